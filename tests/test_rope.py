"""Tests of tutorial_pkg.encodings.rope: layouts, the complex form, weight conversion, scaling,
precision."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

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
from tutorial_pkg.encodings.rope_kernels import fast_rope

PROPERTY = settings(max_examples=25, deadline=None)
pytestmark = pytest.mark.usefixtures("one_thread")
# Set TUTORIAL_PKG_SKIP_SLOW=1 to skip the torch.compile tests (inductor codegen, seconds).
slow = pytest.mark.skipif(os.environ.get("TUTORIAL_PKG_SKIP_SLOW") == "1",
                          reason="TUTORIAL_PKG_SKIP_SLOW=1")


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


# --------------------------------------------------------------------------- fast paths (chapter 5)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rotary_fast_path_equals_apply_rope_with_gradients(layout, dtype):
    gen = torch.Generator().manual_seed(0)
    rot = RotaryEmbedding(16, layout=layout)
    x = torch.randn(2, 6, 3, 16, generator=gen).to(dtype).transpose(1, 2)  # like q from MHA
    x.requires_grad_(True)
    cos, sin = rot.cos_sin(start=5, length=6)
    got, want = rot.rotate(x, start=5), apply_rope(x, cos, sin, layout)
    tol = {torch.bfloat16: 2e-2}.get(dtype, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    g = torch.randn(got.shape, generator=gen).to(dtype)
    (g_got,) = torch.autograd.grad(got, x, g)
    (g_want,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(g_got, g_want, atol=tol, rtol=tol)


def _old_16bit_rope(x, cos, sin):
    """The default path before issue 25, for 16-bit x: tables rounded to x's dtype,
    x * [cos, cos] rounded, then -/+ x * sin added and rounded again."""
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    half = c.shape[-1]
    y = x * torch.cat((c, c), dim=-1)
    y[..., :half].addcmul_(x[..., half:], s, value=-1)
    y[..., half:].addcmul_(x[..., :half], s)
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_rope_is_computed_in_float32_and_rounded_once(dtype):
    """16-bit q/k are rotated in float32 with float32 tables and rounded once: at random
    positions up to 1e5, at least as close to float64 as the old 16-bit form (three
    roundings) and as Hugging Face's bf16 apply_rotary_pos_emb, and within one ulp of the
    correctly rounded rotation (equal to it but where float32 cancellation decides)."""
    d, half = 64, 32
    gen = torch.Generator().manual_seed(25)
    pos = torch.randint(0, 100_001, (4096,), generator=gen)
    x = torch.randn(2, 4, len(pos), d, generator=gen).to(dtype)  # 4 MiB: the blocked path
    rope = RotaryEmbedding(d)
    cos, sin = rope.cos_sin(pos)
    xd, c, s = x.double(), cos.double(), sin.double()
    x1, x2 = xd[..., :half], xd[..., half:]
    ref = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)  # float64 on the same tables
    exact = float64_rope(x, pos, d)  # float64 angles too
    with torch.no_grad():
        new = rope.rotate(x, pos)
        assert torch.equal(new, fast_rope(cos, sin, "half", x.transpose(0, 1))[0].transpose(0, 1))
    old = _old_16bit_rope(x, cos, sin)
    for target in (ref, exact):
        err_new, err_old = (new.double() - target).abs(), (old.double() - target).abs()
        assert err_new.max() <= err_old.max() and err_new.pow(2).mean() < err_old.pow(2).mean()
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf = apply_rotary_pos_emb(x, x, torch.cat((cos, cos), -1)[None].to(dtype),
                              torch.cat((sin, sin), -1)[None].to(dtype))[0]
    assert (new.double() - ref).abs().max() <= (hf.double() - ref).abs().max()
    # one rounding: within one ulp of the correctly rounded value, where a result much
    # smaller than its two terms (cancellation) may also carry float32's error of them
    rounded = ref.to(dtype)
    mant = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    tiny = torch.finfo(dtype).tiny
    ulp = torch.exp2(torch.floor(torch.log2(rounded.double().abs().clamp_min(tiny))) - mant)
    terms = torch.cat(((x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()), -1)
    off = (new.double() - rounded.double()).abs()
    assert bool((off <= torch.maximum(ulp, 2.0**-22 * terms)).all())
    assert (off <= ulp).double().mean() > 0.9999
    assert (new == rounded).double().mean() > 0.999
    assert (old == rounded).double().mean() < 0.8  # the old form: a third of them off


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_rope_same_bits_blocked_or_not_and_backward_matches_float32(dtype):
    rot = RotaryEmbedding(64)
    x = torch.randn(2, 4, 3000, 64).to(dtype)
    cos, sin = rot.cos_sin(start=0, length=3000)
    with torch.no_grad():
        blocked = rot.rotate(x)
    xg = x.clone().requires_grad_(True)
    out = rot.rotate(xg)  # autograd: not block by block
    assert torch.equal(out.detach(), blocked)
    g = torch.randn(out.shape).to(dtype)
    (grad,) = torch.autograd.grad(out, xg, g)
    x32 = x.float().requires_grad_(True)
    (grad32,) = torch.autograd.grad(rot.rotate(x32), x32, g.float())
    # the backward runs in float32 too and rounds once: float32's gradient, rounded
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.float(), grad32.to(dtype).float(), rtol=0,
                               atol=torch.finfo(dtype).eps * grad32.abs().max().item())
    assert (grad == grad32.to(dtype)).double().mean() > 0.999


def test_16bit_rope_function_gradcheck_in_float64():
    # the ops of the unblocked 16-bit path (_rope_half_upcast), run in float64
    from tutorial_pkg.encodings.rope_kernels import _rope_half_upcast

    rot = RotaryEmbedding(8)
    cos, sin = (t.double() for t in rot.cos_sin(start=3, length=5))
    x = randn(2, 5, 8, seed=17, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: _rope_half_upcast(t, cos, sin), (x,))
    torch.testing.assert_close(_rope_half_upcast(x, cos, sin), apply_rope(x, cos, sin))


def test_rotary_pair_equals_two_rotations():
    rot = RotaryEmbedding(16)
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    pos = torch.tensor([3, 4, 5, 6, 7])
    for q_pos, k_pos in ((None, None), (pos, pos), (pos, pos.flip(0))):
        got = rot(q, k, q_pos, k_pos)
        want = (rot.rotate(q, q_pos), rot.rotate(k, k_pos))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    with pytest.raises(ValueError, match="k must be"):
        rot(q, torch.randn(2, 2, 5, 8))


def test_rotary_partial_rotation_takes_the_reference_path():
    rot = RotaryEmbedding(16, rotary_dim=8)
    x = torch.randn(1, 2, 5, 16)
    cos, sin = rot.cos_sin(start=0, length=5)
    torch.testing.assert_close(rot.rotate(x), apply_rope(x, cos, sin))
    assert torch.equal(rot.rotate(x)[..., 8:], x[..., 8:])


@slow
def test_fused_rope_equals_eager():
    # compiles one small elementwise kernel (a few seconds cold)
    fused, eager = RotaryEmbedding(16, fused=True), RotaryEmbedding(16)
    assert "fused=True" in repr(fused) and "fused" not in repr(eager)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 4e-2)):
        x, k = torch.randn(2, 3, 7, 16).to(dtype), torch.randn(2, 1, 7, 16).to(dtype)
        got = fused.rotate(x, start=2)
        assert got.dtype == dtype
        torch.testing.assert_close(got, eager.rotate(x, start=2), atol=tol, rtol=tol)
        for got, want in zip(fused(x, k, start=2), eager(x, k, start=2), strict=True):  # q, k
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    with pytest.raises(TypeError, match="fused"):
        RotaryEmbedding(16, fused=1)


@slow
def test_fused_rope_positions_scaling_and_gradients():
    # the fused path keeps its own cast cos/sin table per dtype: it must follow explicit
    # positions, a change of scaling and cache growth, and it must train like the eager one
    fused, eager = RotaryEmbedding(16, fused=True), RotaryEmbedding(16)
    x, k = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16)
    pos = torch.tensor([7, 0, 300, 2, 2])  # 300 grows the cache past its first 256 rows
    torch.testing.assert_close(fused.rotate(x, pos), eager.rotate(x, pos))
    for rope in (fused, eager):
        rope.set_scaling({"type": "linear", "factor": 4.0})
    torch.testing.assert_close(fused.rotate(x, start=3), eager.rotate(x, start=3))
    torch.testing.assert_close(fused.rotate(x, pos), eager.rotate(x, pos))
    grads = []
    for rope in (fused, eager):
        xq, xk = x.clone().requires_grad_(), k.clone().requires_grad_()
        q_rot, k_rot = rope(xq, xk, start=1)
        (q_rot * k_rot.flip(-1)).sum().backward()
        grads.append((xq.grad, xk.grad))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)


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


# --------------------------------------------------------------------------- the speed record
SPEED_RECORD = Path(__file__).resolve().parents[1] / "book" / "data" / "rope_speed_cpu.json"


def test_rope_speed_cases_compute_the_rotation():
    # the benchmark's cases, on a small shape: each returns q and k rotated as apply_rope does
    from benchmarks.rope_speed import REFERENCE, rope_cases

    b, h, s, d = 1, 2, 16, 8
    cases = rope_cases((b, h, s, d), torch.float64)
    gen = torch.Generator().manual_seed(s)  # the cases' own inputs
    q, k = (torch.randn(b, h, s, d, generator=gen).to(torch.float64) for _ in range(2))
    cos, sin = cos_sin(s, d)
    want = (apply_rope(q, cos, sin), apply_rope(k, cos, sin))
    assert {REFERENCE, "rotate (attention)", "rotate", "apply_rope"} <= set(cases)
    for name, call in cases.items():
        got = call()
        expected = (q, k) if name == REFERENCE else want
        for g, w in zip(got, expected, strict=True):
            torch.testing.assert_close(g, w, msg=name)


def test_rope_speed_record_is_well_formed_and_states_ratios():
    """The recorded run (benchmarks/rope_speed.py): where it ran, how busy the machine was,
    and per dtype each case's ratio to the copy of q and k with its range over rounds."""
    from tutorial_pkg.measure.cases import load_results

    hardware, records = load_results(SPEED_RECORD)
    for key in ("cpu", "torch", "date", "loadavg", "loadavg_end", "malloc", "command"):
        assert hardware.get(key) is not None, key
    assert hardware["num_threads"] == 1
    summary = json.loads(SPEED_RECORD.read_text(encoding="utf-8"))["summary"]
    assert set(summary) == {"float32", "bfloat16"}
    for dtype, cases in summary.items():
        group = [r for r in records if r.params["dtype"] == dtype]
        assert {r.reference for r in group} == {"copy q,k"}
        assert {"copy q,k", "rotate (attention)", "rotate", "apply_rope",
                "hf apply_rotary_pos_emb"} <= set(cases)
        for r in group:
            assert r.ok and len(r.round_ratios) >= 3, (dtype, r.case)
            stated = cases[r.case]
            assert stated["ratio"] == pytest.approx(r.ratio, abs=1e-3)
            assert stated["round_min"] <= stated["ratio"] <= stated["round_max"]
        assert cases["copy q,k"]["ratio"] == 1.0
