"""Sliding windows (Mistral, Gemma's local layers) through every backend.

The mask is Hugging Face's (``kv_idx > q_idx - w``, causal); every backend equals
``"naive"`` with and without padding, GQA, causal or not; a window's output equals
attention over the window's tokens alone (an oracle that does not use the package's
mask); decoding with a KV cache equals the full forward pass; left padding and packed
documents equal each row alone.
"""

from __future__ import annotations

import pytest
import torch

from tutorial_pkg import backends
from tutorial_pkg.attention.backends import AttentionPlan
from tutorial_pkg.attention.layer import KVCache, MultiHeadAttention
from tutorial_pkg.attention.positions import positions_from_documents, positions_from_padding
from tutorial_pkg.models.tiny_lm import TinyLM

from .layer_cases import (
    ALL_BACKENDS,
    KV,
    LAYER_MARKS,
    RELATIVE,
    D,
    H,
    encoding,
    needs_flex,
    no_fallback,
    slow,
    x_of,
)

pytestmark = LAYER_MARKS


# --------------------------------------------------------------------------- windows
def test_window_mask_is_hugging_faces():
    # transformers.masking_utils: causal_mask_function (kv_idx <= q_idx) and
    # sliding_window_overlay (kv_idx > q_idx - sliding_window), on cache slots
    for start, s, w in ((0, 7, 3), (4, 2, 3), (5, 1, 2), (0, 5, 1)):
        k_len = start + s
        plan = AttentionPlan(q_pos=torch.arange(start, k_len)[None],
                             k_pos=torch.arange(k_len)[None], start=start,
                             default_positions=True, causal=True, window=w)
        want = torch.tensor([[kv <= q and kv > q - w for kv in range(k_len)]
                             for q in range(start, k_len)])
        assert torch.equal(plan.allowed()[0, 0], want)
    plan = AttentionPlan(q_pos=torch.arange(6)[None], k_pos=torch.arange(6)[None], start=0,
                         default_positions=True, causal=False, window=2)
    want = torch.tensor([[abs(q - kv) < 2 for kv in range(6)] for q in range(6)])
    assert torch.equal(plan.allowed()[0, 0], want)
    # a window as long as the sequence hides nothing: the plan does not even build a mask
    plan = AttentionPlan(q_pos=torch.arange(6)[None], k_pos=torch.arange(6)[None], start=0,
                         default_positions=True, causal=True, window=6)
    assert not plan.windowed and plan.allowed(padding=False) is not None


@pytest.mark.parametrize("key", RELATIVE)
def test_window_equals_attention_over_the_window_alone(key):
    # an oracle without the package's mask: with a relative encoding, query i under a
    # causal window w attends exactly as the last query of the tokens i-w+1..i alone
    torch.manual_seed(0)
    w, s = 3, 9
    attn = MultiHeadAttention(D, H, encoding(key), backend="naive", window=w, n_kv_heads=KV).eval()
    x = x_of(1, s=s)
    with torch.no_grad():
        out = attn(x)
        alone = torch.stack([attn(x[:, max(0, i - w + 1) : i + 1])[:, -1] for i in range(s)], 1)
        attn.window = None
        full = attn(x)
    torch.testing.assert_close(out, alone, rtol=1e-4, atol=1e-5)
    assert (out - full).abs().max() > 1e-3  # the window changed something


@pytest.mark.parametrize("backend", ["sdpa", "auto", pytest.param("flex", marks=needs_flex)])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("use_pad", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("key", ["nope", "sinusoidal", "learned", *RELATIVE[1:]])
def test_window_backends_equal_naive(key, causal, use_pad, gqa, backend):
    torch.manual_seed(0)
    enc = encoding(key, causal)
    attn = MultiHeadAttention(D, H, enc, causal=causal, backend="naive", window=3,
                              n_kv_heads=KV if gqa else None, compile_flex=False).eval()
    x = enc.embed(x_of(2), torch.arange(9))
    pad = None
    if use_pad:  # left padding in row 1; right padding in row 0
        pad = torch.zeros(2, 9, dtype=torch.bool)
        pad[1, :4] = True
        pad[0, -3:] = True
    with torch.no_grad():
        want = attn(x, key_padding_mask=pad)
        attn.backend = backend
        with no_fallback():
            got = attn(x, key_padding_mask=pad)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if use_pad and causal:
        # row 0's last query sees only padding within its window (3 keys): zeros; without
        # the window it would see the real tokens before it (the one before still does)
        assert got[0, -1].abs().max() == 0 and got[0, -2].abs().max() > 0
        assert got[1, :4].abs().max() == 0


def test_window_fully_masked_rows_zero_in_every_backend_with_gradients():
    attn = MultiHeadAttention(D, H, encoding("t5"), backend="sdpa", window=2)
    x = x_of(3, s=7).requires_grad_(True)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 3:] = True  # queries 4, 5, 6 of row 0: padding only in their window
    out = attn(x, key_padding_mask=pad)
    assert torch.isfinite(out).all() and out[0, 4:].abs().max() == 0
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert attn.encoding.relative_attention_bias.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("key", ["rope", "alibi", "t5", "sinusoidal"])
def test_window_kv_cache_decoding_equals_full_forward(key, backend):
    torch.manual_seed(0)
    model = TinyLM(key, d_model=D, n_layers=2, n_heads=H, n_kv_heads=KV, max_positions=64,
                   backend=backend, window=3, encoding_kwargs={"init_std": 1.0} if key == "t5"
                   else None).eval()
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        full = model(ids)
        caches = model.new_caches()
        steps = torch.cat([model(ids[:, t : t + 1], caches=caches) for t in range(10)], 1)
        caches = model.new_caches()
        cuts = ((0, 4), (4, 5), (5, 10))
        chunks = torch.cat([model(ids[:, a:b], caches=caches) for a, b in cuts], 1)
        no_window = TinyLM(key, d_model=D, n_layers=2, n_heads=H, n_kv_heads=KV, max_positions=64,
                           backend=backend, encoding_kwargs={"init_std": 1.0} if key == "t5"
                           else None).eval()(ids)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunks, full, rtol=1e-4, atol=1e-4)
    assert (full - no_window).abs().max() > 1e-4


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("key", ["rope", "t5", "irope"])
def test_window_left_padding_and_documents_equal_rows_alone(key, backend):
    torch.manual_seed(0)
    model = TinyLM(key, d_model=D, n_layers=4, n_heads=H, backend=backend, window=3,
                   encoding_kwargs={"init_std": 1.0} if key == "t5" else None).eval()
    rows = [torch.randint(0, 256, (n,)) for n in (4, 7)]
    ids = torch.zeros(2, 7, dtype=torch.long)
    pad = torch.ones(2, 7, dtype=torch.bool)
    for r, row in enumerate(rows):
        ids[r, 7 - len(row):] = row
        pad[r, 7 - len(row):] = False
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2]])
    packed_ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        alone = [model(row[None])[0] for row in rows]
        batched = model(ids, positions=positions_from_padding(pad), key_padding_mask=pad)
        caches = model.new_caches()
        positions = positions_from_padding(pad)
        steps = torch.cat([model(ids[:, t : t + 1], positions=positions[:, t : t + 1],
                                 caches=caches, key_padding_mask=pad[:, : t + 1])
                           for t in range(7)], 1)
        with no_fallback():
            packed = model(packed_ids, positions=positions_from_documents(docs),
                           document_ids=docs)[0]
        by_doc = torch.cat([model(packed_ids[:, docs[0] == d])[0] for d in range(3)])
    for r in range(2):
        torch.testing.assert_close(batched[r, ~pad[r]], alone[r], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(steps[r, ~pad[r]], alone[r], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed, by_doc, rtol=1e-4, atol=1e-4)


@needs_flex
def test_flex_window_block_mask_skips_blocks_outside_the_window():
    s = 4 * backends.FLEX_TILE
    plans = [AttentionPlan(q_pos=torch.arange(s)[None], k_pos=torch.arange(s)[None], start=0,
                           default_positions=True, causal=True, window=w) for w in (None, 128)]
    causal, windowed = (backends.flex_block_mask(p, device="cpu") for p in plans)
    # causal: 4 + 3 + 2 + 1 = 10 tiles computed; a 128-token window: at most 2 per row, 7
    assert causal.kv_num_blocks.sum() + causal.full_kv_num_blocks.sum() == 10
    assert windowed.kv_num_blocks.sum() + windowed.full_kv_num_blocks.sum() == 7


@slow
@needs_flex
@pytest.mark.parametrize(("key", "window"), [("alibi", 40), ("t5", None)])
def test_compiled_flex_equals_naive_past_one_tile(key, window):
    # compiled on CPU past one tile: a window (static shapes, its int captured), and T5's
    # score_mod on the dynamic-shape path (its clamp bounds captured as ints did not build)
    torch.manual_seed(0)
    attn = MultiHeadAttention(D, H, encoding(key), backend="naive", window=window,
                              compile_flex=True).eval()
    x = x_of(4, b=1, s=backends.FLEX_TILE + 8)
    with torch.no_grad():
        want = attn(x)
        attn.backend = "flex"
        with no_fallback():
            got = attn(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("window", "error"), [(0, ValueError), (-2, ValueError),
                                               (1.5, TypeError), (True, TypeError)])
def test_bad_window_raises_naming_it(window, error):
    with pytest.raises(error, match="window"):
        MultiHeadAttention(D, H, window=window)
    with pytest.raises(error, match="window"):
        TinyLM("rope", d_model=D, n_layers=2, n_heads=H, window=window)


def test_kv_cache_module_is_unchanged_by_windows():
    # the cache keeps every key (no rolling buffer): its length is the tokens seen
    attn = MultiHeadAttention(D, H, window=2).eval()
    cache = KVCache()
    with torch.no_grad():
        for seed in range(5):
            attn(x_of(seed, b=1, s=1), kv_cache=cache)
    assert cache.length == 5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_in_half_precision_matches_float32(dtype):
    # the 16-bit SDPA mask: window and padding at -inf/finite min, the bias shifted per row
    # over the keys each query sees; no NaN, zeros for a query whose window is all padding
    torch.manual_seed(0)
    attn = MultiHeadAttention(D, H, encoding("hybrid"), backend="naive", window=3).eval()
    x = x_of(7, s=9)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[0, -3:] = True
    with torch.no_grad():
        want = attn(x, key_padding_mask=pad)
        attn.to(dtype)
        for backend in ("naive", "sdpa", "auto"):
            attn.backend = backend
            got = attn(x.to(dtype), key_padding_mask=pad)
            assert got.dtype == dtype and torch.isfinite(got).all()
            assert got[0, -1].abs().max() == 0
            torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.02)
