"""Chapter 7's records, checked here so that the chapter only reads them.

The chapter states that the pilot and the pre-registered run are what their script says they
are: one row per seed in every measure, the copying models trained for ``copy_steps``, the family
stored before the first model trained, fresh seeds with their own trial windows, the stored
decisions the chapter's own paired intervals, and SmolLM2's record the whole grid of rules and
lengths it reads. Each of those checks lives here, not in a reader cell.
"""

from __future__ import annotations

import functools
import json
import math
import re
from datetime import datetime
from pathlib import Path

from tutorial_pkg.experiments.retrieval import copy_distances
from tutorial_pkg.experiments.stats import paired_differences, t_interval, t_quantile, verdict

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


# The chapter's prose states numbers read from these records in plain Markdown; the tests below
# compute each from the records and check that the prose says it (Markdown wraps anywhere, so
# the prose is compared with its whitespace collapsed).
CHAPTER = DATA.parent / "07_extrapolation.ipynb"
T = PILOT["fixed_targets"][0]["target_len"]
TOP = max(PILOT["config"]["eval_multiples"])
NEAR = min(r["distance"] for r in PILOT["retrieval"])
FAR = max(r["distance"] for r in PILOT["retrieval"])
CLAIMS = {c["claim"]: c for c in PRE["claims"]}
ORIG = SMOL["original_max_position_embeddings"]


def _cell(cell_id):
    return next(c for c in json.loads(CHAPTER.read_text())["cells"] if c.get("id") == cell_id)


def _prose(cell_id):
    cell = _cell(cell_id)
    assert cell["cell_type"] == "markdown", cell_id
    return " ".join("".join(cell["source"]).split())


def _printed(cell_id):
    return "".join("".join(o["text"]) for o in _cell(cell_id).get("outputs", [])
                   if o.get("output_type") == "stream")


def _says(cell_id, *wanted):
    text = _prose(cell_id)
    missing = [w for w in wanted if w not in text]
    assert not missing, (cell_id, missing)


@functools.cache
def _family():
    pairs = {c["claim"]: (_values(c["a"]), _values(c["b"])) for c in PRE["claims"]}
    return pairs, paired_differences(pairs, family=True), paired_differences(pairs, family=False)


def _mean(values):
    return sum(values) / len(values)


@functools.cache
def _copy():
    # what the copy-test prose reads: seeds above zero, loss gains, copy density, windows tested
    pairs, family, each = _family()
    long_name = f"copy test, rope+copy+8L at d = {NEAR}: copies"
    far_name = next(n for n in CLAIMS if n.startswith(f"copy test, rope+copy at d = {FAR}"))
    up = {n: sum(a > b for a, b in zip(*pairs[n], strict=True)) for n in (long_name, far_name)}

    def acc(records, d):
        return t_interval([a - b for a, b in zip(
            _per_seed(records, "rope+copy", "acc_copy", distance=d),
            _per_seed(records, "rope+copy", "acc_control", distance=d), strict=True)])

    tested = {(d, r["window_len"]): acc(recs, d) for recs in (PRE["retrieval"],
                                                              PRE["retrieval_fixed_window"])
              for d in copy_distances(L, T)
              for r in recs if r["encoding"] == "rope+copy" and r["distance"] == d}
    long = PRE["long_control"]
    return {
        "pairs": pairs, "family": family, "each": each, "long": long_name, "far": far_name,
        "up": up, "tested": tested,
        "gain": {v: _mean(_per_seed(PRE["retrieval"], v, "gain", distance=NEAR))
                 for v in ("rope+copy", "rope+copy+8L")},
        "density": (T / L, T / (long["train_len_multiple"] * L)),
        "copied": (PRE["copy_steps"] * PRE["config"]["batch_size"] * T,
                   long["steps"] * long["batch_size"] * T),
    }


def test_the_copy_prose_states_what_the_records_hold():
    f = _copy()
    assert f["up"] == {f["long"]: 5, f["far"]: 5} and len(PRE["seeds"]) == 5
    assert all(f["each"][n]["low"] > 0 for n in (f["long"], f["far"]))
    margin = CLAIMS[f"copy test, rope at d = {NEAR}: copy - control within 0.05"]["margin"]
    assert margin == CLAIMS[f["far"]]["margin"] == 0.05
    inside = {k: r for k, r in f["tested"].items() if k[1] <= L}
    beyond = {k: r for k, r in f["tested"].items() if k[1] > L}
    ((d_in, w_in), fit), = inside.items()
    assert fit["low"] > 0 and all(r["high"] < 0.1 * fit["low"] for r in beyond.values())
    at_end = f["tested"][NEAR, TOP * L]
    past = sorted(d for d, w in beyond if w == d + T)
    dense, sparse = f["density"]
    _says("2be8c219",
          f"a segment {NEAR} bytes back", f"margin of ±{margin}", "above zero on 5 of the 5",
          f"loss gain is {f['gain']['rope+copy+8L']:.2f} nats per byte where it was "
          f"{f['gain']['rope+copy']:.2f}",
          f"one copy of {T} bytes", f"copies were {sparse:.1%} of a window's targets instead of "
          f"{dense:.0%}".replace("%", " %"), f"{dense / sparse:.0f} times sparser",
          f"({f['copied'][1]:,} copied bytes in all its training, against {f['copied'][0]:,})",
          f"at $d = {FAR}$ lies within ±{margin}", "on 5 of 5 seeds",
          f"every window {TOP * L} bytes", f"($d = {d_in}$, {w_in} bytes)",
          f"In each of the {len(beyond)} other tested windows",
          f"at $d = {', '.join(map(str, past))}$, and in windows of {TOP * L}",
          f"with {TOP * L - NEAR - T} bytes of filler",
          f"it gains {at_end['mean']:+.3f} in accuracy, "
          f"against {f['tested'][NEAR, NEAR + T]['mean']:+.3f}")
    assert (d_in, w_in) == (NEAR, NEAR + T) and at_end["high"] < 0.1 * fit["low"]


def _smol():
    nll = {(r["rule"], r["length"]): r["nll_by_block"] for r in SMOL["results"]}
    own = nll["none", ORIG]

    def ratio(rule, n):
        r = t_interval([a - b for a, b in zip(nll[rule, n], own, strict=True)])
        return {k: math.exp(r[k]) for k in ("mean", "low", "high")}

    return nll, ratio


def _ratio_txt(r):
    return f"x{r['mean']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"


def test_the_smollm2_prose_states_what_its_record_holds():
    nll, ratio = _smol()
    blocks = len(SMOL["block_ends"])
    pi_claim = next(d for d in SMOL["decided"] if d["claim"] == "PI recovers at 2x")
    _, family, _ = _family()
    toy_pi = family["at 2L: RoPE + linear worse than RoPE"]
    toy_rope_2l = math.exp(_mean([a - b for a, b in zip(
        _per_seed(PRE["fixed_targets"], "rope", "nll", ratio=2, scaling="none"),
        _per_seed(PRE["fixed_targets"], "rope", "nll", ratio=1, scaling="none"), strict=True)]))
    none_2x = ratio("none", 2 * ORIG)
    assert toy_pi["low"] > 0 and pi_claim["high"] < 0  # the two directions the prose contrasts
    assert none_2x["mean"] > 10 * toy_rope_2l
    span = max(math.exp(t_interval(v)["high"] - t_interval(v)["low"]) for v in nll.values())
    fit = SMOL["n_tokens"] // (2 * ORIG + 1)  # non-overlapping windows of the longest length
    t_b, t_16 = t_quantile(0.975, blocks - 1), t_quantile(0.975, 15)
    assert blocks < 16 and fit < 16 and t_b > 1.4 * t_16
    names = {"ntk": "NTK-aware", "yarn": "YaRN", "dynamic": "dynamic NTK"}
    _says("d79e20ed",
          f"past its {ORIG:,} positions", f"perplexity is {_ratio_txt(none_2x)} the model's own",
          f"NLL {-pi_claim['difference']:.2f} nats per token below",
          f"a perplexity x{math.exp(pi_claim['difference']):.2f} as large",
          f"over the {blocks} blocks ({blocks - 1} degrees of freedom",
          *(f"{names[r]} {_ratio_txt(ratio(r, 2 * ORIG))}" for r in names),
          f"against PI's {_ratio_txt(ratio('linear', 2 * ORIG))}",
          f"PI is {_ratio_txt(ratio('linear', ORIG))}",
          f"x{math.exp(toy_pi['mean']):.2f} on the fresh seeds",
          f"(x{toy_rope_2l:.2f} its perplexity",
          f"is x{none_2x['mean']:.1f} its own perplexity at {ORIG:,}",
          f"{blocks} evaluation blocks of {SMOL['targets']} target tokens",
          f"a $t$ quantile of {t_b:.2f} (with 16 blocks it would be {t_16:.2f})",
          f"spans a factor of about {span:.0f}", f"ratio at {2 * ORIG:,}",
          f"only {fit} non-overlapping windows of {2 * ORIG + 1:,} tokens")


def test_the_summary_states_what_the_records_hold():
    _, ratio = _smol()
    near = [ratio(r, 2 * ORIG) for r in ("ntk", "yarn", "dynamic")]
    assert ratio("linear", ORIG)["low"] > 2  # "more than twice above it inside"
    f = _copy()
    beyond = [k for k in f["tested"] if k[1] > L]
    alibi_name = next(n for n in CLAIMS if n.startswith("ALiBi: 8L within"))
    alibi = f["family"][alibi_name]
    margin = CLAIMS[alibi_name]["margin"]
    assert alibi["low"] > 0 and abs(math.expm1(alibi["mean"])) < math.expm1(margin)
    article_alibi = 21.3 / 13.1  # article 002's ALiBi row at 2048 and at 256 tokens (cell ch07-04)
    assert '"ALiBi": (13.1, 14.5, 16.8, 21.3)' in "".join(_cell("ch07-04")["source"])
    assert SMOL["model"].startswith("SmolLM2-135M-Instruct,")  # the summary names it exactly
    _says("6f8f5412", "SmolLM2-135M-Instruct (4-bit weights,",
          f"{len(SMOL['block_ends'])} blocks of one text", f"`max_position_embeddings` of {ORIG:,}",
          f"between x{min(r['low'] for r in near):.2f} and x{max(r['high'] for r in near):.2f}",
          f"PI stays {ratio('linear', 2 * ORIG)['mean']:.1f} times above it",
          f"more than twice above it inside {ORIG:,}",
          f"({len(beyond)} windows), with {TOP * L - NEAR - T} bytes of filler even at "
          f"$d = {NEAR}$",
          f"at $d = {NEAR}$ on 5 of 5 fresh seeds",
          f"(x{article_alibi:.2f} per token from 256 to 2048 tokens)",
          f"changes by {math.expm1(alibi['mean']):+.2%} on fixed targets",
          f"from {math.expm1(alibi['low']):+.4%} to {math.expm1(alibi['high']):+.2%}")


def test_the_limits_section_states_the_records_sizes():
    f = _copy()
    dense, sparse = f["density"]
    n_blocks = {r["n_blocks"] for r in PILOT["fixed_targets"] + PRE["fixed_targets"]}
    assert PRE["config"] == PILOT["config"] and len(n_blocks) == 1  # the same blocks, both runs
    source = "".join(_cell("30dfe918")["source"])
    n_att = int(re.search(r"N_ATT, Q0 = (\d+), \d+", source).group(1))
    _says("ch07-limits",
          f"on the pilot's {n_blocks.pop()} evaluation blocks", f"$d = {NEAR}$",
          f"one copy of {T} bytes in each window of {TOP * L}",
          f"copies {sparse:.1%} of its targets against {dense:.0%} at $L$".replace("%", " %"),
          f"({dense / sparse:.0f} times sparser; {f['copied'][1]:,} copied bytes against "
          f"{f['copied'][0]:,})", f"inside the windows of {TOP * L} bytes",
          f"{len(SMOL['block_ends'])} blocks of one text", f"*use* {2 * ORIG:,}",
          f"grew past {ORIG:,} tokens", f"one forward pass over {n_att} tokens")
    assert len(PRE["seeds"]) == 5  # "five fresh seeds"


def test_the_block_noise_of_a_comparison_reads_as_the_chapter_prints_it():
    # the noise section prints RoPE - ALiBi at L's width ratio, blocks over seeds; the text and
    # exercise 5 read it as "about three times"
    ratio = float(re.search(r"the block interval (\d+\.\d+) times as wide",
                            _printed("ch07-27")).group(1))
    assert 2.5 < ratio < 3.5
    _says("ch07-28", "about three times as wide as the paired interval")
    _says("ch07-75", "about three times as wide")


def test_the_pilots_copying_models_show_the_test_sees_copying_past_l():
    # the copy-test prose, the limits and the summary read the pilot's ALiBi and NoPE copying
    # models as copying past L (exploratory): recompute their per-seed gains from the record
    ret = PILOT["retrieval"]
    # one shared trial draw: the pilot's rows carry no trial seed, and the script gave them seed 0
    assert not any("trial_seed" in r for r in ret)
    script = (DATA.parents[1] / "benchmarks" / "extrapolation_seeds.py").read_text()
    assert "trial_seed = TRIAL_SEED_BASE + seed if args.preregistered else 0" in script

    def acc(v, d):
        return [a - b for a, b in zip(_per_seed(ret, v, "acc_copy", distance=d),
                                      _per_seed(ret, v, "acc_control", distance=d), strict=True)]

    distances = copy_distances(L, T)
    assert 2 * L in distances and FAR == distances[-1] == 496
    seeds = len(PILOT["seeds"])
    text = []
    for v, name in (("alibi+copy", "ALiBi"), ("nope+copy", "NoPE")):
        at_2l = acc(v, 2 * L)
        assert sum(x > 0 for x in at_2l) == seeds == 5  # "above zero on 5 of 5 seeds"
        text.append(f"{min(at_2l):+.3f} to {max(at_2l):+.3f} ({name})")
        for d in distances:  # loss gains above zero on every seed at every tested distance
            assert all(g > 0 for g in _per_seed(ret, v, "gain", distance=d)), (v, d)
        loss = [_mean(_per_seed(ret, v, "gain", distance=d)) for d in distances]
        assert loss == sorted(loss, reverse=True)  # "shrinking with distance"
        means = [_mean(acc(v, d)) for d in distances]
        assert min(means) == means[-1]  # the accuracy gain is smallest at d = 496
    # the hybrid copying model, like RoPE's, loses the copy past L
    inside = t_interval(acc("hybrid+copy", NEAR))
    for d in distances[1:]:
        r = t_interval(acc("hybrid+copy", d))
        assert r["low"] < 0 < r["high"] and r["high"] < 0.1 * inside["low"], d
    # the pre-registered control past L: four claims, none resolved
    long = [d for d in PRE["decided"] if d["claim"].startswith("copy test, rope+copy+8L at")]
    assert len(long) == 4 and {d["verdict"] for d in long} == {"not resolved"}
    _says("2be8c219", "resolves nothing", "none of its four claims is resolved",
          f"at $d = 2L$ their accuracy gains are {text[0]} and {text[1]}",
          "above zero on 5 of 5 seeds", f"every tested distance up to $d = {FAR}$",
          "one draw of trial windows shared by its seeds, not pre-registered")
    _says("ch07-limits", "resolves no claim", "only the pilot's ALiBi and NoPE copying models",
          "one shared draw of trial windows, not pre-registered", f"towards $d = {FAR}$")
    _says("6f8f5412", "resolves no pre-registered claim",
          "copy at $2L$ (accuracy gain above zero on 5 of 5 seeds)")
    for cell_id in ("2be8c219", "ch07-limits", "6f8f5412"):
        text_of = _prose(cell_id)
        assert "only inside $L$" not in text_of and "no working control" not in text_of
