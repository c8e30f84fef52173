"""Record what CPU SDPA computes for a float32 mask given with float64 queries, per kernel level.

Chapter 9's bug 16: ``F.scaled_dot_product_attention`` documents a boolean mask or "a float
mask of the same type as query, key, value"; its argument check lets a float32 mask with
float64 queries through. This script runs the chapter's call (``my_alibi_attention`` and
``case`` below are the chapter's cell, verbatim; ``tests/test_sdpa_avx2_record.py`` holds the
two to each other) once per CPU kernel level PyTorch can be told to use, each in a fresh
process, since ``ATEN_CPU_CAPABILITY`` is read when torch loads its kernels:

* ``avx2``: the kernels a CPU without AVX-512 runs;
* ``default``: the kernels without vector instructions;
* the machine's own (the variable unset).

For each it stores the kernel level torch reports, the largest error of the output against
the same attention in float64 arithmetic, the output's own scale (its largest magnitude), and
the same error for the fixed call (the mask cast to q's dtype). Values are rounded to three
significant digits, and an error below :data:`TOL` is stored as ``None`` with
``"right": true`` (its last digits are the CPU's rounding, not a finding).

    python benchmarks/sdpa_avx2_mask.py --out book/data/sdpa_avx2_mask.json   # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tutorial_pkg as tp  # noqa: E402
from tutorial_pkg import measure as bm  # noqa: E402

#: The values of ``ATEN_CPU_CAPABILITY`` run, in the record's order (None: unset).
CAPABILITIES = ("avx2", "default", None)
#: An error below this counts as right (float64 math, a 10-token softmax).
TOL = 1e-12
#: The CPU flags that decide which kernels a CPU can run, as /proc/cpuinfo names them.
FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile")


def my_alibi_attention(q, k, v, slopes):
    """Causal ALiBi attention, the bias from float32 slopes: (b, H, s, d) -> (b, H, s, d)."""
    n = q.shape[-2]
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]  # i - j
    bias = -slopes[:, None, None] * distance  # (H, s, s), float32 like the slopes
    bias = bias.masked_fill(distance < 0, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])


def case():
    """The chapter's q, k, v (float64) and slopes (float32)."""
    gen16 = torch.Generator().manual_seed(0)
    q16, k16, v16 = (torch.randn(2, 6, 10, 8, dtype=torch.float64, generator=gen16)
                     for _ in range(3))
    slopes16 = tp.alibi_slopes(6)  # float32
    return q16, k16, v16, slopes16


def float64_attention(q16, k16, v16, slopes16):
    """The same attention in float64 arithmetic (the chapter's reference)."""
    distance16 = torch.arange(10)[:, None] - torch.arange(10)[None, :]
    bias16 = (-slopes16.double()[:, None, None] * distance16).masked_fill(distance16 < 0,
                                                                         float("-inf"))
    return ((q16 @ k16.transpose(-2, -1)) / math.sqrt(8) + bias16).softmax(-1) @ v16


def measure_here() -> dict:
    """The call in this process: kernel level, errors against float64 math, output scale."""
    q16, k16, v16, slopes16 = case()
    exact16 = float64_attention(q16, k16, v16, slopes16)
    out = my_alibi_attention(q16, k16, v16, slopes16)
    n = q16.shape[-2]
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    bias = (-slopes16[:, None, None] * distance).masked_fill(distance < 0, float("-inf"))
    fixed = F.scaled_dot_product_attention(q16, k16, v16, attn_mask=bias[None].to(q16.dtype))
    return {"capability": torch.backends.cpu.get_cpu_capability(),
            "mask_dtype": str(bias.dtype).removeprefix("torch."),
            "q_dtype": str(q16.dtype).removeprefix("torch."),
            "max_error": (out - exact16).abs().max().item(),
            "max_error_fixed": (fixed - exact16).abs().max().item(),
            "output_scale": exact16.abs().max().item()}


def in_subprocess(capability: str | None) -> dict:
    """:func:`measure_here` in a fresh interpreter with ``ATEN_CPU_CAPABILITY=capability``."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one"], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def sig3(x: float) -> float:
    return float(f"{x:.3g}")


def summarise(capability: str | None, measured: dict) -> dict:
    """One run of the record: what was asked, what ran, rounded errors and verdicts."""
    right, right_fixed = measured["max_error"] < TOL, measured["max_error_fixed"] < TOL
    return {"ATEN_CPU_CAPABILITY": capability,
            "capability": measured["capability"],
            "q_dtype": measured["q_dtype"], "mask_dtype": measured["mask_dtype"],
            "max_error": None if right else sig3(measured["max_error"]),
            "right": right,
            "max_error_fixed": None if right_fixed else sig3(measured["max_error_fixed"]),
            "right_fixed": right_fixed,
            "output_scale": sig3(measured["output_scale"])}


def cpu_flags() -> list[str]:
    """The flags of :data:`FLAGS` this CPU reports (Linux; [] elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.partition(":")[2].split())
    return [f for f in FLAGS if f in have]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where to write the record (JSON)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # the child: one measurement, as JSON on the last line
        print(json.dumps(measure_here()))
        return {}
    hardware = bm.hardware_info("cpu")
    record = {
        "case": {"function": "my_alibi_attention", "q, k, v": "float64 [2, 6, 10, 8], "
                 "torch.Generator().manual_seed(0)", "slopes": "tp.alibi_slopes(6), float32",
                 "reference": "the same attention in float64 arithmetic"},
        "tolerance": TOL,
        "runs": [summarise(c, in_subprocess(c)) for c in CAPABILITIES],
        "torch": torch.__version__,
        "cpu_flags": cpu_flags(),
        "hardware": {k: hardware[k] for k in ("cpu", "machine", "os", "python", "date")},
        "command": "python " + shlex.join(["benchmarks/sdpa_avx2_mask.py"]
                                          + (argv if argv is not None else sys.argv[1:])),
    }
    text = json.dumps(record, indent=1) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text, end="")
    return record


if __name__ == "__main__":
    main()
