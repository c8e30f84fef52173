"""The Hugging Face conventions chapter 4 names, held to transformers' own functions.

Chapter 4 quotes transformers' ``masking_utils`` (the causal rule on cache slots,
``kv_idx <= q_idx`` on ``arange(q_length) + q_offset``, and when SDPA's ``is_causal`` may
replace the mask), its sliding window (``kv_idx > q_idx - sliding_window``), the positions
``generate`` makes from a left-padded ``attention_mask`` (``cumsum - 1``, padding at 0) and
``repeat_kv``'s grouping of query heads. These tests call those functions and compare the
package's masks, dispatch, positions and grouped-query attention with what they return, so
that a package that aligned the causal mask top-left, passed ``is_causal`` for a chunk, counted
positions by column or tiled the key/value heads fails here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tutorial_pkg as tp
from tutorial_pkg import backends
from tutorial_pkg.attention.masks import causal_mask, dense_mask, sliding_window

hf_masking = pytest.importorskip("transformers.masking_utils")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

#: (cached keys t, new queries s): a whole sequence, a chunk after the cache, one token
CASES = [(0, 9), (6, 3), (8, 1)]


@pytest.mark.parametrize(("t", "s"), CASES, ids=["whole", "chunk", "one token"])
def test_the_causal_rule_on_cache_slots_is_hugging_faces_sdpa_mask(t, s):
    want = hf_masking.sdpa_mask(batch_size=1, q_length=s, kv_length=t + s, q_offset=t,
                                mask_function=hf_masking.causal_mask_function,
                                allow_is_causal_skip=False)
    got = dense_mask(causal_mask, t, s, t + s)
    assert want.dtype == got.dtype == torch.bool
    assert torch.equal(got.expand_as(want), want)


@pytest.mark.parametrize("window", [2, 4])
def test_the_sliding_window_on_cache_slots_is_hugging_faces(window):
    t, s = 6, 3
    hf_rule = hf_masking.and_masks(hf_masking.causal_mask_function,
                                   hf_masking.sliding_window_overlay(window))
    want = hf_masking.sdpa_mask(batch_size=1, q_length=s, kv_length=t + s, q_offset=t,
                                mask_function=hf_rule, allow_is_causal_skip=False)
    window_rule = sliding_window(window)
    got = dense_mask(lambda b, h, q, k: causal_mask(b, h, q, k) & window_rule(b, h, q, k),
                     t, s, t + s)
    assert torch.equal(got.expand_as(want), want)


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
@pytest.mark.parametrize(("t", "s"), CASES, ids=["whole", "chunk", "one token"])
def test_the_mask_is_dropped_exactly_where_hugging_face_drops_it(monkeypatch, backend, t, s):
    # transformers skips the mask (and relies on is_causal, or on no mask for one query)
    # iff q_length == 1 or kv_length == q_length; the package's plain dispatch must agree,
    # and must then pass is_causal=True only for the whole sequence.
    hf_skips = hf_masking._ignore_causal_mask_sdpa(None, s, t + s, t, 0)
    seen = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, is_causal=False, **kw):
        seen.append((attn_mask is None, is_causal))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    torch.manual_seed(0)
    layer = tp.MultiHeadAttention(32, 4, tp.NoPE(), backend=backend)
    x = torch.randn(1, t + s, 32)
    cache = tp.KVCache()
    with torch.no_grad():
        full = layer(x)
        if t:
            layer(x[:, :t], kv_cache=cache)
        monkeypatch.setattr(backends.F, "scaled_dot_product_attention", recording)
        got = layer(x[:, t:], kv_cache=cache)
    torch.testing.assert_close(got, full[:, t:], rtol=1e-4, atol=1e-5)
    ((no_mask, is_causal),) = seen
    assert no_mask == hf_skips
    assert is_causal == (hf_skips and s > 1)


def _tiny_llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config).eval()


def test_positions_from_padding_are_the_positions_generate_makes():
    model = _tiny_llama()
    ids = torch.ones(3, 7, dtype=torch.long)
    attention_mask = torch.ones(3, 7, dtype=torch.long)
    attention_mask[1, :2] = 0  # left padding
    attention_mask[2, :6] = 0  # one real token
    want = model._prepare_position_ids_for_generation(ids, {"attention_mask": attention_mask})
    got = tp.positions_from_padding(attention_mask == 0)
    assert torch.equal(got, want)
    assert got[1].tolist() == [0, 0, 0, 1, 2, 3, 4]  # not the column index


def test_grouped_query_heads_are_hugging_faces_repeat_kv():
    from transformers.models.llama.modeling_llama import repeat_kv

    torch.manual_seed(0)
    layer = tp.MultiHeadAttention(32, 4, tp.NoPE(), n_kv_heads=2, backend="naive")
    x = torch.randn(2, 5, 32)
    q = layer.q_proj(x).view(2, 5, 4, 8).transpose(1, 2)
    k = layer.k_proj(x).view(2, 5, 2, 8).transpose(1, 2)
    v = layer.v_proj(x).view(2, 5, 2, 8).transpose(1, 2)
    assert torch.equal(repeat_kv(k, 2), k.repeat_interleave(2, dim=1))
    want = F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)
    with torch.no_grad():
        got = layer.attend(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    tiled = F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1),
                                           is_causal=True)
    assert (tiled - want).abs().max() > 1e-2  # the grouping matters: tiling is another model
