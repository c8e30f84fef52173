"""The library facts and package behaviour chapter 2 states in prose, held here.

Chapter 2 says that transformers' ``glm5_next`` takes no RoPE in its language layers (its text
config refuses a RoPE dimension, with the error "Expecting NoPE for the DSA attention layers");
that Hugging Face has no static NTK-aware ``rope_type``: its ``ROPE_INIT_FUNCTIONS`` lists
``linear``, ``dynamic``, ``yarn``, ``longrope``, ``llama3`` and ``proportional``, where the
package names the static rule ``"ntk"``; which partial-RoPE class defaults GPT-J, GPT-NeoX,
GLM-4 and GLM-4.5 have and that Qwen2 has q/k biases; and that the package's fast rotation,
``apply_rope``, matches the reference ``_rope`` the chapter shows, within stated bounds, and
that its float32 frequencies lie within one float32 unit of Hugging Face's and Meta's form;
and that ``glm5_next``'s vision tower, unlike its language layers, does rotate (its
``Glm5NextVisionRotaryEmbedding`` and ``apply_rotary_pos_emb_vision``); and that ``generate``
takes left-padded rows' positions from ``attention_mask.cumsum(-1) - 1``, pads at 0; and, in its
checklist, that transformers 5 keeps ``rope_theta`` and ``rope_scaling`` in
``config.rope_parameters`` and that DeepSeek-V3's attention rotates (and re-lays out) only the
``qk_rope_head_dim`` slice. These
tests call transformers and the package, so that a change to any of these facts fails here
rather than leaving the chapter's prose stale.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")


def test_glm5_next_text_config_refuses_a_rope_dimension():
    with pytest.raises(Exception, match="Expecting NoPE for the DSA attention layers") as err:
        transformers.Glm5NextTextConfig(qk_rope_head_dim=64)
    assert "but got 64 as RoPE dim" in str(err.value)


def test_glm5_next_text_config_accepts_no_rope_dimension():
    transformers.Glm5NextTextConfig()  # the defaults: NoPE language layers


def test_hugging_face_has_dynamic_ntk_but_no_static_ntk_rope_type():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert "ntk" not in ROPE_INIT_FUNCTIONS and "dynamic" in ROPE_INIT_FUNCTIONS
    # the list chapter 2 names
    assert set(ROPE_INIT_FUNCTIONS) == {"linear", "dynamic", "yarn", "longrope", "llama3",
                                        "proportional"}


def test_partial_rope_class_defaults_and_qwen2_biases():
    """Chapter 2's partial-RoPE paragraph and its q/k-bias bullet: transformers' class defaults."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    gptj = transformers.GPTJConfig()  # GPT-J 6B's shape: 64 of 256 features per head rotated
    assert (gptj.rotary_dim, gptj.n_embd, gptj.n_head) == (64, 4096, 16)
    assert gptj.n_embd // gptj.n_head == 256
    neox = transformers.GPTNeoXConfig()
    assert neox.rope_parameters["partial_rotary_factor"] == 0.25  # a quarter of each head
    # the checkpoints' older key is read into it
    assert transformers.GPTNeoXConfig(rotary_pct=0.5).rope_parameters[
        "partial_rotary_factor"] == 0.5
    assert transformers.GlmConfig().rope_parameters["partial_rotary_factor"] == 0.5  # GLM-4
    assert transformers.Glm4MoeConfig().rope_parameters["partial_rotary_factor"] == 0.5  # 4.5
    cfg = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    attn = Qwen2Attention(cfg, 0)
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_fast_path_matches_the_reference_rotation(layout):
    """Chapter 2 shows ``_rope`` and says: ``apply_rope`` gives its bits in the interleaved
    layout; in the half layout it differs within float32's rounding of the two products, and
    in bfloat16 in a few elements by one bfloat16 unit."""
    import torch

    from tutorial_pkg import RotaryEmbedding, apply_rope
    from tutorial_pkg.encodings.rope import _rope

    d_h = 64
    x_ref = torch.randn(1, 8, 4096, d_h, generator=torch.Generator().manual_seed(8))
    cos, sin = RotaryEmbedding(d_h, layout=layout).cos_sin(length=4096)  # float32 tables
    for dtype in (torch.float32, torch.bfloat16):
        x = x_ref.to(dtype)
        fast = apply_rope(x, cos, sin, layout).float()
        ref = _rope(x, cos, sin, layout).float()
        if layout == "interleaved":
            assert torch.equal(fast, ref)
            continue
        x1, x2 = x.float()[..., : d_h // 2], x.float()[..., d_h // 2 :]
        c, s = cos.abs(), sin.abs()  # size of the two products of each output
        size = torch.cat((x1.abs() * c + x2.abs() * s, x2.abs() * c + x1.abs() * s), -1)
        diff = (fast - ref).abs()
        if dtype == torch.float32:
            assert (diff <= 2**-23 * size).all()
        else:
            big = torch.maximum(fast.abs(), ref.abs()).clamp(min=2.0**-126)
            unit = 2.0 ** (torch.floor(torch.log2(big)) - 7)  # one bfloat16 unit there
            assert (diff != 0).double().mean() < 1e-4  # a few elements ...
            assert (diff <= unit + 2**-23 * size).all()  # ... by one unit at most


def test_inv_freq_is_rounded_once_and_within_one_ulp_of_the_float32_form():
    """The frequencies chapter 2's precision section starts from: ``inv_freq`` is b^(-2j/d_h)
    computed in float64 and rounded once; Hugging Face's and Meta's float32 form,
    1 / b^(2j/d_h), lies within one float32 unit of it (some entries differ by one)."""
    import torch

    from tutorial_pkg import inv_freq

    d_h = 128
    theta64 = 10_000.0 ** (-torch.arange(0, d_h, 2, dtype=torch.float64) / d_h)
    theta32 = inv_freq(d_h)
    assert torch.equal(theta32, theta64.float())
    hf_form = 1.0 / (10_000.0 ** (torch.arange(0, d_h, 2, dtype=torch.int64).float() / d_h))
    assert ((theta32.double() - hf_form.double()).abs() <= 2**-23 * theta32.double()).all()


def test_glm5_next_vision_tower_rotates():
    """Chapter 2: ``glm5_next`` takes no RoPE in its language layers, but its vision tower's
    attention does: ``Glm5NextVisionAttention`` calls ``apply_rotary_pos_emb_vision``, a
    ``rotate_half`` rotation, with the tables of ``Glm5NextVisionRotaryEmbedding``."""
    import inspect

    import torch
    from transformers.models.glm5_next import modeling_glm5_next as g5n

    assert hasattr(g5n, "Glm5NextVisionRotaryEmbedding")
    assert "apply_rotary_pos_emb_vision(" in inspect.getsource(g5n.Glm5NextVisionAttention.forward)
    from tutorial_pkg import apply_rope

    x = torch.randn(5, 2, 8)  # [tokens, heads, head_dim], as the vision attention passes it
    ang = torch.randn(5, 4)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    q, _ = g5n.apply_rotary_pos_emb_vision(x, x, cos, sin)
    ours = apply_rope(x.transpose(0, 1), ang.cos(), ang.sin(), layout="half").transpose(0, 1)
    torch.testing.assert_close(q, ours)


def test_generate_positions_are_the_mask_cumsum_minus_one_with_pads_at_zero():
    """Chapter 2's exercise on left padding: transformers' ``generate`` takes each row's
    positions from ``attention_mask.cumsum(-1) - 1`` and sets the pads' positions to 0
    (``_prepare_position_ids_for_generation``, a private method, checked here, not in the book)."""
    import torch
    from transformers.generation.utils import GenerationMixin

    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    hf_pos = GenerationMixin._prepare_position_ids_for_generation(
        None, mask, {"attention_mask": mask})
    assert torch.equal(hf_pos, (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0))


def test_rope_theta_and_rope_scaling_live_in_rope_parameters():
    """Chapter 2's checklist: transformers 5 reads a file's ``rope_theta`` and ``rope_scaling``
    into one dict, ``config.rope_parameters``; ``config.rope_scaling`` returns that dict, and
    the config has no ``rope_theta`` attribute."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = transformers.LlamaConfig(rope_theta=500_000.0, rope_scaling=dict(scaling),
                                   max_position_embeddings=131_072)
    assert cfg.rope_parameters == {**scaling, "rope_theta": 500_000.0}
    assert cfg.rope_scaling is cfg.rope_parameters
    assert not hasattr(cfg, "rope_theta")
    assert "rope_parameters" in cfg.to_dict() and "rope_theta" not in cfg.to_dict()


def test_deepseek_v3_rotates_only_its_rope_slice():
    """Chapter 2's checklist: DeepSeek-V3's attention splits each query into a pass-through
    part and a ``qk_rope_head_dim`` part and rotates (and, with ``rope_interleave``, re-lays
    out) only the latter, and its rotated key is one shared head."""
    import inspect

    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    src = inspect.getsource(ds.DeepseekV3Attention.forward)
    assert "torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim]" in src
    assert "k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)" in src
    assert "rope_interleave" in src
