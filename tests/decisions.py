"""One check shared by the record tests: decisions recomputed equal the stored ones."""

from __future__ import annotations

import pytest


def assert_same_decisions(decided: list, record: dict) -> None:
    """``decided`` (recomputed) names the record's claims in order, with its verdicts and
    its numbers to 1e-12."""
    assert [d["claim"] for d in decided] == [c["claim"] for c in record["claims"]]
    for new, old in zip(decided, record["decided"], strict=True):
        assert new["verdict"] == old["verdict"]
        for key in ("mean", "low", "high", "p_value", "confidence"):
            assert new[key] == pytest.approx(old[key], abs=1e-12), (new["claim"], key)
