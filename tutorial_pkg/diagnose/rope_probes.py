"""Probes of a RoPE function you wrote: what it rotates, and how precisely. Chapter 9.

* :func:`probe_rope`: from the function's outputs alone, which features it pairs (half
  or interleaved), its base, partial rotary, scaling, and whether scores depend only
  on ``m - n``; a function that returns the rotated features permuted (DeepSeek-V3's
  de-interleaved output) is judged by the rotation behind the permutation.
* :func:`probe_rope_precision`: how far its output drifts from a float64 reference
  with position, in the dtype you run.
* :func:`compare_rope`: the same measurements on your function and on a reference
  (the model's own implementation, or one built from its config), and what differs:
  the rotated slice, the layout, the frequencies, the attention factor.

Both take any callable ``rope(x) -> rotated x`` on ``[b, H, s, d]`` (``axes="bshd"``
for ``[b, s, H, d]``) with token ``t`` at position ``t``. Both are re-exported by
:mod:`tutorial_pkg.diagnose`.
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
    check_float_dtype,
    check_positive_float,
    check_positive_int,
)
from ..encodings.rope import LAYOUTS, RotaryEmbedding
from .reports import Report, bound, first_true, measured

__all__ = ["RopeReport", "PrecisionReport", "RopeComparisonReport", "probe_rope",
           "probe_rope_precision", "compare_rope"]

AXES = ("bhsd", "bshd")


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
            deviation = measured(self.relative_error)
        else:  # tol itself where it holds: a magnitude of 1 + 1e-7 must not print 2e-05
            deviation = f"<= {bound(self.tol if self.relative_error <= self.tol else limit)}"
        layout = f"{self.layout}"
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

    ``rope(x)`` must rotate ``x`` (``[b, H, s, d]``, or ``[b, s, H, d]`` with
    ``axes="bshd"``) with token ``t`` at position ``t`` and return a tensor of the same
    shape (or a tuple whose first item is one: wrap a ``(q, k)`` function as
    ``lambda x: f(x, x)[0]``). It is called on unit vectors ``e_i`` (batch ``d``)
    and on random vectors (batch 8): the image of ``e_i`` at position ``m`` tells
    which feature ``i`` is paired with and by which angle it turns. Where position 0
    maps the features to a permutation of themselves (DeepSeek-V3's
    ``apply_rotary_pos_emb_interleave`` returns evens' results first, odds' second),
    that permutation is undone first and reported (``output_permutation``, a note):
    scores do not see a permutation q and k share, so the layout reported is that of
    the input pairs.

    Args:
        rope: the function to probe.
        head_dim: ``d``, features per head.
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

    Raises:
        TypeError: ``rope`` is not callable, ``dtype`` not a floating-point dtype.
        ValueError: an argument out of range (naming it), or ``rope`` returns
            something other than a tensor of its input's shape.
    """
    check_callable("rope", rope)
    check_positive_int("head_dim", head_dim)
    check_choice("axes", axes, AXES)
    check_positive_int("n_heads", n_heads)
    if check_positive_int("seq_len", seq_len) < 3:
        raise ValueError(f"seq_len must be >= 3, got {seq_len}")
    check_float_dtype("dtype", dtype)
    if expect_layout is not None:
        check_choice("expect_layout", expect_layout, LAYOUTS)
    if expect_base is not None:
        expect_base = check_positive_float("expect_base", expect_base)
    tol = max(1e-5, 8 * torch.finfo(dtype).eps) if tol is None else (
        check_positive_float("tol", tol))

    with torch.no_grad():
        images = _basis_images(rope, head_dim, n_heads, seq_len, dtype, axes)
        relative_error = _relative_score_error(rope, head_dim, n_heads, seq_len, dtype, axes)
    notes, problems = [], []
    images, output_permutation = _undo_output_permutation(images, tol)
    if output_permutation is not None:
        notes.append(_permutation_note(output_permutation))
    unrotated, partner = _partners(images, tol)
    pairs = sorted({(min(i, j), max(i, j)) for i, j in partner.items()})

    layout, freqs, scale, base, magnitude = None, [], None, None, 1.0
    if not partner:
        problems.append("nothing is rotated: no position information reaches q/k")
    elif any(partner.get(j) != i for i, j in partner.items()):
        layout = "other"
        problems.append("features are not rotated in pairs: not a RoPE rotation")
    else:
        layout = _pair_layout(pairs)
        magnitude, is_rotation, starts_at_identity, theta = _pair_rotation(images, pairs, tol)
        if not is_rotation:
            problems.append("the pairs are not rotated: lengths change with position")
        elif abs(magnitude - 1) > 1e-3:
            notes.append(f"cos and sin are scaled by {magnitude:.4g} (YaRN attention factor?)")
        if not starts_at_identity:
            problems.append("position 0 is not the identity (positions do not start at 0?)")
        if (theta < 0).all():
            notes.append("rotates clockwise (sin with the opposite sign); still relative")
        theta = theta.abs()
        freqs = theta.tolist()
        if is_rotation and len(pairs) >= 2 and bool((theta > 0).all()):
            base, scale, geometric = _fit_base(theta)
            if not geometric:
                notes.append("frequencies are not geometric (YaRN, Llama 3 or another "
                             "per-frequency scaling?): base and scale are a fit")
            elif abs(scale - 1) > 1e-3:
                notes.append(f"frequencies divided by {scale:.4g} (position interpolation?)")

    if relative_error > tol * max(1.0, magnitude**2):
        problems.append(f"scores depend on absolute positions, not only on m - n "
                        f"(deviation {measured(relative_error)})")
    if expect_layout is not None and layout != expect_layout:
        problems.append(f"layout is {layout}, expected {expect_layout}")
    if expect_base is not None and (base is None or abs(base / expect_base - 1) > 1e-3):
        problems.append(f"base is {base}, expected {expect_base:g}")
    return RopeReport(layout, base, head_dim, 2 * len(pairs), pairs, unrotated, freqs, scale,
                      magnitude, relative_error, notes, problems, tol, output_permutation)


def _basis_images(rope, d: int, n_heads: int, s: int, dtype, axes: str) -> torch.Tensor:
    """``images[i, m, :] = R_m e_i``: what ``rope`` makes of unit vector ``e_i`` at position
    ``m`` (head 0), in float64 ``[d, s, d]``."""
    basis = torch.eye(d, dtype=dtype)[:, None, None, :].expand(d, n_heads, s, d)
    return _call_rope(rope, basis.contiguous(), axes)[:, 0].double()


def _relative_score_error(rope, d: int, n_heads: int, s: int, dtype, axes: str) -> float:
    """Largest ``|score(m+1, n+1) - score(m, n)|`` of 8 pairs of random unit vectors: zero
    when scores depend only on ``m - n``."""
    gen = torch.Generator().manual_seed(0)
    u, w = (torch.randn(8, 1, 1, d, generator=gen, dtype=torch.float64) for _ in range(2))
    u, w = u / u.norm(dim=-1, keepdim=True), w / w.norm(dim=-1, keepdim=True)
    qs, ks = (_call_rope(rope, t.expand(8, n_heads, s, d).to(dtype).contiguous(), axes)
              [:, 0].double() for t in (u, w))
    scores = qs @ ks.transpose(-1, -2)  # [8, s, s]
    return float((scores[:, 1:, 1:] - scores[:, :-1, :-1]).abs().max())


def _partners(images: torch.Tensor, tol: float) -> tuple[list, dict]:
    """The features no position moves, and for each moved feature ``i`` the feature its
    image leans into most (its partner, if the rotation is in pairs)."""
    d = images.shape[0]
    eye = torch.eye(d, dtype=torch.float64)
    moved = (images - eye[:, None, :]).abs().amax(dim=(1, 2))
    unrotated = [i for i in range(d) if moved[i] <= tol]
    rotated = [i for i in range(d) if moved[i] > tol]
    off = images.abs().amax(dim=1)  # [i, j]: largest |component j| of R_m e_i
    off[range(d), range(d)] = 0
    return unrotated, {i: int(off[i].argmax()) for i in rotated}


def _pair_layout(pairs: list) -> str:
    """``"half"`` for pairs ``(f + j, f + j + n)``, ``"interleaved"`` for ``(f + 2j, f + 2j + 1)``
    (``n`` pairs from feature ``f``), else ``"other"``."""
    firsts = [a for a, _ in pairs]
    n_p, f0 = len(pairs), firsts[0]
    if all(b - a == n_p for a, b in pairs) and firsts == list(range(f0, f0 + n_p)):
        return "half"
    if all(b == a + 1 for a, b in pairs) and firsts == list(range(f0, f0 + 2 * n_p, 2)):
        return "interleaved"
    return "other"


def _pair_rotation(images: torch.Tensor, pairs: list, tol: float):
    """How each pair ``(a, b)`` turns: ``(magnitude, is_rotation, starts_at_identity, theta)``.

    ``cos`` and ``sin`` are read from the image of ``e_a``; ``magnitude`` is the length they
    carry (1, or an attention factor), ``is_rotation`` whether that length is the same at
    every position, ``starts_at_identity`` whether position 0 does not turn, and
    ``theta`` the angle per position of each pair (float64, negative: clockwise), a
    least-squares fit through the origin of the unwrapped phase.
    """
    a_idx = torch.tensor([a for a, _ in pairs])
    b_idx = torch.tensor([b for _, b in pairs])
    cos, sin = images[a_idx, :, a_idx], images[a_idx, :, b_idx]  # [pairs, s]
    norms = torch.sqrt(cos**2 + sin**2)
    magnitude = float(norms[:, 1:].mean())
    is_rotation = bool((norms - magnitude).abs().max() <= max(tol, 1e-3) * magnitude)
    starts_at_identity = not (sin[:, 0] / magnitude).abs().max() > tol
    m = torch.arange(images.shape[1], dtype=torch.float64)
    phase = _unwrap(torch.atan2(sin, cos))
    theta = (phase * m).sum(-1) / (m * m).sum()
    return magnitude, is_rotation, starts_at_identity, theta


def _unwrap(phase: torch.Tensor) -> torch.Tensor:
    """Unwrap angles along the last axis (steps of less than pi between neighbours)."""
    step = phase.diff(dim=-1)
    step = step - 2 * math.pi * torch.round(step / (2 * math.pi))
    return torch.cat((phase[..., :1], phase[..., :1] + step.cumsum(-1)), dim=-1)


def _fit_base(theta: torch.Tensor) -> tuple[float, float, bool]:
    """Fit ``theta_j = b ** (-2j / r) / scale`` (``r = 2 * pairs``) to positive angles:
    ``(b, scale, geometric)``, both rounded to 4 significant digits; ``geometric`` is
    whether every ``log theta_j`` lies within 0.01 of the fitted line."""
    n_p = theta.numel()
    x = 2 * torch.arange(n_p, dtype=torch.float64) / (2 * n_p)
    y = theta.log()
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    intercept = y.mean() - slope * x.mean()
    base = float(f"{math.exp(-float(slope)):.4g}")
    scale = float(f"{math.exp(-float(intercept)):.4g}")
    geometric = not (y - intercept - slope * x).abs().max() > 1e-2
    return base, scale, geometric


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

    Raises:
        TypeError: ``rope`` or ``reference`` not callable, ``dtype`` not a floating-point
            dtype, ``autocast`` not a bool.
        ValueError: an argument out of range (naming it), or ``rope`` returns
            something other than a tensor of its input's shape.
    """
    check_callable("rope", rope)
    if reference is not None:
        check_callable("reference", reference)
    check_positive_int("head_dim", head_dim)
    check_float_dtype("dtype", dtype)
    check_positive_int("seq_len", seq_len)
    check_choice("axes", axes, AXES)
    check_positive_int("n_heads", n_heads)
    check_positive_int("n_buckets", n_buckets)
    check_bool("autocast", autocast)
    tol = 16 * torch.finfo(dtype).eps if tol is None else check_positive_float("tol", tol)
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
    first = first_true(err > tol)
    problems = [] if first is None else [
        f"error exceeds {tol:.3g} from position {first} (max {measured(float(err.max()))}): "
        f"angles or cos/sin computed in low precision?"]
    return PrecisionReport(dtype, tol, buckets, first, problems)


# --------------------------------------------------------------------------- comparison
@dataclass(repr=False)
class RopeComparisonReport(Report):
    """What :func:`compare_rope` measured.

    Attributes:
        rope: :func:`probe_rope`'s report on the function under test.
        reference: its report on the reference.
        max_output_error: largest ``|rope(x) - reference(x)|`` on random unit vectors.
        frequency_error: largest relative difference of the angles per position, pair by
            pair (``None`` when the pairs differ and cannot be compared).
        magnitude_ratio: the function's cos/sin magnitude over the reference's (1: same
            attention factor; 1 / f: a factor f dropped; f: applied once more).
        tol: tolerance of the output comparison.
        problems: what differs, in words (empty when ``ok``).
    """

    rope: RopeReport
    reference: RopeReport
    max_output_error: float
    frequency_error: float | None
    magnitude_ratio: float
    tol: float
    problems: list = field(default_factory=list)

    def _lines(self):
        r, f = self.rope, self.reference

        def describe(x):
            base = "-" if x.base is None else f"{x.base:g}"
            return (f"layout {x.layout}, rotates {_ranges(_rotated(x))} of {x.head_dim}, "
                    f"base {base}, cos/sin x {x.magnitude:.4g}")

        out = self.max_output_error
        return [f"yours:     {describe(r)}",
                f"reference: {describe(f)}",
                "outputs differ by: " + (f"<= {bound(self.tol)}" if out <= self.tol
                                         else measured(out))]


def _rotated(report: RopeReport) -> list:
    return sorted({i for pair in report.pairs for i in pair})


def _ranges(features: list) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"`` (features, for the report)."""
    if not features:
        return "none"
    runs, start = [], features[0]
    for a, b in zip(features, features[1:] + [None], strict=True):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return "features " + ", ".join(runs)


def compare_rope(
    rope: Callable[[torch.Tensor], torch.Tensor],
    reference: Callable[[torch.Tensor], torch.Tensor] | None,
    head_dim: int,
    *,
    config=None,
    layer_type: str | None = None,
    axes: str = "bhsd",
    n_heads: int = 1,
    seq_len: int = 64,
    dtype: torch.dtype = torch.float32,
    tol: float | None = None,
) -> RopeComparisonReport:
    """Compare a RoPE function with a reference, feature by feature.

    Both are measured by :func:`probe_rope` (same arguments) and called on the same
    random unit vectors. The report names each difference: which features are rotated
    (the wrong slice of a partial rotary head), the pair layout (half against
    interleaved), the angles per position (another base, a scaling rule that should
    or should not apply), and the factor cos and sin carry (an attention factor
    dropped, or applied twice). Where the outputs agree within ``tol`` the functions
    are the same and the report is ``ok``.

    Args:
        rope: the function under test, ``rope(x) -> rotated x`` as :func:`probe_rope`
            takes it.
        reference: the function it must equal (same convention), or None with ``config``.
        head_dim, axes, n_heads, seq_len, dtype: as :func:`probe_rope`.
        config: instead of ``reference``, a Hugging Face config (or its dict): the
            reference is the RoPE it asks for
            (:meth:`~tutorial_pkg.encodings.rope.RotaryEmbedding.from_config`, every
            ``rope_type``), so a rule such as ``proportional`` (Gemma 4's global layers:
            pairs ``(i, i + d/2)`` with frequencies of the whole head, the rest still)
            is compared with itself, not called a wrong slice.
        layer_type: with ``config``, the layer type whose RoPE to read.
        tol: tolerance of the output comparison (default ``max(1e-5, 8 eps(dtype))``).

    Returns:
        A :class:`RopeComparisonReport`.

    Raises:
        TypeError: as :func:`probe_rope`.
        ValueError: as :func:`probe_rope`.
    """
    if (reference is None) == (config is None):
        raise ValueError("give exactly one of reference and config (the RoPE it asks for)")
    if config is not None:
        built = RotaryEmbedding.from_config(config, layer_type)
        if built.head_dim != head_dim:
            raise ValueError(f"the config's RoPE has head_dim={built.head_dim}, not "
                             f"head_dim={head_dim}")
        reference = built.rotate
    check_callable("reference", reference)
    tol = max(1e-5, 8 * torch.finfo(dtype).eps) if tol is None else (
        check_positive_float("tol", tol))
    mine = probe_rope(rope, head_dim, axes=axes, n_heads=n_heads, seq_len=seq_len,
                      dtype=dtype, tol=tol)
    ref = probe_rope(reference, head_dim, axes=axes, n_heads=n_heads, seq_len=seq_len,
                     dtype=dtype, tol=tol)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, n_heads, seq_len, head_dim, generator=gen, dtype=torch.float64)
    x = (x / x.norm(dim=-1, keepdim=True)).to(dtype)
    with torch.no_grad():
        out = float((_call_rope(rope, x.clone(), axes).double()
                     - _call_rope(reference, x.clone(), axes).double()).abs().max())

    problems = []
    if _rotated(mine) != _rotated(ref):
        hint = ("the wrong slice of a partial rotary head?" if config is not None else
                "the wrong slice of a partial rotary head, or a rule such as 'proportional' "
                "that rotates these features on purpose? compare with config= to know")
        problems.append(f"rotates {_ranges(_rotated(mine))}; the reference rotates "
                        f"{_ranges(_rotated(ref))} ({hint})")
    elif mine.pairs != ref.pairs:
        problems.append(f"pairs the rotated features as {mine.layout}; the reference as "
                        f"{ref.layout}")
    freq_error = None
    if mine.pairs == ref.pairs and mine.frequencies and ref.frequencies:
        a = torch.tensor(mine.frequencies, dtype=torch.float64)
        b = torch.tensor(ref.frequencies, dtype=torch.float64)
        freq_error = float(((a - b).abs() / b.abs().clamp_min(1e-12)).max())
        if freq_error > 1e-3:
            what = ("another base" if "not geometric" not in " ".join(mine.notes + ref.notes)
                    else "another scaling of the frequencies")
            problems.append(f"angles per position differ by up to {freq_error:.3g} (relative):"
                            f" {what}")
    ratio = mine.magnitude / ref.magnitude
    if abs(ratio - 1) > 1e-3:
        if abs(mine.magnitude - 1) <= 1e-3:
            hint = f"the reference's attention factor {ref.magnitude:.4g} dropped?"
        elif abs(mine.magnitude - ref.magnitude**2) <= 1e-3 * ref.magnitude**2:
            hint = f"the attention factor {ref.magnitude:.4g} applied twice?"
        else:
            hint = "another attention factor"
        problems.append(f"cos and sin carry {mine.magnitude:.4g}, the reference's "
                        f"{ref.magnitude:.4g} ({hint})")
    if out > tol * max(1.0, ref.magnitude) and not problems:
        problems.append(f"outputs differ by up to {measured(out)}")
    return RopeComparisonReport(mine, ref, out, freq_error, ratio, tol, problems)
