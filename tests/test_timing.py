"""Tests of tutorial_pkg.measure.timing: :func:`~tutorial_pkg.measure.timing.time_fn`, the
:class:`~tutorial_pkg.measure.timing.Timing` it returns and
:func:`~tutorial_pkg.measure.timing.resolve_device`. They check that the timer measures what it
claims (a 2 ms sleep reads ~2 ms, the statistics agree with the samples, the caller's thread
setting is kept, bad arguments are refused by name), never how fast anything is; CPU only but
for one test that needs a CUDA GPU.
"""

from __future__ import annotations

import time

import pytest
import torch

from tutorial_pkg import measure as bm

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    pytest.mark.usefixtures("one_thread"),
]

FAST = {"device": "cpu", "warmup": 1, "min_runs": 5, "max_time_s": 0.02}


def test_timing_fields_are_consistent():
    x = torch.randn(32, 32)
    t = bm.time_fn(lambda: x @ x, **FAST)
    assert t.n_runs >= FAST["min_runs"]
    assert len(t.times_ms) == t.n_runs
    assert 0 < t.min_ms <= t.p25_ms <= t.median_ms <= t.p75_ms <= t.max_ms
    assert t.iqr_ms == pytest.approx(t.p75_ms - t.p25_ms)
    assert t.min_ms <= t.mean_ms <= t.max_ms
    assert t.device == "cpu" and t.method == "torch-timer" and t.calls_per_run >= 1


def test_sleep_of_2ms_measures_about_2ms():
    t = bm.time_fn(lambda: time.sleep(0.002), **FAST)
    assert 1.5 <= t.median_ms <= 50


def test_slow_function_still_gets_min_runs_quickly():
    start = time.perf_counter()
    t = bm.time_fn(lambda: time.sleep(0.01), device="cpu", warmup=1, min_runs=4,
                   max_time_s=0.001)
    assert t.n_runs >= 4
    assert time.perf_counter() - start < 2.0


def test_time_fn_respects_callers_thread_setting():
    before = torch.get_num_threads()
    seen = []
    try:
        torch.set_num_threads(1)
        bm.time_fn(lambda: seen.append(torch.get_num_threads()), **FAST)
        assert set(seen) == {1}
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_timing_from_times_statistics():
    t = bm.Timing.from_times([4.0, 1.0, 3.0, 2.0, 100.0], device="cpu", method="x")
    assert t.median_ms == pytest.approx(3.0) and t.min_ms == pytest.approx(1.0)
    assert t.max_ms == pytest.approx(100.0) and t.p25_ms == pytest.approx(2.0)
    assert t.p75_ms == pytest.approx(4.0) and t.iqr_ms == pytest.approx(2.0)
    with pytest.raises(ValueError):
        bm.Timing.from_times([], device="cpu", method="x")


def test_timing_wraps_a_torch_measurement():
    import torch.utils.benchmark as tb

    t = bm.Timing.from_times([2.0, 4.0], device="cpu", method="x", calls_per_run=10)
    assert isinstance(t.measurement, tb.Measurement)
    assert t.measurement.number_per_run == 10 and t.calls_per_run == 10
    assert t.measurement.raw_times == pytest.approx([0.02, 0.04])  # seconds per block
    assert t.times_ms == pytest.approx([2.0, 4.0]) and t.n_runs == 2
    x = torch.randn(16, 16)
    timed = bm.time_fn(lambda: x @ x, **FAST)
    assert isinstance(timed.measurement, tb.Measurement)
    assert timed.median_ms == pytest.approx(timed.measurement.median * 1e3)


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"min_runs": 0}, ValueError, "min_runs"),
        ({"min_runs": -3}, ValueError, "min_runs"),
        ({"warmup": -1}, ValueError, "warmup"),
        ({"max_time_s": 0}, ValueError, "max_time_s"),
        ({"min_runs": 2.5}, TypeError, "min_runs"),
        ({"device": "tpu9"}, ValueError, "device"),
        ({"device": "not a device"}, ValueError, "device"),
        ({"device": 3}, TypeError, "device"),
    ],
)
def test_time_fn_rejects_bad_arguments(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        bm.time_fn(lambda: None, **kwargs)


def test_non_callable_fn_is_rejected():
    with pytest.raises(TypeError, match="fn"):
        bm.time_fn(42)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_requested_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="device"):
        bm.time_fn(lambda: None, device="cuda")


def test_resolve_device_names_one_device():
    assert bm.resolve_device("cpu") == torch.device("cpu")
    assert bm.resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert bm.resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device"):
        bm.resolve_device("meta")  # shapes without memory or time: nothing to measure
    with pytest.raises(TypeError, match="device"):
        bm.resolve_device(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_events_time_a_matmul():
    x = torch.randn(1024, 1024, device="cuda")
    t = bm.time_fn(lambda: x @ x, device="cuda", warmup=2, min_runs=5, max_time_s=0.05)
    assert t.method == "cuda-events" and t.n_runs >= 5 and t.min_ms > 0
