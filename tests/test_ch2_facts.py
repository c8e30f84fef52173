"""Checks of chapter 2 (book/02_rope.ipynb) that a reader's cell would not hold.

* The chapter quotes Llama 3.1's RoPE numbers from Meta's ``llama-models`` at pinned revisions
  (``sku_list.py``'s ``model_args`` and ``apply_scaling`` in ``reference_impl/model.py``) and writes
  them in the form of Hugging Face's ``config.json``. The book's record of published configs
  (``book/data/model_configs.json``, which chapter 8 reads) holds a transcription of that file; the
  two must agree, and the chapter must link both Meta files at a 40-hex commit.
* Its SmolLM2 section states its passages and its three exploratory checks in the cell before
  scoring, on passages disjoint from the pilot's play; the prose must call them exploratory (margins
  set after a one-passage pilot) and must not fall back to one passage's numbers. The model's
  rotation is changed with hooks and a registered attention function, never by patching
  transformers' module.
* The GLM dropdown says ``glm5_next`` gives its language layers no rotation and rotates in its
  vision tower only: read from the installed transformers source.
* The package's float32 frequencies are within one unit in the last place of Hugging Face's.
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


def test_smollm2_section_fixes_passages_and_checks_before_scoring(nb):
    source = _code(nb, "from tutorial_pkg.experiments.data import list_plays")
    first_run = source.index("nll_right, logits32 = run(smol)")
    fixed_first = ("N_PASSAGES, N_TOKENS = 8, 128", "CLAIMS = {",
                   "CONFIDENCE = bonferroni(0.95, 3)", "list_plays()[8 : 8 + N_PASSAGES]")
    for fixed in fixed_first:
        assert source.index(fixed) < first_run, fixed
    assert 'method="sign_flip"' in source and source.count('("equivalent", 0.01)') == 2
    assert "n_more" not in source and "not resolved" not in source  # no CPU-dependent verdict
    text = _markdown(nb)
    assert "exploratory checks, not pre-registered" in text and "Bonferroni" in text
    assert "98.33 %" in text and "the pilot below read the\nfirst play" in text
    assert "one passage of 256 tokens" not in text and "more than five times" not in text
    helper = _code(nb, "import contextlib")
    assert "register_forward_hook" in helper and "AttentionInterface.register" in helper
    assert "llama_code" not in helper and "modeling_llama" not in helper  # no patching


def test_glm5_next_rotates_in_its_vision_tower_only(nb):
    import inspect

    glm5 = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    text_model = inspect.getsource(glm5.Glm5NextTextModel.forward)
    assert "position_embeddings=None" in text_model
    for cls in (glm5.Glm5NextTextAttention, glm5.Glm5NextTextDecoderLayer):
        body = inspect.getsource(cls)
        assert "apply_rotary" not in body and "cos, sin" not in body
    vision = inspect.getsource(glm5.Glm5NextVisionAttention.forward)
    assert "apply_rotary_pos_emb_vision(query_states, key_states, cos, sin)" in vision
    assert "(`position_embeddings=None`); only its vision tower" in _markdown(nb)


def test_package_frequencies_within_one_ulp_of_hugging_faces():
    import torch

    from tutorial_pkg.encodings.rope import inv_freq

    for d_h in (64, 128, 256):
        for base in (10_000.0, 500_000.0, 1_000_000.0):
            ours = inv_freq(d_h, base)
            hf = 1.0 / (base ** (torch.arange(0, d_h, 2, dtype=torch.int64).float() / d_h))
            ulp = torch.nextafter(ours, torch.tensor(2.0)) - ours
            assert ((hf - ours).abs() <= ulp).all(), (d_h, base)


def test_the_one_step_head_is_not_called_a_previous_token_head(nb):
    text = _markdown(nb)
    assert "gives a\nprevious-token head" not in text
    assert "not a previous-token head" in text
    code = _code(nb, "# one token x at both ends")
    assert "previous-token head" not in code
