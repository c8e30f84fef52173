"""The facts chapter 9 states about the pinned transformers' source.

Chapter 9 quotes lines of transformers' code (bug 10: how BLOOM and Falcon build the ALiBi bias;
bug 18: where Falcon's eager path adds the bias a second time) and says which RoPE pairing the
DeepSeek-V3.2 and GLM-MoE-DSA indexers use and that no file of either model reads the config key
``indexer_rope_interleave`` (bug 17). Reading installed sources is no reader's cell, so these tests
hold the prose true: each quoted line must be in the function the chapter names, and each line the
chapter quotes must be one of these.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from transformers.models.bloom import modeling_bloom  # noqa: E402
from transformers.models.deepseek_v32 import (  # noqa: E402
    configuration_deepseek_v32,
    modeling_deepseek_v32,
)
from transformers.models.falcon import modeling_falcon  # noqa: E402
from transformers.models.glm_moe_dsa import (  # noqa: E402
    configuration_glm_moe_dsa,
    modeling_glm_moe_dsa,
)

CHAPTER = Path(__file__).resolve().parents[1] / "book" / "09_debugging.ipynb"

# (function, the line the chapter quotes from it)
ALIBI_LINES = [  # bug 10
    (modeling_bloom.build_alibi_tensor,
     "return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)"),
    (modeling_bloom.BloomModel.forward,
     "alibi = self.build_alibi_tensor(attention_mask, self.num_heads, dtype=hidden_states.dtype)"),
    (modeling_falcon.build_alibi_tensor, "alibi = slopes[..., None].bfloat16() * arange_tensor"),
]
FALCON_TWICE_LINES = [  # bug 18
    (modeling_falcon.FalconModel.forward,
     "alibi / math.sqrt(self.config.hidden_size // self.num_heads),"),
    (modeling_falcon.FalconAttention.forward,
     "attention_logits = attention_scores + alibi.view(batch_size, self.num_heads, 1, -1)"),
    (modeling_falcon.FalconAttention.forward, "attention_logits *= self.inv_norm_factor"),
    (modeling_falcon.FalconAttention.forward,
     "attention_probs = F.softmax(attention_logits + attention_mask, dim=-1, "
     "dtype=hidden_states.dtype)"),
]


def _lines(function):
    return [line.strip() for line in inspect.getsource(function).splitlines()]


def _cell(cell_id):
    cells = json.loads(CHAPTER.read_text())["cells"]
    return "".join(next(c["source"] for c in cells if c.get("id") == cell_id))


def test_the_pinned_transformers_is_installed():
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    assert (major, minor) == (5, 24)  # pyproject.toml: transformers>=5.24,<5.25


@pytest.mark.parametrize("function, line", ALIBI_LINES + FALCON_TWICE_LINES)
def test_each_quoted_line_is_in_the_named_function(function, line):
    assert line in _lines(function)


def test_falcon_eager_scales_the_bias_before_adding_the_mask_that_holds_it():
    """Bug 18's order: the bias is added, the sum scaled, then the mask (bias / sqrt(d)) added."""
    lines = _lines(modeling_falcon.FalconAttention.forward)
    at = [lines.index(line) for _, line in FALCON_TWICE_LINES[1:]]
    assert at == sorted(at) and at[-1] - at[0] == 2


@pytest.mark.parametrize("cell_id, quoted", [("4dc1220d", ALIBI_LINES),
                                             ("27d0781c", FALCON_TWICE_LINES)])
def test_the_chapter_quotes_exactly_these_lines(cell_id, quoted):
    block = _cell(cell_id).split("```python\n")[1].split("```")[0]
    written = [line.strip() for line in block.splitlines()
               if line.strip() and not line.lstrip().startswith("#")]
    assert written == [line for _, line in quoted]


def test_the_indexers_rotate_as_the_chapter_says():
    glm = _lines(modeling_glm_moe_dsa.GlmMoeDsaIndexer.forward)
    ds = _lines(modeling_deepseek_v32.DeepseekV32Indexer.forward)
    rope_call = "q_rot, k_rot = apply_rotary_pos_emb{}(q_rot, k_rot, cos, sin, unsqueeze_dim=2)"
    assert rope_call.format("_interleave") in glm and rope_call.format("") not in glm
    assert rope_call.format("") in ds and rope_call.format("_interleave") not in ds
    assert ("# The indexer uses NON-interleaved (half-split) RoPE — unlike the main MLA attention"
            in ds)


@pytest.mark.parametrize("module", [configuration_deepseek_v32, modeling_deepseek_v32,
                                    configuration_glm_moe_dsa, modeling_glm_moe_dsa])
def test_no_file_of_either_model_reads_indexer_rope_interleave(module):
    assert "indexer_rope_interleave" not in inspect.getsource(module)


def test_sdpa_masks_torch_fix_is_retired():
    """Bug 4: transformers' own correction of rows that see no key is documented as a no-op."""
    from transformers import masking_utils

    doc = inspect.getdoc(masking_utils.sdpa_mask)
    at = doc.index("allow_torch_fix")
    assert "Deprecated and has no effect" in doc[at:at + 120]


def _bug_numbers():
    cells = json.loads(CHAPTER.read_text())["cells"]
    return [int(m.group(1)) for c in cells if c["cell_type"] == "markdown"
            for m in re.finditer(r"^## (\d+)\. ", "".join(c["source"]), re.M)]


def test_the_map_the_headings_and_the_summary_count_the_same_bugs():
    """Cell 0 names the count in words; each bug has a heading and one summary row, in order."""
    numbers = _bug_numbers()
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) == 21
    intro = _cell("1c1fa85f")
    assert "reproduces twenty-one of them" in intro and "the twenty-one bugs" in intro
    cells = json.loads(CHAPTER.read_text())["cells"]
    table = next(c for c in cells if c.get("id") == "ch9-summary-table")
    assert table["cell_type"] == "markdown"
    rows = [int(m.group(1)) for m in re.finditer(r"^\| (\d+)\. ", "".join(table["source"]), re.M)]
    assert rows == numbers


def test_qwen2_5_vl_keeps_the_rope_delta_for_decoding():
    """Bug 21's fix: get_rope_index returns the delta, the model keeps it as rope_deltas and adds
    it to the cache length when it decodes."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    model = modeling_qwen2_5_vl.Qwen2_5_VLModel
    doc = inspect.getdoc(model.get_rope_index)
    assert "position_ids (`torch.LongTensor` of shape `(3, batch_size, sequence_length)`)" in doc
    assert "mrope_position_deltas" in doc
    lines = _lines(model.compute_3d_position_ids)
    assert "self.rope_deltas = rope_deltas" in lines
    assert "position_ids = torch.arange(cache_length, cache_length + seq_length)" in lines
    assert "position_ids = position_ids + delta.to(device=position_ids.device)" in lines


def test_get_rope_index_reads_the_token_types_not_the_ids():
    """Bug 21's detection passes zeros for the ids: only their shape and device are read."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    source = inspect.getsource(modeling_qwen2_5_vl.Qwen2_5_VLModel.get_rope_index)
    body = source.split('"""')[2]  # after the docstring
    uses = [line.strip() for line in body.splitlines() if "input_ids" in line]
    assert uses and all(re.search(r"input_ids\.(shape|dtype|device)|enumerate\(input_ids\)|"
                                  r"current_input_ids\b", u) for u in uses)
    assert "input_token_type = mm_token_type_ids[batch_idx]" in _lines(
        modeling_qwen2_5_vl.Qwen2_5_VLModel.get_rope_index)


def test_qwen3_norms_before_rotating_and_hunyuan_after():
    """The QK-norm section: Qwen3 normalises q and k, then rotates; HunYuan-V1-Dense rotates, then
    normalises (the order each model's attention forward runs them in)."""
    from transformers.models.hunyuan_v1_dense import modeling_hunyuan_v1_dense
    from transformers.models.qwen3 import modeling_qwen3

    rope = "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)"
    qwen3 = _lines(modeling_qwen3.Qwen3Attention.forward)
    norm = next(i for i, line in enumerate(qwen3) if line.startswith("query_states = self.q_norm("))
    assert norm < qwen3.index(rope)
    hunyuan = _lines(modeling_hunyuan_v1_dense.HunYuanDenseV1Attention.forward)
    assert hunyuan.index(rope) < hunyuan.index("query_states = self.query_layernorm(query_states)")
