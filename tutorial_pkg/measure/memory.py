"""Memory a call needs: its peak, what it holds, and whether a case fits before it runs.

* :func:`peak_memory` -- the extra bytes a call needs at its peak (the CUDA allocator's
  peak statistics; on a CPU every allocation and free the profiler records), as a
  :class:`MemoryStat`; :func:`profiled` is the profiler without its stderr lines.
* :class:`Footprint` -- the memory a case is expected to need, computed from its shapes;
  :func:`available_memory` and :func:`fit_problem` decide whether it fits, before its
  first call.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._checks import check_callable, check_nonneg_int, check_number, check_positive_int
from .timing import resolve_device

__all__ = [
    "MEMORY_HEADROOM",
    "MEMORY_RESERVE_BYTES",
    "Footprint",
    "MemoryStat",
    "available_memory",
    "fit_problem",
    "peak_memory",
    "profiled",
]

#: Headroom of the memory check (:func:`fit_problem`): a case runs only if its expected
#: footprint times ``1 + MEMORY_HEADROOM``, plus :data:`MEMORY_RESERVE_BYTES`, fits in the
#: memory available. The 20 % cover what a footprint computed from shapes leaves out: the
#: caching allocator's rounding (blocks of 2 MiB and up) and fragmentation, kernels' own
#: workspaces (cuBLAS, the attention kernels' log-sum-exp and accumulators).
MEMORY_HEADROOM = 0.20
#: The fixed part of the headroom (for CUDA context growth, cuBLAS and cuDNN handles,
#: compiled kernels).
MEMORY_RESERVE_BYTES = 256 * 2**20


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
        device: As in :func:`~tutorial_pkg.measure.timing.resolve_device`.
        warmup: Calls before measuring.

    Returns:
        The :class:`MemoryStat`.

    Raises:
        TypeError: If ``fn`` is not callable or ``warmup`` is not an int.
        ValueError: If ``warmup`` < 0 or the device is unknown or absent.
    """
    check_callable("fn", fn)
    dev = resolve_device(device)
    check_nonneg_int("warmup", warmup)
    for _ in range(warmup):
        fn()
    if dev.type == "cuda":
        return _peak_memory_cuda(fn, dev)
    return _peak_memory_cpu(fn)


def _collect_garbage() -> None:
    # Cyclic garbage freed by a GC pass *during* the call would show up as
    # negative allocations and hide part of the peak; collect it beforehand.
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
        device: As in :func:`~tutorial_pkg.measure.timing.resolve_device`.
        limit: Bytes the process may use on the device in all (e.g. a smaller GPU's
            memory, rehearsed on a larger one); ``None``: no limit of our own.

    Returns:
        The bytes, or ``None`` (CPU without a limit).

    Raises:
        TypeError: If ``limit`` is not an int.
        ValueError: If ``limit`` is not positive, or as
            :func:`~tutorial_pkg.measure.timing.resolve_device`.
    """
    dev = resolve_device(device)
    if limit is not None:
        check_positive_int("limit", limit)
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

    Args:
        footprint: The case's expected :class:`Footprint`.
        available: Bytes the case may allocate (:func:`available_memory`), or ``None``.
        headroom: Fraction added to ``footprint.need`` (>= 0).
        reserve: Bytes added on top (>= 0).

    Returns:
        ``None``, or a one-line reason with the numbers (the record's ``error``).

    Raises:
        TypeError: If ``footprint`` is not a :class:`Footprint` or a number has the wrong type.
        ValueError: If ``available``, ``headroom`` or ``reserve`` is negative.
    """
    if not isinstance(footprint, Footprint):
        raise TypeError(f"footprint must be a Footprint, got {type(footprint).__name__}")
    if check_number("headroom", headroom) < 0:
        raise ValueError(f"headroom must be >= 0, got {headroom}")
    check_nonneg_int("reserve", reserve)
    if available is None:
        return None
    check_nonneg_int("available", available)
    wanted = footprint.need * (1 + headroom) + reserve
    if wanted <= available:
        return None
    return (f"needs about {_gib(footprint.need)} (held {_gib(footprint.held)}, per call "
            f"{_gib(footprint.call)}, first call {_gib(footprint.build)}), "
            f"{_gib(wanted)} with headroom; {_gib(available)} available")
