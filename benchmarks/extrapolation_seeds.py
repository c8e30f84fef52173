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
and every variant of :data:`VARIANTS` (an encoding name with its options; the scaled
sinusoidal table is one), a :class:`~tutorial_pkg.experiments.training.ExperimentConfig` with that
``seed`` (initial weights and batch order) and the sizes of ``--d-model``, ``--n-layers``,
``--steps`` (defaults 64, 2, 600: several seeds of every encoding fit on a CPU) is trained
at ``L`` and evaluated at ``L .. 8L`` (RoPE-based encodings also with each scaling rule):

* ``records``: :func:`~tutorial_pkg.experiments.training.evaluate` (last quarter and all tokens);
* ``fixed_targets``: :func:`~tutorial_pkg.experiments.context_eval.evaluate_fixed_targets`, the same
  ``L/4`` targets of ``--target-blocks`` blocks at every length, per-block NLL kept;
* ``all_tokens``: :func:`~tutorial_pkg.experiments.context_eval.all_token_perplexity` on
  non-overlapping windows up to ``32 L`` (Press et al.'s measure), per-block NLL kept;
* ``retrieval``: the copy test :func:`~tutorial_pkg.experiments.retrieval.retrieval_test`, also on
  the ``name+copy`` models of ``--copy-encodings``, trained for ``COPY_STEPS`` steps on text in
  which every window repeats its first ``L/4`` tokens (``copy_fraction``): the positive control;
* ``attention_distance``: the mean attention distance of queries in ``[L/2, L)`` (inside
  the training length) and ``[3L, 4L)``;
* ``training``: the final training loss of every model.

Chapter 6 (``--tasks-out``, default ``book/data/hybrid_results.json``), a pre-registered run:

* ``claims``: the family :data:`CH6_CLAIMS` with its test and :data:`CH6_ALPHA`, written into
  the file (``"status": "running"``) **before anything is trained**;
* ``records``: the accuracy of :func:`~tutorial_pkg.experiments.tasks.train_task` on both
  synthetic tasks for every variant and every seed of ``--task-seeds``, with its test-set
  standard error (``se_<length>``); every training seed has its own test sequences
  (test seed ``TEST_SEED_BASE + seed``), so a seed is one independent unit of training and
  test-set noise;
* ``mechanism``: per seed, the offset-copy RoPE and hybrid models read and ablated
  (:func:`~tutorial_pkg.experiments.tasks.far_attention`,
  :func:`~tutorial_pkg.experiments.tasks.with_encoding`);
* ``decided``: :func:`decide_ch6` of the family on the finished run.

Each file stores the command line, the run time, the hardware and every per-seed
record; the chapters compute means and spreads from them
(:func:`~tutorial_pkg.experiments.training.summarize_seeds`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

try:
    import tutorial_pkg
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tutorial_pkg

from tutorial_pkg.encodings.builtin import Hybrid
from tutorial_pkg.experiments.context_eval import all_token_perplexity, evaluate_fixed_targets
from tutorial_pkg.experiments.data import load_splits
from tutorial_pkg.experiments.retrieval import copy_distances, retrieval_test
from tutorial_pkg.experiments.stats import bonferroni, paired_difference, verdict
from tutorial_pkg.experiments.tasks import (
    TASKS,
    evaluate_task,
    far_attention,
    test_batches,
    train_task,
    with_encoding,
)
from tutorial_pkg.experiments.training import (
    SCALING_TYPES,
    ExperimentConfig,
    evaluate,
    evaluation_blocks,
    train,
)
from tutorial_pkg.measure.cases import hardware_info

#: Chapter 7's variants: label -> (encoding name, encoding kwargs). ``sinusoidal_scaled``
#: scales the table to the RMS of the token embeddings at initialisation (std 0.02; the
#: table's RMS is 1/sqrt(2)), as a practitioner would; ``sinusoidal`` is Vaswani's table.
SINUSOIDAL_SCALE = 0.02 * math.sqrt(2.0)
VARIANTS = {
    "nope": ("nope", {}),
    "sinusoidal": ("sinusoidal", {}),
    "sinusoidal_scaled": ("sinusoidal", {"scale": SINUSOIDAL_SCALE}),
    "learned": ("learned", {}),
    "rope": ("rope", {}),
    "alibi": ("alibi", {}),
    "hybrid": ("hybrid", {}),
}
DEFAULT_ENCODINGS = list(VARIANTS)
#: Chapter 8's variants, recorded with the same script (``--encodings t5 p_rope irope``).
VARIANTS.update({"t5": ("t5", {}), "p_rope": ("p_rope", {}), "irope": ("irope", {"every": 2})})
#: The copy test's positive control: these encodings are also trained, for COPY_STEPS
#: steps, on text in which a fraction COPY_FRACTION of the windows repeat their first L/4
#: tokens (label "name+copy"). With 0.5 of the windows or 600 steps the CPU-sized model
#: does not learn to copy (gain < 0.2 nats inside L); with every window and 1500 steps it does.
DEFAULT_COPY_ENCODINGS = ["nope", "rope", "alibi", "hybrid"]
COPY_FRACTION = 1.0
COPY_STEPS = 1500
#: All-token perplexity on non-overlapping windows (Press et al.'s measure), to 32 L.
ALL_TOKEN_MULTIPLES = (1, 2, 4, 8, 16, 32)

#: chapter 6's variants: label -> (encoding name or factory, encoding kwargs)
TASK_VARIANTS = {
    "rope": ("rope", {}),
    "alibi": ("alibi", {}),
    "hybrid": ("hybrid", {}),
    "hybrid_learnable": ("hybrid", {"learnable_scale": True}),
    "hybrid_half": (None, {}),  # the additive hybrid at half slopes (the control)
    "seed_alpha": ("hybrid", {"mix": "alpha", "alpha": 0.5}),
}
#: chapter 6's sizes: trained at TASK_TRAIN_LEN, tested at TASK_EVAL_LENS
TASK_TRAIN_LEN, TASK_EVAL_LENS, TASK_STEPS = 32, (32, 64, 128), 300
#: a training seed s is tested on the sequences of test seed TEST_SEED_BASE + s
TEST_SEED_BASE = 1000
#: The recorded seeds. Seeds 0-4 were the pilot (the record at commit PILOT_COMMIT) from
#: which the claims below were drawn; the claims are tested on these fresh seeds only.
DEFAULT_TASK_SEEDS = list(range(5, 25))
PILOT = {"seeds": [0, 1, 2, 3, 4], "commit": "88ffcb7b9b09cfb5f8c17d0f9f519a17a11bf20c"}


def _acc(task, encoding, length):
    return {"task": task, "encoding": encoding, "length": length}


def _mech(name):
    return {"mechanism": name}


_HYBRIDS = ("hybrid", "hybrid_learnable", "seed_alpha", "hybrid_half")
#: Chapter 6's claim family, fixed before the record was run. Each claim is a paired
#: difference ``a - b`` over the seeds; "greater": ``a - b > 0``; "equivalent":
#: ``|a - b| < margin``. Test: the paired sign-flip test (``stats.sign_flip``), its interval
#: two-sided at ``1 - CH6_ALPHA / len(CH6_CLAIMS)`` (Bonferroni: all claims together at
#: 1 - CH6_ALPHA); decided by ``stats.verdict``. ``mechanism`` values are per seed, on the
#: offset task at 128 tokens unless named ``_at_L`` (32 tokens).
CH6_CLAIMS = (
    *({"claim": f"offset@32: {k} > alibi", "test": "greater", "a": _acc("offset", k, 32),
       "b": _acc("offset", "alibi", 32)} for k in ("rope", *_HYBRIDS)),
    *({"claim": f"offset@128: {k} > rope", "test": "greater", "a": _acc("offset", k, 128),
       "b": _acc("offset", "rope", 128)} for k in _HYBRIDS),
    *({"claim": f"latest@128: {k} > rope", "test": "greater", "a": _acc("latest", k, 128),
       "b": _acc("latest", "rope", 128)} for k in ("alibi", *_HYBRIDS)),
    {"claim": "latest@128: alibi > hybrid", "test": "greater",
     "a": _acc("latest", "alibi", 128), "b": _acc("latest", "hybrid", 128)},
    {"claim": "latest@128: hybrid_learnable > hybrid", "test": "greater",
     "a": _acc("latest", "hybrid_learnable", 128), "b": _acc("latest", "hybrid", 128)},
    *({"claim": f"latest@128: hybrid > {k}", "test": "greater",
       "a": _acc("latest", "hybrid", 128), "b": _acc("latest", k, 128)}
      for k in ("seed_alpha", "hybrid_half")),
    *({"claim": f"{t}@128: seed_alpha = hybrid_half within 0.05", "test": "equivalent",
       "margin": 0.05, "a": _acc(t, "seed_alpha", 128), "b": _acc(t, "hybrid_half", 128)}
      for t in ("latest", "offset")),
    {"claim": "mechanism: far-key attention rope > hybrid", "test": "greater",
     "a": _mech("far_rope"), "b": _mech("far_hybrid")},
    {"claim": "mechanism: rope with a 32-key window > rope", "test": "greater",
     "a": _mech("rope_window"), "b": _acc("offset", "rope", 128)},
    {"claim": "mechanism: hybrid > hybrid with its bias removed", "test": "greater",
     "a": _acc("offset", "hybrid", 128), "b": _mech("no_bias")},
    {"claim": "mechanism: removing the bias costs more at 128 than at 32", "test": "greater",
     "a": _mech("bias_cost"), "b": _mech("bias_cost_at_L")},
    {"claim": "mechanism: hybrid with a 32-key window > hybrid", "test": "greater",
     "a": _mech("hybrid_window"), "b": _acc("offset", "hybrid", 128)},
    *({"claim": f"mechanism: rope with a 32-key window > {k}", "test": "greater",
       "a": _mech("rope_window"), "b": _acc("offset", k, 128)} for k in _HYBRIDS),
)
CH6_ALPHA = 0.05
CH6_TEST = ("paired sign-flip test over seeds (tutorial_pkg.experiments.stats.sign_flip): "
            "two-sided interval at 1 - alpha / k (Bonferroni over the k claims); verdict by "
            "tutorial_pkg.experiments.stats.verdict")


def mean_attention_distance(model, heldout_ids, query_range, n_windows=8):
    """Mean over windows, layers and heads of sum_j w_ij (i - j), queries in ``query_range``.

    The windows are ``query_range[1]`` tokens long (the shortest that holds the queries).
    """
    lo, n = query_range
    x, _ = evaluation_blocks(heldout_ids, n, n_windows * n)
    dist = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).clamp(min=0).float()
    per_layer = []
    for k in range(model.n_layers):
        w = model.attention_weights(x.to(next(model.parameters()).device), layer=k).cpu()
        per_layer.append((w * dist).sum(-1)[..., lo:n].mean(dim=(0, 2)))  # (H,)
    per_head = torch.stack(per_layer).mean(0)
    return per_head.mean().item(), per_head.tolist()


def _rounded(record, key="nll_by_block", digits=5):
    if record.get(key) is not None:  # per-block values: enough digits for any interval
        record[key] = [round(v, digits) for v in record[key]]
    return record


def variant_config(base, label):
    """The config of a variant: ``+copy`` labels train with copies (the positive control)."""
    if not label.endswith("+copy"):
        return base
    return dataclasses.replace(base, copy_fraction=COPY_FRACTION,
                               steps=base.steps if base.steps < 100 else COPY_STEPS)


def run_chapter7(args, device):
    train_ids, heldout_ids = load_splits()
    base = ExperimentConfig(d_model=args.d_model, n_layers=args.n_layers, steps=args.steps,
                            device=device) if not args.quick else ExperimentConfig(
        d_model=32, n_layers=1, n_heads=2, train_len=16, steps=10, batch_size=4,
        warmup=2, eval_tokens=512, eval_batch_tokens=512, device=device)
    L = base.train_len
    seg = L // 4
    base = dataclasses.replace(base, copy_len=seg)
    distances = copy_distances(L, seg)
    n_blocks = 8 if args.quick else args.target_blocks
    labels = list(args.encodings) + [f"{name}+copy" for name in args.copy_encodings]
    out = {key: [] for key in ("records", "fixed_targets", "all_tokens", "retrieval",
                               "attention_distance", "training")}
    for seed in args.seeds:
        t0 = time.perf_counter()
        for label in labels:
            name, kwargs = VARIANTS[label.removesuffix("+copy")]
            cfg = dataclasses.replace(variant_config(base, label), seed=seed)
            model, losses = train(name, cfg, train_ids, encoding_kwargs=kwargs or None,
                                  progress=False)
            tail = losses[-max(1, len(losses) // 10):]
            out["training"].append({"seed": seed, "encoding": label,
                                    "copy_fraction": cfg.copy_fraction, "steps": cfg.steps,
                                    "final_train_loss": sum(tail) / len(tail)})
            for r in retrieval_test(model, heldout_ids, distances, segment_len=seg,
                                    n_trials=args.trials, encoding_name=label):
                out["retrieval"].append({"seed": seed, "train_len": L, **r})
            if label.endswith("+copy"):
                continue  # the positive control is for the copy test only
            rules = [None] + (list(args.scalings) if model.encoding.supports_scaling else [])
            for rule in rules:
                for r in evaluate(model, heldout_ids, L, cfg.eval_multiples, rule,
                                  eval_tokens=cfg.eval_tokens,
                                  batch_tokens=cfg.eval_batch_tokens, encoding_name=label):
                    out["records"].append({"seed": seed, **r,
                                           "final_train_loss": sum(tail) / len(tail)})
                for r in evaluate_fixed_targets(model, heldout_ids, L, cfg.eval_multiples, rule,
                                                target_len=seg, n_blocks=n_blocks,
                                                batch_tokens=cfg.eval_batch_tokens,
                                                encoding_name=label):
                    out["fixed_targets"].append({"seed": seed, **_rounded(r)})
            for r in all_token_perplexity(model, heldout_ids, L, ALL_TOKEN_MULTIPLES,
                                          eval_tokens=max(ALL_TOKEN_MULTIPLES) * L * (
                                              2 if args.quick else args.all_token_blocks),
                                          batch_tokens=cfg.eval_batch_tokens,
                                          encoding_name=label):
                out["all_tokens"].append({"seed": seed, **_rounded(r)})
            for query_range in ((L // 2, L), (3 * L, 4 * L)):
                if model.encoding.max_positions is not None and query_range[1] > (
                        model.encoding.max_positions):
                    continue  # the learned table cannot read past L
                mean, heads = mean_attention_distance(model, heldout_ids, query_range)
                out["attention_distance"].append({
                    "seed": seed, "encoding": label, "train_len": L,
                    "query_range": list(query_range), "mean_distance": mean,
                    "per_head": heads})
        print(f"seed {seed}: {len(labels)} models in {time.perf_counter() - t0:.0f} s",
              flush=True)
    return base, out


def mechanism(rope, hybrid, batches, train_len=TASK_TRAIN_LEN):
    """Chapter 6's readout and ablations of one seed's offset-copy RoPE and hybrid models.

    On the seed's own test sequences (``batches``, :func:`test_batches`), at the longest
    length unless ``_at_L`` (the training length).
    """
    n, short = max(batches), train_len
    x_long = batches[n][0]
    at = lambda model, m=n: evaluate_task(model, {m: batches[m]})[m]["accuracy"]  # noqa: E731
    no_bias = with_encoding(hybrid, "rope")
    out = {"far_rope": far_attention(rope, x_long, train_len),
           "far_hybrid": far_attention(hybrid, x_long, train_len),
           "rope_window": at(with_encoding(rope, "rope", window=train_len)),
           "hybrid_window": at(with_encoding(hybrid, "hybrid", window=train_len)),
           "no_bias": at(no_bias), "no_bias_at_L": at(no_bias, short)}
    out["bias_cost"] = at(hybrid) - out["no_bias"]
    out["bias_cost_at_L"] = at(hybrid, short) - out["no_bias_at_L"]
    return out


def claim_values(payload, ref):
    """The per-seed values (in ``payload["seeds"]`` order) a claim's ``a`` or ``b`` names."""
    seeds = payload["seeds"]
    if "mechanism" in ref:
        rows = {r["seed"]: r[ref["mechanism"]] for r in payload["mechanism"]}
    else:
        rows = {r["seed"]: r[f"acc_{ref['length']}"] for r in payload["records"]
                if r["task"] == ref["task"] and r["encoding"] == ref["encoding"]}
    if sorted(rows) != sorted(seeds):
        raise ValueError(f"{ref} has seeds {sorted(rows)}, the run {seeds}")
    return [rows[s] for s in seeds]


def decide_ch6(payload, claims=None, alpha=None):
    """Each claim of the stored family decided on the run (see :data:`CH6_CLAIMS`)."""
    claims = payload["claims"] if claims is None else claims
    alpha = payload["alpha"] if alpha is None else alpha
    confidence = bonferroni(1 - alpha, len(claims))
    out = []
    for c in claims:
        a, b = claim_values(payload, c["a"]), claim_values(payload, c["b"])
        try:
            d = paired_difference(a, b, confidence=confidence, method="sign_flip")
        except ValueError as err:  # too few seeds for this confidence
            out.append({"claim": c["claim"], "verdict": "not testable", "why": str(err)})
            continue
        out.append({"claim": c["claim"], "mean": d["mean"], "low": d["low"], "high": d["high"],
                    "p_value": d["p_value"], "confidence": confidence,
                    "verdict": verdict(d, c["test"], c.get("margin"))})
    return out


def commit():
    """The checked-out commit (``None`` outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_chapter6(args, device):
    records, mech = [], []
    steps = 20 if args.quick else TASK_STEPS
    for seed in args.task_seeds:
        t0 = time.perf_counter()
        for task in TASKS:
            batches = test_batches(task, TEST_SEED_BASE + seed, TASK_EVAL_LENS)
            models = {}
            for label, (name, kwargs) in TASK_VARIANTS.items():
                encoding = name if name is not None else Hybrid(32 // 4, 4, bias_scale=0.5)
                acc, models[label] = train_task(
                    task, encoding, seed, encoding_kwargs=kwargs or None, steps=steps,
                    train_len=TASK_TRAIN_LEN, eval_lens=TASK_EVAL_LENS,
                    test_seed=TEST_SEED_BASE + seed, device=device)
                se = evaluate_task(models[label], batches)
                records.append({"seed": seed, "task": task, "encoding": label,
                                **{f"acc_{n}": a for n, a in acc.items()},
                                **{f"se_{n}": r["se"] for n, r in se.items()}})
            if task == "offset":
                mech.append({"seed": seed, **mechanism(models["rope"], models["hybrid"],
                                                       batches)})
        print(f"task seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return records, mech


CH7_KEYS = ("records", "fixed_targets", "all_tokens", "retrieval", "attention_distance",
            "training")


def merge(paths, out):
    """Combine chapter-7 files of single seeds (same configuration) into one file."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]
    for part in parts[1:]:
        for key in ("config", "encodings", "copy_encodings", "rope_scalings"):
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
    for key in CH7_KEYS:
        payload[key] = [r for part in parts for r in part[key]]
    Path(out).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"merged {len(parts)} files ({len(seeds)} seeds) into {out}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encodings", nargs="+", default=DEFAULT_ENCODINGS,
                        help=f"chapter 7's variants ({', '.join(VARIANTS)})")
    parser.add_argument("--copy-encodings", nargs="*", default=DEFAULT_COPY_ENCODINGS,
                        help="variants also trained with copies (the copy test's positive "
                             "control)")
    parser.add_argument("--target-blocks", type=int, default=256,
                        help="target blocks of the fixed-target evaluation")
    parser.add_argument("--all-token-blocks", type=int, default=8,
                        help="blocks of 32 L tokens of the all-token perplexity")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--scalings", nargs="*", default=list(SCALING_TYPES))
    parser.add_argument("--d-model", type=int, default=64, help="model width")
    parser.add_argument("--n-layers", type=int, default=2, help="Transformer blocks")
    parser.add_argument("--steps", type=int, default=600, help="training steps per model")
    parser.add_argument("--trials", type=int, default=64, help="copy-test windows per distance")
    parser.add_argument("--task-seeds", nargs="+", type=int, default=DEFAULT_TASK_SEEDS,
                        help="chapter 6's seeds (default 5-24; 0-4 were the pilot)")
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
    for name in [*args.encodings, *args.copy_encodings]:
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
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
        cfg, results = run_chapter7(args, args.device)
        payload = {
            "description": "Chapter 7: held-out perplexity (per byte) by evaluation length "
                           "(last quarter, fixed targets, all tokens), copy test with a "
                           "positive control and attention distance, several training seeds",
            **common, "run_time_s": time.perf_counter() - t0,
            "cpu_time_s": time.process_time() - c0,
            "config": {k: v for k, v in cfg.to_dict().items() if k != "seed"},
            "seeds": args.seeds, "encodings": args.encodings,
            "copy_encodings": args.copy_encodings, "copy_fraction": COPY_FRACTION,
            "copy_steps": COPY_STEPS,
            "variants": {k: {"encoding": VARIANTS[k][0], "kwargs": VARIANTS[k][1]}
                         for k in args.encodings},
            "rope_scalings": args.scalings, "all_token_multiples": list(ALL_TOKEN_MULTIPLES),
            **results,
        }
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.out}: {len(results['records'])} records, {payload['run_time_s']:.0f} s")

    if not args.skip_tasks:
        t0 = time.perf_counter()
        claims = [dict(c) for c in CH6_CLAIMS]
        payload = {
            "description": "Chapter 6: accuracy of one-layer models on two synthetic tasks by "
                           "test length (trained at 32), and the offset task's mechanism, "
                           "several seeds; a pre-registered family of claims",
            "command": common["command"], "commit": commit(),
            "claims": claims, "alpha": CH6_ALPHA, "test": CH6_TEST, "pilot": PILOT,
            "claims_written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "status": "running",
        }
        out = Path(args.tasks_out)
        out.write_text(json.dumps(payload, indent=1) + "\n")  # the family, before any training
        records, mech = run_chapter6(args, args.device)
        payload.update({
            **common, "hardware_end": hardware_info(args.device),
            "run_time_s": time.perf_counter() - t0, "train_len": TASK_TRAIN_LEN,
            "eval_lens": list(TASK_EVAL_LENS), "steps": 20 if args.quick else TASK_STEPS,
            "test_seed_base": TEST_SEED_BASE, "seeds": args.task_seeds,
            "variants": list(TASK_VARIANTS), "records": records, "mechanism": mech,
            "status": "done"})
        payload["decided"] = decide_ch6(payload)
        out.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
        for d in payload["decided"]:
            print(f"  {d['claim']:58s} {d['verdict']}")
        print(f"wrote {args.tasks_out}: {len(records)} records, {payload['run_time_s']:.0f} s")


if __name__ == "__main__":
    main()
