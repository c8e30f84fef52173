"""Records of measured cases, the files that store them with the hardware, and tables.

* :class:`BenchRecord` -- one measured case (timing, memory, ratio to its reference, or the
  reason it failed or was skipped); :class:`Results`, :func:`save_results` and
  :func:`load_results` -- a JSON results file that says where it was measured
  (:func:`hardware_info`).
* :func:`format_table` prints records; :func:`text_table` is the fixed-width table
  behind it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from .._checks import check_nonneg_int
from .memory import MemoryStat
from .timing import Timing, resolve_device

__all__ = [
    "SCHEMA_VERSION",
    "BenchRecord",
    "Results",
    "format_table",
    "hardware_info",
    "load_results",
    "save_results",
    "text_table",
]

#: Version of the JSON layout written by :func:`save_results`.
SCHEMA_VERSION = 1


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
        device: The device the benchmark runs on (as in
            :func:`~tutorial_pkg.measure.timing.resolve_device`).

    Returns:
        A JSON-serialisable dict with ``device``, ``device_name``, ``cpu``,
        ``num_threads`` (torch intra-op threads), ``cpu_count``, ``gpu_count``,
        ``gpu_memory_gib``, ``compute_capability`` (e.g. ``"7.5"``, CUDA only),
        ``torch``, ``cuda`` (CUDA version torch was built with, or ``None``), ``cudnn``,
        ``python``, ``os``, ``machine``,
        ``loadavg`` (1, 5 and 15-minute load averages when the OS reports them:
        on a shared machine they say how busy it was) and ``date`` (ISO 8601, UTC).
    """
    dev = resolve_device(device)
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
        round_positions: The case's position (0 = first) in each round, when
            :func:`~tutorial_pkg.measure.cases.compare` drew a random order per round
            (``order_seed``); empty when the order was fixed.
        median_ms: See :class:`~tutorial_pkg.measure.timing.Timing`; ``None`` if the case failed.
        p25_ms: See :class:`~tutorial_pkg.measure.timing.Timing`.
        p75_ms: See :class:`~tutorial_pkg.measure.timing.Timing`.
        iqr_ms: See :class:`~tutorial_pkg.measure.timing.Timing`.
        mean_ms: See :class:`~tutorial_pkg.measure.timing.Timing`.
        min_ms: See :class:`~tutorial_pkg.measure.timing.Timing`.
        n_runs: See :class:`~tutorial_pkg.measure.timing.Timing`.
        calls_per_run: See :class:`~tutorial_pkg.measure.timing.Timing`.
        timing_method: See :class:`~tutorial_pkg.measure.timing.Timing`.
        times_ms: Raw samples.
        peak_bytes: See :class:`~tutorial_pkg.measure.memory.MemoryStat`; ``None`` if not measured.
        net_bytes: See :class:`~tutorial_pkg.measure.memory.MemoryStat`.
        memory_method: See :class:`~tutorial_pkg.measure.memory.MemoryStat`.
        peak_ratio: ``peak_bytes / reference peak_bytes``.
        held_bytes: Memory the case keeps alive *between* calls (caches such as a
            cached bias table), which :attr:`peak_bytes` cannot see; ``None`` if
            the case does not say (see :class:`~tutorial_pkg.measure.cases.Case`).
        first_call_ms: Wall time of the case's very first call, before any
            warm-up: one-off costs such as compiling (FlexAttention, fused RoPE)
            or building a cache. Reported apart, never mixed into the median.
        error: ``"ExceptionType: message"`` if the case raised, ``"skipped: reason"``
            if it was not run (it would not fit in memory, or the device cannot run
            it), else ``None``. A record with an error has no timing (``median_ms``,
            ``ratio`` are ``None``) unless only its memory measurement failed; test
            :attr:`ok` before reading numbers.
        skipped: True if the case was not run at all (the reason is in ``error``).
        footprint_bytes: The case's expected :attr:`~tutorial_pkg.measure.memory.Footprint.need`
            (bytes beyond the group's inputs), when the case declared one.
    """

    group: str
    case: str
    params: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    reference: str | None = None
    ratio: float | None = None
    round_ratios: list[float] = field(default_factory=list)
    round_positions: list[int] = field(default_factory=list)
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
        """Build a record from a :class:`~tutorial_pkg.measure.timing.Timing` and an optional
        :class:`~tutorial_pkg.measure.memory.MemoryStat`."""
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
    def ratio_range(self) -> tuple[float, float] | None:
        """The lowest and highest per-round ratio (:attr:`round_ratios`), or ``None``.

        The spread of :attr:`ratio` over interleaved rounds: with ``rounds > 1`` each
        round pairs the case with the reference measured seconds before it, so the range
        says how far one round's verdict can stray. ``None`` with fewer than two rounds
        (one ratio has no spread) or when the case has no ratio.
        """
        if self.ratio is None or len(self.round_ratios) < 2:
            return None
        return float(min(self.round_ratios)), float(max(self.round_ratios))

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
    records: Iterable[BenchRecord], path: str | os.PathLike[str], hardware: Mapping[str, Any],
    *, extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``{"schema_version", "hardware", "records"}`` (and ``extra``'s keys) as JSON.

    Args:
        records: The records.
        path: Output file (parent folders are created).
        hardware: Usually :func:`hardware_info`.
        extra: More top-level keys (e.g. the claims a run was made to test, and their
            verdicts); :func:`load_results` ignores them: read the JSON for them.

    Returns:
        The path written.

    Raises:
        TypeError: If a record is not a :class:`BenchRecord` or ``hardware`` not a mapping.
        ValueError: If a number is NaN or infinite (the file would not be valid JSON), or
            ``extra`` names a key of the layout.
    """
    records = list(records)
    for i, r in enumerate(records):
        if not isinstance(r, BenchRecord):
            raise TypeError(f"records[{i}] must be a BenchRecord, got {type(r).__name__}")
    if not isinstance(hardware, Mapping):
        raise TypeError(f"hardware must be a mapping, got {type(hardware).__name__}")
    path = Path(path)
    payload = {
        "schema_version": SCHEMA_VERSION,
        "hardware": _jsonable(dict(hardware)),
        "records": [r.to_dict() for r in records],
    }
    for key, value in (extra or {}).items():
        if key in payload:
            raise ValueError(f"extra must not replace {key!r}")
        payload[key] = _jsonable(value)
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
    :func:`tutorial_pkg.experiments.training.format_table`: columns as wide as their widest
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
    (the reference row shows ``1.00 ref``). ``ratio range`` (the lowest and highest
    per-round ratio, :attr:`BenchRecord.ratio_range`), ``held MiB`` and ``1st call ms``
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
    ]
    if any(r.ratio_range is not None for r in records):
        cols.append(("ratio range", lambda r: "-" if r.ratio_range is None
                     else "{:.2f}-{:.2f}".format(*r.ratio_range)))
    cols.append(("peak MiB", lambda r: "-" if r.peak_mib is None else f"{r.peak_mib:.2f}"))
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
