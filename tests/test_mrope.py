"""Tests of tutorial_pkg.encodings.mrope: M-RoPE's axis per frequency (contiguous and
interleaved), the positions of a text and image sequence against transformers'
get_rope_index, the rotation against Qwen2.5-VL's and Qwen3-VL's own rotary code, and text
alone equal to RoPE. The loaded Qwen-VL text attention is held to transformers in
tests/test_hf_oracle.py."""

from __future__ import annotations

import types

import pytest
import torch

import tutorial_pkg as tp
from tutorial_pkg.encodings.mrope import MRotary, mrope_axes, mrope_positions

transformers = pytest.importorskip("transformers")

SEGMENTS = [("text", 3), ("image", (1, 2, 3)), ("text", 2), ("image", (2, 2, 2)), ("text", 1)]


def test_axes_contiguous_and_interleaved():
    assert mrope_axes((2, 1, 1)).tolist() == [0, 0, 1, 2]
    assert mrope_axes((16, 24, 24)).bincount().tolist() == [16, 24, 24]
    # Qwen3-VL: height and width every third pair, time the rest
    assert mrope_axes((4, 2, 2), interleaved=True).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    with pytest.raises(ValueError, match="3 entries"):
        mrope_axes((4, 4))
    with pytest.raises(ValueError, match="sums to 6 pairs, not head_dim / 2 = 8"):
        MRotary(16, mrope_section=(2, 2, 2))


def test_positions_equal_transformers_get_rope_index():
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    cfg = transformers.Qwen2_5_VLConfig()
    merge = cfg.vision_config.spatial_merge_size
    model = types.SimpleNamespace(config=cfg)
    model.get_vision_position_ids = (
        lambda *a, **k: m.Qwen2_5_VLModel.get_vision_position_ids(model, *a, **k))
    kinds, grids = [], []
    for kind, size in SEGMENTS:
        if kind == "text":
            kinds += [0] * size
        else:
            t, h, w = size
            kinds += [1] * (t * h * w)
            grids.append([t, h * merge, w * merge])  # the grid before the spatial merge
    ids = torch.zeros(1, len(kinds), dtype=torch.long)
    want, _ = m.Qwen2_5_VLModel.get_rope_index(model, ids, torch.tensor([kinds]),
                                               image_grid_thw=torch.tensor(grids))
    assert torch.equal(mrope_positions(SEGMENTS), want)


def _hf_rotation(module, config_cls, section, x, positions):
    config = config_cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_hidden_layers=1, vocab_size=32, intermediate_size=64,
                        pad_token_id=None, bos_token_id=None, eos_token_id=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                         "mrope_section": list(section)})
    rotary = getattr(module, [n for n in dir(module) if n.endswith("RotaryEmbedding")
                              and "Vision" not in n][0])(config)
    cos, sin = rotary(x, positions)
    return module.apply_rotary_pos_emb(x, x, cos, sin)[0]


@pytest.mark.parametrize("interleaved", [False, True], ids=["qwen2_5_vl", "qwen3_vl"])
def test_rotation_equals_transformers(interleaved):
    if interleaved:
        from transformers.models.qwen3_vl import modeling_qwen3_vl as module
        config_cls = transformers.Qwen3VLTextConfig
    else:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as module
        config_cls = transformers.Qwen2_5_VLTextConfig
    section = (4, 2, 2)
    pos = mrope_positions(SEGMENTS, start=5).expand(3, 2, -1)
    x = torch.randn(2, 4, pos.shape[-1], 16, dtype=torch.float64)
    want = _hf_rotation(module, config_cls, section, x, pos)
    enc = MRotary(16, 5e5, mrope_section=section, interleaved=interleaved)
    got = enc.rotate(x, x, pos, pos)[0]
    # the package's inv_freq is base ** -x rounded once to float32, transformers' computed in
    # float32: the angles differ in their last bits (TABLE_TOL of test_hf_oracle.py)
    torch.testing.assert_close(got, want, atol=5e-6, rtol=0)
    # the other assignment is another rotation
    other = MRotary(16, 5e5, mrope_section=section, interleaved=not interleaved)
    assert (other.rotate(x, x, pos, pos)[0] - want).abs().max() > 1e-3


def test_text_alone_is_rope():
    enc = MRotary(16, 10_000.0, mrope_section=(2, 3, 3))
    rope = tp.Rotary(16, 10_000.0)
    q, k = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16)
    pos = torch.arange(3, 12)[None]
    for got, want in zip(enc.rotate(q, k, pos, pos), rope.rotate(q, k, pos, pos), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert tp.make_encoding("mrope", head_dim=16, mrope_section=(2, 3, 3)).head_dim == 16


def test_a_layer_takes_three_axis_positions_only_with_mrope():
    pos = mrope_positions(SEGMENTS)
    s = pos.shape[-1]
    x = torch.randn(1, s, 32)
    layer = tp.MultiHeadAttention(32, 2, MRotary(16, mrope_section=(4, 2, 2)))
    out = layer(x, positions=pos)
    step, cache = [], tp.KVCache()
    for t in range(s):  # decoding with the cache, each token its three positions
        step.append(layer(x[:, t : t + 1], positions=pos[:, :, t : t + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(step, dim=1), out, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"M-RoPE's \[3, b, s\]"):
        tp.MultiHeadAttention(32, 2, tp.Rotary(16))(x, positions=pos)
    with pytest.raises(ValueError, match=r"must have shape \(3, 1 or 1"):
        layer(x, positions=pos[:2])
