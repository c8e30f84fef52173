"""book/data/smollm2_yarn_factor.json, the record chapter 9's bug 12 reads.

It must be what ``benchmarks/smollm2_yarn_factor.py`` writes: the claims of the script (fixed
before the run), verdicts that its own decision rule gives from the per-block numbers, every
variant at every length, each variant's rule as the script builds it, and the blocks and
targets of chapter 7's record (``smollm2_context.json``), whose unscaled model the chapter
shows beside it and whose YaRN numbers the same configured rule reproduces exactly.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.smollm2_context import decide_claims  # noqa: E402
from benchmarks.smollm2_yarn_factor import ALPHA, CLAIMS, VARIANTS, rule_dict  # noqa: E402

RECORD = json.loads((ROOT / "book/data/smollm2_yarn_factor.json").read_text())
CONTEXT = json.loads((ROOT / "book/data/smollm2_context.json").read_text())


def test_the_record_holds_the_scripts_claims_and_their_verdicts():
    assert RECORD["status"] == "done" and RECORD["alpha"] == ALPHA
    assert [tuple(c.values()) for c in RECORD["claims"]] == [tuple(c) for c in CLAIMS]
    assert RECORD["decided"] == decide_claims(RECORD["results"], CLAIMS, ALPHA)
    assert all(d["verdict"] in ("holds", "refuted", "not resolved") for d in RECORD["decided"])


def test_every_variant_is_measured_at_every_length_on_chapter_7s_blocks():
    grid = {(r["rule"], r["length"]) for r in RECORD["results"]}
    lengths = {n for _, n in grid}
    assert grid == {(v, n) for v in VARIANTS for n in lengths} and max(lengths) == 16384
    assert all(len(r["nll_by_block"]) == len(RECORD["block_ends"])
               and all(math.isfinite(x) and x > 0 for x in r["nll_by_block"])
               for r in RECORD["results"])
    assert RECORD["rules"] == {v: rule_dict(v, RECORD["factor"],
                                            RECORD["original_max_position_embeddings"])
                               for v in VARIANTS}
    assert RECORD["block_ends"] == CONTEXT["block_ends"]
    assert RECORD["targets"] == CONTEXT["targets"]


def test_the_configured_rule_reproduces_chapter_7s_yarn_numbers():
    mine = {r["length"]: r["nll_by_block"] for r in RECORD["results"] if r["rule"] == "yarn"}
    theirs = {r["length"]: r["nll_by_block"] for r in CONTEXT["results"] if r["rule"] == "yarn"}
    for n, values in mine.items():
        if n in theirs:
            assert all(abs(a - b) < 2e-3 for a, b in zip(values, theirs[n], strict=True)), n
