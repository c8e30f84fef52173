"""Probes you point at your own code to find position-encoding bugs. Chapter 9.

Each probe takes plain callables or tensors (your function, your model, your
weights), not only this package's classes, and returns a :class:`Report`: a
dataclass with ``ok`` (pass/fail), the measured quantities, a list of ``problems``
in words, and a readable ``str()`` that prints what a check claims, not rounding
noise (``tutorial_pkg/diagnose/reports.py``).

* :func:`probe_rope`: what a RoPE function does: half or interleaved pairs, its
  base, partial rotary, and whether scores depend only on ``m - n``; a function that
  returns the rotated features permuted (DeepSeek-V3's de-interleaved output) is
  judged by the rotation behind the permutation, which the report names.
* :func:`probe_rope_precision`: how far its output drifts from a float64
  reference with position, in the dtype you run (the bf16-angles bug).
* :func:`compare_rope`: your RoPE function against a reference (the model's own,
  or one built from its config): the rotated slice, layout, frequencies and
  attention factor that differ.
* :func:`check_kv_cache`: token-by-token decoding against one full forward pass,
  with and without left padding, through an adapter for your model's convention
  (:class:`TutorialAdapter`, :class:`HFAdapter`, or your own).
* :func:`probe_masking`: non-finite outputs (fully masked rows), future-token
  leaks and cross-document leaks in packed rows.
* :func:`probe_alibi`: ALiBi slopes against Press et al.'s and the rounding of a
  bias stored in low precision.
* :func:`check_weight_conversion`: after permuting q/k weights between layouts,
  the scores equal the original model's (grouped-query aware).
* :func:`record_sdpa_masks`: the masks your code hands to
  ``scaled_dot_product_attention``, each bool or of q's dtype
  (``tutorial_pkg/diagnose/kernel_masks.py``).

The RoPE probes live in ``tutorial_pkg/diagnose/rope_probes.py``, the KV-cache check and its
adapters in ``tutorial_pkg/diagnose/kv_cache_check.py``; this module holds the others and
gathers all of them under one name, ``tutorial_pkg.diagnose``.

Tensors follow the package's layout: queries and keys ``[b, H, s, d]``
(``axes="bshd"`` for ``[b, s, H, d]``), model inputs ``[b, s]`` token ids or
``[b, s, d]`` features, outputs ``[b, s, ...]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .._checks import (
    check_bool,
    check_callable,
    check_choice,
    check_float_tensor,
    check_ids_or_features,
    check_int_in_range,
    check_positive_float,
    check_positive_int,
)
from ..encodings.alibi import alibi_slopes
from ..encodings.rope import LAYOUTS, apply_rope, half_to_interleaved, interleaved_to_half, inv_freq
from .kernel_masks import SdpaMaskReport, record_sdpa_masks
from .kv_cache_check import HFAdapter, KVCacheReport, TutorialAdapter, check_kv_cache
from .reports import Report, first_true, measured
from .rope_probes import (
    PrecisionReport,
    RopeComparisonReport,
    RopeReport,
    compare_rope,
    probe_rope,
    probe_rope_precision,
)

__all__ = [
    "Report", "RopeReport", "PrecisionReport", "KVCacheReport", "MaskingReport", "AlibiReport",
    "ConversionReport", "RopeComparisonReport", "TutorialAdapter", "HFAdapter",
    "probe_rope", "probe_rope_precision", "compare_rope", "check_kv_cache", "probe_masking",
    "probe_alibi",
    "check_weight_conversion", "SdpaMaskReport", "record_sdpa_masks",
]


# --------------------------------------------------------------------------- masking
@dataclass(repr=False)
class MaskingReport(Report):
    """What :func:`probe_masking` measured.

    Attributes:
        nonfinite: ``(row, position)`` of the first NaN/inf output, or ``None``.
        future_leak: first position whose output changes when a later token changes.
        document_leak: ``(row, position, document)``: first output that changes when
            another document of its row changes.
        alone_error: largest difference between a packed document's outputs and the
            same document run alone (``None`` without ``document_ids``).
        problems: what is wrong, in words.
        tol: the largest ``alone_error`` that passes.
    """

    nonfinite: tuple | None
    future_leak: int | None
    document_leak: tuple | None
    alone_error: float | None
    problems: list = field(default_factory=list)
    tol: float | None = None

    def _lines(self):
        lines = [f"non-finite outputs: {self.nonfinite or 'none'}",
                 f"future-token leak: {'none' if self.future_leak is None else self.future_leak}"]
        if self.alone_error is not None:
            same = self.tol is not None and self.alone_error <= self.tol
            lines += [f"cross-document leak: {self.document_leak or 'none'}",
                      "packed vs alone: max |diff| "
                      + (f"<= {self.tol:g}" if same else measured(self.alone_error))]
        return lines


def _perturb(x: torch.Tensor, where: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``x`` with the entries at ``where`` (bool ``[b, s]``) changed."""
    y = x.clone()
    if x.is_floating_point():
        y[where] = y[where] + torch.randn(y[where].shape, generator=gen, dtype=x.dtype)
        return y
    values = x.unique()
    if values.numel() < 2:
        raise ValueError("inputs must hold at least two different token ids (to change tokens)")
    idx = torch.searchsorted(values, x[where])
    y[where] = values[(idx + 1) % values.numel()]  # the next token id that occurs
    return y


def _nonfinite(out):
    bad = ~torch.isfinite(out.reshape(*out.shape[:2], -1)).all(-1)
    idx = bad.nonzero()
    return None if idx.numel() == 0 else tuple(int(v) for v in idx[0])


def probe_masking(
    fn: Callable[..., torch.Tensor],
    inputs: torch.Tensor,
    *,
    causal: bool = True,
    document_ids: torch.Tensor | None = None,
    pad_tokens: int = 0,
    n_cuts: int = 8,
    atol: float = 1e-5,
) -> MaskingReport:
    """Find fully masked rows (NaN), future-token leaks and cross-document leaks.

    ``fn(inputs, **kw)`` must return outputs ``[b, s, ...]``: a model, an attention
    layer, or your wrapper around one. The probe changes tokens and watches which
    outputs move: with ``causal``, changing tokens from ``t`` on must leave the
    outputs before ``t`` as they were (``n_cuts`` values of ``t``). With
    ``document_ids`` (``fn`` is then called with ``document_ids=``), changing one
    document must leave the others as they were, and each document must give the
    outputs it gives alone (called with ``document_ids`` of zeros): positions must
    restart. With ``pad_tokens``, row 0 gets that many left padding tokens in a call
    with ``key_padding_mask=`` (bool ``[b, s]``, ``True`` = padding): a query that
    sees only padding must not produce NaN.

    Args:
        fn: the callable to probe.
        inputs: ``[b, s]`` token ids or ``[b, s, d]`` features.
        causal: check future-token leaks.
        document_ids: integer ``[b, s]`` (or ``(s,)``) ids of packed documents
            (contiguous runs).
        pad_tokens: left padding tokens in row 0 (0: no padding call).
        n_cuts: positions ``t`` tried for the future-leak check.
        atol: change in an output that counts as a leak.

    Returns:
        A :class:`MaskingReport`.

    Raises:
        TypeError: ``fn`` not callable, ``inputs`` not ``[b, s]`` ids or ``[b, s, d]``
            features, ``document_ids`` not an integer tensor.
        ValueError: an argument out of range (naming it), outputs that are not
            ``[b, s, ...]``, token ids with a single value (nothing to change them to).
    """
    check_callable("fn", fn)
    check_ids_or_features("inputs", inputs)
    check_bool("causal", causal)
    b, s = inputs.shape[:2]
    if s < 2:
        raise ValueError(f"inputs must have at least 2 positions, got {s}")
    check_int_in_range("pad_tokens", pad_tokens, 0, s, high_name="s")
    check_positive_int("n_cuts", n_cuts)
    check_positive_float("atol", atol)
    docs = None
    if document_ids is not None:
        if not isinstance(document_ids, torch.Tensor) or document_ids.is_floating_point():
            raise TypeError("document_ids must be an integer tensor [b, s]")
        docs = document_ids.expand(b, s) if document_ids.dim() == 1 else document_ids
        if docs.shape != (b, s):
            raise ValueError(f"document_ids must have shape [b={b}, s={s}], got "
                             f"{tuple(document_ids.shape)}")
    kw = {} if docs is None else {"document_ids": docs}
    gen = torch.Generator().manual_seed(0)
    problems = []
    with torch.no_grad():
        out = fn(inputs, **kw)
        if not isinstance(out, torch.Tensor) or tuple(out.shape[:2]) != (b, s):
            raise ValueError(f"fn must return outputs [b={b}, s={s}, ...], got "
                             f"{getattr(out, 'shape', type(out).__name__)}")
        nonfinite = _nonfinite(out)
        if pad_tokens:
            mask = torch.zeros(b, s, dtype=torch.bool, device=inputs.device)
            mask[0, :pad_tokens] = True
            nonfinite = nonfinite or _nonfinite(fn(inputs, key_padding_mask=mask, **kw))
        if nonfinite:
            problems.append(f"non-finite output at row {nonfinite[0]}, position {nonfinite[1]}"
                            " (a query with every key masked?)")

        def moved(where):  # [b, s]: outputs that change when the tokens at `where` change
            other = fn(_perturb(inputs, where, gen), **kw)
            return (other - out).abs().reshape(b, s, -1).amax(-1).nan_to_num(math.inf) > atol

        future = _future_leak(moved, b, s, n_cuts, inputs.device) if causal else None
        if future is not None:
            problems.append(f"future-token leak: the output at position {future} changes "
                            "when a later token changes")
        doc_leak, alone = None, None
        if docs is not None:
            doc_leak = _document_leak(moved, docs, inputs.device)
            alone = _alone_error(fn, inputs, docs, out)
            if doc_leak is not None:
                problems.append(f"cross-document leak: row {doc_leak[0]}, position "
                                f"{doc_leak[1]} changes when document {doc_leak[2]} changes")
            if not alone <= max(atol, 1e-4):
                problems.append(f"a packed document's outputs differ from the document alone "
                                f"(max {measured(alone)})"
                                + ("" if doc_leak else ": positions do not restart?"))
    return MaskingReport(nonfinite, future, doc_leak, alone, problems,
                         None if alone is None else max(atol, 1e-4))


def _future_leak(moved, b: int, s: int, n_cuts: int, device) -> int | None:
    """First position whose output moves when every token from a cut ``t`` on changes
    (``n_cuts`` cuts spread over the sequence); ``None``: no leak."""
    future = None
    for t in sorted({max(1, round(s * (k + 1) / (n_cuts + 1))) for k in range(n_cuts)}):
        where = torch.zeros(b, s, dtype=torch.bool, device=device)
        where[:, t:] = True
        hit = first_true(moved(where)[:, :t].any(0))
        if hit is not None and (future is None or hit < future):
            future = hit
    return future


def _document_leak(moved, docs: torch.Tensor, device) -> tuple | None:
    """``(row, position, document)``: the first output outside a document that moves when
    that document's tokens change; ``None``: no leak."""
    b, s = docs.shape
    for i in range(b):
        for d in docs[i].unique().tolist():
            own = docs[i] == d
            where = torch.zeros(b, s, dtype=torch.bool, device=device)
            where[i] = own
            hit = moved(where)[i] & ~own
            if hit.any():
                return (i, first_true(hit), d)
    return None


def _alone_error(fn, inputs: torch.Tensor, docs: torch.Tensor, out: torch.Tensor) -> float:
    """Largest ``|output packed - output alone|`` over every document of every row."""
    alone = 0.0
    for i in range(docs.shape[0]):
        for d in docs[i].unique().tolist():
            own = docs[i] == d
            single = fn(inputs[i : i + 1, own], document_ids=torch.zeros_like(docs[i : i + 1, own]))
            alone = max(alone, float((single[0] - out[i, own]).abs().max()))
    return alone


# --------------------------------------------------------------------------- ALiBi
@dataclass(repr=False)
class AlibiReport(Report):
    """What :func:`probe_alibi` measured.

    Attributes:
        slopes: slope of each head, measured from the bias (or as given).
        reference: Press et al.'s slopes for the head count.
        wrong_heads: heads (1-based) whose slope differs by more than 1 % (a fit to a
            rounded bias is off by less).
        rounding_error: largest deviation of the bias from a straight line in the
            distance ``m - n`` (score units, nats), ``None`` for slopes alone.
        first_rounded_distance: first distance where it exceeds ``tol``.
        problems: what is wrong, in words.
        tol: the rounding allowed.
    """

    slopes: list
    reference: list
    wrong_heads: list
    rounding_error: float | None
    first_rounded_distance: int | None
    problems: list = field(default_factory=list)
    tol: float | None = None

    def _lines(self):
        lines = [f"{len(self.slopes)} heads; slopes differ from Press et al. in heads "
                 f"{self.wrong_heads or 'none'}"]
        if self.rounding_error is not None:
            if self.first_rounded_distance is not None:
                lines.append(f"bias rounding: max {measured(self.rounding_error)} nats, above tol "
                             f"from distance {self.first_rounded_distance}")
            elif self.tol is not None:
                lines.append(f"bias rounding: max <= {self.tol:g} nats")
            else:
                lines.append(f"bias rounding: max {measured(self.rounding_error)} nats")
        return lines


def probe_alibi(bias, n_heads: int, *, seq_len: int = 1024, tol: float = 0.05) -> AlibiReport:
    """Check ALiBi slopes against Press et al.'s ``get_slopes`` and the bias's rounding.

    Args:
        bias: the slopes ``(H,)``; or the bias your model adds to causal scores,
            ``[H, L, L]`` or ``[1, H, L, L]`` in its own dtype (or only its last query
            rows, ``[H, L_q, L]``); or a callable ``bias(L)`` returning it (called with
            ``seq_len``). Only the last row is read, that of the query at position
            ``L - 1``: ``bias[h, -1, n] - bias[h, -1, L-1]`` must equal
            ``-slope_h (L - 1 - n)`` (the key-only form passes too).
        n_heads: ``H``.
        seq_len: ``L`` for a callable.
        tol: rounding allowed, in score units.

    Returns:
        An :class:`AlibiReport`.

    Raises:
        TypeError: ``bias`` (or what the callable returns) is not a floating-point tensor.
        ValueError: ``bias`` of another shape, an argument out of range (naming it).
    """
    check_positive_int("n_heads", n_heads)
    check_positive_int("seq_len", seq_len)
    tol = check_positive_float("tol", tol)
    if callable(bias) and not isinstance(bias, torch.Tensor):
        bias = bias(seq_len)
    check_float_tensor("bias", bias)
    if bias.dim() == 4 and bias.shape[0] == 1:
        bias = bias[0]
    if bias.dim() not in (1, 3) or bias.shape[0] != n_heads or (
        bias.dim() == 3 and (bias.shape[1] < 1 or bias.shape[2] < 2)
    ):
        raise ValueError(f"bias must have shape (H,) or [H, L_q, L] with H=n_heads={n_heads}, "
                         f"got {tuple(bias.shape)}")
    ref = alibi_slopes(n_heads).double()
    rounding = first = None
    if bias.dim() == 1:
        slopes = bias.double()
    else:
        row = bias[:, -1].double()
        rel = row - row[:, -1:]  # -slope * distance
        dist = torch.arange(row.shape[1] - 1, -1, -1, dtype=torch.float64)
        slopes = -(rel * dist).sum(-1) / (dist * dist).sum()
        dev = (rel + slopes[:, None] * dist).abs().amax(0).flip(0)  # by distance
        rounding = float(dev.max())
        first = first_true(dev > tol)
    wrong = [h + 1 for h in range(n_heads) if abs(slopes[h] / ref[h] - 1) > 1e-2]
    problems = []
    ratio = slopes / ref
    if wrong and float(ratio.max() - ratio.min()) <= 1e-2 * float(ratio.abs().max()):
        k = float(ratio.mean())  # every head off by one factor: the bias scaled, not the slopes
        problems.append(f"slopes of heads {wrong} are {k:.3g} times Press et al.'s get_slopes, "
                        f"every head alike (the bias scaled by {k:.3g}, or added {k:.3g} times?)")
    elif wrong:
        problems.append(f"slopes of heads {wrong} differ from Press et al.'s get_slopes "
                        f"(a formula for powers of two only?)")
    if first is not None:
        problems.append(f"the bias is rounded by more than {tol:g} from distance {first} "
                        f"(stored in 16 bits?)")
    return AlibiReport(slopes.tolist(), ref.tolist(), wrong, rounding, first, problems, tol)


# --------------------------------------------------------------------------- weights
@dataclass(repr=False)
class ConversionReport(Report):
    """What :func:`check_weight_conversion` measured.

    Attributes:
        head_errors: per query head, the largest score difference relative to the
            largest score.
        bad_heads: heads (1-based) above ``tol``.
        hints: likely causes, found by trying the usual mistakes.
        problems: what is wrong, in words.
        tol: the relative score error allowed.
    """

    head_errors: list
    bad_heads: list
    hints: list
    problems: list = field(default_factory=list)
    tol: float | None = None

    def _lines(self):
        worst = max(self.head_errors)
        shown = (f"<= {self.tol:g}" if self.tol is not None and worst <= self.tol
                 else measured(worst))
        return [f"score error per head: max {shown}", *("hint: " + h for h in self.hints)]


def _weight(name, w, rows):
    """``w`` (``[rows, d_model]``, an ``nn.Linear`` weight) in float64, checked."""
    check_float_tensor(name, w, ndim=2)
    if w.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows (heads * head_dim), got {w.shape[0]}")
    return w.double()


def check_weight_conversion(
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    new_w_q: torch.Tensor,
    new_w_k: torch.Tensor,
    *,
    n_heads: int,
    n_kv_heads: int | None = None,
    source_layout: str = "interleaved",
    target_layout: str = "half",
    base: float = 10000.0,
    rotary_dim: int | None = None,
    seq_len: int = 32,
    tol: float = 1e-6,
) -> ConversionReport:
    """Do converted q/k weights give the original model's attention scores?

    Random inputs ``x`` are projected by both pairs of weights (``nn.Linear`` weights,
    ``[heads * head_dim, d_model]``), rotated by RoPE in each model's layout, and
    their scores compared per query head (head ``h`` reads key head
    ``h // (n_heads / n_kv_heads)``), in float64.

    Args:
        w_q, w_k: the original weights (layout ``source_layout``).
        new_w_q, new_w_k: the converted weights (layout ``target_layout``).
        n_heads, n_kv_heads: query and key heads (``n_kv_heads`` defaults to ``n_heads``).
        source_layout, target_layout: ``"half"`` or ``"interleaved"``.
        base, rotary_dim: the RoPE settings of both models.
        seq_len: positions compared.
        tol: allowed relative score error.

    Returns:
        A :class:`ConversionReport`.

    Raises:
        TypeError: a weight that is not a floating-point tensor.
        ValueError: a weight of the wrong shape, heads that do not divide, an argument
            out of range (each naming the argument).
    """
    check_positive_int("n_heads", n_heads)
    n_kv = n_heads if n_kv_heads is None else check_positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv:
        raise ValueError(f"n_kv_heads ({n_kv}) must divide n_heads ({n_heads})")
    check_choice("source_layout", source_layout, LAYOUTS)
    check_choice("target_layout", target_layout, LAYOUTS)
    check_positive_int("seq_len", seq_len)
    tol = check_positive_float("tol", tol)
    if check_float_tensor("w_q", w_q, ndim=2).shape[0] % n_heads:
        raise ValueError(f"w_q must be [n_heads * head_dim, d_model] with n_heads={n_heads}, "
                         f"got {tuple(w_q.shape)}")
    hd = w_q.shape[0] // n_heads
    wq, nq = _weight("w_q", w_q, n_heads * hd), _weight("new_w_q", new_w_q, n_heads * hd)
    wk, nk = _weight("w_k", w_k, n_kv * hd), _weight("new_w_k", new_w_k, n_kv * hd)
    for name, w in (("w_k", wk), ("new_w_q", nq), ("new_w_k", nk)):
        if w.shape[1] != wq.shape[1]:
            raise ValueError(f"{name} must have d_model={wq.shape[1]} columns, got {w.shape[1]}")
    r = hd if rotary_dim is None else rotary_dim
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64),
                         inv_freq(check_positive_int("rotary_dim", r), base).double())
    cos, sin = angles.cos(), angles.sin()
    x = torch.randn(seq_len, wq.shape[1], generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64)

    def scores(w_q_, w_k_, layout):
        q = apply_rope((x @ w_q_.T).view(seq_len, n_heads, hd).transpose(0, 1), cos, sin, layout)
        k = apply_rope((x @ w_k_.T).view(seq_len, n_kv, hd).transpose(0, 1), cos, sin, layout)
        return q @ k.repeat_interleave(n_heads // n_kv, dim=0).transpose(-1, -2)

    want, got = scores(wq, wk, source_layout), scores(nq, nk, target_layout)
    err = ((got - want).abs().amax(dim=(1, 2)) / want.abs().max()).tolist()
    bad = [h + 1 for h, e in enumerate(err) if e > tol]
    hints = []
    if bad and source_layout != target_layout:
        hints = _conversion_hints(wq, wk, nq, nk, n_heads, n_kv, source_layout,
                                  None if r == hd else r)
    problems = ([f"scores of heads {bad} differ (max relative error {measured(max(err))})"]
                if bad else [])
    return ConversionReport(err, bad, hints, problems, tol)


def _conversion_hints(wq, wk, nq, nk, n_heads, n_kv, source_layout, rotary_dim) -> list:
    """The usual mistakes that explain converted weights ``nq, nk``: a weight copied as it
    was, ``W_k`` permuted with the query head count, a weight permuted twice."""
    convert = interleaved_to_half if source_layout == "interleaved" else half_to_interleaved
    hints = []
    for name, w, new, right, wrong in (("W_q", wq, nq, n_heads, None),
                                       ("W_k", wk, nk, n_kv, n_heads)):
        if torch.equal(w, new):
            hints.append(f"{name} was copied without permuting its rows")
        elif wrong is not None and wrong != right and w.shape[0] % wrong == 0 and (
            torch.allclose(convert(w, wrong, rotary_dim), new)
        ):
            hints.append(f"{name} was permuted with {wrong} heads; it has n_kv_heads={right}")
        elif torch.allclose(convert(convert(w, right), right), new):
            hints.append(f"{name} was permuted twice")
    return hints
