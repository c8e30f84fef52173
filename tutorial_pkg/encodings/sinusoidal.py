"""Sinusoidal absolute position encoding (Vaswani et al., 2017). Chapter 1.

.. math::

    PE(p, 2i) = \\sin(p\\,\\omega_i), \\quad PE(p, 2i+1) = \\cos(p\\,\\omega_i),
    \\quad \\omega_i = \\text{base}^{-2i/d}.

The table is computed in float64 from the positions and cast once, so that
large positions keep their accuracy and a half-precision model never forms the angles
in bfloat16 or float16 (in bfloat16, neighbouring positions above 256 would share a
row); even ``dim`` only (sin/cos come in pairs).
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import (
    as_batched_positions,
    as_positions,
    check_even,
    check_float_tensor,
    check_nonneg_int,
    check_positive_float,
    check_positive_int,
    values_readable,
)

__all__ = ["sinusoidal_frequencies", "sinusoidal_table", "SinusoidalPositionalEmbedding"]


def sinusoidal_frequencies(dim: int, base: float = 10000.0) -> torch.Tensor:
    """Angular frequencies ``omega_i = base ** (-2i / dim)``, ``i = 0..dim/2-1``.

    Args:
        dim: model dimension ``d`` (even).
        base: wavelength base; 10000 in the original Transformer.

    Returns:
        float64 tensor of shape ``(dim // 2,)``.
    """
    check_even("dim", dim)
    base = check_positive_float("base", base)
    return base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def sinusoidal_table(
    positions,
    dim: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> torch.Tensor:
    """The sinusoidal position table, sin in even columns and cos in odd columns.

    Args:
        positions: an int ``L`` (positions ``0..L-1``) or an integer tensor ``(L,)``.
        dim: model dimension ``d`` (even; an odd ``d`` has no cos partner).
        base: wavelength base.
        dtype: dtype of the returned table.
        device: device of the returned table.

    Returns:
        Tensor of shape ``(L, dim)``: row ``p`` is ``PE(p)``.

    Example:
        >>> sinusoidal_table(4, 8).shape
        torch.Size([4, 8])
    """
    pos = as_positions("positions", positions, device=device)
    return _rows(pos, dim, base).to(dtype)


#: device types with no float64 (Apple's MPS): their rows are computed on the CPU
NO_FLOAT64 = frozenset({"mps"})


def _rows(positions: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """``PE(p)`` for integer positions of any shape ``(...)``: float64 ``(..., dim)``.

    On a device without float64 (:data:`NO_FLOAT64`) the rows are computed in float64 on the
    CPU and returned there as float32, moved to the positions' device (one copy each way).
    """
    if positions.device.type in NO_FLOAT64:
        return _rows(positions.cpu(), dim, base).float().to(positions.device)
    omega = sinusoidal_frequencies(dim, base).to(positions.device)
    angles = positions.to(torch.float64)[..., None] * omega  # float64: exact enough for big p
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # interleave


class SinusoidalPositionalEmbedding(nn.Module):
    """Adds ``PE(position)`` to token embeddings. Parameter-free.

    Any position works; decoding passes the positions (or a start offset) of the new
    tokens. Every row is :func:`sinusoidal_table`'s (float64 angles, cast at the end), times
    ``scale``.

    Cache policy: rows ``0..n-1`` are cached (a buffer not saved in ``state_dict``) and the
    cache grows only contiguously. When the rows it lacks are no more than it holds, or
    than the tokens of the call (a training length, a prompt, the next decoding step), or
    than 64, it doubles (at least to the rows asked for), up to ``max_cached`` rows. The
    rows of positions beyond that (a far offset, a jump) are computed directly, for the
    requested positions only, and not kept: serving 4 tokens at position 100000 costs 4
    rows, not a ``(100004, dim)`` table. Sizing the cache reads the largest position back,
    which is free for CPU positions only; positions on a GPU (or meta/fake tensors) always
    get their rows computed directly, with no synchronisation (on Apple's MPS, which has no
    float64, they are computed on the CPU: one copy each way).

    Args:
        dim: model dimension ``d`` (even).
        base: wavelength base.
        scale: factor of the table (``1``: Vaswani et al.'s values, RMS ``1/sqrt(2)``, which
            next to embeddings initialised with std 0.02 is about 35 times theirs).
        max_cached: most rows the cache may hold; default ``max(64, 2**24 // dim)``, that is
            ``2**24`` numbers, 64 MiB of float32 at any width (built through float64
            temporaries a few times larger).
    """

    def __init__(
        self, dim: int, base: float = 10000.0, scale: float = 1.0, *, max_cached: int | None = None
    ) -> None:
        super().__init__()
        self.dim = check_even("dim", dim)
        self.base = check_positive_float("base", base)
        self.scale = check_positive_float("scale", scale)
        self.max_cached = (max(64, 2**24 // dim) if max_cached is None
                           else check_positive_int("max_cached", max_cached))
        self.register_buffer("table", torch.empty(0, dim), persistent=False)

    def _cached_rows(self, device) -> int:
        return self.table.shape[0] if self.table.device == torch.device(device) else 0

    def _cacheable(self, n: int, tokens: int, device) -> bool:
        """Whether rows ``0..n-1`` may come from the cache: held already, or a contiguous
        extension (no more new rows than held, than the call's tokens, or 64) under the cap."""
        held = self._cached_rows(device)
        return n <= held or (n <= self.max_cached and n - held <= max(held, tokens, 64))

    def _grow(self, n: int, device) -> None:
        if self._cached_rows(device) < n or self.table.device != torch.device(device):
            size = min(max(n, 2 * self.table.shape[0], 64), self.max_cached)  # doubling, capped
            self.table = sinusoidal_table(size, self.dim, self.base, device=device)

    def forward(self, x: torch.Tensor, positions=None, *, offset: int = 0) -> torch.Tensor:
        """Add the encoding.

        Args:
            x: embeddings ``[b, s, d]``.
            positions: optional integer positions ``(s,)`` or ``[b, s]``; default
                ``offset + arange(s)``.
            offset: start position when ``positions`` is not given.

        Returns:
            ``x + PE[positions]`` with ``x``'s shape and dtype.
        """
        check_float_tensor("x", x, ndim=3)
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must have last dimension dim={self.dim}, got {x.shape[-1]}")
        if positions is None:
            check_nonneg_int("offset", offset)
            positions = torch.arange(offset, offset + x.shape[1], device=x.device)
        positions = as_batched_positions("positions", positions, x.shape[0], x.shape[1])
        n = None  # rows 0..n-1 cover the positions; read back only where that is free (CPU)
        if values_readable(positions):
            n = int(positions.max()) + 1 if positions.numel() else 0
        if n is not None and self._cacheable(n, x.shape[1], x.device):
            self._grow(n, x.device)
            rows = self.table[positions.to(x.device)]
        else:  # the rows of these positions only, as the table computes them
            rows = _rows(positions.to(x.device), self.dim, self.base).float()
        if self.scale != 1.0:  # skipped at 1: the default stays bit for bit the formula
            rows = rows * self.scale
        return x + rows.to(x.dtype)
