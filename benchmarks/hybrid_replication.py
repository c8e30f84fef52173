"""Chapter 6's replication on fresh seeds: the ablation, a slope sweep, accuracy past L.

Usage (from the repository root)::

    python benchmarks/hybrid_replication.py --claims-only      # the family into the record; commit
    taskset -c 0 python benchmarks/hybrid_replication.py --threads 1   # the recorded run
    python benchmarks/hybrid_replication.py --quick --seeds 25 --out /tmp/r.json  # smoke test

Why: the ablation (``hybrid_ablation.py``) paired its new variants with the stored models of
seeds 5-24, the very draws whose gap raised its question; and every claim of chapter 6 at
128 tokens scored the whole window, whose first 32 positions lie inside the trained length L.
This run trains **every** variant afresh on seeds 25-44 (used by no earlier record: the pilot
was 0-4, the records 5-24), with the same tasks, sizes, steps and optimiser, and tests on
test seed ``TEST_SEED_BASE + seed``. Per model it stores the accuracy over the whole window at
each length (``acc_{n}``) and over the targets past L alone (``acc_past_{n}``, positions
``>= TASK_TRAIN_LEN``, from :func:`~tutorial_pkg.experiments.tasks.evaluate_task`'s
``from_position``).

The family :data:`CLAIMS`, written into the record (``--claims-only``) and committed before
anything is trained (the run refuses to start otherwise), has three parts, all tested by
chapter 6's paired sign-flip test with one Bonferroni correction over the whole family at
:data:`ALPHA`:

* ``replication``: the ablation's 8 claims, verbatim, on the fresh seeds;
* ``slope sweep``: the additive hybrid at c = 1 (no change to W_q) with slopes scaled by 0.25,
  0.5 (``hybrid_half``), 0.75 and 1 (``hybrid``): steeper slopes give higher recency accuracy at
  128 tokens, each step a claim. The alpha sweep moves the slopes and W_q's scale together
  (c = alpha); this moves the slopes alone;
* ``past L``: chapter 6's 128-token accuracy claims (offset: each hybrid > RoPE; recency: ALiBi
  and each hybrid > RoPE, ALiBi > hybrid, learnable > hybrid, hybrid > seed_alpha and
  hybrid_half) scored on the targets past L only.

A pre-run check on the first seed: the init+lr control reproduces the mix (``seed_alpha``)
trained in the same run, within :data:`CHECK_TOL` at every length.
"""

from __future__ import annotations

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
import benchmarks.hybrid_ablation as abl  # noqa: E402
from benchmarks.preregister import run_fields, start_header, write_claims  # noqa: E402
from tutorial_pkg.encodings.builtin import Hybrid  # noqa: E402
from tutorial_pkg.experiments.tasks import (  # noqa: E402
    TASKS,
    evaluate_task,
    test_batches,
    train_task,
)
from tutorial_pkg.measure.cases import hardware_info  # noqa: E402

OUT = "book/data/hybrid_replication.json"
SEEDS = list(range(25, 45))
L = ch6.TASK_TRAIN_LEN
PAST_LENS = tuple(n for n in ch6.TASK_EVAL_LENS if n > L)
CHECK_TOL = abl.CHECK_TOL
ALPHA = ch6.CH6_ALPHA
#: slope factors of the sweep trained as new labels (0.5 is hybrid_half, 1 is hybrid)
SLOPES = (0.25, 0.75)
#: label -> (encoding name, kwargs) for train_task, or a control of hybrid_ablation
VARIANTS = {
    **{k: v for k, v in ch6.TASK_VARIANTS.items()},
    **abl.VARIANTS,
    **{f"slope_{s}": ("slope", {"bias_scale": s}) for s in SLOPES},
}


def _acc(task, encoding, length=128):
    return {"task": task, "encoding": encoding, "length": length}


def _past(task, encoding, length=128):
    return {"task": task, "encoding": encoding, "length": f"past_{length}"}


_HYB = ("hybrid", "hybrid_learnable", "seed_alpha", "hybrid_half")
CLAIMS = (
    *({**c, "part": "replication"} for c in abl.CLAIMS),
    *({"claim": f"latest@128: {a} > {b}", "test": "greater", "part": "slope sweep",
       "a": _acc("latest", a), "b": _acc("latest", b)}
      for a, b in (("hybrid", "slope_0.75"), ("slope_0.75", "hybrid_half"),
                   ("hybrid_half", "slope_0.25"))),
    *({"claim": f"offset past L@128: {k} > rope", "test": "greater", "part": "past L",
       "a": _past("offset", k), "b": _past("offset", "rope")} for k in _HYB),
    *({"claim": f"latest past L@128: {k} > rope", "test": "greater", "part": "past L",
       "a": _past("latest", k), "b": _past("latest", "rope")} for k in ("alibi", *_HYB)),
    *({"claim": f"latest past L@128: {a} > {b}", "test": "greater", "part": "past L",
       "a": _past("latest", a), "b": _past("latest", b)}
      for a, b in (("alibi", "hybrid"), ("hybrid_learnable", "hybrid"),
                   ("hybrid", "seed_alpha"), ("hybrid", "hybrid_half"))),
)
DESIGN = {
    "question": "reviewer of chapter 6: the ablation reused the stored draws (seeds 5-24) that "
                "prompted it; the alpha sweep confounds the slopes with W_q's scale; every "
                "128-token claim scored the whole window, a quarter of it inside L",
    "seeds": "25-44, fresh: the pilot was 0-4, hybrid_results.json and hybrid_ablation.json "
             "5-24; every variant is trained here, none is copied",
    "variants": "chapter 6's six (extrapolation_seeds.TASK_VARIANTS), the ablation's four "
                "(hybrid_ablation.VARIANTS), and the additive hybrid at slopes x0.25 and "
                "x0.75 with W_q untouched (c = 1)",
    "past_L": f"acc_past_n: top-1 accuracy over the targets at positions >= {L} (the trained "
              "length) of the same test windows",
    "check": f"before the loop, seed {SEEDS[0]}: init+lr control vs seed_alpha of this run, "
             f"every length within {CHECK_TOL}",
    "budget": "12 variants x 20 seeds x 2 tasks = 480 models (about 30 min on one core)",
}


def train_variant(label, task, seed, steps, device):
    v = VARIANTS[label]
    if isinstance(v, dict):  # a control of the ablation
        return abl.train_variant(label, task, seed, steps, device)
    name, kwargs = v
    if name is None:  # hybrid_half: the additive hybrid at half slopes
        name, kwargs = "slope", {"bias_scale": 0.5}
    if name == "slope":
        encoding, kwargs = Hybrid(abl.D_MODEL // abl.N_HEADS, abl.N_HEADS, **kwargs), {}
    else:
        encoding = name
    return train_task(task, encoding, seed, encoding_kwargs=kwargs or None, steps=steps,
                      train_len=L, eval_lens=ch6.TASK_EVAL_LENS,
                      test_seed=ch6.TEST_SEED_BASE + seed, device=device)


def header():
    return {"description": "Chapter 6 replication on fresh seeds 25-44: the ablation's family, "
                           "a slope sweep at c = 1 and the 128-token claims past L; every variant "
                           "trained in this run; a pre-registered family, written and committed "
                           "before any model was trained",
            "design": DESIGN, "claims": [dict(c) for c in CLAIMS], "alpha": ALPHA,
            "test": ch6.CH6_TEST, "monotone_claims": abl.MONOTONE,
            "check_tolerance": CHECK_TOL,
            "claims_written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "status": "claims"}


def decide(payload):
    decided = ch6.decide_ch6(payload, claims=payload["claims"], alpha=payload["alpha"])
    verdicts = {d["claim"]: d["verdict"] for d in decided}
    monotone = {"claims": payload["monotone_claims"],
                "holds": all(verdicts[c] == "holds" for c in payload["monotone_claims"])}
    return decided, monotone


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--claims-only", action="store_true")
    p.add_argument("--seeds", nargs="+", type=int, default=SEEDS)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="20 steps, no commit check (smoke)")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
    if args.claims_only:
        write_claims(out, header())
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = 20 if args.quick else ch6.TASK_STEPS
    if not args.quick and args.seeds != SEEDS:
        raise SystemExit(f"the recorded run uses seeds {SEEDS}")
    pre = start_header(out, header(), quick=args.quick)
    t0 = time.perf_counter()
    payload = {**pre, **run_fields("hybrid_replication.py", argv, args.device),
               "train_len": L, "eval_lens": list(ch6.TASK_EVAL_LENS),
               "past_lens": list(PAST_LENS), "steps": steps,
               "test_seed_base": ch6.TEST_SEED_BASE, "seeds": args.seeds,
               "variants": {k: (v if isinstance(v, dict) else list(v))
                            for k, v in VARIANTS.items()}}
    records, check = [], []
    for seed in args.seeds:
        t1 = time.perf_counter()
        for task in TASKS:
            batches = test_batches(task, ch6.TEST_SEED_BASE + seed, ch6.TASK_EVAL_LENS)
            for label in VARIANTS:
                acc, model = train_variant(label, task, seed, steps, args.device)
                se = evaluate_task(model, batches)
                past = evaluate_task(model, batches, from_position=L)
                records.append({"seed": seed, "task": task, "encoding": label,
                                **{f"acc_{n}": a for n, a in acc.items()},
                                **{f"se_{n}": r["se"] for n, r in se.items()},
                                **{f"acc_past_{n}": r["accuracy"] for n, r in past.items()},
                                **{f"se_past_{n}": r["se"] for n, r in past.items()}})
            if seed == args.seeds[0]:
                row = {r["encoding"]: r for r in records
                       if r["seed"] == seed and r["task"] == task}
                both, _ = abl.train_control(task, seed, init_scale=abl.C, lr_scale=abl.C,
                                            steps=steps, device=args.device)
                diff = max(abs(both[n] - row["seed_alpha"][f"acc_{n}"])
                           for n in ch6.TASK_EVAL_LENS)
                check.append({"check": "init+lr vs seed_alpha", "task": task, "seed": seed,
                              "max_abs_diff": diff, "within": diff <= CHECK_TOL})
                print(f"check {task}: max |diff| {diff:.2e}", flush=True)
                if not args.quick and diff > CHECK_TOL:
                    payload.update({"status": "check failed", "check": check,
                                    "records": records})
                    out.write_text(json.dumps(payload, indent=1) + "\n")
                    raise SystemExit("the check failed: the controls are not what the design "
                                     "says")
        payload.update({"records": records, "check": check})
        out.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")  # partial
        print(f"seed {seed}: {time.perf_counter() - t1:.0f} s", flush=True)
    payload.update({"run_time_s": time.perf_counter() - t0, "status": "done",
                    "hardware_end": hardware_info(args.device)})
    payload["decided"], payload["monotone"] = decide(payload)
    out.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    for d in payload["decided"]:
        print(f"  {d['claim']:52s} {d.get('mean', float('nan')):+.3f} "
              f"[{d.get('low', float('nan')):+.3f}, {d.get('high', float('nan')):+.3f}] "
              f"{d['verdict']}")
    print(f"monotone in alpha (recency at 128): {payload['monotone']['holds']}")
    print(f"wrote {out}: {len(records)} records, {payload['run_time_s']:.0f} s")


if __name__ == "__main__":
    main()
