"""Record the multi-seed runs of chapters 6 and 7 into ``book/data/*.json``.

Usage (from the repository root)::

    python benchmarks/extrapolation_seeds.py                 # the recorded run (CPU)
    python benchmarks/extrapolation_seeds.py --quick         # smoke test, seconds
    python benchmarks/extrapolation_seeds.py --encodings rope alibi t5 --seeds 0 1 2
    python benchmarks/extrapolation_seeds.py --skip-tasks    # chapter 7's part only
    # one process per seed (on a shared machine), then one file:
    python benchmarks/extrapolation_seeds.py --skip-tasks --seeds 0 --out /tmp/s0.json  # etc.
    python benchmarks/extrapolation_seeds.py --merge /tmp/s0.json /tmp/s1.json /tmp/s2.json
    # chapter 7's pre-registered run: the family first, then one process per seed, merged
    python benchmarks/extrapolation_seeds.py --preregistered --claims-only
    python benchmarks/extrapolation_seeds.py --preregistered --seeds 5 --out /tmp/p5.json  # etc.
    python benchmarks/extrapolation_seeds.py --preregistered --merge /tmp/p5.json ... /tmp/p9.json

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

Chapter 7's pre-registered run (``--preregistered``, ``--out`` default
``book/data/extrapolation_preregistered.json``): the record above (seeds 0-4, commit
:data:`CH7_PILOT`) was the pilot from which chapter 7's claims were drawn. The family
:data:`CH7_CLAIMS`, with its test and :data:`CH7_ALPHA`, is written into the file
(``"status": "running"``) before anything is trained (``--claims-only``), and decided on the
fresh seeds :data:`CH7_SEEDS` only (:func:`decide_ch7`, at ``--merge``). The run trains the
variants the family names (:data:`CH7_ENCODINGS`), the copy-trained ``rope+copy`` and the
positive control past ``L``: ``rope+copy`` trained on for :data:`LONG_STEPS` steps at
``8 L`` with copies at every offset up to ``8 L - s`` (label ``rope+copy+8L``). Every training
seed draws its own copy-test windows (seed ``TRIAL_SEED_BASE + seed``), and the copy test is
run a second time with every window ``8 L`` long (``retrieval_fixed_window``: the scored
tokens at the same positions at every distance).

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
import copy
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
    lr_factor,
    make_optimizer,
    train,
    training_batches,
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


#: Chapter 7's pre-registered run. The pilot: the record of seeds 0-4 at this commit, from
#: which the claims below were drawn (and the margins chosen); the family is decided on
#: the fresh seeds CH7_SEEDS only.
CH7_PILOT = {"seeds": [0, 1, 2, 3, 4], "commit": "2fbdf61", "file": "extrapolation_results.json"}
CH7_SEEDS = [5, 6, 7, 8, 9]
CH7_ENCODINGS = ["nope", "sinusoidal_scaled", "rope", "alibi", "hybrid"]
CH7_COPY_ENCODINGS = ["rope"]
#: the positive control past L: rope+copy trained on at LONG_MULTIPLE * L for LONG_STEPS
#: steps of LONG_BATCH windows, with a copy in every window at any offset
LONG_MULTIPLE, LONG_STEPS, LONG_BATCH = 8, 600, 8
#: training seed s draws its copy-test windows with seed TRIAL_SEED_BASE + s
TRIAL_SEED_BASE = 2000
#: equivalence margins, chosen from the pilot: nats per byte (0.02: about 2 % perplexity)
#: and accuracy (0.05: a twentieth of the scored bytes)
CH7_NLL_MARGIN, CH7_ACC_MARGIN = 0.02, 0.05
CH7_ALPHA = 0.05
CH7_TEST = ("paired t interval over seeds (tutorial_pkg.experiments.stats.paired_difference, "
            "method='t'): two-sided at 1 - alpha / k (Bonferroni over the k claims); verdict by "
            "tutorial_pkg.experiments.stats.verdict")


def _ft(encoding, k, scaling="none", measure="fixed_targets"):
    return {"measure": measure, "encoding": encoding, "ratio": k, "scaling": scaling,
            "field": "nll"}


def _at(encoding, k):
    return _ft(encoding, k, measure="all_tokens")


def _growth(encoding, k):
    return {**_ft(encoding, k), "minus": _ft(encoding, 1)}


def _ret(encoding, distance, field):
    return {"measure": "retrieval", "encoding": encoding, "distance": distance, "field": field}


def _dist(encoding, lo, hi):
    return {"measure": "attention_distance", "encoding": encoding, "query_range": [lo, hi],
            "field": "mean_distance"}


def _copies(encoding, d, test="greater", margin=None):
    what = "copies" if test == "greater" else f"copy - control within {margin}"
    return {"claim": f"copy test, {encoding} at d = {d}: {what}", "test": test,
            **({"margin": margin} if margin else {}),
            "a": _ret(encoding, d, "acc_copy"), "b": _ret(encoding, d, "acc_control")}


def ch7_claims(L=64, s=16, top=8, far=32):
    """Chapter 7's claim family at training length ``L`` (``s = L/4``), each ``a - b``.

    Values are per seed, paired by seed: NLL in nats per byte (fixed targets unless
    ``all_tokens``), copy-test accuracy, mean attention distance in bytes.
    """
    near, ds = L // 2, (L // 2, 2 * L, 4 * L, top * L - s)
    inside, past = (L // 2, L), (3 * L, 4 * L)
    g, lt = "greater", "less"
    return [
        {"claim": "RoPE: 8L worse than L", "test": g, "a": _ft("rope", top), "b": _ft("rope", 1)},
        {"claim": f"ALiBi: 8L within {CH7_NLL_MARGIN} nats of L", "test": "equivalent",
         "margin": CH7_NLL_MARGIN, "a": _ft("alibi", top), "b": _ft("alibi", 1)},
        {"claim": "at 8L: RoPE worse than ALiBi", "test": g, "a": _ft("rope", top),
         "b": _ft("alibi", top)},
        {"claim": "at L: RoPE better than ALiBi", "test": lt, "a": _ft("rope", 1),
         "b": _ft("alibi", 1)},
        {"claim": "at L: hybrid better than RoPE", "test": lt, "a": _ft("hybrid", 1),
         "b": _ft("rope", 1)},
        {"claim": "at 8L: hybrid better than RoPE", "test": lt, "a": _ft("hybrid", top),
         "b": _ft("rope", top)},
        {"claim": "at 8L: NoPE better than RoPE", "test": lt, "a": _ft("nope", top),
         "b": _ft("rope", top)},
        {"claim": "L to 8L: NoPE grows less than RoPE", "test": lt, "a": _growth("nope", top),
         "b": _growth("rope", top)},
        {"claim": "NoPE: 8L worse than L", "test": g, "a": _ft("nope", top), "b": _ft("nope", 1)},
        {"claim": "at L: NoPE worse than ALiBi", "test": g, "a": _ft("nope", 1),
         "b": _ft("alibi", 1)},
        {"claim": "at 8L: NoPE worse than ALiBi", "test": g, "a": _ft("nope", top),
         "b": _ft("alibi", top)},
        {"claim": "scaled sinusoidal: 2L worse than L", "test": g,
         "a": _ft("sinusoidal_scaled", 2), "b": _ft("sinusoidal_scaled", 1)},
        {"claim": "at 2L: RoPE + linear worse than RoPE", "test": g,
         "a": _ft("rope", 2, "linear"), "b": _ft("rope", 2)},
        {"claim": "at 8L: RoPE + YaRN better than RoPE", "test": lt,
         "a": _ft("rope", top, "yarn"), "b": _ft("rope", top)},
        {"claim": "at 8L: RoPE + YaRN worse than ALiBi", "test": g,
         "a": _ft("rope", top, "yarn"), "b": _ft("alibi", top)},
        {"claim": "all tokens: ALiBi better at 2L than at L", "test": lt, "a": _at("alibi", 2),
         "b": _at("alibi", 1)},
        {"claim": f"all tokens: ALiBi better at {far}L than at L", "test": lt,
         "a": _at("alibi", far), "b": _at("alibi", 1)},
        {"claim": f"all tokens: RoPE worse at {far}L than at L", "test": g,
         "a": _at("rope", far), "b": _at("rope", 1)},
        {"claim": f"all tokens: scaled sinusoidal worse at {far}L than at L", "test": g,
         "a": _at("sinusoidal_scaled", far), "b": _at("sinusoidal_scaled", 1)},
        _copies("rope+copy", near),
        _copies("rope+copy", ds[-1], "equivalent", CH7_ACC_MARGIN),
        *(_copies("rope+copy+8L", d) for d in ds),
        *(_copies(e, near, "equivalent", CH7_ACC_MARGIN) for e in ("rope", "alibi")),
        {"claim": "attention distance inside L: RoPE closer than ALiBi", "test": lt,
         "a": _dist("rope", *inside), "b": _dist("alibi", *inside)},
        {"claim": "attention distance past L: RoPE farther than ALiBi", "test": g,
         "a": _dist("rope", *past), "b": _dist("alibi", *past)},
    ]


CH7_CLAIMS = tuple(ch7_claims())


def ch7_values(payload, ref):
    """The per-seed values (in ``payload["seeds"]`` order) a chapter-7 claim's ref names."""
    match = {k: v for k, v in ref.items() if k not in ("measure", "field", "minus")}
    rows = {r["seed"]: r[ref["field"]] for r in payload[ref["measure"]]
            if all(r.get(k) == v for k, v in match.items())}
    seeds = payload["seeds"]
    if sorted(rows) != sorted(seeds) or any(rows[s] is None for s in seeds):
        raise ValueError(f"{ref} has seeds {sorted(rows)}, the run {seeds}")
    values = [rows[s] for s in seeds]
    if "minus" in ref:
        values = [x - y for x, y in zip(values, ch7_values(payload, ref["minus"]), strict=True)]
    return values


def decide_ch7(payload, claims=None, alpha=None):
    """Each claim of chapter 7's stored family decided on the run (see :func:`ch7_claims`)."""
    claims = payload["claims"] if claims is None else claims
    alpha = payload["alpha"] if alpha is None else alpha
    confidence = bonferroni(1 - alpha, len(claims))
    out = []
    for c in claims:
        d = paired_difference(ch7_values(payload, c["a"]), ch7_values(payload, c["b"]),
                              confidence=confidence, method="t")
        out.append({"claim": c["claim"], "mean": d["mean"], "low": d["low"], "high": d["high"],
                    "confidence": confidence,
                    "verdict": verdict(d, c["test"], c.get("margin"))})
    return out


def family(args):
    """Chapter 7's family as stored (at ``--quick``'s sizes for a smoke test)."""
    return [dict(c) for c in (ch7_claims(16, 4) if args.quick else CH7_CLAIMS)]


def continue_training(model, cfg, train_ids):
    """Train ``model`` on for ``cfg.steps`` steps of :func:`training_batches` (a fresh
    AdamW and schedule, as :func:`~tutorial_pkg.experiments.training.train` sets them up)."""
    optimizer = make_optimizer(model, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
    losses = []
    model.train()
    for x, y in training_batches(train_ids, cfg):
        loss = model.loss(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"continued training diverged at step {len(losses)}")
    model.eval()
    return model, losses


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


def top_len(cfg):
    """The longest evaluation length, ``max(eval_multiples) * L``."""
    return max(cfg.eval_multiples) * cfg.train_len


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
    keys = ("records", "fixed_targets", "all_tokens", "retrieval", "attention_distance",
            "training") + (("retrieval_fixed_window",) if args.preregistered else ())
    out = {key: [] for key in keys}
    long_cfg = dataclasses.replace(  # eval sizes: enough for a window of 8 L (not used)
        base, train_len=LONG_MULTIPLE * L, batch_size=LONG_BATCH,
        steps=LONG_STEPS if not args.quick else base.steps, copy_fraction=COPY_FRACTION,
        eval_multiples=(1,), eval_tokens=max(base.eval_tokens, LONG_MULTIPLE * L),
        eval_batch_tokens=max(base.eval_batch_tokens, LONG_MULTIPLE * L))
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
            trained = [(label, model, L)]
            if args.preregistered and label in {f"{e}+copy" for e in args.long_control}:
                long_model = copy.deepcopy(model)
                _, long_losses = continue_training(long_model, dataclasses.replace(
                    long_cfg, seed=seed), train_ids)
                tail_long = long_losses[-max(1, len(long_losses) // 10):]
                out["training"].append({
                    "seed": seed, "encoding": f"{label}+{LONG_MULTIPLE}L", "trained_from": label,
                    "train_len": long_cfg.train_len, "batch_size": long_cfg.batch_size,
                    "copy_fraction": long_cfg.copy_fraction, "steps": long_cfg.steps,
                    "final_train_loss": sum(tail_long) / len(tail_long)})
                trained.append((f"{label}+{LONG_MULTIPLE}L", long_model, long_cfg.train_len))
            trial_seed = TRIAL_SEED_BASE + seed if args.preregistered else 0
            for name_r, model_r, len_r in trained:
                for r in retrieval_test(model_r, heldout_ids, distances, segment_len=seg,
                                        n_trials=args.trials, encoding_name=name_r,
                                        seed=trial_seed):
                    out["retrieval"].append({"seed": seed, "train_len": len_r,
                                             "trial_seed": trial_seed, **r})
                if args.preregistered:
                    for r in retrieval_test(model_r, heldout_ids, distances, segment_len=seg,
                                            n_trials=args.trials, encoding_name=name_r,
                                            seed=trial_seed, window_len=top_len(cfg)):
                        out["retrieval_fixed_window"].append(
                            {"seed": seed, "train_len": len_r, "trial_seed": trial_seed, **r})
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
    """Combine chapter-7 files of single seeds (same configuration) into one file.

    Pre-registered parts must carry the family already stored in ``out`` (written by
    ``--claims-only`` before any part started); the merged file keeps that family and the
    time it was written, and adds the decisions (:func:`decide_ch7`).
    """
    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]
    stored = json.loads(Path(out).read_text()) if Path(out).exists() else {}
    if "claims" in first:
        if stored.get("claims") != first["claims"] or stored.get("status") != "running":
            raise SystemExit(f"cannot merge: {out} does not hold the parts' family, running")
        started = min((part["started"] for part in parts), key=datetime.fromisoformat)
        if not datetime.fromisoformat(stored["claims_written"]) < datetime.fromisoformat(started):
            raise SystemExit("cannot merge: a part started before the family was written")
    for part in parts[1:]:
        for key in ("config", "encodings", "copy_encodings", "rope_scalings", "claims"):
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
    for key in CH7_KEYS + (("retrieval_fixed_window",) if "claims" in first else ()):
        payload[key] = [r for part in parts for r in part[key]]
    if "claims" in first:
        payload.update({"claims_written": stored["claims_written"],
                        "commit": stored["commit"], "started": started,
                        "status": "done"})
        payload["decided"] = decide_ch7(payload)
        for d in payload["decided"]:
            print(f"  {d['claim']:62s} {d['verdict']}")
    Path(out).write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
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
    parser.add_argument("--preregistered", action="store_true",
                        help="chapter 7's pre-registered run (its family, seeds, variants, "
                             "controls; chapter 7 only; see the module docstring)")
    parser.add_argument("--claims-only", action="store_true",
                        help="with --preregistered: write the family into --out, then stop")
    parser.add_argument("--skip-extrapolation", action="store_true", help="chapter 6's only")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="book/data/extrapolation_results.json")
    parser.add_argument("--tasks-out", default="book/data/hybrid_results.json")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="combine chapter-7 files of single seeds into --out, then stop")
    args = parser.parse_args(argv)
    args.long_control = []
    if args.preregistered:
        args.skip_tasks = True
        defaults = {"seeds": [0, 1, 2], "encodings": DEFAULT_ENCODINGS,
                    "copy_encodings": DEFAULT_COPY_ENCODINGS,
                    "out": "book/data/extrapolation_results.json"}
        prereg = {"seeds": CH7_SEEDS, "encodings": CH7_ENCODINGS,
                  "copy_encodings": CH7_COPY_ENCODINGS,
                  "out": "book/data/extrapolation_preregistered.json"}
        for key, value in defaults.items():
            if getattr(args, key) == value:
                setattr(args, key, prereg[key])
        args.long_control = list(args.copy_encodings)
        if args.claims_only:
            Path(args.out).write_text(json.dumps({
                "description": "Chapter 7's pre-registered run: the claim family, written "
                               "before any model was trained",
                "commit": commit(), "claims": family(args),
                "alpha": CH7_ALPHA, "test": CH7_TEST, "pilot": CH7_PILOT,
                "claims_written": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
                "status": "running"}, indent=1) + "\n")
            print(f"wrote the family into {args.out}")
            return
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
        started = datetime.now(timezone.utc).isoformat(timespec="microseconds")
        prereg = {"claims": family(args), "alpha": CH7_ALPHA,
                  "test": CH7_TEST, "pilot": CH7_PILOT, "started": started,
                  "trial_seed_base": TRIAL_SEED_BASE,
                  "long_control": {"from": [f"{e}+copy" for e in args.long_control],
                                   "train_len_multiple": LONG_MULTIPLE, "steps": LONG_STEPS,
                                   "batch_size": LONG_BATCH}} if args.preregistered else {}
        if args.preregistered:  # the family in the part too, before its first model
            Path(args.out).write_text(json.dumps({**prereg, "status": "running"}) + "\n")
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
            **prereg, **results,
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
