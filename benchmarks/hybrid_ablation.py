"""Chapter 6's ablation of the alpha-mix: an alpha sweep and two single-factor controls.

Usage (from the repository root)::

    python benchmarks/hybrid_ablation.py --claims-only      # the family into the record; commit it
    taskset -c 0 python benchmarks/hybrid_ablation.py --threads 1   # the recorded run
    python benchmarks/hybrid_ablation.py --quick --out /tmp/a.json  # smoke test

Chapter 6 shows (its cells on the reparametrisation) that under AdamW without weight decay the
articles' alpha-mix ``Hybrid(mix="alpha", alpha=a)`` (with ``dim`` the head width, so that
``c = a``) trains *exactly* as its control, the additive hybrid at slopes ``(1 - a)``, with its
query weights ``W_q`` **initialised c times smaller** and **trained at c times the learning
rate** (Adam's ``eps`` divided by ``c``). At ``a = 0.5`` the control is the stored
``hybrid_half`` and the mix the stored ``seed_alpha`` (``book/data/hybrid_results.json``).
This run adds, as new variants only:

* ``init_only``: ``hybrid_half`` with ``W_q`` multiplied by ``c = 0.5`` after construction,
  trained like ``train_task``;
* ``lr_only``: ``hybrid_half`` with ``W_q`` in its own AdamW group at ``lr * c`` (and
  ``eps / c``: the optimiser half of the reparametrisation), initialised as the control;
* ``alpha_0.25``, ``alpha_0.75``: the mix at those alphas (``train_task`` itself).
  ``alpha = 0.5`` is the stored ``seed_alpha``; ``alpha = 1`` is RoPE exactly
  (``1 * S + 0 * B``), so the stored ``rope`` stands for it (checked on one seed, below).

Same tasks, sizes, steps, optimiser and seeds (5-24) as the stored record, and the same test
sequences per seed (test seed ``TEST_SEED_BASE + seed``): every comparison with a stored
variant is paired by seed. The two controls are ``train_task`` with a ``param_groups`` callable
that makes the two changes (:func:`train_control`); before the
run, on seed 5, init+lr together must reproduce the stored ``seed_alpha`` accuracies (and
``alpha = 1`` the stored ``rope``) within :data:`CHECK_TOL`.

The family :data:`CLAIMS` (paired sign-flip test, Bonferroni over the family at
:data:`ALPHA`, decided by ``decide_ch6`` as chapter 6's own family) is written into the record
(``--claims-only``) and committed before anything is trained; the run refuses to start unless
the committed record holds that family.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchmarks.extrapolation_seeds as ch6  # noqa: E402
import tutorial_pkg  # noqa: E402
from benchmarks.preregister import committed_header, git, write_claims  # noqa: E402
from tutorial_pkg.encodings.builtin import Hybrid  # noqa: E402
from tutorial_pkg.experiments.tasks import (  # noqa: E402
    TASKS,
    evaluate_task,
    test_batches,
    train_task,
)
from tutorial_pkg.measure.cases import hardware_info  # noqa: E402

OUT = "book/data/hybrid_ablation.json"
STORED = "book/data/hybrid_results.json"
#: the factor on W_q that alpha = 0.5 implies (dim = head width: c = alpha)
C = 0.5
#: the sweep: new alphas trained here; 0.5 is the stored seed_alpha, 1.0 the stored rope
SWEEP = (0.25, 0.75)
SWEEP_STORED = {0.5: "seed_alpha", 1.0: "rope"}
#: train_task's defaults, which the stored record used
LR, BATCH, D_MODEL, N_HEADS, VOCAB = 3e-3, 32, 32, 4, 32
#: the pre-run check: init+lr vs stored seed_alpha, alpha 1 vs stored rope, on this seed
CHECK_SEED, CHECK_TOL = 5, 0.01
#: variant label -> how it is trained
VARIANTS = {
    "init_only": {"control": "hybrid_half", "init_scale": C, "lr_scale": 1.0},
    "lr_only": {"control": "hybrid_half", "init_scale": 1.0, "lr_scale": C},
    **{f"alpha_{a}": {"encoding": "hybrid", "kwargs": {"mix": "alpha", "alpha": a}}
       for a in SWEEP},
}


def _acc(task, encoding, length=128):
    return {"task": task, "encoding": encoding, "length": length}


#: The family, fixed before the run. Each claim: paired difference a - b over seeds 5-24.
CLAIMS = (
    *({"claim": f"latest@128: {k} > hybrid_half", "test": "greater",
       "a": _acc("latest", k), "b": _acc("latest", "hybrid_half")}
      for k in ("init_only", "lr_only")),
    *({"claim": f"latest@128: seed_alpha > {k}", "test": "greater",
       "a": _acc("latest", "seed_alpha"), "b": _acc("latest", k)}
      for k in ("init_only", "lr_only")),
    {"claim": "latest@128: alpha_0.25 > seed_alpha (alpha 0.5)", "test": "greater",
     "a": _acc("latest", "alpha_0.25"), "b": _acc("latest", "seed_alpha")},
    {"claim": "latest@128: seed_alpha (alpha 0.5) > alpha_0.75", "test": "greater",
     "a": _acc("latest", "seed_alpha"), "b": _acc("latest", "alpha_0.75")},
    {"claim": "latest@128: alpha_0.75 > rope (alpha 1)", "test": "greater",
     "a": _acc("latest", "alpha_0.75"), "b": _acc("latest", "rope")},
    {"claim": "offset@128: alpha_0.75 > rope (alpha 1)", "test": "greater",
     "a": _acc("offset", "alpha_0.75"), "b": _acc("offset", "rope")},
)
ALPHA = ch6.CH6_ALPHA
#: derived statement, fixed with the family: "on recency at 128, accuracy falls as alpha rises
#: over 0.25, 0.5, 0.75, 1" holds iff the three sweep claims on latest@128 all hold
MONOTONE = [c["claim"] for c in CLAIMS if c["claim"].startswith("latest@128: alpha_0.25")
            or c["claim"].startswith("latest@128: seed_alpha (alpha")
            or c["claim"].startswith("latest@128: alpha_0.75")]
DESIGN = {
    "question": "reviewer: 'alpha must be tuned carefully' is judged from one alpha (0.5); and the "
                "gap between the alpha-mix (seed_alpha) and its control (hybrid_half) has no "
                "cause without two single-factor controls",
    "reparametrisation": "the alpha-mix at alpha = c (dim = head width) is hybrid_half with W_q "
                         "initialised c times smaller and trained at c times the learning rate "
                         "(Adam eps / c), every other weight as in the control (chapter 6)",
    "c": C,
    "init_only": "hybrid_half, W_q.mul_(c) after TinyLM(seed=seed), AdamW(lr) as train_task",
    "lr_only": "hybrid_half, W_q in its own AdamW group at lr * c and eps / c, init as control",
    "sweep_trained": [f"alpha_{a}" for a in SWEEP],
    "sweep_stored": {str(a): k for a, k in SWEEP_STORED.items()},
    "alpha_1_is_rope": "alpha = 1: score = 1 * RoPE scores + 0 * bias, the same function as RoPE; "
                       "the stored rope stands for it (checked on one seed)",
    "pairing": "same tasks, train_len, eval_lens, steps, optimiser, sizes and seeds 5-24 as "
               "book/data/hybrid_results.json, and the same test sequences per seed (test seed "
               "1000 + seed): every claim is a paired difference per seed, new variants against "
               "the stored ones (copied into stored_records from that file)",
    "check": f"before the run, seed {CHECK_SEED}, both tasks: init+lr together vs the stored "
             f"seed_alpha, and alpha = 1 vs the stored rope, every length within {CHECK_TOL}",
    "budget": "4 new variants x 20 seeds x 2 tasks = 160 models (about 25 min on one core); the "
              "sweep was cut to two new alphas before the run to keep it under 40 min",
}
TEST = ch6.CH6_TEST


def train_control(task, seed, *, init_scale=1.0, lr_scale=1.0, steps=ch6.TASK_STEPS,
                  bias_scale=0.5, device="cpu"):
    """``train_task`` for the half-slope hybrid with W_q multiplied by ``init_scale`` after
    construction and trained at ``lr_scale`` times the learning rate (its own AdamW group,
    ``eps`` divided by ``lr_scale``). Returns ``(accuracy per length, model)``."""
    eps = torch.optim.AdamW([torch.zeros(1)]).defaults["eps"]

    def groups(model):
        attn = model.blocks[0].attn
        assert attn.q_proj.bias is None  # W_q x: nothing else to rescale
        w_q = attn.q_proj.weight
        with torch.no_grad():
            w_q.mul_(init_scale)
        rest = [p for p in model.parameters() if p is not w_q]
        return [{"params": rest}, {"params": [w_q], "lr": lr_scale * LR, "eps": eps / lr_scale}]

    return train_task(task, Hybrid(D_MODEL // N_HEADS, N_HEADS, bias_scale=bias_scale), seed,
                      steps=steps, train_len=ch6.TASK_TRAIN_LEN, eval_lens=ch6.TASK_EVAL_LENS,
                      test_seed=ch6.TEST_SEED_BASE + seed, device=device, param_groups=groups,
                      lr=LR, batch=BATCH, d_model=D_MODEL, n_heads=N_HEADS, vocab=VOCAB)


def train_variant(label, task, seed, steps, device):
    v = VARIANTS[label]
    if "control" in v:
        return train_control(task, seed, init_scale=v["init_scale"], lr_scale=v["lr_scale"],
                             steps=steps, device=device)
    return train_task(task, v["encoding"], seed, encoding_kwargs=v["kwargs"], steps=steps,
                      train_len=ch6.TASK_TRAIN_LEN, eval_lens=ch6.TASK_EVAL_LENS,
                      test_seed=ch6.TEST_SEED_BASE + seed, device=device)


def stored_rows(stored, seeds, encodings):
    return [{k: r[k] for k in ("seed", "task", "encoding",
                               *(f"acc_{n}" for n in ch6.TASK_EVAL_LENS))}
            for r in stored["records"] if r["seed"] in seeds and r["encoding"] in encodings]


def referenced_stored():
    return sorted({ref["encoding"] for c in CLAIMS for ref in (c["a"], c["b"])} - set(VARIANTS)
                  | {"seed_alpha", "hybrid_half", "rope"})


def decide(payload):
    """The family decided as chapter 6's (``decide_ch6``) on new + stored records, paired."""
    merged = {"seeds": payload["seeds"],
              "records": payload["records"] + payload["stored_records"]}
    decided = ch6.decide_ch6(merged, claims=payload["claims"], alpha=payload["alpha"])
    verdicts = {d["claim"]: d["verdict"] for d in decided}
    monotone = {"claims": payload["monotone_claims"],
                "holds": all(verdicts[c] == "holds" for c in payload["monotone_claims"])}
    return decided, monotone


def check(device, steps):
    """init+lr together vs the stored seed_alpha; alpha 1 vs the stored rope (seed CHECK_SEED)."""
    stored = json.loads((ROOT / STORED).read_text())
    rows = {(r["task"], r["encoding"]): r for r in stored["records"] if r["seed"] == CHECK_SEED}
    out = []
    for task in TASKS:
        both, _ = train_control(task, CHECK_SEED, init_scale=C, lr_scale=C, steps=steps,
                                device=device)
        one, _ = train_task(task, "hybrid", CHECK_SEED, encoding_kwargs={"mix": "alpha",
                                                                         "alpha": 1.0},
                            steps=steps, test_seed=ch6.TEST_SEED_BASE + CHECK_SEED, device=device)
        for name, acc, ref in (("init+lr vs seed_alpha", both, "seed_alpha"),
                               ("alpha_1.0 vs rope", one, "rope")):
            diff = max(abs(acc[n] - rows[task, ref][f"acc_{n}"]) for n in ch6.TASK_EVAL_LENS)
            out.append({"check": name, "task": task, "seed": CHECK_SEED,
                        **{f"acc_{n}": acc[n] for n in ch6.TASK_EVAL_LENS},
                        "max_abs_diff": diff, "within": diff <= CHECK_TOL})
    return out


def mean_acc(payload, task, encoding, length=128):
    """Mean accuracy over the seeds of one variant (new or stored) at one length."""
    v = [r[f"acc_{length}"] for r in payload["records"] + payload["stored_records"]
         if r["task"] == task and r["encoding"] == encoding and r["seed"] in payload["seeds"]]
    assert len(v) == len(payload["seeds"])
    return sum(v) / len(v)


def summary(payload):
    """Five lines for the chapter, every number from the record."""
    d = {x["claim"]: x for x in payload["decided"]}
    n, k = len(payload["seeds"]), len(payload["claims"])

    def iv(name):
        x = d[name]
        return f"{x['mean']:+.3f} [{x['low']:+.3f}, {x['high']:+.3f}] ({x['verdict']})"

    exact = max(c["max_abs_diff"] for c in payload["check"])
    sweep = {0.25: "alpha_0.25", 0.5: "seed_alpha", 0.75: "alpha_0.75", 1.0: "rope"}
    accs = ", ".join(f"{a:g}: {mean_acc(payload, 'latest', e):.3f}" for a, e in sweep.items())
    conf = next((x["confidence"] for x in payload["decided"] if "confidence" in x), float("nan"))
    return [
        f"Ablation (pre-registered, {k} claims at family-wise {1 - payload['alpha']:.2f}, paired "
        f"sign-flip intervals at {conf:.4f} over the stored seeds {payload['seeds'][0]}-"
        f"{payload['seeds'][-1]}, n = {n}): the half-slope control with W_q only initialised "
        f"{C:g} times as large (init_only) or only trained at {C:g} times the learning rate "
        f"(lr_only); both together reproduce the mix's stored accuracies on seed "
        f"{payload['check'][0]['seed']} (largest difference {exact:.3g}).",
        f"Recency at 128 tokens, control minus half-slope hybrid: init_only "
        f"{iv('latest@128: init_only > hybrid_half')}, lr_only "
        f"{iv('latest@128: lr_only > hybrid_half')}.",
        f"Recency at 128 tokens, the mix minus each control: minus init_only "
        f"{iv('latest@128: seed_alpha > init_only')}, minus lr_only "
        f"{iv('latest@128: seed_alpha > lr_only')}.",
        f"Alpha sweep, recency at 128 tokens, mean accuracy by alpha ({accs}); 0.25 minus 0.5 "
        f"{iv('latest@128: alpha_0.25 > seed_alpha (alpha 0.5)')}, 0.5 minus 0.75 "
        f"{iv('latest@128: seed_alpha (alpha 0.5) > alpha_0.75')}, 0.75 minus 1 "
        f"{iv('latest@128: alpha_0.75 > rope (alpha 1)')}: accuracy falling as alpha rises "
        f"{'holds' if payload['monotone']['holds'] else 'is not shown'} over the four alphas.",
        f"Offset copy at 128 tokens, alpha 0.75 minus RoPE (alpha 1): "
        f"{iv('offset@128: alpha_0.75 > rope (alpha 1)')}; mean accuracy at alpha 0.25, 0.5, "
        f"0.75, 1: " + ", ".join(f"{mean_acc(payload, 'offset', e):.3f}"
                                 for e in sweep.values()) + ".",
    ]


def header(claims):
    """The record before the run: the design and the family, with the time it was written."""
    return {"description": "Chapter 6 ablation of the alpha-mix: an alpha sweep and two "
                           "single-factor controls (W_q init only, W_q learning rate only), "
                           "paired per seed with book/data/hybrid_results.json; a pre-registered "
                           "family, written and committed before any model was trained",
            "design": DESIGN, "claims": claims, "alpha": ALPHA, "test": TEST,
            "monotone_claims": MONOTONE, "check_tolerance": CHECK_TOL,
            "claims_written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "status": "claims"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--claims-only", action="store_true")
    p.add_argument("--summary", action="store_true", help="print the record's five lines")
    p.add_argument("--seeds", nargs="+", type=int, default=ch6.DEFAULT_TASK_SEEDS)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="20 steps, no commit check (smoke)")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
    claims = [dict(c) for c in CLAIMS]
    if args.summary:
        print("\n".join(summary(json.loads(out.read_text()))))
        return
    if args.claims_only:
        write_claims(out, header(claims))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = 20 if args.quick else ch6.TASK_STEPS
    if args.quick:
        pre = {**header(claims), "claims_written": None, "claims_commit": None}
    else:
        pre = committed_header(out, claims)
    stored = json.loads((ROOT / STORED).read_text())
    if not args.quick and stored["seeds"] != args.seeds:
        raise SystemExit(f"seeds must be the stored record's {stored['seeds']}")
    command = "python benchmarks/hybrid_ablation.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    payload = {**pre, "command": command, "commit": git("rev-parse", "HEAD"),
               "started": started, "status": "running",
               "tutorial_pkg_version": tutorial_pkg.__version__,
               "torch_version": torch.__version__, "hardware": hardware_info(args.device),
               "train_len": ch6.TASK_TRAIN_LEN, "eval_lens": list(ch6.TASK_EVAL_LENS),
               "steps": steps, "test_seed_base": ch6.TEST_SEED_BASE, "seeds": args.seeds,
               "variants": {k: v for k, v in VARIANTS.items()},
               "stored": {"file": STORED, "commit": stored.get("commit"),
                          "variants": referenced_stored()},
               "stored_records": stored_rows(stored, set(args.seeds), referenced_stored())}
    payload["check"] = check(args.device, steps)
    for c in payload["check"]:
        print(f"check {c['check']:24s} {c['task']:7s} max |diff| {c['max_abs_diff']:.2e}",
              flush=True)
    if not args.quick and not all(c["within"] for c in payload["check"]):
        payload["status"] = "check failed"
        out.write_text(json.dumps(payload, indent=1) + "\n")
        raise SystemExit("the check failed: the controls are not what the design says")
    records = []
    for seed in args.seeds:
        t1 = time.perf_counter()
        for task in TASKS:
            batches = test_batches(task, ch6.TEST_SEED_BASE + seed, ch6.TASK_EVAL_LENS)
            for label in VARIANTS:
                acc, model = train_variant(label, task, seed, steps, args.device)
                se = evaluate_task(model, batches)
                records.append({"seed": seed, "task": task, "encoding": label,
                                **{f"acc_{n}": a for n, a in acc.items()},
                                **{f"se_{n}": r["se"] for n, r in se.items()}})
        payload["records"] = records
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
    print("\n".join(summary(payload)))
    print(f"wrote {out}: {len(records)} records, {payload['run_time_s']:.0f} s")


if __name__ == "__main__":
    main()
