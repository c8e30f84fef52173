"""The attention plan, and one mask rule per concern. Chapter 4.

:class:`~tutorial_pkg.attention.layer.MultiHeadAttention` describes a call once, as an
:class:`AttentionPlan`; every backend of :mod:`tutorial_pkg.attention.backends` derives what it
needs from the plan's mask rules: ``"naive"`` and ``"sdpa"`` a dense boolean mask
(:meth:`AttentionPlan.allowed`), ``"flex"`` the same rules as its ``mask_mod``, every
backend the rows that keep a key (:meth:`AttentionPlan.has_key`; a query with none
returns zeros, never NaN).

A rule is a FlexAttention ``mask_mod``, ``rule(b, h, q_idx, kv_idx) -> bool``, where
``q_idx`` and ``kv_idx`` are **cache slots** (the query at slot ``start + i``); they
broadcast, so one rule gives the dense mask of index tensors and Flex's mask alike.
Rules compose with :func:`and_masks`, as in attention-gym:

* :func:`causal_mask`: key slot at most the query slot. Causality is by order in the
  sequence, as in Hugging Face models, not by position value.
* :func:`sliding_window`: ``|i - j| < w``; with causality ``i - w < j <= i``, that is
  ``w`` keys including the query itself (Hugging Face's ``sliding_window_overlay``:
  ``kv_idx > q_idx - sliding_window``).
* :func:`same_document`: query and key in one packed document.
* :func:`key_padding`: the key is not padding.
* :func:`same_chunk`: query and key in one chunk of ``c`` positions (Llama 4's chunked
  attention: positions ``0..c-1``, ``c..2c-1``, ...; on positions, not slots, so that a
  left-padded row's chunks start at its first token, as Hugging Face's
  ``chunked_overlay`` subtracts the left padding).

:func:`additive_mask` is the one place that turns the rules and an encoding's bias into the
float mask a kernel is handed, always of the query's dtype (the form PyTorch documents for
``scaled_dot_product_attention``: "a float mask of the same type as query"); a boolean mask
is :meth:`AttentionPlan.allowed`.

Windows and documents count cache slots, like causality, so a left-padded row or a packed
document sees the keys it sees alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "AttentionPlan",
    "and_masks",
    "causal_mask",
    "sliding_window",
    "same_document",
    "same_chunk",
    "key_padding",
    "dense_mask",
    "additive_mask",
    "round_bias",
]


# --------------------------------------------------------------------------- the rules
def causal_mask(b, h, q_idx, kv_idx):
    """A query sees its own slot and the slots before it."""
    # a plain function, not a closure: under dynamic shapes a captured int becomes
    # symbolic, which FlexAttention's CPU template cannot build
    return kv_idx <= q_idx


def sliding_window(window: int):
    """The rule ``|q_idx - kv_idx| < window`` (``window`` keys back, with causality)."""

    def window_mask(b, h, q_idx, kv_idx):
        return (kv_idx > q_idx - window) & (kv_idx < q_idx + window)

    return window_mask


def same_document(documents: torch.Tensor):
    """The rule "same document"; ``documents`` is ``[b, L_k]``, the id of every slot."""

    def document_mask(b, h, q_idx, kv_idx):
        return documents[b, q_idx] == documents[b, kv_idx]

    return document_mask


def same_chunk(positions: torch.Tensor, chunk: int):
    """The rule "same chunk of ``chunk`` positions"; ``positions`` is ``[b, L_k]``, the
    position of every slot (a query at slot ``i`` has the position of key slot ``i``)."""

    def chunk_mask(b, h, q_idx, kv_idx):
        return positions[b, q_idx] // chunk == positions[b, kv_idx] // chunk

    return chunk_mask


def key_padding(padding: torch.Tensor):
    """The rule "the key is not padding"; ``padding`` is bool ``[b, L_k]``, True = pad."""

    def padding_mask(b, h, q_idx, kv_idx):
        return ~padding[b, kv_idx]

    return padding_mask


def and_masks(*rules):
    """A rule that allows a pair where every one of ``rules`` does (one rule: itself)."""
    if len(rules) == 1:
        return rules[0]

    def all_of(b, h, q_idx, kv_idx):
        keep = rules[0](b, h, q_idx, kv_idx)
        for rule in rules[1:]:
            keep = keep & rule(b, h, q_idx, kv_idx)
        return keep

    return all_of


def offset_queries(rule, start: int):
    """``rule`` for a call whose query ``i`` sits at cache slot ``start + i`` (Flex's view)."""
    if start == 0:
        return rule

    def at_offset(b, h, q_idx, kv_idx):
        return rule(b, h, q_idx + start, kv_idx)

    return at_offset


def dense_mask(rule, start: int, s: int, k_len: int, *, batch: int = 1,
               device=None) -> torch.Tensor:
    """``rule`` on every (query, key) pair: bool ``[1 or batch, 1, s, k_len]``.

    Queries at slots ``start .. start+s-1``, keys at ``0 .. k_len-1``; the batch axis is
    ``batch`` only if a rule reads ``b``.
    """
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q_idx = torch.arange(start, start + s, device=device)[None, None, :, None]
    kv_idx = torch.arange(k_len, device=device)[None, None, None, :]
    return rule(b, h, q_idx, kv_idx)


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
        k_doc: ``[1 or b, L_k]`` document ids of the keys (the queries' are its last
            ``s`` columns), or None.
        window: sliding window ``w``: the query at slot ``i`` sees key slots
            ``i - w < j <= i`` (``|i - j| < w`` when not causal); None = no window.
        scale: the softmax scale ``c`` in ``softmax(c q k^T + bias)``; None = the
            default ``1 / sqrt(head_dim)``.
        softcap: logit soft-capping (Gemma 2): the scores ``c q k^T`` become
            ``softcap * tanh(c q k^T / softcap)`` before the bias and the mask; None = none.
        chunk: chunked attention (Llama 4): a query sees only keys whose position lies in
            its own chunk of ``chunk`` positions (:func:`same_chunk`); None = no chunks.
        sinks: float ``[H]``, one learned logit per query head that joins every row's
            softmax denominator and takes no value (gpt-oss's attention sinks): the weights
            are ``exp(x_j) / (sum_j exp(x_j) + exp(sink_h))``; None = none.
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
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    chunk: int | None = None

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
    def shapes_scores(self) -> bool:
        """Whether soft-capping or sinks change the scores or the softmax (SDPA cannot)."""
        return self.softcap is not None or self.sinks is not None

    @property
    def has_documents(self) -> bool:
        return self.q_doc is not None

    @property
    def reads_data(self) -> bool:
        """Whether a rule reads tensors (documents, chunks of positions), so that no cached
        mask serves the call."""
        return self.q_doc is not None or self.chunk is not None

    @property
    def windowed(self) -> bool:
        """The window hides some key of some query (a window this long hides none)."""
        if self.window is None:
            return False
        if self.causal:  # the longest look-back is the last query's: start + s - 1
            return self.start + self.s > self.window
        return max(self.start + self.s, self.k_len) > self.window

    def _batch(self) -> int:
        rows = [t.shape[0] for t in (self.key_padding_mask, self.k_doc,
                                      self.k_pos if self.chunk is not None else None)
                if t is not None]
        return max(rows, default=1)

    def mask_rule(self, *, padding: bool = True, batch: int | None = None):
        """The plan's rules composed (:func:`~tutorial_pkg.attention.masks.and_masks`), on cache
        slots; None if no rule.

        ``batch`` expands the document ids to that many rows (Flex indexes them by ``b``).
        """
        rules = []
        if self.causal:
            rules.append(causal_mask)
        if self.windowed:
            rules.append(sliding_window(self.window))
        if self.has_documents:
            docs = self.k_doc
            if batch is not None and docs.shape[0] != batch:
                docs = docs.expand(batch, -1).contiguous()
            rules.append(same_document(docs))
        if self.chunk is not None:
            pos = self.k_pos
            if batch is not None and pos.shape[0] != batch:
                pos = pos.expand(batch, -1).contiguous()
            rules.append(same_chunk(pos, self.chunk))
        if padding and self.key_padding_mask is not None:
            rules.append(key_padding(self.key_padding_mask))
        return and_masks(*rules) if rules else None

    def allowed(self, *, padding: bool = True) -> torch.Tensor | None:
        """Bool ``[1 or b, 1, s, L_k]`` of allowed (query, key) pairs; None if all are."""
        batch = self._batch()
        rule = self.mask_rule(padding=padding, batch=batch)
        if rule is None:
            return None
        return dense_mask(rule, self.start, self.s, self.k_len, batch=batch,
                          device=self.q_pos.device)

    def has_key(self) -> torch.Tensor | None:
        """Bool ``[b, 1, s, 1]``: whether each query has a key left; None if all have.

        ``allowed().any(-1)``. Only padding can take every key from a query (causally a
        query sees itself, its document and its window hold it), and where the rules
        leave each query an interval of slots (causal, window) the kept keys of that
        interval are counted from the padding alone, without the ``L x L`` mask.
        """
        if self.key_padding_mask is None:
            return None
        if self.reads_data or (self.windowed and not self.causal):
            return self.allowed().any(dim=-1, keepdim=True)
        keep = ~self.key_padding_mask  # [b, L_k]
        if not self.causal:
            return keep.any(dim=-1)[:, None, None, None]
        counts = F.pad(keep.long().cumsum(-1), (1, 0))  # counts[:, t] = kept keys < slot t
        last = torch.arange(self.start + 1, self.start + self.s + 1, device=keep.device)
        first = (last - self.window).clamp_min(0) if self.windowed else torch.zeros_like(last)
        seen = (counts[:, last] - counts[:, first]) > 0  # kept keys in the query's interval
        return seen[:, None, :, None]


# --------------------------------------------------------------------------- float masks
def round_bias(bias: torch.Tensor, dtype: torch.dtype,
               live: torch.Tensor | None = None) -> torch.Tensor:
    """``bias`` (float32 or float64) cast to ``dtype``; to 16 bits only after a shift per row.

    Softmax is shift invariant along a row, so subtracting each row's largest value
    changes nothing but the rounding: the keys that carry weight sit near 0, where 16-bit
    floats are fine (``m j`` itself, at ``j`` = 30000, is not: bfloat16 keeps 8 bits).
    ``live`` is the bias with the keys a query cannot see at ``-inf`` (default: ``bias``),
    so that padding never sets the shift.
    """
    if bias.dtype == dtype:
        return bias
    if dtype not in (torch.float32, torch.float64) and bias.dim():
        live = bias if live is None else live
        bias = bias - live.detach().amax(dim=-1, keepdim=True).clamp_min(-1e30)
    return bias.to(dtype)


def additive_mask(plan: AttentionPlan, bias: torch.Tensor | None, dtype: torch.dtype, *,
                  causal_applied: bool = False) -> torch.Tensor:
    """The plan's rules and ``bias`` as one additive mask of ``dtype``, 4-D.

    Args:
        plan: the call; its causal, window and document rules give ``-inf``, its padding
            ``finfo(dtype).min`` (finite, so that a query with no key left stays NaN-free;
            the backends zero it).
        bias: float ``[1 or b, H, s, L_k]`` (float32 at least), or None for none.
        dtype: the query's dtype, which the result always has: a kernel is never handed a
            float mask of another dtype (on some CPUs a float32 mask with float64 queries
            is silently misread).
        causal_applied: causality is taken care of: ``bias`` already holds ``-inf`` at the
            future keys (a cached table), or the kernel is called with ``is_causal``
            (a key row).

    Returns:
        ``[1 or b, 1 or H, s or 1, L_k]`` of ``dtype``: a bias of one row per head
        ``(.., 1, L_k)`` under no rule but padding stays one row.
    """
    device = plan.q_pos.device
    work = torch.promote_types(dtype, torch.float32)
    if bias is None:
        bias = torch.zeros((), dtype=work, device=device)
    elif bias.dtype != torch.float64:
        bias = bias.to(work)  # a float64 bias stays float64 until the last cast
    minus_inf = torch.tensor(float("-inf"), dtype=bias.dtype, device=device)
    if (plan.causal and not causal_applied) or plan.reads_data or plan.windowed:
        bias = torch.where(plan.allowed(padding=False), bias, minus_inf)
    pad = None if plan.key_padding_mask is None else plan.key_padding_mask[:, None, None, :]
    live = None  # the shift (16 bits) is over the keys a query may see: not padding
    if pad is not None and dtype not in (torch.float32, torch.float64):
        live = torch.where(pad, minus_inf, bias)
    mask = round_bias(bias, dtype, live)
    if pad is not None:
        mask = torch.where(pad, torch.tensor(torch.finfo(dtype).min, dtype=dtype,
                                             device=device), mask)
    if mask.dim() < 4:
        mask = mask.expand(1, 1, plan.s, plan.k_len)
    return mask
