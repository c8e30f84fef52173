"""benchmarks/extrapolation_seeds.py, chapter 6's part: the claim family is written before any
model is trained, each claim names values the run records, and decide_ch6 decides it."""

from __future__ import annotations

import json

import pytest

import benchmarks.extrapolation_seeds as seeds


def test_the_family_is_well_formed():
    names = [c["claim"] for c in seeds.CH6_CLAIMS]
    assert len(names) == len(set(names)) == 29
    for c in seeds.CH6_CLAIMS:
        assert c["test"] in ("greater", "equivalent")
        assert ("margin" in c) == (c["test"] == "equivalent")
        for ref in (c["a"], c["b"]):
            assert ("mechanism" in ref) or (ref["task"] in ("offset", "latest")
                                            and ref["encoding"] in seeds.TASK_VARIANTS
                                            and ref["length"] in seeds.TASK_EVAL_LENS)
    assert not set(seeds.PILOT["seeds"]) & set(seeds.DEFAULT_TASK_SEEDS)  # fresh seeds


def _payload(n_seeds, shift):
    """A run where every 'a' value beats its 'b' by ``shift``, seed by seed (with noise)."""
    seeds_ = list(range(n_seeds))
    recs, mech = [], []
    for s in seeds_:
        for task in ("offset", "latest"):
            for k in seeds.TASK_VARIANTS:
                recs.append({"seed": s, "task": task, "encoding": k,
                             **{f"acc_{n}": 0.5 for n in seeds.TASK_EVAL_LENS}})
        mech.append({"seed": s, **dict.fromkeys(
            ("far_rope", "far_hybrid", "rope_window", "hybrid_window", "no_bias",
             "no_bias_at_L", "bias_cost", "bias_cost_at_L"), 0.5)})
    claims = [{"claim": "x > y", "test": "greater", "a": {"mechanism": "far_rope"},
               "b": {"mechanism": "far_hybrid"}},
              {"claim": "x = y", "test": "equivalent", "margin": 0.05,
               "a": {"task": "latest", "encoding": "seed_alpha", "length": 128},
               "b": {"task": "latest", "encoding": "hybrid_half", "length": 128}}]
    for i, m in enumerate(mech):
        m["far_rope"] += shift + 0.01 * (i % 3)
    return {"seeds": seeds_, "records": recs, "mechanism": mech, "claims": claims,
            "alpha": 0.05}


def test_decide_ch6_holds_refutes_and_says_when_seeds_are_too_few():
    got = {d["claim"]: d for d in seeds.decide_ch6(_payload(12, 0.2))}
    assert got["x > y"]["verdict"] == "holds" and got["x = y"]["verdict"] == "holds"
    assert got["x > y"]["confidence"] == pytest.approx(1 - 0.05 / 2)
    assert got["x > y"]["low"] >= 0.2  # inside the range of the differences
    got = {d["claim"]: d for d in seeds.decide_ch6(_payload(12, -0.2))}
    assert got["x > y"]["verdict"] == "refuted"
    few = seeds.decide_ch6(_payload(3, 0.2))
    assert {d["verdict"] for d in few} == {"not testable"}


def test_the_claims_are_in_the_file_before_the_first_model_trains(tmp_path, monkeypatch):
    out = tmp_path / "h.json"
    real, seen = seeds.train_task, []

    def spy(*args, **kwargs):
        if not seen:
            seen.append(json.loads(out.read_text()))
        return real(*args, **{**kwargs, "steps": 1})

    monkeypatch.setattr(seeds, "train_task", spy)
    seeds.main(["--skip-extrapolation", "--quick", "--task-seeds", "0", "--tasks-out", str(out)])
    first = seen[0]
    assert first["status"] == "running" and "records" not in first
    assert first["claims"] == [dict(c) for c in seeds.CH6_CLAIMS] and first["alpha"] == 0.05
    done = json.loads(out.read_text())
    assert done["status"] == "done" and done["claims"] == first["claims"]
    assert len(done["records"]) == 2 * len(seeds.TASK_VARIANTS) and len(done["mechanism"]) == 1
    assert all(0 <= r["acc_128"] <= 1 and r["se_128"] >= 0 for r in done["records"])
    assert done["decided"] == seeds.decide_ch6(done)
