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
