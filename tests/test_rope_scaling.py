"""Every RoPE scaling rule against an independent transcription of its published formula.

The references below are written from the papers / reference code (Meta's
``apply_scaling`` for Llama 3.1, the YaRN paper's ``find_correction_range``,
LongRoPE's per-dimension divisors, the dynamic-NTK base formula), in numpy float64,
element by element where the source is a loop; they do not call the package.
"""

import math

import numpy as np
import pytest
import torch

from tutorial_pkg import RotaryEmbedding, inv_freq
from tutorial_pkg.encodings.rope_scaling import (
    ROPE_SCALINGS,
    depends_on_length,
    dynamic_ntk_scaling,
    llama3_scaling,
    longrope_scaling,
    p_rope_inv_freq,
    scaled_inv_freq,
    seq_len_after,
    yarn_mscale,
    yarn_scaling,
)


def ref_theta(dim, base):
    return np.array([base ** (-(2 * j) / dim) for j in range(dim // 2)])


def ref_llama3(dim, base, factor, low, high, old_len):
    """Meta's ``apply_scaling`` (llama-models, Llama 3.1), as a loop over frequencies."""
    out = []
    for freq in ref_theta(dim, base):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def ref_yarn(dim, base, factor, orig, beta_fast=32, beta_slow=1, mscale=None, mscale_all_dim=None,
             truncate=True):
    """YaRN (Peng et al.): correction range from rotations, linear ramp, mscale."""

    def dim_for(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for j, freq in enumerate(ref_theta(dim, base)):
        ramp = min(max((j - low) / (high - low), 0.0), 1.0)  # 0: keep, 1: interpolate
        out.append(freq * (1 - ramp) + freq / factor * ramp)

    def m(scale, ms=1.0):
        return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

    att = m(factor, mscale) / m(factor, mscale_all_dim) if mscale and mscale_all_dim else m(factor)
    return np.array(out), att


def ref_dynamic(dim, base, factor, orig, seq_len):
    seq_len = max(seq_len, orig)
    new_base = base * ((factor * seq_len / orig) - (factor - 1)) ** (dim / (dim - 2))
    return ref_theta(dim, new_base)


def real_shaped_factors(n, top, seed):
    """Monotone per-dimension divisors from ~1 to ``top``, the shape of Phi-3's lists."""
    rng = np.random.default_rng(seed)
    return list(np.round(1 + (top - 1) * np.sort(rng.random(n)) ** 3, 4))


def close(got, ref, rtol=2e-7):
    np.testing.assert_allclose(got.double().numpy(), ref, rtol=rtol, atol=0)


# --------------------------------------------------------------------------- llama3
LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("dim, base, params", [
    (128, 500000.0, LLAMA31),  # Llama 3.1 8B / 70B / 405B
    (64, 500000.0, {**LLAMA31, "factor": 32.0}),  # Llama 3.2 1B/3B: factor 32
    (128, 10000.0, {"factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                    "original_max_position_embeddings": 2048}),
])
def test_llama3_matches_meta_apply_scaling(dim, base, params):
    theta, af = scaled_inv_freq(dim, base, {"type": "llama3", **params})
    ref = ref_llama3(dim, base, params["factor"], params["low_freq_factor"],
                     params["high_freq_factor"], params["original_max_position_embeddings"])
    close(theta, ref)
    assert af == 1.0


def test_llama31_bands():
    theta, _ = llama3_scaling(128, 500000.0, factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=8192)
    plain = inv_freq(128, 500000.0)
    wavelength = 2 * math.pi / plain.double()
    kept, divided = wavelength < 8192 / 4, wavelength > 8192
    assert int(kept.sum()) > 0 and int(divided.sum()) > 0
    assert torch.equal(theta[kept], plain[kept])
    torch.testing.assert_close(theta[divided], plain[divided] / 8)
    band = ~kept & ~divided
    assert int(band.sum()) > 0
    assert bool(((theta[band] < plain[band]) & (theta[band] > plain[band] / 8)).all())


def test_llama3_equal_factors_is_a_step():  # Llama 4 Scout: low = high = 1
    theta, _ = llama3_scaling(128, 500000.0, factor=16.0, low_freq_factor=1.0,
                              high_freq_factor=1.0, original_max_position_embeddings=8192)
    plain = ref_theta(128, 500000.0)
    ref = np.where(2 * math.pi / plain > 8192, plain / 16, plain)
    close(theta, ref)
    assert bool(torch.isfinite(theta).all())


# --------------------------------------------------------------------------- yarn
@pytest.mark.parametrize("dim, base, params", [
    (128, 1e6, {"factor": 4.0, "original_max_position_embeddings": 32768}),  # Qwen2.5 YaRN
    (64, 10000.0, {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                   "mscale_all_dim": 1.0}),  # DeepSeek-V3 (qk_rope_head_dim 64)
    (64, 10000.0, {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
                   "mscale_all_dim": 0.707}),  # DeepSeek-V2
    (128, 10000.0, {"factor": 16.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                    "mscale_all_dim": 0.5}),
    (128, 150000.0, {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "truncate": False}),  # gpt-oss-like: no rounding
    (16, 10000.0, {"factor": 2.0, "original_max_position_embeddings": 64}),
])
def test_yarn_matches_the_paper(dim, base, params):
    theta, af = scaled_inv_freq(dim, base, {"type": "yarn", **params})
    p = dict(params)
    ref, ref_af = ref_yarn(dim, base, p.pop("factor"), p.pop("original_max_position_embeddings"),
                           **p)
    close(theta, ref)
    assert af == pytest.approx(ref_af, rel=1e-12)


def test_yarn_attention_factors():
    assert yarn_scaling(128, 1e6, factor=4.0,
                        original_max_position_embeddings=32768)[1] == pytest.approx(
        0.1 * math.log(4) + 1)
    # DeepSeek-V3: mscale == mscale_all_dim, so cos/sin are not scaled (its attention
    # multiplies the softmax scale by yarn_mscale(40, 1) ** 2 instead)
    assert yarn_scaling(64, 1e4, factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                        mscale_all_dim=1.0)[1] == 1.0
    assert yarn_scaling(64, 1e4, factor=40.0, original_max_position_embeddings=4096,
                        attention_factor=1.25)[1] == 1.25
    assert yarn_mscale(1.0) == 1.0 and yarn_mscale(0.5) == 1.0
    assert yarn_mscale(40.0, 1.0) == pytest.approx(0.1 * math.log(40) + 1)


def test_yarn_truncate_changes_the_ramp():
    kw = {"factor": 32.0, "original_max_position_embeddings": 4096}
    a, _ = yarn_scaling(64, 150000.0, truncate=True, **kw)
    b, _ = yarn_scaling(64, 150000.0, truncate=False, **kw)
    assert not torch.equal(a, b)
    with pytest.raises(TypeError, match="truncate"):
        yarn_scaling(64, 150000.0, truncate="no", **kw)


# --------------------------------------------------------------------------- dynamic
@pytest.mark.parametrize("seq_len", [None, 100, 4096, 4097, 8192, 20000])
def test_dynamic_ntk_matches_formula(seq_len):
    theta, af = dynamic_ntk_scaling(128, 10000.0, factor=2.0, original_max_position_embeddings=4096,
                                    seq_len=seq_len)
    close(theta, ref_dynamic(128, 10000.0, 2.0, 4096, seq_len or 4096))
    assert af == 1.0
    if seq_len is None or seq_len <= 4096:
        close(theta, ref_theta(128, 10000.0))


def test_rotary_dynamic_follows_the_length_like_hugging_face():
    """HF ``dynamic_rope_update``: grow past the largest length seen, reset under L0."""
    dim, orig = 16, 32
    rope = RotaryEmbedding(dim, scaling={"type": "dynamic", "factor": 2.0,
                                         "original_max_position_embeddings": orig})
    x = torch.randn(1, 1, 80, dim, generator=torch.Generator().manual_seed(0))

    def freqs_for(n):
        return torch.from_numpy(ref_dynamic(dim, 10000.0, 2.0, orig, n)).float()

    rope.rotate(x[:, :, :20])
    torch.testing.assert_close(rope.inv_freq, freqs_for(orig))  # under L0: plain
    out = rope.rotate(x[:, :, :80])  # past L0: the base for 80
    torch.testing.assert_close(rope.inv_freq, freqs_for(80))
    angles = torch.arange(80)[:, None].float() * freqs_for(80)
    x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
    ref = torch.cat((x1 * angles.cos() - x2 * angles.sin(),
                     x2 * angles.cos() + x1 * angles.sin()), dim=-1)
    torch.testing.assert_close(out, ref)
    rope.rotate(x[:, :, :50])  # between L0 and the largest: keeps the grown base
    torch.testing.assert_close(rope.inv_freq, freqs_for(80))
    rope.rotate(x[:, :, :1], torch.tensor([99]))  # explicit positions count too
    torch.testing.assert_close(rope.inv_freq, freqs_for(100))
    rope.rotate(x[:, :, :10])  # back under L0: the original base
    torch.testing.assert_close(rope.inv_freq, freqs_for(orig))


def test_dynamic_kv_cache_caveat():
    """Keys cached before the base grew keep their old angles: scores then differ."""
    dim, orig = 16, 32
    rope = RotaryEmbedding(dim, scaling={"type": "dynamic", "factor": 4.0,
                                         "original_max_position_embeddings": orig})
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 64, dim, generator=g), torch.randn(1, 1, 64, dim, generator=g)
    cached = rope.rotate(k[:, :, :orig])  # the prompt, rotated with the original base
    k_new = rope.rotate(k[:, :, orig:], start=orig)  # decoding past L0 grows the base
    q_last = rope.rotate(q[:, :, -1:], start=63)
    incremental = q_last @ torch.cat((cached, k_new), dim=-2).transpose(-1, -2)
    full = rope.rotate(q, start=0)[:, :, -1:] @ rope.rotate(k).transpose(-1, -2)
    assert (incremental[..., :orig] - full[..., :orig]).abs().max() > 1e-3
    torch.testing.assert_close(incremental[..., orig:], full[..., orig:])


# --------------------------------------------------------------------------- longrope
def test_longrope_matches_formula_and_switches_at_original_length():
    dim, base, orig = 96, 10000.0, 4096  # Phi-3-mini-128k: head_dim 96
    short, long = real_shaped_factors(48, 1.2, 0), real_shaped_factors(48, 60.0, 1)
    params = {"short_factor": short, "long_factor": long, "original_max_position_embeddings": orig,
              "factor": 131072 / 4096}
    for seq_len, factors in ((None, short), (4096, short), (4097, long), (131072, long)):
        theta, af = longrope_scaling(dim, base, seq_len=seq_len, **params)
        close(theta, ref_theta(dim, base) / np.array(factors))
        assert af == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-12)
    assert longrope_scaling(dim, base, attention_factor=1.5, **params)[1] == 1.5
    assert longrope_scaling(dim, base, **{**params, "factor": 1.0})[1] == 1.0


def test_rotary_longrope_uses_long_factors_past_the_original_length():
    dim, orig = 8, 16
    short, long = [1.0, 1.0, 1.5, 2.0], [1.0, 2.0, 4.0, 8.0]
    rope = RotaryEmbedding(dim, scaling={"type": "longrope", "short_factor": short,
                                         "long_factor": long,
                                         "original_max_position_embeddings": orig,
                                         "factor": 4.0})
    x = torch.randn(1, 1, 40, dim, generator=torch.Generator().manual_seed(2))
    af = math.sqrt(1 + math.log(4) / math.log(orig))
    rope.rotate(x[:, :, :16])
    close(rope.inv_freq, ref_theta(dim, 10000.0) / np.array(short))
    out = rope.rotate(x)
    close(rope.inv_freq, ref_theta(dim, 10000.0) / np.array(long))
    # cos and sin carry the attention factor: norms of rotated pairs grow by it
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1) * af)
    rope.rotate(x[:, :, :16])
    close(rope.inv_freq, ref_theta(dim, 10000.0) / np.array(short))


# --------------------------------------------------------------------------- p-RoPE
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("p", [0.0, 0.25, 0.5, 1.0])
def test_p_rope_rotates_only_the_highest_frequencies(layout, p):
    dim = 16
    rope = RotaryEmbedding(dim, layout=layout, p_rope=p)
    kept = int(p * dim // 2)
    expected = ref_theta(dim, 10000.0)
    expected[kept:] = 0.0
    close(rope.inv_freq, expected)
    x = torch.randn(1, 2, 30, dim, generator=torch.Generator().manual_seed(3))
    out = rope.rotate(x)
    idx = torch.arange(dim)
    pair = idx % (dim // 2) if layout == "half" else idx // 2
    still = pair >= kept
    torch.testing.assert_close(out[..., still], x[..., still], rtol=0, atol=0)
    if kept:
        assert (out[..., ~still] - x[..., ~still]).abs().max() > 0.1
    full = RotaryEmbedding(dim, layout=layout).rotate(x)
    torch.testing.assert_close(out[..., ~still], full[..., ~still])


def test_p_rope_composes_with_scaling_and_rejects_bad_p():
    rope = RotaryEmbedding(16, p_rope=0.5, scaling={"type": "linear", "factor": 4})
    ref = ref_theta(16, 10000.0) / 4
    ref[4:] = 0
    close(rope.inv_freq, ref)
    rope.set_scaling(None)
    assert int((rope.inv_freq == 0).sum()) == 4
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="p"):
            RotaryEmbedding(16, p_rope=bad)
    with pytest.raises(TypeError, match="p"):
        RotaryEmbedding(16, p_rope="half")
    with pytest.raises(TypeError, match="inv_freq"):
        p_rope_inv_freq([1.0, 0.5], 0.5)


# --------------------------------------------------------------------------- partial rotary
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_partial_rotary_with_scaling_uses_the_rotary_dim(layout):
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(32, rotary_dim=8, layout=layout, scaling=scaling)
    ref, af = ref_yarn(8, 10000.0, 4.0, 64)
    close(rope.inv_freq, ref)
    x = torch.randn(1, 1, 100, 32, generator=torch.Generator().manual_seed(4))
    out = rope.rotate(x)
    assert torch.equal(out[..., 8:], x[..., 8:])
    head = RotaryEmbedding(8, layout=layout, scaling=scaling).rotate(x[..., :8].contiguous())
    torch.testing.assert_close(out[..., :8], head)
    torch.testing.assert_close(out[..., :8].norm(dim=-1), x[..., :8].norm(dim=-1) * af)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("scaling, exc, name", [
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, ValueError, "high_freq_factor"),
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     ValueError, "original_max_position_embeddings"),
    ({"type": "dynamic", "factor": 2.0}, ValueError, "original_max_position_embeddings"),
    ({"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 32, "seq_len": 64},
     ValueError, "seq_len"),
    ({"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4,
      "original_max_position_embeddings": 32, "factor": 2.0}, ValueError, "short_factor"),
    ({"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0, 2.0, 0.0, 1.0],
      "original_max_position_embeddings": 32, "factor": 2.0}, ValueError, r"long_factor\[2\]"),
    ({"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
      "original_max_position_embeddings": 32}, ValueError, "factor"),
    ({"type": "longrope", "short_factor": 1.0, "long_factor": [1.0] * 4,
      "original_max_position_embeddings": 32, "factor": 2.0}, TypeError, "short_factor"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": "x"},
     TypeError, "mscale"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
      "attention_factor": -1.0},
     ValueError, "attention_factor"),
    ({"type": "llama4", "factor": 4.0}, ValueError, "llama4"),
])
def test_bad_scaling_names_the_argument(scaling, exc, name):
    with pytest.raises(exc, match=name):
        scaled_inv_freq(8, 10000.0, scaling)
    with pytest.raises(exc, match=name):
        RotaryEmbedding(8, scaling=scaling)


@pytest.mark.parametrize("kind, params", [
    ("dynamic", {"factor": 2.0}),
    ("yarn", {"factor": 4.0}),
    ("longrope", {"short_factor": [1.0] * 4, "long_factor": [1.0] * 4, "factor": 2.0}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
])
def test_the_short_key_original_max_position_is_refused_by_name(kind, params):
    # one spelling, Hugging Face's: the short key is unknown, and the error says so
    # (before the missing original_max_position_embeddings)
    scaling = {"type": kind, **params, "original_max_position": 32}
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'original_max_position';.*"
                                         r"original_max_position_embeddings"):
        scaled_inv_freq(8, 10000.0, scaling)
    with pytest.raises(ValueError, match="'original_max_position'"):
        RotaryEmbedding(8, scaling=scaling)
    assert RotaryEmbedding(8, scaling={"type": kind, **params,
                                       "original_max_position_embeddings": 32}).scaling


def test_nothing_is_nan_for_extreme_lengths():
    for scaling in ({"type": "dynamic", "factor": 8.0, "original_max_position_embeddings": 16},
                    {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 16}):
        rope = RotaryEmbedding(8, scaling=scaling)
        out = rope.rotate(torch.ones(1, 1, 3, 8), torch.tensor([0, 5000, 100000]))
        assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(rope.inv_freq).all())


def test_rotary_encoding_passes_p_rope():
    from tutorial_pkg import Rotary

    enc = Rotary(16, p_rope=0.5)
    assert enc.rope.p_rope == 0.5 and int((enc.rope.inv_freq == 0).sum()) == 4


def test_p_rope_is_registered_by_name():
    from tutorial_pkg import ENCODINGS, make_encoding
    from tutorial_pkg.encodings.builtin import PRoPE

    assert ENCODINGS["p_rope"] is PRoPE
    enc = make_encoding("p_rope", d_model=64, n_heads=4)  # head_dim 16: 8 pairs, 6 rotate
    assert enc.rope.p_rope == 0.75 and int((enc.rope.inv_freq > 0).sum()) == 6
    assert make_encoding("p_rope", head_dim=16, p_rope=0.5).rope.p_rope == 0.5
    assert enc.supports_scaling


def test_which_rules_follow_the_length_and_when_they_change():
    """Only "dynamic" and "longrope" take seq_len; seq_len_after says when (Hugging Face's
    dynamic_rope_update): dynamic grows with the longest length seen and returns to the
    original base below the original length; longrope switches factors at that length."""
    assert {k for k in ROPE_SCALINGS if depends_on_length(k)} == {"dynamic", "longrope"}
    with pytest.raises(ValueError, match="scaling\\['type'\\]"):
        depends_on_length("nope")
    dyn = {"type": "dynamic", "factor": 2, "original_max_position_embeddings": 256}
    steps, current = [], None
    for end in (100, 300, 600, 400, 200, 700):
        current = seq_len_after(dyn, end, current)
        steps.append(current)
    assert steps == [None, 300, 600, 600, None, 700]
    lr = {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
          "original_max_position_embeddings": 256, "factor": 4}
    steps, current = [], None
    for end in (100, 300, 600, 200, 257):
        current = seq_len_after(lr, end, current)
        steps.append(current)
    assert steps == [None, 300, 300, None, 257]  # the factors, not the length, matter
    assert seq_len_after({"type": "linear", "factor": 2}, 10_000, None) is None
    assert seq_len_after(None, 10_000, None) is None
