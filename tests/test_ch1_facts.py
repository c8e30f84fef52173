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
