"""The measuring library of chapter 5: time and memory, measured honestly, and recorded.

One ``time.time()`` pair around one call (the articles' method) times one-off costs
(lazy initialisation, compiling, cold caches), on a GPU only the *launch* of the
work, and one sample of a noisy quantity. This module does it properly:

* :func:`time_fn` -- warm-up, many samples, the median and the inter-quartile
  range. On CUDA each run is bracketed by a pair of ``torch.cuda.Event`` and the
  host synchronises before reading them; on CPU ``torch.utils.benchmark.Timer``
  measures. Either way the result, a :class:`Timing`, wraps a
  ``torch.utils.benchmark`` ``Measurement``.
* :func:`peak_memory` -- the extra bytes a call needs at its peak.
* :func:`compare` -- several cases measured side by side, in interleaved rounds,
  each related to a named reference (:class:`Case` adds parameters, the bytes a
  case holds between calls, what to free once it is measured, and its expected
  :class:`Footprint`: a case that would not fit in the device's free memory is
  skipped and recorded with the reason, :func:`available_memory`).
* :class:`BenchRecord`, :func:`save_results`, :func:`load_results`,
  :func:`hardware_info` -- results files that say where they were measured;
  :func:`format_table` and the generic :func:`text_table` print them.

The suites that use it (attention per encoding and backend, RoPE, a training step
of the tiny LM), their command line and the articles' own code kept as a baseline
live in the repository's ``benchmarks/`` folder, not in the package.

Example:
    >>> import torch
    >>> from tutorial_pkg.benchmark import time_fn
    >>> x = torch.randn(256, 256)
    >>> t = time_fn(lambda: x @ x, device="cpu", max_time_s=0.05)
    >>> t.min_ms <= t.median_ms
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils.benchmark as torch_benchmark

from ._checks import check_nonneg_int, check_positive_float, check_positive_int

__all__ = [
    "ATTENTION_LIMIT",
    "ROPE_LIMIT",
    "SCHEMA_VERSION",
    "MEMORY_HEADROOM",
    "MEMORY_RESERVE_BYTES",
    "BenchRecord",
    "Case",
    "Footprint",
    "MemoryStat",
    "Results",
    "Timing",
    "available_memory",
    "compare",
    "fit_problem",
    "format_table",
    "hardware_info",
    "keep_freed_memory",
    "load_results",
    "peak_memory",
    "profiled",
    "save_results",
    "text_table",
    "time_fn",
]

#: Version of the JSON layout written by :func:`save_results`.
SCHEMA_VERSION = 1
#: Name of the attention groups' reference case in the book's results files, which is
#: ``scaled_dot_product_attention(is_causal=True)`` with no encoding.
ATTENTION_LIMIT = "limit: sdpa causal"
#: Name of the RoPE groups' reference case, a copy of q and k (one read, one write).
ROPE_LIMIT = "limit: clone q,k"

#: Headroom of the memory check (:func:`fit_problem`): a case runs only if its expected
#: footprint times ``1 + MEMORY_HEADROOM``, plus :data:`MEMORY_RESERVE_BYTES`, fits in the
#: memory available. The 20 % cover what a footprint computed from shapes leaves out: the
#: caching allocator's rounding (blocks of 2 MiB and up) and fragmentation, kernels' own
#: workspaces (cuBLAS, the attention kernels' log-sum-exp and accumulators).
MEMORY_HEADROOM = 0.20
#: The fixed part of the headroom (for CUDA context growth, cuBLAS and cuDNN handles,
#: compiled kernels).
MEMORY_RESERVE_BYTES = 256 * 2**20

# Bigger than the L2 cache of current GPUs (H100/H200: 50 MB), so zeroing it
# evicts whatever the previous run left in L2 (same size as Triton's do_bench).
_L2_FLUSH_BYTES = 256 * 1024 * 1024


# --------------------------------------------------------------------------- #
# Argument checking
# --------------------------------------------------------------------------- #
def _check_callable(name: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"{name} must be callable (no arguments), got {type(fn).__name__}")


def _resolve_device(device: str | torch.device | None) -> torch.device:
    """Turn ``None``/``"cpu"``/``"cuda"``/``"cuda:1"``/``torch.device`` into a device.

    ``None`` means CUDA when available, else CPU. A bare ``"cuda"`` gets the
    current device's index so that the memory statistics name one GPU.
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
    _check_callable("fn", fn)
    dev = _resolve_device(device)
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


# --------------------------------------------------------------------------- #
# Memory
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class MemoryStat:
    """Memory a call needs beyond what was allocated before it, in bytes.

    Attributes:
        peak_bytes: Highest extra allocation reached during the call (>= 0).
        net_bytes: Extra allocation still alive when the call returned
            (typically its outputs; negative if the call freed older memory).
        device: Device measured.
        method: ``"cuda-max-memory-allocated"`` or ``"cpu-profiler-events"``.
    """

    peak_bytes: int
    net_bytes: int
    device: str
    method: str

    @property
    def peak_mib(self) -> float:
        """``peak_bytes`` in MiB (2**20 bytes)."""
        return self.peak_bytes / 2**20


@contextlib.contextmanager
def _quiet_stderr_fd() -> Iterator[None]:
    """Silence file descriptor 2 briefly.

    The profiler's C++ side prints ``profiler_start``/``profiler_stop`` lines
    straight to fd 2 (no setting turns them off); in a notebook they would land
    in the cell output. Used only around the profiler's start and stop calls.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2: nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def profiled(**kwargs: Any) -> Iterator[torch.profiler.profile]:
    """``torch.profiler.profile(**kwargs)`` as a context, minus its stderr chatter.

    The profiler's C++ side prints ``profiler_start``/``profiler_stop`` lines with
    timestamps straight to file descriptor 2 when it starts and stops; in a
    notebook they become cell output that changes on every run. They are
    silenced; everything else is the plain profiler.

    Example:
        >>> with profiled() as prof:
        ...     _ = torch.ones(3).sum()
        >>> any(e.key == "aten::sum" for e in prof.key_averages())
        True
    """
    prof = torch.profiler.profile(**kwargs)
    with _quiet_stderr_fd():
        prof.start()
    try:
        yield prof
    finally:
        with _quiet_stderr_fd():
            prof.stop()


def _cpu_memory_events(prof: torch.profiler.profile) -> tuple[list[tuple[int, int]], str]:
    """(timestamp, signed bytes) of every CPU allocation/free the profiler saw."""
    try:
        raw = prof.profiler.kineto_results.events()
        events = [
            (e.start_ns(), e.nbytes())
            for e in raw
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        ]
        return events, "cpu-profiler-events"
    except AttributeError:
        # Fallback for a torch whose raw event API moved: the public events
        # fold allocations into the ops that made them (one net figure per op,
        # children included), so alloc/free pairs inside one op are invisible
        # and the peak found is only a lower bound.
        events = []
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CPU:
                continue
            nbytes = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
            if nbytes:
                events.append((e.time_range.start, nbytes))
        return events, "cpu-profiler-ops-lower-bound"


def peak_memory(
    fn: Callable[[], Any],
    *,
    device: str | torch.device | None = None,
    warmup: int = 1,
) -> MemoryStat:
    """Measure the extra memory ``fn()`` needs at its peak.

    **CUDA.** ``torch.cuda.reset_peak_memory_stats`` then
    ``max_memory_allocated`` after the call, minus the bytes allocated before
    it: the peak of tensors alive at once, as seen by PyTorch's caching
    allocator (not the cached-but-free blocks, not the CUDA context).

    **CPU.** There is no CPU peak counter, so the call runs under
    ``torch.profiler.profile(profile_memory=True)``, which records every
    allocation (+bytes) and free (-bytes) of torch's CPU allocator with a
    timestamp, including those made and released inside one operator; the
    running sum in time order is the extra memory alive at each instant and its
    maximum is the peak. It is the peak extra bytes allocated by torch's CPU
    allocator during the call: it does not count non-torch memory (NumPy
    arrays, Python objects, oneDNN scratch space), and allocations made on
    threads the profiler does not follow are missed.

    The result of ``fn`` is kept alive until the measurement ends, so outputs
    count (in ``net_bytes`` too). ``warmup`` untimed calls come first so that
    one-off allocations (e.g. a cuBLAS workspace) are not billed to the call.

    Args:
        fn: The callable; called with no arguments.
        device: As in :func:`time_fn`.
        warmup: Calls before measuring.

    Returns:
        The :class:`MemoryStat`.

    Raises:
        TypeError: If ``fn`` is not callable or ``warmup`` is not an int.
        ValueError: If ``warmup`` < 0 or the device is unknown or absent.
    """
    _check_callable("fn", fn)
    dev = _resolve_device(device)
    check_nonneg_int("warmup", warmup)
    for _ in range(warmup):
        fn()
    if dev.type == "cuda":
        return _peak_memory_cuda(fn, dev)
    return _peak_memory_cpu(fn)


def _collect_garbage() -> None:
    # Cyclic garbage freed by a GC pass *during* the call would show up as
    # negative allocations and hide part of the peak; collect it beforehand.
    import gc

    gc.collect()


def _peak_memory_cuda(fn: Callable[[], Any], dev: torch.device) -> MemoryStat:
    _collect_garbage()
    torch.cuda.synchronize(dev)
    baseline = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    out = fn()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - baseline
    net = torch.cuda.memory_allocated(dev) - baseline
    del out
    return MemoryStat(
        peak_bytes=max(int(peak), 0),
        net_bytes=int(net),
        device=str(dev),
        method="cuda-max-memory-allocated",
    )


def _peak_memory_cpu(fn: Callable[[], Any]) -> MemoryStat:
    _collect_garbage()
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=False,
        with_stack=False,
    )
    with _quiet_stderr_fd():
        prof.start()
    try:
        out = fn()
    finally:
        with _quiet_stderr_fd():
            prof.stop()
    events, method = _cpu_memory_events(prof)
    running = peak = 0
    # sorted() is stable: same-timestamp events keep the recorded order.
    for _, nbytes in sorted(events, key=lambda ev: ev[0]):
        running += nbytes
        peak = max(peak, running)
    del out
    return MemoryStat(peak_bytes=int(peak), net_bytes=int(running), device="cpu", method=method)


# --------------------------------------------------------------------------- #
# Expected footprint, and the memory check
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Footprint:
    """The device memory a case is expected to need, in bytes, computed from its shapes.

    Three phases, each counted on top of what is allocated when the case starts (the
    group's inputs, which exist before any case runs and are listed apart):

    * ``held``: what the case keeps between calls (a cached bias table, a buffer);
    * ``call``: the extra at the peak of one call beyond ``held`` (the output, the
      temporaries, the attention weights a naive kernel materialises, the tensors
      autograd saves and the gradients, for a training case);
    * ``build``: the peak of the first call, which also builds what is held
      (building a table may need more than keeping it: the float32 intermediates
      of a half-precision table).

    Attributes:
        held: Bytes kept between calls.
        call: Extra bytes at the peak of a call, on top of ``held``.
        build: Peak bytes of the first call (building included), ``held`` included.
        inputs: Bytes of the group's inputs (allocated already; not in :attr:`need`).
        parts: The named terms the numbers are made of (for the reader and the record).
    """

    held: int = 0
    call: int = 0
    build: int = 0
    inputs: int = 0
    parts: Mapping[str, int] = field(default_factory=dict)

    @property
    def need(self) -> int:
        """Bytes the case needs beyond what exists when it starts (the larger phase)."""
        return max(self.held + self.call, self.build)

    @property
    def total(self) -> int:
        """:attr:`need` plus the group's inputs."""
        return self.need + self.inputs


def available_memory(
    device: str | torch.device | None = None, limit: int | None = None
) -> int | None:
    """Bytes a case may still allocate on ``device``, or ``None`` if nothing says.

    **CUDA.** The driver's free memory (``torch.cuda.mem_get_info``) plus the blocks
    PyTorch's caching allocator holds but does not use (``memory_reserved -
    memory_allocated``: it hands them out again first), capped by the per-process
    memory fraction (``torch.cuda.set_per_process_memory_fraction``) and by
    ``limit``, both of which count from what is allocated now.

    **CPU.** ``limit`` as given (a configured budget), else ``None``: no check.

    Args:
        device: As in :func:`time_fn`.
        limit: Bytes the process may use on the device in all (e.g. a smaller GPU's
            memory, rehearsed on a larger one); ``None``: no limit of our own.

    Returns:
        The bytes, or ``None`` (CPU without a limit).
    """
    dev = _resolve_device(device)
    if dev.type != "cuda":
        return None if limit is None else int(limit)
    free, total = torch.cuda.mem_get_info(dev)
    allocated = torch.cuda.memory_allocated(dev)
    available = free + max(torch.cuda.memory_reserved(dev) - allocated, 0)
    fraction = torch.cuda.get_per_process_memory_fraction(dev)
    if fraction < 1.0:
        available = min(available, int(fraction * total) - allocated)
    if limit is not None:
        available = min(available, int(limit) - allocated)
    return max(int(available), 0)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def fit_problem(
    footprint: Footprint,
    available: int | None,
    *,
    headroom: float = MEMORY_HEADROOM,
    reserve: int = MEMORY_RESERVE_BYTES,
) -> str | None:
    """Why ``footprint`` would not fit in ``available`` bytes, or ``None`` if it fits.

    It fits when ``footprint.need * (1 + headroom) + reserve <= available``
    (see :data:`MEMORY_HEADROOM`); ``available=None`` (no check) always fits.

    Returns:
        ``None``, or a one-line reason with the numbers (the record's ``error``).
    """
    if available is None:
        return None
    wanted = footprint.need * (1 + headroom) + reserve
    if wanted <= available:
        return None
    return (f"needs about {_gib(footprint.need)} (held {_gib(footprint.held)}, per call "
            f"{_gib(footprint.call)}, first call {_gib(footprint.build)}), "
            f"{_gib(wanted)} with headroom; {_gib(available)} available")


# --------------------------------------------------------------------------- #
# Hardware
# --------------------------------------------------------------------------- #
def keep_freed_memory(threshold_bytes: int = 32 * 2**20) -> bool:
    """Ask glibc's ``malloc`` to keep freed blocks for reuse instead of returning them.

    By default glibc serves a large request (over a threshold that adapts between
    128 KiB and 32 MiB) with a fresh ``mmap`` and gives it back to the OS when freed,
    so a function that allocates a large output pays a page fault at the first touch
    of each 4 KiB page, in every call. This sets ``M_MMAP_THRESHOLD`` to
    ``threshold_bytes`` and ``M_TRIM_THRESHOLD`` to 2 GiB with ``mallopt``, as the
    environment variables ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``
    would at start-up: freed blocks up to that size stay in the process and are
    reused. It changes the whole process, for the rest of its life.

    Args:
        threshold_bytes: Largest block kept (glibc caps it at 32 MiB on 64-bit).

    Returns:
        True if glibc accepted both settings, False elsewhere (other C libraries).

    Raises:
        TypeError: If ``threshold_bytes`` is not an int.
        ValueError: If it is not in ``1..32 MiB``.
    """
    check_positive_int("threshold_bytes", threshold_bytes)
    if threshold_bytes > 32 * 2**20:
        raise ValueError(f"threshold_bytes must be <= 32 MiB (glibc's cap), got {threshold_bytes}")
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, threshold_bytes)) and bool(
        mallopt(m_trim_threshold, 2**31 - 1)
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):  # not on every OS
        return None


def hardware_info(device: str | torch.device | None = None) -> dict[str, Any]:
    """Describe the machine, so that a results file says where it was measured.

    Only descriptive, non-identifying facts: no host name, user or path.

    Args:
        device: The device the benchmark runs on (as in :func:`time_fn`).

    Returns:
        A JSON-serialisable dict with ``device``, ``device_name``, ``cpu``,
        ``num_threads`` (torch intra-op threads), ``cpu_count``, ``gpu_count``,
        ``gpu_memory_gib``, ``compute_capability`` (e.g. ``"7.5"``, CUDA only),
        ``torch``, ``cuda`` (CUDA version torch was built with, or ``None``), ``cudnn``,
        ``python``, ``os``, ``machine``,
        ``loadavg`` (1, 5 and 15-minute load averages when the OS reports them:
        on a shared machine they say how busy it was) and ``date`` (ISO 8601, UTC).
    """
    dev = _resolve_device(device)
    cpu = _cpu_model()
    cuda_ok = torch.cuda.is_available()
    info: dict[str, Any] = {
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu,
        "cpu": cpu,
        "num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "gpu_count": torch.cuda.device_count() if cuda_ok else 0,
        "gpu_memory_gib": (
            round(torch.cuda.get_device_properties(dev).total_memory / 2**30, 1)
            if dev.type == "cuda"
            else None
        ),
        "compute_capability": (
            ".".join(map(str, torch.cuda.get_device_capability(dev)))
            if dev.type == "cuda"
            else None
        ),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda_ok else None,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}".strip(),
        "machine": platform.machine(),
        "loadavg": _loadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return info


# --------------------------------------------------------------------------- #
# Records, files, tables
# --------------------------------------------------------------------------- #
def _jsonable(value: Any) -> Any:
    """Params may hold dtypes or devices; store them as short strings."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.generic,)):
        return value.item()
    return value


@dataclass
class BenchRecord:
    """One measured case, as stored in a results file.

    Attributes:
        group: Group of cases measured side by side (e.g. ``"causal-attention L=1024 fwd"``).
        case: Case name within the group (e.g. ``"sdpa"``, ``"rope/flash"``).
        params: What was measured, e.g. ``encoding``, ``backend``, ``seq_len``,
            ``batch``, ``heads``, ``head_dim``, ``dtype``, ``pass`` (``"fwd"`` or
            ``"fwd+bwd"``).
        device: Device measured.
        reference: Name of the group's reference case.
        ratio: Time relative to the reference (> 1: slower). With one round,
            ``median_ms / reference median_ms``; with several (interleaved)
            rounds, the median over rounds of that ratio within each round
            (paired: a busy spell of the machine slows both sides of a pair).
        round_ratios: The per-round ratios (empty with one round).
        median_ms: See :class:`Timing`; ``None`` if the case failed.
        p25_ms: See :class:`Timing`.
        p75_ms: See :class:`Timing`.
        iqr_ms: See :class:`Timing`.
        mean_ms: See :class:`Timing`.
        min_ms: See :class:`Timing`.
        n_runs: See :class:`Timing`.
        calls_per_run: See :class:`Timing`.
        timing_method: See :class:`Timing`.
        times_ms: Raw samples.
        peak_bytes: See :class:`MemoryStat`; ``None`` if not measured.
        net_bytes: See :class:`MemoryStat`.
        memory_method: See :class:`MemoryStat`.
        peak_ratio: ``peak_bytes / reference peak_bytes``.
        held_bytes: Memory the case keeps alive *between* calls (caches such as a
            cached bias table), which :attr:`peak_bytes` cannot see; ``None`` if
            the case does not say (see :class:`Case`).
        first_call_ms: Wall time of the case's very first call, before any
            warm-up: one-off costs such as compiling (FlexAttention, fused RoPE)
            or building a cache. Reported apart, never mixed into the median.
        error: ``"ExceptionType: message"`` if the case raised, ``"skipped: reason"``
            if it was not run (it would not fit in memory, or the device cannot run
            it), else ``None``. A record with an error has no timing (``median_ms``,
            ``ratio`` are ``None``) unless only its memory measurement failed; test
            :attr:`ok` before reading numbers.
        skipped: True if the case was not run at all (the reason is in ``error``).
        footprint_bytes: The case's expected :attr:`Footprint.need` (bytes beyond the
            group's inputs), when the case declared one.
    """

    group: str
    case: str
    params: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    reference: str | None = None
    ratio: float | None = None
    round_ratios: list[float] = field(default_factory=list)
    median_ms: float | None = None
    p25_ms: float | None = None
    p75_ms: float | None = None
    iqr_ms: float | None = None
    mean_ms: float | None = None
    min_ms: float | None = None
    n_runs: int = 0
    calls_per_run: int = 1
    timing_method: str | None = None
    times_ms: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    net_bytes: int | None = None
    memory_method: str | None = None
    peak_ratio: float | None = None
    held_bytes: int | None = None
    first_call_ms: float | None = None
    error: str | None = None
    skipped: bool = False
    footprint_bytes: int | None = None

    @property
    def ok(self) -> bool:
        """True if the case ran and was timed without error (its numbers can be read)."""
        return self.error is None and self.median_ms is not None

    @classmethod
    def from_measurements(
        cls,
        *,
        group: str,
        case: str,
        params: Mapping[str, Any] | None,
        device: str,
        timing: Timing | None,
        memory: MemoryStat | None = None,
        reference: str | None = None,
        error: str | None = None,
    ) -> BenchRecord:
        """Build a record from a :class:`Timing` and an optional :class:`MemoryStat`."""
        rec = cls(group=group, case=case, params=dict(params or {}), device=device,
                  reference=reference, error=error)
        if timing is not None:
            rec.median_ms, rec.p25_ms, rec.p75_ms = timing.median_ms, timing.p25_ms, timing.p75_ms
            rec.iqr_ms, rec.mean_ms, rec.min_ms = timing.iqr_ms, timing.mean_ms, timing.min_ms
            rec.n_runs, rec.calls_per_run = timing.n_runs, timing.calls_per_run
            rec.timing_method, rec.times_ms = timing.method, list(timing.times_ms)
        if memory is not None:
            rec.peak_bytes, rec.net_bytes = memory.peak_bytes, memory.net_bytes
            rec.memory_method = memory.method
        return rec

    @property
    def peak_mib(self) -> float | None:
        """``peak_bytes`` in MiB, or ``None``."""
        return None if self.peak_bytes is None else self.peak_bytes / 2**20

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (dtypes and devices in ``params`` become strings)."""
        return _jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchRecord:
        """Inverse of :meth:`to_dict`; unknown keys (newer files) are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class Results(NamedTuple):
    """Contents of a results file: ``hardware, records = load_results(path)``."""

    hardware: dict[str, Any]
    records: list[BenchRecord]


def save_results(
    records: Iterable[BenchRecord], path: str | os.PathLike[str], hardware: Mapping[str, Any]
) -> Path:
    """Write ``{"schema_version", "hardware", "records"}`` as JSON.

    Args:
        records: The records.
        path: Output file (parent folders are created).
        hardware: Usually :func:`hardware_info`.

    Returns:
        The path written.
    """
    path = Path(path)
    payload = {
        "schema_version": SCHEMA_VERSION,
        "hardware": _jsonable(dict(hardware)),
        "records": [r.to_dict() for r in records],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: a NaN would make the file invalid JSON for other tools.
    path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def load_results(path: str | os.PathLike[str]) -> Results:
    """Read a file written by :func:`save_results`.

    Args:
        path: The JSON file.

    Returns:
        ``Results(hardware, records)``.

    Raises:
        ValueError: If the file does not have the expected layout.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or "records" not in data or "hardware" not in data:
        raise ValueError(f"{path}: not a benchmark results file (needs 'hardware' and 'records')")
    return Results(dict(data["hardware"]), [BenchRecord.from_dict(r) for r in data["records"]])


def _fmt_ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.2f}" if v >= 100 else f"{v:.3f}" if v >= 1 else f"{v:.4f}"


def _fmt_params(params: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={_jsonable(v)}" for k, v in params.items())


def text_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1
) -> list[str]:
    """Lines of a fixed-width text table: a header, a rule, the rows.

    The one formatter behind :func:`format_table` and
    :func:`tutorial_pkg.experiments.format_table`: columns as wide as their widest
    cell, the first ``left`` columns (text) left-aligned, the others (numbers)
    right-aligned, two spaces between columns, no trailing spaces.

    Args:
        header: Column titles.
        rows: Cells as strings, one sequence per row, as many as ``header``.
        left: How many leading columns are left-aligned.

    Returns:
        The lines, without newlines.

    Raises:
        ValueError: If a row has another number of cells than ``header``.
    """
    check_nonneg_int("left", left)
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"rows must have {len(header)} cells like header, got {len(row)}")
    widths = [max(len(str(h)), *(len(str(row[i])) for row in rows)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if i < left else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(row) for row in rows]


def format_table(
    records: Sequence[BenchRecord], *, columns: Sequence[str] | None = None
) -> str:
    """Render records as a fixed-width text table (one row per record).

    Parameters shared by every record are printed once above the table; each row
    shows the rest. ``ratio`` is the median over the group's reference median
    (the reference row shows ``1.00 ref``). ``held MiB`` and ``1st call ms``
    appear when some record has them. A failed or skipped record prints its error
    (the reason) below it.

    Args:
        records: The records, in display order.
        columns: Titles of the columns to keep (``"case"``, ``"median ms"``,
            ``"ratio"``, ...), to fit a narrow page; default all of them.

    Returns:
        The table (no trailing newline); ``"(no records)"`` if empty.

    Raises:
        ValueError: If ``columns`` names a column the table does not have.
    """
    if not records:
        return "(no records)"
    keys = list(dict.fromkeys(k for r in records for k in r.params))
    common = {
        k: records[0].params[k]
        for k in keys
        if all(k in r.params and r.params[k] == records[0].params[k] for r in records)
    }
    cols: list[tuple[str, Callable[[BenchRecord], str]]] = [
        ("group", lambda r: r.group),
        ("case", lambda r: r.case),
        ("params", lambda r: _fmt_params({k: v for k, v in r.params.items() if k not in common})),
        ("median ms", lambda r: "skipped" if r.skipped else "error" if r.error
         else _fmt_ms(r.median_ms)),
        ("IQR ms", lambda r: _fmt_ms(r.iqr_ms)),
        ("runs", lambda r: str(r.n_runs) if r.n_runs else "-"),
        ("ratio", lambda r: "-" if r.ratio is None
         else f"{r.ratio:.2f}" + (" ref" if r.case == r.reference else "")),
        ("peak MiB", lambda r: "-" if r.peak_mib is None else f"{r.peak_mib:.2f}"),
    ]
    if any(r.held_bytes is not None for r in records):
        cols.append(("held MiB", lambda r: "-" if r.held_bytes is None
                     else f"{r.held_bytes / 2**20:.2f}"))
    if any(r.first_call_ms is not None for r in records):
        cols.append(("1st call ms", lambda r: _fmt_ms(r.first_call_ms)))
    if columns is not None:
        titles = [title for title, _ in cols]
        unknown = [c for c in columns if c not in titles]
        if unknown:
            raise ValueError(f"columns: unknown {unknown}; the table has {titles}")
        cols = [col for col in cols if col[0] in columns]
    if all(not fmt(r) for title, fmt in cols if title == "params" for r in records):
        cols = [col for col in cols if col[0] != "params"]  # nothing left to show there
    n_left = sum(title in ("group", "case", "params") for title, _ in cols)
    lines = text_table([t for t, _ in cols], [[fmt(r) for _, fmt in cols] for r in records],
                       left=n_left)
    out = [f"common: {_fmt_params(common)}"] if common else []
    out += lines[:2]
    for r, line in zip(records, lines[2:], strict=True):
        out.append(line)
        if r.error:
            out.append(f"    ! {r.error}")
    return "\n".join(out)


# --------------------------------------------------------------------------- #
# Side-by-side comparison
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Case:
    """A case with its own parameters, for :func:`compare`.

    A plain callable in ``cases`` is the same as ``Case(fn)``. Use this form when
    cases of one group differ by more than their name (e.g.
    ``Case(fn, {"encoding": "rope", "backend": "flash"})``), hold memory between
    calls, or may not fit on the device.

    Attributes:
        fn: Zero-argument callable to measure.
        params: Merged over the group's params in the case's record.
        held: Optional zero-argument callable returning the bytes the case keeps
            alive between calls (e.g. a cached bias), read after measuring and
            stored as :attr:`BenchRecord.held_bytes`.
        release: Optional zero-argument callable that frees what the case holds
            (its cached tables, its buffers). :func:`compare` calls it after each
            round of the case (timing, and in the last round memory and ``held``),
            so that the next case starts without it; a later round's warm-up
            rebuilds it, untimed.
        footprint: Optional expected :class:`Footprint`; if it would not fit in the
            memory available when the case is due (:func:`available_memory`,
            :func:`fit_problem`), the case is skipped and its record says why.
        skip: Optional reason not to run the case at all on this device (e.g. a
            kernel this GPU's compute capability lacks); recorded as skipped.
    """

    fn: Callable[[], Any]
    params: Mapping[str, Any] = field(default_factory=dict)
    held: Callable[[], int] | None = None
    release: Callable[[], Any] | None = None
    footprint: Footprint | None = None
    skip: str | None = None


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text if len(text) <= 300 else text[:297] + "..."


def compare(
    cases: Mapping[str, Callable[[], Any] | Case],
    reference: str,
    *,
    device: str | torch.device | None = None,
    group: str = "",
    params: Mapping[str, Any] | None = None,
    warmup: int = 3,
    min_runs: int = 10,
    max_time_s: float = 0.5,
    rounds: int = 1,
    measure_memory: bool = True,
    catch_errors: bool = True,
    memory_limit: int | None = None,
    on_case_done: Callable[[str], Any] | None = None,
) -> list[BenchRecord]:
    """Measure several callables side by side and relate each to a reference.

    Each case's first call is timed on its own (:attr:`BenchRecord.first_call_ms`:
    compilation, cache building), then :func:`time_fn` warms up and measures.
    All cases are measured in this one call -- same process, same machine
    state, minutes apart at most -- which is what makes their ratios
    meaningful: absolute times move with clocks, temperature and driver
    versions, ratios to a reference measured alongside move much less. With
    ``rounds > 1`` the cases are measured in turn, round after round, and each
    case's samples are pooled, so that a slow drift of the machine spreads over
    every case instead of biasing whichever ran last; the ratio is then the
    median of the per-round ratios (each case against the reference measured in
    the same round, seconds apart), which is robust on a shared machine.

    **Memory.** Cases are measured one at a time, and a case's memory (peak
    per call, then what it holds) is measured in the last round right after its
    timing; its :attr:`Case.release` is called after each of its rounds, so at
    most one case's caches exist at a time (on a 16 GB GPU, the tables of every
    case of a long-sequence group would not fit together). Before a case's first
    call, its :attr:`Case.footprint` is checked against :func:`available_memory`
    (with ``memory_limit``); one that would not fit is skipped, and so is a case
    with a :attr:`Case.skip` reason: its record has ``skipped=True`` and the
    reason in ``error``, no numbers.

    Args:
        cases: Case name -> zero-argument callable (or :class:`Case`).
        reference: Name of the case every ratio is relative to (the limit
            reference, e.g. PyTorch's fused attention).
        device: As in :func:`time_fn`.
        group: Group label stored in the records.
        params: Parameters shared by the cases (seq_len, dtype, pass, ...).
        warmup: See :func:`time_fn`.
        min_runs: See :func:`time_fn` (per round).
        max_time_s: See :func:`time_fn` (per round).
        rounds: Measuring rounds over all cases.
        measure_memory: Also run :func:`peak_memory` on each case.
        catch_errors: Record a failing case (``error`` set, no numbers) and go
            on, instead of raising; an unsupported backend then does not stop
            a whole suite.
        memory_limit: Bytes the process may use on the device, for the footprint
            check (default: what the device has on CUDA, no check on CPU).
        on_case_done: Called with the case name after each case (progress bars).

    Returns:
        One :class:`BenchRecord` per case, in the order of ``cases``, with
        ``ratio`` (and ``peak_ratio``) filled when the reference succeeded.

    Raises:
        ValueError: If ``cases`` is empty or ``reference`` is not one of them.
        TypeError: If a case is not callable.
    """
    if not cases:
        raise ValueError("cases must hold at least one case")
    if reference not in cases:
        raise ValueError(f"reference {reference!r} is not one of the cases {list(cases)}")
    specs: dict[str, Case] = {}
    case_params: dict[str, dict[str, Any]] = {}
    for name, spec in cases.items():
        spec = spec if isinstance(spec, Case) else Case(spec)
        _check_callable(f"cases[{name!r}]", spec.fn)
        specs[name] = spec
        case_params[name] = {**(params or {}), **spec.params}
    dev = _resolve_device(device)
    check_positive_int("rounds", rounds)
    # Checked here, not left to time_fn: inside the loop below a bad argument
    # would be caught and recorded as a failure of every case.
    check_nonneg_int("warmup", warmup)
    check_positive_int("min_runs", min_runs)
    check_positive_float("max_time_s", max_time_s)
    if memory_limit is not None:
        check_positive_int("memory_limit", memory_limit)

    # The reference goes first in every round: if it fails, we know early.
    order = [reference] + [n for n in specs if n != reference]
    samples: dict[str, list[float]] = {n: [] for n in specs}
    round_medians: dict[str, list[float | None]] = {n: [] for n in specs}
    calls: dict[str, int] = {n: 1 for n in specs}
    method: dict[str, str] = {}
    errors: dict[str, str] = {}
    skipped: set[str] = set()
    first_ms: dict[str, float] = {}
    memory: dict[str, MemoryStat] = {}
    held: dict[str, int] = {}
    for round_ in range(rounds):
        last = round_ == rounds - 1
        for name in order:
            spec = specs[name]
            if name in errors:
                round_medians[name].append(None)
                continue
            if round_ == 0:
                reason = spec.skip
                if reason is None and spec.footprint is not None:
                    reason = fit_problem(spec.footprint, available_memory(dev, memory_limit))
                if reason is not None:
                    errors[name] = f"skipped: {reason}"
                    skipped.add(name)
                    round_medians[name].append(None)
                    continue
            failed = False
            try:
                if name not in first_ms:
                    first_ms[name] = _first_call_ms(spec.fn, dev)
                # later rounds need no full warm-up: the case ran moments ago (but
                # what release() freed is rebuilt by one untimed call)
                n_warm = warmup if round_ == 0 else min(warmup, 1)
                if round_ and spec.release is not None:
                    n_warm = max(n_warm, 1)
                t = time_fn(spec.fn, device=dev, warmup=n_warm, min_runs=min_runs,
                            max_time_s=max_time_s)
                samples[name].extend(t.times_ms)
                round_medians[name].append(t.median_ms)
                calls[name], method[name] = t.calls_per_run, t.method
                if last:
                    try:
                        if measure_memory:
                            memory[name] = peak_memory(spec.fn, device=dev)
                        if spec.held is not None:
                            held[name] = int(spec.held())
                    except Exception as exc:  # timing stands, memory failed
                        if not catch_errors:
                            raise
                        errors[name], failed = _error_text(exc), True
            except Exception as exc:
                if not catch_errors:
                    raise
                if name not in errors:
                    errors[name], failed = _error_text(exc), True
            finally:
                # (here the exception and its frames, which may hold large tensors,
                # are gone)
                if spec.release is not None:
                    spec.release()
                if failed:
                    _after_failure(dev)

    records: dict[str, BenchRecord] = {}
    for name in order:
        timed = name in method and len(round_medians[name]) == rounds and all(
            m is not None for m in round_medians[name])
        timing = None
        if timed:
            timing = Timing.from_times(samples[name], device=str(dev), method=method[name],
                                       calls_per_run=calls[name])
        records[name] = BenchRecord.from_measurements(
            group=group, case=name, params=case_params[name], device=str(dev),
            timing=timing, memory=memory.get(name), reference=reference,
            error=errors.get(name),
        )
        records[name].first_call_ms = first_ms.get(name)
        records[name].held_bytes = held.get(name)
        records[name].skipped = name in skipped
        fp = specs[name].footprint
        records[name].footprint_bytes = None if fp is None else int(fp.need)
        if on_case_done is not None:
            on_case_done(name)

    ref = records[reference]
    for name, rec in records.items():
        if rec.median_ms is not None and ref.median_ms:
            rec.ratio = rec.median_ms / ref.median_ms
            if rounds > 1:
                pairs = [a / b for a, b in zip(round_medians[name], round_medians[reference],
                                               strict=True) if a is not None and b]
                rec.round_ratios = pairs
                rec.ratio = float(np.median(pairs)) if pairs else rec.ratio
        if rec.peak_bytes is not None and ref.peak_bytes:
            rec.peak_ratio = rec.peak_bytes / ref.peak_bytes
    return [records[n] for n in specs]


def _first_call_ms(fn: Callable[[], Any], dev: torch.device) -> float:
    """Wall time of one call, synchronised on CUDA (compile and cache-building costs)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    start = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return (time.perf_counter() - start) * 1e3


def _after_failure(dev: torch.device) -> None:
    # After a CUDA out-of-memory error the cache holds the failed case's
    # blocks; release them so the next case starts from the same state.
    if dev.type == "cuda":
        _collect_garbage()
        try:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
        except RuntimeError:  # a sticky CUDA error: the next case will report it too
            pass
