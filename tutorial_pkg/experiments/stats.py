"""Intervals for the chapters' claims: a bootstrap over evaluation blocks, paired seed differences.

* :func:`bootstrap_interval`: the mean of per-block values (e.g. the mean NLL of each
  evaluation block) with a percentile bootstrap interval; fixed seed, so the same values
  always give the same interval. It measures **evaluation-set noise** (which text was
  scored), not training noise.
* :func:`paired_difference`: per-seed differences ``a[i] - b[i]`` of two variants trained
  with the same seed (same initial weights and batches), their mean and an interval
  (Student's t by default, or a bootstrap over the pairs). It measures **training
  noise** for a paired design, which is tighter than comparing two unpaired spreads.
* :func:`t_quantile`: the Student t quantile the interval uses (no SciPy needed).
* :func:`bonferroni`: the per-claim confidence that keeps a family of claims at a
  family-wise confidence.

Multiplicity: a chapter that asserts ``k`` comparisons, each with a 95 % interval, makes
on average ``0.05 k`` false claims when nothing differs. :func:`paired_differences`
(many comparisons) documents how to hold the whole family at a confidence instead.

Example:
    >>> r = paired_difference([0.61, 0.70, 0.55], [0.60, 0.62, 0.58])
    >>> [round(d, 2) for d in r["differences"]]
    [0.01, 0.08, -0.03]
    >>> r["low"] < r["mean"] < r["high"]
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from .._checks import check_choice, check_nonneg_int, check_number, check_positive_int

__all__ = [
    "t_quantile",
    "t_interval",
    "bootstrap_interval",
    "paired_difference",
    "paired_differences",
    "bonferroni",
]


def _values(name: str, values) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        v = values.detach().double().cpu().flatten()
    elif isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of numbers or a tensor, got {values!r}")
    else:
        v = torch.tensor([check_number(f"{name}[i]", x) for x in values], dtype=torch.float64)
    if v.numel() == 0:
        raise ValueError(f"{name} must not be empty")
    if not torch.isfinite(v).all():
        raise ValueError(f"{name} must be finite")
    return v


def _confidence(confidence: float) -> float:
    if not 0.0 < check_number("confidence", confidence) < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    return float(confidence)


def _t_cdf(x: float, df: int) -> float:
    """Student t CDF by Simpson's rule on the density (accurate to ~1e-10 for |x| < 50)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    n = 2000  # even
    h = abs(x) / n
    total = 0.0
    for i in range(n + 1):
        t = i * h
        w = 1 if i in (0, n) else (4 if i % 2 else 2)
        total += w * math.exp(log_c - (df + 1) / 2 * math.log1p(t * t / df))
    half = total * h / 3
    return 0.5 + half if x >= 0 else 0.5 - half


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``0.5 <= p < 1``).

    Bisection on the CDF; e.g. ``t_quantile(0.975, 4)`` is 2.776 (the 95 % two-sided value
    for 5 paired seeds).

    Raises:
        ValueError: for ``p`` outside ``[0.5, 1)`` or ``df < 1``.
    """
    check_positive_int("df", df)
    if not 0.5 <= check_number("p", p) < 1.0:
        raise ValueError(f"p must lie in [0.5, 1), got {p!r}")
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def t_interval(values, *, confidence: float = 0.95) -> dict:
    """The mean of ``values`` with Student's t interval ``mean +- t * sd / sqrt(n)``.

    For a few independent replicates (e.g. one value per training seed); assumes they
    are roughly normal. Needs at least 2 values.

    Returns:
        ``{"mean", "low", "high", "n", "confidence"}``.

    Raises:
        ValueError: for fewer than 2 values, non-finite values or a confidence outside
            ``(0, 1)``.
    """
    v = _values("values", values)
    confidence = _confidence(confidence)
    if v.numel() < 2:
        raise ValueError("a t interval needs at least 2 values")
    n = v.numel()
    half = t_quantile((1 + confidence) / 2, n - 1) * v.std().item() / math.sqrt(n)
    mean = v.mean().item()
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n,
            "confidence": confidence}


def bootstrap_interval(
    values,
    *,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """The mean of ``values`` with a percentile bootstrap interval.

    ``n_resamples`` resamples of the values with replacement (from a ``torch.Generator``
    seeded with ``seed``: the same values give the same interval on every run); the
    interval is the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of
    the resampled means. Pass **one value per independent unit**, e.g. the mean NLL of each
    evaluation block: resampling single tokens would ignore that neighbouring tokens of
    one text are correlated. For a perplexity, bootstrap the NLL and take ``exp`` of the
    three numbers (``exp`` is monotone, so the interval carries over).

    Args:
        values: a sequence of numbers or a tensor (flattened), at least one value.
        confidence: the interval's coverage, in ``(0, 1)``.
        n_resamples: bootstrap resamples.
        seed: seed (int >= 0) of the resampling.

    Returns:
        ``{"mean", "low", "high", "n", "confidence"}`` (floats; ``n`` the number of values).
        With one value, ``low == high == mean``.

    Raises:
        TypeError: for values that are not numbers.
        ValueError: for empty or non-finite values or a confidence outside ``(0, 1)``.
    """
    v = _values("values", values)
    confidence = _confidence(confidence)
    check_positive_int("n_resamples", n_resamples)
    check_nonneg_int("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, v.numel(), (n_resamples, v.numel()), generator=gen)
    means = v[idx].mean(dim=1)
    q = torch.tensor([(1 - confidence) / 2, (1 + confidence) / 2], dtype=torch.float64)
    low, high = torch.quantile(means, q).tolist()
    mean = v.mean().item()
    return {"mean": mean, "low": min(low, mean), "high": max(high, mean), "n": v.numel(),
            "confidence": confidence}


def paired_difference(
    a,
    b,
    *,
    confidence: float = 0.95,
    method: str = "t",
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """Per-seed differences ``a[i] - b[i]`` of a paired design, with an interval of their mean.

    ``a[i]`` and ``b[i]`` must come from the same seed (same initial weights, same batches),
    so that each difference cancels what the seed shares. The interval is

    * ``method="t"`` (default): ``mean +- t * sd / sqrt(n)`` with Student's t quantile at
      ``n - 1`` degrees of freedom (:func:`t_quantile`); needs ``n >= 2``. It assumes the
      differences are roughly normal; with 3-5 seeds it is wide, as it should be.
    * ``method="bootstrap"``: the percentile bootstrap of the pairs
      (:func:`bootstrap_interval`); with few seeds it is too narrow, shown for comparison.

    An interval that excludes 0 supports "a differs from b" at that confidence; one that
    contains 0 supports neither "they differ" nor "they are equal": the run cannot tell
    differences smaller than the interval's half-width. Equivalence needs the whole
    interval inside a margin chosen in advance.

    Args:
        a, b: sequences (or tensors) of the same length, paired by position.
        confidence: the interval's coverage, in ``(0, 1)``.
        method: ``"t"`` or ``"bootstrap"``.
        n_resamples, seed: for ``method="bootstrap"``.

    Returns:
        ``{"differences", "mean", "low", "high", "min", "max", "n", "confidence", "method"}``
        (``differences`` a list of floats).

    Raises:
        TypeError: for values that are not numbers.
        ValueError: for different lengths, fewer than 2 pairs with ``method="t"``, or as
            :func:`bootstrap_interval`.
    """
    va, vb = _values("a", a), _values("b", b)
    if va.numel() != vb.numel():
        raise ValueError(f"a and b must pair up: {va.numel()} values against {vb.numel()}")
    confidence = _confidence(confidence)
    check_choice("method", method, ("t", "bootstrap"))
    d = va - vb
    n = d.numel()
    if method == "t":
        if n < 2:
            raise ValueError("method='t' needs at least 2 pairs")
        r = t_interval(d, confidence=confidence)
        mean, low, high = r["mean"], r["low"], r["high"]
    else:
        r = bootstrap_interval(d, confidence=confidence, n_resamples=n_resamples, seed=seed)
        mean, low, high = r["mean"], r["low"], r["high"]
    return {"differences": d.tolist(), "mean": mean, "low": low, "high": high,
            "min": d.min().item(), "max": d.max().item(), "n": n,
            "confidence": confidence, "method": method}


def bonferroni(confidence: float, k: int) -> float:
    """Per-claim confidence ``1 - (1 - confidence) / k`` that holds ``k`` claims at ``confidence``.

    If each of ``k`` intervals has coverage ``1 - (1 - confidence) / k``, the chance that
    *any* of them misses is at most ``1 - confidence`` (Bonferroni; no assumption about
    how the claims depend on each other). E.g. ``bonferroni(0.95, 10) == 0.995``.
    """
    confidence = _confidence(confidence)
    check_positive_int("k", k)
    return 1.0 - (1.0 - confidence) / k


def paired_differences(
    pairs: Mapping[str, tuple],
    *,
    confidence: float = 0.95,
    family: bool = True,
    method: str = "t",
) -> dict[str, dict]:
    """:func:`paired_difference` for several named comparisons at once.

    **Multiplicity.** Each comparison a chapter asserts is one more chance of a false
    claim: ``k`` claims at 95 % each are all right only with probability down to
    ``1 - 0.05 k``. With ``family=True`` (default) every interval is computed at
    :func:`bonferroni` ``(confidence, k)``, so that all ``k`` intervals hold together with
    probability at least ``confidence``; ``family=False`` gives each its own
    ``confidence`` (state the number of claims next to them then).

    Args:
        pairs: ``{name: (a, b)}``, each ``a``/``b`` paired by seed.
        confidence: the family's (or each claim's) confidence.
        family: widen each interval for the number of claims (Bonferroni).
        method: as :func:`paired_difference`.

    Returns:
        ``{name: paired_difference(a, b, ...)}``, each with ``"k"`` (the number of claims).
    """
    if not isinstance(pairs, Mapping) or not pairs:
        raise TypeError("pairs must be a non-empty mapping {name: (a, b)}")
    k = len(pairs)
    each = bonferroni(confidence, k) if family else _confidence(confidence)
    out = {}
    for name, pair in pairs.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"pairs[{name!r}] must be a pair (a, b)")
        out[name] = {**paired_difference(pair[0], pair[1], confidence=each, method=method),
                     "k": k}
    return out
