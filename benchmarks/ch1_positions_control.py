"""Chapter 1's positions-moved control, on every pilot seed of chapter 7's scaled sinusoidal model.

Usage (from the repository root)::

    python benchmarks/ch1_positions_control.py --claims-only   # the claims into the record; commit
    taskset -c 0 python benchmarks/ch1_positions_control.py --threads 1   # the recorded run
    python benchmarks/ch1_positions_control.py --quick --seeds 0 --out /tmp/c.json  # smoke test
    python benchmarks/ch1_positions_control.py --replicate --claims-only   # fresh seeds: claims
    taskset -c 0 python benchmarks/ch1_positions_control.py --replicate --threads 1   # their run

What it measures. Chapter 7 scores the same target bytes (the last ``target_len`` of every
window) with windows of ``k L`` bytes from position 0, so at ``k > 1`` the scored bytes sit at
unseen positions *and* have more context in front. The control scores the same bytes with a
window of ``L`` bytes, as in training, once at positions ``0 .. L-1`` and once moved to
``(k-1) L .. k L - 1``, the positions they have at the end of the long window. Per seed it
stores the rise of the NLL over the window of ``L`` at 0 for both, and their ratio, the
*share* of the long window's rise that the moved window already carries.

The records store no weights, so each pilot seed (``data/extrapolation_results.json``, seeds
0-4) is trained again from the configuration and variant its record stores; a pre-run check
holds each seed's fixed-target NLL to the record's within :data:`CHECK_TOL` at every length.

The claims :data:`CLAIMS` are written into the record (``--claims-only``) and committed before
anything is trained; the run refuses to start otherwise. They are exploratory: not part of
chapter 7's family, no error rate attached; each must hold in every seed.

The claims were chosen after a first look at the pilot seeds, so ``--replicate`` tests the
same two rules on other seeds (:data:`FRESH_SEEDS`, never trained for the pilot) into
:data:`REPLICATION_OUT`, pre-registered the same way. Seeds 5-9 among them are chapter 7's
pre-registered models (``data/extrapolation_preregistered.json``, same configuration): their
long-window scores were on record before the replication's claims were committed, and the
replication's long-window NLL for them matches that record's ``sinusoidal_scaled`` rows within
2e-6 nats per byte (chapter 1 checks it), although the script itself runs no pre-run check on any
replication seed (``check_max_abs_diff`` is ``None``). Seeds 10-14 have no earlier record: they
are the strictly fresh set. The windows are the pilot's (the same target length and blocks as
every pilot seed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.preregister import run_fields, start_header, write_claims  # noqa: E402
from tutorial_pkg.experiments.context_eval import fixed_target_windows  # noqa: E402
from tutorial_pkg.experiments.data import load_splits  # noqa: E402
from tutorial_pkg.experiments.training import ExperimentConfig, train  # noqa: E402

OUT = "book/data/ch1_positions_control.json"
REPLICATION_OUT = "book/data/ch1_positions_replication.json"
FRESH_SEEDS = tuple(range(5, 15))  # disjoint from the pilot's seeds 0-4
PILOT = ROOT / "book/data/extrapolation_results.json"
VARIANT = "sinusoidal_scaled"
RATIOS = (1, 2, 4, 8)
CHECK_TOL = 1e-2  # nats per byte: the retrained seed against its record
CLAIMS = [
    {"claim": "share at 2L above one half", "rule": "share[2] > 0.5 in every seed",
     "kind": "exploratory"},
    {"claim": "share falls from 2L to 8L", "rule": "share[8] < share[2] in every seed",
     "kind": "exploratory"},
]


def header(replicate=False):
    description = (
        "Chapter 1's positions-moved control on fresh seeds of chapter 7's scaled sinusoidal "
        "model (its pilot configuration); the control record's two claims tested again, "
        "written and committed before any model was trained" if replicate else
        "Chapter 1's positions-moved control on the five pilot seeds of "
        "chapter 7's scaled sinusoidal model, retrained; exploratory claims, "
        "written and committed before any model was trained")
    return {"description": description,
            "variant": VARIANT, "ratios": list(RATIOS), "claims": CLAIMS,
            "check_tolerance": CHECK_TOL,
            "claims_written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "status": "claims"}


def control(pilot, seed, steps=None):
    """Train ``seed`` again and score the long and the moved windows; returns one row."""
    cfg = {**pilot["config"], "eval_multiples": RATIOS, "seed": seed}
    if steps is not None:
        cfg["steps"] = steps
    cfg = ExperimentConfig(**cfg)
    train_ids, heldout_ids = load_splits(cfg.heldout_fraction)
    variant = pilot["variants"][VARIANT]
    model, _ = train(variant["encoding"], cfg, train_ids, encoding_kwargs=variant["kwargs"],
                     progress=False)
    rows = [r for r in pilot["fixed_targets"] if r["encoding"] == VARIANT
            and r["scaling"] == "none"]
    (T, n_blocks), = {(r["target_len"], r["n_blocks"]) for r in rows}  # one design
    stored = {r["ratio"]: r for r in rows if r["seed"] == seed}  # none for a fresh seed
    L = cfg.train_len
    windows = fixed_target_windows(heldout_ids, [k * L for k in RATIOS], T, n_blocks)
    x_L, y_L = windows[L]
    assert all(torch.equal(windows[k * L][1][:, -T:], y_L[:, -T:]) for k in RATIOS)

    def target_nll(x, y, first):
        with torch.no_grad():
            logits = model(x, positions=torch.arange(first, first + x.shape[1]))
        return F.cross_entropy(logits[:, -T:].flatten(0, 1), y[:, -T:].flatten()).item()

    long_nll = {k: target_nll(*windows[k * L], 0) for k in RATIOS}
    moved_nll = {k: target_nll(x_L, y_L, (k - 1) * L) for k in RATIOS}
    diff = max(abs(long_nll[k] - stored[k]["nll"]) for k in RATIOS) if stored else None
    rise_long = {k: long_nll[k] - long_nll[1] for k in RATIOS[1:]}
    rise_moved = {k: moved_nll[k] - moved_nll[1] for k in RATIOS[1:]}
    return {"seed": seed, "steps": cfg.steps, "train_len": L, "target_len": T,
            "n_blocks": n_blocks, "check_max_abs_diff": diff,
            "long_nll": {str(k): v for k, v in long_nll.items()},
            "moved_nll": {str(k): v for k, v in moved_nll.items()},
            "rise_long": {str(k): v for k, v in rise_long.items()},
            "rise_moved": {str(k): v for k, v in rise_moved.items()},
            "share": {str(k): rise_moved[k] / rise_long[k] for k in RATIOS[1:]}}


def decide(rows):
    s2 = [r["share"]["2"] for r in rows]
    s8 = [r["share"]["8"] for r in rows]
    held = {"share at 2L above one half": all(s > 0.5 for s in s2),
            "share falls from 2L to 8L": all(b < a for a, b in zip(s2, s8, strict=True))}
    return [{**c, "verdict": "holds" if held[c["claim"]] else "fails"} for c in CLAIMS]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--claims-only", action="store_true")
    p.add_argument("--seeds", nargs="+", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="20 steps, no commit check (smoke)")
    p.add_argument("--replicate", action="store_true",
                   help=f"the same claims on fresh seeds {FRESH_SEEDS[0]}-{FRESH_SEEDS[-1]}")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = Path(args.out or (REPLICATION_OUT if args.replicate else OUT))
    out = out if out.is_absolute() else ROOT / out
    if args.claims_only:
        write_claims(out, header(args.replicate))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    pilot = json.loads(PILOT.read_text())
    planned = list(FRESH_SEEDS) if args.replicate else pilot["seeds"]
    seeds = planned if args.seeds is None else args.seeds
    if not args.quick and seeds != planned:
        raise SystemExit(f"the recorded run uses the seeds {planned}")
    pre = start_header(out, header(args.replicate), quick=args.quick)
    t0 = time.perf_counter()
    payload = {**pre, **run_fields("ch1_positions_control.py", argv),
               "threads": torch.get_num_threads(), "seeds": seeds, "rows": []}
    for seed in seeds:
        row = control(pilot, seed, steps=20 if args.quick else None)
        payload["rows"].append(row)
        check = row["check_max_abs_diff"]
        print(f"seed {seed}: check {'-' if check is None else f'{check:.1e}'}; share "
              + ", ".join(f"{k}L {v:.3f}" for k, v in row["share"].items()), flush=True)
        if not args.quick and check is not None and check > CHECK_TOL:
            payload["status"] = "check failed"
            out.write_text(json.dumps(payload, indent=1) + "\n")
            raise SystemExit("the retrained seed is not the record's model")
        out.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")  # partial
    payload.update({"run_time_s": time.perf_counter() - t0, "status": "done",
                    "decided": decide(payload["rows"])})
    out.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    for c in payload["decided"]:
        print(f"  {c['claim']}: {c['verdict']}")
    print(f"wrote {out}, {payload['run_time_s']:.0f} s")


if __name__ == "__main__":
    main()
