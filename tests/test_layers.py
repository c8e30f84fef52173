"""Sliding windows, per-layer schedules and T5's relative bias (issue 17).

* Sliding windows: the mask is Hugging Face's (``kv_idx > q_idx - w``, causal); every
  backend equals ``"naive"`` with and without padding, GQA, causal or not; a window's
  output equals attention over the window's tokens alone (an oracle that does not use
  the package's mask); decoding with a KV cache equals the full forward pass; left
  padding and packed documents equal each row alone.
* Schedules: the layer rules of Hugging Face's Llama 4 / SmolLM3 (``no_rope_layers``)
  and Gemma 3 (``layer_types``) configs, transcribed here; TinyLM by name, by list,
  decoding with a cache.
* T5: the bucket function equals an independent transcription of Hugging Face's
  ``T5Attention._relative_position_bucket``; the bias, its Flex ``score_mod`` and its
  gradients.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch

from tutorial_pkg import backends
from tutorial_pkg.attention import KVCache, MultiHeadAttention
from tutorial_pkg.backends import AttentionPlan
from tutorial_pkg.encodings import NoPE, Rotary
from tutorial_pkg.model import TinyLM
from tutorial_pkg.positions import positions_from_documents, positions_from_padding
from tutorial_pkg.registry import ENCODINGS, make_encoding
from tutorial_pkg.relative_bias import T5RelativeBias, t5_relative_position_bucket
from tutorial_pkg.schedules import LayerSchedule, LocalGlobal, NoPEEvery, PerLayer

HAS_FLEX = backends.flex_available()[0]
# compiles (inductor codegen): `pytest -m "not slow"` skips it while editing
slow = pytest.mark.slow
needs_flex = pytest.mark.skipif(not HAS_FLEX, reason="FlexAttention unavailable")
ALL_BACKENDS = ["naive", "sdpa", "auto", pytest.param("flex", marks=needs_flex)]
RELATIVE = ["nope", "rope", "alibi", "hybrid", "t5"]
D, H, KV = 32, 4, 2

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.filterwarnings("ignore:flex backend falls back to sdpa"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    pytest.mark.usefixtures("one_thread"),
]


def encoding(key: str, causal: bool = True):
    if key in ("alibi", "hybrid"):
        return make_encoding(key, d_model=D, n_heads=H, mode="causal" if causal else "symmetric")
    if key == "t5":  # a large init, so that the bias matters in the comparisons
        return make_encoding("t5", n_heads=H, bidirectional=not causal, init_std=1.0)
    return make_encoding(key, d_model=D, n_heads=H, max_len=64)


def x_of(seed, b=2, s=9):
    return torch.randn(b, s, D, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def no_fallback():
    """The backend must really run: a fallback to sdpa (its RuntimeWarning) raises."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flex backend falls back to sdpa",
                                category=RuntimeWarning)
        yield


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
    model = TinyLM(key, d_model=D, n_layers=2, n_heads=H, n_kv_heads=KV, max_len=64,
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
        no_window = TinyLM(key, d_model=D, n_layers=2, n_heads=H, n_kv_heads=KV, max_len=64,
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


# --------------------------------------------------------------------------- schedules
def test_nope_every_follows_hugging_faces_no_rope_layers():
    # Llama4TextConfig / SmolLM3Config: no_rope_layers[i] = int((i + 1) % interval != 0)
    for every in (2, 3, 4):
        schedule = NoPEEvery(8, every=every)
        for i in range(12):
            rope = int((i + 1) % every != 0)
            enc, window = schedule.layer(i)
            assert (enc is schedule.rope) == bool(rope) and window is None
            assert isinstance(enc, NoPE) == (not rope)
    assert NoPEEvery(8).describe(8) == ["rope", "rope", "rope", "nope"] * 2  # 3 : 1


def test_local_global_follows_gemma3_layer_types():
    # Gemma3TextConfig: layer_types[i] = "sliding_attention" if (i + 1) % pattern else
    # "full_attention"; rope_local_base_freq 10 000 on sliding layers, rope_theta 1e6 on full
    schedule = LocalGlobal(8, window=16, global_scaling={"type": "linear", "factor": 8.0})
    for i in range(14):
        enc, window = schedule.layer(i)
        sliding = bool((i + 1) % 6)
        assert window == (16 if sliding else None)
        assert enc.rope.base == (10_000.0 if sliding else 1_000_000.0)
    assert schedule.describe(6) == ["rope/w=16"] * 5 + ["rope"]
    assert schedule.global_rope.scaling["factor"] == 8.0 and schedule.local_rope.scaling is None
    schedule.set_scaling({"type": "linear", "factor": 2.0})  # the global layers only
    assert schedule.scaling["factor"] == 2.0 and schedule.local_rope.scaling is None
    assert LocalGlobal(8).window == 1024  # Gemma 3's local span


def test_schedules_are_built_by_name():
    for name, cls in (("irope", NoPEEvery), ("local_global", LocalGlobal), ("t5", T5RelativeBias)):
        assert ENCODINGS[name] is cls
        assert isinstance(make_encoding(name, d_model=D, n_heads=H), cls)
    model = TinyLM("irope", d_model=D, n_layers=8, n_heads=H)
    names = [type(b.attn.encoding).__name__ for b in model.blocks]
    assert names == ["Rotary"] * 3 + ["NoPE"] + ["Rotary"] * 3 + ["NoPE"]
    assert model.blocks[0].attn.encoding is model.blocks[5].attn.encoding  # one shared RoPE
    model = TinyLM("local_global", d_model=D, n_layers=6, n_heads=H,
                   encoding_kwargs={"window": 5})
    assert [b.attn.window for b in model.blocks] == [5] * 5 + [None]
    assert model.encoding.supports_scaling and model.encoding.max_positions is None


def test_single_encoding_and_per_layer_list_agree():
    # the old call is unchanged (one shared instance); a list of the same names gives the
    # same model (same seed, RoPE has no parameters)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    single = TinyLM("rope", d_model=D, n_layers=3, n_heads=H).eval()
    assert all(b.attn.encoding is single.encoding for b in single.blocks)
    listed = TinyLM(["rope"] * 3, d_model=D, n_layers=3, n_heads=H).eval()
    assert isinstance(listed.encoding, PerLayer) and listed.encoding.n_layers == 3
    with torch.no_grad():
        torch.testing.assert_close(listed(ids), single(ids))
    shared = Rotary(D // H)
    model = TinyLM(PerLayer([shared, NoPE(), shared], windows=[2, None, 2]), d_model=D,
                   n_layers=3, n_heads=H)
    assert model.blocks[0].attn.encoding is model.blocks[2].attn.encoding is shared
    assert [b.attn.window for b in model.blocks] == [2, None, 2]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("schedule", ["irope", "local_global", "mixed"])
def test_schedule_kv_cache_decoding_equals_full_forward(schedule, backend):
    torch.manual_seed(0)
    if schedule == "mixed":
        enc, kw = ["rope", "t5", "alibi", "nope"], {"encoding_kwargs": None}
    else:
        enc, kw = schedule, {"encoding_kwargs": {"window": 3} if schedule == "local_global"
                             else {"every": 2}}
    model = TinyLM(enc, d_model=D, n_layers=4, n_heads=H, backend=backend, **kw).eval()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        full = model(ids)
        caches = model.new_caches()
        steps = torch.cat([model(ids[:, t : t + 1], caches=caches) for t in range(9)], 1)
        caches = model.new_caches()
        chunks = torch.cat([model(ids[:, a:b], caches=caches) for a, b in ((0, 5), (5, 9))], 1)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunks, full, rtol=1e-4, atol=1e-4)


def test_schedule_bad_input_raises_naming_the_argument():
    with pytest.raises(ValueError, match="every"):
        NoPEEvery(8, every=1)
    with pytest.raises(ValueError, match="pattern"):
        LocalGlobal(8, pattern=1)
    with pytest.raises(TypeError, match="window"):
        LocalGlobal(8, window=None)
    with pytest.raises(ValueError, match="i must be"):
        PerLayer([NoPE()]).layer(1)
    with pytest.raises(ValueError, match="i must be"):
        NoPEEvery(8).layer(-1)
    with pytest.raises(ValueError, match="embeddings"):
        PerLayer([make_encoding("sinusoidal", d_model=D)])
    with pytest.raises(TypeError, match=r"encodings\[1\]"):
        PerLayer([NoPE(), "rope"])
    with pytest.raises(ValueError, match="windows"):
        PerLayer([NoPE(), NoPE()], windows=[1])
    with pytest.raises(ValueError, match="n_layers"):
        TinyLM(["rope", "nope"], d_model=D, n_layers=3, n_heads=H)
    with pytest.raises(ValueError, match="n_layers"):
        TinyLM(PerLayer([NoPE(), NoPE()]), d_model=D, n_layers=3, n_heads=H)
    with pytest.raises(ValueError, match="window"):
        TinyLM("local_global", d_model=D, n_layers=2, n_heads=H, window=4)
    with pytest.raises(TypeError, match="encoding"):
        MultiHeadAttention(D, H, NoPEEvery(D // H))
    with pytest.raises(TypeError, match="encoding"):
        TinyLM([1, 2], d_model=D, n_layers=2, n_heads=H)
    with pytest.raises(ValueError, match="scaling"):
        PerLayer([NoPE()]).set_scaling({"type": "linear", "factor": 2.0})
    assert issubclass(NoPEEvery, LayerSchedule)


# --------------------------------------------------------------------------- T5
def hf_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """Hugging Face's T5Attention._relative_position_bucket, transcribed independently."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
    )
    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 64), (8, 20), (64, 33)])
def test_t5_bucket_equals_hugging_faces(bidirectional, num_buckets, max_distance):
    grid = torch.cat([torch.arange(-600, 601), torch.tensor([-100_000, 100_000])])
    ours = t5_relative_position_bucket(grid, bidirectional=bidirectional,
                                       num_buckets=num_buckets, max_distance=max_distance)
    assert torch.equal(ours, hf_bucket(grid, bidirectional, num_buckets, max_distance))
    assert ours.min() == 0 and ours.max() == num_buckets - 1
    # the last bucket of each direction is reached at max_distance and kept beyond
    per_direction = num_buckets // 2 if bidirectional else num_buckets
    assert ours[grid <= -max_distance].unique().tolist() == [per_direction - 1]
    assert ours[grid >= max_distance].unique().tolist() == [num_buckets - 1 if bidirectional
                                                             else 0]


def test_t5_bucket_of_a_2d_grid_of_positions():
    q, k = torch.arange(300)[:, None], torch.arange(300)[None, :]
    assert torch.equal(t5_relative_position_bucket(k - q), hf_bucket(k - q))
    assert torch.equal(t5_relative_position_bucket(k - q, bidirectional=False),
                       hf_bucket(k - q, bidirectional=False))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bias_is_the_learned_value_of_each_bucket(bidirectional):
    enc = T5RelativeBias(3, bidirectional=bidirectional, init_std=1.0)
    weight = enc.relative_attention_bias.weight  # (num_buckets, n_heads), HF's layout
    assert weight.shape == (32, 3) and weight.requires_grad
    q_pos = torch.tensor([0, 5, 140, 400])
    k_pos = torch.tensor([0, 3, 5, 150, 399, 1000])
    bias = enc.bias(q_pos, k_pos)
    assert bias.shape == (3, 4, 6) and bias.dtype == torch.float32
    want = weight[hf_bucket(k_pos[None] - q_pos[:, None], bidirectional)].permute(2, 0, 1)
    torch.testing.assert_close(bias, want, rtol=0, atol=0)
    batched = enc.bias(torch.stack([q_pos, q_pos + 7]), torch.stack([k_pos, k_pos + 7]))
    assert batched.shape == (2, 3, 4, 6)
    torch.testing.assert_close(batched[0], bias, rtol=0, atol=0)
    torch.testing.assert_close(batched[1], bias, rtol=0, atol=0)  # relative: shift invariant
    score_mod = enc.score_mod(q_offset=2)  # query index i sits at position i + 2
    got = score_mod(torch.zeros(()), 0, torch.tensor(1), torch.tensor(0), torch.tensor(150))
    torch.testing.assert_close(got, enc.bias(torch.tensor([2]), torch.tensor([150]))[1, 0, 0])


def test_t5_scores_are_scaled_content_plus_unscaled_bias():
    # score = q.k / sqrt(d_h) + b: the content term is scaled as for every encoding,
    # the learned bias is added as it is (module docs)
    torch.manual_seed(0)
    attn = MultiHeadAttention(D, H, encoding("t5"), backend="naive").eval()
    x = x_of(5, b=1, s=6)
    with torch.no_grad():
        _, weights = attn(x, return_weights=True)
        q = attn.q_proj(x).view(1, 6, H, D // H).transpose(1, 2)
        k = attn.k_proj(x).view(1, 6, H, D // H).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // H) + attn.encoding.bias(
            torch.arange(6), torch.arange(6))
        scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(weights, scores.softmax(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["naive", "sdpa", "auto"])
def test_t5_learns_per_head_parameters_through_every_backend(backend):
    torch.manual_seed(0)
    model = TinyLM("t5", d_model=D, n_layers=2, n_heads=H, backend=backend)
    assert model.blocks[0].attn.encoding is model.blocks[1].attn.encoding  # shared, as in T5
    ids = torch.randint(0, 256, (2, 12))
    model.loss(ids[:, :-1], ids[:, 1:]).backward()
    grad = model.encoding.relative_attention_bias.weight.grad
    assert grad is not None and torch.isfinite(grad).all()
    # 11 tokens, causal: buckets 0..10 are used (one per distance), by every head
    assert (grad[:11].abs() > 0).all() and (grad[11:] == 0).all()


def test_t5_bad_input_raises_naming_the_argument():
    with pytest.raises(TypeError, match="relative_position"):
        t5_relative_position_bucket(torch.tensor([0.5]))
    with pytest.raises(ValueError, match="num_buckets"):
        t5_relative_position_bucket(torch.tensor([1]), num_buckets=3)  # 1 per direction
    with pytest.raises(ValueError, match="max_distance"):
        t5_relative_position_bucket(torch.tensor([1]), num_buckets=32, max_distance=8)
    with pytest.raises(TypeError, match="bidirectional"):
        T5RelativeBias(4, bidirectional=1)
    with pytest.raises(ValueError, match="n_heads"):
        T5RelativeBias(0)
    with pytest.raises(ValueError, match="init_std"):
        T5RelativeBias(4, init_std=0.0)
    with pytest.raises(ValueError, match="n_heads"):
        make_encoding("t5")
    with pytest.raises(ValueError, match="q_pos and k_pos"):
        T5RelativeBias(4).score_mod(0, torch.zeros(1, 3, dtype=torch.long), None)
    with pytest.raises(ValueError, match="n_heads"):  # declared n_heads checked by attention
        MultiHeadAttention(D, H, T5RelativeBias(H + 1))


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
