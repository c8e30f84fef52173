"""Tests of tutorial_pkg.encodings.builtin (and of the subpackage tutorial_pkg.encodings): the
hooks of every encoding, bias caching. The registry (``ENCODINGS``, ``make_encoding``) is tested
in test_registry.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tutorial_pkg import backends
from tutorial_pkg.attention.layer import MultiHeadAttention
from tutorial_pkg.encodings.alibi import alibi_bias, alibi_slopes
from tutorial_pkg.encodings.builtin import (
    ALiBi,
    Hybrid,
    Learned,
    NoPE,
    Rotary,
    Sinusoidal,
)
from tutorial_pkg.encodings.registry import make_encoding
from tutorial_pkg.encodings.rope import RotaryEmbedding
from tutorial_pkg.encodings.rope_config import read_rope_config
from tutorial_pkg.encodings.schedules import NoPEEvery
from tutorial_pkg.encodings.sinusoidal import sinusoidal_table

D_MODEL, N_HEADS, HEAD_DIM = 16, 4, 4

pytestmark = pytest.mark.usefixtures("one_thread")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_has_bias_flags():
    assert not NoPE().has_bias and not Rotary(8).has_bias and not Sinusoidal(8).has_bias
    assert not Learned(8, 4).has_bias
    assert ALiBi(4).has_bias and Hybrid(8, 4).has_bias


def test_nope_hooks_are_identities():
    enc = NoPE()
    x, q, k = randn(2, 3, 8), randn(2, 4, 3, 2, seed=1), randn(2, 4, 3, 2, seed=2)
    pos = torch.arange(3)
    assert enc.embed(x, pos) is x
    assert enc.rotate(q, k, pos, pos) == (q, k)
    assert enc.bias(pos, pos) is None and enc.score_mod(0) is None


def test_sinusoidal_and_learned_embed_add_their_tables():
    x = randn(2, 5, 8)
    pos = torch.arange(3, 8)
    torch.testing.assert_close(Sinusoidal(8).embed(x, pos), x + sinusoidal_table(pos, 8))
    learned = Learned(8, 16)
    torch.testing.assert_close(learned.embed(x, pos), x + learned.table.weight[pos])
    assert "table.weight" in learned.state_dict()


def test_rotary_rotates_queries_and_keys_at_their_positions():
    enc = Rotary(HEAD_DIM, layout="interleaved")
    ref = RotaryEmbedding(HEAD_DIM, layout="interleaved")
    q, k = randn(1, 4, 2, HEAD_DIM), randn(1, 2, 5, HEAD_DIM, seed=1)  # GQA: fewer key heads
    q_pos, k_pos = torch.tensor([3, 4]), torch.arange(5)
    rq, rk = enc.rotate(q, k, q_pos, k_pos)
    torch.testing.assert_close(rq, ref.rotate(q, q_pos))
    torch.testing.assert_close(rk, ref.rotate(k, k_pos))
    assert enc.bias(q_pos, k_pos) is None


@pytest.mark.parametrize("mode", ["causal", "key_only", "symmetric"])
def test_alibi_bias_and_score_mod_hooks(mode):
    enc = ALiBi(N_HEADS, mode=mode)
    q_pos, k_pos = torch.arange(2, 5), torch.arange(5)
    torch.testing.assert_close(enc.bias(q_pos, k_pos),
                               alibi_bias(alibi_slopes(N_HEADS), q_pos, k_pos, mode=mode))
    assert len(enc.state_dict()) == 0  # parameter-free, slopes not saved
    # score_mod adds the same bias, with q_offset (the cache length) or explicit positions
    scores = torch.zeros(1, N_HEADS, 3, 5)
    full = alibi_bias(alibi_slopes(N_HEADS), q_pos, k_pos, mode=mode)
    torch.testing.assert_close(apply_score_mod(enc.score_mod(2), scores),
                               full.expand(N_HEADS, 3, 5)[None])
    batched_q, batched_k = torch.stack([q_pos, q_pos + 7]), torch.stack([k_pos, k_pos + 7])
    got = apply_score_mod(enc.score_mod(0, batched_q, batched_k), scores.expand(2, -1, -1, -1))
    torch.testing.assert_close(got, enc.bias(batched_q, batched_k).expand(2, N_HEADS, 3, 5))
    if mode != "key_only":  # relative forms: a shift of every position changes nothing
        torch.testing.assert_close(got[1], got[0])


def apply_score_mod(score_mod, scores):
    """Evaluate a FlexAttention score_mod on every (b, h, q, kv) of ``scores``."""
    b, h, q, kv = (torch.arange(n).view(*([1] * i), n, *([1] * (3 - i)))
                   for i, n in enumerate(scores.shape))
    return score_mod(scores, b, h, q, kv)


def attention_logits(enc, q, k, q_pos, k_pos):
    """What attention computes from the hooks: rotated q.k / sqrt(d) plus the bias."""
    rq, rk = enc.rotate(q, k, q_pos, k_pos)
    logits = rq @ rk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    bias = enc.bias(q_pos, k_pos)
    return logits if bias is None else logits + bias


def test_hybrid_add_is_rope_plus_alibi():
    q, k = randn(1, N_HEADS, 6, HEAD_DIM), randn(1, N_HEADS, 6, HEAD_DIM, seed=1)
    pos = torch.arange(6)
    rope_part = attention_logits(Rotary(HEAD_DIM), q, k, pos, pos)
    expected = rope_part + alibi_bias(N_HEADS, 6)
    torch.testing.assert_close(attention_logits(Hybrid(HEAD_DIM, N_HEADS), q, k, pos, pos),
                               expected)


def test_hybrid_alpha_reproduces_the_seed_formula():
    alpha = 0.3
    q, k = randn(1, N_HEADS, 6, HEAD_DIM), randn(1, N_HEADS, 6, HEAD_DIM, seed=1)
    pos = torch.arange(6)
    rope_scores = attention_logits(Rotary(HEAD_DIM), q, k, pos, pos)
    expected = alpha * rope_scores + (1 - alpha) * alibi_bias(N_HEADS, 6)
    enc = Hybrid(HEAD_DIM, N_HEADS, mix="alpha", alpha=alpha)
    torch.testing.assert_close(attention_logits(enc, q, k, pos, pos), expected)


def test_hybrid_learnable_scale_multiplies_slopes_and_gets_gradients():
    enc = Hybrid(HEAD_DIM, N_HEADS, learnable_scale=True)
    assert not enc.static_bias
    torch.testing.assert_close(enc.effective_slopes(), alibi_slopes(N_HEADS))
    with torch.no_grad():
        enc.log_scale.copy_(torch.log(torch.tensor([1.0, 2.0, 0.5, 3.0])))
    torch.testing.assert_close(enc.effective_slopes(),
                               alibi_slopes(N_HEADS) * torch.tensor([1.0, 2.0, 0.5, 3.0]))
    for backend in ("naive", "sdpa"):
        enc.log_scale.grad = None
        mha = MultiHeadAttention(D_MODEL, N_HEADS, enc, backend=backend)
        mha(randn(2, 5, D_MODEL)).square().sum().backward()
        grad = enc.log_scale.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
        assert not backends.cached_tensors(enc)  # a learnable bias is never cached


def test_cached_bias_is_a_masked_4d_table_held_by_the_attention_side():
    enc = ALiBi(N_HEADS)
    full = backends.cached_bias(enc, 0, 6, 6, causal=True, device="cpu")
    assert full.shape == (1, N_HEADS, 6, 6) and full.dtype == torch.float32
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    expected = alibi_bias(N_HEADS, 6).masked_fill(future, float("-inf"))
    torch.testing.assert_close(full[0], expected)
    (table,) = backends.cached_tensors(enc)
    step = backends.cached_bias(enc, 5, 1, 6, causal=True, device="cpu")  # a decoding step
    torch.testing.assert_close(step, full[:, :, 5:6])
    assert backends.cached_tensors(enc)[0] is table  # sliced, not rebuilt
    backends.cached_bias(enc, 0, 300, 300, causal=True, device="cpu")  # longer: grown once
    assert max(t.shape[-1] for t in backends.cached_tensors(enc)) >= 300
    with torch.no_grad():
        enc.slopes.mul_(2)  # an in-place change is seen: a new table, not the stale one
    doubled = backends.cached_bias(enc, 0, 6, 6, causal=True, device="cpu")
    torch.testing.assert_close(doubled[0], 2 * expected)
    for i in range(10):  # bounded: at most MAX_CACHED_TABLES entries per encoding
        backends.cached_bias(enc, 0, 4, 4, causal=True, device="cpu", dtype=torch.float64)
        with torch.no_grad():
            enc.slopes.add_(i)
    assert len(backends.cached_tensors(enc)) <= backends.MAX_CACHED_TABLES


def test_caches_do_not_keep_encodings_alive():
    import gc
    import weakref

    enc = ALiBi(N_HEADS)
    backends.cached_bias(enc, 0, 6, 6, causal=True, device="cpu")
    backends.cached_key_bias(enc, 6, device="cpu")
    ref = weakref.ref(enc)
    del enc
    gc.collect()
    assert ref() is None


def test_sdpa_reuses_the_alibi_bias_and_passes_a_4d_mask(monkeypatch):
    enc = ALiBi(N_HEADS)
    mha = MultiHeadAttention(D_MODEL, N_HEADS, enc, backend="sdpa")
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, attn_mask=None, **kwargs):
        seen.append(None if attn_mask is None else tuple(attn_mask.shape))
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(backends.F, "scaled_dot_product_attention", recording_sdpa)
    x = randn(2, 7, D_MODEL)
    with torch.no_grad():
        first = mha(x)
        (table,) = backends.cached_tensors(enc)
        ptr = table.data_ptr()
        second = mha(x)
    (table_again,) = backends.cached_tensors(enc)
    assert table_again.data_ptr() == ptr  # not rebuilt on the second call
    torch.testing.assert_close(first, second)
    assert seen == [(1, N_HEADS, 7, 7)] * 2  # 4-D: a 3-D float mask takes the slow path
    # with key padding, the mask is still 4-D (batch, heads, L_q, L_k)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, :2] = True
    with torch.no_grad():
        mha(x, key_padding_mask=pad)
    assert seen[-1] == (2, N_HEADS, 7, 7)
    assert len(backends.cached_tensors(enc)) == 1


def test_bf16_model_keeps_rope_and_alibi_constants_in_float32():
    enc = Hybrid(HEAD_DIM, N_HEADS).to(torch.bfloat16)
    assert enc.slopes.dtype == torch.float32
    assert enc.rope.inv_freq.dtype == torch.float32
    bias = enc.bias(torch.arange(4), torch.arange(4))
    assert bias.dtype == torch.float32
    torch.testing.assert_close(bias, alibi_bias(N_HEADS, 4), rtol=0, atol=0)


def test_encodings_declare_what_attention_reads():
    # attention and the experiments read these attributes; they never probe internals
    table = {
        NoPE(): (None, None, None, False),
        Sinusoidal(8): (None, None, None, False),
        Learned(8, 16): (None, None, 16, False),
        Rotary(8, max_positions=32): (None, 8, 32, True),
        ALiBi(4): (4, None, None, False),
        Hybrid(8, 4): (4, 8, None, True),
    }
    for enc, want in table.items():
        got = (enc.n_heads, enc.head_dim, enc.max_positions, enc.supports_scaling)
        assert got == want, type(enc).__name__
    with pytest.raises(ValueError, match="head_dim"):
        MultiHeadAttention(32, 4, Rotary(16))  # head_dim 8 here
    with pytest.raises(ValueError, match="n_heads"):
        MultiHeadAttention(32, 4, ALiBi(8))


def test_hybrid_is_a_rotary_and_an_alibi_composed():
    enc = Hybrid(HEAD_DIM, N_HEADS, base=500.0, mode="symmetric")
    assert isinstance(enc.rotary, Rotary) and isinstance(enc.alibi, ALiBi)
    assert enc.rope is enc.rotary.rope and enc.rope.base == 500.0
    assert enc.alibi.mode == "symmetric" and enc.slopes is enc.alibi.slopes
    q, k = randn(1, N_HEADS, 5, HEAD_DIM), randn(1, N_HEADS, 5, HEAD_DIM, seed=1)
    pos = torch.arange(5)
    torch.testing.assert_close(enc.rotate(q, k, pos, pos), enc.rotary.rotate(q, k, pos, pos))
    torch.testing.assert_close(enc.bias(pos, pos), enc.alibi.bias(pos, pos))
    enc.set_scaling({"type": "linear", "factor": 2.0})
    assert enc.scaling == {"type": "linear", "factor": 2.0} == enc.rotary.scaling


def test_hybrid_from_parts_equals_hybrid_from_sizes():
    rotary, alibi = Rotary(HEAD_DIM, 500.0, layout="interleaved"), ALiBi(N_HEADS, mode="key_only")
    parts = Hybrid(rotary, alibi, mix="alpha", alpha=0.3)
    sizes = Hybrid(HEAD_DIM, N_HEADS, 500.0, layout="interleaved", mode="key_only", mix="alpha",
                   alpha=0.3)
    assert parts.rotary is rotary and parts.alibi is alibi  # shared, not copied
    assert Hybrid(rotary.rope, N_HEADS).rope is rotary.rope  # a RotaryEmbedding is wrapped
    q, k = randn(2, N_HEADS, 5, HEAD_DIM), randn(2, N_HEADS, 5, HEAD_DIM, seed=1)
    pos = torch.arange(5)
    for a, b in zip(parts.rotate(q, k, pos, pos), sizes.rotate(q, k, pos, pos), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(parts.bias(pos, pos), sizes.bias(pos, pos))
    assert torch.equal(parts.key_bias(pos), sizes.key_bias(pos))
    with pytest.raises(TypeError, match="mode"):
        Hybrid(rotary, alibi, mode="causal")
    with pytest.raises(TypeError, match="layout"):
        Hybrid(rotary, N_HEADS, layout="half")


class _ScaledSlopes(Hybrid):
    """The old ``HalfSlopeHybrid`` (chapter 6's control until ``bias_scale`` replaced it)."""

    def __init__(self, head_dim, n_heads, *, slope_scale, **kwargs):
        super().__init__(head_dim, n_heads, **kwargs)
        self.slope_scale = slope_scale

    def effective_slopes(self):
        return super().effective_slopes() * self.slope_scale


def test_hybrid_bias_scale_scales_the_slopes_bit_for_bit():
    # Hybrid(h, n, bias_scale=s, **kw) is the additive hybrid with every slope times s
    for scale, kw in ((0.5, {}), (0.2, {"layout": "interleaved"}), (0.5, {"mode": "key_only"})):
        old = _ScaledSlopes(HEAD_DIM, N_HEADS, slope_scale=scale, **kw)
        new = Hybrid(HEAD_DIM, N_HEADS, bias_scale=scale, **kw)
        assert torch.equal(old.effective_slopes(), new.effective_slopes())
        pos, batched = torch.arange(7), torch.arange(7).expand(2, 7)
        assert torch.equal(old.bias(pos, pos), new.bias(pos, pos))
        assert torch.equal(old.key_bias(batched), new.key_bias(batched))
        for backend in ("naive", "sdpa", "auto"):
            torch.manual_seed(0)
            a = MultiHeadAttention(D_MODEL, N_HEADS, old, backend=backend)
            torch.manual_seed(0)
            b = MultiHeadAttention(D_MODEL, N_HEADS, new, backend=backend)
            x = randn(2, 7, D_MODEL)
            assert torch.equal(a(x), b(x)), backend


def test_rotary_takes_a_ready_part_or_rotary_embeddings_arguments():
    rope = RotaryEmbedding(HEAD_DIM, 500.0, layout="interleaved")
    assert Rotary(rope).rope is rope and Rotary(Rotary(rope)).rope is rope
    by_name = Rotary(head_dim=HEAD_DIM, base=500.0, layout="interleaved")
    assert (by_name.rope.base, by_name.rope.layout) == (500.0, "interleaved")
    config = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
              "rope_theta": 500.0}
    from_config = Rotary(read_rope_config(config), max_positions=64)
    assert (from_config.head_dim, from_config.rope.base, from_config.max_positions) == (
        8, 500.0, 64)
    with pytest.raises(TypeError, match="layout"):
        Rotary(rope, layout="half")  # a ready part's options are set
    with pytest.raises(TypeError, match="colour"):
        make_encoding("rope", head_dim=HEAD_DIM, colour="red")
    shared = Rotary(HEAD_DIM)
    assert NoPEEvery(shared).rope is shared  # schedules take the same parts
    assert NoPEEvery(HEAD_DIM, base=500.0).rope.rope.base == 500.0
