"""Chapter 6: the learnable hybrid's slope scales c_h, on fresh seeds, both tasks.

    python benchmarks/ch6_learned_slopes.py --claims-only   # the claim into the record; commit
    python benchmarks/ch6_learned_slopes.py --threads 1     # then train (refuses otherwise)

Trains ``hybrid_learnable`` exactly as ``benchmarks/extrapolation_seeds.py`` does
(``TASK_VARIANTS``, the same ``train_task`` settings: train length, evaluation lengths, steps,
test seeds) on seeds 25-44, which neither chapter 6's record (5-24) nor its pilot (0-4) used,
on both tasks, and stores each head's learned slope scale ``c_h = exp(log_scale_h)``.

The one claim (:data:`CLAIMS`), exploratory, is written into the record and committed before
anything is trained: per task, in at least 18 of the 20 seeds every head's c_h is above 1.
"""

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchmarks.extrapolation_seeds as ch6  # noqa: E402
from benchmarks.preregister import run_fields, start_header, write_claims  # noqa: E402
from tutorial_pkg.experiments.tasks import TASKS, train_task  # noqa: E402

OUT = "book/data/ch6_learned_slopes.json"
SEEDS = list(range(25, 45))
LABEL = "hybrid_learnable"
MIN_SEEDS = 18
CLAIMS = [{"claim": f"{task}: every head's c_h > 1 in at least {MIN_SEEDS} of {len(SEEDS)} seeds",
           "task": task, "min_seeds": MIN_SEEDS, "kind": "exploratory"} for task in TASKS]


def header():
    return {"description": "chapter 6's learnable hybrid: each head's learned slope scale c_h "
                           "on fresh seeds, both tasks (exploratory claim fixed before the run)",
            "claims": [dict(c) for c in CLAIMS],
            "claims_written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "status": "claims"}


def decide(records):
    out = []
    for c in CLAIMS:
        rows = [r for r in records if r["task"] == c["task"]]
        n = sum(all(v > 1 for v in r["c_h"]) for r in rows)
        out.append({"claim": c["claim"], "task": c["task"], "seeds_all_above_1": n,
                    "n_seeds": len(rows), "verdict": "holds" if n >= c["min_seeds"] else "fails"})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--claims-only", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    out = ROOT / args.out
    if args.claims_only:
        write_claims(out, header())
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    pre = start_header(out, header(), quick=False)
    name, kwargs = ch6.TASK_VARIANTS[LABEL]
    payload = {**pre, **run_fields("ch6_learned_slopes.py", argv),
               "variant": [name, kwargs], "train_len": ch6.TASK_TRAIN_LEN,
               "eval_lens": list(ch6.TASK_EVAL_LENS), "steps": ch6.TASK_STEPS,
               "test_seed_base": ch6.TEST_SEED_BASE, "seeds": SEEDS}
    records, t0 = [], time.perf_counter()
    for seed in SEEDS:
        for task in TASKS:
            acc, model = train_task(task, name, seed, encoding_kwargs=kwargs or None,
                                    steps=ch6.TASK_STEPS, train_len=ch6.TASK_TRAIN_LEN,
                                    eval_lens=ch6.TASK_EVAL_LENS,
                                    test_seed=ch6.TEST_SEED_BASE + seed, device="cpu")
            c_h = model.encoding.log_scale.exp().detach().cpu().tolist()
            records.append({"seed": seed, "task": task, "c_h": c_h,
                            **{f"acc_{n}": a for n, a in acc.items()}})
        print(f"seed {seed}: " + "; ".join(
            f"{r['task']} " + ", ".join(f"{v:.2f}" for v in r["c_h"])
            for r in records[-len(TASKS):]), flush=True)
    payload.update({"records": records, "run_time_s": time.perf_counter() - t0,
                    "status": "done", "decided": decide(records)})
    out.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    for d in payload["decided"]:
        print(f"  {d['claim']}: {d['seeds_all_above_1']}/{d['n_seeds']} {d['verdict']}")


if __name__ == "__main__":
    main()
