"""Chapter 7's pre-registered record: benchmarks/extrapolation_seeds.py --preregistered."""

from __future__ import annotations

import json

import pytest

import benchmarks.extrapolation_seeds as seeds

MEASURES = {"fixed_targets", "all_tokens", "retrieval", "attention_distance"}


def test_the_family_is_well_formed():
    names = [c["claim"] for c in seeds.CH7_CLAIMS]
    assert len(names) == len(set(names)) == 29
    for c in seeds.CH7_CLAIMS:
        assert c["test"] in ("greater", "less", "equivalent")
        assert ("margin" in c) == (c["test"] == "equivalent")
        for ref in (c["a"], c["b"]):
            assert ref["measure"] in MEASURES and ref["field"]
    # the variants the family names are the ones the run trains
    named = {ref["encoding"] for c in seeds.CH7_CLAIMS for ref in (c["a"], c["b"])}
    assert named <= {*seeds.CH7_ENCODINGS, "rope+copy", "rope+copy+8L"}
    assert not set(seeds.CH7_SEEDS) & set(seeds.CH7_PILOT["seeds"])


def test_the_family_is_stored_before_training_and_decided_at_the_merge(tmp_path, monkeypatch):
    claims, part = tmp_path / "claims.json", tmp_path / "p0.json"
    real, seen = seeds.train, []

    def spy(*args, **kwargs):
        if not seen:
            seen.append(json.loads(part.read_text()))
        return real(*args, **kwargs)

    monkeypatch.setattr(seeds, "train", spy)
    common = ["--preregistered", "--quick"]
    seeds.main([*common, "--claims-only", "--out", str(claims)])
    stored = json.loads(claims.read_text())
    assert stored["status"] == "running" and stored["claims"] == seeds.family(
        type("A", (), {"quick": True})())
    seeds.main([*common, "--seeds", "0", "--out", str(part), "--threads", "1"])
    first = seen[0]  # the part, when its first model started training
    assert first["status"] == "running" and first["claims"] == stored["claims"]
    assert "records" not in first
    done = json.loads(part.read_text())
    assert {r["trial_seed"] for r in done["retrieval"]} == {seeds.TRIAL_SEED_BASE}
    assert {r["window_len"] for r in done["retrieval_fixed_window"]} == {8 * 16}
    assert "rope+copy+8L" in {r["encoding"] for r in done["retrieval"]}
    # the merge refuses a file that does not hold the family, and decides it when it does
    with pytest.raises(SystemExit, match="family"):
        seeds.main([*common, "--merge", str(part), "--out", str(tmp_path / "none.json")])
    with pytest.raises(ValueError):  # one seed: no interval (needs two)
        seeds.main([*common, "--merge", str(part), "--out", str(claims)])
