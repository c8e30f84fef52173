"""Attention backends: one registry, one signature. Chapters 4 and 5.

:data:`BACKENDS` maps a name to a function with the signature of Hugging Face's
``ALL_ATTENTION_FUNCTIONS``::

    fn(q, k, v, plan, encoding, *, dropout_p=0.0, compile=True) -> out

``q`` ``[b, H, s, d]``; ``k``, ``v`` ``[b, H_kv, L_k, d]`` (grouped-query when ``H_kv < H``),
on one device; ``plan`` an :class:`~tutorial_pkg.attention.masks.AttentionPlan` (positions,
cache offset, masks, scale); ``encoding`` a
:class:`~tutorial_pkg.encodings.builtin.PositionEncoding`, whose bias hooks the backend
calls; ``out`` ``[b, H, s, d]`` in q's dtype. Every backend computes ``softmax(c q k^T +
bias)`` (the bias after the scale ``c``, as in Hugging Face's layers), takes its mask from
the plan's rules (:mod:`~tutorial_pkg.attention.masks`), returns zeros for a query with no
key (never NaN), handles its own fallback (with a ``RuntimeWarning`` saying why) and agrees
with ``"naive"`` to tolerance (tested for every encoding):

* ``"naive"``: matmul, softmax, matmul in at least float32: the textbook form, the test
  oracle, the only one that returns weights (the layer's ``return_weights``).
* ``"sdpa"``: :func:`torch.nn.functional.scaled_dot_product_attention`, ``is_causal=True``
  where there is neither bias nor mask, else a 4-D boolean or q-dtype float mask.
* ``"flex"``: FlexAttention with the encoding's ``score_mod`` and the plan's block mask;
  nothing ``L x L`` is built (:func:`flex`).
* ``"auto"``, the default: the plain dispatch without a bias; for causal ALiBi and the hybrid
  in float32/float64 the key row with ``is_causal`` where the CPU probe passed (a call
  PyTorch documents as an error: :func:`auto_key_bias`); else ``"sdpa"``.

Soft-capping and sinks are exact in ``"naive"`` and ``"flex"``; ``"sdpa"`` and ``"auto"``
compute ``"naive"`` for them. :func:`register_backend` adds your own under a name.

Private beside this module: the cached tables and block masks (``_caches``), what is assumed
of each device's kernels (``_kernel_rules``), the probe behind ``"auto"``'s key row
(``_probe``) and FlexAttention's parts (``_flex``). What a backend builds is built on q's
device from the encoding's constants; learned tensors are never copied (elsewhere than q:
``ValueError`` naming both devices).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from ..encodings.builtin import PositionEncoding
from ._caches import (  # noqa: F401 (re-exported for the chapters and tests)
    MAX_CACHED_TABLES,
    _as_4d,
    _overrides,
    _plan_bias,
    cache_info,
    cached_bias,
    cached_key_bias,
    cached_tensors,
    clear_caches,
)
from ._flex import (  # noqa: F401
    FLEX_TILE,
    flex_available,
    flex_block_mask,
    flex_blocker,
    flex_compiles_on_cpu,
    flex_kernel,
    flex_score_mod,
    without_sinks,
)
from ._kernel_rules import KERNEL_RULES, assume_kernels, kernel_rules  # noqa: F401
from ._probe import key_bias_supported, probe_key_bias  # noqa: F401
from .masks import AttentionPlan, additive_mask

__all__ = ["BACKENDS", "register_backend", "naive", "sdpa", "flex", "auto"]


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
    # no scale given: divide by sqrt(head_dim), the textbook form
    scores = scores / math.sqrt(q.shape[-1]) if plan.scale is None else scores * plan.scale
    if plan.softcap is not None:  # Gemma 2: capped before the bias and the mask
        scores = plan.softcap * torch.tanh(scores / plan.softcap)
    bias = _plan_bias(encoding, plan)
    if bias is not None:
        scores = scores + bias
    allowed = plan.allowed()
    if allowed is not None:
        # A finite fill (not -inf) keeps fully masked rows NaN-free; they are zeroed below.
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if plan.sinks is None:
        weights = scores.softmax(dim=-1)
    else:  # gpt-oss: a sink logit per head joins the denominator, then is dropped
        sink = plan.sinks.to(dt).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    weights = _zero_empty_rows(weights, plan.has_key())
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    out = (weights @ v.to(dt)).to(q.dtype)
    return (out, weights) if need_weights else out


def _plain(encoding: PositionEncoding, plan: AttentionPlan) -> bool:
    """No bias and no data-dependent mask: SDPA's own ``is_causal`` or a boolean rule."""
    return not encoding.has_bias and plan.key_padding_mask is None and not plan.reads_data


def _sdpa_plain(q, k, v, plan: AttentionPlan, *, dropout_p: float):
    # the plain dispatch: is_causal for a whole causal sequence (nothing L x L built)
    if plan.windowed:
        mask, is_causal = plan.allowed(), False
    elif not plan.causal or plan.s == 1:
        mask, is_causal = None, False  # one new token sees every cached key
    elif plan.whole_sequence:
        mask, is_causal = None, True  # the fused causal kernel: nothing L x L built
    else:
        mask, is_causal = plan.allowed(), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=is_causal, **_kernel_kwargs(q, k, plan))


# --------------------------------------------------------------------------- sdpa
_SHAPED = ("SDPA has no soft-capping (a change of the scores inside the kernel) nor sink "
           "logits (its log-sum-exp is not returned): the naive form computes them exactly")


def sdpa(q, k, v, plan: AttentionPlan, encoding: PositionEncoding, *, dropout_p: float = 0.0,
         compile: bool = True):
    """``scaled_dot_product_attention`` with the plan as a 4-D mask (or ``is_causal``).

    The mask is boolean or of q's dtype (:func:`~tutorial_pkg.attention.masks.additive_mask`), the
    forms PyTorch documents; a bias is built in float32 at least and rounded to 16 bits
    only after a shift per row."""
    if plan.shapes_scores:
        warnings.warn(f"sdpa backend falls back to naive: {_SHAPED}", RuntimeWarning,
                      stacklevel=3)
        return naive(q, k, v, plan, encoding, dropout_p=dropout_p)
    kw = _kernel_kwargs(q, k, plan)
    if _plain(encoding, plan):
        return _sdpa_plain(q, k, v, plan, dropout_p=dropout_p)
    work = torch.promote_types(q.dtype, torch.float32)  # the bias is built in float32 at least
    if plan.default_positions and encoding.static_bias and encoding.has_bias:
        bias = cached_bias(encoding, plan.start, plan.s, plan.k_len, causal=plan.causal,
                           device=q.device, dtype=work)
        causal_applied = bias is not None
    else:
        bias, causal_applied = _plan_bias(encoding, plan), False
    if bias is None and plan.key_padding_mask is None and not plan.reads_data:
        return _sdpa_plain(q, k, v, plan, dropout_p=dropout_p)  # a bias hook that gave none
    mask = additive_mask(plan, bias, q.dtype, causal_applied=causal_applied)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                         is_causal=False, **kw)
    return _zero_empty_rows(out, plan.has_key())


# --------------------------------------------------------------------------- auto
def auto_key_bias(q, k, plan: AttentionPlan, encoding: PositionEncoding, *, dropout_p: float):
    """The float key row ``(1 or b, H, 1, L_k)`` for the ``"auto"`` path, or None (use sdpa).

    With the key-only form of the bias
    (:meth:`~tutorial_pkg.encodings.builtin.PositionEncoding.key_bias`: causal ALiBi, the
    hybrid), several queries take an **undocumented** call,
    ``scaled_dot_product_attention(q, k, v, attn_mask=row, is_causal=True)`` (PyTorch: "An
    error is thrown if both attn_mask and is_causal are set"; torch 2.13's CPU kernel computes
    the causal softmax with the row added). It is taken only on the CPU, where
    :func:`~tutorial_pkg.attention._probe.key_bias_supported` has run it at this dtype and
    head width (the selected kernel and each fused kernel alone, forward and backward,
    against float64); on every other device no run is recorded and the 4-D mask of
    ``"sdpa"`` is used (same numbers, an ``(H, L, L)`` table).

    Only for float32 and float64 q: the row is handed to the kernel in q's dtype, and in
    16 bits ``m j`` loses the differences between neighbouring keys (the row grows with
    ``j`` and, unlike a square table, cannot be shifted per query). One query (a decoding
    step) gets the row relative to its last key, a documented call on any device. Several
    queries get ``m_h j`` itself where the probe passed: in float32 its entries near query
    ``i`` are rounded to about ``m_h i 2^-24`` (about 1e-3 at ``m_h i = 16384``), so at long
    lengths ``"flex"`` keeps more of float32's precision."""
    if q.dtype not in (torch.float32, torch.float64):
        return None
    if dropout_p or plan.reads_data or plan.windowed or not _overrides(encoding, "key_bias"):
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
    if plan.s == 1:
        # One query: the row alone, without is_causal (the documented float-mask call, on
        # every device), taken relative to the last key (a constant per head: the same
        # softmax), so the entries near the query stay small and keep float32's precision
        # at any length (m_h j itself reaches m_h L_k).
        return row - row[..., -1:]
    if not key_bias_supported(q.device, q.dtype, q.shape[1] != k.shape[1], q.shape[-1]):
        return None
    return row


def sdpa_key_bias(q, k, v, plan: AttentionPlan, row: torch.Tensor):
    """SDPA's fused kernel with ``is_causal`` and a float key row (see :func:`auto_key_bias`)."""
    is_causal = plan.causal and plan.s > 1
    # the kernel applies causality; padding depends on the key only, so the mask stays
    # one row per head, (1 or b, H, 1, L_k), in q's dtype (float32 or float64 here)
    mask = additive_mask(plan, row, q.dtype, causal_applied=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                         **_kernel_kwargs(q, k, plan))
    return _zero_empty_rows(out, plan.has_key())


def auto(q, k, v, plan: AttentionPlan, encoding: PositionEncoding, *, dropout_p: float = 0.0,
         compile: bool = True):
    """The plain dispatch where there is no bias; the key row with the fused causal kernel
    where :func:`auto_key_bias` gives one; else :func:`sdpa`. Soft-capping or sinks:
    :func:`naive`, the exact form without compiling."""
    if plan.shapes_scores:
        return naive(q, k, v, plan, encoding, dropout_p=dropout_p)
    if _plain(encoding, plan):
        return _sdpa_plain(q, k, v, plan, dropout_p=dropout_p)
    row = auto_key_bias(q, k, plan, encoding, dropout_p=dropout_p)
    if row is None:
        return sdpa(q, k, v, plan, encoding, dropout_p=dropout_p)
    return sdpa_key_bias(q, k, v, plan, row)


# --------------------------------------------------------------------------- flex
def flex(q, k, v, plan: AttentionPlan, encoding: PositionEncoding, *, dropout_p: float = 0.0,
         compile: bool = True):
    """FlexAttention: the encoding's ``score_mod`` and the plan's block mask.

    Falls back to :func:`sdpa`, with a ``RuntimeWarning`` saying why, where
    :func:`~tutorial_pkg.attention._flex.flex_blocker` names a reason (no FlexAttention,
    inputs that require grad on CPU, dropout, a single-token step, a bias without
    ``score_mod``, sinks or soft-capping in a compiled CPU call); to :func:`naive` instead
    where the call has sinks or soft-capping, which SDPA cannot compute. Every tensor of the
    encoding must live on q's device (:func:`~tutorial_pkg.attention._flex.flex_score_mod`).
    On CPU, calls shorter than :data:`~tutorial_pkg.attention._flex.FLEX_TILE` run eagerly
    (torch 2.13: the compiled CPU kernel is wrong there on AVX2 CPUs), and so does every call
    on a CPU where the compiled kernel cannot be built
    (:func:`~tutorial_pkg.attention._flex.flex_compiles_on_cpu`), with a ``RuntimeWarning``;
    ``compile=False`` runs every call eagerly.
    """
    eager = not compile or (q.device.type == "cpu" and min(plan.s, plan.k_len) < FLEX_TILE)
    if not eager and q.device.type == "cpu" and not flex_compiles_on_cpu():
        warnings.warn("flex backend runs eagerly: torch's compiled FlexAttention kernel does "
                      "not build on this CPU (it needs AVX2; not under "
                      "ATEN_CPU_CAPABILITY=default)", RuntimeWarning, stacklevel=3)
        eager = True
    reason = flex_blocker(q, k, v, plan, encoding, dropout_p=dropout_p, compiled=not eager)
    if reason:
        if plan.shapes_scores:  # sdpa cannot cap or sink: the exact fallback is naive
            warnings.warn(f"flex backend falls back to naive: {reason}", RuntimeWarning,
                          stacklevel=3)
            return naive(q, k, v, plan, encoding, dropout_p=dropout_p)
        warnings.warn(f"flex backend falls back to sdpa: {reason}", RuntimeWarning,
                      stacklevel=3)
        return sdpa(q, k, v, plan, encoding, dropout_p=dropout_p)
    batch = q.shape[0]
    score_mod = flex_score_mod(plan, encoding, batch, q.device)
    # the dynamic compile only for the common call: default positions (a score_mod that
    # captures position tensors does not build with dynamic shapes on CPU), whole causal
    # sequence, no padding, no documents, no window (a mask_mod that captures the window
    # int would make it symbolic, which the CPU template cannot build)
    plain = (plan.default_positions and plan.causal and plan.start == 0
             and plan.key_padding_mask is None and not plan.reads_data
             and not plan.windowed)
    block_mask = flex_block_mask(plan, batch=batch, device=q.device,
                                 mark_dynamic=plain and not eager)
    sinks = plan.sinks is not None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = flex_kernel(not eager, plain)(
            q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=sinks,
            **_kernel_kwargs(q, k, plan)
        )
    if sinks:
        out = without_sinks(*out, plan.sinks)
    return _zero_empty_rows(out, plan.has_key())



#: The attention backends by name, one signature (module docs); ``"auto"`` is the default.
BACKENDS = {"naive": naive, "sdpa": sdpa, "flex": flex, "auto": auto}


def register_backend(name: str, fn, *, replace: bool = False):
    """Add ``fn`` to :data:`BACKENDS` under ``name`` (the signature of the module docs).

    Returns ``fn``. ``ValueError`` if ``name`` is taken and ``replace`` is False;
    ``TypeError`` if ``fn`` is not callable or ``name`` not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if name in BACKENDS and BACKENDS[name] is not fn and not replace:
        raise ValueError(f"backend {name!r} is registered; pass replace=True to replace it")
    BACKENDS[name] = fn
    return fn
