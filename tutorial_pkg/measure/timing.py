"""Timing a callable honestly: warm-up, many samples, the median and the spread.

* :func:`time_fn` -- on CUDA each run is bracketed by a pair of ``torch.cuda.Event``
  and the host synchronises before reading them; on CPU ``torch.utils.benchmark.Timer``
  measures. Either way the result, a :class:`Timing`, wraps a ``torch.utils.benchmark``
  ``Measurement``.
* :func:`resolve_device` -- the one reading of a ``device`` argument that the measuring
  library (:mod:`tutorial_pkg.measure.cases`) uses everywhere.

Example:
    >>> import torch
    >>> from tutorial_pkg.measure.timing import time_fn
    >>> x = torch.randn(256, 256)
    >>> t = time_fn(lambda: x @ x, device="cpu", max_time_s=0.05)
    >>> t.min_ms <= t.median_ms
    True
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.benchmark as torch_benchmark

from .._checks import check_callable, check_nonneg_int, check_positive_float, check_positive_int

__all__ = ["Timing", "resolve_device", "time_fn"]

# Bigger than the L2 cache of current GPUs (H100/H200: 50 MB), so zeroing it
# evicts whatever the previous run left in L2 (same size as Triton's do_bench).
_L2_FLUSH_BYTES = 256 * 1024 * 1024


# --------------------------------------------------------------------------- #
# The device
# --------------------------------------------------------------------------- #
def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The device a measurement is for, as every function of the measuring library reads it.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``torch.device``, or ``None`` for
            CUDA when available, else CPU.

    Returns:
        A ``torch.device`` of type ``cpu`` or ``cuda``; a CUDA device always has an index
        (a bare ``"cuda"`` gets the current one), so that memory statistics name one GPU.

    Raises:
        TypeError: If ``device`` is not a str, ``torch.device`` or ``None``.
        ValueError: If the string is not a device, the type is neither CPU nor CUDA, or the
            CUDA device is not there.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError):
            raise ValueError(
                f"device: unknown device string {device!r} (expected 'cpu', 'cuda' or 'cuda:N')"
            ) from None
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise TypeError(f"device must be a str, torch.device or None, got {type(device).__name__}")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: unsupported device type {dev.type!r} (only 'cpu' and 'cuda')")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(dev)!r} requested but CUDA is not available here")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device={str(dev)!r}: only {torch.cuda.device_count()} CUDA device(s) visible"
            )
        dev = torch.device("cuda", index)
    return dev


# --------------------------------------------------------------------------- #
# Timing
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Timing:
    """Repeated timings of one callable: a ``torch.utils.benchmark`` ``Measurement``.

    The median and the inter-quartile range (IQR = p75 - p25) are the numbers to
    report: unlike the mean and the standard deviation they are not dragged by
    the occasional run that an interrupt or another process slowed down. The
    statistics are the ``Measurement``'s, in milliseconds.

    Attributes:
        measurement: The ``Measurement``: ``raw_times`` in seconds per block of
            ``number_per_run`` calls (CPU ``Timer`` blocks; one call per sample on CUDA).
        device: Device the timing was done for (``"cpu"``, ``"cuda:0"``, ...).
        method: How it was measured (``"cuda-events"`` or ``"torch-timer"``).
    """

    measurement: torch_benchmark.Measurement
    device: str
    method: str

    @classmethod
    def from_times(
        cls, times_ms: Sequence[float], *, device: str, method: str, calls_per_run: int = 1
    ) -> Timing:
        """Wrap per-call samples (milliseconds) in a ``Measurement``.

        Args:
            times_ms: Samples, at least one; each the mean of ``calls_per_run`` calls.
            device: Device label.
            method: Measuring method label.
            calls_per_run: Calls averaged into each sample.

        Returns:
            The :class:`Timing`.

        Raises:
            ValueError: If ``times_ms`` is empty.
            TypeError: If ``calls_per_run`` is not an int.
        """
        if len(times_ms) == 0:
            raise ValueError("times_ms must hold at least one sample")
        check_positive_int("calls_per_run", calls_per_run)
        measurement = torch_benchmark.Measurement(
            number_per_run=calls_per_run,
            raw_times=[float(t) * 1e-3 * calls_per_run for t in times_ms],
            task_spec=torch_benchmark.utils.common.TaskSpec(stmt="fn()", setup="pass"),
        )
        return cls(measurement, device, method)

    @property
    def times_ms(self) -> list[float]:
        """Every per-call sample, in the order measured."""
        return [t * 1e3 for t in self.measurement.times]

    # The statistics, in milliseconds per call, read from the Measurement.
    median_ms = property(lambda self: self.measurement.median * 1e3, doc="Median.")
    iqr_ms = property(lambda self: self.measurement.iqr * 1e3, doc="``p75_ms - p25_ms``.")
    mean_ms = property(lambda self: self.measurement.mean * 1e3, doc="Mean (outliers drag it).")
    p25_ms = property(lambda self: self._pct(25), doc="25th percentile.")
    p75_ms = property(lambda self: self._pct(75), doc="75th percentile.")
    min_ms = property(lambda self: min(self.measurement.times) * 1e3, doc="Fastest sample.")
    max_ms = property(lambda self: max(self.measurement.times) * 1e3, doc="Slowest sample.")
    n_runs = property(lambda self: len(self.measurement.raw_times), doc="Number of samples.")
    calls_per_run = property(lambda self: self.measurement.number_per_run,
                             doc="Calls averaged into one sample.")

    def _pct(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.measurement.times), q)) * 1e3

    def __str__(self) -> str:
        return (
            f"{self.median_ms:.4f} ms median (IQR {self.iqr_ms:.4f} ms, "
            f"min {self.min_ms:.4f} ms, {self.n_runs} runs, {self.method} on {self.device})"
        )


def time_fn(
    fn: Callable[[], Any],
    *,
    device: str | torch.device | None = None,
    warmup: int = 3,
    min_runs: int = 10,
    max_time_s: float = 0.5,
    max_runs: int = 10_000,
    num_threads: int | None = None,
    flush_l2: bool = False,
) -> Timing:
    """Time a zero-argument callable honestly.

    **CUDA.** Kernel launches are asynchronous: the host returns long before the
    GPU is done, so host clocks measure the launch, not the work. Here, after
    ``warmup`` untimed calls and a synchronisation, one more synchronised call
    estimates the cost, which sets the number of runs (``max_time_s`` worth,
    clamped to ``[min_runs, max_runs]``). Each run is bracketed by a pair of
    ``torch.cuda.Event(enable_timing=True)`` recorded on the current stream;
    runs are queued back to back, the host synchronises once at the end and
    reads each pair's GPU-side elapsed time.

    **CPU.** ``torch.utils.benchmark.Timer.blocked_autorange`` does the work: it
    warms up while choosing a block size (calls per sample) large enough for the
    timer's own overhead to be negligible, then collects per-block samples for
    at least ``max_time_s`` (``Measurement.times``, one per-call mean per block).
    ``Timer`` would otherwise run with one thread; it is given the caller's
    ``torch.get_num_threads()`` (or ``num_threads``) and restores the setting
    afterwards, so the global thread count is never changed. If fewer than
    ``min_runs`` blocks come back, more blocks of the same size are added.

    ``fn``'s inputs must be built beforehand (only the call is timed), and ``fn``
    must run on ``device``: the device only chooses how to time, it moves nothing.

    Args:
        fn: The callable; called with no arguments, result discarded.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``torch.device``, or ``None``
            for CUDA when available else CPU. Pass it explicitly for CPU work on
            a CUDA machine.
        warmup: Untimed calls before measuring (compilation, caches, allocator).
        min_runs: Minimum number of samples.
        max_time_s: Measuring-time budget in seconds; a target, not a hard limit
            (``min_runs`` takes precedence and warm-up is not counted).
        max_runs: Maximum number of samples (CUDA only).
        num_threads: CPU threads for the measurement; ``None`` keeps the caller's.
        flush_l2: CUDA only: zero a 256 MB buffer before each run (outside the
            timed region) so that every run starts with a cold L2 cache.

    Returns:
        The :class:`Timing`, per call, in milliseconds.

    Raises:
        TypeError: If ``fn`` is not callable or an argument has the wrong type.
        ValueError: If an argument is out of range or the device is unknown or absent.
    """
    check_callable("fn", fn)
    dev = resolve_device(device)
    check_nonneg_int("warmup", warmup)
    check_positive_int("min_runs", min_runs)
    check_positive_float("max_time_s", max_time_s)
    check_positive_int("max_runs", max_runs)
    if max_runs < min_runs:
        raise ValueError(f"max_runs ({max_runs}) must be >= min_runs ({min_runs})")
    if num_threads is not None:
        check_positive_int("num_threads", num_threads)
    if dev.type == "cuda":
        return _time_cuda(fn, dev, warmup, min_runs, max_time_s, max_runs, flush_l2)
    return _time_cpu(fn, warmup, min_runs, max_time_s, num_threads)


def _time_cuda(
    fn: Callable[[], Any],
    dev: torch.device,
    warmup: int,
    min_runs: int,
    max_time_s: float,
    max_runs: int,
    flush_l2: bool,
) -> Timing:
    with torch.cuda.device(dev):
        # Drain work queued before us, so that it is not billed to fn.
        torch.cuda.synchronize()
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()

        # One synchronised, event-timed call to size the measurement.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = max(start.elapsed_time(end), 1e-3)
        n_runs = min(max(min_runs, math.ceil(max_time_s * 1e3 / estimate_ms)), max_runs)

        flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.int8, device=dev) if flush_l2 else None
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_runs)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_runs)]
        for s, e in zip(starts, ends, strict=True):
            if flush is not None:
                flush.zero_()  # queued before `s`, so not inside the timed region
            s.record()
            fn()
            e.record()
        # Events are only readable once the GPU has passed them.
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return Timing.from_times(times, device=str(dev), method="cuda-events")


def _time_cpu(
    fn: Callable[[], Any],
    warmup: int,
    min_runs: int,
    max_time_s: float,
    num_threads: int | None,
) -> Timing:
    threads = torch.get_num_threads() if num_threads is None else num_threads
    # Our own warm-up calls also give a rough cost per call, used below so that
    # a slow function still yields `min_runs` samples in one Timer pass.
    per_call_s = 0.0
    if warmup:
        t0 = time.perf_counter()
        for _ in range(warmup):
            fn()
        per_call_s = (time.perf_counter() - t0) / warmup
    timer = torch_benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    min_run_time = max(max_time_s, 1.1 * min_runs * per_call_s)
    measurement = timer.blocked_autorange(min_run_time=min_run_time)
    raw = list(measurement.raw_times)
    while len(raw) < min_runs:
        # Same block size; Timer.timeit adds a couple of untimed calls first.
        raw.extend(timer.timeit(number=measurement.number_per_run).raw_times)
    if len(raw) > len(measurement.raw_times):
        measurement = dataclasses.replace(measurement, raw_times=raw)
    return Timing(measurement, "cpu", "torch-timer")

