"""Tests of tutorial_pkg.encodings.alibi: slopes, the three bias forms, offsets, score_mod."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from tutorial_pkg.encodings.alibi import ALIBI_MODES, alibi_bias, alibi_score_mod, alibi_slopes
from tutorial_pkg.encodings.builtin import ALiBi

pytestmark = pytest.mark.usefixtures("one_thread")


def get_slopes(n):
    """Press et al.'s reference ``get_slopes`` (the paper's code, re-typed independently)."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


def test_slopes_equal_reference_for_1_to_128_heads():
    for n in range(1, 129):
        got = alibi_slopes(n)
        assert got.dtype == torch.float32 and got.shape == (n,)
        assert got.tolist() == pytest.approx(get_slopes(n), rel=1e-6, abs=0), f"n={n}"


def test_slopes_for_8_heads_are_powers_of_two():
    assert alibi_slopes(8).tolist() == [2.0**-h for h in range(1, 9)]
    assert alibi_slopes(1).tolist() == [2.0**-8]


def reference_causal(slopes, n):
    out = torch.empty(len(slopes), n, n)
    for h, m in enumerate(slopes.tolist()):
        for i in range(n):
            for j in range(n):
                out[h, i, j] = -m * (i - j)
    return out


def test_causal_bias_is_minus_slope_times_distance():
    slopes = alibi_slopes(4)
    bias = alibi_bias(slopes, 6)
    assert bias.shape == (4, 6, 6) and bias.dtype == torch.float32
    torch.testing.assert_close(bias, reference_causal(slopes, 6), rtol=0, atol=0)
    assert alibi_bias(4, 6).equal(bias)  # an int head count builds the slopes


def test_symmetric_bias_is_minus_slope_times_abs_distance():
    slopes = alibi_slopes(3)
    bias = alibi_bias(slopes, 5, mode="symmetric")
    torch.testing.assert_close(bias, -reference_causal(slopes, 5).abs(), rtol=0, atol=0)
    assert bias.equal(bias.transpose(-1, -2))


def test_key_only_gives_the_same_causal_softmax():
    n_heads, n = 4, 9
    scores = torch.randn(2, n_heads, n, n, generator=torch.Generator().manual_seed(0))
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    key_only = alibi_bias(n_heads, n, mode="key_only")
    assert key_only.shape == (n_heads, 1, n)
    causal = alibi_bias(n_heads, n, mode="causal")
    p_key = (scores + key_only).masked_fill(future, float("-inf")).softmax(-1)
    p_causal = (scores + causal).masked_fill(future, float("-inf")).softmax(-1)
    torch.testing.assert_close(p_key, p_causal)
    # the two differ by a per-row constant -m i
    diff = (causal - key_only).masked_fill(future, 0)
    torch.testing.assert_close(diff[..., 0:1].expand(-1, -1, n).masked_fill(future, 0), diff)


@pytest.mark.parametrize("mode", ALIBI_MODES)
def test_decoding_offsets_equal_rows_of_the_full_bias(mode):
    n = 12
    full = alibi_bias(6, n, mode=mode).expand(-1, n, -1)
    for t in range(n):  # one new query at position t, keys 0..t
        row = alibi_bias(6, torch.tensor([t]), t + 1, mode=mode)
        torch.testing.assert_close(row[:, 0], full[:, t, : t + 1], rtol=0, atol=0)
    chunk = alibi_bias(6, torch.arange(4, 8), 8, mode=mode)  # a chunk of 4 queries
    torch.testing.assert_close(chunk.expand(-1, 4, -1), full[:, 4:8, :8], rtol=0, atol=0)


def test_bias_is_float32_for_low_precision_slopes_and_modules():
    slopes = alibi_slopes(12)
    assert alibi_bias(slopes.bfloat16(), 5).dtype == torch.float32
    enc = ALiBi(12).to(torch.bfloat16)  # a bf16 model: the slopes stay exact float32
    bias = enc.bias(torch.arange(5), torch.arange(5))
    assert bias.dtype == torch.float32
    torch.testing.assert_close(bias, alibi_bias(slopes, 5), rtol=0, atol=0)


def test_bias_has_no_fixed_length_limit():
    # the seed's fixed (H, 2048, 2048) buffer broke past 2048 tokens
    row = alibi_bias(8, torch.tensor([4999]), 5000)
    assert row.shape == (8, 1, 5000)
    torch.testing.assert_close(row[:, 0, 0], -alibi_slopes(8) * 4999)
    assert row[:, 0, -1].abs().max() == 0


@pytest.mark.parametrize("mode", ALIBI_MODES)
@pytest.mark.parametrize("q_offset", [0, 5])
def test_score_mod_equals_bias(mode, q_offset):
    n_heads, lq = 4, 3
    lk = q_offset + lq
    slopes = alibi_slopes(n_heads)
    score_mod = alibi_score_mod(slopes, mode=mode, q_offset=q_offset)
    h = torch.arange(n_heads)[:, None, None]
    q_idx = torch.arange(lq)[None, :, None]
    kv_idx = torch.arange(lk)[None, None, :]
    score = torch.zeros(n_heads, lq, lk)
    got = score_mod(score, torch.tensor(0), h, q_idx, kv_idx)
    expected = alibi_bias(slopes, torch.arange(q_offset, q_offset + lq), lk, mode=mode)
    torch.testing.assert_close(got, expected.expand(-1, lq, -1))
    # and it adds to the score it is given
    torch.testing.assert_close(score_mod(score + 2.0, 0, h, q_idx, kv_idx), got + 2.0)


def test_bias_decreases_with_distance():
    bias = alibi_bias(4, 10)
    past = torch.ones(10, 10, dtype=torch.bool).tril()
    row = bias[:, 9, :]  # last query: keys 0..9
    assert bool((row.diff(dim=-1) > 0).all())  # closer keys get larger bias
    assert bool((bias[:, past] <= 0).all())


# --------------------------------------------------------------------------- bias_scale
@pytest.mark.parametrize("mode", ALIBI_MODES)
def test_bias_scale_scales_every_hook(mode):
    """ALiBi(bias_scale=c): bias, key row and score_mod are c times the unscaled ones."""
    c = 8**-0.5  # Falcon: 1 / sqrt(head_dim)
    plain, scaled = ALiBi(6, mode=mode), ALiBi(6, mode=mode, bias_scale=c)
    q_pos = k_pos = torch.arange(7)
    torch.testing.assert_close(scaled.bias(q_pos, k_pos), c * plain.bias(q_pos, k_pos))
    torch.testing.assert_close(scaled.slopes, plain.slopes)  # the paper's slopes are kept
    torch.testing.assert_close(scaled.effective_slopes(), c * plain.slopes)
    if mode != "symmetric":
        torch.testing.assert_close(scaled.key_bias(k_pos), c * plain.key_bias(k_pos))
    score = torch.zeros(())
    fn = scaled.score_mod(q_offset=2)
    want = scaled.bias(torch.arange(2, 9), torch.arange(9)).expand(6, 7, 9)
    for h, i, j in ((0, 0, 1), (3, 4, 2), (5, 6, 8)):
        got = fn(score, torch.tensor(0), torch.tensor(h), torch.tensor(i), torch.tensor(j))
        torch.testing.assert_close(got, want[h, i, j])


def test_bias_scale_in_the_hybrid_and_checked():
    from tutorial_pkg.encodings.builtin import Hybrid

    hyb = Hybrid(8, 4, bias_scale=0.25)
    torch.testing.assert_close(hyb.effective_slopes(), 0.25 * alibi_slopes(4))
    torch.testing.assert_close(hyb.bias(torch.arange(5), torch.arange(5)),
                               0.25 * alibi_bias(4, 5))
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="bias_scale"):
            ALiBi(4, bias_scale=bad)
    with pytest.raises(TypeError, match="bias_scale"):
        ALiBi(4, bias_scale="1")


def test_falcon_bf16_recipe_of_the_docstring():
    """The FalconBF16ALiBi recipe of ALiBi's docstring equals transformers' Falcon
    build_alibi_tensor (bfloat16 slopes and m_h * j) divided by sqrt(head_dim), for 6
    heads (slopes not exact in bfloat16) and positions past 256."""
    falcon = pytest.importorskip("transformers.models.falcon.modeling_falcon")

    # the recipe exactly as the docstring prints it (its indented block after "::")
    doc = ALiBi.__doc__
    block = doc[doc.index("class FalconBF16ALiBi"):].split("\n\n    with the")[0]
    namespace = {"ALiBi": ALiBi}
    exec(textwrap.dedent("        " + block), namespace)
    FalconBF16ALiBi = namespace["FalconBF16ALiBi"]

    H, head_dim, s = 6, 16, 300
    mask = torch.ones(2, s, dtype=torch.long)
    mask[1, :5] = 0  # left padding: Falcon counts positions from the first real token
    want = falcon.build_alibi_tensor(mask, H, torch.float32).view(2, H, 1, s)
    want = want / math.sqrt(head_dim)
    k_pos = ((mask.cumsum(-1) - 1) * mask)  # Falcon's positions (0 at padding)
    enc = FalconBF16ALiBi(H, head_dim)
    for got in (enc.bias(k_pos, k_pos), enc.key_bias(k_pos)):
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    exact = ALiBi(H, mode="key_only", bias_scale=head_dim**-0.5).bias(k_pos, k_pos)
    assert (exact - want).abs().max() > 1e-4  # the rounding the recipe reproduces
