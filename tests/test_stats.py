"""Intervals: bootstrap over blocks, paired seed differences, Student t, Bonferroni."""

from __future__ import annotations

import math

import pytest
import torch

from tutorial_pkg.experiments.stats import (
    bonferroni,
    bootstrap_interval,
    paired_difference,
    paired_differences,
    t_interval,
    t_quantile,
)


@pytest.mark.parametrize(("p", "df", "expected"), [(0.975, 4, 2.776445), (0.975, 2, 4.302653),
                                                   (0.995, 10, 3.169273), (0.975, 1, 12.706205)])
def test_t_quantile_matches_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-5)


def test_t_quantile_tends_to_the_normal():
    assert t_quantile(0.975, 10000) == pytest.approx(1.959964, abs=1e-3)


def test_bootstrap_interval_is_deterministic_and_brackets_the_mean():
    v = torch.randn(50, generator=torch.Generator().manual_seed(0)).tolist()
    a, b = bootstrap_interval(v), bootstrap_interval(v)
    assert a == b
    assert a["low"] < a["mean"] < a["high"] and a["n"] == 50
    assert a["mean"] == pytest.approx(sum(v) / 50)
    wider = bootstrap_interval(v, confidence=0.99)
    assert wider["low"] <= a["low"] and wider["high"] >= a["high"]
    # ~ mean +- 1.96 sd / sqrt(n) for many values
    sd = torch.tensor(v).std().item()
    assert a["high"] - a["low"] == pytest.approx(2 * 1.96 * sd / math.sqrt(50), rel=0.25)


def test_bootstrap_interval_of_a_constant_and_of_one_value():
    assert bootstrap_interval([2.0] * 5)["low"] == bootstrap_interval([2.0] * 5)["high"] == 2.0
    one = bootstrap_interval([3.0])
    assert one["low"] == one["mean"] == one["high"] == 3.0


def test_paired_difference_t_interval():
    a, b = [0.61, 0.70, 0.55, 0.66, 0.58], [0.60, 0.62, 0.58, 0.60, 0.57]
    r = paired_difference(a, b)
    d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    half = 2.776445 * d.std().item() / math.sqrt(5)
    assert r["differences"] == pytest.approx(d.tolist())
    assert r["low"] == pytest.approx(d.mean().item() - half, abs=1e-6)
    assert r["high"] == pytest.approx(d.mean().item() + half, abs=1e-6)
    assert r["min"] == pytest.approx(d.min().item()) and r["n"] == 5 and r["method"] == "t"
    assert t_interval(d.tolist())["low"] == pytest.approx(r["low"])


def test_paired_difference_sees_a_consistent_shift_that_unpaired_spreads_hide():
    base = [0.2, 0.5, 0.8, 0.4, 0.6]  # large seed-to-seed spread
    shifted = [v + 0.05 for v in base]  # every seed better by 0.05
    r = paired_difference(shifted, base)
    assert r["low"] > 0  # paired: clearly positive
    assert min(shifted) < max(base)  # unpaired ranges overlap


def test_paired_difference_bootstrap_method():
    r = paired_difference([1.0, 2.0, 3.0], [0.0, 0.5, 1.0], method="bootstrap")
    assert r["method"] == "bootstrap" and r["low"] <= r["mean"] <= r["high"]


def test_bonferroni_and_the_family():
    assert bonferroni(0.95, 10) == pytest.approx(0.995)
    assert bonferroni(0.95, 1) == pytest.approx(0.95)
    pairs = {"x": ([1.0, 2.0, 3.0], [0.5, 1.0, 2.5]), "y": ([1.0, 1.5, 1.2], [1.1, 1.4, 1.0])}
    fam, each = paired_differences(pairs), paired_differences(pairs, family=False)
    for name in pairs:
        assert fam[name]["k"] == 2 and fam[name]["confidence"] == pytest.approx(0.975)
        assert fam[name]["low"] < each[name]["low"] and fam[name]["high"] > each[name]["high"]


@pytest.mark.parametrize(("call", "error"), [
    (lambda: bootstrap_interval([]), ValueError),
    (lambda: bootstrap_interval("abc"), TypeError),
    (lambda: bootstrap_interval([1.0, float("nan")]), ValueError),
    (lambda: bootstrap_interval([1.0], confidence=1.0), ValueError),
    (lambda: paired_difference([1.0, 2.0], [1.0]), ValueError),
    (lambda: paired_difference([1.0], [2.0]), ValueError),
    (lambda: paired_difference([1.0, 2.0], [1.0, 2.0], method="z"), ValueError),
    (lambda: t_quantile(0.3, 4), ValueError),
    (lambda: t_quantile(0.9, 0), ValueError),
    (lambda: bonferroni(0.95, 0), ValueError),
    (lambda: paired_differences({}), TypeError),
    (lambda: paired_differences({"a": [1.0]}), TypeError),
])
def test_errors(call, error):
    with pytest.raises(error):
        call()


def test_stratified_interval_is_the_mean_of_stratum_means_and_covers_at_its_level():
    from tutorial_pkg.experiments.stats import stratified_interval, t_interval

    one = stratified_interval([[0.1, 0.3, 0.2, 0.25]])
    ref = t_interval([0.1, 0.3, 0.2, 0.25])
    assert one["df"] == 3 and abs(one["low"] - ref["low"]) < 1e-12
    # unweighted: a long stratum does not outweigh a short one
    r = stratified_interval([[0.0, 0.2] * 10, [1.0, 1.2]])
    assert abs(r["mean"] - 0.6) < 1e-12 and r["strata"] == 2 and r["n"] == 22
    # coverage: four strata with different effects and spreads, 12 values each
    gen = torch.Generator().manual_seed(0)
    effects, sds = [0.0, 0.05, -0.02, 0.1], [0.02, 0.05, 0.03, 0.08]
    truth = sum(effects) / 4
    hits, trials = 0, 1000
    for _ in range(trials):
        strata = [(e + s * torch.randn(12, generator=gen, dtype=torch.float64)).tolist()
                  for e, s in zip(effects, sds, strict=True)]
        c = stratified_interval(strata, confidence=0.9)
        hits += c["low"] <= truth <= c["high"]
    assert 0.87 <= hits / trials <= 0.94  # 0.90 nominal (df rounded down: a little above)
    with pytest.raises(ValueError, match="at least 2"):
        stratified_interval([[0.1, 0.2], [0.3]])
    with pytest.raises(ValueError):
        stratified_interval([])
    with pytest.raises(TypeError):
        stratified_interval("ab")


def _brute_sign_flip(d, theta):
    """One-sided p-values of the sign-flip test by enumerating every sign pattern."""
    import itertools

    x = torch.tensor(d, dtype=torch.float64) - theta
    pats = torch.tensor(list(itertools.product([1.0, -1.0], repeat=len(d))), dtype=torch.float64)
    sums, obs = pats @ x, x.sum()
    above = (sums >= obs - 1e-12).double().mean().item()
    return above, (sums <= obs + 1e-12).double().mean().item()


def test_sign_flip_p_values_equal_the_enumeration_and_the_interval_inverts_the_test():
    from tutorial_pkg.experiments.stats import sign_flip

    d = [0.3, -0.1, 0.2, 0.5, 0.05, -0.02, 0.4, 0.25]
    r = sign_flip(d, confidence=0.9)
    assert (r["p_greater"], r["p_less"]) == pytest.approx(_brute_sign_flip(d, 0.0))
    assert r["p_value"] == pytest.approx(2 * min(r["p_greater"], r["p_less"]))
    tail = 0.05
    for end, side in ((r["low"], 0), (r["high"], 1)):  # inside: not rejected; outside: rejected
        inside = end + (1e-6 if side == 0 else -1e-6)
        outside = end - (1e-6 if side == 0 else -1e-6)
        assert _brute_sign_flip(d, inside)[side] > tail
        assert _brute_sign_flip(d, outside)[side] <= tail
    assert min(d) <= r["low"] < r["mean"] < r["high"] <= max(d)


def test_sign_flip_interval_stays_inside_the_range_of_bounded_differences():
    from tutorial_pkg.experiments.stats import sign_flip

    near_one = [1.0, 1.0, 0.98, 1.0, 0.99, 1.0, 1.0, 0.97, 1.0, 1.0]  # accuracies near 1
    r = sign_flip(near_one, confidence=0.95)
    assert 0.97 <= r["low"] <= r["high"] <= 1.0
    t = t_interval(near_one)
    assert t["high"] > 1.0  # the t interval leaves [0, 1] here


def test_sign_flip_covers_a_symmetric_skewless_bimodal_shift():
    from tutorial_pkg.experiments.stats import sign_flip

    g, hits, runs = torch.Generator().manual_seed(1), 0, 300
    for _ in range(runs):  # two modes, symmetric about 0.2
        x = (torch.rand(10, generator=g) < 0.5).double() * 0.6 - 0.3 + 0.2
        x = x + 0.05 * torch.randn(10, generator=g, dtype=torch.float64)
        r = sign_flip(x, confidence=0.9)
        hits += r["low"] <= 0.2 <= r["high"]
    assert 0.85 <= hits / runs <= 0.95


def test_sign_flip_refuses_a_confidence_its_values_cannot_reach_and_samples_past_exact_max():
    from tutorial_pkg.experiments.stats import EXACT_MAX, sign_flip

    with pytest.raises(ValueError, match="cannot give"):
        sign_flip([0.1, 0.2, 0.3, 0.4, 0.5], confidence=0.95)  # 2 / 32 > 0.05
    big = torch.linspace(0.1, 0.5, EXACT_MAX + 3)
    r = sign_flip(big, n_resamples=20_000)
    assert not r["exact"] and r["low"] > 0.1 and r["p_value"] < 1e-3
    assert r == sign_flip(big, n_resamples=20_000)  # fixed seed: the same answer


def test_paired_difference_sign_flip_method_and_verdicts():
    from tutorial_pkg.experiments.stats import verdict

    a = [0.9, 0.8, 0.95, 0.85, 0.9, 0.7, 0.88, 0.92]
    b = [0.5, 0.6, 0.55, 0.5, 0.45, 0.6, 0.52, 0.58]
    r = paired_difference(a, b, method="sign_flip")
    assert r["method"] == "sign_flip" and r["p_value"] == pytest.approx(2 / 2 ** 8)
    assert verdict(r, "greater") == "holds" and verdict(r, "less") == "refuted"
    assert verdict({"low": -0.02, "high": 0.03}, "equivalent", 0.05) == "holds"
    assert verdict({"low": -0.02, "high": 0.08}, "equivalent", 0.05) == "not resolved"
    assert verdict({"low": 0.06, "high": 0.08}, "equivalent", 0.05) == "refuted"
    assert verdict({"low": -0.1, "high": 0.2}, "greater") == "not resolved"
    with pytest.raises(ValueError, match="margin"):
        verdict({"low": 0.0, "high": 0.1}, "equivalent")


def test_sign_test_counts_signs_and_gives_the_binomial_tail():
    from tutorial_pkg.experiments.stats import sign_test

    r = sign_test([0.3, 0.2, 0.1, 0.4, -0.05, 0.0])
    assert (r["above"], r["below"], r["ties"]) == (4, 1, 1)
    assert r["p_value"] == pytest.approx(2 * (math.comb(5, 4) + 1) / 2**5)
    assert sign_test([1.0, -1.0])["p_value"] == 1.0  # capped at 1
    assert sign_test([0.1] * 20)["p_value"] == pytest.approx(2 / 2**20)
    # only the signs count: scaling one difference leaves the p-value unchanged
    big, small = sign_test([5.0, 0.2, 0.1, -0.1]), sign_test([0.3, 0.2, 0.1, -0.1])
    assert big["p_value"] == small["p_value"]


def test_spearman_is_pearson_on_average_ranks():
    from tutorial_pkg.experiments.stats import spearman

    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 8, 27, 64]) == pytest.approx(1.0)  # monotone, not linear
    ranks_b = [1.0, 2.5, 2.5, 4.0]  # 20 and 20 tie: average rank 2.5
    expected = torch.corrcoef(torch.tensor([[1.0, 2, 3, 4], ranks_b]))[0, 1].item()
    assert spearman([1, 2, 3, 4], [10, 20, 20, 40]) == pytest.approx(expected)
    with pytest.raises(ValueError):
        spearman([1, 2], [1, 2, 3])
