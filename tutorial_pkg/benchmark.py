"""Honest timing and memory measurement for the book's benchmarks (chapter 5).

The source articles time a function with one ``time.time()`` pair around a single
call: no warm-up, no device synchronisation, one sample. On a GPU that measures
how long it took to *enqueue* the kernels, not to run them; on any device the
first call also pays one-off costs (lazy initialisation, kernel selection, cache
misses), and a single sample says nothing about noise. This module does it right:

* :func:`time_fn` -- warm-up, many runs, robust statistics (median and IQR).
  On CUDA each run is bracketed by a pair of ``torch.cuda.Event`` and the host
  synchronises before reading them; on CPU ``torch.utils.benchmark.Timer`` does
  the measuring.
* :func:`naive_time_fn` -- the seeds' wrong method, kept only for comparison.
* :func:`peak_memory` -- extra bytes a call needs at its peak.
* :func:`compare` -- measures several callables side by side in the same run and
  reports each one's ratio to a named reference (the suite's key principle: a
  number is only meaningful next to its limit reference measured on the same
  machine, in the same process, minutes apart).
* :class:`BenchRecord`, :func:`save_results`, :func:`load_results`,
  :func:`format_table`, :func:`hardware_info` -- recording and reporting.
* The standard suite (:func:`default_suite`): attention per encoding x backend x
  length x pass (:func:`attention_suite`), RoPE apply (:func:`rope_suite`) and a
  training step of the tiny LM (:func:`lm_suite`), each case next to its limit
  reference; :func:`parse_args` builds the arguments a suite takes.
* A command line, ``python -m tutorial_pkg.benchmark``, that runs it (or any
  other suite, ``--suite module:function``) and writes a JSON results file;
  ``benchmarks/suite.py`` also checks the book's performance targets.

Example:
    >>> import torch
    >>> from tutorial_pkg.benchmark import time_fn
    >>> x = torch.randn(256, 256)
    >>> t = time_fn(lambda: x @ x, device="cpu", max_time_s=0.05)
    >>> t.min_ms <= t.median_ms
    True
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import importlib
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

__all__ = [
    "ATTENTION_ENCODINGS",
    "ATTENTION_LIMIT",
    "ROPE_LIMIT",
    "SCHEMA_VERSION",
    "SUITE_PARTS",
    "BenchRecord",
    "Case",
    "MemoryStat",
    "Results",
    "SeedALiBiAttention",
    "SuiteEntry",
    "SuiteFn",
    "Timing",
    "attention_suite",
    "build_parser",
    "compare",
    "default_suite",
    "format_table",
    "hardware_info",
    "lm_suite",
    "load_results",
    "main",
    "naive_time_fn",
    "parse_args",
    "peak_memory",
    "profiled",
    "rope_suite",
    "save_results",
    "time_fn",
]

#: Version of the JSON layout written by :func:`save_results`.
SCHEMA_VERSION = 1

# Bigger than the L2 cache of current GPUs (H100/H200: 50 MB), so zeroing it
# evicts whatever the previous run left in L2 (same size as Triton's do_bench).
_L2_FLUSH_BYTES = 256 * 1024 * 1024


# --------------------------------------------------------------------------- #
# Argument checking
# --------------------------------------------------------------------------- #
def _check_callable(name: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"{name} must be callable (no arguments), got {type(fn).__name__}")


def _check_int(name: str, value: Any, minimum: int) -> int:
    # bool is an int subclass; `warmup=True` is almost surely a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


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
    """Statistics of repeated timings of one callable, in milliseconds.

    The median and the inter-quartile range (IQR = p75 - p25) are the numbers to
    report: unlike the mean and the standard deviation they are not dragged by
    the occasional run that an interrupt or another process slowed down.

    Attributes:
        median_ms: Median time per call.
        p25_ms: 25th percentile.
        p75_ms: 75th percentile.
        iqr_ms: ``p75_ms - p25_ms``, the spread.
        mean_ms: Mean (sensitive to outliers; reported for completeness).
        min_ms: Fastest run (a lower bound; optimistic).
        max_ms: Slowest run.
        n_runs: Number of samples in ``times_ms``.
        calls_per_run: Calls averaged into one sample (CPU ``Timer`` blocks; 1 on CUDA).
        times_ms: Every sample, in the order measured.
        device: Device the timing was done for (``"cpu"``, ``"cuda:0"``, ...).
        method: How it was measured (``"cuda-events"``, ``"torch-timer"``, ``"naive-wall-clock"``).
    """

    median_ms: float
    p25_ms: float
    p75_ms: float
    iqr_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    n_runs: int
    calls_per_run: int
    times_ms: list[float]
    device: str
    method: str

    @classmethod
    def from_times(
        cls, times_ms: Sequence[float], *, device: str, method: str, calls_per_run: int = 1
    ) -> Timing:
        """Build the statistics from raw per-call samples (milliseconds).

        Args:
            times_ms: Samples, at least one.
            device: Device label.
            method: Measuring method label.
            calls_per_run: Calls averaged into each sample.

        Returns:
            The :class:`Timing`.

        Raises:
            ValueError: If ``times_ms`` is empty.
        """
        if len(times_ms) == 0:
            raise ValueError("times_ms must hold at least one sample")
        arr = np.asarray(times_ms, dtype=np.float64)
        p25, median, p75 = (float(v) for v in np.percentile(arr, [25, 50, 75]))
        return cls(
            median_ms=median,
            p25_ms=p25,
            p75_ms=p75,
            iqr_ms=p75 - p25,
            mean_ms=float(arr.mean()),
            min_ms=float(arr.min()),
            max_ms=float(arr.max()),
            n_runs=int(arr.size),
            calls_per_run=int(calls_per_run),
            times_ms=[float(v) for v in arr],
            device=device,
            method=method,
        )

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
    _check_int("warmup", warmup, 0)
    _check_int("min_runs", min_runs, 1)
    _check_positive("max_time_s", max_time_s)
    _check_int("max_runs", max_runs, 1)
    if max_runs < min_runs:
        raise ValueError(f"max_runs ({max_runs}) must be >= min_runs ({min_runs})")
    if num_threads is not None:
        _check_int("num_threads", num_threads, 1)
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
    times_s = list(measurement.times)
    while len(times_s) < min_runs:
        # Same block size; Timer.timeit adds a couple of untimed calls first.
        times_s.extend(timer.timeit(number=measurement.number_per_run).times)
    return Timing.from_times(
        [t * 1e3 for t in times_s],
        device="cpu",
        method="torch-timer",
        calls_per_run=measurement.number_per_run,
    )


def naive_time_fn(fn: Callable[[], Any], *, device: str | torch.device | None = None) -> Timing:
    """Time ``fn`` the way the seeds do -- WRONG, kept for chapter 5's comparison.

    One ``time.time()`` pair around one call: no warm-up (the first call pays
    lazy initialisation, kernel selection and cold caches), no device
    synchronisation (on a GPU the call returns as soon as the kernels are
    *queued*, so this times the launch, not the work, and the unfinished work
    is billed to whatever runs next), one sample (no idea of the noise), and
    ``time.time()`` is a wall clock that may be coarse or adjusted mid-run.
    Use :func:`time_fn`.

    Args:
        fn: The callable.
        device: Only recorded in the result; nothing is synchronised.

    Returns:
        A one-sample :class:`Timing` with ``method="naive-wall-clock"``.

    Raises:
        TypeError: If ``fn`` is not callable.
        ValueError: If the device is unknown or absent.
    """
    _check_callable("fn", fn)
    dev = _resolve_device(device)
    start = time.time()
    fn()
    elapsed_ms = (time.time() - start) * 1e3
    return Timing.from_times([elapsed_ms], device=str(dev), method="naive-wall-clock")


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
    _check_int("warmup", warmup, 0)
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
# Hardware
# --------------------------------------------------------------------------- #
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
        ``gpu_memory_gib``, ``torch``, ``cuda`` (CUDA version torch was built
        with, or ``None``), ``cudnn``, ``python``, ``os``, ``machine``,
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
        error: ``"ExceptionType: message"`` if the case raised, else ``None``.
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


def format_table(records: Sequence[BenchRecord]) -> str:
    """Render records as a fixed-width text table.

    Parameters shared by every record are printed once above the table; each row
    shows the rest. ``ratio`` is the median over the group's reference median
    (the reference row shows ``1.00 ref``). ``held MiB`` and ``1st call ms``
    columns appear when some record has them.

    Args:
        records: The records, in display order.

    Returns:
        The table (no trailing newline); ``"(no records)"`` if empty.
    """
    if not records:
        return "(no records)"
    keys = list(dict.fromkeys(k for r in records for k in r.params))
    common = {
        k: records[0].params[k]
        for k in keys
        if all(k in r.params and r.params[k] == records[0].params[k] for r in records)
    }
    header = ["group", "case", "params", "median ms", "IQR ms", "runs", "ratio", "peak MiB"]
    extra_cols = [
        ("held MiB", lambda r: "-" if r.held_bytes is None else f"{r.held_bytes / 2**20:.2f}"),
        ("1st call ms", lambda r: _fmt_ms(r.first_call_ms)),
    ]
    # optional columns appear only when some record has the value
    extra_cols = [
        (title, fmt) for title, fmt in extra_cols
        if any(getattr(r, "held_bytes" if title == "held MiB" else "first_call_ms") is not None
               for r in records)
    ]
    header += [title for title, _ in extra_cols]
    rows = []
    for r in records:
        own = {k: v for k, v in r.params.items() if k not in common}
        if r.ratio is None:
            ratio = "-"
        else:
            ratio = f"{r.ratio:.2f}" + (" ref" if r.case == r.reference else "")
        peak = "-" if r.peak_mib is None else f"{r.peak_mib:.2f}"
        row = [r.group, r.case, _fmt_params(own), _fmt_ms(r.median_ms), _fmt_ms(r.iqr_ms),
               str(r.n_runs) if r.n_runs else "-", ratio, peak]
        row += [fmt(r) for _, fmt in extra_cols]
        if r.error:
            row[3] = "error"
        rows.append((row, r.error))
    widths = [max(len(h), *(len(row[i]) for row, _ in rows)) for i, h in enumerate(header)]
    left = {0, 1, 2}  # text columns left-aligned, numbers right-aligned

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = []
    if common:
        out.append(f"common: {_fmt_params(common)}")
    out.append(line(header))
    out.append(line(["-" * w for w in widths]))
    for row, error in rows:
        out.append(line(row))
        if error:
            out.append(f"    ! {error}")
    return "\n".join(out)


# --------------------------------------------------------------------------- #
# Side-by-side comparison
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Case:
    """A case with its own parameters, for :func:`compare`.

    A plain callable in ``cases`` is the same as ``Case(fn)``. Use this form when
    cases of one group differ by more than their name (e.g.
    ``Case(fn, {"encoding": "rope", "backend": "flash"})``).

    Attributes:
        fn: Zero-argument callable to measure.
        params: Merged over the group's params in the case's record.
        held: Optional zero-argument callable returning the bytes the case keeps
            alive between calls (e.g. a cached bias), read after measuring and
            stored as :attr:`BenchRecord.held_bytes`.
    """

    fn: Callable[[], Any]
    params: Mapping[str, Any] = field(default_factory=dict)
    held: Callable[[], int] | None = None


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
    fns: dict[str, Callable[[], Any]] = {}
    case_params: dict[str, dict[str, Any]] = {}
    helds: dict[str, Callable[[], int] | None] = {}
    for name, spec in cases.items():
        fn, extra = (spec.fn, spec.params) if isinstance(spec, Case) else (spec, {})
        _check_callable(f"cases[{name!r}]", fn)
        fns[name] = fn
        helds[name] = spec.held if isinstance(spec, Case) else None
        case_params[name] = {**(params or {}), **extra}
    dev = _resolve_device(device)
    _check_int("rounds", rounds, 1)
    # Checked here, not left to time_fn: inside the loop below a bad argument
    # would be caught and recorded as a failure of every case.
    _check_int("warmup", warmup, 0)
    _check_int("min_runs", min_runs, 1)
    _check_positive("max_time_s", max_time_s)

    # The reference goes first in every round: if it fails, we know early.
    order = [reference] + [n for n in fns if n != reference]
    samples: dict[str, list[float]] = {n: [] for n in fns}
    round_medians: dict[str, list[float | None]] = {n: [] for n in fns}
    calls: dict[str, int] = {n: 1 for n in fns}
    method: dict[str, str] = {}
    errors: dict[str, str] = {}
    first_ms: dict[str, float] = {}
    for round_ in range(rounds):
        for name in order:
            if name in errors:
                round_medians[name].append(None)
                continue
            try:
                if name not in first_ms:
                    first_ms[name] = _first_call_ms(fns[name], dev)
                # later rounds need no full warm-up: the case ran moments ago
                t = time_fn(fns[name], device=dev, warmup=warmup if round_ == 0 else min(warmup, 1),
                            min_runs=min_runs, max_time_s=max_time_s)
            except Exception as exc:
                if not catch_errors:
                    raise
                errors[name] = _error_text(exc)
                _after_failure(dev)
                continue
            samples[name].extend(t.times_ms)
            round_medians[name].append(t.median_ms)
            calls[name], method[name] = t.calls_per_run, t.method

    records: dict[str, BenchRecord] = {}
    for name in order:
        timing = memory = None
        if name not in errors:
            timing = Timing.from_times(samples[name], device=str(dev), method=method[name],
                                       calls_per_run=calls[name])
            if measure_memory:
                try:
                    memory = peak_memory(fns[name], device=dev)
                except Exception as exc:
                    if not catch_errors:
                        raise
                    errors[name] = _error_text(exc)
                    _after_failure(dev)
        records[name] = BenchRecord.from_measurements(
            group=group, case=name, params=case_params[name], device=str(dev),
            timing=timing, memory=memory, reference=reference, error=errors.get(name),
        )
        records[name].first_call_ms = first_ms.get(name)
        if helds[name] is not None and name not in errors:
            records[name].held_bytes = int(helds[name]())
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
    return [records[n] for n in fns]


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
        try:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
        except RuntimeError:  # a sticky CUDA error: the next case will report it too
            pass


# --------------------------------------------------------------------------- #
# Suite and command line
# --------------------------------------------------------------------------- #
class SuiteEntry(NamedTuple):
    """One group of a suite: cases measured side by side with their reference.

    Attributes:
        group: Group label.
        cases: Case name -> zero-argument callable (or :class:`Case`).
        reference: Name of the reference case in ``cases``.
        params: Parameters shared by the group's cases.
    """

    group: str
    cases: Mapping[str, Callable[[], Any] | Case]
    reference: str
    params: Mapping[str, Any]


#: The type of a suite, parsed CLI arguments -> groups to measure (generated lazily, so only
#: one group's inputs need to exist at a time).
SuiteFn = Callable[[argparse.Namespace], Iterable[SuiteEntry]]

#: Presets of the command line (``--quick`` is a smoke test, not a measurement).
_QUICK = {
    "lengths": [64, 128], "warmup": 1, "min_runs": 3, "max_time": 0.02, "rounds": 1,
    "passes": ["fwd"], "backends": ["naive", "sdpa", "auto"], "rope_shape": [1, 4, 128, 64],
    "lm_batch": 4, "lm_len": 32,
}
_FULL = {
    "warmup": 3, "min_runs": 5, "max_time": 0.5, "rounds": 3, "passes": ["fwd", "fwd+bwd"],
    "backends": ["naive", "sdpa", "flex", "auto"], "rope_shape": [4, 8, 2048, 64],
    "lm_batch": 32, "lm_len": 64,
}
_FULL_LENGTHS = {"cpu": [512, 1024, 2048, 4096], "cuda": [1024, 2048, 4096, 8192, 16384]}
#: Parts of the standard suite, in the order they run.
SUITE_PARTS = ("attention", "rope", "lm")
#: The encodings of the attention part; the others (sinusoidal, learned) act on the
#: embeddings, so their attention is NoPE's; they appear in the ``lm`` part.
ATTENTION_ENCODINGS = ("nope", "rope", "alibi", "hybrid")
#: The name of the attention part's limit reference, PyTorch's fused causal attention
#: without any encoding. Nothing that attends causally can do much better.
ATTENTION_LIMIT = "limit: sdpa causal"
#: The name of the RoPE part's limit reference, copying q and k (one read, one write).
ROPE_LIMIT = "limit: clone q,k"


def _naive_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The textbook causal attention: matmul, mask, softmax, matmul.

    It materialises the (L, L) score and probability matrices per head, which
    is exactly what fused kernels avoid.
    """
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class SeedALiBiAttention:
    """The source articles' ALiBi attention, reconstructed from their description.

    Kept only as a measured point of comparison (chapters 3 and 5): slopes as in
    Press et al.'s ``get_slopes``; the bias ``-m (i - j)`` precomputed into a
    fixed ``(H, max_len, max_len)`` buffer in ``__init__`` and sliced (the
    articles use ``max_len=2048``, so their code breaks past 2048 tokens); a causal
    mask built on every call with ``torch.tril``; ``masked_fill(mask == 0, -inf)``;
    softmax; weighted sum. Everything ``L x L`` is materialised, in float32.

    Args:
        n_heads: heads.
        max_len: side of the precomputed buffer.
        device: where the buffer lives.
    """

    def __init__(self, n_heads: int, max_len: int = 2048, device=None) -> None:
        from .alibi import alibi_slopes

        slopes = alibi_slopes(n_heads, device=device)
        pos = torch.arange(max_len, device=device)
        distance = (pos[:, None] - pos[None, :]).float()
        self.alibi_biases = -slopes[:, None, None] * distance  # (H, max_len, max_len)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[b, H, L, d]`` heads in, attention output out (float32 arithmetic)."""
        L = q.shape[-2]
        scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
        scores = scores + self.alibi_biases[:, :L, :L]  # past max_len: a shape error
        mask = torch.tril(torch.ones(L, L, device=q.device))
        scores = scores.masked_fill(mask == 0, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)


def _held_bytes(*modules: Any) -> int:
    """Bytes of the buffers and caches a module keeps between calls (encodings, seeds)."""
    from . import backends
    from .encodings import PositionEncoding

    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:  # views of one cache count once
                seen.add(storage.data_ptr())
                total += storage.nbytes()

    for m in modules:
        if isinstance(m, torch.nn.Module):
            for sub in m.modules():
                for t in sub.buffers(recurse=False):
                    add(t)
                if isinstance(sub, PositionEncoding):  # tables cached by the backends
                    for t in backends.cached_tensors(sub):
                        add(t)
        else:
            for t in vars(m).values():
                add(t)
    return total


def _unsupported(reason: str) -> Callable[[], Any]:
    def run() -> Any:
        raise NotImplementedError(reason)

    return run


def _make_call(
    attn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    pass_: str,
    grad_out: torch.Tensor | None,
) -> Callable[[], Any]:
    if pass_ == "fwd":
        def run() -> Any:
            # the inference path: no autograd graph (FlexAttention on CPU needs it)
            with torch.no_grad():
                return attn(*inputs)
    else:
        def run() -> Any:
            # autograd.grad returns the gradients instead of accumulating them
            # into .grad, so every call does the same work and memory is not
            # held between calls.
            out = attn(*inputs)
            return torch.autograd.grad(out, inputs[:3], grad_out)
    return run


def _suite_dtype(args: argparse.Namespace) -> torch.dtype:
    return getattr(torch, args.dtype)


def attention_suite(args: argparse.Namespace) -> Iterator[SuiteEntry]:
    """Attention alone, per length and pass: every encoding x backend next to the limit.

    One group per (length, pass). In each: the limit reference
    (:data:`ATTENTION_LIMIT`, ``scaled_dot_product_attention(..., is_causal=True)``
    without any encoding), then ``{encoding}/{backend}`` for
    ``args.encodings`` x ``args.backends`` through
    :meth:`~tutorial_pkg.attention.MultiHeadAttention.attend` (q, k, v already
    projected: projections cost the same for every case and would only dilute the
    ratios), and for ALiBi two extra points: ``alibi/seed``
    (:class:`SeedALiBiAttention`, its buffer grown to the length) and
    ``alibi/sdpa-3d-mask`` (the bias passed as a 3-D ``(H, L, L)`` mask, which
    CPU SDPA silently runs on its slow math path). ``auto`` is listed only for
    encodings with a bias (otherwise it is the ``sdpa`` path). ``flex`` has no CPU
    backward in torch 2.13: that case is recorded as an error, not measured.

    ``fwd`` runs under ``torch.no_grad()`` (inference); ``fwd+bwd`` returns the
    gradients of q, k, v. Every case of an encoding gets its own encoding object,
    so each record's ``held_bytes`` is that path's own cache.

    Args:
        args: Parsed arguments (``device``, ``dtype``, ``lengths``, ``passes``,
            ``batch``, ``heads``, ``head_dim``, ``encodings``, ``backends``).

    Yields:
        One :class:`SuiteEntry` per (length, pass); inputs are created when the
        entry is generated, so only one group's tensors are alive at a time.
    """
    from . import backends
    from .attention import MultiHeadAttention
    from .encodings import make_encoding

    device = torch.device(args.device)
    dtype = _suite_dtype(args)
    batch, heads, head_dim = args.batch, args.heads, args.head_dim
    for seq_len in args.lengths:
        for pass_ in args.passes:
            train = pass_ == "fwd+bwd"
            gen = torch.Generator().manual_seed(seq_len)  # same inputs on every run
            shape = (batch, heads, seq_len, head_dim)
            q, k, v = (
                torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
                .requires_grad_(train)
                for _ in range(3)
            )
            grad_out = torch.randn(shape, generator=gen).to(device, dtype) if train else None
            cases: dict[str, Case] = {
                ATTENTION_LIMIT: Case(_make_call(_sdpa_causal, (q, k, v), pass_, grad_out),
                                      {"encoding": "none", "backend": "sdpa"}),
            }
            for enc_name in args.encodings:
                for backend in args.backends:
                    enc = make_encoding(enc_name, d_model=heads * head_dim, n_heads=heads,
                                        max_len=seq_len)
                    if backend == "auto" and enc.key_bias(torch.arange(1)) is None:
                        continue  # auto is exactly the sdpa path here
                    layer = MultiHeadAttention(heads * head_dim, heads, enc, backend=backend)
                    layer = layer.to(device)
                    if backend == "flex" and train and device.type == "cpu":
                        fn = _unsupported("FlexAttention has no CPU backward in this torch")
                    else:
                        fn = _make_call(layer.attend, (q, k, v), pass_, grad_out)
                    cases[f"{enc_name}/{backend}"] = Case(
                        fn, {"encoding": enc_name, "backend": backend},
                        held=lambda enc=enc: _held_bytes(enc),
                    )
                if enc_name == "alibi":
                    seed = SeedALiBiAttention(heads, max(2048, seq_len), device=device)
                    cases["alibi/seed"] = Case(
                        _make_call(seed, (q, k, v), pass_, grad_out),
                        {"encoding": "alibi", "backend": "seed"},
                        held=lambda seed=seed: _held_bytes(seed),
                    )
                    enc3 = make_encoding("alibi", n_heads=heads)
                    bias3 = backends.cached_bias(enc3, 0, seq_len, seq_len, causal=True,
                                                 device=device, dtype=dtype)[0]  # 3-D mask

                    def sdpa_3d(q_, k_, v_, bias3=bias3):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q_, k_, v_, attn_mask=bias3)

                    cases["alibi/sdpa-3d-mask"] = Case(
                        _make_call(sdpa_3d, (q, k, v), pass_, grad_out),
                        {"encoding": "alibi", "backend": "sdpa-3d-mask"},
                        held=lambda enc3=enc3: _held_bytes(enc3),
                    )
            params = {
                "op": "attention", "seq_len": seq_len, "batch": batch, "heads": heads,
                "head_dim": head_dim, "dtype": args.dtype, "pass": pass_,
            }
            yield SuiteEntry(f"attn L={seq_len} {pass_}", cases, ATTENTION_LIMIT, params)


def rope_suite(args: argparse.Namespace) -> Iterator[SuiteEntry]:
    """Applying RoPE to q and k, per dtype, next to copying them (:data:`ROPE_LIMIT`).

    Cases: ``apply_rope`` (the readable reference form), ``rotate`` (the package's
    :class:`~tutorial_pkg.rope.RotaryEmbedding` on q and k, three passes each),
    ``rotate fused`` (the same with ``fused=True``: one compiled call for q and k;
    its compile time is the record's ``first_call_ms``), ``rotate_half`` (Hugging Face's
    ``x * cos + rotate_half(x) * sin``) and ``complex`` (Meta's
    ``view_as_complex`` form, interleaved layout; float32 arithmetic). Shape
    ``args.rope_shape`` = (batch, heads, length, head_dim); dtypes float32 and
    bfloat16 (float16 too on CUDA). Inference (no autograd).

    Every call allocates its outputs with the default allocator, as a model
    would; on Linux, large blocks come back from the OS and each first touch of
    a page faults (~1 us per 4 KiB page here), which is part of what is
    measured, for the reference as for the cases.
    """
    device = torch.device(args.device)
    dtypes = ["float32", "bfloat16"] + (["float16"] if device.type == "cuda" else [])
    for dtype_name in dtypes:
        yield _rope_entry(device, tuple(args.rope_shape), dtype_name)


def _rope_entry(device: torch.device, shape: tuple[int, ...], dtype_name: str) -> SuiteEntry:
    from .rope import RotaryEmbedding, apply_rope, apply_rope_complex, precompute_freqs_cis
    from .rope import rotate_half as hf_rotate_half

    b, h, s, d = shape
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(s)
    q, k = (torch.randn(b, h, s, d, generator=gen).to(device, dtype) for _ in range(2))
    eager = RotaryEmbedding(d).to(device)
    fused = RotaryEmbedding(d, fused=True).to(device)
    cos, sin = eager.cos_sin(start=0, length=s)
    cos_full = torch.cat((cos, cos), -1).to(dtype)
    sin_full = torch.cat((sin, sin), -1).to(dtype)
    freqs = precompute_freqs_cis(d, s).to(device)

    def run(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad():
                return fn(q), fn(k)
        return call

    def run_pair(module: torch.nn.Module) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad():
                return module(q, k)  # RotaryEmbedding.forward: q and k at positions 0..s-1
        return call

    cases = {
        ROPE_LIMIT: Case(run(torch.clone), {"impl": "clone"}),
        "apply_rope": Case(run(lambda x: apply_rope(x, cos, sin)), {"impl": "reference"}),
        "rotate": Case(run_pair(eager), {"impl": "eager"}),
        "rotate fused": Case(run_pair(fused), {"impl": "compiled"}),
        "rotate_half": Case(run(lambda x: x * cos_full + hf_rotate_half(x) * sin_full),
                            {"impl": "hugging face"}),
        "complex": Case(run(lambda x: apply_rope_complex(x, freqs)), {"impl": "meta"}),
    }
    params = {"op": "rope", "shape": [b, h, s, d], "dtype": dtype_name, "pass": "fwd"}
    return SuiteEntry(f"rope {dtype_name}", cases, ROPE_LIMIT, params)


def lm_suite(args: argparse.Namespace) -> Iterator[SuiteEntry]:
    """One training step of the tiny LM per encoding, next to the NoPE step.

    The step: zero the gradients, forward, cross-entropy, backward, AdamW step,
    on a batch of ``args.lm_batch`` windows of ``args.lm_len`` tokens, with the
    model of chapter 7 (d_model 96, 3 layers, 4 heads) on the ``"auto"`` backend,
    plus ``alibi (sdpa backend)`` for comparison. The reference is ``nope``:
    the same model with no position information, i.e. what a step costs before
    any encoding adds work.
    """
    from .model import TinyLM

    device = torch.device(args.device)
    batch, length = args.lm_batch, args.lm_len
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (batch, length + 1), generator=gen).to(device)
    x, y = ids[:, :-1], ids[:, 1:]
    encodings = ["nope", "sinusoidal", "learned", "rope", "alibi", "hybrid"]
    variants = [(name, "auto") for name in encodings] + [("alibi", "sdpa")]
    cases: dict[str, Case] = {}
    for name, backend in variants:
        model = TinyLM(name, d_model=96, n_layers=3, n_heads=4, max_len=length,
                       backend=backend).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model=model, opt=opt) -> Any:
            opt.zero_grad(set_to_none=True)
            loss = model.loss(x, y)
            loss.backward()
            opt.step()
            return loss.detach()

        label = name if backend == "auto" else f"{name} ({backend} backend)"
        cases[label] = Case(step, {"encoding": name, "backend": backend},
                            held=lambda model=model: _held_bytes(model.encoding))
    params = {"op": "lm train step", "batch": batch, "seq_len": length, "d_model": 96,
              "layers": 3, "heads": 4, "pass": "fwd+bwd+adamw"}
    yield SuiteEntry(f"lm step L={length}", cases, "nope", params)


def default_suite(args: argparse.Namespace) -> Iterator[SuiteEntry]:
    """The standard suite: the parts in ``args.parts`` (default all of :data:`SUITE_PARTS`).

    ``attention`` (:func:`attention_suite`), ``rope`` (:func:`rope_suite`) and
    ``lm`` (:func:`lm_suite`); each group measures its cases side by side with
    its limit reference. ``benchmarks/suite.py`` runs it and checks the book's
    performance targets; any other suite can be run with ``--suite
    module:function`` (a function with this signature).

    Args:
        args: Parsed and completed arguments of :func:`build_parser`.

    Yields:
        :class:`SuiteEntry` groups, generated lazily.
    """
    parts = {"attention": attention_suite, "rope": rope_suite, "lm": lm_suite}
    for part in getattr(args, "parts", None) or SUITE_PARTS:
        yield from parts[part](args)


def _load_suite(spec: str) -> SuiteFn:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--suite must look like 'module:function', got {spec!r}")
    suite = getattr(importlib.import_module(module_name), attr)
    _check_callable("--suite", suite)
    return suite


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (suites may read any of its arguments)."""
    p = argparse.ArgumentParser(
        prog="python -m tutorial_pkg.benchmark",
        description="Time and measure memory of benchmark cases side by side with their "
        "reference, print a table of ratios and write a JSON results file.",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON results file to write")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, few runs (a smoke test, not a measurement)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda if available, else cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=None, metavar="L",
                   help="sequence lengths (default depends on --device and --quick)")
    p.add_argument("--passes", nargs="+", choices=["fwd", "fwd+bwd"], default=None)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="default: float16 on cuda, float32 on cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--parts", nargs="+", choices=list(SUITE_PARTS), default=None,
                   help="parts of the standard suite to run (default: all)")
    p.add_argument("--encodings", nargs="+", choices=list(ATTENTION_ENCODINGS), default=None,
                   help="encodings of the attention part (default: all four)")
    p.add_argument("--backends", nargs="+", choices=["naive", "sdpa", "flex", "auto"],
                   default=None, help="attention backends (default: all; --quick: no flex)")
    p.add_argument("--rope-shape", type=int, nargs=4, default=None, metavar=("B", "H", "S", "D"),
                   help="q/k shape of the rope part (default 4 8 2048 64)")
    p.add_argument("--lm-batch", type=int, default=None, help="batch of the lm part (32)")
    p.add_argument("--lm-len", type=int, default=None, help="window of the lm part (64)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--min-runs", type=int, default=None)
    p.add_argument("--max-time", type=float, default=None, help="seconds per case and round")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved measuring rounds over a group's cases (default 3)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for this process (default: torch's own)")
    p.add_argument("--no-memory", action="store_true", help="skip peak-memory measurement")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--suite", default=None, metavar="MODULE:FUNCTION",
                   help="suite to run instead of default_suite")
    return p


def _finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --device and --quick."""
    args.device = str(_resolve_device(args.device))
    kind = torch.device(args.device).type
    preset = _QUICK if args.quick else _FULL
    if args.lengths is None:
        args.lengths = list(preset.get("lengths", _FULL_LENGTHS[kind]))
    if args.passes is None:
        args.passes = list(preset["passes"])
    if args.dtype is None:
        args.dtype = "float16" if kind == "cuda" else "float32"
    for name in ("warmup", "min_runs", "max_time", "rounds", "backends", "rope_shape",
                 "lm_batch", "lm_len"):
        if getattr(args, name, None) is None:
            setattr(args, name, copy.copy(preset[name]))
    if getattr(args, "encodings", None) is None:
        args.encodings = list(ATTENTION_ENCODINGS)
    if getattr(args, "parts", None) is None:
        args.parts = list(SUITE_PARTS)
    return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line style arguments, parsed and completed: what a suite function takes.

    Example: ``attention_suite(parse_args(["--lengths", "256", "--passes", "fwd"]))``.
    """
    return _finish_args(build_parser().parse_args([] if argv is None else list(argv)))


def main(argv: Sequence[str] | None = None, *, suite: SuiteFn | None = None) -> int:
    """Run a suite, print the table, optionally write the JSON results file.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).
        suite: Suite function; default ``--suite`` if given, else :func:`default_suite`.

    Returns:
        The exit status (0).
    """
    from tqdm import tqdm

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args = _finish_args(args)
        if suite is None:
            suite = _load_suite(args.suite) if args.suite else default_suite
    except (ValueError, ImportError, AttributeError, TypeError) as exc:
        parser.error(str(exc))
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)  # the CLI is the caller: its choice to make

    hardware = hardware_info(args.device)
    print(f"{hardware['device_name']} ({hardware['device']}), torch {hardware['torch']}, "
          f"{hardware['num_threads']} threads, load average {hardware['loadavg']}", flush=True)
    entries = suite(args)
    total = sum(len(e.cases) for e in entries) if isinstance(entries, Sequence) else None
    records: list[BenchRecord] = []
    with tqdm(total=total, unit="case", disable=args.no_progress, file=sys.stderr) as bar:
        for group, cases, reference, params in entries:
            bar.set_description(group)
            group_records = compare(
                cases, reference, device=args.device, group=group, params=params,
                warmup=args.warmup, min_runs=args.min_runs, max_time_s=args.max_time,
                rounds=args.rounds, measure_memory=not args.no_memory,
                on_case_done=lambda _name: bar.update(1),
            )
            records.extend(group_records)
            # one table per group as soon as it is measured (long runs show progress)
            bar.clear()
            print(format_table(group_records) + "\n", flush=True)
    hardware["loadavg_end"] = _loadavg()
    if args.out is not None:
        save_results(records, args.out, hardware)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
