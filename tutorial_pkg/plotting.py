"""Matplotlib figures shared by the chapters.

Each function draws on axes it is given (or creates a figure) and returns the
figure, so a chapter can add to it; nothing here calls ``plt.show()``.

matplotlib is an optional dependency (``pip install "tutorial_pkg[plot]"``; the book's
extra has it too): ``import tutorial_pkg`` does not import this module, and importing it
without matplotlib raises an ``ImportError`` that says so.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

try:
    import matplotlib.pyplot as plt
except ImportError as exc:  # the layers need no matplotlib; only the figures do
    raise ImportError(
        'tutorial_pkg.plotting needs matplotlib: pip install "tutorial_pkg[plot]"'
    ) from exc

__all__ = ["heatmap", "head_heatmaps", "curves", "band_curves", "slider_figure"]


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(x)


def heatmap(
    matrix,
    *,
    ax=None,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    cmap: str = "viridis",
    colorbar: str | None = None,
    vmin=None,
    vmax=None,
):
    """Draw a 2-D array as an image with labelled axes (row 0 at the top).

    Args:
        matrix: ``(rows, cols)`` tensor or array.
        ax: axes to draw on (default: a new figure).
        title, xlabel, ylabel: labels.
        cmap: colormap name.
        colorbar: colorbar label; ``None`` for no colorbar.
        vmin, vmax: colour limits.

    Returns:
        The figure.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 4))
    im = ax.imshow(_np(matrix), aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax,
                   interpolation="nearest")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if colorbar is not None:
        ax.figure.colorbar(im, ax=ax, label=colorbar)
    return ax.figure


def head_heatmaps(
    per_head,
    *,
    titles: Sequence[str] | None = None,
    suptitle: str = "",
    xlabel: str = "key position j",
    ylabel: str = "query position i",
    cmap: str = "viridis",
    ncols: int = 4,
    share_scale: bool = False,
    colorbar: str | None = None,
    vmin=None,
    vmax=None,
):
    """One heatmap per head from a ``(H, s, L_k)`` tensor (biases or attention weights).

    Heads are titled ``head 1`` .. ``head H`` (the book numbers heads from 1) unless
    ``titles`` is given. ``colorbar`` labels one colour bar per panel; ``vmin``/``vmax``
    fix the colour range of every panel (``share_scale`` takes it from the data).

    Returns:
        The figure.
    """
    data = _np(per_head)
    n = data.shape[0]
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.9 * nrows), squeeze=False)
    if share_scale and vmin is None and vmax is None:
        vmin, vmax = float(np.nanmin(data)), float(np.nanmax(data))
    for h in range(nrows * ncols):
        ax = axes[h // ncols][h % ncols]
        if h >= n:
            ax.axis("off")
            continue
        heatmap(data[h], ax=ax, title=titles[h] if titles else f"head {h + 1}", cmap=cmap,
                vmin=vmin, vmax=vmax, colorbar=colorbar,
                xlabel=xlabel if h // ncols == nrows - 1 else "",
                ylabel=ylabel if h % ncols == 0 else "")
    fig.suptitle(suptitle)
    fig.tight_layout()
    return fig


def curves(
    x,
    ys: Mapping[str, Iterable],
    *,
    ax=None,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    logx: bool = False,
    logy: bool = False,
    marker: str | None = "o",
):
    """Several labelled curves sharing one x axis.

    Args:
        x: x values.
        ys: ``{label: y values}``.

    Returns:
        The figure.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    for label, y in ys.items():
        ax.plot(_np(x), _np(list(y) if not isinstance(y, torch.Tensor) else y),
                marker=marker, label=label)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return ax.figure


def band_curves(
    x,
    series: Mapping[str, tuple],
    *,
    ax=None,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    logx: bool = False,
    logy: bool = False,
    ylim: tuple | None = None,
):
    """Curves with a shaded band: ``{label: (mean, low, high)}``, e.g. mean and min/max over seeds.

    Each series gets its own colour, marker and line style, so that curves lying on top
    of each other stay visible. ``None`` values are skipped. With ``ylim`` the axis is
    clipped (values outside it leave the plot; say so in the caption).

    Returns:
        The figure.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4.2))
    markers = "osD^vP*Xh<>"
    styles = ["-", "--", "-.", ":"]
    xs = _np(x).astype(float)
    for i, (label, (mean, low, high)) in enumerate(series.items()):
        keep = [j for j, v in enumerate(mean) if v is not None]
        if not keep:
            continue
        xv = xs[keep]
        m = np.array([mean[j] for j in keep], dtype=float)
        lo = np.array([low[j] for j in keep], dtype=float)
        hi = np.array([high[j] for j in keep], dtype=float)
        (line,) = ax.plot(xv, m, marker=markers[i % len(markers)], ls=styles[i % len(styles)],
                          label=label)
        ax.fill_between(xv, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{v:g}" for v in xs])
    if logy:
        ax.set_yscale("log")
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return ax.figure


def slider_figure(
    name: str,
    x,
    frames: Mapping[str, Mapping[str, Iterable]],
    *,
    slider: str,
    xlabel: str = "",
    ylabel: str = "",
    title: str = "",
    digits: int = 4,
    logx: bool = False,
    fallback: str | None = None,
) -> str:
    """An interactive figure for the rendered book: curves over ``x`` and a slider that
    steps through ``frames``. Returns HTML to display (``IPython.display.HTML``).

    The page draws it with ``book/_static/slider-figure.js`` (bundled with the book: no
    network); where that script does not run (no JavaScript, or a notebook, which does not
    load it) the HTML shows one line, ``fallback``, and the chapter keeps a static figure.
    Values are rounded to ``digits`` decimals, so the stored HTML does not depend on the
    CPU's last bits.

    Args:
        name: the figure's id on its page (letters, digits, ``-``).
        x: ``[n]`` x values shared by every curve.
        frames: ``{slider label: {curve label: [n] y values}}``, the same curve labels in
            every frame, in the order the slider steps through them.
        slider: what the slider sets (shown beside it).
        logx: a logarithmic x axis (``x > 0``).
        fallback: the line shown where the book's script does not run (in Jupyter or Colab,
            which do not load it, as much as in a browser without JavaScript); default: a
            line saying so, which names no other figure (pass one that points the reader to
            the chapter's static counterpart). Plain text (escaped).

    Raises:
        ValueError: for a bad ``name``, no frames, curves that differ between frames, or
            curves whose length is not ``len(x)``.
    """
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", name):
        raise ValueError(f"name must be letters, digits and '-', got {name!r}")
    xs = [round(float(v), digits) for v in _np(x).reshape(-1)]
    if not frames:
        raise ValueError("frames must hold at least one frame")
    labels = None
    data = []
    for value, curves_ in frames.items():
        if labels is None:
            labels = list(curves_)
        if list(curves_) != labels:
            raise ValueError(f"frame {value!r} has curves {list(curves_)}, the first has {labels}")
        ys = [[round(float(v), digits) for v in _np(y).reshape(-1)] for y in curves_.values()]
        if any(len(y) != len(xs) for y in ys):
            raise ValueError(f"frame {value!r}: every curve needs len(x) = {len(xs)} values")
        data.append({"value": str(value), "ys": ys})
    if logx and min(xs) <= 0:
        raise ValueError("logx needs x > 0")
    spec = {"x": xs, "labels": labels, "frames": data, "slider": slider, "xlabel": xlabel,
            "ylabel": ylabel, "title": title, "logx": logx}
    if fallback is None:
        fallback = ("(An interactive figure with a slider, drawn by the rendered book's own "
                    "script; where that script does not run, as in a notebook, only this line "
                    "shows.)")
    return (f'<div class="pe-slider-figure" id="{name}" '
            f'data-figure="{html.escape(json.dumps(spec, separators=(",", ":")))}">'
            f"<p>{html.escape(fallback)}</p></div>")
