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
* :func:`sign_flip`: the paired randomisation (sign-flip) test of per-seed differences and
  the interval that inverts it: its level is exact for any number of seeds when the
  differences are symmetric about the true shift (no normality), and its interval never
  leaves ``[min, max]`` of the differences (so a difference of accuracies stays in
  ``[-1, 1]``). ``paired_difference(..., method="sign_flip")`` uses it.
* :func:`stratified_interval`: the mean of per-condition means (e.g. a paired log ratio
  of timings over rounds, at several sequence lengths) with a t interval
  (Welch-Satterthwaite degrees of freedom).
* :func:`sign_test`: the two-sided sign test of paired differences (counts only their signs,
  so it needs no symmetry; a check on :func:`sign_flip` where the differences are skewed).
* :func:`spearman`: Spearman's rank correlation, ties given their average rank.
* :func:`bonferroni`: the per-claim confidence that keeps a family of claims at a
  family-wise confidence.
* :func:`verdict`: "holds", "refuted" or "not resolved" for a claim decided by an interval
  (a direction, or an equivalence within a margin fixed in advance).

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

import functools
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
    "sign_flip",
    "EXACT_MAX",
    "bonferroni",
    "sign_test",
    "spearman",
    "stratified_interval",
    "verdict",
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
    * ``method="sign_flip"``: the interval that inverts the paired sign-flip test
      (:func:`sign_flip`); exact under symmetry of the differences, inside their range;
      the result also holds the test's two-sided ``p_value`` for a shift of 0.

    An interval that excludes 0 supports "a differs from b" at that confidence; one that
    contains 0 supports neither "they differ" nor "they are equal": the run cannot tell
    differences smaller than the interval's half-width. Equivalence needs the whole
    interval inside a margin chosen in advance.

    Args:
        a, b: sequences (or tensors) of the same length, paired by position.
        confidence: the interval's coverage, in ``(0, 1)``.
        method: ``"t"``, ``"bootstrap"`` or ``"sign_flip"``.
        n_resamples, seed: for ``method="bootstrap"`` (and ``"sign_flip"`` past
            :data:`EXACT_MAX` pairs).

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
    check_choice("method", method, ("t", "bootstrap", "sign_flip"))
    d = va - vb
    n = d.numel()
    extra = {}
    if method == "sign_flip":
        r = sign_flip(d, confidence=confidence, n_resamples=n_resamples, seed=seed)
        mean, low, high = r["mean"], r["low"], r["high"]
        extra = {"p_value": r["p_value"], "exact": r["exact"]}
    elif method == "t":
        if n < 2:
            raise ValueError("method='t' needs at least 2 pairs")
        r = t_interval(d, confidence=confidence)
        mean, low, high = r["mean"], r["low"], r["high"]
    else:
        r = bootstrap_interval(d, confidence=confidence, n_resamples=n_resamples, seed=seed)
        mean, low, high = r["mean"], r["low"], r["high"]
    return {"differences": d.tolist(), "mean": mean, "low": low, "high": high,
            "min": d.min().item(), "max": d.max().item(), "n": n,
            "confidence": confidence, "method": method, **extra}


#: :func:`sign_flip` enumerates all ``2**n`` sign patterns up to this many values.
EXACT_MAX = 22


def _subset_means(d: torch.Tensor, n_resamples: int, seed: int) -> tuple[torch.Tensor, int, bool]:
    """Means of the non-empty subsets F of ``d`` (all of them, or random ones), and the count N.

    Flipping the signs of the differences in F changes the sum by ``-2 sum_F(d - theta)``,
    so a pattern's statistic is at least the observed one exactly when ``mean_F(d) <= theta``:
    the test at every ``theta`` reads off these means.
    """
    n = d.numel()
    if n <= EXACT_MAX:
        sums = torch.zeros(1, dtype=torch.float64)
        sizes = torch.zeros(1, dtype=torch.float64)
        for x in d.tolist():  # every subset: those without x, then those with it
            sums, sizes = torch.cat([sums, sums + x]), torch.cat([sizes, sizes + 1])
        return sums[1:] / sizes[1:], 2 ** n, True
    gen = torch.Generator().manual_seed(seed)
    masks = torch.rand(n_resamples, n, generator=gen, dtype=torch.float64) < 0.5
    sizes = masks.sum(1)
    keep = sizes > 0  # the empty subset is the observed pattern, counted once below
    means = (masks.double() @ d)[keep] / sizes[keep]
    return means, n_resamples + 1 + int((~keep).sum()), False


def sign_flip(
    values,
    *,
    confidence: float = 0.95,
    shift: float = 0.0,
    n_resamples: int = 200_000,
    seed: int = 0,
) -> dict:
    """The sign-flip test of per-seed paired differences, and the interval that inverts it.

    If nothing but chance separates two variants trained with the same seed, each
    difference ``d_i = a_i - b_i`` is as likely to be ``+x`` as ``-x``: its distribution is
    symmetric about 0. The test compares the observed sum of the differences with the sums
    under all ``2**n`` sign patterns (:data:`EXACT_MAX` values at most; past that,
    ``n_resamples`` random patterns with the observed one counted in, which keeps the level);
    its p-value is the fraction of patterns whose sum is at least as far out. Under that
    symmetry its level is exact for any ``n``: no normality, no large sample.

    The interval is the set of shifts ``theta`` that the test of ``d - theta`` does not reject
    at ``1 - confidence`` (two-sided, half on each side); exact when ``d - theta`` is
    symmetric about 0 for the true ``theta``. Its ends are subset means of the differences
    (Hartigan's subsample means), so it lies inside ``[min d, max d]``: a difference of
    accuracies never leaves ``[-1, 1]``.

    Args:
        values: the differences (a sequence or tensor), at least 2.
        confidence: the interval's coverage, in ``(0, 1)``.
        shift: the shift tested for ``p_value`` (default 0: "no difference").
        n_resamples, seed: random patterns past :data:`EXACT_MAX` values.

    Returns:
        ``{"mean", "low", "high", "p_value", "p_greater", "p_less", "n", "confidence",
        "exact"}``: ``p_greater`` is the one-sided p-value for a shift above ``shift``,
        ``p_less`` below it, ``p_value`` the two-sided one (twice the smaller, at most 1).

    Raises:
        ValueError: for fewer than 2 values, non-finite values, a confidence outside
            ``(0, 1)``, or a confidence too high for ``n`` values (the smallest p-value the
            test can give is ``2 / 2**n``: 6 values cannot make a 97 % interval).

    Example:
        >>> r = sign_flip([0.1, 0.3, 0.2, 0.4, 0.25, 0.15, 0.35, 0.05])
        >>> r["p_value"] == 2 / 2 ** 8, 0.05 <= r["low"] < r["high"] <= 0.4
        (True, True)
    """
    d = _values("values", values)
    confidence = _confidence(confidence)
    check_number("shift", shift)
    check_positive_int("n_resamples", n_resamples)
    check_nonneg_int("seed", seed)
    if d.numel() < 2:
        raise ValueError("a sign-flip test needs at least 2 values")
    means, total, exact = _subset_means(d, n_resamples, seed)
    # a pattern is at least as far above as the observed one when its subset mean <= shift
    p_greater = (1 + int((means <= shift).sum())) / total
    p_less = (1 + int((means >= shift).sum())) / total
    tail = (1 - confidence) / 2
    j = math.floor(tail * total + 1e-9)  # the j-th smallest (largest) subset mean is an end
    if j < 1:
        raise ValueError(
            f"{d.numel()} values cannot give a {confidence:.4g} sign-flip interval: the "
            f"smallest one-sided p-value is 1 / {total}; use more values or a lower confidence")
    low = torch.kthvalue(means, j).values.item()
    high = -torch.kthvalue(-means, j).values.item()
    return {"mean": d.mean().item(), "low": low, "high": high,
            "p_value": min(1.0, 2 * min(p_greater, p_less)), "p_greater": p_greater,
            "p_less": p_less, "n": d.numel(), "confidence": confidence, "exact": exact}


def verdict(interval: Mapping, test: str, margin: float | None = None) -> str:
    """The verdict on a claim from its interval: ``"holds"``, ``"refuted"`` or ``"not resolved"``.

    * ``test="greater"`` (``a - b > 0``): holds if the interval lies above 0, refuted if it
      lies below 0.
    * ``test="less"``: the mirror image.
    * ``test="equivalent"`` (``|a - b| < margin``, the margin fixed before the data): holds
      if the interval lies inside ``(-margin, margin)``, refuted if it lies wholly outside
      it. With a two-sided interval at ``1 - alpha`` this is two one-sided tests at
      ``alpha / 2`` each (conservative against TOST at ``alpha``).

    Anything else is "not resolved": the run cannot tell.
    """
    check_choice("test", test, ("greater", "less", "equivalent"))
    low, high = check_number("low", interval["low"]), check_number("high", interval["high"])
    if test == "equivalent":
        if margin is None or not check_number("margin", margin) > 0:
            raise ValueError(f"an equivalence needs a margin > 0, got {margin!r}")
        if -margin < low and high < margin:
            return "holds"
        return "refuted" if low >= margin or high <= -margin else "not resolved"
    if margin is not None:
        raise ValueError("a margin belongs to an equivalence only")
    above, below = low > 0, high < 0
    if test == "less":
        above, below = below, above
    return "holds" if above else "refuted" if below else "not resolved"


def bonferroni(confidence: float, k: int) -> float:
    """Per-claim confidence ``1 - (1 - confidence) / k`` that holds ``k`` claims at ``confidence``.

    If each of ``k`` intervals has coverage ``1 - (1 - confidence) / k``, the chance that
    *any* of them misses is at most ``1 - confidence`` (Bonferroni; no assumption about
    how the claims depend on each other). E.g. ``bonferroni(0.95, 10) == 0.995``.
    """
    confidence = _confidence(confidence)
    check_positive_int("k", k)
    return 1.0 - (1.0 - confidence) / k


def sign_test(differences) -> dict:
    """The two-sided sign test of paired differences: how many are above 0, below 0, tied.

    Under "no difference" each non-zero difference is as likely positive as negative,
    whatever the shape of the differences, so the count above 0 is binomial with ``n`` (the
    non-zero differences) and 1/2. The p-value is twice the chance of a count at least as
    far out as the larger of the two counts (capped at 1); ties (zeros) are dropped. Unlike
    :func:`sign_flip`, it assumes no symmetry, and it ignores the sizes of the differences.

    Returns:
        ``{"above": int, "below": int, "ties": int, "p_value": float}``.

    Example:
        >>> sign_test([0.2, 0.1, 0.3, -0.1, 0.0])["p_value"]
        0.625
    """
    d = _values("differences", differences)
    above, below = int((d > 0).sum()), int((d < 0).sum())
    n = above + below
    tail = sum(math.comb(n, j) for j in range(max(above, below), n + 1)) / 2**n
    return {"above": above, "below": below, "ties": d.numel() - n,
            "p_value": min(1.0, 2 * tail)}


def _average_ranks(v: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(v, stable=True)
    sorted_v = v[order]
    ranks = torch.empty_like(v)
    i, n = 0, v.numel()
    while i < n:
        j = i
        while j + 1 < n and sorted_v[j + 1] == sorted_v[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1  # ties: their average rank (1-based)
        i = j + 1
    return ranks


def spearman(a, b) -> float:
    """Spearman's rank correlation of two equal-length sequences: Pearson's on their ranks.

    Tied values get their average rank. A description (no test, no interval).

    Example:
        >>> round(spearman([1, 2, 3, 4], [10, 20, 20, 40]), 4)
        0.9487
    """
    x, y = _values("a", a), _values("b", b)
    if x.numel() != y.numel() or x.numel() < 2:
        raise ValueError(f"a and b need the same length, at least 2; got {x.numel()} and "
                         f"{y.numel()}")
    r = torch.stack([_average_ranks(x), _average_ranks(y)])
    return torch.corrcoef(r)[0, 1].item()


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


@functools.lru_cache(maxsize=4096)
def _t_quantile_cached(p: float, df: int) -> float:
    return t_quantile(p, df)


def stratified_interval(strata, *, confidence: float = 0.95) -> dict:
    """The mean over strata of each stratum's mean, with a Student t interval.

    For one difference measured under several conditions, e.g. the log ratio of two
    timings taken in the same round, in several rounds at each of several sequence
    lengths: each stratum (a length) gives the mean of its values (its rounds), and the
    estimate is the **unweighted mean of the stratum means**, the average effect over the
    conditions measured, whether or not the effect is the same in each (pooling all values
    into one mean would weight conditions by their counts and, where the effect differs,
    mix that difference into the noise). With the values independent within and across
    strata, its variance is ``sum_g s_g^2 / (G^2 n_g)``; the interval is
    ``mean +- t * sqrt(variance)`` with Student's t at the Welch-Satterthwaite degrees of
    freedom ``(sum_g v_g)^2 / sum_g (v_g^2 / (n_g - 1))``, ``v_g = s_g^2 / n_g``, rounded
    down (conservative). With one stratum this is :func:`t_interval`.

    Args:
        strata: a sequence of strata, each a sequence (or tensor) of at least 2 values.
        confidence: the interval's coverage, in ``(0, 1)``.

    Returns:
        ``{"mean", "low", "high", "df", "n", "strata", "confidence", "stratum_means"}``
        (``n`` the number of values, ``strata`` the number of strata).

    Raises:
        TypeError: for strata that are not sequences of numbers.
        ValueError: for no strata, a stratum of fewer than 2 values, non-finite values or a
            confidence outside ``(0, 1)``.

    Example:
        >>> r = stratified_interval([[0.1, 0.3, 0.2], [1.0, 1.2, 1.1]])
        >>> round(r["mean"], 3), r["df"], r["low"] < r["mean"] < r["high"]
        (0.65, 4, True)
    """
    if isinstance(strata, (str, bytes, Mapping, torch.Tensor)) or not isinstance(strata,
                                                                                  Sequence):
        raise TypeError(f"strata must be a sequence of sequences of numbers, got {strata!r}")
    if not strata:
        raise ValueError("strata must hold at least one stratum")
    confidence = _confidence(confidence)
    vs = [_values(f"strata[{i}]", s) for i, s in enumerate(strata)]
    if any(v.numel() < 2 for v in vs):
        raise ValueError("every stratum needs at least 2 values (a spread to estimate)")
    g = len(vs)
    means = [v.mean().item() for v in vs]
    var_of_mean = [v.var().item() / v.numel() for v in vs]  # v_g = s_g^2 / n_g
    variance = sum(var_of_mean) / g**2
    dof = sum(v.numel() - 1 for v in vs)
    denom = sum(w * w / (v.numel() - 1) for w, v in zip(var_of_mean, vs, strict=True))
    if denom > 0:
        dof = max(1, math.floor(sum(var_of_mean) ** 2 / denom + 1e-9))
    half = _t_quantile_cached((1 + confidence) / 2, dof) * math.sqrt(variance)
    mean = sum(means) / g
    return {"mean": mean, "low": mean - half, "high": mean + half, "df": dof,
            "n": sum(v.numel() for v in vs), "strata": g, "confidence": confidence,
            "stratum_means": means}
