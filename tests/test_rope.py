"""Tests of tutorial_pkg.encodings.rope: layouts, the complex form, weight conversion, scaling,
precision. The rotation kernels (rope_kernels) have tests/test_rope_kernels.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tutorial_pkg.encodings.rope import (
    LAYOUTS,
    RotaryEmbedding,
    apply_rope,
    apply_rope_complex,
    half_to_interleaved,
    interleaved_to_half,
    interleaved_to_half_permutation,
    inv_freq,
    precompute_freqs_cis,
    rope_angles,
    rotate_half,
    scaled_inv_freq,
)

PROPERTY = settings(max_examples=25, deadline=None)
pytestmark = pytest.mark.usefixtures("one_thread")


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def cos_sin(n_pos, dim, base=10000.0):
    angles = rope_angles(n_pos, inv_freq(dim, base))
    return angles.cos(), angles.sin()


# --------------------------------------------------------------------------- frequencies
def test_inv_freq_formula_and_dtype():
    theta = inv_freq(8, 10000.0)
    assert theta.dtype == torch.float32
    expected = torch.tensor([10000.0 ** (-2 * i / 8) for i in range(4)])
    torch.testing.assert_close(theta, expected)


def test_rope_angles_are_float32_even_for_int_positions():
    angles = rope_angles(torch.tensor([0, 3, 9], dtype=torch.int32), inv_freq(4))
    assert angles.dtype == torch.float32 and angles.shape == (3, 2)
    torch.testing.assert_close(angles[:, 0], torch.tensor([0.0, 3.0, 9.0]))
    assert rope_angles(5, inv_freq(4).double()).dtype == torch.float64


# --------------------------------------------------------------------------- layouts
def test_half_layout_equals_hugging_face_rotate_half_formula():
    x = randn(2, 3, 7, 16)
    cos, sin = cos_sin(7, 16)
    hf = x * torch.cat((cos, cos), -1) + rotate_half(x) * torch.cat((sin, sin), -1)
    torch.testing.assert_close(apply_rope(x, cos, sin, "half"), hf)


def test_complex_form_equals_interleaved_layout():
    x = randn(2, 3, 9, 16, seed=1)
    cos, sin = cos_sin(9, 16)
    meta = apply_rope_complex(x, precompute_freqs_cis(16, 9))
    torch.testing.assert_close(meta, apply_rope(x, cos, sin, "interleaved"))
    module = RotaryEmbedding(16, layout="interleaved")
    torch.testing.assert_close(module.rotate(x, torch.arange(9)), meta)


def test_interleaved_equals_half_after_permuting_features():
    x = randn(2, 2, 6, 12, seed=2)
    cos, sin = cos_sin(6, 12)
    perm = interleaved_to_half_permutation(12)
    torch.testing.assert_close(perm, torch.tensor([0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11]))
    inter = apply_rope(x, cos, sin, "interleaved")
    torch.testing.assert_close(apply_rope(x[..., perm], cos, sin, "half"), inter[..., perm])
    # without the permutation the two layouts disagree (the silent checkpoint bug)
    assert (apply_rope(x, cos, sin, "half") - inter).abs().max() > 0.1


def test_complex_form_keeps_dtype():
    x = randn(1, 1, 4, 8).to(torch.bfloat16)
    assert apply_rope_complex(x, precompute_freqs_cis(8, 4)).dtype == torch.bfloat16


# --------------------------------------------------------------------------- weight converter
def hf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``permute`` of Hugging Face's convert_llama_weights_to_hf.py (written independently)."""
    dim1 = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, dim1 // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def scores(x, wq, wk, bq, bk, n_heads, n_kv, layout, rotary_dim=None, complex_form=False):
    """Attention logits ``[b, H, s, s]`` of a q/k projection followed by RoPE."""
    b, s, _ = x.shape
    head_dim = wq.shape[0] // n_heads
    q = F.linear(x, wq, bq).view(b, s, n_heads, head_dim).transpose(1, 2)
    k = F.linear(x, wk, bk).view(b, s, n_kv, head_dim).transpose(1, 2)
    if complex_form:
        freqs = precompute_freqs_cis(head_dim, s)
        q, k = apply_rope_complex(q, freqs), apply_rope_complex(k, freqs)
    else:
        rope = RotaryEmbedding(head_dim, rotary_dim=rotary_dim, layout=layout)
        q, k = rope.rotate(q, torch.arange(s)), rope.rotate(k, torch.arange(s))
    k = k.repeat_interleave(n_heads // n_kv, dim=1)
    return q @ k.transpose(-1, -2)


@pytest.mark.parametrize(
    "n_heads, n_kv, head_dim, rotary_dim, use_bias",
    [(4, 4, 8, None, False), (4, 2, 8, None, True), (2, 1, 12, 8, True)],
)
def test_converted_weights_give_the_same_scores(n_heads, n_kv, head_dim, rotary_dim, use_bias):
    d_model = 16
    x = randn(2, 7, d_model, seed=3, dtype=torch.float64)
    wq = randn(n_heads * head_dim, d_model, seed=4, dtype=torch.float64)
    wk = randn(n_kv * head_dim, d_model, seed=5, dtype=torch.float64)
    bq = randn(n_heads * head_dim, seed=6, dtype=torch.float64) if use_bias else None
    bk = randn(n_kv * head_dim, seed=7, dtype=torch.float64) if use_bias else None
    meta = scores(x, wq, wk, bq, bk, n_heads, n_kv, "interleaved", rotary_dim,
                  complex_form=rotary_dim is None)

    def conv(t, h):
        return None if t is None else interleaved_to_half(t, h, rotary_dim)

    hf = scores(x, conv(wq, n_heads), conv(wk, n_kv), conv(bq, n_heads), conv(bk, n_kv),
                n_heads, n_kv, "half", rotary_dim)
    torch.testing.assert_close(hf, meta, rtol=1e-5, atol=1e-5)
    # loading Meta weights into a half-layout model unchanged gives other scores
    wrong = scores(x, wq, wk, bq, bk, n_heads, n_kv, "half", rotary_dim)
    assert (wrong - meta).abs().max() > 1e-2


def test_converter_equals_hugging_face_permute():
    w = randn(4 * 8, 16, seed=8)
    torch.testing.assert_close(interleaved_to_half(w, 4), hf_permute(w, 4))
    b = randn(4 * 8, seed=9)
    torch.testing.assert_close(interleaved_to_half(b, 4), hf_permute(b, 4))


@pytest.mark.parametrize("rotary_dim", [None, 4, 6])
@pytest.mark.parametrize("shape", [(3 * 8, 5), (3 * 8,)])
def test_converter_round_trip(rotary_dim, shape):
    w = randn(*shape, seed=10)
    there = half_to_interleaved(w, 3, rotary_dim)
    torch.testing.assert_close(interleaved_to_half(there, 3, rotary_dim), w, rtol=0, atol=0)
    back = interleaved_to_half(w, 3, rotary_dim)
    torch.testing.assert_close(half_to_interleaved(back, 3, rotary_dim), w, rtol=0, atol=0)
    if rotary_dim is not None:  # features past rotary_dim stay put in every head
        heads = back.reshape(3, 8, *shape[1:])
        orig = w.reshape(3, 8, *shape[1:])
        torch.testing.assert_close(heads[:, rotary_dim:], orig[:, rotary_dim:])


# --------------------------------------------------------------------------- properties
@PROPERTY
@given(
    m=st.integers(0, 1024),
    n=st.integers(0, 1024),
    shift=st.integers(0, 1024),
    seed=st.integers(0, 2**16),
    layout=st.sampled_from(LAYOUTS),
    rotary_dim=st.sampled_from([None, 8]),
)
def test_score_depends_only_on_relative_position(m, n, shift, seed, layout, rotary_dim):
    rope = RotaryEmbedding(16, rotary_dim=rotary_dim, layout=layout)
    q = randn(1, 1, 1, 16, seed=seed, dtype=torch.float64)
    k = randn(1, 1, 1, 16, seed=seed + 1, dtype=torch.float64)

    def score(i, j):
        return (rope.rotate(q, torch.tensor([i])) * rope.rotate(k, torch.tensor([j]))).sum()

    # float32 angles of positions <= 2048 are exact to ~2.5e-4 rad
    tol = 2e-3 * q.norm() * k.norm()
    assert abs(score(m + shift, n + shift) - score(m, n)) <= tol


@PROPERTY
@given(
    pos=st.lists(st.integers(0, 100_000), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    layout=st.sampled_from(LAYOUTS),
)
def test_rotation_preserves_norms(pos, seed, layout):
    rope = RotaryEmbedding(16, layout=layout)
    x = randn(2, 3, len(pos), 16, seed=seed, dtype=torch.float64)
    out = rope.rotate(x, torch.tensor(pos))
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-6, atol=1e-6)
    # each rotated pair keeps its own norm too
    pairs_in = x.reshape(*x.shape[:-1], 2, 8).norm(dim=-2) if layout == "half" else None
    if pairs_in is not None:
        pairs_out = out.reshape(*x.shape[:-1], 2, 8).norm(dim=-2)
        torch.testing.assert_close(pairs_out, pairs_in, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_rotary_leaves_tail_unchanged(layout):
    x = randn(2, 2, 5, 16, seed=11)
    pos = torch.tensor([0, 7, 100, 3, 4096])
    out = RotaryEmbedding(16, rotary_dim=6, layout=layout).rotate(x, pos)
    assert torch.equal(out[..., 6:], x[..., 6:])
    head = RotaryEmbedding(6, layout=layout).rotate(x[..., :6].contiguous(), pos)
    torch.testing.assert_close(out[..., :6], head)
    assert (out[..., :6] - x[..., :6]).abs().max() > 0.1


def test_position_zero_is_identity_and_start_offset():
    rope = RotaryEmbedding(8)
    x = randn(1, 2, 4, 8, seed=12)
    torch.testing.assert_close(rope.rotate(x[:, :, :1], torch.tensor([0])), x[:, :, :1])
    torch.testing.assert_close(rope.rotate(x, start=10), rope.rotate(x, torch.arange(10, 14)))
    q, k = rope(x, x, torch.arange(4), torch.arange(4))
    torch.testing.assert_close(q, rope.rotate(x, torch.arange(4)))
    torch.testing.assert_close(k, q)


# --------------------------------------------------------------------------- scaling
def test_linear_scaling_divides_every_frequency():
    theta, af = scaled_inv_freq(32, 10000.0, {"type": "linear", "factor": 4})
    torch.testing.assert_close(theta, inv_freq(32) / 4)
    assert af == 1.0


@pytest.mark.parametrize("dim, factor", [(32, 4.0), (128, 8.0), (64, 2.5)])
def test_ntk_keeps_highest_and_divides_lowest_frequency(dim, factor):
    theta, af = scaled_inv_freq(dim, 10000.0, {"type": "ntk", "factor": factor})
    plain = inv_freq(dim)
    assert theta[0].item() == pytest.approx(1.0)
    assert theta[-1].item() == pytest.approx(plain[-1].item() / factor, rel=1e-5)
    assert bool((theta <= plain * (1 + 1e-6)).all()) and af == 1.0


def hf_yarn_inv_freq(dim, base, factor, original_max, beta_fast=32.0, beta_slow=1.0):
    """Hugging Face's ``_compute_yarn_parameters`` re-derived in numpy float64."""

    def correction_dim(n_rot):
        return dim * math.log(original_max / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv, attention


@pytest.mark.parametrize(
    "dim, base, factor, original, betas",
    [
        (128, 10000.0, 4.0, 4096, {}),
        (64, 500000.0, 8.0, 8192, {}),
        (32, 10000.0, 16.0, 2048, {"beta_fast": 16.0, "beta_slow": 2.0}),
        (16, 10000.0, 2.0, 64, {}),
    ],
)
def test_yarn_matches_hugging_face_reference(dim, base, factor, original, betas):
    scaling = {"type": "yarn", "factor": factor, "original_max_position_embeddings": original,
               **betas}
    theta, af = scaled_inv_freq(dim, base, scaling)
    ref, ref_af = hf_yarn_inv_freq(dim, base, factor, original, **betas)
    np.testing.assert_allclose(theta.double().numpy(), ref, rtol=1e-6)
    assert af == pytest.approx(ref_af) == pytest.approx(0.1 * math.log(factor) + 1.0)


def test_yarn_keeps_high_and_interpolates_low_frequencies():
    # dim 128, base 1e4, L = 4096: pairs below ~20 turn > 32 times (kept), above ~46 < once
    theta, _ = scaled_inv_freq(128, 10000.0, {"type": "yarn", "factor": 8,
                                              "original_max_position_embeddings": 4096})
    plain = inv_freq(128)
    torch.testing.assert_close(theta[:20], plain[:20])
    torch.testing.assert_close(theta[46:], plain[46:] / 8)
    ratio = plain / theta
    assert bool((ratio.diff() >= -1e-6).all())  # interpolation grows monotonically


def test_yarn_attention_factor_scales_cos_sin_and_scores():
    factor = 4.0
    rope = RotaryEmbedding(16, scaling={"type": "yarn", "factor": factor,
                                        "original_max_position_embeddings": 32})
    expected = 0.1 * math.log(factor) + 1.0
    assert rope.attention_factor == pytest.approx(expected)
    cos, sin = rope.cos_sin(torch.arange(50))
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, expected**2))
    q, k = randn(1, 1, 1, 16, seed=13), randn(1, 1, 1, 16, seed=14)
    pos = torch.tensor([9])
    got = (rope.rotate(q, pos) * rope.rotate(k, pos)).sum()
    torch.testing.assert_close(got, (q * k).sum() * expected**2)


def test_set_scaling_clears_cache_and_changes_frequencies():
    rope = RotaryEmbedding(16)
    rope.rotate(randn(1, 1, 3, 16))
    assert rope.cos_cached.shape[0] > 0
    rope.set_scaling({"type": "linear", "factor": 2})
    assert rope.cos_cached.shape[0] == 0
    torch.testing.assert_close(rope.inv_freq, inv_freq(16) / 2)
    rope.set_scaling(None)
    torch.testing.assert_close(rope.inv_freq, inv_freq(16))


# --------------------------------------------------------------------------- cache
def test_cos_sin_cache_grows_on_demand_and_is_not_in_state_dict():
    rope = RotaryEmbedding(8)
    assert rope.cos_cached.shape[0] == 0
    x = randn(1, 1, 3, 8)
    rope.rotate(x)
    small = rope.cos_cached.shape[0]
    assert 3 <= small
    rope.rotate(x[:, :, :1], start=small + 500)
    assert rope.cos_cached.shape[0] >= small + 501
    # explicit positions are turned into angles directly: equal values, cache untouched
    grown = rope.cos_cached.shape[0]
    far = torch.tensor([grown + 7])
    direct = rope.rotate(x[:, :, :1], far)
    assert rope.cos_cached.shape[0] == grown
    torch.testing.assert_close(direct, rope.rotate(x[:, :, :1], start=grown + 7),
                               rtol=0, atol=0)
    angles = rope_angles(rope.cos_cached.shape[0], inv_freq(8))
    torch.testing.assert_close(rope.cos_cached, angles.cos())
    torch.testing.assert_close(rope.sin_cached, angles.sin())
    assert len(rope.state_dict()) == 0
    cos_a, sin_a = rope.cos_sin(start=5, length=4)
    cos_b, sin_b = rope.cos_sin(torch.arange(5, 9))
    torch.testing.assert_close((cos_a, sin_a), (cos_b, sin_b))


def test_module_dtype_cast_does_not_round_frequencies():
    # .to(bfloat16) would round inv_freq to 8 bits: ~1 rad of error at position 30000
    rope = RotaryEmbedding(64).to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32
    x = randn(1, 1, 1, 64, seed=15).to(torch.bfloat16)
    pos = torch.tensor([30000])
    ref = RotaryEmbedding(64).rotate(x.float(), pos)
    assert (rope.rotate(x, pos).float() - ref).abs().max() < 0.05


# --------------------------------------------------------------------------- precision
def float64_rope(x: torch.Tensor, positions: torch.Tensor, dim: int, base=10000.0):
    """Reference rotation (half layout) with angles and products in float64."""
    i = torch.arange(0, dim, 2, dtype=torch.float64)
    angles = positions.double()[:, None] * base ** (-i / dim)[None, :]
    x = x.double()
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    c, s = angles.cos(), angles.sin()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


# Stated tolerances: max |error| / max |x| of the package's RoPE against the float64
# rotation, at positions up to 32768: 2 * eps of the dtype (bf16: 1.6e-2, fp16: 2.0e-3),
# i.e. the rounding of cos/sin and of the products, nothing from the angles (formed in
# float32). float32 itself stays under 1e-3 (its angles near 32768 are off by < 2e-3 rad).
PRECISION = {
    torch.float32: 1e-3,
    torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps,
    torch.float16: 2 * torch.finfo(torch.float16).eps,
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_rope_stays_close_to_float32_at_long_positions(dtype):
    dim = 64
    positions = torch.tensor([0, 1, 255, 1000, 4095, 10000, 20001, 32767, 32768])
    x = randn(2, 4, len(positions), dim, seed=16).to(dtype)
    scale = x.abs().max().double()
    ref = float64_rope(x, positions, dim)
    rope = RotaryEmbedding(dim)

    err32 = (rope.rotate(x.float(), positions).double() - ref).abs().max() / scale
    err = (rope.rotate(x, positions).double() - ref).abs().max() / scale
    assert err32 <= PRECISION[torch.float32]
    assert err <= PRECISION[dtype]

    # the naive alternative: angles m * theta formed in the low-precision dtype
    angles = positions.to(dtype)[:, None] * inv_freq(dim).to(dtype)[None, :]
    naive = apply_rope(x, angles.cos(), angles.sin(), "half")
    naive_err = (naive.double() - ref).abs().max() / scale
    assert naive_err > 0.3  # essentially random rotations at long positions
    assert naive_err > 20 * err


# --------------------------------------------------------------------------- HF's tables
def _hf_tables(s: int, r: int, base: float = 10_000.0):
    """Hugging Face's form: ``[b, 1, s, r]``, the ``r/2`` angles twice (cat(freqs, freqs))."""
    ang = rope_angles(s, inv_freq(r, base))
    emb = torch.cat((ang, ang), dim=-1)[None, None].expand(2, 1, s, r)
    return emb.cos(), emb.sin(), ang


@pytest.mark.parametrize("r", [4, 8, 12, 16])
def test_apply_rope_refuses_hf_duplicated_tables(r):
    """HF's duplicated-halves tables are refused, saying how to pass them (by value where
    they fit the shape check, by shape where they cover more than d features); their
    first half is the package's form and rotates as rotate_half does."""
    x = torch.randn(2, 3, 10, 16)
    cos, sin, ang = _hf_tables(10, r)
    with pytest.raises(ValueError, match=r"cos\[\.\.\., : cos.shape\[-1\] // 2\]"):
        apply_rope(x, cos, sin)
    got = apply_rope(x, cos[..., : r // 2], sin[..., : r // 2])
    emb = torch.cat((ang, ang), dim=-1)
    want = torch.cat((x[..., :r] * emb.cos() + rotate_half(x[..., :r]) * emb.sin(),
                      x[..., r:]), dim=-1)
    torch.testing.assert_close(got, want)


def test_apply_rope_accepts_tables_with_equal_halves_that_do_not_rotate():
    """Position 0 alone (cos 1, sin 0): both readings are the identity, nothing to refuse."""
    x = torch.randn(1, 1, 1, 16)
    cos, sin = torch.ones(1, 8), torch.zeros(1, 8)
    torch.testing.assert_close(apply_rope(x, cos, sin), x)
