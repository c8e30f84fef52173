"""Matplotlib figures shared by the chapters.

Each function draws on axes it is given (or creates a figure) and returns the
figure, so a chapter can add to it; nothing here calls ``plt.show()``.

matplotlib is an optional dependency (``pip install "tutorial_pkg[plot]"``; the book's
extra has it too): ``import tutorial_pkg`` does not import this module, and importing it
without matplotlib raises an ``ImportError`` that says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

try:
    import matplotlib.pyplot as plt
except ImportError as exc:  # the layers need no matplotlib; only the figures do
    raise ImportError(
        'tutorial_pkg.plotting needs matplotlib: pip install "tutorial_pkg[plot]"'
    ) from exc

__all__ = ["heatmap", "head_heatmaps", "curves", "band_curves"]


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
