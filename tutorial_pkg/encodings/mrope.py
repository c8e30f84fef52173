"""Multimodal RoPE (M-RoPE): one position per axis (time, height, width). Chapter 8.

Qwen2-VL and Qwen2.5-VL give every token three positions ``[3, b, s]``: text tokens the
same index on all three axes, the patches of an image grid their frame, row and column
(offset to follow the text before them). Each frequency pair ``j`` of RoPE then rotates by
the position on *one* axis, ``axis(j)``:

* ``mrope_section`` ``(n_t, n_h, n_w)`` (pairs per axis, summing to ``head_dim / 2``):
  the first ``n_t`` frequencies (the fastest) follow time, the next ``n_h`` height, the
  last ``n_w`` width (Qwen2-VL, Qwen2.5-VL: ``[16, 24, 24]`` for ``head_dim`` 128);
* ``interleaved=True`` (Qwen3-VL's ``mrope_interleaved``): height and width take every
  third frequency, ``j = 1, 4, 7, ...`` and ``j = 2, 5, 8, ...`` (the first ``3 n_h`` and
  ``3 n_w``), time the rest, so every axis has fast and slow frequencies.

The pairs are Hugging Face's half layout; the angles are float32 ``position * inv_freq``
as in transformers' ``recomposition_frequencies``. For text alone (positions ``(s,)`` or
``[b, s]``) every axis has the same position and M-RoPE is RoPE.
:func:`mrope_positions` builds the three positions of a text and image sequence as
transformers' ``get_rope_index`` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._checks import check_even, check_nonneg_int, check_positive_float, check_positive_int
from .builtin import PositionEncoding
from .rope import inv_freq
from .rope_kernels import rotate_pairs

__all__ = ["MRotary", "mrope_axes", "mrope_positions"]


def mrope_axes(mrope_section: Sequence[int], interleaved: bool = False) -> torch.Tensor:
    """int64 ``[sum(mrope_section)]``: the axis (0 time, 1 height, 2 width) of each pair."""
    section = [check_positive_int("mrope_section", n) for n in mrope_section]
    if len(section) != 3:
        raise ValueError(f"mrope_section must have 3 entries (time, height, width), got "
                         f"{list(mrope_section)}")
    half = sum(section)
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
    axes = torch.zeros(half, dtype=torch.long)
    for axis in (1, 2):
        if 3 * section[axis] > half + axis:
            raise ValueError(f"interleaved mrope_section {section}: {3 * section[axis]} "
                             f"frequencies for axis {axis}, more than the {half} pairs")
        axes[axis : 3 * section[axis] : 3] = axis
    return axes


class MRotary(PositionEncoding):
    """M-RoPE on ``q`` and ``k``; positions ``[3, b, s]`` (or ``(s,)``, ``[b, s]`` for text).

    Args:
        head_dim: features per head (even); every feature is rotated.
        base: the RoPE base ``rope_theta``.
        mrope_section: pairs per axis ``(time, height, width)``, summing to ``head_dim / 2``.
        interleaved: Qwen3-VL's interleaved assignment (module docs).

    Raises:
        ValueError, TypeError: naming the argument.
    """

    name = "mrope"
    #: attention passes ``[3, b, s]`` positions to :meth:`rotate` (``MultiHeadAttention``)
    position_axes = 3

    def __init__(self, head_dim: int, base: float = 10000.0, *,
                 mrope_section: Sequence[int] = (16, 24, 24), interleaved: bool = False) -> None:
        super().__init__()
        self.head_dim = check_even("head_dim", head_dim)
        self.base = check_positive_float("base", base)
        if not isinstance(interleaved, bool):
            raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
        axes = mrope_axes(mrope_section, interleaved)
        if axes.numel() != head_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} sums to {axes.numel()} pairs, "
                             f"not head_dim / 2 = {head_dim // 2}")
        self.mrope_section, self.interleaved = tuple(int(n) for n in mrope_section), interleaved
        self.register_buffer("inv_freq", inv_freq(head_dim, base), persistent=False)
        self.register_buffer("axes", axes, persistent=False)

    @classmethod
    def build(cls, *, d_model=None, n_heads=None, head_dim=None, max_positions=None, **options):
        if head_dim is None:
            raise ValueError("make_encoding('mrope') needs head_dim")
        return cls(head_dim, **options)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """float32 ``[b, s, head_dim / 2]`` angles of positions ``[3, b, s]`` (or text's
        ``(s,)`` / ``[b, s]``): pair ``j`` at the position of its axis."""
        pos = positions
        if pos.dim() == 1:
            pos = pos[None]
        if pos.dim() == 2:
            pos = pos[None].expand(3, -1, -1)
        inv = self.inv_freq.to(pos.device)
        per_axis = pos.to(torch.float32)[..., None] * inv  # [3, b, s, d/2]
        index = self.axes.to(pos.device).view(1, 1, 1, -1).expand(1, *per_axis.shape[1:])
        return per_axis.gather(0, index)[0]

    def rotate(self, q, k, q_pos, k_pos):
        a = self.angles(q_pos)[:, None]  # [b, 1, s, d/2] against [b, H, s, d]
        cos, sin = a.cos(), a.sin()
        if q_pos is k_pos and q.shape[-2] == k.shape[-2]:
            return rotate_pairs(cos, sin, "half", q, k)
        b = self.angles(k_pos)[:, None]
        return (rotate_pairs(cos, sin, "half", q)[0],
                rotate_pairs(b.cos(), b.sin(), "half", k)[0])


def mrope_positions(segments: Sequence[tuple], *, start: int = 0) -> torch.Tensor:
    """int64 ``[3, 1, s]``: the M-RoPE positions of a sequence of text and image segments.

    ``segments`` lists ``("text", n)`` (``n`` tokens) and ``("image", (t, h, w))`` (a grid
    of ``t * h * w`` tokens after the vision encoder's spatial merge), in order. As
    transformers' ``get_rope_index``: text continues from the largest position so far
    (every axis the same index); an image's tokens, frame-major then row-major, sit at
    ``(s0 + f, s0 + r, s0 + c)`` with ``s0`` the next text index; the text after it
    continues from ``max + 1``.
    """
    rows, nxt = [], check_nonneg_int("start", start)
    for kind, size in segments:
        if kind == "text":
            n = check_positive_int("text length", size)
            idx = torch.arange(nxt, nxt + n)
            rows.append(idx.expand(3, -1))
            nxt += n
        elif kind == "image":
            t, h, w = (check_positive_int("grid", v) for v in size)
            f, r, c = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                     indexing="ij")
            rows.append(torch.stack((f.flatten(), r.flatten(), c.flatten())) + nxt)
            nxt = int(rows[-1].max()) + 1
        else:
            raise ValueError(f"a segment is ('text', n) or ('image', (t, h, w)), got {kind!r}")
    return torch.cat(rows, dim=1)[:, None, :]
