"""book/data/hybrid_replication.json (benchmarks/hybrid_replication.py): chapter 6's replication
on fresh seeds. The record holds the script's family, committed before the run started; its seeds
are used by no earlier record; it has every model's values; its pre-run check held; and its
decisions recompute from its stored values."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import benchmarks.hybrid_ablation as abl
import benchmarks.hybrid_replication as rep
from tests.decisions import assert_same_decisions, committed_before_run

ROOT = Path(__file__).resolve().parents[1]
REC = json.loads((ROOT / rep.OUT).read_text())
MAIN = json.loads((ROOT / "book" / "data" / "hybrid_results.json").read_text())
PILOT = json.loads((ROOT / "book" / "data" / "hybrid_pilot.json").read_text())
ABL = json.loads((ROOT / abl.OUT).read_text())
LENS = rep.ch6.TASK_EVAL_LENS


def _git(*args):
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout


def test_the_family_is_the_scripts():
    assert REC["claims"] == [dict(c) for c in rep.CLAIMS]
    assert REC["alpha"] == rep.ALPHA == rep.ch6.CH6_ALPHA and REC["test"] == rep.ch6.CH6_TEST
    assert REC["monotone_claims"] == abl.MONOTONE
    names = [c["claim"] for c in REC["claims"]]
    assert len(names) == len(set(names))
    # the replication part is the ablation's family, word for word
    assert [c for c in REC["claims"] if c["part"] == "replication"] == [
        {**c, "part": "replication"} for c in ABL["claims"]]
    for c in REC["claims"]:
        for ref in (c["a"], c["b"]):
            assert ref["encoding"] in rep.VARIANTS and ref["task"] in ("offset", "latest")


def test_the_claims_were_committed_before_the_run_started():
    committed_before_run(REC, rep.OUT, ROOT, keys=("claims", "alpha"))
    try:
        history = _git("log", "--format=%H", REC["commit"], "--", rep.OUT).split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the record's history is not in this clone (shallow?)")
    assert REC["claims_commit"] in history  # the commit that last wrote the record before the run


def test_the_seeds_are_fresh():
    fresh = set(REC["seeds"])
    assert REC["seeds"] == rep.SEEDS
    assert not fresh & set(MAIN["seeds"]) and not fresh & set(ABL["seeds"])
    assert not fresh & set(PILOT["seeds"]) and not fresh & set(MAIN["pilot"]["seeds"])


def test_the_record_has_every_model_and_the_run_settings():
    cells = {(r["seed"], r["task"], r["encoding"]) for r in REC["records"]}
    assert cells == {(s, t, v) for s in REC["seeds"] for t in ("offset", "latest")
                     for v in rep.VARIANTS}
    assert len(cells) == len(REC["records"])
    for r in REC["records"]:
        assert all(0 <= r[f"acc_{n}"] <= 1 and r[f"se_{n}"] >= 0 for n in LENS)
        assert all(0 <= r[f"acc_past_{n}"] <= 1 for n in REC["past_lens"])
    assert REC["past_lens"] == [n for n in LENS if n > REC["train_len"]]
    for key in ("train_len", "eval_lens", "steps", "test_seed_base"):
        assert REC[key] == MAIN[key], key
    assert REC["hardware"]["num_threads"] == 1 and REC["run_time_s"] > 0


def test_the_pre_run_check_held():
    assert {(c["check"], c["task"]) for c in REC["check"]} == {
        ("init+lr vs seed_alpha", t) for t in ("offset", "latest")}
    assert all(c["within"] and c["max_abs_diff"] <= REC["check_tolerance"] == rep.CHECK_TOL
               for c in REC["check"])


def test_the_decisions_recompute_from_the_stored_values():
    decided, monotone = rep.decide(REC)
    assert monotone == REC["monotone"]
    assert_same_decisions(decided, REC)
