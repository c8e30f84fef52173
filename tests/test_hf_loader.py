"""tutorial_pkg.models.hf: the README's loader snippet, what the loader refuses (by name), the
attention-mask conversion, and that the package never imports transformers.

The loader's numbers against Hugging Face (every supported family, every backend, causal
and left-padded) are tests/test_hf_oracle.py::test_loader_from_hf_attention.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tutorial_pkg as tp

from . import hf_families as F

ROOT = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


def test_readme_hf_snippet_runs():
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"<!-- hf-snippet.*?-->\n```python\n(.*?)```", readme, re.S).group(1)
    torch.manual_seed(0)
    exec(compile(snippet, "README.md", "exec"), {})  # the asserts inside must hold


def test_import_tutorial_pkg_never_imports_transformers():
    code = ("import sys, tutorial_pkg, tutorial_pkg.models.hf; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_padding_mask():
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    assert torch.equal(tp.hf.padding_mask(mask), torch.tensor([[False] * 3, [True, False, False]]))
    assert torch.equal(tp.hf.padding_mask(mask.bool()), tp.hf.padding_mask(mask))
    with pytest.raises(ValueError, match=r"shape \[b, L\]"):
        tp.hf.padding_mask(mask[None])
    with pytest.raises(TypeError, match="attention_mask must be a tensor"):
        tp.hf.padding_mask([[1, 1]])


def _attention(fam, model_cls, path, **overrides):
    config = fam.make_config(attn_implementation="eager", **overrides)
    torch.manual_seed(0)
    return config, getattr(transformers, model_cls)(config).get_submodule(path)


@pytest.mark.parametrize(("fam", "model_cls", "path", "overrides", "match"), [
    (F.DEEPSEEK_V3, "DeepseekV3Model", "layers.0.self_attn", {},
     "cannot load a deepseek_v3 attention layer: .*latent attention"),
    (F.OLMO2, "Olmo2Model", "layers.0.self_attn", {},
     r"cannot load a 'olmo2' attention layer: the loader knows \["),
    (F.MPT, "MptModel", "blocks.0.attn", {"attn_config": {"clip_qkv": 6.0}},
     "cannot load a MPT attention layer: attn_config clip_qkv=6.0: .*no clamp"),
    (F.MPT, "MptModel", "blocks.0.attn", {"attn_config": {"qk_ln": True}},
     "cannot load a MPT attention layer: attn_config qk_ln=True"),
    (F.MPT, "MptModel", "blocks.0.attn", {"attn_config": {"alibi_bias_max": 16}},
     "cannot load a MPT attention layer: attn_config alibi_bias_max=16: .*whatever the config"),
], ids=lambda v: getattr(v, "name", None))
def test_loader_refuses_families_it_cannot_express_by_name(fam, model_cls, path, overrides,
                                                            match):
    config, attn = _attention(fam, model_cls, path, **overrides)
    with pytest.raises(ValueError, match=match):
        tp.hf.from_hf_attention(attn, config)


def test_loader_reads_gemma2_softcapping_and_gpt_oss_sinks():
    """The cap of Gemma 2's config and GPT-OSS's sinks parameter reach the layer (their
    outputs are held to the modules' in tests/test_hf_oracle.py); a sinks parameter on
    another family is refused."""
    config, attn = _attention(F.GEMMA2, "Gemma2Model", "layers.0.self_attn")
    ours = tp.hf.from_hf_attention(attn, config)
    assert ours.softcap == 0.5 and ours.sinks is None and "softcap=0.5" in repr(ours)
    config, attn = _attention(F.GPT_OSS, "GptOssModel", "layers.0.self_attn",
                              num_hidden_layers=1, layer_types=["sliding_attention"])
    ours = tp.hf.from_hf_attention(attn, config)
    assert torch.equal(ours.sinks, attn.sinks) and ours.sinks is not attn.sinks
    assert ours.window == 4 and ours.softcap is None
    config, attn = _attention(F.LLAMA, "LlamaModel", "layers.0.self_attn")
    attn.sinks = nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="Llama .*sinks"):
        tp.hf.from_hf_attention(attn, config)


def test_loader_refuses_what_a_supported_family_module_does_not_usually_have():
    config, attn = _attention(F.LLAMA, "LlamaModel", "layers.0.self_attn")
    attn.extra_norm = nn.LayerNorm(16)  # e.g. a variant with another norm
    with pytest.raises(ValueError, match=r"Llama .*submodule\(s\) \['extra_norm'\]"):
        tp.hf.from_hf_attention(attn, config)
    config, attn = _attention(F.GEMMA3, "Gemma3TextModel", "layers.0.self_attn",
                              layer_types=["full_attention"], num_hidden_layers=1)
    attn.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="Gemma 3 .*soft-caps"):
        tp.hf.from_hf_attention(attn, config)
    config, attn = _attention(F.QWEN3, "Qwen3Model", "layers.0.self_attn")
    attn.q_norm = nn.LayerNorm(16)
    with pytest.raises(ValueError, match="Qwen3 .*q_norm is a LayerNorm"):
        tp.hf.from_hf_attention(attn, config)


def test_loader_reads_scale_window_biases_and_dtype():
    config, attn = _attention(F.GEMMA3, "Gemma3TextModel", "layers.0.self_attn",
                              layer_types=["sliding_attention"], num_hidden_layers=1)
    layer = tp.hf.from_hf_attention(attn.to(torch.bfloat16), config, backend="sdpa")
    assert layer.scale == pytest.approx(config.query_pre_attn_scalar**-0.5)
    assert (layer.window, layer.head_dim, layer.n_kv_heads) == (4, 16, 2)
    assert layer.q_proj.weight.dtype == torch.bfloat16 and layer.backend == "sdpa"
    assert layer.encoding.rope.base == 10_000.0  # the sliding layers' RoPE
    config, attn = _attention(F.QWEN2, "Qwen2Model", "layers.0.self_attn")
    layer = tp.hf.from_hf_attention(attn, config.to_dict())  # the dict works too
    assert layer.q_proj.bias is not None and layer.out_proj.bias is None
    with pytest.raises(TypeError, match="attention must be"):
        tp.hf.from_hf_attention("self_attn", config)
    with pytest.raises(TypeError, match="config must be"):
        tp.hf.from_hf_attention(attn, 3)


def test_loader_reads_smollm3_no_rope_layers_and_falcon_layouts():
    """SmolLM3's no_rope_layers (1 = RoPE): layers.3 of [1, 1, 1, 0] loads as NoPE, by its
    layer_idx; Falcon's three query_key_value layouts give their key/value head counts."""
    config, attn = _attention(F.SMOLLM3, "SmolLM3Model", "layers.3.self_attn")
    assert config.no_rope_layers == [1, 1, 1, 0] and attn.use_rope == 0
    assert isinstance(tp.hf.from_hf_attention(attn, config).encoding, tp.NoPE)
    config, attn = _attention(F.SMOLLM3, "SmolLM3Model", "layers.2.self_attn")
    assert isinstance(tp.hf.from_hf_attention(attn, config).encoding, tp.Rotary)
    attn.layer_idx = None
    with pytest.raises(ValueError, match="SmolLM3 .*layer_idx"):
        tp.hf.from_hf_attention(attn, config)
    for kw, n_kv in [({}, 6), ({"multi_query": True}, 1),
                     ({"new_decoder_architecture": True, "parallel_attn": True,
                       "num_kv_heads": 2}, 2)]:
        config, attn = _attention(F.FALCON, "FalconModel", "h.0.self_attention", **kw)
        layer = tp.hf.from_hf_attention(attn, config)
        assert (layer.n_heads, layer.n_kv_heads) == (6, n_kv)
        assert isinstance(layer.encoding, tp.ALiBi)
        assert layer.encoding.bias_scale == pytest.approx(8 ** -0.5)
