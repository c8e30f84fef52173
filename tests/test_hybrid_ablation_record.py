"""book/data/hybrid_ablation.json (benchmarks/hybrid_ablation.py): chapter 6's alpha sweep and
single-factor controls. The record has the promised form, its family was committed before the
run started, it is paired per seed with book/data/hybrid_results.json, and its decisions
recompute from its stored values."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

import benchmarks.hybrid_ablation as abl
from tests.decisions import assert_same_decisions

ROOT = Path(__file__).resolve().parents[1]
REC = json.loads((ROOT / abl.OUT).read_text())
STORED = json.loads((ROOT / abl.STORED).read_text())
LENS = abl.ch6.TASK_EVAL_LENS


def test_the_family_is_the_scripts_and_small():
    assert REC["claims"] == [dict(c) for c in abl.CLAIMS]
    assert REC["alpha"] == abl.ALPHA == abl.ch6.CH6_ALPHA and REC["test"] == abl.ch6.CH6_TEST
    names = [c["claim"] for c in REC["claims"]]
    assert len(names) == len(set(names)) <= 8
    known = set(abl.VARIANTS) | set(REC["stored"]["variants"])
    for c in REC["claims"]:
        assert c["test"] in ("greater", "less", "equivalent")
        for ref in (c["a"], c["b"]):
            assert ref["task"] in abl.TASKS and ref["encoding"] in known and ref["length"] in LENS
    assert set(REC["monotone_claims"]) <= set(names)


def test_the_record_has_every_value_and_the_run_settings():
    assert REC["status"] == "done"
    assert REC["seeds"] == STORED["seeds"] == list(range(5, 25))
    for key in ("train_len", "eval_lens", "steps", "test_seed_base"):
        assert REC[key] == STORED[key], key
    cells = {(r["seed"], r["task"], r["encoding"]) for r in REC["records"]}
    assert cells == {(s, t, v) for s in REC["seeds"] for t in abl.TASKS for v in abl.VARIANTS}
    assert len(cells) == len(REC["records"])
    for r in REC["records"]:
        assert all(0 <= r[f"acc_{n}"] <= 1 and r[f"se_{n}"] >= 0 for n in LENS)
    assert REC["run_time_s"] > 0 and REC["hardware"]["num_threads"] == 1
    assert REC["command"].startswith("python benchmarks/hybrid_ablation.py")


def test_the_stored_variants_are_the_chapter_records_values():
    # the pairing: the stored variants enter the claims with the values of hybrid_results.json
    assert REC["stored"]["file"] == abl.STORED and REC["stored"]["commit"] == STORED["commit"]
    want = {(r["seed"], r["task"], r["encoding"]): r for r in STORED["records"]
            if r["encoding"] in REC["stored"]["variants"]}
    got = {(r["seed"], r["task"], r["encoding"]): r for r in REC["stored_records"]}
    assert set(got) == set(want)
    for key, r in got.items():
        assert all(r[f"acc_{n}"] == want[key][f"acc_{n}"] for n in LENS)


def test_the_controls_reproduce_the_mix_and_alpha_one_is_rope():
    checks = REC["check"]
    assert {(c["check"], c["task"]) for c in checks} == {
        (n, t) for n in ("init+lr vs seed_alpha", "alpha_1.0 vs rope") for t in abl.TASKS}
    assert all(c["within"] and c["max_abs_diff"] <= REC["check_tolerance"] for c in checks)


def _git(*args):
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout


def test_the_claims_were_committed_before_the_run():
    assert datetime.fromisoformat(REC["claims_written"]) < datetime.fromisoformat(REC["started"])
    try:
        before = json.loads(_git("show", f"{REC['claims_commit']}:{abl.OUT}"))
        _git("merge-base", "--is-ancestor", REC["claims_commit"], REC["commit"])
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the claims' commit is not in this clone (shallow?)")
    assert before["status"] == "claims" and "records" not in before
    assert before["claims"] == REC["claims"] and before["alpha"] == REC["alpha"]
    assert before["claims_written"] == REC["claims_written"]
    assert before["monotone_claims"] == REC["monotone_claims"]


def test_the_decisions_recompute_from_the_stored_values():
    decided, monotone = abl.decide(REC)
    assert monotone == REC["monotone"]
    assert_same_decisions(decided, REC)
