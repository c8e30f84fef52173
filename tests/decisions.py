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


def committed_before_run(record: dict, path: str, root, keys=("claims",)) -> dict:
    """Assert that ``record`` (stored at ``path`` in the repository at ``root``) was run from
    the commit that holds its claims, committed before the run started, with the header as
    the script wrote it (status "claims", no records, the same ``keys`` and claim time).
    Returns the committed header; skips where the clone lacks the claims' commit."""
    import json
    import subprocess
    from datetime import datetime

    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=root).stdout

    assert record["status"] == "done"
    started = datetime.fromisoformat(record["started"])
    assert datetime.fromisoformat(record["claims_written"]) < started
    try:
        before = json.loads(git("show", f"{record['claims_commit']}:{path}"))
        committed = datetime.fromisoformat(
            git("log", "-1", "--format=%cI", record["claims_commit"]).strip())
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the claims' commit is not in this clone (shallow?)")
    assert committed < started
    assert record["commit"] == record["claims_commit"]  # run from the commit with the family
    assert before["status"] == "claims" and "records" not in before
    assert all(before[k] == record[k] for k in keys)
    assert before["claims_written"] == record["claims_written"]
    return before
