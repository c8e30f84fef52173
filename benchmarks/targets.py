"""The book's performance targets (P1-P4), read from the records of one suite run.

Each target is a ratio of two cases measured side by side in the same run (see
``benchmarks/README.md``, "Performance targets"); :func:`check_targets` says for each
whether it passed, missed or was not measured, :func:`format_targets` prints one line per
target, and :func:`one_off_costs` lists the first calls (compiling) that no median includes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tutorial_pkg.measure.records import BenchRecord  # noqa: E402

__all__ = ["Target", "check_targets", "format_targets", "one_off_costs", "targets"]


@dataclass
class Target:
    """One performance target: a name, a threshold, and how to read it from records."""

    name: str
    text: str
    limit: float
    direction: str  # "max": value <= limit passes; "min": value >= limit passes
    value: Callable[[dict], float | None]
    group: str  # the suite group whose cases the value is read from


def _find(records: dict, group: str, case: str):
    rec = records.get((group, case))
    return None if rec is None or not rec.ok else rec


def _ratio(group: str, case: str, **sizes) -> Callable[[dict], float | None]:
    """The case's ratio; None if absent, failed, or measured at other ``sizes`` (params)."""

    def get(records: dict) -> float | None:
        rec = _find(records, group, case)
        if rec is None or any(rec.params.get(k) != v for k, v in sizes.items()):
            return None
        return rec.ratio

    return get


def _speedup(group: str, slow: str, fast: str) -> Callable[[dict], float | None]:
    def get(records: dict) -> float | None:
        a, b = _find(records, group, slow), _find(records, group, fast)
        return None if a is None or b is None or not b.ratio else a.ratio / b.ratio

    return get


def _peak_ratio(group: str, case: str) -> Callable[[dict], float | None]:
    def get(records: dict) -> float | None:
        rec = _find(records, group, case)
        return None if rec is None else rec.peak_ratio

    return get


def _held_fraction(group: str, case: str) -> Callable[[dict], float | None]:
    """Held bytes over the size of one (H, L, L) float32 tensor."""

    def get(records: dict) -> float | None:
        rec = _find(records, group, case)
        if rec is None or rec.held_bytes is None:
            return None
        heads, length = rec.params["heads"], rec.params["seq_len"]
        return rec.held_bytes / (heads * length * length * 4)

    return get


def targets() -> list[Target]:
    """The performance targets (P1-P4), on the records of one run."""
    out = []
    for length in (2048, 4096):
        group = f"attn L={length} fwd"
        out.append(Target(
            f"P1 fwd L={length}", "ALiBi inference (auto) / plain causal SDPA", 1.10, "max",
            _ratio(group, "alibi/auto"), group))
    group = "attn L=2048 fwd"
    out.append(Target("P1 article L=2048", "the articles' ALiBi / ALiBi auto (speed-up)", 3.0,
                      "min", _speedup(group, "alibi/article", "alibi/auto"), group))
    for length in (2048, 4096):
        group = f"attn L={length} fwd+bwd"
        out.append(Target(
            f"P1 fwd+bwd L={length}", "ALiBi training (auto) / plain causal SDPA", 2.0, "max",
            _ratio(group, "alibi/auto"), group))
    group = "attn L=4096 fwd"
    out.append(Target("P2 peak L=4096", "ALiBi auto peak memory / plain causal SDPA's", 1.5,
                      "max", _peak_ratio(group, "alibi/auto"), group))
    out.append(Target("P2 held L=4096", "ALiBi auto held memory / one (H, L, L) fp32 bias",
                      0.01, "max", _held_fraction(group, "alibi/auto"), group))
    for dtype, limit in (("float32", 1.3), ("bfloat16", 2.0)):
        out.append(Target(f"P3 {dtype} rotate fused", "RoPE fused=True on q, k / clone of q, k",
                          limit, "max",
                          _ratio(f"rope {dtype}", "rotate fused", shape=[4, 8, 2048, 64]),
                          f"rope {dtype}"))
    for dtype, limit in (("float32", 3.0), ("bfloat16", 5.0)):
        out.append(Target(f"P3 {dtype} rotate", "RoPE default path on q, k / clone of q, k",
                          limit, "max",
                          _ratio(f"rope {dtype}", "rotate", shape=[4, 8, 2048, 64]),
                          f"rope {dtype}"))
    for enc in ("rope", "alibi", "hybrid"):
        out.append(Target(f"P4 {enc}", f"tiny-LM training step, {enc} / NoPE", 1.10, "max",
                          _lm_ratio(enc), "lm step L=64"))
    return out


def _lm_ratio(enc: str) -> Callable[[dict], float | None]:
    def get(records: dict) -> float | None:
        for (group, case), rec in records.items():
            sizes = (rec.params.get("batch"), rec.params.get("seq_len"))
            if group.startswith("lm step") and case == enc and rec.ok and sizes == (32, 64):
                return rec.ratio
        return None  # not measured, or at other sizes than chapter 7's (batch 32, L = 64)

    return get


def check_targets(records: Iterable[BenchRecord]) -> list[tuple[Target, float | None, str]]:
    """Evaluate every target: ``(target, value or None, "PASS"/"MISS"/"not measured")``."""
    by_key = {(r.group, r.case): r for r in records}
    results = []
    for t in targets():
        value = t.value(by_key)
        if value is None:
            verdict = "not measured"
        elif t.direction == "max":
            verdict = "PASS" if value <= t.limit else "MISS"
        else:
            verdict = "PASS" if value >= t.limit else "MISS"
        results.append((t, value, verdict))
    return results


def format_targets(results: list[tuple[Target, float | None, str]]) -> str:
    """One line per target."""
    lines = []
    for t, value, verdict in results:
        sign = "<=" if t.direction == "max" else ">="
        shown = "-" if value is None else f"{value:.3f}"
        lines.append(f"{verdict:>12}  {t.name:<24} {shown:>8} (target {sign} {t.limit:g})  "
                     f"{t.text}")
    return "\n".join(lines)


def one_off_costs(records: Iterable[BenchRecord]) -> str:
    """First calls that took over a second *and* 3x the median (compiling, cache building)."""
    lines = [
        f"  {r.group:<20} {r.case:<22} first call {r.first_call_ms / 1e3:6.1f} s "
        f"(median afterwards {r.median_ms:.2f} ms)"
        for r in records
        if r.first_call_ms is not None and r.median_ms is not None
        and r.first_call_ms > max(1000.0, 3 * r.median_ms)
    ]
    return "\n".join(lines) if lines else "  (none over 1 s and 3x the median)"
