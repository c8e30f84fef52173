"""Record the multi-seed runs of chapters 6 and 7 into ``book/data/*.json``.

Usage (from the repository root)::

    python benchmarks/extrapolation_seeds.py                 # the recorded run (CPU)
    python benchmarks/extrapolation_seeds.py --quick         # smoke test, seconds
    python benchmarks/extrapolation_seeds.py --encodings rope alibi t5 --seeds 0 1 2
    python benchmarks/extrapolation_seeds.py --skip-tasks    # chapter 7's part only
    # one process per seed (on a shared machine), then one file:
    python benchmarks/extrapolation_seeds.py --skip-tasks --seeds 0 --out /tmp/s0.json  # etc.
    python benchmarks/extrapolation_seeds.py --merge /tmp/s0.json /tmp/s1.json /tmp/s2.json

Chapter 7 (``--out``, default ``book/data/extrapolation_results.json``): for every seed
and every encoding (any name registered in ``tutorial_pkg.registry.ENCODINGS``), a
:class:`~tutorial_pkg.experiments.ExperimentConfig` with that ``seed`` (initial weights
and batch order) and the sizes of ``--d-model``, ``--n-layers``, ``--steps`` (defaults
64, 2, 600: smaller than the default config, so that several seeds of every encoding
fit on a CPU) is trained at ``L`` and evaluated by
:func:`~tutorial_pkg.experiments.run_extrapolation` at ``L .. 8L`` (RoPE-based
encodings also with each scaling rule), then by the copy test
:func:`~tutorial_pkg.retrieval.retrieval_test` and by the mean attention distance of
queries in the last quarter of ``4L``-token windows.

Chapter 6 (``--tasks-out``, default ``book/data/hybrid_results.json``): the accuracy of
:func:`~tutorial_pkg.tasks.train_task` on both synthetic tasks for every variant
of chapter 6 and every seed of ``--task-seeds``.

Each file stores the command line, the run time, the hardware and every per-seed
record; the chapters compute means and spreads from them
(:func:`~tutorial_pkg.experiments.summarize_seeds`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
import time
from pathlib import Path

import torch

try:
    import tutorial_pkg
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tutorial_pkg

from tutorial_pkg.benchmark import hardware_info
from tutorial_pkg.data import load_splits
from tutorial_pkg.encodings import Hybrid
from tutorial_pkg.experiments import (
    SCALING_TYPES,
    ExperimentConfig,
    evaluation_blocks,
    run_extrapolation,
)
from tutorial_pkg.registry import ENCODINGS
from tutorial_pkg.retrieval import copy_distances, retrieval_test
from tutorial_pkg.tasks import TASKS, train_task

DEFAULT_ENCODINGS = ["nope", "sinusoidal", "learned", "rope", "alibi", "hybrid"]

#: chapter 6's variants: label -> (encoding name or factory, encoding kwargs)
TASK_VARIANTS = {
    "rope": ("rope", {}),
    "alibi": ("alibi", {}),
    "hybrid": ("hybrid", {}),
    "hybrid_learnable": ("hybrid", {"learnable_scale": True}),
    "hybrid_half": (None, {}),  # the additive hybrid at half slopes (the control)
    "seed_alpha": ("hybrid", {"mix": "alpha", "alpha": 0.5}),
}


def mean_attention_distance(model, heldout_ids, train_len, n_windows=8):
    """Mean over windows, layers and heads of sum_j w_ij (i - j), queries in [3L, 4L)."""
    n = 4 * train_len
    x, _ = evaluation_blocks(heldout_ids, n, n_windows * n)
    dist = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).clamp(min=0).float()
    past = slice(3 * train_len, 4 * train_len)
    per_layer = []
    for k in range(model.n_layers):
        w = model.attention_weights(x.to(next(model.parameters()).device), layer=k).cpu()
        per_layer.append((w * dist).sum(-1)[..., past].mean(dim=(0, 2)))  # (H,)
    per_head = torch.stack(per_layer).mean(0)
    return per_head.mean().item(), per_head.tolist()


def run_chapter7(args, device):
    train_ids, heldout_ids = load_splits()
    base = ExperimentConfig(d_model=args.d_model, n_layers=args.n_layers, steps=args.steps,
                            device=device) if not args.quick else ExperimentConfig(
        d_model=32, n_layers=1, n_heads=2, train_len=16, steps=10, batch_size=4,
        warmup=2, eval_tokens=512, eval_batch_tokens=512, device=device)
    L = base.train_len
    seg = L // 4
    distances = copy_distances(L, seg)
    records, retrieval, distance = [], [], []
    for seed in args.seeds:
        cfg = dataclasses.replace(base, seed=seed)
        t0 = time.perf_counter()
        models = {}
        recs = run_extrapolation(args.encodings, cfg, args.scalings, train_ids=train_ids,
                                 heldout_ids=heldout_ids, models=models, progress=False,
                                 encoding_kwargs=args.encoding_kwargs)
        for r in recs:
            records.append({"seed": seed, **r})
        for name, (model, _) in models.items():
            for r in retrieval_test(model, heldout_ids, distances, segment_len=seg,
                                    n_trials=args.trials, encoding_name=name):
                retrieval.append({"seed": seed, "train_len": L, **r})
            if name != "learned":  # the learned table cannot read 4L tokens
                mean, heads = mean_attention_distance(model, heldout_ids, L)
                distance.append({"seed": seed, "encoding": name, "train_len": L,
                                 "query_range": [3 * L, 4 * L], "mean_distance": mean,
                                 "per_head": heads})
        print(f"seed {seed}: {len(args.encodings)} encodings in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    return base, records, retrieval, distance


def run_chapter6(args, device):
    records = []
    for seed in args.task_seeds:
        t0 = time.perf_counter()
        for task in TASKS:
            for label, (name, kwargs) in TASK_VARIANTS.items():
                encoding = name if name is not None else Hybrid(32 // 4, 4, bias_scale=0.5)
                acc, _ = train_task(task, encoding, seed, encoding_kwargs=kwargs or None,
                                    steps=20 if args.quick else 300, device=device)
                records.append({"seed": seed, "task": task, "encoding": label,
                                **{f"acc_{n}": a for n, a in acc.items()}})
        print(f"task seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return records


def merge(paths, out):
    """Combine chapter-7 files of single seeds (same configuration) into one file."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]
    for part in parts[1:]:
        for key in ("config", "encodings", "rope_scalings"):
            if part[key] != first[key]:
                raise SystemExit(f"cannot merge: {key} differs between {paths[0]} and another file")
    seeds = [s for part in parts for s in part["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"cannot merge: a seed appears twice ({seeds})")
    payload = {**first, "seeds": sorted(seeds),
               # each part's --out is named after its file (not the machine's path)
               "command": " ; ".join(
                   [re.sub(r"--out \S+", f"--out {Path(p).name}", part["command"])
                    for p, part in zip(paths, parts, strict=True)]
                   + ["python benchmarks/extrapolation_seeds.py --merge "
                      + " ".join(Path(p).name for p in paths)]),
               "run_time_s": max(part["run_time_s"] for part in parts),
               "run_time_note": "the seeds ran as parallel processes: wall time of the slowest",
               "cpu_time_s": sum(part.get("cpu_time_s", 0.0) for part in parts)}
    for key in ("records", "retrieval", "attention_distance"):
        payload[key] = [r for part in parts for r in part[key]]
    Path(out).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"merged {len(parts)} files ({len(seeds)} seeds) into {out}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encodings", nargs="+", default=DEFAULT_ENCODINGS,
                        help=f"names from ENCODINGS ({', '.join(ENCODINGS)})")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--scalings", nargs="*", default=list(SCALING_TYPES))
    parser.add_argument("--d-model", type=int, default=64, help="model width")
    parser.add_argument("--n-layers", type=int, default=2, help="Transformer blocks")
    parser.add_argument("--steps", type=int, default=600, help="training steps per model")
    parser.add_argument("--trials", type=int, default=64, help="copy-test windows per distance")
    parser.add_argument("--encoding-kwargs", type=json.loads, default=None, metavar="JSON",
                        help='options per encoding name, e.g. \'{"irope": {"every": 2}}\'')
    parser.add_argument("--task-seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--skip-tasks", action="store_true", help="chapter 7's part only")
    parser.add_argument("--skip-extrapolation", action="store_true", help="chapter 6's only")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="book/data/extrapolation_results.json")
    parser.add_argument("--tasks-out", default="book/data/hybrid_results.json")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="combine chapter-7 files of single seeds into --out, then stop")
    args = parser.parse_args(argv)
    if args.merge:
        merge(args.merge, args.out)
        return
    for name in args.encodings:
        if name not in ENCODINGS:
            parser.error(f"unknown encoding {name!r}; registered: {', '.join(ENCODINGS)}")
    for name in args.encoding_kwargs or {}:
        if name not in args.encodings:
            parser.error(f"--encoding-kwargs names {name!r}, which is not in --encodings")
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.task_seeds)) != len(
            args.task_seeds):
        parser.error("seeds must not repeat")
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/extrapolation_seeds.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    common = {"command": command.strip(), "tutorial_pkg_version": tutorial_pkg.__version__,
              "torch_version": torch.__version__, "hardware": hardware_info(args.device)}

    if not args.skip_extrapolation:
        t0, c0 = time.perf_counter(), time.process_time()
        cfg, records, retrieval, distance = run_chapter7(args, args.device)
        payload = {
            "description": "Chapter 7: held-out perplexity (per byte) by evaluation length, "
                           "copy test and attention distance, several training seeds",
            **common, "run_time_s": time.perf_counter() - t0,
            "cpu_time_s": time.process_time() - c0,
            "config": {k: v for k, v in cfg.to_dict().items() if k != "seed"},
            "seeds": args.seeds, "encodings": args.encodings,
            "rope_scalings": args.scalings, "encoding_kwargs": args.encoding_kwargs or {},
            "records": records, "retrieval": retrieval,
            "attention_distance": distance,
        }
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.out}: {len(records)} records, {payload['run_time_s']:.0f} s")

    if not args.skip_tasks:
        t0 = time.perf_counter()
        records = run_chapter6(args, args.device)
        payload = {
            "description": "Chapter 6: accuracy of one-layer models on two synthetic tasks by "
                           "test length (trained at 32), several seeds",
            **common, "run_time_s": time.perf_counter() - t0,
            "train_len": 32, "eval_lens": [32, 64, 128], "steps": 20 if args.quick else 300,
            "seeds": args.task_seeds, "variants": list(TASK_VARIANTS), "records": records,
        }
        Path(args.tasks_out).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.tasks_out}: {len(records)} records, {payload['run_time_s']:.0f} s")


if __name__ == "__main__":
    main()
