"""Tests of tutorial_pkg.attention.backends as a registry: one signature, each backend's own
fallback, the kernel rules tests switch, the caches; and the KV cache's public contract."""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import tutorial_pkg as tp
from tutorial_pkg import backends
from tutorial_pkg.attention.layer import KVCache, MultiHeadAttention
from tutorial_pkg.attention.masks import AttentionPlan

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

H, D, S = 4, 8, 8


def _call(b=2, s=S, pad=None, causal=True):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, H, s, D, generator=gen) for _ in range(3))
    plan = AttentionPlan(q_pos=torch.arange(s)[None], k_pos=torch.arange(s)[None], start=0,
                         default_positions=True, causal=causal, key_padding_mask=pad)
    return q, k, v, plan


def test_the_registry_holds_every_backend_with_one_signature():
    assert list(tp.BACKENDS) == ["naive", "sdpa", "flex", "auto"]
    assert "naive" in tp.BACKENDS and tp.BACKENDS is backends.BACKENDS
    want = ["q", "k", "v", "plan", "encoding", "dropout_p", "compile"]
    for name, fn in backends.BACKENDS.items():
        params = inspect.signature(fn).parameters
        assert list(params)[:7] == want, name
        assert params["dropout_p"].default == 0.0 and params["compile"].default is True


@pytest.mark.parametrize("name", ["sdpa", "flex", "auto"])
def test_every_backend_called_directly_equals_naive_with_empty_rows(name):
    pad = torch.zeros(2, S, dtype=torch.bool)
    pad[1, :3] = True  # queries 0..2 of row 1 see no key: zeros, never NaN
    q, k, v, plan = _call(pad=pad)
    enc = tp.make_encoding("alibi", n_heads=H)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex without FlexAttention: its fallback
        got = backends.BACKENDS[name](q, k, v, plan, enc, compile=False)
    want = backends.naive(q, k, v, plan, enc)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got[1, :, :3].abs().max() == 0


def test_naive_returns_weights_on_request():
    q, k, v, plan = _call()
    enc = tp.make_encoding("alibi", n_heads=H)
    out, weights = backends.naive(q, k, v, plan, enc, need_weights=True)
    assert torch.equal(out, backends.naive(q, k, v, plan, enc))
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, H, S))
    assert weights.triu(1).abs().max() == 0


def test_a_registered_backend_is_a_layer_choice(monkeypatch):
    seen = []

    def mine(q, k, v, plan, encoding, *, dropout_p=0.0, compile=True):
        seen.append(plan.causal)
        return backends.sdpa(q, k, v, plan, encoding, dropout_p=dropout_p)

    monkeypatch.setitem(backends.BACKENDS, "mine", mine)
    layer = MultiHeadAttention(32, H, backend="mine")
    layer(torch.randn(1, 5, 32))
    assert seen == [True]


def test_register_backend_adds_a_name_and_refuses_to_overwrite(monkeypatch):
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    seen = []

    def mine(q, k, v, plan, encoding, *, dropout_p=0.0, compile=True):
        seen.append(plan.s)
        return backends.naive(q, k, v, plan, encoding, dropout_p=dropout_p)

    assert backends.register_backend("mine", mine) is mine
    from tutorial_pkg.attention import layer as layer_module

    monkeypatch.setattr(layer_module, "BACKENDS", backends.BACKENDS)
    MultiHeadAttention(32, H, backend="mine")(torch.randn(1, 5, 32))
    assert seen == [5]
    with pytest.raises(ValueError, match="'sdpa' is registered"):
        backends.register_backend("sdpa", mine)
    assert backends.register_backend("sdpa", mine, replace=True) is mine
    with pytest.raises(TypeError, match="fn must be callable"):
        backends.register_backend("x", 3)
    with pytest.raises(TypeError, match="name must be"):
        backends.register_backend("", mine)


def test_the_module_exports_the_registry_and_the_four_backends():
    assert sorted(backends.__all__) == ["BACKENDS", "auto", "flex", "naive", "register_backend",
                                        "sdpa"]


@pytest.mark.parametrize("name", ["sdpa", "auto"])
def test_plain_causal_attention_goes_straight_to_is_causal(monkeypatch, name):
    # no bias, no padding: the first SDPA call is the fused causal one, nothing else built
    calls = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((attn_mask, is_causal))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(backends.F, "scaled_dot_product_attention", recording)
    monkeypatch.setattr(backends, "_plan_bias", lambda *a: pytest.fail("bias looked up"))
    MultiHeadAttention(32, H, encoding=tp.make_encoding("rope", d_model=32, n_heads=H),
                       backend=name)(torch.randn(1, 5, 32))
    assert calls == [(None, True)]


def test_return_weights_goes_through_the_registry(monkeypatch):
    called = []
    real = backends.BACKENDS["naive"]

    def naive(*args, **kw):
        called.append(kw.get("need_weights"))
        return real(*args, **kw)

    monkeypatch.setitem(backends.BACKENDS, "naive", naive)
    _, weights = MultiHeadAttention(32, H, backend="sdpa")(torch.randn(1, 5, 32),
                                                          return_weights=True)
    assert called == [True] and weights.shape == (1, H, 5, 5)


def test_an_unknown_backend_raises_naming_it():
    with pytest.raises(ValueError, match="backend must be one of"):
        MultiHeadAttention(32, H, backend="fast")
    layer = MultiHeadAttention(32, H)
    with pytest.raises(ValueError, match="backend must be one of"):
        layer.backend = "fast"  # reassigned later: checked when set, not on every call
    assert layer.backend == "auto"
    layer.backend = "naive"
    assert layer(torch.randn(1, 3, 32)).shape == (1, 3, 32)


@pytest.mark.skipif(not backends.flex_available()[0], reason="FlexAttention unavailable")
def test_flex_falls_back_to_sdpa_itself_with_a_warning():
    q, k, v, plan = _call()
    q.requires_grad_(True)  # no CPU backward in this torch
    enc = tp.make_encoding("alibi", n_heads=H)
    with pytest.warns(RuntimeWarning, match="flex backend falls back to sdpa: .*backward"):
        got = backends.flex(q, k, v, plan, enc)
    torch.testing.assert_close(got, backends.sdpa(q, k, v, plan, enc))
    got.sum().backward()
    assert q.grad is not None


@pytest.mark.skipif(not backends.flex_available()[0], reason="FlexAttention unavailable")
@pytest.mark.parametrize("kind", ["sinks", "softcap"])
def test_flex_with_sinks_or_softcap_on_cpu_from_one_tile_falls_back_to_naive(kind):
    """torch 2.13's compiled CPU FlexAttention refuses ``return_lse`` (sinks) and fails to
    build a soft-capped score_mod: from one tile (128 tokens) on, where the package
    compiles, the layer must warn and compute the naive backend, not raise."""
    torch.manual_seed(0)
    kw = {"sinks": True} if kind == "sinks" else {"softcap": 2.0}
    flex = MultiHeadAttention(32, 4, tp.ALiBi(4), backend="flex", **kw)
    ref = MultiHeadAttention(32, 4, tp.ALiBi(4), backend="naive", **kw)
    with torch.no_grad():
        if flex.sinks is not None:
            flex.sinks.copy_(torch.linspace(-1.0, 1.0, 4))
    ref.load_state_dict(flex.state_dict())
    x = torch.randn(1, backends.FLEX_TILE, 32)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = flex(x)
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(messages) == 1 and messages[0].startswith("flex backend falls back to naive")
    with torch.no_grad():
        torch.testing.assert_close(got, ref(x))


def test_assume_kernels_switches_a_rule_for_a_block_and_restores_it():
    cpu = backends.kernel_rules("cpu")
    assert cpu.key_bias is None
    with backends.assume_kernels("cpu", key_bias=False) as rules:
        assert backends.kernel_rules("cpu") == rules and rules.key_bias is False
        # assumed, not probed: auto takes sdpa (the cached 4-D table)
        assert not backends.key_bias_supported(torch.device("cpu"), torch.float32, False)
    assert backends.kernel_rules("cpu") == cpu
    with backends.assume_kernels("meta", key_bias=True):
        assert backends.key_bias_supported(torch.device("meta"), torch.float32, False)
    assert "meta" not in backends.KERNEL_RULES
    with pytest.raises(TypeError):
        with backends.assume_kernels("cpu", fast=True):
            pass
    assert backends.kernel_rules("cpu") == cpu


def test_cache_info_counts_what_clear_caches_drops():
    enc = tp.make_encoding("alibi", n_heads=H)
    backends.clear_caches()
    backends.cached_bias(enc, 0, 8, 8, causal=True, device="cpu")
    backends.cached_key_bias(enc, 8, device="cpu")
    assert backends.cache_info()["tables"] == 2 == len(backends.cached_tensors(enc))
    backends.clear_caches(enc)
    assert backends.cache_info()["tables"] == 0


def test_kv_cache_update_has_no_default_positions_switch():
    # the "default positions" flag belongs to attention (it knows the positions it made);
    # a user's update always gives explicit positions
    cache = KVCache()
    k = torch.zeros(1, 2, 3, 4)
    with pytest.raises(TypeError):
        cache.update(k, k, torch.arange(3), default=True)
    cache.update(k, k, torch.arange(3))
    assert not cache.default_positions
    layer_cache = KVCache()
    MultiHeadAttention(32, H)(torch.randn(1, 3, 32), kv_cache=layer_cache)
    assert layer_cache.default_positions and layer_cache.length == 3


# --------------------------------------------------------------------------- softcap, sinks
def _hf_mask(pad: torch.Tensor, s: int, dtype=torch.float32) -> torch.Tensor:
    """Hugging Face's additive 4-D mask: causal and key padding, finfo.min where hidden."""
    keep = torch.ones(s, s, dtype=torch.bool).tril()[None, None] & ~pad[:, None, None, :]
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def _shaped_case(seed=0, b=2, h=4, h_kv=2, s=20, d=16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=gen)
    k, v = (torch.randn(b, h_kv, s, d, generator=gen) for _ in range(2))
    pad = torch.zeros(b, s, dtype=torch.bool)
    if b > 1:
        pad[1, :5] = True  # row 1 left-padded
    return q, k, v, pad


class _HFModule(torch.nn.Module):
    def __init__(self, h, h_kv, d, sinks=None):
        super().__init__()
        self.num_key_value_groups, self.head_dim = h // h_kv, d
        self.sinks = sinks


@pytest.mark.parametrize("backend", ["naive", "sdpa", "auto", "flex"])
@pytest.mark.parametrize("kind", ["softcap", "sinks", "both"])
def test_softcap_and_sinks_equal_hugging_face_eager_attention(backend, kind):
    """Gemma 2's soft-capping and gpt-oss's sinks, held to transformers' own
    eager_attention_forward of each family, causal with a left-padded row (the rows that
    keep a key), for every backend: exact in naive and flex, sdpa warning and computing
    naive, auto computing naive."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss

    q, k, v, pad = _shaped_case()
    b, h, s, d = q.shape
    cap = 2.0 if kind in ("softcap", "both") else None
    layer = MultiHeadAttention(h * d, h, n_kv_heads=k.shape[1], backend=backend,
                               softcap=cap, sinks=kind in ("sinks", "both"))
    if layer.sinks is not None:
        with torch.no_grad():
            layer.sinks.copy_(torch.linspace(-1.0, 2.0, h))
    mask = _hf_mask(pad, s)
    module = _HFModule(h, k.shape[1], d, layer.sinks)
    with torch.no_grad():
        if kind == "softcap":
            want, _ = gemma2(module, q, k, v, mask, scaling=d**-0.5, softcap=cap)
        elif kind == "sinks":
            want, _ = gpt_oss(module, q, k, v, mask, scaling=d**-0.5)
        else:  # no family has both: the scores capped as Gemma 2's, then gpt-oss's softmax
            scores = (q @ k.repeat_interleave(2, dim=1).transpose(-2, -1)) * d**-0.5
            scores = cap * torch.tanh(scores / cap) + mask
            sink = layer.sinks.view(1, -1, 1, 1).expand(b, h, s, 1)
            weights = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
            want = (weights @ v.repeat_interleave(2, dim=1)).transpose(1, 2)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = layer.attend(q, k, v, key_padding_mask=pad)
    shaped = [w for w in caught if "falls back to naive" in str(w.message)]
    assert bool(shaped) == (backend == "sdpa")
    got = got.transpose(1, 2)  # HF's [b, s, H, d]
    rows = ~pad  # a left-padded query has no key: the package returns zeros there
    torch.testing.assert_close(got[rows], want[rows], atol=2e-6, rtol=2e-6)
    assert bool((got[pad] == 0).all())


def test_a_sink_takes_its_share_and_a_cap_bounds_the_scores():
    """With sinks the output is the plain output times sum_j e^x_j / (sum_j e^x_j +
    e^sink) (a large sink takes all the weight); soft-capped scores stay within the cap,
    so huge scores still give bounded odds between keys."""
    q, k, v, _ = _shaped_case(seed=1)
    b, h, s, d = q.shape
    plain = MultiHeadAttention(h * d, h, n_kv_heads=2, backend="naive")
    sink = MultiHeadAttention(h * d, h, n_kv_heads=2, backend="naive", sinks=True)
    assert "sinks=True" in repr(sink) and "sinks" in dict(sink.named_parameters())
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-2, -1)) * d**-0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    with torch.no_grad():
        sink.sinks.copy_(torch.linspace(-1.0, 1.0, h))
        share = torch.sigmoid(lse - sink.sinks.view(1, -1, 1, 1))
        torch.testing.assert_close(sink.attend(q, k, v), plain.attend(q, k, v) * share)
        sink.sinks.fill_(40.0)
        assert sink.attend(q, k, v).abs().max() < 1e-6
        capped = MultiHeadAttention(h * d, h, n_kv_heads=2, backend="naive", softcap=1.0)
        big = torch.zeros_like(q)
        big[..., 0] = 1e4  # scores of about 1e4 * k[..., 0] / 4: capped to (-1, 1)
        out = capped.attend(big, k, v)
        w = (torch.tanh(scores * 0 + (big @ k.repeat_interleave(2, 1).transpose(-2, -1))
                        * d**-0.5)).masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(),
                                                float("-inf")).softmax(-1)
        torch.testing.assert_close(out, w @ v.repeat_interleave(2, dim=1))
        last = w[..., -1, :]  # the last query sees every key: odds within e^2
        assert (last.amax(-1) / last.amin(-1)).max() <= math.e**2 * (1 + 1e-5)
    with pytest.raises(ValueError, match="softcap"):
        MultiHeadAttention(16, 2, softcap=0.0)
    with pytest.raises(TypeError, match="sinks"):
        MultiHeadAttention(16, 2, sinks=1)


@pytest.mark.parametrize("backend", ["naive", "flex"])
@pytest.mark.filterwarnings("ignore:flex backend falls back to naive. single-token")
def test_softcap_and_sinks_decode_through_the_kv_cache_as_one_pass(backend):
    q, k, v, _ = _shaped_case(seed=2, b=1)
    h, d = q.shape[1], q.shape[-1]
    layer = MultiHeadAttention(h * d, h, n_kv_heads=2, backend=backend, softcap=1.5,
                               sinks=True)
    with torch.no_grad():
        layer.sinks.copy_(torch.linspace(0.5, -0.5, h))
        full = layer.attend(q, k, v)
        cache, steps = KVCache(), []
        for t in range(q.shape[2]):
            sl = slice(t, t + 1)
            steps.append(layer.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=2), full, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("backend", ["naive", "sdpa", "auto", "flex"])
def test_chunks_and_temperature_decode_through_the_kv_cache_as_one_pass(backend):
    """Llama 4's chunked attention (by position) and temperature tuning (by cache slot):
    token-by-token decoding equals one pass, and chunks hide every key of an earlier chunk."""
    q, k, v, _ = _shaped_case(seed=3, b=1)
    h, d = q.shape[1], q.shape[-1]
    layer = MultiHeadAttention(h * d, h, n_kv_heads=2, backend=backend, chunk=6,
                               temperature_tuning=(3.0, 0.5))
    assert "chunk=6" in repr(layer) and "temperature_tuning=(3.0, 0.5)" in repr(layer)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex falls back for the one-token steps
        full = layer.attend(q, k, v)
        cache, steps = KVCache(), []
        for t in range(q.shape[2]):
            sl = slice(t, t + 1)
            steps.append(layer.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], kv_cache=cache))
        # query 12 (chunk 2: positions 12..17) sees only key 12: its output is v[12]
        torch.testing.assert_close(full[:, :, 12], v.repeat_interleave(2, 1)[:, :, 12])
    torch.testing.assert_close(torch.cat(steps, dim=2), full, atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="chunk"):
        MultiHeadAttention(16, 2, chunk=0)
    with pytest.raises(TypeError, match="temperature_tuning"):
        MultiHeadAttention(16, 2, temperature_tuning=3.0)


def test_auto_takes_the_undocumented_key_row_on_the_cpu_only():
    """On a GPU (and any device but the CPU) no run of ``attn_mask`` with ``is_causal`` is
    recorded, so the rules answer False without probing: ``"auto"`` makes the documented
    call there. (Before, the probe ran on CUDA at one shape and its answer was trusted.)"""
    for device_type in ("cuda", "xpu", "hpu", "mps"):
        assert backends.key_bias_supported(torch.device(device_type), torch.float32, False,
                                           64) is False
    assert backends.cache_info()["key_bias_probes"].get(("cuda", torch.float32, False, 64)) is None


def test_layer_clear_cache_frees_its_encodings_tables():
    # the public way to free what one long call left: tables of this encoding only
    layer = MultiHeadAttention(16, 4, encoding=tp.make_encoding("alibi", n_heads=4), backend="sdpa")
    other = tp.make_encoding("alibi", n_heads=4)
    backends.cached_bias(other, 0, 8, 8, causal=True, device="cpu")
    layer(torch.randn(1, 300, 16))
    assert len(backends.cached_tensors(layer.encoding)) >= 1
    layer.clear_cache()
    assert backends.cached_tensors(layer.encoding) == []
    assert len(backends.cached_tensors(other)) == 1  # another encoding's table is kept
    layer(torch.randn(1, 10, 16))  # builds again
    assert len(backends.cached_tensors(layer.encoding)) >= 1


_FLEX_WITHOUT_AVX2 = """
import warnings, torch, tutorial_pkg as tp
from tutorial_pkg.attention._flex import flex_compiles_on_cpu
assert not flex_compiles_on_cpu()
torch.manual_seed(0)
flex = tp.MultiHeadAttention(32, 4, tp.ALiBi(4), backend="flex").eval()
naive = tp.MultiHeadAttention(32, 4, tp.ALiBi(4), backend="naive").eval()
naive.load_state_dict(flex.state_dict())
x = torch.randn(1, 128, 32)  # one tile: the first length the backend compiles
with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = flex(x)
assert any("flex backend runs eagerly" in str(w.message) for w in caught), caught
torch.testing.assert_close(out, naive(x), atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_flex_runs_eagerly_where_the_compiled_cpu_kernel_cannot_be_built(tmp_path):
    """Under ATEN_CPU_CAPABILITY=default torch 2.13's compiled FlexAttention CPU template
    raises (InductorError: "torch.compile on current platform is not supported for CPU");
    from one tile on the backend runs flex_attention eagerly there, with a warning, and
    computes the naive backend's output."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "CUDA_VISIBLE_DEVICES": "",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", _FLEX_WITHOUT_AVX2], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def _decode_step(model, x, dtype=torch.float64):
    """``model``'s output for the last token of ``x`` after the others were cached, and the
    same step computed by a float64 naive copy on the same cached keys."""
    import copy

    ref = copy.deepcopy(model).to(dtype)
    ref.backend = "naive"
    with torch.no_grad():
        cache = KVCache()
        model(x[:, :-1], kv_cache=cache)
        ref_cache = copy.deepcopy(cache)
        ref_cache.k, ref_cache.v = cache.k.to(dtype), cache.v.to(dtype)
        return model(x[:, -1:], kv_cache=cache), ref(x[:, -1:].to(dtype), kv_cache=ref_cache)


def test_auto_decoding_step_keeps_float32_precision_at_long_context():
    """One query against 8191 cached keys: the ALiBi row m_h j reaches m_h L; handed to the
    kernel as it is, the entries near the query are rounded at that size (error 6.7e-6 here
    before the row was taken relative to the last key); relative, they stay small."""
    torch.manual_seed(0)
    model = MultiHeadAttention(64, 8, tp.ALiBi(8), backend="auto").eval()
    got, want = _decode_step(model, torch.randn(1, 8192, 64))
    assert (got.double() - want).abs().max().item() < 1e-6


def test_auto_decoding_step_passes_a_row_not_a_table_where_the_key_row_call_is_not_probed():
    """On a device whose kernel rules refuse the undocumented key-row call (every GPU type),
    a decoding step still passes one row per head (the documented float-mask call without
    is_causal), so no (H, T, T) table is built for it."""
    torch.manual_seed(0)
    model = MultiHeadAttention(32, 4, tp.ALiBi(4), backend="auto").eval()
    x = torch.randn(1, 301, 32)
    with backends.assume_kernels("cpu", key_bias=False):
        with torch.no_grad():
            cache = KVCache()
            model(x[:, :-1], kv_cache=cache)  # the documented 4-D table for the prompt
            model.clear_cache()
            out = model(x[:, -1:], kv_cache=cache)
        kept = backends.cached_tensors(model.encoding)
    assert kept and all(t.shape[-2] == 1 for t in kept), [tuple(t.shape) for t in kept]
    _, want = _decode_step(model, x)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
