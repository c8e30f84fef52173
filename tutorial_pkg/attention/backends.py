"""Attention backends: one registry, one signature. Chapters 4 and 5.

:data:`BACKENDS` maps a name to a function with the signature of Hugging Face's
``ALL_ATTENTION_FUNCTIONS``::

    fn(q, k, v, plan, encoding, *, dropout_p=0.0, compile=True) -> out

``q`` is ``[b, H, s, d]``, ``k`` and ``v`` ``[b, H_kv, L_k, d]`` (grouped-query when
``H_kv < H``), all on one device; ``plan`` an :class:`~tutorial_pkg.attention.masks.AttentionPlan`
(positions, cache offset, masks, scale); ``encoding`` a
:class:`~tutorial_pkg.encodings.builtin.PositionEncoding`, whose bias hooks the backend calls.
``out`` is ``[b, H, s, d]`` in q's dtype. Every backend computes
``softmax(c q k^T + bias)`` (the bias after the scale ``c``, as in Hugging Face's layers),
takes its mask from the plan's rules (:mod:`tutorial_pkg.attention.masks`), returns zeros for a
query with no key (never NaN), handles its own fallback, and agrees with ``"naive"`` to
tolerance (tested for every encoding). ``compile`` matters to ``"flex"`` only.

* ``"naive"``: matmul, softmax, matmul, in float32 (float64 for float64 inputs); the
  textbook form and the test oracle, the only one that returns weights (``need_weights``).
* ``"sdpa"``: :func:`torch.nn.functional.scaled_dot_product_attention`; ``is_causal=True``
  where there is neither bias nor mask, else a 4-D mask ``(1 or b, H, s, L_k)`` (the
  bias cached per encoding: :func:`cached_bias`).
* ``"flex"``: FlexAttention, the encoding's ``score_mod`` and the plan's block mask
  (:func:`flex_block_mask`); nothing ``L x L`` is built. Where it cannot run
  (:func:`flex_blocker` says why) it warns (``RuntimeWarning``, "flex backend falls back
  to sdpa: ...") and computes ``"sdpa"``.
* ``"auto"``: the default. Where the encoding has a key-only form
  (:meth:`~tutorial_pkg.encodings.builtin.PositionEncoding.key_bias`, causal ALiBi and the hybrid),
  q is float32 or float64, and :func:`key_bias_supported` has proven the kernel right, SDPA's
  fused causal kernel with that row ``(1 or b, H, 1, L_k)`` in q's dtype
  (:func:`auto_key_bias`, :func:`sdpa_key_bias`); else ``"sdpa"``.

Every float mask handed to a kernel has q's dtype (PyTorch documents "a float mask of the
same type as query"; torch 2.13's CPU kernel misreads a float32 mask with float64 q on
some CPUs), built by :func:`~tutorial_pkg.attention.masks.additive_mask`.

Caches are bounded: per encoding (held weakly) at most :data:`MAX_CACHED_TABLES` bias
tables and rows, keyed by device, dtype and
:meth:`~tutorial_pkg.encodings.builtin.PositionEncoding.cache_key`; at most
:data:`MAX_BLOCK_MASKS` block masks. Under a ``FakeTensorMode`` nothing is cached or
served. :func:`clear_caches` empties them; :func:`cache_info` counts them.

Devices: what a backend builds for a call (tables, rows, block masks) is built on q's
device from the encoding's constants. Learned tensors are never copied: elsewhere than q
they raise ``ValueError`` naming both devices (for ``"flex"``, any tensor of the
encoding). The one read back to the host is the key-row probe, once per
(device type, dtype, GQA).

What the backends assume of a device type's kernels is a :class:`KernelRules` in
:data:`KERNEL_RULES`; :func:`assume_kernels` changes it within a ``with`` block, so that
tests run the GPU's rules on a CPU.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._checks import check_device, fake_mode_active
from ..encodings.builtin import PositionEncoding, check_learned_device
from .masks import (
    AttentionPlan,
    additive_mask,
    causal_mask,
    dense_mask,
    offset_queries,
    round_bias,
)

try:  # FlexAttention: torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _FLEX_IMPORT_ERROR = None
except ImportError as _err:  # pragma: no cover - depends on the installed torch
    flex_attention = create_block_mask = None
    _FLEX_IMPORT_ERROR = str(_err)

__all__ = [
    "BACKENDS",
    "MAX_CACHED_TABLES",
    "MAX_BLOCK_MASKS",
    "FLEX_TILE",
    "AttentionPlan",
    "KernelRules",
    "KERNEL_RULES",
    "kernel_rules",
    "assume_kernels",
    "flex_available",
    "cached_bias",
    "cached_key_bias",
    "cached_tensors",
    "cache_info",
    "clear_caches",
    "key_bias_supported",
    "probe_key_bias",
    "naive",
    "sdpa",
    "auto",
    "auto_key_bias",
    "sdpa_key_bias",
    "flex_blocker",
    "flex_block_mask",
    "flex_kernel",
    "flex",
]

#: Bias tables and key rows kept per encoding (least recently used dropped first).
MAX_CACHED_TABLES = 4
#: FlexAttention block masks kept (least recently used dropped first).
MAX_BLOCK_MASKS = 32
#: FlexAttention's tile (block) size; below it, CPU calls run eagerly (see :func:`flex`).
FLEX_TILE = 128


# --------------------------------------------------------------------------- kernel rules
@dataclass(frozen=True)
class KernelRules:
    """What the backends assume of the kernels of one device type.

    Attributes:
        key_bias: the answer of :func:`key_bias_supported` for every dtype; None = probe.
        flex: FlexAttention runs on this device type.
        flex_backward: FlexAttention has a backward there (not on CPU in torch 2.13).
    """

    key_bias: bool | None = None
    flex: bool = False
    flex_backward: bool = False


#: What the backends assume per device type; a type not listed gets ``KernelRules()``,
#: nothing assumed. torch 2.13's FlexAttention devices (its ``_validate_device``).
KERNEL_RULES: dict[str, KernelRules] = {
    "cpu": KernelRules(flex=True),
    "mps": KernelRules(flex=True),
    **{t: KernelRules(flex=True, flex_backward=True) for t in ("cuda", "xpu", "hpu")},
}


def kernel_rules(device_type: str) -> KernelRules:
    """The :class:`KernelRules` the backends follow on ``device_type`` (e.g. ``"cuda"``)."""
    return KERNEL_RULES.get(device_type) or KernelRules()


@contextlib.contextmanager
def assume_kernels(device_type: str, **rules):
    """Within the ``with`` block, follow ``rules`` (fields of :class:`KernelRules`) on
    ``device_type``: e.g. the GPU's ``key_bias=False`` on ``"cpu"``.
    Unknown fields raise ``TypeError``."""
    missing = object()
    before = KERNEL_RULES.get(device_type, missing)
    KERNEL_RULES[device_type] = replace(kernel_rules(device_type), **rules)
    try:
        yield KERNEL_RULES[device_type]
    finally:
        if before is missing:
            KERNEL_RULES.pop(device_type, None)
        else:
            KERNEL_RULES[device_type] = before


def _zero_empty_rows(out: torch.Tensor, has_key: torch.Tensor | None) -> torch.Tensor:
    # A query with no allowed key gets zeros (never NaN, never a uniform average).
    if has_key is None:
        return out
    return torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))


def _kernel_kwargs(q: torch.Tensor, k: torch.Tensor, plan: AttentionPlan) -> dict:
    # GQA, and the plan's scale where it is not the kernels' default 1 / sqrt(head_dim)
    kw = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if plan.scale is not None:
        kw["scale"] = plan.scale
    return kw


# --------------------------------------------------------------------------- caches
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_block_masks: OrderedDict = OrderedDict()
_key_bias_ok: dict = {}
_compiled_flex: dict = {}  # dynamic (bool) -> compiled flex_attention


def _overrides(encoding: PositionEncoding, hook: str) -> bool:
    return getattr(type(encoding), hook) is not getattr(PositionEncoding, hook)


def _lookup(encoding: PositionEncoding, key: tuple, size: int, build):
    if fake_mode_active():  # tensors without data: neither stored nor served
        return build()
    entries = _tables.setdefault(encoding, OrderedDict())
    key = (*key, encoding.cache_key())
    table = entries.get(key)
    if table is None or table.shape[-1] < size:
        table = build()
        if table is None:
            return None
        entries[key] = table
    entries.move_to_end(key)
    while len(entries) > MAX_CACHED_TABLES:
        entries.popitem(last=False)
    return table


def _table_size(n: int) -> int:
    return max(128, 1 << (max(n, 1) - 1).bit_length())


def cached_bias(
    encoding: PositionEncoding,
    q_start: int,
    q_len: int,
    k_len: int,
    *,
    causal: bool,
    device,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor | None:
    """The encoding's bias as a 4-D additive mask ``(1, H, q_len, k_len)``, cached.

    Queries at positions ``q_start..q_start+q_len-1``, keys at ``0..k_len-1``; with
    ``causal`` the future keys hold ``-inf``. One square table per (encoding, device,
    dtype, causal) is built for the longest length seen (rounded up to a power of
    two) and sliced, so the ``L x L`` bias is built once per length, not per call. A
    learnable bias (``static_bias = False``) is rebuilt on every call. ``None`` if the
    encoding has no bias.

    Built on ``device`` from the encoding's constants (ALiBi's slopes); learned
    parameters on another device raise ``ValueError`` naming both (move them first).
    """
    device = torch.device(device)
    check_learned_device(encoding, device)
    n = max(q_start + q_len, k_len)

    if not encoding.static_bias:
        return _masked_bias(encoding, torch.arange(q_start, q_start + q_len, device=device),
                            torch.arange(k_len, device=device), causal, dtype)

    def build():
        pos = torch.arange(_table_size(n), device=device)
        return _masked_bias(encoding, pos, pos, causal, dtype)

    table = _lookup(encoding, ("bias", device, dtype, causal), n, build)
    return None if table is None else table[:, :, q_start : q_start + q_len, :k_len]


def _masked_bias(encoding, q_pos, k_pos, causal, dtype):
    # A static bias is a cached constant: never record a graph for it.
    with torch.set_grad_enabled(torch.is_grad_enabled() and not encoding.static_bias):
        bias = encoding.bias(q_pos, k_pos)
        if bias is None:
            return None
        bias = _as_4d(bias).expand(-1, -1, q_pos.numel(), -1)
        if causal:
            future = ~causal_mask(None, None, q_pos[:, None], k_pos[None, :])
            bias = bias.masked_fill(future, float("-inf"))
    return round_bias(bias, dtype)


def cached_key_bias(encoding: PositionEncoding, k_len: int, *, device) -> torch.Tensor | None:
    """The encoding's ``key_bias`` for keys ``0..k_len-1`` as ``(1, H, 1, k_len)``, cached.

    Float32 (float64 for float64 slopes), cast to q's dtype per call by
    :func:`sdpa_key_bias`, which ``"auto"`` calls for float32 and float64 q only: the row
    holds ``m_h j``, which grows with ``j``; rounded to bfloat16 it would lose the small
    differences between neighbouring keys. ``H`` floats per position, not ``H L`` as
    for :func:`cached_bias`. A learnable bias is rebuilt on every call. ``None`` if
    the encoding has no key-only form. Built on ``device`` as :func:`cached_bias` is.
    """
    device = torch.device(device)
    check_learned_device(encoding, device)
    if not encoding.static_bias:
        row = encoding.key_bias(torch.arange(k_len, device=device))
        return None if row is None else _as_4d(row)

    def build():
        with torch.no_grad():
            row = encoding.key_bias(torch.arange(_table_size(k_len), device=device))
        return None if row is None else _as_4d(row)

    row = _lookup(encoding, ("row", device), k_len, build)
    return None if row is None else row[..., :k_len]


def cached_tensors(encoding: PositionEncoding) -> list[torch.Tensor]:
    """The bias tables and key rows held for ``encoding`` (to count memory)."""
    return list(_tables.get(encoding, {}).values())


def cache_info() -> dict:
    """What this module holds: ``tables`` (bias tables and key rows, all encodings),
    ``block_masks``, ``key_bias_probes`` (``{(device type, dtype, gqa): bool}``, the
    probes' answers) and ``compiled_flex`` (the ``dynamic`` flags compiled so far)."""
    return {"tables": sum(len(t) for t in _tables.values()),
            "block_masks": len(_block_masks),
            "key_bias_probes": dict(_key_bias_ok),
            "compiled_flex": tuple(sorted(_compiled_flex))}


def clear_caches(encoding: PositionEncoding | None = None) -> None:
    """Drop the cached tables of one encoding, or every table and block mask.

    Probe answers and compiled FlexAttention functions are kept (both are per process)."""
    if encoding is None:
        _tables.clear()
        _block_masks.clear()
    else:
        _tables.pop(encoding, None)


def _as_4d(bias: torch.Tensor) -> torch.Tensor:
    return bias.unsqueeze(0) if bias.dim() == 3 else bias


def _plan_bias(encoding: PositionEncoding, plan: AttentionPlan) -> torch.Tensor | None:
    """The bias hook on the plan's positions, 4-D ``(1 or b, H, s, L_k)``, or None."""
    if plan.default_positions:  # 1-D positions: (H, s, L_k), as the chapters show it
        bias = encoding.bias(plan.q_pos[0], plan.k_pos[0])
    else:
        bias = encoding.bias(plan.q_pos, plan.k_pos)
    return None if bias is None else _as_4d(bias)


# --------------------------------------------------------------------------- naive
def naive(q, k, v, plan: AttentionPlan, encoding: PositionEncoding, *, dropout_p: float = 0.0,
          compile: bool = True, need_weights: bool = False):
    """Scores, softmax, weighted sum, in at least float32; ``(out, weights)`` if
    ``need_weights`` (the weights ``[b, H, s, L_k]`` after dropout)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    # at least float32 (half inputs are upcast); float64 stays float64 (gradcheck)
    dt = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(dt) @ k.to(dt).transpose(-2, -1)
    # the default divides by sqrt(head_dim), as before the scale existed (same rounding)
    scores = scores / math.sqrt(q.shape[-1]) if plan.scale is None else scores * plan.scale
    bias = _plan_bias(encoding, plan)
    if bias is not None:
        scores = scores + bias
    allowed = plan.allowed()
    if allowed is not None:
        # A finite fill (not -inf) keeps fully masked rows NaN-free; they are zeroed below.
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    weights = _zero_empty_rows(scores.softmax(dim=-1), plan.has_key())
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    out = (weights @ v.to(dt)).to(q.dtype)
    return (out, weights) if need_weights else out


# --------------------------------------------------------------------------- sdpa
def sdpa(q, k, v, plan: AttentionPlan, encoding: PositionEncoding, *, dropout_p: float = 0.0,
         compile: bool = True):
    """``scaled_dot_product_attention`` with the plan as a 4-D mask (or ``is_causal``).

    The mask is boolean or of q's dtype (:func:`~tutorial_pkg.attention.masks.additive_mask`), the
    forms PyTorch documents; a bias is built in float32 at least and rounded to 16 bits
    only after a shift per row."""
    kw = _kernel_kwargs(q, k, plan)
    work = torch.promote_types(q.dtype, torch.float32)  # the bias is built in float32 at least
    if plan.default_positions and encoding.static_bias and encoding.has_bias:
        bias = cached_bias(encoding, plan.start, plan.s, plan.k_len, causal=plan.causal,
                           device=q.device, dtype=work)
        causal_applied = bias is not None
    else:
        bias, causal_applied = _plan_bias(encoding, plan), False
    if bias is None and plan.key_padding_mask is None and not plan.has_documents:
        if plan.windowed:
            mask, is_causal = plan.allowed(), False
        elif not plan.causal or plan.s == 1:
            mask, is_causal = None, False  # one new token sees every cached key
        elif plan.whole_sequence:
            mask, is_causal = None, True  # the fused causal kernel: nothing L x L built
        else:
            mask, is_causal = plan.allowed(), False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                              is_causal=is_causal, **kw)
    mask = additive_mask(plan, bias, q.dtype, causal_applied=causal_applied)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                         is_causal=False, **kw)
    return _zero_empty_rows(out, plan.has_key())


# --------------------------------------------------------------------------- auto
def key_bias_supported(device: torch.device, dtype: torch.dtype, gqa: bool) -> bool:
    """Does SDPA add a float key row *and* apply ``is_causal`` here, exactly? (cached).

    ``"auto"`` relies on it, although PyTorch's documentation calls ``attn_mask`` with
    ``is_causal=True`` an error. :func:`probe_key_bias` answers, once per (device type,
    dtype, GQA); where nothing can run (meta, ``FakeTensorMode``, tracing) the answer is
    False and is not kept. A :class:`KernelRules` ``key_bias`` answers instead.
    """
    device = torch.device(device)
    assumed = kernel_rules(device.type).key_bias
    if assumed is not None:
        return assumed
    key = (device.type, dtype, gqa)
    if key in _key_bias_ok:
        return _key_bias_ok[key]
    if torch.compiler.is_compiling():
        return False  # never probe while tracing; the next eager call will
    ok = probe_key_bias(device, dtype, gqa)
    if ok is None:
        return False
    _key_bias_ok[key] = ok
    return ok


#: The fused SDPA kernels the key-row path may land on; each must be exact where it runs.
_FUSED = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
          SDPBackend.CUDNN_ATTENTION)


def probe_key_bias(device, dtype: torch.dtype, gqa: bool) -> bool | None:
    """The check of :func:`key_bias_supported`, run now (nothing cached).

    A tiny problem whose keys sit at positions 4096+ (a row rounded to 16 bits fails
    there): ``scaled_dot_product_attention(q, k, v, attn_mask=row, is_causal=True)``, the
    row of q's dtype, forward and gradients, against a float64 reference; once with the
    kernel PyTorch selects and once restricted to each fused kernel (flash,
    memory-efficient, cuDNN) that takes the call on this device. True if every one that
    runs is right and the selected one runs. None where tensors hold no data (meta,
    ``FakeTensorMode``). Reads its errors back to the host (a synchronisation).
    """
    device = torch.device(device)
    if device.type == "meta" or fake_mode_active():
        return None
    heads, kv_heads, length, dim, offset = 2, 1 if gqa else 2, 16, 8, 4096
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, length, dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, length, dim, generator=gen) for _ in range(2))
    grad_out = torch.randn(1, heads, length, dim, generator=gen)
    slopes = torch.tensor([0.5, 1 / 16])
    row_dtype = dtype  # a float mask of q's dtype: the only one PyTorch documents
    row = (slopes[:, None, None] * torch.arange(offset, offset + length).double())[None]

    def run(tensors, mask, fused):
        q_, k_, v_ = (t.detach().requires_grad_(True) for t in tensors)
        if fused:
            kw = {"enable_gqa": True} if gqa else {}
            out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, is_causal=True, **kw)
        else:
            rep = heads // kv_heads
            kk, vv = k_.repeat_interleave(rep, 1), v_.repeat_interleave(rep, 1)
            scores = q_ @ kk.transpose(-2, -1) / math.sqrt(dim) + mask
            future = ~dense_mask(causal_mask, 0, length, length, device=q_.device)
            out = scores.masked_fill(future, float("-inf")).softmax(-1) @ vv
        grads = torch.autograd.grad(out, (q_, k_, v_), grad_out.to(out))
        return [out, *grads]

    # float32 rounds m j ~ 2048 to ~1e-4; a row rounded to 16 bits is off by ~1 or more.
    tol = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2

    def exact(got, want) -> bool:  # float() reads each error back: the synchronisation
        return all(float((g.detach().double() - w.detach()).abs().max())
                   <= tol * max(1.0, float(w.detach().abs().max()))
                   for g, w in zip(got, want, strict=True))

    inputs = [t.to(device, dtype) for t in (q, k, v)]
    with torch.enable_grad():
        want = run([t.double() for t in inputs], row.to(device), fused=False)
        try:  # the kernel PyTorch selects: it must take the pair ...
            if not exact(run(inputs, row.to(device, row_dtype), fused=True), want):
                return False
        except RuntimeError:  # e.g. "attn_mask should not be set when is_causal=True"
            return False
        for kernel in _FUSED:  # ... and so must every fused kernel it may select
            try:
                with sdpa_kernel([kernel]), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a refusing kernel warns why
                    got = run(inputs, row.to(device, row_dtype), fused=True)
            except (RuntimeError, ValueError):  # it does not take the call: never selected
                continue
            if not exact(got, want):
                return False
    return True


def auto_key_bias(q, k, plan: AttentionPlan, encoding: PositionEncoding, *, dropout_p: float):
    """The float key row ``(1 or b, H, 1, L_k)`` for the ``"auto"`` path, or None (use sdpa).

    Only for float32 and float64 q: the row is handed to the kernel in q's dtype, and in
    16 bits ``m j`` loses the differences between neighbouring keys (the row grows with
    ``j`` and, unlike a square table, cannot be shifted per query)."""
    if q.dtype not in (torch.float32, torch.float64):
        return None
    if dropout_p or plan.has_documents or plan.windowed or not _overrides(encoding, "key_bias"):
        return None
    # is_causal aligns the mask top-left (query i sees keys <= i): right for a whole
    # sequence, and a single new token sees every cached key anyway.
    if plan.causal and plan.s > 1 and not plan.whole_sequence:
        return None
    if plan.default_positions:
        row = cached_key_bias(encoding, plan.k_len, device=q.device)
    else:
        row = encoding.key_bias(plan.k_pos)
        row = None if row is None else _as_4d(row)
    if row is None or (row.requires_grad and torch.is_grad_enabled()):
        return None  # no key-only form, or a learnable bias (fused kernels give no mask grad)
    if not key_bias_supported(q.device, q.dtype, q.shape[1] != k.shape[1]):
        return None
    return row


def sdpa_key_bias(q, k, v, plan: AttentionPlan, row: torch.Tensor):
    """SDPA's fused kernel with ``is_causal`` and a float key row (see :func:`auto_key_bias`)."""
    is_causal = plan.causal and plan.s > 1
    mask = row.to(q.dtype)  # float32 or float64 (auto_key_bias): q's dtype, as documented
    if plan.key_padding_mask is not None:
        # padding depends on the key only, so the mask stays one row per head:
        # (b, H, 1, L_k); finite, so a query with no key left stays NaN-free
        pad = plan.key_padding_mask[:, None, None, :]
        mask = torch.where(pad, torch.tensor(torch.finfo(q.dtype).min, dtype=q.dtype,
                                             device=q.device), mask)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                         **_kernel_kwargs(q, k, plan))
    return _zero_empty_rows(out, plan.has_key())


def auto(q, k, v, plan: AttentionPlan, encoding: PositionEncoding, *, dropout_p: float = 0.0,
         compile: bool = True):
    """The key row with the fused causal kernel where :func:`auto_key_bias` gives one, else
    :func:`sdpa`."""
    row = auto_key_bias(q, k, plan, encoding, dropout_p=dropout_p)
    if row is None:
        return sdpa(q, k, v, plan, encoding, dropout_p=dropout_p)
    return sdpa_key_bias(q, k, v, plan, row)


# --------------------------------------------------------------------------- flex
def flex_available() -> tuple[bool, str]:
    """Whether FlexAttention can be imported here, and why not if it cannot."""
    if flex_attention is None:
        return False, f"torch.nn.attention.flex_attention is unavailable ({_FLEX_IMPORT_ERROR})"
    return True, ""


def flex_blocker(q, k, v, plan: AttentionPlan, encoding: PositionEncoding, *,
                 dropout_p: float) -> str:
    """Why FlexAttention cannot run this call here (``""`` if it can)."""
    ok, why = flex_available()
    if not ok:
        return why
    rules = kernel_rules(q.device.type)
    if not rules.flex:
        return f"FlexAttention does not run on {q.device.type} tensors"
    if plan.s == 1:
        return "single-token decoding step (the cached bias row is cheaper)"
    if encoding.has_bias and not _overrides(encoding, "score_mod"):
        return f"{type(encoding).__name__} has a bias hook but no score_mod"
    if dropout_p:
        return "attention dropout is not supported by FlexAttention"
    if not rules.flex_backward:
        # torch refuses inputs that require grad there, whatever the grad mode
        learnable = torch.is_grad_enabled() and any(
            p.requires_grad for p in encoding.parameters()
        )
        if q.requires_grad or k.requires_grad or v.requires_grad or learnable:
            return (f"FlexAttention has no {q.device.type.upper()} backward in this torch "
                    f"(use torch.no_grad())")
    return ""


def flex_kernel(compiled: bool, dynamic: bool = False):
    """The FlexAttention function :func:`flex` calls: ``flex_attention`` itself, or
    compiled (once per process and ``dynamic``).

    ``dynamic=True`` serves the common call (a whole causal sequence, no padding): one
    compilation for every length. Other calls compile statically, once per shape (with
    dynamic shapes torch 2.13's CPU template fails to build some of them).
    """
    if not compiled:
        return flex_attention
    fn = _compiled_flex.get(dynamic)
    if fn is None:
        fn = _compiled_flex[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return fn


def _mark_block_mask_dynamic(block_mask) -> None:
    # The block counts and indices grow with L / 128; unmarked, the first compile
    # specialises on their sizes and the next block count recompiles once more.
    for t in block_mask.as_tuple():
        if isinstance(t, torch.Tensor):
            for dim in range(2, t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, dim)


def flex_block_mask(plan: AttentionPlan, *, batch: int = 1, device="cpu",
                    mark_dynamic: bool = False):
    """The plan's mask rules as a FlexAttention block mask (None: nothing is masked).

    Tiles that no rule allows are skipped, not computed. Masks of padding or documents
    (data) are built per call; the others are cached (:data:`MAX_BLOCK_MASKS`).
    ``mark_dynamic`` marks the mask's block axes dynamic for a dynamic-shape compile.
    """
    rule = plan.mask_rule(batch=batch)
    if rule is None:
        return None
    mask_mod = offset_queries(rule, plan.start)  # Flex counts queries from 0
    if plan.key_padding_mask is not None or plan.has_documents:  # data-dependent: per call
        return create_block_mask(mask_mod, batch, None, plan.s, plan.k_len, device=device)
    window = plan.window if plan.windowed else None
    key = (plan.s, plan.k_len, plan.start, plan.causal, window, torch.device(device),
           mark_dynamic)
    fake = fake_mode_active()  # fake masks are neither stored nor served
    block_mask = None if fake else _block_masks.get(key)
    if block_mask is None:
        block_mask = create_block_mask(mask_mod, None, None, plan.s, plan.k_len, device=device)
        if mark_dynamic:
            _mark_block_mask_dynamic(block_mask)
        if fake:
            return block_mask
        _block_masks[key] = block_mask
    _block_masks.move_to_end(key)
    while len(_block_masks) > MAX_BLOCK_MASKS:
        _block_masks.popitem(last=False)
    return block_mask


def flex(q, k, v, plan: AttentionPlan, encoding: PositionEncoding, *, dropout_p: float = 0.0,
         compile: bool = True):
    """FlexAttention: the encoding's ``score_mod`` and the plan's block mask.

    Falls back to :func:`sdpa`, with a ``RuntimeWarning`` saying why, where
    :func:`flex_blocker` names a reason (no FlexAttention, inputs that require grad on
    CPU, dropout, a single-token step, a bias without ``score_mod``). A ``score_mod``
    captures the encoding's tensors as they are, so every tensor of the encoding must
    live on q's device (``ValueError`` naming both devices otherwise). On CPU, calls
    shorter than :data:`FLEX_TILE` run eagerly (torch 2.13's compiled CPU kernel is
    wrong there on AVX2 CPUs); ``compile=False`` runs every call eagerly.
    """
    reason = flex_blocker(q, k, v, plan, encoding, dropout_p=dropout_p)
    if reason:
        warnings.warn(f"flex backend falls back to sdpa: {reason}", RuntimeWarning,
                      stacklevel=3)
        return sdpa(q, k, v, plan, encoding, dropout_p=dropout_p)
    batch = q.shape[0]
    if plan.default_positions:
        score_mod = encoding.score_mod(q_offset=plan.start)
    else:
        score_mod = encoding.score_mod(0, plan.q_pos.expand(batch, -1).contiguous(),
                                       plan.k_pos.expand(batch, -1).contiguous())
    if score_mod is not None:
        for name, t in (*encoding.named_buffers(), *encoding.named_parameters()):
            check_device(f"{type(encoding).__name__}'s tensor {name}", t, q.device,
                         fix="FlexAttention's score_mod captures it; move the encoding (or "
                             "the layer) to that device with .to(device)")
    # the dynamic compile only for the common call: default positions (a score_mod that
    # captures position tensors does not build with dynamic shapes on CPU), whole causal
    # sequence, no padding, no documents, no window (a mask_mod that captures the window
    # int would make it symbolic, which the CPU template cannot build)
    plain = (plan.default_positions and plan.causal and plan.start == 0
             and plan.key_padding_mask is None and not plan.has_documents
             and not plan.windowed)
    eager = not compile or (q.device.type == "cpu" and min(plan.s, plan.k_len) < FLEX_TILE)
    block_mask = flex_block_mask(plan, batch=batch, device=q.device,
                                 mark_dynamic=plain and not eager)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = flex_kernel(not eager, plain)(
            q, k, v, score_mod=score_mod, block_mask=block_mask, **_kernel_kwargs(q, k, plan)
        )
    return _zero_empty_rows(out, plan.has_key())


#: The attention backends by name, one signature (module docs); ``"auto"`` is the default.
BACKENDS = {"naive": naive, "sdpa": sdpa, "flex": flex, "auto": auto}
