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


def test_the_records_chapter_1_reads_are_consistent():
    """Chapter 1 reads the pilot and the pre-registered record side by side: the same setup on
    disjoint seeds, the family stored before training, the two claims it quotes stored as the
    comparisons it describes, and their decided means the chapter's own per-seed rises."""
    from datetime import datetime
    from pathlib import Path
    from statistics import fmean

    data = Path(__file__).resolve().parents[1] / "book" / "data"
    pilot = json.loads((data / "extrapolation_results.json").read_text())
    pre = json.loads((data / "extrapolation_preregistered.json").read_text())
    assert pre["config"] == pilot["config"]
    assert not set(pre["seeds"]) & set(pilot["seeds"])
    written = datetime.fromisoformat(pre["claims_written"])
    assert written < datetime.fromisoformat(pre["started"])

    def per_seed(rec, encoding, ratio):
        rows = sorted((r for r in rec["fixed_targets"] if r["encoding"] == encoding
                       and r["ratio"] == ratio and r["scaling"] == "none"),
                      key=lambda r: r["seed"])
        assert [r["seed"] for r in rows] == sorted(rec["seeds"])  # one row per seed
        return [r["nll"] for r in rows]

    for rec in (pilot, pre):
        for encoding in ("sinusoidal_scaled", "nope"):
            for ratio in (1, 2, 4, 8):
                per_seed(rec, encoding, ratio)

    claims = {c["claim"]: c for c in pre["claims"]}
    decided = {c["claim"]: c for c in pre["decided"]}
    for name, encoding, ratio in (("scaled sinusoidal: 2L worse than L", "sinusoidal_scaled", 2),
                                  ("NoPE: 8L worse than L", "nope", 8)):
        a, b = claims[name]["a"], claims[name]["b"]
        assert (a["encoding"], a["ratio"], b["encoding"], b["ratio"]) == (
            encoding, ratio, encoding, 1)
        assert a["measure"] == b["measure"] == "fixed_targets"
        assert a["field"] == b["field"] == "nll" and a["scaling"] == b["scaling"] == "none"
        assert claims[name]["test"] == "greater"
        rises = [hi - lo for hi, lo in zip(per_seed(pre, encoding, ratio),
                                           per_seed(pre, encoding, 1), strict=True)]
        assert abs(decided[name]["mean"] - fmean(rises)) < 1e-9


def _records():
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "book" / "data"
    return (json.loads((data / "extrapolation_results.json").read_text()),
            json.loads((data / "extrapolation_preregistered.json").read_text()),
            data)


def test_the_stored_family_is_the_scripts_and_its_decisions_follow_from_the_record():
    """What chapter 7 reads as the family: the script's claims, decided as the script decides."""
    pilot, pre, _ = _records()
    assert pre["claims"] == json.loads(json.dumps(list(seeds.CH7_CLAIMS)))
    assert pre["decided"] == seeds.decide_ch7(pre)
    # the fresh seeds scored the pilot's blocks: the same configuration, block count and size
    assert pre["config"] == pilot["config"]
    assert {(r["target_len"], r["n_blocks"]) for r in pre["fixed_targets"]} == {
        (r["target_len"], r["n_blocks"]) for r in pilot["fixed_targets"]}


def test_the_smollm2_record_holds_the_scripts_claims_and_their_decisions():
    """Chapter 7 reads smollm2_context.json's stored decisions; they are the script's."""
    from benchmarks.smollm2_context import CLAIMS, decide_claims

    *_, data = _records()
    smol = json.loads((data / "smollm2_context.json").read_text())
    assert [c["claim"] for c in smol["claims"]] == [c[0] for c in CLAIMS]
    assert smol["decided"] == decide_claims(smol["results"])  # recomputed from the blocks


def test_the_records_chapter_1_tabulates_score_one_set_of_blocks():
    """Chapter 1's hidden helper reads chapter 7's two records without checking their shape:
    one row per seed for each model and length it reads, every row scored on one fixed set of
    held-out blocks, and at 2L every scored byte past L."""
    pilot, pre, _ = _records()
    assert len(pre["seeds"]) == len(pilot["seeds"])
    for rec in (pilot, pre):
        for encoding in ("sinusoidal_scaled", "nope"):
            for ratio in (1, 2, 4, 8):
                rows = [r for r in rec["fixed_targets"] if r["encoding"] == encoding
                        and r["ratio"] == ratio and r["scaling"] == "none"]
                assert sorted(r["seed"] for r in rows) == sorted(rec["seeds"])
    blocks = {(r["n_blocks"], r["n_tokens"]) for rec in (pilot, pre) for r in rec["fixed_targets"]}
    assert len(blocks) == 1
    at_2l = [r for rec in (pilot, pre) for r in rec["fixed_targets"] if r["ratio"] == 2]
    assert all(r["context_len"] >= pilot["config"]["train_len"] for r in at_2l)
