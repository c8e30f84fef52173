"""The backends' caches (private to ``attention``): bias tables, key rows, block masks.

Bounded: per encoding (held weakly) at most :data:`MAX_CACHED_TABLES` bias tables and
rows, keyed by device, dtype and
:meth:`~tutorial_pkg.encodings.builtin.PositionEncoding.cache_key`; at most
:data:`MAX_BLOCK_MASKS` block masks. Under a ``FakeTensorMode`` nothing is cached or
served. :func:`clear_caches` empties them; :func:`cache_info` counts them. Tables are built
on the device asked for, from the encoding's constants.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from .._checks import fake_mode_active
from ..encodings.builtin import PositionEncoding, check_learned_device
from .masks import AttentionPlan, causal_mask, round_bias

__all__ = ["MAX_CACHED_TABLES", "MAX_BLOCK_MASKS", "cached_bias", "cached_key_bias",
           "cached_tensors", "cache_info", "clear_caches"]

#: Bias tables and key rows kept per encoding (least recently used dropped first).
MAX_CACHED_TABLES = 4
#: FlexAttention block masks kept (least recently used dropped first).
MAX_BLOCK_MASKS = 32

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
    :func:`~tutorial_pkg.attention.backends.sdpa_key_bias`, which ``"auto"`` calls for
    float32 and float64 q only: the row holds ``m_h j``, which grows with ``j``; rounded
    to bfloat16 it would lose the small differences between neighbouring keys. ``H``
    floats per position, not ``H L`` as for :func:`cached_bias`. A learnable bias is
    rebuilt on every call. ``None`` if the encoding has no key-only form. Built on
    ``device`` as :func:`cached_bias` is.
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
    ``block_masks``, ``key_bias_probes`` (``{(device type, dtype, gqa, head_dim): bool}``, the
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
