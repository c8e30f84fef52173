"""Draw the README's figure from chapter 7's record (``book/data/extrapolation_results.json``).

Usage (from the repository root)::

    python benchmarks/readme_figure.py   # writes book/images/ch7_perplexity_by_length.png

The figure is chapter 7's central measure: the perplexity per byte of the same target bytes
at every evaluation length (``fixed_targets``, no RoPE scaling), the mean over the recorded
seeds with a band from the lowest to the highest seed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tutorial_pkg.experiments.training import summarize_seeds  # noqa: E402
from tutorial_pkg.plotting import band_curves  # noqa: E402

SHOWN = ("nope", "sinusoidal", "sinusoidal_scaled", "learned", "rope", "alibi", "hybrid")


def main() -> None:
    rec = json.loads((ROOT / "book" / "data" / "extrapolation_results.json").read_text())
    L = rec["config"]["train_len"]
    rows = [r for r in rec["fixed_targets"] if r["scaling"] == "none"]
    stats = {(r["encoding"], r["eval_len"]): r
             for r in summarize_seeds(rows, "ppl", by=("encoding", "eval_len"))}
    lengths = sorted({n for _, n in stats})

    def series(enc, key):
        return [stats[enc, n][key] if (enc, n) in stats and stats[enc, n]["n"] else None
                for n in lengths]

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    band_curves(lengths, {enc: tuple(series(enc, k) for k in ("mean", "min", "max"))
                          for enc in SHOWN},
                ax=ax, logx=True, logy=True, xlabel="evaluation length (bytes)",
                ylabel="perplexity per byte of the same targets (log)",
                title=f"Trained at L = {L} bytes, {len(rec['seeds'])} seeds (band: min to max)")
    ax.axvline(L, color="grey", ls="--", lw=1)
    fig.tight_layout()
    out = ROOT / "book" / "images" / "ch7_perplexity_by_length.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
