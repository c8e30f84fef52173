"""Prove the book's GPU path on one GPU in under ten minutes, and write what it measured.

Usage (from the repository root, on a machine with a CUDA GPU and the package installed)::

    python benchmarks/gpu_check.py --out gpu_check            # everything, 540 s budget
    python benchmarks/gpu_check.py --out gpu_check --as-t4    # a 16 GB T4 rehearsed on a big GPU
    python benchmarks/gpu_check.py --out gpu_check --chapters 05_benchmarking 04_attention

Stages, in this order, each with its own time cap, all within ``--budget`` seconds:

1. ``suite``: ``benchmarks/suite.py --quick --device cuda`` (every group of the suite, tiny
   sizes; ``suite_quick.json`` and ``suite_quick.log``).
2. ``footprint``: the attention part at one long length (``--footprint-length``, 4096),
   forward and forward + backward, one timed run per case, so that every case's expected
   footprint (``attention_footprint``, recorded as ``footprint_bytes``) can be compared
   with what the GPU's allocator measured (``held_bytes + peak_bytes``); no FlexAttention
   (its footprint is that of plain attention, and it would spend the budget compiling).
3. Every chapter, executed on the GPU (a chapter with a larger GPU setting takes it there;
   the others run their stored setting on the GPU's kernels), from a copy in memory
   (nbclient), in ``book/`` as working directory; the executed notebook is written under
   ``OUT/executed/``, so nothing in ``book/`` changes. Chapters run in the order of
   :data:`CHAPTERS` (the benchmark chapter first, then by expected cost), each stopped at
   its cap or when the budget runs out; the first failing cell is recorded with its error,
   and the next chapter starts.

``OUT/summary.json`` (rewritten after every stage, so a killed run still leaves one) holds
the hardware, each stage's status (``ok``, ``error``, ``timeout``, ``not run``), its time
and cap, the first failing cell of a chapter, the suite's failed and skipped cases, and for
the footprint stage every case's estimate next to the measurement. ``OUT/summary.txt`` says
the same in lines. Exit status 0 if every stage that ran passed, 1 otherwise, 2 without
a GPU (``--allow-cpu`` runs the machinery on a CPU, for a rehearsal: the chapters then take
their CPU setting).

``--as-t4`` caps PyTorch's allocator at ``--memory-limit`` GiB (14.5: what a 16 GB T4
leaves for tensors) and makes ``torch.cuda.get_device_capability`` answer 7.5, in the
suite (``--memory-limit``) and in every chapter (a first cell inserted into the copy), so
that the plan a T4 gets (float16, no bfloat16 fused RoPE, cases that do not fit skipped)
is what runs. The kernels are still this GPU's: it proves the memory plan and the choices,
not a T4's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BOOK = REPO / "book"

#: (chapter, cap in seconds), in the order they run: the benchmark chapter first, then the
#: cheap chapters, then those that train (caps from the chapters' GPU settings: an estimate
#: for an H100-class GPU; the summary records the real times).
CHAPTERS: tuple[tuple[str, int], ...] = (
    ("05_benchmarking", 210),
    ("01_sinusoidal", 45),
    ("02_rope", 60),
    ("03_alibi", 60),
    ("10_choosing", 45),
    ("04_attention", 60),
    ("08_modern_rope", 75),
    ("06_hybrid", 90),
    ("09_debugging", 90),
    ("07_extrapolation", 180),
)
#: Caps of the two suite stages, seconds.
SUITE_CAP, FOOTPRINT_CAP = 150, 90
#: Default total budget: under ten minutes with the machine's start-up.
BUDGET_S = 540
#: What a 16 GB T4 leaves for tensors once the CUDA context is loaded, GiB.
T4_MEMORY_GIB = 14.5

#: Run a Python file as __main__ after optionally making torch report another compute
#: capability (``GPU_CHECK_CAPABILITY=7.5``): how the suite gets the T4 plan.
_LAUNCH = """
import os, runpy, sys
cap = os.environ.get("GPU_CHECK_CAPABILITY")
if cap:
    import torch
    major, minor = (int(v) for v in cap.split("."))
    torch.cuda.get_device_capability = lambda device=None: (major, minor)
path = sys.argv.pop(1)
sys.argv[0] = path
runpy.run_path(path, run_name="__main__")
"""

#: The first cell of a chapter's copy under --as-t4 (never stored in the book).
_T4_CELL = """# inserted by benchmarks/gpu_check.py --as-t4 (not part of the book): a 16 GB T4's
# memory and compute capability, rehearsed on this GPU
import torch
if torch.cuda.is_available():
    _total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, {limit} * 2**30 / _total))
    torch.cuda.get_device_capability = lambda device=None: ({major}, {minor})
"""


def _write(out: Path, summary: dict[str, Any]) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (out / "summary.txt").write_text("\n".join(summary_lines(summary)) + "\n", encoding="utf-8")


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary in lines: one per stage, then the footprint comparison."""
    hw = summary.get("hardware", {})
    lines = [f"{hw.get('device_name', '?')} (compute capability "
             f"{hw.get('compute_capability', '-')}, {hw.get('gpu_memory_gib', '-')} GiB), "
             f"torch {hw.get('torch', '?')}; budget {summary['budget_s']} s, used "
             f"{summary.get('total_s', 0):.0f} s" + ("; as a T4" if summary.get("as_t4") else "")]
    for stage in summary["stages"]:
        line = (f"{stage['status']:>8}  {stage['name']:<18} {stage.get('seconds', 0):6.0f} s "
                f"(cap {stage['cap_s']} s)")
        if stage.get("error"):
            where = f"cell {stage['failed_cell']}: " if "failed_cell" in stage else ""
            line += f"  {where}{stage['error'][:160]}"
        if stage.get("records"):
            line += (f"  {stage['records']} records, {len(stage.get('failed', []))} failed, "
                     f"{len(stage.get('skipped', []))} skipped")
        lines.append(line)
    for row in summary.get("footprints", []):
        lines.append(f"  footprint {row['group']:<20} {row['case']:<20} estimate "
                     f"{row['estimate_mib']:9.1f} MiB, measured {row['measured_mib']:9.1f} MiB"
                     + ("  OVER (past the check's headroom)" if row["over"] else ""))
    return lines


def _run_suite(args: Sequence[str], out_json: Path, log: Path, cap: float,
               env: dict[str, str]) -> dict[str, Any]:
    """One run of suite.py in a subprocess; its records summarised."""
    cmd = [sys.executable, "-c", _LAUNCH, str(REPO / "benchmarks" / "suite.py"), *args,
           "--no-progress", "--out", str(out_json)]
    start = time.monotonic()
    stage: dict[str, Any] = {"command": " ".join(["python", "benchmarks/suite.py", *args]),
                             "cap_s": int(cap)}
    with open(log, "w", encoding="utf-8") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                  timeout=cap)
            stage["status"] = "ok" if proc.returncode == 0 else "error"
            if proc.returncode:
                stage["error"] = f"exit status {proc.returncode} (see {log.name})"
        except subprocess.TimeoutExpired:
            stage["status"], stage["error"] = "timeout", f"stopped after {cap:.0f} s"
    stage["seconds"] = round(time.monotonic() - start, 1)
    stage["log"] = log.name
    if out_json.exists():
        data = json.loads(out_json.read_text(encoding="utf-8"))
        records = data["records"]
        stage["file"] = out_json.name
        stage["records"] = len(records)
        stage["failed"] = [f"{r['group']} / {r['case']}: {r['error']}" for r in records
                           if r.get("error") and not r.get("skipped")]
        stage["skipped"] = [f"{r['group']} / {r['case']}: {r['error']}" for r in records
                            if r.get("skipped")]
    return stage


def footprint_rows(records: Sequence[dict[str, Any]], headroom: float = 0.20,
                   reserve: int = 256 * 2**20) -> list[dict[str, Any]]:
    """Each measured record's expected footprint next to what was measured.

    Measured: ``held_bytes + peak_bytes`` (what the case keeps, plus the extra at the peak
    of a call after warm-up). ``over`` when that exceeds the estimate with the headroom the
    memory check leaves (``tutorial_pkg.measure.memory.MEMORY_HEADROOM`` and
    ``MEMORY_RESERVE_BYTES``, the defaults here): the check would then have let through a
    case that does not fit. ``ratio`` (measured / estimate) says how close the model is.
    """
    rows = []
    for r in records:
        if r.get("footprint_bytes") is None or r.get("peak_bytes") is None or r.get("error"):
            continue
        measured = (r.get("held_bytes") or 0) + r["peak_bytes"]
        estimate = r["footprint_bytes"]
        rows.append({"group": r["group"], "case": r["case"],
                     "estimate_mib": round(estimate / 2**20, 2),
                     "measured_mib": round(measured / 2**20, 2),
                     "ratio": round(measured / estimate, 3) if estimate else None,
                     "over": measured > estimate * (1 + headroom) + reserve})
    return rows


def _t4_cell(limit: float, capability: tuple[int, int]) -> str:
    return _T4_CELL.format(limit=limit, major=capability[0], minor=capability[1])


def run_chapter(path: Path, out: Path, cap: float, *, first_cell: str | None = None,
                kernel_name: str = "python3") -> dict[str, Any]:
    """Execute one chapter (a copy: ``path`` is only read) and write it under ``out``.

    The chapter runs with ``book/`` (``path``'s folder) as working directory and stops at
    its first failing cell or after ``cap`` seconds (the cell running then is
    interrupted). Returns its stage record: ``status``, ``seconds``, ``failed_cell`` (the
    index in the stored chapter) and ``error``, ``notebook`` (the executed copy).
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # the stored outputs must not pass for this run's
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    offset = 0
    if first_cell is not None:
        nb.cells.insert(0, nbformat.v4.new_code_cell(first_cell))
        offset = 1
    deadline = time.monotonic() + cap
    current = {"index": None}

    def on_cell_start(cell: Any = None, cell_index: int | None = None, **_: Any) -> None:
        current["index"] = cell_index

    client = NotebookClient(
        nb, kernel_name=kernel_name, allow_errors=False, interrupt_on_timeout=True,
        timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
        resources={"metadata": {"path": str(path.parent)}}, startup_timeout=120,
        on_cell_start=on_cell_start,
    )
    stage: dict[str, Any] = {"name": path.stem, "cap_s": int(cap)}
    start = time.monotonic()
    try:
        client.execute()
        stage["status"] = "ok"
    except CellTimeoutError as exc:
        stage["status"], stage["error"] = "timeout", f"stopped after {cap:.0f} s: {exc}"[:300]
    except CellExecutionError as exc:
        if exc.ename == "KeyboardInterrupt" and time.monotonic() >= deadline - 2:
            # the cap: nbclient interrupted the cell that was running
            stage["status"], stage["error"] = "timeout", f"stopped after {cap:.0f} s"
        else:
            stage["status"] = "error"
            stage["error"] = f"{exc.ename}: {exc.evalue}"[:300]
    except DeadKernelError as exc:
        stage["status"], stage["error"] = "error", f"kernel died: {exc}"[:300]
    stage["seconds"] = round(time.monotonic() - start, 1)
    if stage["status"] != "ok" and current["index"] is not None:
        stage["failed_cell"] = current["index"] - offset  # its index in the stored chapter
    executed = out / "executed" / path.name
    executed.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, executed)
    stage["notebook"] = str(executed.relative_to(out))
    return stage


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for everything it writes")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds for all stages together (default {BUDGET_S})")
    p.add_argument("--chapters", nargs="*", default=None, metavar="NAME",
                   help="chapters to run, by file name without .ipynb (default: all, in "
                   "the order of CHAPTERS); give none to run only the suite")
    p.add_argument("--no-suite", action="store_true", help="skip the two suite stages")
    p.add_argument("--footprint-length", type=int, default=4096,
                   help="sequence length of the footprint stage (default 4096)")
    p.add_argument("--as-t4", action="store_true",
                   help="rehearse a 16 GB T4: cap the allocator at --memory-limit GiB and "
                   "report compute capability --capability")
    p.add_argument("--memory-limit", type=float, default=T4_MEMORY_GIB, metavar="GIB",
                   help=f"with --as-t4 (default {T4_MEMORY_GIB})")
    p.add_argument("--capability", default="7.5", help="with --as-t4 (default 7.5)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="run without a GPU (a rehearsal of this script: chapters take their "
                   "CPU setting)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    sys.path.insert(0, str(REPO))
    from tutorial_pkg import measure as bm

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("gpu_check: no CUDA GPU here (--allow-cpu rehearses the script on a CPU)",
              file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    order = [name for name, _ in CHAPTERS]
    caps = dict(CHAPTERS)
    if args.chapters is not None:
        unknown = [c for c in args.chapters if c not in caps]
        if unknown:
            print(f"gpu_check: unknown chapters {unknown}; known: {order}", file=sys.stderr)
            return 2
        order = [c for c in order if c in args.chapters]
    capability = tuple(int(v) for v in args.capability.split("."))
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    env = dict(os.environ)
    env.pop("CI", None)  # the chapters' GPU setting: they force the CPU one when CI is set
    env["PYTHONHASHSEED"] = "0"
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="gpu-check-inductor-"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if args.as_t4:
        env["GPU_CHECK_CAPABILITY"] = args.capability
    os.environ.clear()
    os.environ.update(env)  # the chapters' kernels inherit this environment

    start = time.monotonic()
    deadline = start + args.budget
    summary: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/gpu_check.py", *(argv or sys.argv[1:])]),
        "hardware": bm.hardware_info(device), "budget_s": args.budget, "as_t4": args.as_t4,
        "memory_limit_gib": args.memory_limit if args.as_t4 else None, "stages": [],
    }

    def left() -> float:
        return deadline - time.monotonic()

    def finish(stage: dict[str, Any]) -> None:
        summary["stages"].append(stage)
        summary["total_s"] = round(time.monotonic() - start, 1)
        _write(out, summary)
        print(summary_lines({**summary, "stages": [stage], "footprints": []})[1], flush=True)

    limit = ["--memory-limit", str(args.memory_limit)] if args.as_t4 else []
    if not args.no_suite:
        for name, cap, suite_args in (
            ("suite", SUITE_CAP, ["--quick", "--device", device, *limit]),
            ("footprint", FOOTPRINT_CAP,
             ["--device", device, "--parts", "attention", "--lengths",
              str(args.footprint_length), "--passes", "fwd", "fwd+bwd", "--backends", "naive",
              "sdpa", "auto", "--warmup", "1", "--min-runs", "1", "--max-time", "0.01",
              "--rounds", "1", *limit]),
        ):
            cap = min(cap, left())
            if cap < 5:
                finish({"name": name, "status": "not run", "cap_s": 0,
                        "error": "budget spent"})
                continue
            stem = "suite_quick" if name == "suite" else f"footprint_{args.footprint_length}"
            stage = _run_suite(suite_args, out / f"{stem}.json", out / f"{stem}.log", cap, env)
            stage["name"] = name
            if name == "footprint" and stage.get("file"):
                records = json.loads((out / stage["file"]).read_text())["records"]
                summary["footprints"] = footprint_rows(records)
                if any(row["over"] for row in summary["footprints"]):
                    stage["status"] = "error"
                    stage["error"] = "a case measured more than its footprint and headroom"
            finish(stage)

    first_cell = _t4_cell(args.memory_limit, capability) if args.as_t4 else None
    for name in order:
        cap = min(caps[name], left())
        if cap < 10:
            finish({"name": name, "status": "not run", "cap_s": 0, "error": "budget spent"})
            continue
        finish(run_chapter(BOOK / f"{name}.ipynb", out, cap, first_cell=first_cell))

    summary["total_s"] = round(time.monotonic() - start, 1)
    _write(out, summary)
    print("\n".join(summary_lines(summary)))
    print(f"wrote {out / 'summary.json'}")
    ran = [s for s in summary["stages"] if s["status"] != "not run"]
    return 0 if all(s["status"] == "ok" for s in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
