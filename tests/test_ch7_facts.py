"""Chapter 7's records, checked here so that the chapter only reads them.

The chapter states that the pilot and the pre-registered run are what their script says they
are: one row per seed in every measure, the copying models trained for ``copy_steps``, the family
stored before the first model trained, fresh seeds with their own trial windows, the stored
decisions the chapter's own paired intervals, and SmolLM2's record the whole grid of rules and
lengths it reads. Each of those checks lives here, not in a reader cell.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from tutorial_pkg.experiments.retrieval import copy_distances
from tutorial_pkg.experiments.stats import paired_differences, verdict

DATA = Path(__file__).resolve().parents[1] / "book" / "data"
PILOT = json.loads((DATA / "extrapolation_results.json").read_text())
PRE = json.loads((DATA / "extrapolation_preregistered.json").read_text())
SMOL = json.loads((DATA / "smollm2_context.json").read_text())
L = PILOT["config"]["train_len"]


def test_the_pilot_has_one_row_per_seed_and_its_copying_models_train_longer():
    seeds = set(PILOT["seeds"])
    assert len(PILOT["seeds"]) == 5  # the chapter's "five seeds"
    for key in ("records", "fixed_targets", "all_tokens", "retrieval", "attention_distance"):
        assert {r["seed"] for r in PILOT[key]} == seeds, key
    copy = {f"{name}+copy" for name in PILOT["copy_encodings"]}
    steps = PILOT["config"]["steps"]
    assert PILOT["copy_steps"] > steps
    for r in PILOT["training"]:
        assert r["steps"] == (PILOT["copy_steps"] if r["encoding"] in copy else steps)
    assert "commit" not in PILOT  # the pilot is pinned by the commit the later record names


def test_the_preregistered_record_stored_its_family_before_training_on_fresh_seeds():
    assert PRE["status"] == "done"
    written = datetime.fromisoformat(PRE["claims_written"])
    assert written < datetime.fromisoformat(PRE["started"])
    assert PRE["pilot"]["seeds"] == PILOT["seeds"] and PRE["pilot"]["commit"]
    assert not set(PRE["seeds"]) & set(PILOT["seeds"])
    assert len(PRE["seeds"]) == len(PILOT["seeds"])
    for key in ("fixed_targets", "all_tokens", "retrieval", "retrieval_fixed_window",
                "attention_distance"):
        assert {r["seed"] for r in PRE[key]} == set(PRE["seeds"]), key


def test_the_copy_test_records_each_seed_with_its_own_trials_in_both_layouts():
    t = PILOT["fixed_targets"][0]["target_len"]
    top = max(PILOT["config"]["eval_multiples"])
    distances = copy_distances(L, t)
    for rec in (PILOT["retrieval"], PRE["retrieval"], PRE["retrieval_fixed_window"]):
        assert tuple(sorted({r["distance"] for r in rec})) == distances
    # each fresh seed drew its own trial windows
    assert sorted({r["trial_seed"] for r in PRE["retrieval"]}) == [
        PRE["trial_seed_base"] + s for s in PRE["seeds"]]
    # windows of d + s in the first layout; every window 8L long in the second
    assert all(r["window_len"] == r["distance"] + r["segment_len"] for r in PRE["retrieval"])
    assert {r["window_len"] for r in PRE["retrieval_fixed_window"]} == {top * L}


def _per_seed(records, variant, field, **match):
    found = {r["seed"]: r[field] for r in records if r["encoding"] == variant
             and all(r.get(k) == v for k, v in match.items())}
    return [found[s] for s in sorted({r["seed"] for r in records})]


def _values(ref):
    match = {k: v for k, v in ref.items() if k not in ("measure", "encoding", "field", "minus")}
    out = _per_seed(PRE[ref["measure"]], ref["encoding"], ref["field"], **match)
    if "minus" in ref:
        out = [x - y for x, y in zip(out, _values(ref["minus"]), strict=True)]
    return out


def test_the_stored_decisions_are_the_chapters_family_wise_intervals():
    pairs = {c["claim"]: (_values(c["a"]), _values(c["b"])) for c in PRE["claims"]}
    family = paired_differences(pairs, family=True)
    assert [d["claim"] for d in PRE["decided"]] == list(pairs)
    for d in PRE["decided"]:
        for bound in ("low", "high"):
            assert abs(family[d["claim"]][bound] - d[bound]) < 1e-9


def test_the_stored_verdicts_are_what_the_family_wise_intervals_decide():
    # the chapter decides each claim from its interval; the script stored the same verdict
    pairs = {c["claim"]: (_values(c["a"]), _values(c["b"])) for c in PRE["claims"]}
    family = paired_differences(pairs, family=True)
    decided = {c["claim"]: verdict(family[c["claim"]], c["test"], c.get("margin"))
               for c in PRE["claims"]}
    assert decided == {d["claim"]: d["verdict"] for d in PRE["decided"]}


def test_the_smollm2_record_holds_the_whole_grid_and_one_decision_per_claim():
    cells = {(r["rule"], r["length"]) for r in SMOL["results"]}
    lengths = {n for _, n in cells}
    assert cells == {(rule, n) for rule in SMOL["rules"] for n in lengths}
    assert len(SMOL["results"]) == len(cells)
    assert all(len(r["nll_by_block"]) == len(SMOL["block_ends"]) for r in SMOL["results"])
    assert [d["claim"] for d in SMOL["decided"]] == [c["claim"] for c in SMOL["claims"]]


def test_the_chapter_prints_every_stored_claim_once_with_its_stored_verdict():
    # claim() prints one line per claim: its name, the family-wise interval, the verdict
    nb = json.loads((DATA.parent / "07_extrapolation.ipynb").read_text())
    lines = [line for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])
             if o.get("output_type") == "stream" for line in "".join(o["text"]).splitlines()]
    for d in PRE["decided"]:
        printed = [line for line in lines
                   if re.match(re.escape(d["claim"]) + r"\s+[+-]\d", line)]
        assert len(printed) == 1, (d["claim"], printed)
        assert f": {d['verdict']}" in printed[0], (d["claim"], printed[0])
