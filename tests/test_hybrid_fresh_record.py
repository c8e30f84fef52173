"""book/data/hybrid_fresh.json (benchmarks/hybrid_fresh.py): chapter 6's mix-versus-control
equivalence and learned-slope counts on seeds 45-64. The record holds the script's family,
committed before the run started; its seeds are used by no earlier record of chapter 6; it has
every model; and its decisions recompute from its stored values."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import benchmarks.ch6_learned_slopes as slopes
import benchmarks.hybrid_fresh as fresh
from tests.decisions import assert_same_decisions, committed_before_run

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "book" / "data"
REC = json.loads((ROOT / fresh.OUT).read_text())


def _git(*args):
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout


def test_the_family_is_the_scripts_and_quotes_the_earlier_claims_verbatim():
    assert REC["claims"] == [dict(c) for c in fresh.CLAIMS]
    assert REC["alpha"] == fresh.ALPHA
    main = json.loads((DATA / "hybrid_results.json").read_text())
    equivalences = [c for c in main["claims"] if c["test"] == "equivalent"]
    assert len(equivalences) == 2
    assert [{k: v for k, v in c.items() if k != "part"} for c in REC["claims"]
            if c["part"] == "equivalence"] == equivalences
    learned = json.loads((DATA / "ch6_learned_slopes.json").read_text())
    assert [{k: v for k, v in c.items() if k != "part"} for c in REC["claims"]
            if c["part"] == "slopes"] == learned["claims"]


def test_the_claims_were_committed_before_the_run_started():
    committed_before_run(REC, fresh.OUT, ROOT)


def test_the_seeds_are_used_by_no_earlier_record_of_chapter_6():
    seen = set()
    for name in ("hybrid_pilot", "hybrid_results", "hybrid_ablation", "hybrid_replication",
                 "ch6_learned_slopes"):
        seen |= set(json.loads((DATA / f"{name}.json").read_text())["seeds"])
    assert REC["seeds"] == fresh.SEEDS and not set(REC["seeds"]) & seen


def test_the_record_has_every_model():
    cells = [(r["seed"], r["task"], r["encoding"]) for r in REC["records"]]
    assert sorted(cells) == sorted((s, t, v) for s in REC["seeds"] for t in ("offset", "latest")
                                   for v in fresh.VARIANTS)
    for r in REC["records"]:
        assert all(0 <= r[f"acc_{n}"] <= 1 for n in REC["eval_lens"])
        assert ("c_h" in r) == (r["encoding"] == "hybrid_learnable")


def test_the_decisions_recompute_from_the_stored_values():
    decided = fresh.decide(REC)
    tested = [d for d in decided if "mean" in d]
    assert_same_decisions(tested, {"claims": [c for c in REC["claims"]
                                              if c["part"] == "equivalence"],
                                   "decided": REC["decided"][:len(tested)]})
    assert decided[len(tested):] == REC["decided"][len(tested):]
    assert [d["claim"] for d in decided] == [c["claim"] for c in REC["claims"]]
    assert slopes.MIN_SEEDS == 18
