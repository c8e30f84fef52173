"""The facts chapter 1 states in prose about its dependencies and about the book's own model.

Chapter 1 holds its tables to Hugging Face's M2M100 and Whisper classes, which are those of the
transformers that ``pyproject.toml`` pins; and its checklist says that the book's ``TinyLM``
(chapter 7) initialises its token embeddings at standard deviation 0.02, never multiplies them by
``sqrt(d)``, and adds the sinusoidal table either unscaled (``sinusoidal``) or scaled to the
embeddings' RMS (``sinusoidal_scaled``). These tests keep that prose true.
"""

from __future__ import annotations

import json
import math
import re
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from tutorial_pkg import TinyLM

ROOT = Path(__file__).resolve().parents[1]


def test_installed_transformers_is_the_pinned_one():
    pytest.importorskip("transformers")
    pins = set(re.findall(r'"transformers>=([\d.]+),<([\d.]+)"',
                          (ROOT / "pyproject.toml").read_text()))
    assert len(pins) == 1  # one pin for every extra that names transformers
    ((low, high),) = pins
    def minor(v):
        return tuple(int(x) for x in v.split(".")[:2])

    assert minor(low) <= minor(version("transformers")) < minor(high)


def test_tiny_lm_embeddings_std_0_02_and_not_multiplied_by_sqrt_d():
    d = 256
    model = TinyLM("nope", d_model=d, n_layers=1, seed=0)
    std = model.tok_emb.weight.std().item()
    assert abs(std - 0.02) < 0.001
    seen = {}
    original = model.encoding.embed

    def spy(x, positions):
        seen["x"] = x
        return original(x, positions)

    model.encoding.embed = spy
    ids = torch.arange(8)[None]
    with torch.no_grad():
        model(ids)
    # what the encoding receives is the embedding row itself, not sqrt(d) times it
    torch.testing.assert_close(seen["x"][0], model.tok_emb.weight[ids[0]], rtol=0, atol=0)


def test_chapter_7_sinusoidal_variants_unscaled_and_scaled_to_the_embeddings_rms():
    record = json.loads((ROOT / "book/data/extrapolation_results.json").read_text())
    variants = record["variants"]
    assert variants["sinusoidal"]["encoding"] == "sinusoidal"
    assert variants["sinusoidal"]["kwargs"].get("scale", 1.0) == 1.0
    scaled = variants["sinusoidal_scaled"]
    assert scaled["encoding"] == "sinusoidal"
    # table RMS 1/sqrt(2) times scale == the embeddings' 0.02
    assert math.isclose(scaled["kwargs"]["scale"] / math.sqrt(2), 0.02, rel_tol=1e-9)


def test_chapter_1_control_retrains_the_pilot_model_from_its_record():
    # chapter 1's control rebuilds the pilot's ExperimentConfig from the stored config and the
    # stored variant; that stays possible, and the record holds what the control reads
    from tutorial_pkg.experiments.training import ExperimentConfig

    record = json.loads((ROOT / "book/data/extrapolation_results.json").read_text())
    seed = record["seeds"][0]
    ratios = (1, 2, 4, 8)
    cfg = ExperimentConfig(**{**record["config"], "eval_multiples": ratios, "seed": seed})
    trained = {t["encoding"]: t for t in record["training"] if t["seed"] == seed}
    assert cfg.steps == trained["sinusoidal_scaled"]["steps"]
    rows = {r["ratio"]: r for r in record["fixed_targets"] if r["seed"] == seed
            and r["encoding"] == "sinusoidal_scaled" and r["scaling"] == "none"}
    assert sorted(rows) == list(ratios)
    assert len({(r["target_len"], r["n_blocks"]) for r in rows.values()}) == 1
    assert all(r["eval_len"] == k * cfg.train_len for k, r in rows.items())


def test_the_positions_control_record_holds_its_claims_before_its_run():
    """book/data/ch1_positions_control.json: the script's claims, committed before the run
    (the claims' commit is an ancestor of the run's), every pilot seed retrained to its record,
    and the verdicts the rows give."""
    import subprocess
    import sys

    sys.path.insert(0, str(ROOT))
    import benchmarks.ch1_positions_control as ctl

    record = json.loads((ROOT / ctl.OUT).read_text())
    pilot = json.loads((ROOT / "book/data/extrapolation_results.json").read_text())
    assert record["status"] == "done" and record["claims"] == ctl.CLAIMS
    assert record["seeds"] == pilot["seeds"] == [r["seed"] for r in record["rows"]]
    assert record["claims_written"] < record["started"]
    known = subprocess.run(["git", "cat-file", "-e", record["claims_commit"]], cwd=ROOT,
                           capture_output=True).returncode == 0
    if known:  # a shallow clone may lack the history
        git = subprocess.run(["git", "merge-base", "--is-ancestor", record["claims_commit"],
                              record["commit"]], cwd=ROOT, capture_output=True)
        assert git.returncode == 0
    for row in record["rows"]:
        assert row["check_max_abs_diff"] < record["check_tolerance"]
        for k in ("2", "4", "8"):
            assert abs(row["share"][k] - row["rise_moved"][k] / row["rise_long"][k]) < 1e-12
    assert record["decided"] == ctl.decide(record["rows"])


def test_chapter_1_reads_press_table_2_from_its_record_and_types_none_of_it():
    """Press et al.'s Table 2 is read from book/data/press_tables.json (the record chapter 3
    reads, which names its source); no perplexity of the table is typed in a code cell."""
    nb = json.loads((ROOT / "book/01_sinusoidal.ipynb").read_text(encoding="utf-8"))
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert 'open("data/press_tables.json")' in code
    table = json.loads((ROOT / "book/data/press_tables.json").read_text())["tables"]["table_2"]
    values = {v for row in table["perplexity"].values() for v in row.values() if v is not None}
    typed = sorted(v for v in values if re.search(rf"(?<![\d.]){re.escape(f'{v:.2f}')}(?!\d)", code)
                   or re.search(rf"(?<![\d.]){re.escape(repr(v))}(?!\d)", code))
    assert not typed, typed


def test_chapter_1_states_press_table_2_as_the_record_has_it():
    """The prose about Press et al.'s sinusoidal column (plain Markdown) states the record's
    values: its score at L, its best rows, the first row worse than at L, and the later rows."""
    nb = json.loads((ROOT / "book/01_sinusoidal.ipynb").read_text(encoding="utf-8"))
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    text = " ".join(text.split())
    table = json.loads((ROOT / "book/data/press_tables.json").read_text())["tables"]["table_2"]
    col = {int(n): row["sinusoidal"] for n, row in table["perplexity"].items()}
    L = table["train_length"]
    at_L, best = col[L], min(col.values())
    best_at = [n for n, v in col.items() if v == best]
    first_worse = min(n for n, v in col.items() if v > at_L)
    before = max(n for n in col if n < first_worse)
    last = max(col)
    stated = [
        f"scores {at_L:.2f} at $L$ and *improves* just past it: {col[513]:.2f} at 513 tokens, "
        f"{best:.2f} from {best_at[0]} to {best_at[-1]}",
        f"worse than at $L$ is {first_worse} tokens, {first_worse - L} past $L$ (the table steps "
        f"by {first_worse - before} tokens there, so it crosses somewhere from {before + 1} to "
        f"{first_worse})",
        f"{col[612]:.2f} at 612, {col[1012]:.2f} at 1012 (about $2L$) and {col[last]:.0f} at "
        f"{last / L:.0f} times $L$",
        f"at its best {best_at[0] - L} to {best_at[-1] - L} tokens past $L$ ({best:.2f}, against "
        f"{at_L:.2f} at $L$), worse than at $L$ from the tabulated length {first_worse - L} tokens "
        f"past it on, and at {col[1012]:.2f} by about $2L$",
    ]
    missing = [s for s in stated if s not in text]
    assert not missing, missing


# ---------------------------------------------------------------------------------------------
# The chapter's plain-Markdown prose states numbers that its cells compute or its records hold.
# These tests recompute each number (or read it from the record) and require the prose to say
# it, so the page's text cannot drift from the run; nbval holds the cells' stored outputs to
# their re-execution.

NB = ROOT / "book/01_sinusoidal.ipynb"
L_CH1, D_CH1 = 128, 64  # the chapter's L and d


def _cells():
    return json.loads(NB.read_text(encoding="utf-8"))["cells"]


def _prose():
    text = "\n".join("".join(c["source"]) for c in _cells() if c["cell_type"] == "markdown")
    return " ".join(text.split())


def _missing(stated):
    text = _prose()
    return [s for s in stated if " ".join(s.split()) not in text]


def _output_of(snippet):
    (cell,) = [c for c in _cells() if c["cell_type"] == "code" and snippet in "".join(c["source"])]
    return "".join("".join(o.get("text", "")) for o in cell["outputs"])


def _angle_outside(positions, L, freq):
    # the chapter's angle_outside: radians outside the arc 0 .. (L-1) omega_i each pair swept
    arc = (L - 1) * freq
    phase = (positions.double()[:, None] * freq).remainder(2 * math.pi)
    outside = torch.minimum((phase - arc).clamp(min=0), 2 * math.pi - phase)
    outside[:, arc >= 2 * math.pi] = 0
    return outside


def test_chapter_1_code_uses_the_L_and_d_these_tests_assume():
    setup = "".join(_cells()[2]["source"])
    assert f"L = {L_CH1} " in setup and f"d = {D_CH1} " in setup


def test_chapter_1_states_how_f_wiggles_as_computed():
    from tutorial_pkg.encodings.sinusoidal import sinusoidal_frequencies

    omega = sinusoidal_frequencies(D_CH1).double()
    f = torch.cos(torch.arange(L_CH1).double()[:, None] * omega).sum(dim=1)  # f(r), r = 0..L-1
    r_up = int(torch.nonzero(f[1:] > f[:-1])[0])
    rise_fast = math.cos(r_up + 1) - math.cos(r_up)
    peak, edge = f[0].item(), f[-1].item()
    assert not _missing([
        f"it first rises from $r = {r_up}$ to ${r_up + 1}$",
        f"its cosine climbs by {rise_fast:.2f} there",
        f"still holds {edge / peak:.0%} of its peak: $f({L_CH1 - 1}) = {edge:.1f}$ against "
        f"$f(0) = {peak:.0f}$",
    ])


def test_chapter_1_states_the_sawtooth_of_novelty_as_computed():
    from tutorial_pkg.encodings.sinusoidal import sinusoidal_frequencies

    L = L_CH1
    omega = sinusoidal_frequencies(D_CH1).double()
    wavelength = 2 * math.pi / omega
    outside = _angle_outside(torch.arange(8 * L), L, omega)
    worst = outside.max(dim=1)
    past = worst.values[L:]
    n_fall = int((past[1:] < past[:-1]).sum())
    dip = (past.cummax(dim=0).values - past).max().item()
    record = {q: worst.values[: q + 1].max().item() for q in (2 * L, 8 * L - 1)}
    i4, i8 = int(worst.indices[4 * L]), int(worst.indices[8 * L - 1])
    assert not _missing([
        f"the most novel pair is {worst.values[L]:.3f} radian outside its arc",
        f"it falls in {n_fall} of its {len(past) - 1} steps past $L$, by up to {dip:.1f} radian",
        f"rises, {record[2 * L]:.1f} radians by $2L$ and {record[8 * L - 1]:.1f} by $8L - 1$",
        f"at $4L$ is pair {i4} (wavelength ${wavelength[i4] / L:.1f}\\,L$), at $8L - 1$ pair {i8} "
        f"(${wavelength[i8] / L:.1f}\\,L$)",
        f"the slowest pair is only {outside[8 * L - 1, -1]:.3f} radian out at $8L - 1$",
    ])


def test_chapter_1_states_the_novelty_of_press_et_al_geometry_as_computed():
    table = json.loads((ROOT / "book/data/press_tables.json").read_text())["tables"]["table_2"]
    L, half = table["train_length"], 1024 // 2  # width 1024 (their text), fairseq's frequencies
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / (half - 1))
    lengths = (513, 562, 612, 1012)
    nov = dict(zip(lengths, _angle_outside(torch.tensor(lengths) - 1, L, freq).amax(dim=1).tolist(),
                   strict=True))
    assert not _missing([
        f"the most novel pair is {nov[513]:.2f} radian outside its arc at 513 tokens, "
        f"{nov[562]:.2f} at 562, {nov[612]:.2f} at 612 and {nov[1012]:.2f} at 1012"])


def _chapter_7():
    pilot = json.loads((ROOT / "book/data/extrapolation_results.json").read_text())
    pre = json.loads((ROOT / "book/data/extrapolation_preregistered.json").read_text())

    def gmean(rec, encoding, ratio):
        nll = [r["nll"] for r in rec["fixed_targets"] if r["encoding"] == encoding
               and r["ratio"] == ratio and r["scaling"] == "none"]
        return torch.tensor(nll, dtype=torch.float64).mean().exp().item()

    return pilot, pre, gmean


def test_chapter_1_states_chapter_7_s_claims_as_recorded():
    pilot, pre, gmean = _chapter_7()
    decided = {c["claim"]: c for c in pre["decided"]}
    sin, nope = decided["scaled sinusoidal: 2L worse than L"], decided["NoPE: 8L worse than L"]
    assert sin["verdict"] == nope["verdict"] == "holds"
    at_2l = next(r for r in pilot["fixed_targets"] if r["ratio"] == 2)
    g1, g2 = (gmean(pre, "sinusoidal_scaled", k) for k in (1, 2))
    L7 = pilot["config"]["train_len"]
    assert not _missing([
        f"holds: {sin['mean']:+.2f} nats per byte, family-wise interval {sin['low']:.2f} to "
        f"{sin['high']:.2f} (perplexity per byte {g1:.2f} at $L$, {g2:.2f} at $2L$, where every "
        f"scored byte sits at position {at_2l['context_len']} or later, past $L = {L7}$)",
        f"*NoPE: 8L worse than L* holds ({nope['mean']:+.2f} nats per byte)",
        f"chapter 7's scaled sinusoidal model goes from {g1:.2f} to {g2:.2f} per byte from $L$ to "
        "$2L$ on its pre-registered seeds (a pre-registered claim, it holds)",
    ])


def test_chapter_1_states_the_positions_control_as_recorded():
    pilot, pre, _ = _chapter_7()
    control = json.loads((ROOT / "book/data/ch1_positions_control.json").read_text())
    rep = json.loads((ROOT / "book/data/ch1_positions_replication.json").read_text())
    assert [c["verdict"] for c in control["decided"] + rep["decided"]] == ["holds"] * 4

    def shares(rec, seeds=None):
        rows = [r for r in rec["rows"] if seeds is None or r["seed"] in seeds]
        return {k: torch.tensor([r["share"][str(k)] for r in rows]) for k in (2, 8)}

    fresh = [s for s in rep["seeds"] if s not in pre["seeds"] + pilot["seeds"]]
    assert len(fresh) == 5 and fresh == list(range(10, 15))
    s_pilot, s_rep, s_new = shares(control), shares(rep), shares(rep, fresh)
    for s in (s_pilot, s_rep, s_new):  # the claims' rules, seed by seed
        assert (s[2] > 0.5).all() and (s[8] < s[2]).all()

    def rng(s):
        return f"{s.min():.0%} to {s.max():.0%}"

    n_rep, n_new = len(rep["seeds"]), len(fresh)
    L7, T7 = pilot["config"]["train_len"], pilot["fixed_targets"][0]["target_len"]
    queries = torch.arange(2 * L7 - T7, 2 * L7)
    unseen = ((queries - L7 + 1).clamp(min=0).sum() / (queries + 1).sum()).item()
    assert not _missing([
        f"on the fresh seeds {fresh[0]} to {fresh[-1]}, moving the positions alone carries "
        f"{rng(s_new[2])} of the rise the window of $2L$ adds (mean {s_new[2].mean():.0%}), and "
        f"{rng(s_new[8])} of the rise at $8L$ (mean {s_new[8].mean():.0%}): both claims hold in "
        f"all {n_new} seeds, at $\\alpha = 2^{{-{n_new}}} = {0.5 ** n_new:.2g}$ each, "
        f"{2 * 0.5 ** n_new:.2g} for either",
        f"On all {n_rep} tested seeds, {rep['seeds'][0]} to {rep['seeds'][-1]}, the share at $2L$ "
        f"is {rng(s_rep[2])} (mean {s_rep[2].mean():.0%}) and at $8L$ {rng(s_rep[8])} (mean "
        f"{s_rep[8].mean():.0%}); both claims hold at $\\alpha = 2^{{-{n_rep}}} = "
        f"{0.5 ** n_rep:.2g}$ each, {2 * 0.5 ** n_rep:.2g} for either",
        f"the shares are {rng(s_pilot[2])} at $2L$ (mean {s_pilot[2].mean():.0%}) and "
        f"{rng(s_pilot[8])} at $8L$ (mean {s_pilot[8].mean():.0%})",
        f"in the long window {unseen:.0%} of the scored bytes' query-key pairs are $L$ or more "
        "bytes apart",
        f"carries {rng(s_new[2])} of the rise at $2L$ on the {n_new} fresh seeds where the "
        f"control's claims were tested ({rng(s_rep[2])} on all {n_rep} tested seeds, "
        f"{rng(s_pilot[2])} on the pilot seeds that chose them; one small model)",
    ])
    assert len(control["seeds"]) == 5 and rep["seeds"] == list(range(5, 15))


def test_the_positions_records_hold_the_chapter_s_rules_and_reproduce_chapter_7():
    """The chapter recomputes the two claims' verdicts from the shares with its own rules; the
    records state those rules and the same verdicts. Seeds 5-9 of the replication are chapter 7's
    pre-registered models trained again: their long-window scores are that record's (1e-5), and the
    pilot seeds' retrained scores are within the control's stored tolerance."""
    _, pre, _ = _chapter_7()
    control = json.loads((ROOT / "book/data/ch1_positions_control.json").read_text())
    rep = json.loads((ROOT / "book/data/ch1_positions_replication.json").read_text())
    assert rep["status"] == control["status"] == "done" and rep["claims"] == control["claims"]
    assert [(c["claim"], c["rule"]) for c in rep["claims"]] == [
        ("share at 2L above one half", "share[2] > 0.5 in every seed"),
        ("share falls from 2L to 8L", "share[8] < share[2] in every seed")]
    for rec in (control, rep):
        shares = [{int(k): v for k, v in r["share"].items()} for r in rec["rows"]]
        mine = [all(s[2] > 0.5 for s in shares), all(s[8] < s[2] for s in shares)]
        assert [c["verdict"] == "holds" for c in rec["decided"]] == mine == [True, True]
    assert all(r["check_max_abs_diff"] < control["check_tolerance"] for r in control["rows"])
    on_record = {(r["seed"], r["ratio"]): r["nll"] for r in pre["fixed_targets"]
                 if r["encoding"] == "sinusoidal_scaled" and r["scaling"] == "none"}
    retrained = [r for r in rep["rows"] if r["seed"] in pre["seeds"]]
    assert [r["seed"] for r in retrained] == pre["seeds"]
    diff = max(abs(r["long_nll"][str(k)] - on_record[r["seed"], k]) for r in retrained
               for k in (1, 2, 4, 8))
    assert diff < 1e-5


def test_chapter_1_states_hugging_face_s_marian_and_pegasus_tables_as_they_are():
    """The checklist's Marian/Pegasus column: Pegasus's rows are Marian's (its class is "Copied
    from" Marian's), Marian's docstring is quoted, and both configs' scale_embedding defaults to
    False."""
    pytest.importorskip("transformers")
    import inspect

    from transformers import MarianConfig, PegasusConfig
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding
    from transformers.models.pegasus.modeling_pegasus import PegasusSinusoidalPositionalEmbedding

    assert MarianConfig().scale_embedding is False and PegasusConfig().scale_embedding is False
    rows = MarianSinusoidalPositionalEmbedding(16, 8).create_weight()
    assert torch.equal(rows, PegasusSinusoidalPositionalEmbedding(16, 8).create_weight())
    doc = " ".join(inspect.getdoc(MarianSinusoidalPositionalEmbedding.create_weight).split())
    quoted = "Identical to the XLM create_sinusoidal_embeddings except features are not interleaved"
    assert quoted in doc
    assert not _missing([f'"{quoted}"', "class default `False`",
                         "Marian and Pegasus in the layout only"])


def test_chapter_1_summary_states_the_bfloat16_damage_as_computed():
    out = _output_of("cos_worst = min(")
    m = re.search(r"cosine with the exact row is ([\d.]+) at worst, ([\d.]+) in the median;\s+"
                  r"at most (\d+) of (\d+) entries of a row flip sign \(off by more than 1\), all "
                  r"in the (\d+) fastest", out)
    assert m, out
    worst, median, n_flip, width, fast = m.groups()
    assert int(width) == D_CH1
    assert not _missing([
        f"(in the {fast} fastest pairs, at most {n_flip} of {width} entries of a row; a row's "
        f"cosine with the exact one {worst} at worst, {median} in the median)"])
