"""Checks of chapter 2 (book/02_rope.ipynb) that a reader's cell would not hold.

* The chapter quotes Llama 3.1's RoPE numbers from Meta's ``llama-models`` at pinned revisions
  (``sku_list.py``'s ``model_args`` and ``apply_scaling`` in ``reference_impl/model.py``) and writes
  them in the form of Hugging Face's ``config.json``. The book's record of published configs
  (``book/data/model_configs.json``, which chapter 8 reads) holds a transcription of that file; the
  two must agree, and the chapter must link both Meta files at a 40-hex commit.
* Its SmolLM2 section fixes its passages and its claims in the cell before scoring; the prose
  around it must say so and must not fall back to one passage's numbers.
* The head with ``phi_j = theta_j`` is described as what it computes (a token's own content one
  position back), not as a previous-token head.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

BOOK = Path(__file__).resolve().parent.parent / "book"
CHAPTER = BOOK / "02_rope.ipynb"


@pytest.fixture(scope="module")
def nb():
    return nbformat.read(CHAPTER, as_version=4)


def _code(nb, start: str) -> str:
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(start)]
    return cell.source


def _markdown(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def _literal(source: str, name: str):
    """The value of ``name = {...}`` in a cell (a literal dict, quoted from a file)."""
    match = re.search(rf"^{name} = (\{{.*?\}})\n", source, flags=re.M | re.S)
    assert match, f"no literal {name} in the cell"
    return eval(match.group(1), {"__builtins__": {}}, {"True": True, "False": False})


def test_meta_files_are_linked_at_pinned_commits(nb):
    text = _markdown(nb)
    for path in ("models/llama3_1/api/sku_list.py", "models/llama3/reference_impl/model.py"):
        pinned = rf"github\.com/meta-llama/llama-models/blob/[0-9a-f]{{40}}/{re.escape(path)}"
        assert re.search(pinned, text), path
    assert "book's record of its config" not in text  # no longer the source of the values


def test_quoted_values_agree_with_the_books_config_record(nb):
    source = _code(nb, "# Llama 3.1 8B's model_args in Meta's llama-models")
    meta = _literal(source, "llama31")
    record = json.loads((BOOK / "data" / "model_configs.json").read_text())
    hf = record["models"]["Llama 3.1 8B"]["config"]
    assert (meta["dim"], meta["n_heads"], meta["rope_theta"]) == (
        hf["hidden_size"], hf["num_attention_heads"], hf["rope_theta"])
    assert meta["use_scaled_rope"] is True
    # the chapter's rope_scaling dict, Meta's apply_scaling constants in Hugging Face's names
    scaling = re.search(r'"rope_scaling": (\{.*?\})\}', source, flags=re.S)
    assert scaling
    chapter = eval(scaling.group(1), {"__builtins__": {}}, {})
    assert chapter == hf["rope_scaling"]
    for const, key in (("scale_factor = 8", "factor"), ("low_freq_factor = 1", "low_freq_factor"),
                       ("high_freq_factor = 4", "high_freq_factor"),
                       ("old_context_len = 8192", "original_max_position_embeddings")):
        assert const in source  # the quoted apply_scaling
        assert float(const.split("= ")[1]) == float(chapter[key])


def test_smollm2_section_fixes_passages_and_claims_before_scoring(nb):
    source = _code(nb, "from tutorial_pkg.experiments.data import list_plays")
    first_run = source.index("nll_right, logits32 = run(smol)")
    fixed_first = ("N_PASSAGES, N_TOKENS = 8, 128", "CLAIMS = {",
                   "CONFIDENCE = bonferroni(0.95, 4)")
    for fixed in fixed_first:
        assert source.index(fixed) < first_run, fixed
    assert 'method="sign_flip"' in source
    text = _markdown(nb)
    assert "fixed before any is scored" in text and "Bonferroni" in text
    assert "one passage of 256 tokens" not in text and "more than five times" not in text


def test_the_one_step_head_is_not_called_a_previous_token_head(nb):
    text = _markdown(nb)
    assert "gives a\nprevious-token head" not in text
    assert "not a previous-token head" in text
    code = _code(nb, "# one token x at both ends")
    assert "previous-token head" not in code
