"""The measuring library of chapter 5: time and memory, measured side by side, and recorded.

``from tutorial_pkg import measure as bm`` gives all of it. Its parts, one idea each:

* :mod:`tutorial_pkg.measure.timing` -- :func:`~tutorial_pkg.measure.timing.time_fn`:
  warm-up, many samples, the median and the inter-quartile range (CUDA events on a GPU,
  ``torch.utils.benchmark`` on a CPU), as a :class:`~tutorial_pkg.measure.timing.Timing`;
* :mod:`tutorial_pkg.measure.memory` -- :func:`~tutorial_pkg.measure.memory.peak_memory`
  (the extra bytes of one call at its peak), the expected
  :class:`~tutorial_pkg.measure.memory.Footprint` of a case and whether it fits
  (:func:`~tutorial_pkg.measure.memory.available_memory`,
  :func:`~tutorial_pkg.measure.memory.fit_problem`);
* :mod:`tutorial_pkg.measure.records` -- :class:`~tutorial_pkg.measure.records.BenchRecord`,
  results files that say where they were measured
  (:func:`~tutorial_pkg.measure.records.save_results`,
  :func:`~tutorial_pkg.measure.records.load_results`,
  :func:`~tutorial_pkg.measure.records.hardware_info`) and tables;
* here: :func:`compare` -- several cases measured side by side, in interleaved rounds,
  each related to a named reference (:class:`Case` adds parameters, the bytes a case
  holds between calls, what to free once it is measured, and its expected footprint: a
  case that would not fit in the device's free memory is skipped with the reason; on a GPU
  the L2 cache is flushed before every timed run);
* here too, for reading a GPU's numbers: :func:`attention_work` (the useful FLOPs and the
  least memory traffic of one attention call, as a :class:`Work`, whose
  :meth:`~Work.rates` are TFLOP/s and GB/s to set against the device's peak) and
  :func:`sdpa_kernels` (which kernel ``scaled_dot_product_attention`` really ran, read
  from the profiler).

The suites that use it (attention per encoding and backend, RoPE, a training step of the
tiny LM), their names and command line, and the articles' own code kept as a baseline
live in the repository's ``benchmarks/`` folder, not in the package.

Example:
    >>> import torch
    >>> from tutorial_pkg import measure as bm
    >>> x = torch.randn(64, 64)
    >>> recs = bm.compare({"matmul": lambda: x @ x, "copy": x.clone}, "copy",
    ...                   device="cpu", max_time_s=0.01, measure_memory=False)
    >>> [r.case for r in recs], recs[1].ratio
    (['matmul', 'copy'], 1.0)
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._checks import check_callable, check_nonneg_int, check_positive_float, check_positive_int
from .memory import (
    MEMORY_HEADROOM,
    MEMORY_RESERVE_BYTES,
    Footprint,
    MemoryStat,
    available_memory,
    fit_problem,
    peak_memory,
    profiled,
)
from .records import (
    SCHEMA_VERSION,
    BenchRecord,
    Results,
    format_table,
    hardware_info,
    load_results,
    save_results,
    text_table,
)
from .timing import Timing, resolve_device, time_fn

__all__ = [
    # here
    "SDPA_KERNELS",
    "Case",
    "Work",
    "attention_work",
    "compare",
    "sdpa_kernels",
    # timing
    "Timing",
    "resolve_device",
    "time_fn",
    # memory
    "MEMORY_HEADROOM",
    "MEMORY_RESERVE_BYTES",
    "Footprint",
    "MemoryStat",
    "available_memory",
    "fit_problem",
    "peak_memory",
    "profiled",
    # records
    "SCHEMA_VERSION",
    "BenchRecord",
    "Results",
    "format_table",
    "hardware_info",
    "load_results",
    "save_results",
    "text_table",
]



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
            stored as :attr:`~tutorial_pkg.measure.records.BenchRecord.held_bytes`.
        release: Optional zero-argument callable that frees what the case holds
            (its cached tables, its buffers). :func:`compare` calls it after each
            round of the case (timing, and in the last round memory and ``held``),
            so that the next case starts without it; a later round's warm-up
            rebuilds it, untimed.
        footprint: Optional expected :class:`~tutorial_pkg.measure.memory.Footprint`; if it
            would not fit in the memory available when the case is due
            (:func:`~tutorial_pkg.measure.memory.available_memory`,
            :func:`~tutorial_pkg.measure.memory.fit_problem`), the case is skipped and its record
            says why.
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
    flush_l2: bool | None = None,
    order_seed: int | None = None,
) -> list[BenchRecord]:
    """Measure several callables side by side and relate each to a reference.

    Each case's first call is timed on its own
    (:attr:`~tutorial_pkg.measure.records.BenchRecord.first_call_ms`: compilation, cache
    building), then :func:`~tutorial_pkg.measure.timing.time_fn` warms up and measures.
    All cases are measured in this one call -- same process, same machine
    state, minutes apart at most -- which is what makes their ratios
    meaningful: absolute times move with clocks, temperature and driver
    versions, ratios to a reference measured alongside move much less. With
    ``rounds > 1`` the cases are measured in turn, round after round, and each
    case's samples are pooled, so that a slow drift of the machine spreads over
    every case instead of biasing whichever ran last; the ratio is then the
    median of the per-round ratios (each case against the reference measured in
    the same round, seconds apart), which is robust on a shared machine.

    **Order.** Without ``order_seed`` every round runs the reference first, then the
    other cases in the order of ``cases``: a case's position in a round is then fixed, and
    whatever depends on it (the machine warming up or settling during a round, what the
    previous case left in caches or in the allocator) is confounded with the case. With
    ``order_seed`` every round runs all cases in a fresh random order (a permutation drawn
    from a ``torch.Generator`` seeded with it, so the same seed gives the same orders), and
    each record keeps its position in every round
    (:attr:`~tutorial_pkg.measure.records.BenchRecord.round_positions`): position effects
    then become noise shared out over the cases, not a bias of one, and one callable timed
    under two names (an A/A control) has per-round log ratios symmetric about 0.

    **Memory.** Cases are measured one at a time, and a case's memory (peak
    per call, then what it holds) is measured in the last round right after its
    timing; its :attr:`Case.release` is called after each of its rounds, so at
    most one case's caches exist at a time (on a 16 GB GPU, the tables of every
    case of a long-sequence group would not fit together). Before a case's first
    call, its :attr:`Case.footprint` is checked against
    :func:`~tutorial_pkg.measure.memory.available_memory` (with ``memory_limit``); one that
    would not fit is skipped, and so is a case with a :attr:`Case.skip` reason: its
    record has ``skipped=True`` and the reason in ``error``, no numbers.

    Args:
        cases: Case name -> zero-argument callable (or :class:`Case`).
        reference: Name of the case every ratio is relative to (the limit
            reference, e.g. PyTorch's fused attention).
        device: As in :func:`~tutorial_pkg.measure.timing.time_fn`.
        group: Group label stored in the records.
        params: Parameters shared by the cases (seq_len, dtype, pass, ...).
        warmup: See :func:`~tutorial_pkg.measure.timing.time_fn`.
        min_runs: See :func:`~tutorial_pkg.measure.timing.time_fn` (per round).
        max_time_s: See :func:`~tutorial_pkg.measure.timing.time_fn` (per round).
        rounds: Measuring rounds over all cases.
        measure_memory: Also run :func:`~tutorial_pkg.measure.memory.peak_memory` on each case.
        catch_errors: Record a failing case (``error`` set, no numbers) and go
            on, instead of raising; an unsupported backend then does not stop
            a whole suite.
        memory_limit: Bytes the process may use on the device, for the footprint
            check (default: what the device has on CUDA, no check on CPU).
        on_case_done: Called with the case name after each case (progress bars).
        flush_l2: Passed to :func:`~tutorial_pkg.measure.timing.time_fn`: on a GPU, evict the L2
            cache before every timed run, so that no case is timed on data the previous
            run left in L2 (a 50 MB L2 holds a whole small attention call). ``None``
            (the default) flushes on CUDA devices; ``False`` times warm-cache runs (state
            it when you report them). No effect on a CPU.
        order_seed: With an int >= 0, a random order of all cases in every round, drawn
            from this seed and recorded; ``None`` (the default) runs the reference first
            and the rest in the order given.

    Returns:
        One :class:`~tutorial_pkg.measure.records.BenchRecord` per case, in the order of ``cases``,
        with ``ratio`` (and ``peak_ratio``) filled when the reference succeeded.

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
        check_callable(f"cases[{name!r}]", spec.fn)
        specs[name] = spec
        case_params[name] = {**(params or {}), **spec.params}
    dev = resolve_device(device)
    if flush_l2 is None:
        flush_l2 = dev.type == "cuda"
    elif not isinstance(flush_l2, bool):
        raise TypeError(f"flush_l2 must be a bool or None, got {type(flush_l2).__name__}")
    check_positive_int("rounds", rounds)
    # Checked here, not left to time_fn: inside the loop below a bad argument
    # would be caught and recorded as a failure of every case.
    check_nonneg_int("warmup", warmup)
    check_positive_int("min_runs", min_runs)
    check_positive_float("max_time_s", max_time_s)
    if memory_limit is not None:
        check_positive_int("memory_limit", memory_limit)

    if order_seed is not None:
        check_nonneg_int("order_seed", order_seed)
    # Without a seed the reference goes first in every round: if it fails, we know early.
    order = [reference] + [n for n in specs if n != reference]
    names = list(specs)
    gen = None if order_seed is None else torch.Generator().manual_seed(order_seed)
    positions: dict[str, list[int]] = {n: [] for n in specs}
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
        if gen is not None:
            round_order = [names[i] for i in torch.randperm(len(names), generator=gen).tolist()]
        else:
            round_order = order
        for position, name in enumerate(round_order):
            positions[name].append(position)
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
                            max_time_s=max_time_s, flush_l2=flush_l2)
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
        records[name].round_positions = positions[name] if order_seed is not None else []
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
        gc.collect()
        try:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
        except RuntimeError:  # a sticky CUDA error: the next case will report it too
            pass


# --------------------------------------------------------------------------- #
# Reading a GPU's numbers: work per call, and the kernel that ran
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Work:
    """The work of one call: useful floating-point operations and least bytes moved.

    Attributes:
        flops: Floating-point operations the result needs (a multiply-add is 2).
        bytes: Bytes that must cross device memory at least once (inputs read,
            outputs written), for a kernel that keeps everything else on chip.
    """

    flops: int
    bytes: int

    @property
    def intensity(self) -> float:
        """The arithmetic intensity, FLOPs per byte.

        Above the device's peak FLOP/s over its peak bytes/s the call can be
        compute-bound; below it, it is memory-bound whatever the kernel does.
        """
        return self.flops / self.bytes

    def rates(self, median_ms: float) -> tuple[float, float]:
        """``(TFLOP/s, GB/s)`` achieved by a call of this work that took ``median_ms``.

        Set them against the device's datasheet peaks (dense 16-bit tensor-core
        TFLOP/s, memory GB/s): a fused attention kernel near its peak FLOP/s has little
        left to gain; one far below both peaks is limited by something else (launches,
        a slow path, a small problem).

        Raises:
            ValueError: If ``median_ms`` is not a positive number.
        """
        check_positive_float("median_ms", median_ms)
        seconds = median_ms * 1e-3
        return self.flops / seconds / 1e12, self.bytes / seconds / 1e9


def attention_work(
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float16,
    causal: bool = True,
    backward: bool = False,
    kv_heads: int | None = None,
    extra_bytes: int = 0,
) -> Work:
    """The useful FLOPs and the least memory traffic of one attention call.

    FLOPs: the two matrix products ``q k^T`` and ``weights v``, 2 FLOPs per
    multiply-add, over the query-key pairs the mask lets through (with ``causal``,
    query ``i`` sees keys ``0..i``, aligned top-left as ``is_causal=True`` is; a
    kernel that computes masked tiles does not get credit for them). With
    ``backward``, forward plus backward: the backward pass recomputes ``q k^T`` and
    makes four more products of the same size (dq, dk, dv and the weights'
    gradient), 2.5 times the forward's FLOPs, 3.5 times in all (FlashAttention's
    count). Softmax and scaling are left out (a few FLOPs per score, on other
    units).

    Bytes: q, k and v read once and the output written once (forward); with
    ``backward`` also the output and its gradient read, and dq, dk, dv written; plus
    the row statistics (log-sum-exp, float32) a fused kernel saves for the backward.
    That is the least any kernel can move; a path that materialises the scores or
    reads an ``(H, L, L)`` bias moves more (add it as ``extra_bytes``).

    Args:
        batch: Batch size.
        heads: Query heads.
        q_len: Queries per sequence.
        k_len: Keys per sequence.
        head_dim: Width of a head.
        dtype: Dtype of q, k, v and the output.
        causal: Count only the pairs a causal mask keeps.
        backward: Forward and backward instead of forward alone.
        kv_heads: Key/value heads (grouped-query attention); default ``heads``.
        extra_bytes: Bytes a path moves beyond the least (a materialised bias).

    Returns:
        The :class:`Work`.

    Raises:
        TypeError: If a size is not an int or ``dtype`` not a ``torch.dtype``.
        ValueError: If a size is not positive or ``kv_heads`` does not divide ``heads``.

    Example:
        >>> w = attention_work(1, 8, 1024, 1024, 64, dtype=torch.float16, causal=False)
        >>> w.flops == 4 * 8 * 1024 * 1024 * 64
        True
    """
    for name, value in (("batch", batch), ("heads", heads), ("q_len", q_len),
                        ("k_len", k_len), ("head_dim", head_dim)):
        check_positive_int(name, value)
    kv_heads = heads if kv_heads is None else kv_heads
    check_positive_int("kv_heads", kv_heads)
    if heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
    check_nonneg_int("extra_bytes", extra_bytes)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    if causal:  # query i sees min(i + 1, k_len) keys
        full = min(q_len, k_len)
        pairs = full * (full + 1) // 2 + max(q_len - k_len, 0) * k_len
    else:
        pairs = q_len * k_len
    fwd_flops = 4 * batch * heads * pairs * head_dim
    size = torch.empty((), dtype=dtype).element_size()
    q_elems, kv_elems = batch * heads * q_len * head_dim, batch * kv_heads * k_len * head_dim
    lse_bytes = batch * heads * q_len * 4
    if not backward:
        return Work(fwd_flops, size * (2 * q_elems + 2 * kv_elems) + extra_bytes)
    # forward: q, k, v in, out and lse out; backward: q, k, v, out, d_out, lse in,
    # dq, dk, dv out
    fwd_bytes = size * (2 * q_elems + 2 * kv_elems) + lse_bytes
    bwd_bytes = size * (4 * q_elems + 4 * kv_elems) + lse_bytes
    return Work(int(3.5 * fwd_flops), fwd_bytes + bwd_bytes + extra_bytes)


#: The ATen operators behind ``scaled_dot_product_attention``'s kernels, by the name
#: :func:`sdpa_kernels` reports.
SDPA_KERNELS: dict[str, str] = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "aten::_scaled_dot_product_attention_math": "math",
}


def sdpa_kernels(fn: Callable[[], Any]) -> list[str]:
    """Which kernels ``scaled_dot_product_attention`` ran during one call of ``fn``.

    SDPA picks its kernel at run time, from the device, the dtypes, the mask and
    the shapes, and falls back silently (a 3-D mask on a CPU, a mask of the wrong
    dtype, FlashAttention on a GPU older than compute capability 8.0). The
    profiler records the ATen operator it dispatched to; this runs ``fn`` once
    under :func:`~tutorial_pkg.measure.memory.profiled` and names those operators
    (:data:`SDPA_KERNELS`). Run ``fn`` once before (warm-up) if its first call does
    other work. On a GPU the operators are recorded on the host side, so no CUDA
    activity needs to be profiled.

    Args:
        fn: Zero-argument callable (e.g. an attention call).

    Returns:
        The kernels' names, sorted (``["flash (CPU)"]``, ``["math"]``,
        ``["memory-efficient"]``...); empty if ``fn`` called no SDPA kernel.

    Raises:
        TypeError: If ``fn`` is not callable.

    Example:
        >>> q = torch.randn(1, 2, 8, 16)
        >>> sdpa_kernels(lambda: torch.nn.functional.scaled_dot_product_attention(
        ...     q, q, q, attn_mask=torch.zeros(2, 8, 8)))  # a 3-D mask
        ['math']
    """
    check_callable("fn", fn)
    with profiled() as prof:
        fn()
    keys = {e.key for e in prof.key_averages()}
    return sorted(name for op, name in SDPA_KERNELS.items() if op in keys)
