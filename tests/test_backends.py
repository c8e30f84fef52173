"""Tests of tutorial_pkg.attention.backends as a registry: one signature, each backend's own
fallback, the kernel rules tests switch, the caches; and the KV cache's public contract."""

from __future__ import annotations

import inspect
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
