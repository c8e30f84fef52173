"""Checks of chapter 3 (book/03_alibi.ipynb) that a reader's cell would not hold.

The chapter shows the plain recipe for a 16-bit ALiBi mask (build the key-only row in float32,
subtract each row's largest visible value, then cast to q's dtype) and says that the package's
``"sdpa"`` backend does the same. These tests check that claim on the layer: its bfloat16 output
against float32, and the mask it hands ``scaled_dot_product_attention``.
"""

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from tutorial_pkg import ALiBi, MultiHeadAttention


@pytest.fixture(scope="module")
def layers():
    """An 8-head key-only ALiBi layer on 1024 tokens, uniform content (q = 0), in float32 and
    bfloat16."""
    torch.manual_seed(0)
    layer32 = MultiHeadAttention(64, 8, ALiBi(8, mode="key_only"), backend="sdpa")
    with torch.no_grad():
        layer32.q_proj.weight.zero_()  # q = 0: the bias alone sets the weights
    layer16 = copy.deepcopy(layer32).bfloat16()
    x16 = torch.randn(1, 1024, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    return layer32, layer16, x16


def test_key_only_rows_are_large_before_the_shift(layers):
    layer32, _, x16 = layers
    keys = torch.arange(x16.shape[1])
    # lambda_1 * m for the last query: unshifted, bfloat16 would drop these rows' low bits
    assert layer32.encoding.bias(keys[-1:], keys).amax().item() > 100


def test_bfloat16_sdpa_layer_matches_float32(layers):
    layer32, layer16, x16 = layers
    with torch.no_grad():
        gap = (layer16(x16).float() - layer32(x16.float())).abs().max().item()
    assert gap < 0.01


def test_bfloat16_sdpa_layer_hands_a_shifted_bfloat16_mask(layers):
    _, layer16, x16 = layers
    with torch.no_grad(), mock.patch.object(
            F, "scaled_dot_product_attention", wraps=F.scaled_dot_product_attention) as kernel:
        layer16(x16)
    handed = kernel.call_args.kwargs["attn_mask"]
    assert handed.dtype == torch.bfloat16  # rounded to q's dtype, not kept in float32
    assert (handed.amax(-1) == 0).all()  # each row's largest visible value is 0: shifted first


def test_falcon_record_labels_each_value_by_its_source():
    """book/data/falcon_configs.json, which chapter 3 reads: a 'transcription' names a pinned copy
    of config.json (repo, path, 40-hex commit); the card's values say they are the card's and
    name no copy."""
    import json
    import re
    from pathlib import Path

    record = json.loads((Path(__file__).resolve().parents[1] / "book/data/falcon_configs.json")
                        .read_text(encoding="utf-8"))["models"]
    seven, rw = record["Falcon-7B"], record["Falcon-RW-1B"]
    assert seven["provenance"] == "transcription" and seven["keys"]["alibi"] is False
    assert seven["copy"]["path"].endswith("config.json")
    assert re.fullmatch(r"[0-9a-f]{40}", seven["copy"]["commit"])
    assert rw["provenance"] == "model card" and rw["copy"] is None and rw["keys"]["alibi"] is True
    assert rw["keys"]["d_model"] % rw["keys"]["head_dim"] == 0  # the chapter derives the heads


# --------------------------------------------- book/data/press_tables.json, which chapter 3 reads
def _press_record():
    import json
    from pathlib import Path

    return json.loads((Path(__file__).resolve().parents[1] / "book/data/press_tables.json")
                      .read_text(encoding="utf-8"))


def _chapter_cells():
    import json
    from pathlib import Path

    return json.loads((Path(__file__).resolve().parents[1] / "book/03_alibi.ipynb")
                      .read_text(encoding="utf-8"))["cells"]


def test_press_record_names_its_source_and_what_was_checked():
    import re

    source = _press_record()["source"]
    assert source["arxiv"] == "2108.12409v2" and source["bibtex_key"] == "press2022alibi"
    copy = source["transcription"]
    assert copy["repo"] == "viktor-shcherb/msc_thesis"
    assert re.fullmatch(r"[0-9a-f]{40}", copy["commit"])
    # the record says what it was compared with, and what it was not
    assert "NOT compared with the arXiv PDF" in source["verification"]
    tables = _press_record()["tables"]
    assert (tables["table_2"]["page"], tables["table_15"]["page"]) == (16, 25)
    for table in tables.values():
        assert table["transcription_path"].startswith("references/") and table["rows_kept"]


def test_press_table_2_structure_and_its_bold_minima():
    table = _press_record()["tables"]["table_2"]
    rows = {int(n): row for n, row in table["perplexity"].items()}
    assert len(rows) == 35 and min(rows) == table["train_length"] == 512 and max(rows) == 15512
    assert all(list(row) == table["columns"] for row in rows.values())
    for method in table["columns"]:
        values = {n: row[method] for n, row in rows.items() if row[method] is not None}
        assert all(isinstance(v, float) and 10 < v < 1000 for v in values.values())
        # "Bold shows the best score for each model": each bold entry is its column's minimum
        best = min(values.values())
        assert sorted(table["bold"][method]) == sorted(n for n, v in values.items() if v == best)
    # only the T5 bias model runs out of memory, from 13 512 tokens on
    oom = sorted(n for n, row in rows.items() if row["t5_bias"] is None)
    assert oom == [13512, 14512, 15512]
    assert all(row[m] is not None for row in rows.values() for m in table["columns"]
               if m != "t5_bias")


def test_press_table_15_structure():
    rows = {int(t): {int(n): p for n, p in row.items()}
            for t, row in _press_record()["tables"]["table_15"]["perplexity"].items()}
    assert sorted(rows) == [512, 1024, 3072]
    for trained_on, row in rows.items():
        assert min(row) == trained_on  # each model from its own training length on
        assert set(row) <= {512, 1024, 1536, 2048, 3072}
        assert all(isinstance(p, float) and 10 < p < 30 for p in row.values())


def test_chapter_reads_press_record_and_types_none_of_its_values():
    cells = _chapter_cells()
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert sum("data/press_tables.json" in s for s in code) == 1
    tables = _press_record()["tables"]
    values = {p for row in tables["table_2"]["perplexity"].values() for p in row.values()
              if p is not None}
    values |= {p for row in tables["table_15"]["perplexity"].values() for p in row.values()}
    typed = sorted(v for v in values if any(repr(v) in s for s in code))
    assert typed == []
    # the stored Table 2 rendering holds the record's rows (the chapter read it)
    shown = "".join("".join(o.get("data", {}).get("text/markdown", ""))
                    for c in cells if c["cell_type"] == "code" for o in c.get("outputs", []))
    t2 = tables["table_2"]["perplexity"]
    for n in ("512", "1012", "2512", "15512"):
        r = t2[n]
        t5 = "OOM" if r["t5_bias"] is None else f"{r['t5_bias']:.2f}"
        assert (f"| {n} | {r['sinusoidal']:.2f} | {r['rotary']:.2f} | {t5} | "
                f"{r['alibi']:.2f} |") in shown
    t15 = tables["table_15"]["perplexity"]["512"]
    assert "| 512 | " + " | ".join(f"{t15[n]:.2f}" for n in ("512", "1024", "1536", "2048",
                                                               "3072")) + " |" in shown


def test_chapter_quotes_the_papers_body_as_the_pinned_transcription_words_it():
    """The transcription paraphrases the paper's body in the third person: the chapter quotes that
    wording (listed in the record), never a first-person form no pinned source holds."""
    import re

    def flat(text):
        return re.sub(r"\s+", " ", text)

    prose = flat(" ".join("".join(c["source"]) for c in _chapter_cells()
                          if c["cell_type"] == "markdown"))
    passages = _press_record()["source"]["quoted_passages"]["passages"]
    listed = " ".join(p["text"] for p in passages)
    for quote in ("The authors initially experimented with making the slopes trainable, but this "
                  "did not yield strong extrapolation results",
                  "The ALiBi models cannot improve perplexity when looking at longer sequences in "
                  "this setting, but they keep perplexity flat",
                  "ALiBi might not be using contexts longer than the ones it was trained on"):
        assert f'"{quote}' in prose or f"{quote}\"" in prose, quote
        assert quote in listed, quote
    for first_person in ("We initially experimented", "our ALiBi models cannot"):
        assert first_person not in prose
    for p in passages:
        assert p["transcription_path"].startswith("references/") and p["page"] in (2, 5, 24)


# ----------------------------------- preconditions and prose checks moved out of the chapter
def test_flex_cells_print_the_same_without_the_compiled_cpu_kernel():
    """The chapter compiles flex_attention only where torch 2.13 builds its CPU kernel
    (flex_compiles_on_cpu: AVX2 or AVX-512, not macOS) and otherwise calls it eagerly. Under
    ATEN_CPU_CAPABILITY=default, where compiling raises an InductorError, its two FlexAttention
    cells run and print exactly their stored outputs (what nbval under that setting compares)."""
    import os
    import subprocess
    import sys

    cells = _chapter_cells()
    at = next(i for i, c in enumerate(cells) if "flex_compiles_on_cpu()" in "".join(c["source"]))
    setup, run = ("".join(cells[i]["source"]) for i in (at, at + 1))
    assert "torch.compile(flex_attention)" in setup and "flex = flex_attention" in setup
    stored = "".join("".join(o.get("text", "")) for o in cells[at + 1]["outputs"])
    assert stored and not cells[at]["outputs"]
    prelude = ("import math\nimport torch\nimport torch.nn.functional as F\n"
               "from tutorial_pkg import ALiBi, alibi_bias\ndevice = 'cpu'\n")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", prelude + setup + "\n" + run], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == stored
    assert done.stderr == ""  # the eager call's warning is silenced in the cell


def test_chapter_states_no_falcon_rw_head_count():
    """No pinned config gives Falcon-RW-1B's head count: the chapter states none (the card's
    head dimension is used as an example only), and prints no provenance labels."""
    cells = _chapter_cells()
    prose = " ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    assert "| Falcon-RW-1B | – " in prose
    code = " ".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "n_rw" not in code and "['provenance']" not in code
    assert "get_cpu_capability" not in code  # the switch lives here, not in a reader cell


def test_table_15_reading_calls_each_row_one_model():
    """Table 15's rows are training lengths, one trained model each; its cells are evaluation
    lengths of that model, not separate models."""
    cells = _chapter_cells()
    text = " ".join("".join(c["source"]) for c in cells)
    assert "each row is one trained model" in text and "one trained model per row" in text
    assert "each cell is one" not in text and "model per cell" not in text


def test_flashattention_prose_names_the_pre_divided_slope():
    """FlashAttention-2 adds slope / softmax_scale * col_idx to the unscaled q.k
    (flash_fwd_kernel.h, pinned in the chapter); the chapter's prose says so and pins the file."""
    cells = _chapter_cells()
    prose = " ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    assert "/ params.scale_softmax" in prose
    assert ("Dao-AILab/flash-attention/blob/c1f0be2f7a69a649c3252a79db8cdc65f4c5dccf/"
            "csrc/flash_attn/src/flash_fwd_kernel.h") in prose
