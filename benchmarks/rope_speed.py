"""RoPE speed on a CPU: the package's default path next to a copy of q, k and Hugging Face's.

Measures, side by side in one run and per dtype (float32, bfloat16), in interleaved rounds
with one thread, inference (no autograd):

* ``copy q,k`` (the reference): ``q.clone(), k.clone()``, the same definition as the
  ``rope`` group of ``benchmarks/suite.py`` (its limit case), on the same shape
  (``--shape``, default the suite's ``4 8 2048 64``);
* ``rotate (attention)``: :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding` on q and k as
  attention calls it (``rope(q, k, pos, pos, check_positions=False)`` with ``pos =
  arange(s)[None]``, so the cos/sin tables are built in the call);
* ``rotate``: ``rope(q, k)`` (default positions: the cached tables);
* ``apply_rope``: the public function, on the cached tables (the same rotation as ``rotate``,
  plus its argument checks);
* ``spec``: ``rope._rope``, the rotation as the math reads (four products, a difference, a
  sum, a concatenation), the form the fast path is tested against;
* ``rotate interleaved`` and ``meta complex``: the interleaved layout, the package's
  default (``RotaryEmbedding(layout="interleaved")``) and Meta's ``apply_rotary_emb`` form
  (:func:`~tutorial_pkg.encodings.rope.apply_rope_complex` on a cached ``freqs_cis``);
* ``rotate fused``: ``RotaryEmbedding(fused=True)``, the compiled kernel (its compilation
  falls in the warm-up);
* ``one multiply``: ``x * [cos, cos]`` into a fresh output, one eager elementwise pass with
  a broadcast table: the floor under any eager form of the rotation, which needs at least
  this pass (the limit ``copy q,k`` is a plain memory copy);
* ``hf apply_rotary_pos_emb``: ``transformers.models.llama.modeling_llama``'s eager
  function on Hugging Face's ``[1, s, h_d]`` tables in q's dtype (built once, outside the
  timing, as its model does once per forward pass), when transformers is installed.

The performance targets (:data:`TARGETS`) are constants of this script, fixed before the
run; the results store them (``targets``) and each one's decision (``decided``): the median
over rounds of the per-round ratio, and its range over rounds.

The results file (``--out``) holds the records (:func:`tutorial_pkg.measure.cases.save_results`:
hardware, load average at start and end, glibc's setting) and a ``summary``: per dtype and
case the ratio to the copy (the median over rounds of the paired per-round ratio) with the
range over rounds.

    python benchmarks/rope_speed.py --out book/data/rope_speed_cpu.json
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.allocator import keep_freed_memory  # noqa: E402
from tutorial_pkg import measure as bm  # noqa: E402
from tutorial_pkg.encodings.rope import (  # noqa: E402
    RotaryEmbedding,
    _rope,
    apply_rope,
    apply_rope_complex,
    precompute_freqs_cis,
)

REFERENCE = "copy q,k"
DTYPES = ("float32", "bfloat16")
HF = "hf apply_rotary_pos_emb"
#: The targets of the package's default rotation, fixed before the run: (name, dtype, case,
#: against, bound): the median over rounds of ``case / against`` must be at most ``bound``.
TARGETS = (
    ("interleaved fp32 <= 1.2x copy", "float32", "rotate interleaved", REFERENCE, 1.2),
    ("half fp32 <= 2x copy", "float32", "rotate", REFERENCE, 2.0),
    ("half bf16 <= 0.75x HF eager", "bfloat16", "rotate", HF, 0.75),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs=4, default=[4, 8, 2048, 64],
                   metavar=("B", "H", "S", "D"), help="q/k shape (default: the suite's rope shape)")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--max-time", type=float, default=0.3, help="seconds per case and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's malloc settings alone (default: keep freed blocks)")
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face's function")
    p.add_argument("--out", type=Path, default=None, help="results file (JSON)")
    return p


def _hf_apply():
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError:
        return None
    return apply_rotary_pos_emb


def rope_cases(shape, dtype: torch.dtype, *, hf: bool = True) -> dict:
    """The cases of one dtype: zero-argument callables on inputs built here."""
    b, h, s, d = shape
    gen = torch.Generator().manual_seed(s)
    q, k = (torch.randn(b, h, s, d, generator=gen).to(dtype) for _ in range(2))
    rope = RotaryEmbedding(d)
    pos = torch.arange(s)[None]  # what attention passes: [1, s]
    cos, sin = rope.cos_sin(start=0, length=s)

    def no_grad(fn):
        def call():
            with torch.no_grad():
                return fn()
        return call

    inter = RotaryEmbedding(d, layout="interleaved")
    fused = RotaryEmbedding(d, fused=True)
    cos2 = torch.cat((cos, cos), -1).to(dtype)  # [s, d]
    freqs_cis = precompute_freqs_cis(d, s)
    cases = {
        REFERENCE: no_grad(lambda: (q.clone(), k.clone())),
        "rotate (attention)": no_grad(lambda: rope(q, k, pos, pos, check_positions=False)),
        "rotate": no_grad(lambda: rope(q, k)),
        "apply_rope": no_grad(lambda: (apply_rope(q, cos, sin), apply_rope(k, cos, sin))),
        "spec": no_grad(lambda: (_rope(q, cos, sin, "half"), _rope(k, cos, sin, "half"))),
        "rotate interleaved": no_grad(lambda: inter(q, k)),
        "meta complex": no_grad(lambda: (apply_rope_complex(q, freqs_cis),
                                         apply_rope_complex(k, freqs_cis))),
        "rotate fused": no_grad(lambda: fused(q, k)),
        "one multiply": no_grad(lambda: (q * cos2, k * cos2)),
    }
    apply_hf = _hf_apply() if hf else None
    if apply_hf is not None:
        cos_hf = torch.cat((cos, cos), -1)[None].to(dtype)  # [1, s, d], halves duplicated
        sin_hf = torch.cat((sin, sin), -1)[None].to(dtype)
        cases[HF] = no_grad(lambda: apply_hf(q, k, cos_hf, sin_hf))
    return cases


def summarize(records) -> dict:
    """``{dtype: {case: {"ratio", "round_min", "round_max", "median_ms"}}}``."""
    out: dict = {}
    for r in records:
        if not r.ok:
            continue
        rounds = r.round_ratios or [r.ratio]
        out.setdefault(r.params["dtype"], {})[r.case] = {
            "ratio": round(r.ratio, 3), "round_min": round(min(rounds), 3),
            "round_max": round(max(rounds), 3), "median_ms": round(r.median_ms, 4),
        }
    return out


def decide_targets(records) -> list[dict]:
    """Each target of :data:`TARGETS` decided from the records: the median and range over
    rounds of the per-round ratio ``case / against`` (both timed in the same round)."""
    by = {(r.params["dtype"], r.case): r for r in records if r.ok and r.round_ratios}
    out = []
    for name, dtype, case, against, bound in TARGETS:
        if (dtype, case) not in by or (dtype, against) not in by:
            out.append({"target": name, "bound": bound, "met": None, "note": "not measured"})
            continue
        per_round = sorted(a / b for a, b in zip(by[dtype, case].round_ratios,
                                                 by[dtype, against].round_ratios, strict=True))
        n = len(per_round)
        median = (per_round[(n - 1) // 2] + per_round[n // 2]) / 2
        out.append({"target": name, "dtype": dtype, "case": case, "against": against,
                    "bound": bound, "median": round(median, 3),
                    "round_min": round(per_round[0], 3), "round_max": round(per_round[-1], 3),
                    "met": median <= bound})
    return out


def main(argv=None) -> list:
    args = build_parser().parse_args(argv)
    if args.threads < 1 or args.rounds < 1:
        raise SystemExit("--threads and --rounds must be >= 1")
    torch.set_num_threads(args.threads)
    kept = False if args.default_malloc else keep_freed_memory()
    hardware = bm.hardware_info("cpu")
    hardware["malloc"] = "glibc keeps freed blocks (mmap threshold 32 MiB)" if kept else "default"
    print(f"{hardware['cpu']}, torch {hardware['torch']}, {hardware['num_threads']} thread(s), "
          f"load average {hardware['loadavg']}", flush=True)
    records = []
    targets = [{"target": name, "dtype": dtype, "case": case, "against": against, "bound": bound}
               for name, dtype, case, against, bound in TARGETS]  # fixed before timing
    for name in args.dtypes:
        params = {"op": "rope", "shape": list(args.shape), "dtype": name, "pass": "fwd"}
        recs = bm.compare(rope_cases(args.shape, getattr(torch, name), hf=not args.no_hf),
                          REFERENCE, device="cpu", group=f"rope {name}", params=params,
                          warmup=args.warmup, min_runs=args.min_runs, max_time_s=args.max_time,
                          rounds=args.rounds, measure_memory=False)
        print(bm.format_table(recs), flush=True)
        records += recs
    hardware["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    summary = summarize(records)
    for name, cases in summary.items():
        print(name, {c: v["ratio"] for c, v in cases.items()})
    decided = decide_targets(records)
    for d in decided:
        print(f"target {d['target']}: median {d.get('median')} "
              f"(rounds {d.get('round_min')}-{d.get('round_max')}), met: {d['met']}")
    if args.out is not None:
        import json

        hardware["command"] = "python benchmarks/rope_speed.py " + shlex.join(
            sys.argv[1:] if argv is None else list(argv))
        path = bm.save_results(records, args.out, hardware)
        data = json.loads(path.read_text(encoding="utf-8"))
        data["targets"] = targets
        data["summary"] = summary
        data["decided"] = decided
        path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
