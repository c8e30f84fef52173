"""Probes you point at your own code to find position-encoding bugs. Chapter 9.

Each probe takes plain callables or tensors (your function, your model, your
weights), not only this package's classes, and returns a small report: a
dataclass with ``ok`` (pass/fail), the measured quantities, a list of
``problems`` in words, and a readable ``str()``. The ``str()`` prints what a check
claims, not rounding noise: a residual that passes is printed as the bound it passed
(``max |diff| <= 0.0001``), one that fails with two significant digits; the exact
values are the report's attributes.

* :func:`probe_rope`: what a RoPE function does: half or interleaved pairs, its
  base, partial rotary, and whether scores depend only on ``m - n``; a function that
  returns the rotated features permuted (DeepSeek-V3's de-interleaved output) is
  judged by the rotation behind the permutation, which the report names.
* :func:`probe_rope_precision`: how far its output drifts from a float64
  reference with position, in the dtype you run (the bf16-angles bug).
* :func:`check_kv_cache`: token-by-token decoding against one full forward pass,
  with and without left padding, through an adapter for your model's convention
  (:class:`TutorialAdapter`, :class:`HFAdapter`, or your own).
* :func:`probe_masking`: non-finite outputs (fully masked rows), future-token
  leaks and cross-document leaks in packed rows.
* :func:`probe_alibi`: ALiBi slopes against Press et al.'s and the rounding of a
  bias stored in low precision.
* :func:`check_weight_conversion`: after permuting q/k weights between layouts,
  the scores equal the original model's (grouped-query aware).

Tensors follow the package's layout: queries and keys ``[b, n_h, s, h_d]``
(``axes="bshd"`` for ``[b, s, n_h, h_d]``), model inputs ``[b, s]`` token ids or
``[b, s, d]`` features, outputs ``[b, s, ...]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ._checks import check_choice, check_positive_float, check_positive_int
from .alibi import alibi_slopes
from .positions import positions_from_padding
from .rope import LAYOUTS, apply_rope, half_to_interleaved, interleaved_to_half, inv_freq

__all__ = [
    "Report", "RopeReport", "PrecisionReport", "KVCacheReport", "MaskingReport", "AlibiReport",
    "ConversionReport", "TutorialAdapter", "HFAdapter",
    "probe_rope", "probe_rope_precision", "check_kv_cache", "probe_masking", "probe_alibi",
    "check_weight_conversion",
]

AXES = ("bhsd", "bshd")


# --------------------------------------------------------------------------- helpers
def _check_callable(name: str, fn) -> None:
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")


def _check_dtype(name: str, dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.dtype, got {dtype!r}")
    return dtype


def _check_tol(name: str, value, default: float) -> float:
    return default if value is None else check_positive_float(name, value)


def _call_rope(rope, x: torch.Tensor, axes: str) -> torch.Tensor:
    """Call ``rope`` on ``x [b, h, s, d]`` in the user's axes; the result as ``[b, h, s, d]``."""
    arg = x.transpose(1, 2) if axes == "bshd" else x
    out = rope(arg)
    if isinstance(out, tuple):
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.shape != arg.shape:
        raise ValueError(f"rope must return a tensor of its input's shape {tuple(arg.shape)}, "
                         f"got {getattr(out, 'shape', type(out).__name__)}")
    return out.transpose(1, 2) if axes == "bshd" else out


def _unwrap(phase: torch.Tensor) -> torch.Tensor:
    """Unwrap angles along the last axis (steps of less than pi between neighbours)."""
    step = phase.diff(dim=-1)
    step = step - 2 * math.pi * torch.round(step / (2 * math.pi))
    return torch.cat((phase[..., :1], phase[..., :1] + step.cumsum(-1)), dim=-1)


def _bound(x: float) -> str:
    """``x`` rounded up to one significant digit (``1e-05``, ``2e-05``, ``0.05``): a bound to
    print in place of a residual, whose digits depend on how the CPU's kernels round."""
    if not x > 0:
        return f"{x:g}"
    exp = math.floor(math.log10(x))
    digit = math.ceil(round(x / 10.0**exp, 9))
    return f"{float(f'{digit}e{exp}'):g}"


def _measured(x: float) -> str:
    """A residual that failed its check, to two significant digits (``5.3``, ``0.0012``)."""
    return f"{x:.2g}"


def _first(mask: torch.Tensor) -> int | None:
    idx = mask.nonzero()
    return None if idx.numel() == 0 else int(idx[0, 0])


class Report:
    """The base of every report: ``ok`` is True when ``problems`` is empty; ``str()`` is
    the readable report (a ``OK``/``FAIL`` headline, the measurements, the problems)."""

    problems: list

    @property
    def ok(self) -> bool:
        return not self.problems

    def _lines(self) -> list[str]:
        raise NotImplementedError

    def __str__(self) -> str:
        head = f"{type(self).__name__[:-6]}: {'OK' if self.ok else 'FAIL'}"
        return "\n".join([head, *("  " + s for s in self._lines()),
                          *("  problem: " + p for p in self.problems)])


# --------------------------------------------------------------------------- RoPE layout
@dataclass(repr=False)
class RopeReport(Report):
    """What :func:`probe_rope` measured.

    Attributes:
        layout: ``"half"`` (pairs ``i, i + r/2``), ``"interleaved"`` (``2i, 2i + 1``),
            ``"other"`` or ``None`` (nothing rotated).
        base: the base ``b`` of ``theta_j = b ** (-2j / r)`` fitted to the measured
            angles, rounded to 4 significant digits (exact for standard bases); ``None``
            with fewer than two pairs.
        head_dim: features per head.
        rotary_dim: features rotated per head.
        pairs: the rotated pairs ``(i, j)``; ``unrotated``: features left as they are.
        frequencies: measured angle per position of each pair, in pair order.
        frequency_scale: ``1 / theta_0`` (1 without position interpolation).
        magnitude: the factor cos and sin carry (1, or e.g. YaRN's attention factor).
        relative_error: largest ``|s(m+1, n+1) - s(m, n)|`` of unit vectors' scores.
        notes: what is unusual but not wrong (scaling, direction of rotation).
        problems: what is wrong, in words (empty when ``ok``).
        tol: the tolerance of the checks (``relative_error`` may reach
            ``tol * max(1, magnitude ** 2)``).
        output_permutation: ``None``, or where the function puts input feature ``i``
            of a rotation in its output (``output_permutation[i]``) when it returns the
            features permuted (DeepSeek-V3's de-interleaved output). ``layout``,
            ``pairs`` and ``unrotated`` then describe the input features.
    """

    layout: str | None
    base: float | None
    head_dim: int
    rotary_dim: int
    pairs: list
    unrotated: list
    frequencies: list
    frequency_scale: float | None
    magnitude: float
    relative_error: float
    notes: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    tol: float | None = None
    output_permutation: list | None = None

    def _lines(self):
        base = "-" if self.base is None else f"{self.base:g}"
        limit = None if self.tol is None else self.tol * max(1.0, self.magnitude**2)
        if limit is None or self.relative_error > limit:
            deviation = _measured(self.relative_error)
        else:  # tol itself where it holds: a magnitude of 1 + 1e-7 must not print 2e-05
            deviation = f"<= {_bound(self.tol if self.relative_error <= self.tol else limit)}"
        layout = self.layout
        if self.output_permutation is not None:
            layout += (", de-interleaved output" if _deinterleaved(self.output_permutation)
                       else ", output permuted")
        return [f"layout {layout}, base {base}, rotary_dim {self.rotary_dim} of "
                f"{self.head_dim} ({len(self.unrotated)} features unrotated)",
                f"scores depend only on m - n: max deviation {deviation}",
                *("note: " + n for n in self.notes)]


def probe_rope(
    rope: Callable[[torch.Tensor], torch.Tensor],
    head_dim: int,
    *,
    axes: str = "bhsd",
    n_heads: int = 1,
    seq_len: int = 64,
    dtype: torch.dtype = torch.float32,
    expect_layout: str | None = None,
    expect_base: float | None = None,
    tol: float | None = None,
) -> RopeReport:
    """Measure what a RoPE function does, from its outputs alone.

    ``rope(x)`` must rotate ``x`` (``[b, n_h, s, h_d]``, or ``[b, s, n_h, h_d]`` with
    ``axes="bshd"``) with token ``t`` at position ``t`` and return a tensor of the same
    shape (or a tuple whose first item is one: wrap a ``(q, k)`` function as
    ``lambda x: f(x, x)[0]``). It is called on unit vectors ``e_i`` (batch ``h_d``)
    and on random vectors (batch 8): the image of ``e_i`` at position ``m`` tells
    which feature ``i`` is paired with and by which angle it turns. Where position 0
    maps the features to a permutation of themselves (DeepSeek-V3's
    ``apply_rotary_pos_emb_interleave`` returns evens' results first, odds' second),
    that permutation is undone first and reported (``output_permutation``, a note):
    scores do not see a permutation q and k share, so the layout reported is that of
    the input pairs.

    Args:
        rope: the function to probe.
        head_dim: ``h_d``, features per head.
        axes: ``"bhsd"`` or ``"bshd"``.
        n_heads: heads of the probe tensors (if your function needs a fixed count).
        seq_len: positions probed (at least 3).
        dtype: dtype of the probe tensors.
        expect_layout: if given, a different layout is a problem.
        expect_base: if given, a base off by more than 0.1 % is a problem.
        tol: tolerance of the rotation and relative-score checks (default
            ``max(1e-5, 8 eps(dtype))``).

    Returns:
        A :class:`RopeReport`.
    """
    _check_callable("rope", rope)
    check_positive_int("head_dim", head_dim)
    check_choice("axes", axes, AXES)
    check_positive_int("n_heads", n_heads)
    if check_positive_int("seq_len", seq_len) < 3:
        raise ValueError(f"seq_len must be >= 3, got {seq_len}")
    _check_dtype("dtype", dtype)
    if expect_layout is not None:
        check_choice("expect_layout", expect_layout, LAYOUTS)
    if expect_base is not None:
        expect_base = check_positive_float("expect_base", expect_base)
    tol = _check_tol("tol", tol, max(1e-5, 8 * torch.finfo(dtype).eps))
    d, s = head_dim, seq_len
    with torch.no_grad():
        basis = torch.eye(d, dtype=dtype)[:, None, None, :].expand(d, n_heads, s, d)
        img = _call_rope(rope, basis.contiguous(), axes)[:, 0].double()  # [i, m, :] = R_m e_i
        gen = torch.Generator().manual_seed(0)
        u, w = (torch.randn(8, 1, 1, d, generator=gen, dtype=torch.float64) for _ in range(2))
        u, w = u / u.norm(dim=-1, keepdim=True), w / w.norm(dim=-1, keepdim=True)
        qs, ks = (_call_rope(rope, t.expand(8, n_heads, s, d).to(dtype).contiguous(), axes)
                  [:, 0].double() for t in (u, w))
    scores = qs @ ks.transpose(-1, -2)  # [8, s, s]
    relative_error = float((scores[:, 1:, 1:] - scores[:, :-1, :-1]).abs().max())
    problems, notes = [], []
    img, output_permutation = _undo_output_permutation(img, tol)
    if output_permutation is not None:
        notes.append(_permutation_note(output_permutation))
    eye = torch.eye(d, dtype=torch.float64)
    moved = (img - eye[:, None, :]).abs().amax(dim=(1, 2))
    unrotated = [i for i in range(d) if moved[i] <= tol]
    rotated = [i for i in range(d) if moved[i] > tol]
    off = img.abs().amax(dim=1)  # [i, j]: largest |component j| of R_m e_i
    off[range(d), range(d)] = 0
    partner = {i: int(off[i].argmax()) for i in rotated}
    pairs = sorted({(min(i, j), max(i, j)) for i, j in partner.items()})
    layout, freqs, scale, base, magnitude = None, [], None, None, 1.0
    if rotated and any(partner.get(j) != i for i, j in partner.items()):
        layout = "other"
        problems.append("features are not rotated in pairs: not a RoPE rotation")
    elif pairs:
        firsts = [a for a, _ in pairs]
        n_p, f0 = len(pairs), firsts[0]
        if all(b - a == n_p for a, b in pairs) and firsts == list(range(f0, f0 + n_p)):
            layout = "half"
        elif all(b == a + 1 for a, b in pairs) and firsts == list(range(f0, f0 + 2 * n_p, 2)):
            layout = "interleaved"
        else:
            layout = "other"
        a_idx = torch.tensor([a for a, _ in pairs])
        b_idx = torch.tensor([b for _, b in pairs])
        cos, sin = img[a_idx, :, a_idx], img[a_idx, :, b_idx]  # [pairs, s]
        norms = torch.sqrt(cos**2 + sin**2)
        magnitude = float(norms[:, 1:].mean())
        rotation = bool((norms - magnitude).abs().max() <= max(tol, 1e-3) * magnitude)
        if not rotation:
            problems.append("the pairs are not rotated: lengths change with position")
        elif abs(magnitude - 1) > 1e-3:
            notes.append(f"cos and sin are scaled by {magnitude:.4g} (YaRN attention factor?)")
        if (sin[:, 0] / magnitude).abs().max() > tol:
            problems.append("position 0 is not the identity (positions do not start at 0?)")
        m = torch.arange(s, dtype=torch.float64)
        phase = _unwrap(torch.atan2(sin, cos))
        theta = (phase * m).sum(-1) / (m * m).sum()
        if (theta < 0).all():
            notes.append("rotates clockwise (sin with the opposite sign); still relative")
        theta = theta.abs()
        freqs = theta.tolist()
        if rotation and n_p >= 2 and bool((theta > 0).all()):
            x = 2 * torch.arange(n_p, dtype=torch.float64) / (2 * n_p)
            y = theta.log()
            slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
            intercept = y.mean() - slope * x.mean()
            base = float(f"{math.exp(-float(slope)):.4g}")
            scale = float(f"{math.exp(-float(intercept)):.4g}")
            if (y - intercept - slope * x).abs().max() > 1e-2:
                notes.append("frequencies are not geometric (YaRN, Llama 3 or another "
                             "per-frequency scaling?): base and scale are a fit")
            elif abs(scale - 1) > 1e-3:
                notes.append(f"frequencies divided by {scale:.4g} (position interpolation?)")
    else:
        problems.append("nothing is rotated: no position information reaches q/k")
    if relative_error > tol * max(1.0, magnitude**2):
        problems.append(f"scores depend on absolute positions, not only on m - n "
                        f"(deviation {_measured(relative_error)})")
    if expect_layout is not None and layout != expect_layout:
        problems.append(f"layout is {layout}, expected {expect_layout}")
    if expect_base is not None and (base is None or abs(base / expect_base - 1) > 1e-3):
        problems.append(f"base is {base}, expected {expect_base:g}")
    return RopeReport(layout, base, d, 2 * len(pairs), pairs, unrotated, freqs, scale,
                      magnitude, relative_error, notes, problems, tol, output_permutation)


def _undo_output_permutation(img: torch.Tensor, tol: float):
    """``img`` ``[i, m, :] = rope(e_i)`` at position ``m``, with a fixed permutation of the
    output features undone, and that permutation (``None``: none).

    At position 0 a rotation is the identity (times the attention factor on the rotated
    features); a function whose position-0 image is a permutation matrix returns its
    features permuted (DeepSeek-V3's ``apply_rotary_pos_emb_interleave`` rotates adjacent
    pairs and returns evens' results first, odds' second). Scores ``q . k`` do not see a
    permutation that q and k share, so the probe judges the rotation behind it.
    """
    d = img.shape[0]
    at0 = img[:, 0, :]
    perm = at0.abs().argmax(dim=1)  # perm[i]: the output feature input i lands in
    if torch.equal(perm, torch.arange(d)) or len(set(perm.tolist())) != d:
        return img, None
    rows = torch.arange(d)
    values = at0[rows, perm]
    rest = at0.clone()
    rest[rows, perm] = 0
    if not bool((values > 0).all()) or float(rest.abs().max()) > tol * float(values.max()):
        return img, None
    return img[:, :, perm], perm.tolist()  # output feature k of input order = perm[k]


def _deinterleaved(perm: list) -> bool:
    """Whether ``perm`` (input ``i`` -> output ``perm[i]``) de-interleaves: ``2i -> i`` and
    ``2i + 1 -> r/2 + i`` over the first ``r`` features, the rest in place."""
    d = len(perm)
    for r in range(d - d % 2, 1, -2):
        want = [i // 2 if i % 2 == 0 else r // 2 + i // 2 for i in range(r)] + list(range(r, d))
        if perm == want:
            return True
    return False


def _permutation_note(perm: list) -> str:
    if _deinterleaved(perm):
        return ("output de-interleaved (evens' results first, odds' second: DeepSeek-V3's "
                "apply_rotary_pos_emb_interleave); scores unaffected, layout is the input's")
    return ("output features permuted (a fixed permutation: scores unaffected when q and k "
            "share it); layout is the input's")


# --------------------------------------------------------------------------- precision
@dataclass(repr=False)
class PrecisionReport(Report):
    """What :func:`probe_rope_precision` measured.

    Attributes:
        dtype: the dtype probed.
        tol: the error allowed (relative to the RMS of the inputs).
        buckets: ``(first position, last position, max error)`` per range of positions.
        first_bad_position: first position whose error exceeds ``tol`` (``None``: none).
        problems: what is wrong, in words.
    """

    dtype: torch.dtype
    tol: float
    buckets: list
    first_bad_position: int | None
    problems: list = field(default_factory=list)

    def _lines(self):
        rows = [f"{a:>6d}-{b:<6d} {e:.2g}" for a, b, e in self.buckets]
        return [f"error vs float64 reference in {self.dtype} (tol {self.tol:.3g}):", *rows]


def probe_rope_precision(
    rope: Callable[[torch.Tensor], torch.Tensor],
    head_dim: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seq_len: int = 8192,
    axes: str = "bhsd",
    n_heads: int = 1,
    reference: Callable[[torch.Tensor], torch.Tensor] | None = None,
    autocast: bool = False,
    n_buckets: int = 8,
    tol: float | None = None,
) -> PrecisionReport:
    """How far ``rope``'s output in ``dtype`` drifts from a float64 reference, by position.

    The input ``x`` (random, ``[1, n_heads, seq_len, head_dim]``) is rounded to ``dtype``
    and rotated twice: by ``rope`` in ``dtype`` (under ``torch.autocast`` to ``dtype``
    if ``autocast``) and by ``reference`` in float64 (default: ``rope`` itself on the
    float64 input, outside autocast; pass a reference if your function hard-codes a
    low-precision table). The error at a position is the largest absolute difference
    divided by the RMS of ``x``. A rounding-limited rotation stays near ``eps(dtype)``
    at every position; angles computed in 16 bits grow with the position.

    Args:
        rope: the function to probe, as in :func:`probe_rope`.
        head_dim: features per head.
        dtype: the dtype you run in.
        seq_len: positions probed.
        axes: ``"bhsd"`` or ``"bshd"``.
        n_heads: heads of the probe tensor.
        reference: a float64 rotation of the same convention (default ``rope``).
        autocast: run ``rope`` under ``torch.autocast("cpu", dtype)``.
        n_buckets: ranges of positions reported.
        tol: allowed error (default ``16 eps(dtype)``).

    Returns:
        A :class:`PrecisionReport`.
    """
    _check_callable("rope", rope)
    if reference is not None:
        _check_callable("reference", reference)
    check_positive_int("head_dim", head_dim)
    _check_dtype("dtype", dtype)
    check_positive_int("seq_len", seq_len)
    check_choice("axes", axes, AXES)
    check_positive_int("n_heads", n_heads)
    check_positive_int("n_buckets", n_buckets)
    if not isinstance(autocast, bool):
        raise TypeError(f"autocast must be a bool, got {type(autocast).__name__}")
    tol = _check_tol("tol", tol, 16 * torch.finfo(dtype).eps)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, n_heads, seq_len, head_dim, generator=gen, dtype=torch.float64)
    low = x.to(dtype)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            out = _call_rope(rope, low, axes).double()
        ref = _call_rope(reference or rope, low.double(), axes).double()
    err = ((out - ref).abs().amax(dim=(0, 1, 3)) / x.pow(2).mean().sqrt()).nan_to_num(math.inf)
    edges = torch.linspace(0, seq_len, min(n_buckets, seq_len) + 1).long().tolist()
    buckets = [(a, b - 1, float(err[a:b].max()))
               for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]
    first = _first(err > tol)
    problems = [] if first is None else [
        f"error exceeds {tol:.3g} from position {first} (max {_measured(float(err.max()))}): "
        f"angles or cos/sin computed in low precision?"]
    return PrecisionReport(dtype, tol, buckets, first, problems)


# --------------------------------------------------------------------------- KV cache
class TutorialAdapter:
    """The cache convention of this package, for :func:`check_kv_cache`.

    A model with ``new_caches()`` (:class:`~tutorial_pkg.model.TinyLM`) is called as
    ``model(ids, positions=, caches=, key_padding_mask=)``; any other module
    (:class:`~tutorial_pkg.attention.MultiHeadAttention`,
    :class:`~tutorial_pkg.attention.TransformerBlock`) as
    ``model(x, positions=, kv_cache=, key_padding_mask=)`` with one
    :class:`~tutorial_pkg.attention.KVCache`.

    An adapter has three methods, which your own adapter (any object with them) can
    override to reproduce your decoding loop: ``start()`` returns an empty cache;
    ``full(inputs, positions, padding)`` returns the outputs ``[b, s, ...]`` of one
    pass without cache; ``step(chunk, positions, padding, cache)`` returns
    ``(outputs, cache)`` for new tokens. ``positions`` are the correct ``[b, s]``
    positions, ``padding`` is ``None`` or a bool ``[b, L]`` (``True`` = padding) over
    every token so far.

    Args:
        model: the model.
        pass_positions: give the model ``positions`` (``False``: let it derive them
            from the cache, as a loop that ignores padding does).
    """

    def __init__(self, model, *, pass_positions: bool = True) -> None:
        _check_callable("model", model)
        self.model, self.pass_positions = model, bool(pass_positions)

    def start(self):
        from .attention import KVCache

        return self.model.new_caches() if hasattr(self.model, "new_caches") else KVCache()

    def _call(self, inputs, positions, padding, cache):
        key = "caches" if hasattr(self.model, "new_caches") else "kv_cache"
        kw = {key: cache} if cache is not None else {}
        return self.model(inputs, positions=positions if self.pass_positions else None,
                          key_padding_mask=padding, **kw)

    def full(self, inputs, positions, padding):
        return self._call(inputs, positions, padding, None)

    def step(self, chunk, positions, padding, cache):
        return self._call(chunk, positions, padding, cache), cache


class HFAdapter(TutorialAdapter):
    """The Hugging Face convention, for :func:`check_kv_cache`.

    A transformers causal LM (or any callable with its signature): each decoding step
    is ``model(input_ids, position_ids=, cache=, use_cache=True, attention_mask=)``
    (``inputs_embeds=`` for float inputs); the full pass has ``use_cache=False``. The
    cache is asked for explicitly, so a model whose config says ``use_cache=False``
    (MPT's) still decodes through one. :meth:`start` returns an empty
    ``transformers.DynamicCache`` built from ``model.config`` (transformers is imported
    there, when a check runs, never by this module), or ``None`` for a model without a
    ``config`` or where transformers is not installed (the model then makes its own).
    The cache argument is named as the model's ``forward`` names it: ``cache``
    (transformers >= 5.24) or ``past_key_values`` (earlier; 5.24 still accepts it,
    with a deprecation warning);
    the cache comes back as the output's ``.cache`` (``.past_key_values`` before),
    or as the second item of a tuple ``(logits, cache)``. ``attention_mask`` is ``1``
    for real tokens, over past and new tokens, and only passed with padding.
    """

    def start(self):
        config = getattr(self.model, "config", None)
        if config is None:  # not a transformers model: it makes its own cache
            return None
        try:
            from transformers import DynamicCache
        except ImportError:  # a model of this convention without transformers
            return None
        return DynamicCache(config=config)

    def _params(self):
        import inspect

        fn = getattr(self.model, "forward", self.model)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # no signature to read: the current names
            return {"cache", "use_cache"}, True
        any_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        return set(params), any_kw

    def _run(self, inputs, positions, padding, cache, use_cache):
        names, any_kw = self._params()
        cache_name = "past_key_values" if (
            "cache" not in names and "past_key_values" in names) else "cache"
        kw = {"inputs_embeds" if inputs.is_floating_point() else "input_ids": inputs,
              "position_ids": positions if self.pass_positions else None}
        if use_cache or cache is not None:
            kw[cache_name] = cache
        if "use_cache" in names or any_kw:
            kw["use_cache"] = use_cache
        if padding is not None:
            kw["attention_mask"] = (~padding).long()
        out = self.model(**kw)
        if isinstance(out, tuple):
            return out[0], (out[1] if len(out) > 1 else None)
        fields = getattr(out, "__dataclass_fields__", None) or {}
        name = "cache" if "cache" in fields or not fields and hasattr(out, "cache") else (
            "past_key_values")
        return out.logits, getattr(out, name, None)

    def full(self, inputs, positions, padding):
        return self._run(inputs, positions, padding, None, False)[0]

    def step(self, chunk, positions, padding, cache):
        out, cache = self._run(chunk, positions, padding, cache, True)
        if cache is None:
            raise ValueError("the model returned no cache from a step with use_cache=True: "
                             "it cannot decode through a cache (write an adapter for its "
                             "loop, see TutorialAdapter)")
        return out, cache


@dataclass(repr=False)
class KVCacheReport(Report):
    """What :func:`check_kv_cache` measured.

    Attributes:
        scenarios: name -> ``(first differing position or None, max |difference|)``;
            positions count the real tokens of a row (padding excluded).
        problems: what is wrong, in words.
        atol: the absolute tolerance of the comparison.
        rtol: its relative tolerance.
    """

    scenarios: dict
    problems: list = field(default_factory=list)
    atol: float | None = None
    rtol: float | None = None

    def _lines(self):
        head = ([] if self.atol is None else
                [f"compared with one full pass, within atol {self.atol:g} + rtol {self.rtol:g}:"])
        return head + [f"{name:<28s} " + ("same" if first is None else
                                          f"differs from position {first} (max |diff| "
                                          f"{_measured(err)})")
                       for name, (first, err) in self.scenarios.items()]


def _compare(got, want, atol, rtol, name, scenarios, problems, offset=None):
    """First position where ``got`` and ``want`` (``[b, s, ...]``) differ, per row offset."""
    b, s = want.shape[:2]
    bad = torch.zeros(s, dtype=torch.bool)
    worst = 0.0
    for i in range(b):
        p = 0 if offset is None else offset[i]
        g, w = got[i, p:].double(), want[i, : s - p].double()
        diff = (g - w).abs().reshape(s - p, -1).nan_to_num(math.inf)
        limit = atol + rtol * w.abs().reshape(s - p, -1)
        bad[: s - p] |= (diff > limit).any(-1)
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    first = _first(bad)
    scenarios[name] = (first, worst)
    if first is not None:
        problems.append(f"{name}: outputs differ from the full unpadded pass from position "
                        f"{first}")


def check_kv_cache(
    model,
    inputs: torch.Tensor,
    *,
    convention: str = "tutorial",
    n_pad: int = 3,
    prefill: int = 1,
    pad_value: int = 0,
    atol: float = 1e-4,
    rtol: float = 1e-3,
) -> KVCacheReport:
    """Token-by-token decoding and left-padded batches against one full forward pass.

    The reference is one pass over ``inputs`` without cache or padding. Then:
    decoding (``prefill`` tokens, then one at a time, through the cache) must give
    the same outputs; so must a left-padded batch (every even row gets ``n_pad``
    padding tokens on the left and loses its last ``n_pad`` tokens; odd rows stay
    unpadded), in one pass and decoded. The model must be causal (an output depends
    on earlier tokens only). Runs under ``torch.no_grad()``; call ``model.eval()``
    first if it has dropout.

    Args:
        model: the model, or an adapter (any object with ``start``, ``full`` and
            ``step``, see :class:`TutorialAdapter`) that describes your decoding loop.
        inputs: ``[b, s]`` token ids or ``[b, s, d]`` features.
        convention: ``"tutorial"`` (:class:`TutorialAdapter`) or ``"hf"``
            (:class:`HFAdapter`), when ``model`` is not an adapter.
        n_pad: padding tokens (0: skip the padded scenarios); must be < ``s``.
        prefill: tokens of the first decoding call.
        pad_value: the padding token id (zeros for features).
        atol, rtol: tolerances of the comparison.

    Returns:
        A :class:`KVCacheReport`.
    """
    adapters = {"tutorial": TutorialAdapter, "hf": HFAdapter}
    if all(hasattr(model, a) for a in ("start", "full", "step")):
        adapter = model
    else:
        adapter = adapters[check_choice("convention", convention, adapters)](model)
    if not isinstance(inputs, torch.Tensor) or inputs.dim() not in (2, 3) or inputs.is_complex():
        raise TypeError(f"inputs must be a tensor [b, s] of ids or [b, s, d] of features, got "
                        f"{getattr(inputs, 'shape', type(inputs).__name__)}")
    b, s = inputs.shape[:2]
    if isinstance(n_pad, bool) or not isinstance(n_pad, int) or not 0 <= n_pad < s:
        raise ValueError(f"n_pad must be an int in [0, s={s}), got {n_pad!r}")
    if check_positive_int("prefill", prefill) > s:
        raise ValueError(f"prefill must be <= s={s}, got {prefill}")
    check_positive_float("atol", atol)
    check_positive_float("rtol", rtol)
    scenarios, problems = {}, []
    arange = torch.arange(s, device=inputs.device)[None].expand(b, s)

    def decode(x, positions, padding):
        cache, outs, t = adapter.start(), [], 0
        while t < s:
            c = prefill if t == 0 else 1
            pad = None if padding is None else padding[:, : t + c]
            out, cache = adapter.step(x[:, t : t + c], positions[:, t : t + c], pad, cache)
            outs.append(out)
            t += c
        return torch.cat(outs, dim=1)

    with torch.no_grad():
        ref = adapter.full(inputs, arange, None)
        if not isinstance(ref, torch.Tensor) or tuple(ref.shape[:2]) != (b, s):
            raise ValueError(f"model must return outputs [b={b}, s={s}, ...], got "
                             f"{getattr(ref, 'shape', type(ref).__name__)}")
        if not torch.isfinite(ref).all():
            problems.append("the full pass returns non-finite values")
        _compare(decode(inputs, arange, None), ref, atol, rtol, "decode", scenarios, problems)
        if n_pad:
            offset = [n_pad if i % 2 == 0 else 0 for i in range(b)]
            padded = inputs.clone()
            padding = torch.zeros(b, s, dtype=torch.bool, device=inputs.device)
            for i, p in enumerate(offset):
                if p:
                    padded[i, p:] = inputs[i, : s - p]
                    padded[i, :p] = pad_value
                    padding[i, :p] = True
            positions = positions_from_padding(padding)
            _compare(adapter.full(padded, positions, padding), ref, atol, rtol,
                     "left padding, one pass", scenarios, problems, offset)
            _compare(decode(padded, positions, padding), ref, atol, rtol,
                     "left padding, decode", scenarios, problems, offset)
    return KVCacheReport(scenarios, problems, atol, rtol)


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
                      + (f"<= {self.tol:g}" if same else _measured(self.alone_error))]
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
    """
    _check_callable("fn", fn)
    if not isinstance(inputs, torch.Tensor) or inputs.dim() not in (2, 3) or inputs.is_complex():
        raise TypeError(f"inputs must be a tensor [b, s] of ids or [b, s, d] of features, got "
                        f"{getattr(inputs, 'shape', type(inputs).__name__)}")
    b, s = inputs.shape[:2]
    if s < 2:
        raise ValueError(f"inputs must have at least 2 positions, got {s}")
    if isinstance(pad_tokens, bool) or not isinstance(pad_tokens, int) or not (
        0 <= pad_tokens < s
    ):
        raise ValueError(f"pad_tokens must be an int in [0, s={s}), got {pad_tokens!r}")
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

        def moved(other):
            return ((fn(other, **kw) - out).abs().reshape(b, s, -1).amax(-1).nan_to_num(
                math.inf) > atol)

        future = None
        if causal:
            for t in sorted({max(1, round(s * (k + 1) / (n_cuts + 1))) for k in range(n_cuts)}):
                where = torch.zeros(b, s, dtype=torch.bool, device=inputs.device)
                where[:, t:] = True
                hit = _first(moved(_perturb(inputs, where, gen))[:, :t].any(0))
                if hit is not None and (future is None or hit < future):
                    future = hit
            if future is not None:
                problems.append(f"future-token leak: the output at position {future} changes "
                                "when a later token changes")
        doc_leak, alone = None, None
        if docs is not None:
            alone = 0.0
            for i in range(b):
                for d in docs[i].unique().tolist():
                    own = docs[i] == d
                    where = torch.zeros(b, s, dtype=torch.bool, device=inputs.device)
                    where[i] = own
                    hit = moved(_perturb(inputs, where, gen))[i] & ~own
                    if doc_leak is None and hit.any():
                        doc_leak = (i, _first(hit), d)
                    ids = inputs[i : i + 1, own]
                    single = fn(ids, document_ids=torch.zeros_like(docs[i : i + 1, own]))
                    alone = max(alone, float((single[0] - out[i, own]).abs().max()))
            if doc_leak is not None:
                problems.append(f"cross-document leak: row {doc_leak[0]}, position "
                                f"{doc_leak[1]} changes when document {doc_leak[2]} changes")
            if not alone <= max(atol, 1e-4):
                problems.append(f"a packed document's outputs differ from the document alone "
                                f"(max {_measured(alone)})"
                                + ("" if doc_leak else ": positions do not restart?"))
    return MaskingReport(nonfinite, future, doc_leak, alone, problems,
                         None if alone is None else max(atol, 1e-4))


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
                lines.append(f"bias rounding: max {_measured(self.rounding_error)} nats, above tol "
                             f"from distance {self.first_rounded_distance}")
            elif self.tol is not None:
                lines.append(f"bias rounding: max <= {self.tol:g} nats")
            else:
                lines.append(f"bias rounding: max {_measured(self.rounding_error)} nats")
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
    """
    check_positive_int("n_heads", n_heads)
    check_positive_int("seq_len", seq_len)
    tol = check_positive_float("tol", tol)
    if callable(bias) and not isinstance(bias, torch.Tensor):
        bias = bias(seq_len)
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise TypeError(f"bias must be a floating-point tensor or a callable returning one, got "
                        f"{type(bias).__name__}")
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
        first = _first(dev > tol)
    wrong = [h + 1 for h in range(n_heads) if abs(slopes[h] / ref[h] - 1) > 1e-2]
    problems = []
    if wrong:
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
                 else _measured(worst))
        return [f"score error per head: max {shown}", *("hint: " + h for h in self.hints)]


def _weight(name, w, rows):
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 2:
        raise TypeError(f"{name} must be a 2-D floating-point tensor [out, d_model], got "
                        f"{getattr(w, 'shape', type(w).__name__)}")
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
    """
    check_positive_int("n_heads", n_heads)
    n_kv = n_heads if n_kv_heads is None else check_positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv:
        raise ValueError(f"n_kv_heads ({n_kv}) must divide n_heads ({n_heads})")
    check_choice("source_layout", source_layout, LAYOUTS)
    check_choice("target_layout", target_layout, LAYOUTS)
    check_positive_int("seq_len", seq_len)
    tol = check_positive_float("tol", tol)
    if not isinstance(w_q, torch.Tensor) or w_q.dim() != 2 or w_q.shape[0] % n_heads:
        raise ValueError(f"w_q must be [n_heads * head_dim, d_model] with n_heads={n_heads}, "
                         f"got {getattr(w_q, 'shape', type(w_q).__name__)}")
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
        convert = interleaved_to_half if source_layout == "interleaved" else half_to_interleaved
        for name, w, new, right, wrong in (("W_q", wq, nq, n_heads, None),
                                           ("W_k", wk, nk, n_kv, n_heads)):
            if torch.equal(w, new):
                hints.append(f"{name} was copied without permuting its rows")
            elif wrong is not None and wrong != right and w.shape[0] % wrong == 0 and (
                torch.allclose(convert(w, wrong, r if r != hd else None), new)
            ):
                hints.append(f"{name} was permuted with {wrong} heads; it has n_kv_heads={right}")
            elif torch.allclose(convert(convert(w, right), right), new):
                hints.append(f"{name} was permuted twice")
    problems = ([f"scores of heads {bad} differ (max relative error {_measured(max(err))})"]
                if bad else [])
    return ConversionReport(err, bad, hints, problems, tol)
