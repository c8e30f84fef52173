"""The config reader on real-shaped Hugging Face configs, in both forms, and bad configs.

The dicts copy the RoPE-related keys of the models' ``config.json`` files (Llama 3.1
8B, Qwen2.5-7B-Instruct with the YaRN block its model card suggests, Phi-3-mini-128k,
DeepSeek-V3, Gemma 3 4B); longrope's per-dimension lists are real-shaped (48 monotone
values), not Phi-3's exact numbers. Each has its ``model_type`` (every ``config.json``
does): the reader takes the pair layout from it.
"""

import importlib.util
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tutorial_pkg import RotaryEmbedding, read_rope_config
from tutorial_pkg.encodings.rope_config import FAMILY_LAYOUTS, RopeConfig
from tutorial_pkg.encodings.rope_scaling import scaled_inv_freq

LLAMA31_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128,
    "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
QWEN25_7B_YARN = {
    "model_type": "qwen2",
    "hidden_size": 3584, "num_attention_heads": 28, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
}
PHI3_MINI_128K = {
    "model_type": "phi3",
    "hidden_size": 3072, "num_attention_heads": 32, "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
    "rope_scaling": {"type": "longrope",
                     "short_factor": [1.0 + 0.01 * i for i in range(48)],
                     "long_factor": [1.0 + 1.2 * i for i in range(48)]},
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168, "num_attention_heads": 128, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 163840,
    "rope_theta": 10000, "rope_interleave": True,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
}
GEMMA3_4B_NEW = {
    "model_type": "gemma3_text", "hidden_size": 2560, "num_attention_heads": 8, "head_dim": 256,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
}
GEMMA3_4B_OLD = {
    "model_type": "gemma3_text", "hidden_size": 2560, "num_attention_heads": 8, "head_dim": 256,
    "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
}


def to_new_form(config):
    """The transformers-5 form: RoPE keys moved into ``rope_parameters``."""
    out = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    out["rope_parameters"] = {**(config.get("rope_scaling") or {"rope_type": "default"}),
                              "rope_theta": config["rope_theta"]}
    return out


def test_llama31_in_both_forms():
    cfg = read_rope_config(LLAMA31_8B)
    assert cfg == RopeConfig(head_dim=128, base=500000.0, rotary_dim=128, layout="half",
                             scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192},
                             rope_type="llama3", max_position_embeddings=131072)
    assert read_rope_config(to_new_form(LLAMA31_8B)) == cfg
    rope = RotaryEmbedding.from_config(LLAMA31_8B)
    torch.testing.assert_close(rope.inv_freq, scaled_inv_freq(128, 500000.0, cfg.scaling)[0])
    assert rope.inv_freq[0] == 1.0 and rope.attention_factor == 1.0


def test_qwen_yarn_with_the_legacy_type_key():
    cfg = read_rope_config(QWEN25_7B_YARN)
    assert cfg.head_dim == 128 and cfg.base == 1e6 and cfg.rope_type == "yarn"
    assert cfg.scaling["factor"] == 4.0 and cfg.scaling["original_max_position_embeddings"] == 32768
    rope = RotaryEmbedding.from_config(QWEN25_7B_YARN)
    assert rope.attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    assert read_rope_config(to_new_form(QWEN25_7B_YARN)) == cfg


def test_phi3_longrope_reads_the_top_level_original_length():
    cfg = read_rope_config(PHI3_MINI_128K)
    assert cfg.head_dim == 96 and cfg.scaling["original_max_position_embeddings"] == 4096
    assert cfg.scaling["factor"] == 32.0  # max_position_embeddings / original
    rope = RotaryEmbedding.from_config(PHI3_MINI_128K)
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    theta = 10000.0 ** -(np.arange(0, 96, 2) / 96)
    short = np.array(PHI3_MINI_128K["rope_scaling"]["short_factor"])
    np.testing.assert_allclose(rope.inv_freq.double().numpy(), theta / short, rtol=2e-7)


def test_deepseek_v3_decoupled_rope_head_and_interleaved_layout():
    cfg = read_rope_config(DEEPSEEK_V3)
    assert cfg.head_dim == 64 and cfg.rotary_dim == 64 and cfg.layout == "interleaved"
    assert cfg.scaling["mscale"] == 1.0 and cfg.scaling["factor"] == 40
    assert RotaryEmbedding.from_config(DEEPSEEK_V3).attention_factor == 1.0


def test_gemma3_two_bases_per_layer_type_in_both_forms():
    for config in (GEMMA3_4B_NEW, GEMMA3_4B_OLD):
        full = read_rope_config(config, layer_type="full_attention")
        local = read_rope_config(config, layer_type="sliding_attention")
        assert (full.base, full.scaling) == (1e6, {"type": "linear", "factor": 8.0})
        assert (local.base, local.scaling, local.rope_type) == (1e4, None, "default")
    with pytest.raises(ValueError, match="layer_type"):
        read_rope_config(GEMMA3_4B_NEW)
    with pytest.raises(ValueError, match="chunked_attention"):
        read_rope_config(GEMMA3_4B_NEW, layer_type="chunked_attention")
    old_full = read_rope_config(GEMMA3_4B_OLD)  # no layer type: the global (scaled) RoPE
    assert old_full.base == 1e6


def test_partial_rotary_factor_and_proportional():
    neox = {"model_type": "gpt_neox", "hidden_size": 2560, "num_attention_heads": 32,
            "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    assert read_rope_config(neox).rotary_dim == 20
    new = {"model_type": "phi", "head_dim": 64,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                               "partial_rotary_factor": 0.5}}
    assert read_rope_config(new).rotary_dim == 32
    # Gemma 4's global layers take global_head_dim (512 where absent): one head size here
    prop = {"model_type": "gemma4_text", "head_dim": 64, "global_head_dim": 64,
            "rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4,
                                "partial_rotary_factor": 0.25}}
    cfg = read_rope_config(prop)
    assert (cfg.rotary_dim, cfg.p_rope, cfg.scaling) == (64, 0.25, None)
    rope = RotaryEmbedding.from_config(prop)
    assert int((rope.inv_freq > 0).sum()) == 8


def test_dynamic_uses_max_position_embeddings():
    config = {"head_dim": 64, "rope_theta": 1e4, "max_position_embeddings": 2048,
              "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "model_type": "llama"}
    assert read_rope_config(config).scaling == {"type": "dynamic", "factor": 2.0,
                                                "original_max_position_embeddings": 2048}


def test_accepts_an_object_with_to_dict():
    class Config:
        def to_dict(self):
            return dict(LLAMA31_8B)

    assert read_rope_config(Config()) == read_rope_config(LLAMA31_8B)
    with pytest.raises(TypeError, match="config"):
        read_rope_config([1, 2])


@pytest.mark.parametrize("change, match", [
    (lambda c: c["rope_scaling"].update(rope_type="llama4"), "llama4"),
    (lambda c: c["rope_scaling"].update(factr=8.0), "factr"),
    (lambda c: c["rope_scaling"].pop("low_freq_factor"), "low_freq_factor"),
    (lambda c: c.pop("rope_theta"), "rope_theta"),
    (lambda c: c["rope_scaling"].update(type="yarn"), "type"),
    (lambda c: c["rope_scaling"].update(factor=-8.0), "factor"),
    (lambda c: c["rope_scaling"].update(high_freq_factor=0.5), "high_freq_factor"),
    (lambda c: c.update(head_dim=None, hidden_size=None), "hidden_size"),
    (lambda c: c.update(partial_rotary_factor=0.15), "rotary dimension"),
    (lambda c: c.update(partial_rotary_factor=1.5), "partial_rotary_factor"),
    # the rename bug: the new key holds the default, the old one the real scaling
    (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
     "rope_parameters"),
    (lambda c: c.update(rope_scaling="llama3"), "rope_scaling"),
])
def test_bad_configs_raise_naming_the_key(change, match):
    config = {**LLAMA31_8B, "rope_scaling": dict(LLAMA31_8B["rope_scaling"])}
    change(config)
    with pytest.raises(ValueError, match=match):
        read_rope_config(config)


def test_missing_lengths_and_none_layer():
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        read_rope_config({"head_dim": 64, "rope_theta": 1e4, "model_type": "llama",
                          "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        read_rope_config({"head_dim": 64, "rope_theta": 1e4, "model_type": "llama",
                          "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    nope = {"model_type": "gemma3_text", "head_dim": 64,
            "rope_parameters": {"full_attention": None,
                                                "sliding_attention": {"rope_theta": 1e4}}}
    with pytest.raises(ValueError, match="no RoPE"):
        read_rope_config(nope, layer_type="full_attention")
    assert read_rope_config(nope, layer_type="sliding_attention").base == 1e4
    with pytest.raises(TypeError, match="layer_type"):
        read_rope_config(LLAMA31_8B, layer_type=1)


# --------------------------------------------------------------------------- pair layout
def test_layout_comes_from_the_family_never_a_default():
    llama4 = {**LLAMA31_8B, "model_type": "llama4_text"}  # same keys, other pairs
    assert read_rope_config(llama4).layout == "interleaved"
    assert read_rope_config(LLAMA31_8B).layout == "half"
    # DeepSeek-V3's config.json has no rope_interleave: DeepseekV3Config's default (True)
    no_key = {k: v for k, v in DEEPSEEK_V3.items() if k != "rope_interleave"}
    assert read_rope_config(no_key).layout == "interleaved"
    assert read_rope_config({**DEEPSEEK_V3, "rope_interleave": False}).layout == "half"
    # the argument overrides; RotaryEmbedding.from_config passes it on
    assert read_rope_config(LLAMA31_8B, layout="interleaved").layout == "interleaved"
    assert RotaryEmbedding.from_config(llama4, layout="half").layout == "half"


@pytest.mark.parametrize("config, match", [
    ({k: v for k, v in LLAMA31_8B.items() if k != "model_type"}, "no 'model_type'.*layout="),
    ({**LLAMA31_8B, "model_type": "cohere"}, "model_type 'cohere'.*layout="),
    ({**LLAMA31_8B, "rope_interleave": True}, "rope_interleave.*ignores"),
    ({**LLAMA31_8B, "rope_interleave": "yes"}, "rope_interleave"),
])
def test_unknown_layout_raises_naming_layout(config, match):
    with pytest.raises(ValueError, match=match):
        read_rope_config(config)
    with pytest.raises(ValueError, match=match):
        RotaryEmbedding.from_config(config)
    if "rope_interleave" not in config:  # the argument settles it
        assert read_rope_config(config, layout="half").layout == "half"
    with pytest.raises(ValueError, match="layout"):
        read_rope_config(LLAMA31_8B, layout="meta")


def test_a_plain_dict_with_rope_interleave_needs_no_model_type():
    config = {k: v for k, v in DEEPSEEK_V3.items() if k != "model_type"}
    assert read_rope_config(config) == read_rope_config(DEEPSEEK_V3)


def _modeling_source(model_type: str) -> str | None:
    module = {"gemma3_text": "gemma3", "gemma4_text": "gemma4", "llama4_text": "llama4"}.get(
        model_type, model_type)
    name = f"transformers.models.{module}.modeling_{module}"
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None
    return None if spec is None or spec.origin is None else Path(spec.origin).read_text()


@pytest.mark.parametrize("model_type", sorted(FAMILY_LAYOUTS))
def test_family_layouts_match_the_installed_modeling_code(model_type):
    """Each entry against its family's code: ``"half"`` families define Llama's
    ``rotate_half`` (first/second halves) or GPT-OSS's chunked halves and nothing that
    rotates adjacent pairs; ``"interleaved"`` ones rotate adjacent pairs
    (``view_as_complex`` on pairs, or ``rotate_every_two``). The oracle tests
    (test_hf_oracle.py) check the numbers for the families they cover."""
    pytest.importorskip("transformers")
    src = _modeling_source(model_type)
    if src is None:
        pytest.skip(f"the installed transformers has no {model_type}")
    rotate_half = re.search(r"def rotate_half\(x.*?\n\n", src, re.S)
    halves = bool(rotate_half) and "x[..., : x.shape[-1] // 2]" in rotate_half.group(0)
    chunked = "torch.chunk(" in src and "first_half" in src  # GPT-OSS's _apply_rotary_emb
    adjacent = "view_as_complex" in src or "def rotate_every_two" in src
    if model_type == "deepseek_v3":  # both paths, rope_interleave picks one
        assert halves and "apply_rotary_pos_emb_interleave" in src
    elif FAMILY_LAYOUTS[model_type] == "half":
        assert (halves or chunked) and not adjacent
    else:
        assert adjacent and not halves


def test_gptj_rule():
    """GPT-J: base 10000 from its code, rotary_dim a count, head_dim n_embd // n_head."""
    gptj = {"model_type": "gptj", "n_embd": 4096, "n_head": 16, "rotary_dim": 64,
            "n_positions": 2048}
    cfg = read_rope_config(gptj)
    assert cfg == RopeConfig(head_dim=256, base=10000.0, rotary_dim=64, layout="interleaved",
                             max_position_embeddings=2048)
    for change, match in (({"rotary_dim": None}, "rotary_dim"), ({"rotary_dim": 512}, "512"),
                          ({"n_head": None}, "n_head")):
        with pytest.raises(ValueError, match=match):
            read_rope_config({**gptj, **change})


def test_per_layer_config_overrides_of_the_layer_type():
    """Gemma 4's global layers: head_dim from per_layer_config (layer index -> overrides)."""
    gemma4 = {"model_type": "gemma4_text", "head_dim": 16, "num_hidden_layers": 3,
              "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
              "per_layer_config": {"2": {"head_dim": 32}},
              "rope_parameters": {
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                  "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                     "partial_rotary_factor": 0.25}}}
    assert read_rope_config(gemma4, layer_type="full_attention").head_dim == 32
    assert read_rope_config(gemma4, layer_type="sliding_attention").head_dim == 16
    flat = {**LLAMA31_8B, "per_layer_config": {"0": {"head_dim": 64}}}
    with pytest.raises(ValueError, match="per_layer_config.*layer_type"):
        read_rope_config(flat)
    uneven = {**gemma4, "layer_types": ["full_attention"] * 3}
    with pytest.raises(ValueError, match="different overrides"):
        read_rope_config(uneven, layer_type="full_attention")
    with pytest.raises(ValueError, match="layer_types"):
        read_rope_config(gemma4, layer_type="chunked_attention")
    # overrides that leave RoPE alone do not need a layer type
    kv_only = {**LLAMA31_8B, "per_layer_config": {"0": {"num_key_value_heads": 2}}}
    assert read_rope_config(kv_only) == read_rope_config(LLAMA31_8B)


def test_qwen3_next_partial_rotary_from_its_config_class():
    """Qwen3-Next: partial_rotary_factor 0.25 of head_dim 256 (the class defaults), rotate_half."""
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, "Qwen3NextConfig", None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3NextConfig")
    cfg = read_rope_config(cls().to_dict())
    assert (cfg.head_dim, cfg.rotary_dim, cfg.layout, cfg.p_rope) == (256, 64, "half", None)


def test_gemma4_file_form_global_head_dim():
    """A Gemma 4 config.json: global_head_dim (512 where absent) for full_attention layers;
    without layer_type the two head sizes are refused; other families' global_head_dim too."""
    file = {"model_type": "gemma4_text", "head_dim": 16, "global_head_dim": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                   "partial_rotary_factor": 0.25}}}
    assert read_rope_config(file, layer_type="full_attention").head_dim == 32
    assert read_rope_config(file, layer_type="sliding_attention").head_dim == 16
    absent = {k: v for k, v in file.items() if k != "global_head_dim"}
    assert read_rope_config(absent, layer_type="full_attention").head_dim == 512
    flat = {**absent, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="pass layer_type"):
        read_rope_config(flat)
    with pytest.raises(ValueError, match="global_head_dim"):
        read_rope_config({"model_type": "llama", "head_dim": 16, "global_head_dim": 32,
                          "rope_theta": 1e4})
