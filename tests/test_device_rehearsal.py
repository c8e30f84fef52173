"""A GPU rehearsal without a GPU: every device-taking path on a device that is not the CPU.

A GPU run fails where CPU-only CI never looks: a buffer left on the CPU multiplied by
positions built on the GPU, a table cached for one device handed to another, a value read
back to the host (a synchronisation per call on a GPU), a branch on the device type. Here
every path that takes a device runs on two stand-ins for a GPU:

* ``meta``: real tensors without data. A CPU tensor mixed into a meta computation raises
  (as a CPU/CUDA mix does on a GPU), and so does every read back to the host (``.item()``,
  ``int(t)``, ``bool(t)``). Autograd runs, so backward passes are rehearsed here.
* fake CUDA: ``FakeTensorMode(allow_non_fake_inputs=False)`` tensors that report
  ``cuda:0``, so code that branches on the device type takes its GPU branch (masks in
  q's dtype, the compiled FlexAttention, no CPU-only probe), and a real tensor that leaks
  in raises. Limits of a CPU-only torch 2.13, worked around here and checked on CPU:
  autograd of fake CUDA tensors aborts the process (no CUDA device guard), so fake CUDA
  runs forward only, under ``no_grad`` (and :class:`_FakeCudaShim` turns an attempt into
  an error); Python-level indexing, ``~``, ``.copy_()`` and ``.contiguous()`` need that
  guard too, so :class:`_FakeCudaShim` sends them to the equivalent aten ops;
  ``Module.to`` cannot swap fake parameters, so :func:`_to_fake_cuda` replaces them.

Neither device can run FlexAttention's kernel (meta is not a Flex device; on fake CUDA its
eager path compiles) nor SDPA's fused kernels (the math kernel refuses ``attn_mask`` with
``is_causal``). So for ``"flex"`` everything up to the kernel runs (block masks built on
the device, the encodings' ``score_mod``), then :func:`_reference_flex` calls that
``score_mod`` and ``mask_mod`` on index tensors of the device; ``"auto"``'s key-row path
gets :func:`_fused_key_bias_sdpa` for its one fused call. Both stand-ins are checked
against the real kernels on CPU below.

The chapters' own calls (chapters 4 and 5 call ``cached_bias`` / ``cached_key_bias``
directly) are replicated, with the encoding on the CPU where the chapter leaves it there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import tutorial_pkg as tp
from tutorial_pkg import backends
from tutorial_pkg.attention.layer import KVCache, MultiHeadAttention
from tutorial_pkg.models.tiny_lm import TinyLM

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA = torch.device("cuda", 0)
H, D = 2, 8  # heads, head size: tiny, nothing here measures anything
D_MODEL = H * D
#: Attention encodings (the per-layer schedules are TinyLM's, below).
ENCODINGS = {
    "nope": {}, "sinusoidal": {}, "learned": {}, "rope": {}, "p_rope": {}, "alibi": {},
    "alibi_symmetric": {"mode": "symmetric"}, "hybrid": {},
    "hybrid_learnable": {"learnable_scale": True}, "t5": {},
}
BACKENDS = ["naive", "sdpa", "auto", "flex"]
MODEL_ENCODINGS = ["nope", "sinusoidal", "learned", "rope", "alibi", "hybrid", "t5",
                   "irope", "local_global"]
#: Two layers: a NoPE layer in two, a local (window 3) and a global layer.
MODEL_KWARGS = {"irope": {"every": 2}, "local_global": {"pattern": 2, "window": 3}}
#: The model on meta with every backend; on fake CUDA with the GPU's default ("auto", which
#: takes "sdpa" there) and "flex" (the attention test above runs every backend on both).
MODEL_CASES = [pytest.param(d, k, b, id=f"{d}-{k}-{b}") for k in MODEL_ENCODINGS
               for d, bs in (("meta", BACKENDS), ("fake_cuda", ["auto", "flex"])) for b in bs]
_REAL_SDPA = F.scaled_dot_product_attention


def make_encoding(key: str):
    name = key.split("_")[0] if key.startswith(("alibi", "hybrid")) else key
    return tp.make_encoding(name, d_model=D_MODEL, n_heads=H, max_positions=64, **ENCODINGS[key])


# --------------------------------------------------------------------------- fake CUDA
def _split_index(t: torch.Tensor, index):
    """Basic indexing as aten views; the tensor part as ``aten.index``'s list (or None)."""
    if not isinstance(index, tuple):
        index = (index,)
    used = sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
               for i in index if i is not None and i is not Ellipsis)
    out, dim, advanced = t, 0, {}
    for i in index:
        if i is Ellipsis:
            dim += t.dim() - used
        elif i is None:
            out, dim = out.unsqueeze(dim), dim + 1
        elif isinstance(i, bool):
            raise NotImplementedError("a bool index")
        elif isinstance(i, int):
            out = out.select(dim, i)
        elif isinstance(i, slice):
            stop = 2**62 if i.stop is None else i.stop
            out = torch.ops.aten.slice.Tensor(out, dim, i.start or 0, stop, i.step or 1)
            dim += 1
        elif isinstance(i, torch.Tensor):
            advanced[dim] = i
            dim += i.dim() if i.dtype == torch.bool else 1
        else:
            raise NotImplementedError(f"an index of type {type(i).__name__}")
    return out, ([advanced.get(d) for d in range(max(advanced) + 1)] if advanced else None)


class _FakeCudaShim(TorchFunctionMode):
    """Fake CUDA on a CPU-only torch: guarded methods as aten ops, and no autograd.

    A CPU-only torch has no CUDA device guard, so ``t[i]``, ``t[i] = v``, ``~t``,
    ``t.copy_(u)`` and ``t.contiguous()`` raise on fake CUDA tensors before
    FakeTensorMode sees them: they are sent to the equivalent aten ops. Recording
    autograd on a fake CUDA tensor aborts the whole process (the same missing guard):
    such a call raises a RuntimeError here instead, so a path that turns gradients on
    fails its test, not the test run. A read back to the host (``int(t)``, ``.item()``)
    raises naming it: on a GPU it is a synchronisation.
    """

    _READS = {torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__bool__,
              torch.Tensor.__index__, torch.Tensor.item, torch.Tensor.tolist}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fake_cuda = [t for t in tree_leaves((args, kwargs))
                     if isinstance(t, FakeTensor) and t.device.type == "cuda"]
        if func in self._READS and fake_cuda:
            raise RuntimeError(f"{func} reads a CUDA tensor back to the host (a device "
                               f"synchronisation on a GPU; fake tensors hold no values)")
        if torch.is_grad_enabled() and any(t.requires_grad for t in fake_cuda):
            raise RuntimeError(f"{func} would record autograd on a fake CUDA tensor (it aborts "
                               f"a CPU-only torch); the rehearsal runs fake CUDA under no_grad")
        if func is torch.Tensor.__getitem__:
            out, indices = _split_index(*args)
            return out if indices is None else torch.ops.aten.index.Tensor(out, indices)
        if func is torch.Tensor.__setitem__:
            t, index, value = args
            out, indices = _split_index(t, index)
            if not isinstance(value, torch.Tensor):
                value = torch.full((), value, dtype=t.dtype, device=t.device)
            if indices is None:
                torch.ops.aten.copy_(out, value)
            else:
                torch.ops.aten.index_put_(out, indices, value)
            return None
        if func is torch.Tensor.__invert__:
            return torch.bitwise_not(*args)
        if func is torch.Tensor.copy_ and not kwargs and len(args) == 2:
            return torch.ops.aten.copy_(*args)
        if func is torch.Tensor.contiguous and not kwargs and len(args) == 1:
            t = args[0]
            return t if t.is_contiguous() else torch.ops.aten.clone(
                t, memory_format=torch.contiguous_format)
        try:
            return func(*args, **kwargs)
        except RuntimeError as err:
            if "not linked with support for cuda" in str(err):  # a method to map above
                raise RuntimeError(f"{func} needs a CUDA device guard (_FakeCudaShim)") from err
            raise


def _to_fake_cuda(module: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """Replace every parameter and buffer of a meta ``module`` by a fake ``cuda:0`` one."""
    new: dict[int, torch.Tensor] = {}  # shared tensors (one encoding in every layer) stay shared
    for m in module.modules():
        for store, wrap in ((m._parameters, True), (m._buffers, False)):
            for name, t in store.items():
                if t is None:
                    continue
                if id(t) not in new:
                    fake = FakeTensor(mode, t.data if wrap else t, CUDA)
                    new[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if wrap else fake
                store[name] = new[id(t)]
    return module


# --------------------------------------------------------------------------- the two devices
class Meta:
    """The ``meta`` device: data-less real tensors; autograd runs."""

    name, device, dtype, backward = "meta", torch.device("meta"), torch.float32, True

    def host(self, build):  # what the chapter leaves on the CPU
        return build()

    def on_device(self, build):  # what the chapter moves with .to(device)
        return build().to(self.device)

    def run(self):
        return contextlib.nullcontext()


class FakeCuda:
    """Fake ``cuda:0`` tensors in float16 (the GPU's dtype); forward only, see the docs."""

    name, device, dtype, backward = "fake_cuda", CUDA, torch.float16, False

    def __init__(self):
        self.mode = FakeTensorMode(allow_non_fake_inputs=False)

    def host(self, build):
        with self.mode:  # fake CPU tensors: "left on the CPU", and still no data
            return build()

    def on_device(self, build):
        with torch.device("meta"):
            module = build()
        return _to_fake_cuda(module, self.mode)

    @contextlib.contextmanager
    def run(self):
        with self.mode, _FakeCudaShim(), torch.no_grad():
            yield


@pytest.fixture(params=["meta", "fake_cuda"])
def dev(request):
    return Meta() if request.param == "meta" else FakeCuda()  # caches: tests/conftest.py


def _assume_kernels(monkeypatch, device_type, **rules):
    """``backends.assume_kernels(device_type, **rules)`` for the rest of the test."""
    monkeypatch.setitem(backends.KERNEL_RULES, device_type,
                        dataclasses.replace(backends.kernel_rules(device_type), **rules))


def _fake_kernels(monkeypatch):
    """FlexAttention and the fused key-row SDPA call as stand-ins (see the module docs)."""
    calls = {"flex": [], "sdpa_key_bias": 0}

    def flex_fn(compiled, dynamic=False):
        calls["flex"].append(compiled)
        return _reference_flex

    monkeypatch.setattr(backends, "flex_kernel", flex_fn)
    # Flex refuses meta tensors; let the backend run up to the (stand-in) kernel there too
    _assume_kernels(monkeypatch, "meta", flex=True, flex_backward=True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", _fused_key_bias_sdpa)
    real_sdpa_key_bias = backends.sdpa_key_bias

    def sdpa_key_bias(*args, **kwargs):
        calls["sdpa_key_bias"] += 1
        return real_sdpa_key_bias(*args, **kwargs)

    monkeypatch.setattr(backends, "sdpa_key_bias", sdpa_key_bias)
    return calls


def _reference_flex(q, k, v, score_mod=None, block_mask=None, enable_gqa=False, **_):
    """FlexAttention's result, computed with its ``score_mod`` and ``mask_mod`` on index
    tensors of q's device (so a captured tensor on another device fails here as in Flex)."""
    if enable_gqa:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[-2], k.shape[-2]
    scores = q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.shape[-1])
    ar = lambda n: torch.arange(n, device=q.device)  # noqa: E731
    idx = (ar(b)[:, None, None, None], ar(h)[None, :, None, None],
           ar(lq)[None, None, :, None], ar(lk)[None, None, None, :])
    if score_mod is not None:
        scores = score_mod(scores, *idx)
    if block_mask is not None:
        scores = torch.where(block_mask.mask_mod(*idx), scores, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def _fused_key_bias_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
    """SDPA that takes a float mask *and* ``is_causal`` as the fused kernels do."""
    if attn_mask is not None and is_causal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                            device=q.device).triu(1)
        attn_mask = torch.where(future, float("-inf"), attn_mask)
        is_causal = False
    return _REAL_SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                      **kw)


def _qkv(dev, b=2, s=8, requires_grad=False):
    return [torch.randn(b, H, s, D, device=dev.device, dtype=dev.dtype,
                        requires_grad=requires_grad) for _ in range(3)]


def _assert_names_both(err: pytest.ExceptionInfo, a, b) -> None:
    message = str(err.value)
    for device in (a, b):
        assert torch.device(device).type in message, message


# --------------------------------------------------------------------------- stand-ins
INDEXES = [(None,), (slice(None), None), (Ellipsis, None, slice(None)), (0,), (slice(1, 3),),
           (Ellipsis, slice(None, 2)), (slice(None), slice(None), slice(1, None, 2)),
           (torch.tensor([1, 0]),), (slice(None), torch.tensor([[0, 2], [1, 1]])),
           (torch.tensor([0, 1])[:, None], slice(None), torch.tensor([1, 2])),
           (Ellipsis, torch.tensor([3, 0]))]


@pytest.mark.parametrize("index", INDEXES, ids=str)
def test_cuda_indexing_equals_torch_indexing(index):
    t = torch.arange(2 * 3 * 4 * 5).view(2, 3, 4, 5)
    want = t[index]
    mutated = t.clone()
    mutated[index] = -1
    with _FakeCudaShim():
        got = t[index]
        mine = t.clone()
        mine[index] = -1
        inverted = ~(t > 3)
        transposed = t.transpose(1, 2).contiguous()
    assert torch.equal(got, want)
    assert torch.equal(mine, mutated)
    assert torch.equal(inverted, t <= 3)
    assert transposed.is_contiguous() and torch.equal(transposed, t.transpose(1, 2))


@pytest.mark.parametrize("key", ["alibi", "hybrid", "t5", "rope"])
@pytest.mark.parametrize("case", ["causal", "padding", "documents", "window"])
def test_the_stand_in_kernels_give_naive_attention_on_cpu(monkeypatch, key, case):
    calls = _fake_kernels(monkeypatch)
    _assume_kernels(monkeypatch, "cpu", key_bias=True)
    _ = torch.manual_seed(0)
    enc = make_encoding(key)
    layers = {b: MultiHeadAttention(D_MODEL, H, enc, backend=b, window=3 if case == "window"
                                    else None) for b in ("naive", "flex", "auto")}
    for layer in layers.values():
        layer.load_state_dict(layers["naive"].state_dict())
    x = torch.randn(2, 8, D_MODEL)
    kw = {}
    if case == "padding":
        pad = torch.zeros(2, 8, dtype=torch.bool)
        pad[1, :3] = True
        kw = {"positions": tp.positions_from_padding(pad), "key_padding_mask": pad}
    elif case == "documents":
        docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
        kw = {"positions": tp.positions_from_documents(docs), "document_ids": docs}
    with torch.no_grad():
        want = layers["naive"](x, **kw)
        for backend in ("flex", "auto"):
            torch.testing.assert_close(layers[backend](x, **kw), want, atol=1e-5, rtol=1e-5)
    assert calls["flex"], "the flex stand-in was not used"
    if case == "causal" and key in ("alibi", "hybrid"):
        assert calls["sdpa_key_bias"] == 1  # auto took the fused key-row path, with the stand-in


def test_the_fused_key_bias_stand_in_equals_cpu_sdpa():
    q, k, v = (torch.randn(1, H, 8, D) for _ in range(3))
    row = torch.randn(1, H, 1, 8)
    want = _REAL_SDPA(q, k, v, attn_mask=row, is_causal=True)  # the CPU fused kernel takes both
    torch.testing.assert_close(_fused_key_bias_sdpa(q, k, v, attn_mask=row, is_causal=True), want)


# --------------------------------------------------------------------------- chapter calls
def test_chapter5_cached_bias_and_key_bias_of_an_encoding_left_on_the_cpu(dev):
    seq_len = 16
    alibi_enc = dev.host(lambda: tp.make_encoding("alibi", n_heads=H))  # never moved
    with dev.run():
        first = backends.cached_bias(alibi_enc, 0, seq_len, seq_len, causal=True,
                                     device=dev.device)
        second = backends.cached_bias(alibi_enc, 0, seq_len, seq_len, causal=True,
                                      device=dev.device)
        row = backends.cached_key_bias(alibi_enc, seq_len, device=dev.device)
    assert first.device.type == dev.device.type and first.dtype == torch.float32
    assert tuple(first.shape) == (1, H, seq_len, seq_len)
    assert row.device.type == dev.device.type and tuple(row.shape) == (1, H, 1, seq_len)
    if dev.name == "meta":  # the chapter: "not rebuilt: the same storage" (no cache when fake)
        assert first._base is second._base is not None


def test_chapter5_profiled_masks_and_auto_layer(dev):
    L_MAX = 16
    enc = dev.host(lambda: tp.make_encoding("alibi", n_heads=H))
    auto_layer = dev.on_device(lambda: MultiHeadAttention(D_MODEL, H,
                                                          tp.make_encoding("alibi", n_heads=H)))
    with dev.run():
        q, k, v = _qkv(dev, b=1, s=L_MAX)
        bias4 = backends.cached_bias(enc, 0, L_MAX, L_MAX, causal=True, device=dev.device,
                                     dtype=q.dtype)
        outs = [F.scaled_dot_product_attention(q, k, v, attn_mask=bias4[0]),
                F.scaled_dot_product_attention(q, k, v, attn_mask=bias4)]
        with torch.no_grad():
            outs.append(auto_layer.attend(q, k, v))
        row = backends.cached_key_bias(tp.make_encoding("alibi", n_heads=H), 64,
                                      device=dev.device)
    assert bias4.device.type == dev.device.type and bias4.dtype == q.dtype
    for out in outs:
        assert out.device.type == dev.device.type and out.dtype == q.dtype
    assert row.dtype == torch.float32 and row.device.type == dev.device.type  # never rounded


def test_chapter4_table_sizes_on_the_device(dev):
    L_chk = 256
    layer = dev.on_device(lambda: MultiHeadAttention(D_MODEL, H,
                                                     tp.make_encoding("alibi", n_heads=H)))
    alibi_enc = layer.encoding
    backends.clear_caches(alibi_enc)
    with dev.run():
        cached = backends.cached_bias(alibi_enc, 0, L_chk, L_chk, causal=True, device=dev.device)
        row = backends.cached_key_bias(alibi_enc, L_chk, device=dev.device)
        probe = backends.key_bias_supported(dev.device, torch.float32, False)
    # the chapter's formulas: one float32 (H, L, L) table, one (H, L) row
    assert cached.untyped_storage().nbytes() == H * L_chk * L_chk * 4
    assert row.untyped_storage().nbytes() == H * L_chk * 4
    assert cached.device.type == row.device.type == dev.device.type
    assert probe is False  # nothing runs on data-less tensors: nothing is proven ...
    assert not any(key[0] == dev.device.type for key in backends.cache_info()["key_bias_probes"])


# --------------------------------------------------------------------------- every path
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", list(ENCODINGS))
def test_every_encoding_and_backend_runs_on_the_device(monkeypatch, dev, key, backend):
    calls = _fake_kernels(monkeypatch)
    if key in ("alibi", "hybrid"):  # let "auto" take its key-row path (the stand-in kernel)
        _assume_kernels(monkeypatch, dev.device.type, key_bias=True)
    layer = dev.on_device(lambda: MultiHeadAttention(D_MODEL, H, make_encoding(key),
                                                     backend=backend))
    with dev.run():
        x = torch.randn(2, 8, D_MODEL, device=dev.device, requires_grad=dev.backward)
        positions = torch.arange(8, device=dev.device)
        h = layer.encoding.embed(x, positions)
        out = layer(h)
        q, k, v = _qkv(dev, requires_grad=dev.backward)  # float16 on fake CUDA: the GPU's masks
        heads = layer.attend(q, k, v)  # default positions: the cached tables
        explicit = layer.attend(q, k, v, positions=positions)  # the uncached bias
        if dev.backward:
            (out.sum() + heads.sum() + explicit.sum()).backward()
    for o in (out, heads, explicit):
        assert o.device.type == dev.device.type
    assert out.shape == x.shape and heads.shape == explicit.shape == q.shape
    assert heads.dtype == q.dtype
    if dev.backward:
        grads = [x.grad, q.grad, *(p.grad for p in layer.parameters() if p.requires_grad)]
        assert all(g is not None and g.device.type == "meta" for g in grads)
    if backend == "flex":  # flex ran (no fallback), compiled as off the CPU it always is
        assert calls["flex"] and all(calls["flex"])
    if backend == "auto" and key in ("alibi", "hybrid"):
        assert calls["sdpa_key_bias"] >= 1


@pytest.mark.parametrize(("dev", "key", "backend"), MODEL_CASES, indirect=["dev"])
def test_tiny_lm_forward_backward_padding_and_kv_cache_on_the_device(monkeypatch, dev, key,
                                                                      backend):
    calls = _fake_kernels(monkeypatch)
    model = dev.on_device(lambda: TinyLM(key, d_model=D_MODEL, n_layers=2, n_heads=H,
                                         max_positions=64, backend=backend,
                                         encoding_kwargs=MODEL_KWARGS.get(key)))
    with dev.run(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-token steps fall back from flex, by design
        ids = torch.randint(0, 256, (2, 8), device=dev.device)
        logits = model(ids)
        if dev.backward:
            model.loss(ids, ids).backward()
        # left padding: two pad tokens in row 0, positions counted from the first real one
        pad = torch.zeros(2, 8, dtype=torch.bool, device=dev.device)
        pad[0, :2] = True
        padded = model(ids, positions=tp.positions_from_padding(pad), key_padding_mask=pad)
        # KV cache: a prefill of 5 tokens, then one token at a time, padding mask extended
        caches = model.new_caches()
        pos = tp.positions_from_padding(pad)
        steps = [model(ids[:, :5], positions=pos[:, :5], caches=caches,
                       key_padding_mask=pad[:, :5])]
        for t in range(5, 8):
            steps.append(model(ids[:, t: t + 1], positions=pos[:, t: t + 1], caches=caches,
                               key_padding_mask=pad[:, : t + 1]))
        # default positions with a cache (the cached-table paths)
        caches = model.new_caches()
        decoded = [model(ids[:, :4], caches=caches), model(ids[:, 4:5], caches=caches)]
        docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]] * 2, device=dev.device)
        packed = model(ids, positions=tp.positions_from_documents(docs), document_ids=docs)
    for out in (logits, padded, *steps, *decoded, packed):
        assert out.device.type == dev.device.type and out.shape[-1] == 256
    assert caches[0].k.device.type == dev.device.type and caches[0].length == 5
    if dev.backward:
        assert all(p.grad is not None and p.grad.device.type == "meta"
                   for p in model.parameters() if p.requires_grad)
    if backend == "flex":
        assert calls["flex"]


def test_learned_positions_past_max_positions_raise_on_the_device_without_a_read_back(dev):
    model = dev.on_device(lambda: TinyLM("learned", d_model=D_MODEL, n_layers=1, n_heads=H,
                                         max_positions=8))
    with dev.run():
        ids = torch.randint(0, 256, (1, 9), device=dev.device)
        model(ids[:, :8])
        with pytest.raises(ValueError, match="max_positions=8"):
            model(ids)


# --------------------------------------------------------------------------- bad devices
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", list(ENCODINGS))
def test_a_layer_left_on_the_cpu_moves_constants_or_names_both_devices(monkeypatch, dev, key,
                                                                       backend):
    _fake_kernels(monkeypatch)
    layer = dev.host(lambda: MultiHeadAttention(D_MODEL, H, make_encoding(key),
                                                backend=backend))
    learned = any(True for _ in layer.encoding.parameters())
    flex_captures = backend == "flex" and layer.encoding.has_bias
    with dev.run():
        q, k, v = _qkv(dev)
        if learned or flex_captures:
            with pytest.raises(ValueError) as err:
                layer.attend(q, k, v)
            _assert_names_both(err, "cpu", dev.device)
            return
        out = layer.attend(q, k, v)  # constants (slopes, RoPE tables) moved to q's device
    assert out.device.type == dev.device.type


@pytest.mark.parametrize("call", ["cached_bias", "cached_key_bias", "bias_hook"])
@pytest.mark.parametrize("key", ["t5", "hybrid_learnable"])
def test_a_learned_encoding_on_another_device_names_both(dev, key, call):
    enc = dev.host(lambda: make_encoding(key))
    with dev.run():
        pos = torch.arange(8, device=dev.device)
        with pytest.raises(ValueError) as err:
            if call == "cached_bias":
                backends.cached_bias(enc, 0, 8, 8, causal=True, device=dev.device)
            elif call == "cached_key_bias":
                backends.cached_key_bias(enc, 8, device=dev.device)
            else:
                enc.bias(pos, pos)
    _assert_names_both(err, "cpu", dev.device)


def test_inputs_on_another_device_than_the_weights(dev):
    layer = dev.host(lambda: MultiHeadAttention(D_MODEL, H, tp.make_encoding("alibi", n_heads=H)))
    learned = dev.host(lambda: tp.make_encoding("learned", d_model=D_MODEL, max_positions=8))
    model = dev.on_device(lambda: TinyLM("alibi", d_model=D_MODEL, n_layers=1, n_heads=H))
    with dev.run():
        x = torch.randn(1, 4, D_MODEL, device=dev.device)
        q, k, v = _qkv(dev)
        checks = [lambda: layer(x),  # activations are never copied silently
                  lambda: layer.attend(q, torch.empty_like(k, device="cpu"), v),
                  lambda: learned.embed(x, torch.arange(4, device=dev.device))]
        for call in checks:
            with pytest.raises(ValueError) as err:
                call()
            _assert_names_both(err, "cpu", dev.device)
        cache = KVCache()
        cache.update(*(torch.empty_like(t, device="cpu") for t in (k, v)), torch.arange(8)[None])
        with pytest.raises(ValueError) as err:
            cache.update(k, v, torch.arange(8, 16, device=dev.device)[None])
        _assert_names_both(err, "cpu", dev.device)
        # token ids (a reader's CPU batch) are moved to the model, as positions and masks are
        ids = torch.randint(0, 256, (1, 4))
        out = model(ids, positions=torch.arange(4), key_padding_mask=torch.zeros(1, 4,
                                                                                  dtype=torch.bool))
    assert out.device.type == dev.device.type


# --------------------------------------------------------------------------- caches
def test_tables_cached_for_one_device_are_never_served_to_another():
    enc = tp.make_encoding("alibi", n_heads=H)
    want = tp.alibi_bias(enc.slopes, 8).masked_fill(
        torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    for device in ("cpu", "meta", "cpu", "meta"):
        bias = backends.cached_bias(enc, 0, 8, 8, causal=True, device=device)
        row = backends.cached_key_bias(enc, 8, device=device)
        assert bias.device.type == row.device.type == device
        if device == "cpu":  # the CPU table is what it always was
            torch.testing.assert_close(bias[0], want)
            torch.testing.assert_close(row[0, :, 0], enc.slopes[:, None] * torch.arange(8.0))
    assert {t.device.type for t in backends.cached_tensors(enc)} == {"cpu", "meta"}


def test_nothing_is_cached_or_served_under_fake_tensor_mode(monkeypatch):
    _fake_kernels(monkeypatch)
    fake = FakeCuda()
    enc = fake.host(lambda: tp.make_encoding("alibi", n_heads=H))
    layer = fake.on_device(lambda: MultiHeadAttention(D_MODEL, H,
                                                      tp.make_encoding("alibi", n_heads=H),
                                                      backend="flex"))
    before = backends.cache_info()
    with fake.run():
        backends.cached_bias(enc, 0, 8, 8, causal=True, device=CUDA)
        backends.cached_key_bias(enc, 8, device=CUDA)
        layer.attend(*_qkv(fake))  # a causal block mask on fake cuda
        backends.key_bias_supported(CUDA, torch.float16, False)
    assert backends.cached_tensors(enc) == []
    after = backends.cache_info()
    assert after["block_masks"] == before["block_masks"]
    assert after["key_bias_probes"] == before["key_bias_probes"]  # nothing kept from a fake run
    # and a real call after the fake run builds real tensors
    real = tp.make_encoding("alibi", n_heads=H)
    assert not isinstance(backends.cached_bias(real, 0, 8, 8, causal=True, device="cpu"),
                          FakeTensor)


def test_the_key_bias_probe_does_not_run_on_meta():
    assert backends.key_bias_supported(torch.device("meta"), torch.float32, False) is False
    assert backends.probe_key_bias(torch.device("meta"), torch.float32, False) is None
    probes = backends.cache_info()["key_bias_probes"]
    assert not any(key[0] == "meta" for key in probes)  # not cached either


def test_the_shim_turns_fake_cuda_autograd_into_an_error():
    fake = FakeCuda()
    with fake.mode, _FakeCudaShim():
        x = torch.randn(2, device=CUDA, requires_grad=True)
        with pytest.raises(RuntimeError, match="would record autograd"):
            x * 2
        with torch.no_grad():
            assert (x * 2).device == CUDA
            with pytest.raises(RuntimeError, match="reads a CUDA tensor back to the host"):
                int(x.sum())
