"""Attention backends: one plan, four ways to compute it. Chapters 4 and 5.

:class:`~tutorial_pkg.attention.MultiHeadAttention` describes a call once, as an
:class:`AttentionPlan` (query and key positions, where the queries sit in the KV cache,
causal or not, key padding, document ids), and each backend turns the plan into its
own kernel call. They all agree with ``"naive"`` to tolerance, tested for every encoding.

* ``"naive"``: matmul, softmax, matmul, in float32 (float64 for float64 inputs).
  The textbook form and the test oracle; it materialises the ``(b, H, L_q, L_k)``
  scores.
* ``"sdpa"``: :func:`torch.nn.functional.scaled_dot_product_attention`. Without a
  bias and without a mask it uses ``is_causal=True`` (nothing ``L x L`` is built).
  With ALiBi/hybrid it passes a 4-D bias ``(1 or b, H, L_q, L_k)`` (a 3-D float mask
  makes CPU SDPA fall back silently to its slow math path, chapter 5). For the
  default positions the table is cached per encoding (:func:`cached_bias`).
  The bias stays float32 where the kernel takes a float32 mask with 16-bit q (CPU,
  checked); elsewhere each row is first shifted so that its largest allowed value is
  0 (softmax is shift invariant), so rounding to q's dtype keeps the keys that carry
  weight exact: the key-only form ``m j`` would lose ``m`` at large ``j`` otherwise.
* ``"flex"``: FlexAttention with the encoding's ``score_mod`` and a block mask
  (causal, padding and documents in its ``mask_mod``), so no bias is materialised.
  For a whole causal sequence without padding it is compiled with dynamic shapes:
  one compilation per ``score_mod`` serves every length; other calls compile once
  per shape. On CPU, calls shorter than one tile (128 queries or keys) run
  FlexAttention *eagerly*: torch 2.13's compiled CPU kernel is wrong there on AVX2
  CPUs (measured at 8 tokens: errors of 1.9-3.9 with dynamic shapes, NaN with
  static ones; right at 2-7, 9-100 and from 128 on; AVX-512 CPUs are right), and
  eagerly the scores of one tile are small. Falls back to ``"sdpa"``, with a
  warning saying why, where this torch cannot run it: FlexAttention missing,
  inputs that require grad on CPU (no CPU backward in torch 2.13; decided by
  ``requires_grad``, which is what torch checks, not by grad mode), dropout, or
  single-token decoding steps.
* ``"auto"``: the fastest exact path for the call at hand, without compiling
  anything. Encodings without a key row take ``"sdpa"``. ALiBi and the hybrid
  (causal or key-only form) add their :meth:`~tutorial_pkg.encodings.PositionEncoding.key_bias`
  row ``m_h j`` of shape ``(1 or b, H, 1, L_k)``, float32, to SDPA's fused causal
  kernel: softmax is shift invariant along a query's row and
  ``-m (i - j) = m j - m i``, so the weights are exactly those of the full causal
  bias while nothing ``L x L`` is built. PyTorch's documentation says passing both
  ``attn_mask`` and ``is_causal=True`` is an error (its math path refuses it); the
  fused kernels accept the pair, so the path is checked once per
  (device type, dtype, GQA) against a float64 reference, forward and backward,
  before it is used (:func:`key_row_supported`); where the check fails, and for the
  symmetric form, documents, chunked prefill with a KV cache, dropout or a learnable
  bias under autograd, ``"auto"`` uses ``"sdpa"``.

Causality is by order in the sequence (the query at cache slot ``t`` sees slots
``<= t``), as in Hugging Face models, not by position value; positions only feed the
encoding. A query whose keys are all masked returns zeros, never NaN.

**Sliding windows** (Mistral, Gemma's local layers) are a property of the plan,
``window = w``: causally, the query at cache slot ``i`` sees the key slots ``j`` with
``i - w < j <= i``, that is ``w`` keys including itself. This is Hugging Face's
convention (``sliding_window_overlay`` of ``transformers.masking_utils``:
``kv_idx > q_idx - sliding_window``). Without causality the query sees
``|i - j| < w``. Windows count cache slots, like causality, so a left-padded row or a
packed document sees the same keys as the row alone. Every backend applies it:
``"naive"`` and ``"sdpa"`` in their mask, ``"flex"`` in its block mask (blocks outside
the window are skipped, not computed), ``"auto"`` through ``"sdpa"`` (the fused causal
kernel has no window). The KV cache keeps every key (no rolling buffer): the window
saves compute on ``"flex"``, not cache memory.

**Scale.** Every backend computes ``softmax(c q k^T + bias)``, the bias (ALiBi's,
T5's) added after the scale as in Hugging Face's layers. ``c`` is the plan's ``scale``;
None means ``1 / sqrt(head_dim)`` (the original Transformer's), computed as before:
``"naive"`` divides by ``sqrt(head_dim)``, the kernels use their own default. A scale
(Gemma's ``query_pre_attn_scalar ** -0.5``, DeepSeek's ``mscale ** 2 / sqrt(d)``) is
``"naive"``'s factor and the ``scale=`` argument of SDPA (``"sdpa"`` and ``"auto"``'s
key-row path) and of FlexAttention, so a KV cache, which goes through the same
backends, uses it too. The key-row check of ``"auto"`` runs at the default scale: the
scale multiplies ``q k^T`` before the mask is added, in every kernel, so it does not
change what is checked (the row is added, in float32, with ``is_causal``).

Caches are bounded: per encoding (held weakly, so they go with it) at most
:data:`MAX_CACHED_TABLES` bias tables and rows, keyed by device, dtype and the
encoding's tensors (a ``.to()`` or an in-place change of the slopes makes a new
entry); at most :data:`MAX_BLOCK_MASKS` block masks. Under a ``FakeTensorMode``
(tensors without data, as in the device rehearsal) nothing is cached or served.

**Devices.** Everything a backend builds for a call is built on the device of ``q``:
bias tables, key rows and block masks, from the encoding's constants moved there
(:func:`cached_bias` and :func:`cached_key_row` take the device as an argument, so
an encoding left on the CPU still gets a GPU table built on the GPU). An encoding's
learned tensors are never copied: on another device they raise ``ValueError``
naming both devices, as do, for ``"flex"``, any of its tensors (a ``score_mod``
captures them as they are). Nothing is read back to the host on these paths, with one
documented exception: :func:`key_row_supported` runs its probe once per device
type, dtype and GQA setting.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._checks import check_device, fake_mode_active
from .encodings import PositionEncoding, check_learned_device

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
    "flex_available",
    "cached_bias",
    "cached_key_row",
    "cached_tensors",
    "clear_caches",
    "key_row_supported",
    "naive",
    "sdpa",
    "auto_key_row",
    "key_row",
    "flex_blocker",
    "flex",
]

#: Attention backends, see the module docs.
BACKENDS = ("naive", "sdpa", "flex", "auto")
#: Bias tables and key rows kept per encoding (least recently used dropped first).
MAX_CACHED_TABLES = 4
#: FlexAttention block masks kept (least recently used dropped first).
MAX_BLOCK_MASKS = 32
#: FlexAttention's tile (block) size; below it, CPU calls run eagerly (module docs).
FLEX_TILE = 128


# --------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class AttentionPlan:
    """Everything a backend needs to know about one attention call, but q, k and v.

    Attributes:
        q_pos: int64 ``[1 or b, s]`` positions of the queries.
        k_pos: int64 ``[1 or b, L_k]`` positions of the keys (cached ones first).
        start: cache slot of query 0 (the number of keys that came from the cache).
        default_positions: ``q_pos == start + arange(s)`` and ``k_pos == arange(L_k)``,
            known without looking: cached tables and Flex's ``q_offset`` apply.
        causal: query at slot ``start + i`` sees key slots ``<= start + i``.
        key_padding_mask: bool ``[b, L_k]``, ``True`` = padding, or None.
        q_doc: ``[1 or b, s]`` document ids of the queries, or None.
        k_doc: ``[1 or b, L_k]`` document ids of the keys, or None.
        window: sliding window ``w`` (module docs): the query at slot ``i`` sees key
            slots ``i - w < j <= i`` (``|i - j| < w`` when not causal); None = no window.
        scale: the softmax scale ``c`` in ``softmax(c q k^T + bias)``; None = the
            default ``1 / sqrt(head_dim)`` (module docs, "Scale").
    """

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    start: int
    default_positions: bool
    causal: bool
    key_padding_mask: torch.Tensor | None = None
    q_doc: torch.Tensor | None = None
    k_doc: torch.Tensor | None = None
    window: int | None = None
    scale: float | None = None

    @property
    def s(self) -> int:
        return self.q_pos.shape[-1]

    @property
    def k_len(self) -> int:
        return self.k_pos.shape[-1]

    @property
    def whole_sequence(self) -> bool:
        """Queries and keys are the same tokens (no cached keys before them)."""
        return self.start == 0 and self.s == self.k_len

    @property
    def has_documents(self) -> bool:
        return self.q_doc is not None

    @property
    def windowed(self) -> bool:
        """The window hides some key of some query (a window this long hides none)."""
        if self.window is None:
            return False
        if self.causal:  # the longest look-back is the last query's: start + s - 1
            return self.start + self.s > self.window
        return max(self.start + self.s, self.k_len) > self.window

    def allowed(self, *, padding: bool = True) -> torch.Tensor | None:
        """Bool ``[1 or b, 1, s, L_k]`` of allowed (query, key) pairs; None if all are."""
        device = self.q_pos.device
        allowed = None
        q_slot = torch.arange(self.start, self.start + self.s, device=device)[:, None]
        k_slot = torch.arange(self.k_len, device=device)[None, :]
        if self.causal:
            allowed = (k_slot <= q_slot)[None, None]
        if self.windowed:
            near = (k_slot > q_slot - self.window) & (k_slot < q_slot + self.window)
            allowed = near[None, None] if allowed is None else allowed & near
        if self.q_doc is not None:
            same = (self.q_doc[:, :, None] == self.k_doc[:, None, :])[:, None]
            allowed = same if allowed is None else allowed & same
        if padding and self.key_padding_mask is not None:
            keep = ~self.key_padding_mask[:, None, None, :]
            allowed = keep if allowed is None else allowed & keep
        return allowed

    def has_key(self) -> torch.Tensor | None:
        """Bool ``[b, 1, s, 1]``: whether each query has a key left; None if all have.

        Only padding can take every key from a query: causally a query sees itself,
        it is in its own document and in its own window.
        """
        if self.key_padding_mask is None:
            return None
        if self.has_documents or (self.windowed and not self.causal):
            return self.allowed().any(dim=-1, keepdim=True)
        keep = ~self.key_padding_mask  # [b, L_k]: from the padding alone, nothing L x L
        if not self.causal:
            return keep.any(dim=-1)[:, None, None, None]
        counts = F.pad(keep.long().cumsum(-1), (1, 0))  # counts[:, t] = kept keys < slot t
        last = torch.arange(self.start + 1, self.start + self.s + 1, device=keep.device)
        first = (last - self.window).clamp_min(0) if self.windowed else torch.zeros_like(last)
        seen = (counts[:, last] - counts[:, first]) > 0  # kept keys in the query's window
        return seen[:, None, :, None]


def _zero_empty_rows(out: torch.Tensor, has_key: torch.Tensor | None) -> torch.Tensor:
    # A query with no allowed key gets zeros (never NaN, never a uniform average).
    if has_key is None:
        return out
    return torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))


def _gqa_kwargs(q: torch.Tensor, k: torch.Tensor) -> dict:
    return {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}


def _kernel_kwargs(q: torch.Tensor, k: torch.Tensor, plan: AttentionPlan) -> dict:
    # GQA, and the plan's scale where it is not the kernels' default 1 / sqrt(head_dim)
    kw = _gqa_kwargs(q, k)
    if plan.scale is not None:
        kw["scale"] = plan.scale
    return kw


# --------------------------------------------------------------------------- caches
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_block_masks: OrderedDict = OrderedDict()


def _overrides(encoding: PositionEncoding, hook: str) -> bool:
    return getattr(type(encoding), hook) is not getattr(PositionEncoding, hook)


def _lookup(encoding: PositionEncoding, key: tuple, size: int, build):
    if fake_mode_active():  # tensors without data: neither stored nor served (module docs)
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

    The table is built on ``device``, from the encoding's constants (ALiBi's slopes)
    moved there, wherever the encoding lives; an encoding whose learned parameters
    live on another device raises ``ValueError`` naming both (move it first).
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
            future = k_pos[None, :] > q_pos[:, None]
            bias = bias.masked_fill(future, float("-inf"))
    return _to_mask_dtype(bias, dtype)


def _to_mask_dtype(
    bias: torch.Tensor, dtype: torch.dtype, live: torch.Tensor | None = None
) -> torch.Tensor:
    """Cast a float32 bias to ``dtype``; to 16 bits only after a shift per row.

    Softmax is shift invariant along a row, so subtracting each row's largest value
    changes nothing but the rounding: the keys that carry weight sit near 0, where
    16-bit floats are fine (``m j`` itself, at ``j`` = 30000, is not: bf16 keeps 8 bits).
    ``live`` is the bias with the keys a query cannot see at ``-inf`` (default: ``bias``),
    so that padding never sets the shift.
    """
    if bias.dtype == dtype:
        return bias
    if dtype not in (torch.float32, torch.float64) and bias.dim():
        live = bias if live is None else live
        bias = bias - live.detach().amax(dim=-1, keepdim=True).clamp_min(-1e30)
    return bias.to(dtype)


def cached_key_row(encoding: PositionEncoding, k_len: int, *, device) -> torch.Tensor | None:
    """The encoding's ``key_bias`` for keys ``0..k_len-1`` as ``(1, H, 1, k_len)``, cached.

    Float32 whatever the dtype of q and k (float64 for float64 slopes): the row holds
    ``m_h j``, which grows with ``j``; rounded to bfloat16 it would lose the small
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


def clear_caches(encoding: PositionEncoding | None = None) -> None:
    """Drop the cached tables of one encoding, or every cache of this module."""
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
def naive(q, k, v, plan: AttentionPlan, encoding: PositionEncoding, *, dropout_p: float = 0.0):
    """Scores, softmax, weighted sum, in at least float32. Returns ``(out, weights)``."""
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
    return (weights @ v.to(dt)).to(q.dtype), weights


# --------------------------------------------------------------------------- sdpa
#: Device types whose SDPA takes a float32 mask with 16-bit q, and uses it in float32.
_FLOAT32_MASK_DEVICES = {"cpu"}


def _mask_dtype(q: torch.Tensor) -> torch.dtype:
    if q.dtype in (torch.float32, torch.float64) or q.device.type not in _FLOAT32_MASK_DEVICES:
        return q.dtype
    return torch.float32


def sdpa(q, k, v, plan: AttentionPlan, encoding: PositionEncoding, *, dropout_p: float = 0.0):
    """``scaled_dot_product_attention`` with the plan as a 4-D mask (or ``is_causal``)."""
    kw = _kernel_kwargs(q, k, plan)
    # -inf: a query always keeps one key (itself: causal, its document, its window)
    hard = plan.causal or plan.has_documents or plan.windowed
    dtype = _mask_dtype(q)
    work = torch.promote_types(dtype, torch.float32)  # the bias is built in float32 at least
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
    if bias is None:
        bias = torch.zeros((), dtype=work, device=q.device)
    minus_inf = torch.tensor(float("-inf"), dtype=work, device=q.device)
    if hard and not (causal_applied and not plan.has_documents and not plan.windowed):
        bias = torch.where(plan.allowed(padding=False), bias, minus_inf)
    if dtype != work:  # a 16-bit mask (the kernel wants q's dtype): shift, then round
        live = None  # the shift is over the keys a query may see: not padding, not past L_k
        if plan.key_padding_mask is not None:
            live = torch.where(plan.key_padding_mask[:, None, None, :], minus_inf, bias)
        bias = _to_mask_dtype(bias, dtype, live)
    if plan.key_padding_mask is not None:
        # finite (not -inf) for padding, so a row with no key left stays NaN-free
        pad = torch.zeros(plan.key_padding_mask.shape, dtype=dtype, device=q.device)
        pad = pad.masked_fill(plan.key_padding_mask, torch.finfo(dtype).min)
        bias = bias + pad[:, None, None, :]
    if bias.dim() < 4:
        bias = bias.expand(1, 1, plan.s, plan.k_len)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p,
                                         is_causal=False, **kw)
    return _zero_empty_rows(out, plan.has_key())


# --------------------------------------------------------------------------- auto
_key_row_ok: dict = {}


def key_row_supported(device: torch.device, dtype: torch.dtype, gqa: bool) -> bool:
    """Does SDPA add a float key row *and* apply ``is_causal`` here, exactly? (cached).

    The ``"auto"`` path relies on it, although PyTorch's documentation calls
    ``attn_mask`` with ``is_causal=True`` an error (its math path refuses it; the
    fused kernels accept it). A kernel could also round the float32 row to the
    dtype of q, which would destroy ``m j`` at large ``j``. So it is checked once
    per (device type, dtype, GQA) on a tiny problem whose keys sit at positions
    4096+ (a row rounded to bfloat16 fails there): forward and gradients against a
    float64 reference.

    The probe reads its errors back to the host: a synchronisation, once per key.
    Where nothing can run (meta tensors, a ``FakeTensorMode``) nothing is proven: the
    answer is False and is not cached, so a real device of that type probes later.
    """
    key = (torch.device(device).type, dtype, gqa)
    if key in _key_row_ok:
        return _key_row_ok[key]
    if torch.compiler.is_compiling():
        return False  # never probe while tracing; the next eager call will
    ok = _probe_key_row(torch.device(device), dtype, gqa)
    if ok is None:
        return False
    _key_row_ok[key] = ok
    return ok


def _probe_key_row(device, dtype, gqa) -> bool | None:
    """The check of :func:`key_row_supported`; None where tensors hold no data."""
    if device.type == "meta" or fake_mode_active():
        return None
    heads, kv_heads, length, dim, offset = 2, 1 if gqa else 2, 16, 8, 4096
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, length, dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, length, dim, generator=gen) for _ in range(2))
    grad_out = torch.randn(1, heads, length, dim, generator=gen)
    slopes = torch.tensor([0.5, 1 / 16])
    row_dtype = torch.float64 if dtype == torch.float64 else torch.float32
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
            future = torch.ones(length, length, dtype=torch.bool, device=q_.device).triu(1)
            out = scores.masked_fill(future, float("-inf")).softmax(-1) @ vv
        grads = torch.autograd.grad(out, (q_, k_, v_), grad_out.to(out))
        return [out, *grads]

    try:
        with torch.enable_grad():
            got = run([t.to(device, dtype) for t in (q, k, v)],
                      row.to(device, row_dtype), fused=True)
            want = run([t.to(device, dtype).double() for t in (q, k, v)],
                       row.to(device), fused=False)
    except RuntimeError:  # e.g. "attn_mask should not be set when is_causal=True"
        return False
    # float32 rounds m j ~ 2048 to ~1e-4; a row rounded to 16 bits is off by ~1 or more.
    # float() reads each error back: the probe's one synchronisation (once per key)
    tol = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
    return all(
        float((g.detach().double() - w.detach()).abs().max())
        <= tol * max(1.0, float(w.detach().abs().max()))
        for g, w in zip(got, want, strict=True)
    )


def auto_key_row(q, k, plan: AttentionPlan, encoding: PositionEncoding, *, dropout_p: float):
    """The float key row ``(1 or b, H, 1, L_k)`` for the ``"auto"`` path, or None (use sdpa)."""
    if dropout_p or plan.has_documents or plan.windowed or not _overrides(encoding, "key_bias"):
        return None
    # is_causal aligns the mask top-left (query i sees keys <= i): right for a whole
    # sequence, and a single new token sees every cached key anyway.
    if plan.causal and plan.s > 1 and not plan.whole_sequence:
        return None
    if plan.default_positions:
        row = cached_key_row(encoding, plan.k_len, device=q.device)
    else:
        row = encoding.key_bias(plan.k_pos)
        row = None if row is None else _as_4d(row)
    if row is None or (row.requires_grad and torch.is_grad_enabled()):
        return None  # no key-only form, or a learnable bias (fused kernels give no mask grad)
    if not key_row_supported(q.device, q.dtype, q.shape[1] != k.shape[1]):
        return None
    return row


def key_row(q, k, v, plan: AttentionPlan, row: torch.Tensor):
    """SDPA's fused kernel with ``is_causal`` and a float key row (see :func:`auto_key_row`)."""
    is_causal = plan.causal and plan.s > 1
    mask = row.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    if plan.key_padding_mask is not None:
        # padding depends on the key only, so the mask stays one row per head:
        # (b, H, 1, L_k); finite, so a query with no key left stays NaN-free
        pad = plan.key_padding_mask
        pad_bias = torch.zeros(pad.shape, dtype=mask.dtype, device=q.device)
        mask = mask + pad_bias.masked_fill(pad, torch.finfo(mask.dtype).min)[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                         **_kernel_kwargs(q, k, plan))
    return _zero_empty_rows(out, plan.has_key())


# --------------------------------------------------------------------------- flex
_compiled_flex: dict = {}  # dynamic (bool) -> compiled flex_attention


def flex_available() -> tuple[bool, str]:
    """Whether FlexAttention can be imported here, and why not if it cannot."""
    if flex_attention is None:
        return False, f"torch.nn.attention.flex_attention is unavailable ({_FLEX_IMPORT_ERROR})"
    return True, ""


#: Device types FlexAttention runs on (torch 2.13's ``_validate_device``), and those of
#: them without a backward.
_FLEX_DEVICES = {"cuda", "cpu", "xpu", "hpu", "mps"}
_FLEX_NO_BACKWARD = {"cpu", "mps"}


def flex_blocker(q, k, v, plan: AttentionPlan, encoding: PositionEncoding, *,
                 dropout_p: float) -> str:
    """Why FlexAttention cannot run this call here (``""`` if it can)."""
    ok, why = flex_available()
    if not ok:
        return why
    if q.device.type not in _FLEX_DEVICES:
        return f"FlexAttention does not run on {q.device.type} tensors"
    if plan.s == 1:
        return "single-token decoding step (the cached bias row is cheaper)"
    if encoding.has_bias and not _overrides(encoding, "score_mod"):
        return f"{type(encoding).__name__} has a bias hook but no score_mod"
    if dropout_p:
        return "attention dropout is not supported by FlexAttention"
    if q.device.type in _FLEX_NO_BACKWARD:
        # torch refuses inputs that require grad there, whatever the grad mode
        learnable = torch.is_grad_enabled() and any(
            p.requires_grad for p in encoding.parameters()
        )
        if q.requires_grad or k.requires_grad or v.requires_grad or learnable:
            return (f"FlexAttention has no {q.device.type.upper()} backward in this torch "
                    f"(use torch.no_grad())")
    return ""


def _flex_fn(compiled: bool, dynamic: bool = False):
    """``flex_attention``, eager or compiled (once per process and ``dynamic``).

    ``dynamic=True`` serves the common call (a whole causal sequence, no padding):
    with static shapes every new length recompiles (~10 s each on a 2-core CPU)
    and after 8 lengths dynamo gives up and runs FlexAttention eagerly,
    materialising the scores. Other calls compile statically, once per shape: in
    torch 2.13 inductor's CPU FlexAttention template fails to build some of them
    with dynamic shapes (undeclared ``cur_qSplitSize`` in the generated C++).
    """
    if not compiled:
        return flex_attention
    fn = _compiled_flex.get(dynamic)
    if fn is None:
        fn = _compiled_flex[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return fn


def _causal_mask_mod(b, h, q_idx, kv_idx):
    # A plain function, not a closure over `start`: under dynamic shapes an int
    # captured by a mask_mod becomes symbolic, which the CPU template cannot build.
    return kv_idx <= q_idx


def _offset_causal_mask_mod(start: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + start

    return mask_mod


def _window_mask_mod(start: int, window: int, causal: bool):
    def mask_mod(b, h, q_idx, kv_idx):
        keep = (kv_idx > q_idx + start - window) & (kv_idx < q_idx + start + window)
        return keep & (kv_idx <= q_idx + start) if causal else keep

    return mask_mod


def _plan_mask_mod(plan: AttentionPlan, batch: int):
    start, causal = plan.start, plan.causal
    window = plan.window if plan.windowed else None
    pad = plan.key_padding_mask
    q_doc = k_doc = None
    if plan.has_documents:
        q_doc = plan.q_doc.expand(batch, -1).contiguous()
        k_doc = plan.k_doc.expand(batch, -1).contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx >= 0
        if causal:
            keep = keep & (kv_idx <= q_idx + start)
        if window is not None:
            keep = keep & (kv_idx > q_idx + start - window) & (kv_idx < q_idx + start + window)
        if pad is not None:
            keep = keep & ~pad[b, kv_idx]
        if q_doc is not None:
            keep = keep & (q_doc[b, q_idx] == k_doc[b, kv_idx])
        return keep

    return mask_mod


def _mark_block_mask_dynamic(block_mask) -> None:
    # The block counts and indices grow with L / 128; unmarked, the first compile
    # specialises on their sizes and the next block count recompiles once more.
    for t in block_mask.as_tuple():
        if isinstance(t, torch.Tensor):
            for dim in range(2, t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, dim)


def _block_mask(plan: AttentionPlan, batch: int, device, mark_dynamic: bool):
    if plan.key_padding_mask is not None or plan.has_documents:  # data-dependent: per call
        return create_block_mask(_plan_mask_mod(plan, batch), batch, None, plan.s, plan.k_len,
                                 device=device)
    window = plan.window if plan.windowed else None
    if not plan.causal and window is None:
        return None
    key = (plan.s, plan.k_len, plan.start, plan.causal, window, torch.device(device),
           mark_dynamic)
    fake = fake_mode_active()  # fake masks are neither stored nor served (module docs)
    block_mask = None if fake else _block_masks.get(key)
    if block_mask is None:
        if window is not None:  # captures ints: compiled with static shapes (see flex)
            mask_mod = _window_mask_mod(plan.start, window, plan.causal)
        elif plan.start == 0:
            mask_mod = _causal_mask_mod
        else:
            mask_mod = _offset_causal_mask_mod(plan.start)
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


def flex(q, k, v, plan: AttentionPlan, encoding: PositionEncoding, *, compile: bool = True):
    """FlexAttention: the encoding's ``score_mod`` and the plan's block mask.

    A ``score_mod`` captures the encoding's tensors as they are, so with one every
    tensor of the encoding must live on ``q``'s device (``ValueError`` naming both
    devices otherwise).
    """
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
    # below one tile the compiled CPU kernel is wrong on AVX2 (module docs): run eagerly
    eager = not compile or (q.device.type == "cpu" and min(plan.s, plan.k_len) < FLEX_TILE)
    block_mask = _block_mask(plan, batch, q.device, mark_dynamic=plain and not eager)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = _flex_fn(not eager, plain)(
            q, k, v, score_mod=score_mod, block_mask=block_mask, **_kernel_kwargs(q, k, plan)
        )
    return _zero_empty_rows(out, plan.has_key())
