"""Attention with Linear Biases (ALiBi; Press et al., 2022). Chapter 3.

Each head ``h`` adds ``-m_h * distance`` to its attention scores (after the
``1/sqrt(d)`` scaling of ``q.k``; the bias itself is *not* divided by ``sqrt(d)``, as
in the paper, BLOOM and MPT; Falcon divides it: :class:`~tutorial_pkg.encodings.builtin.ALiBi`'s
``bias_scale=head_dim ** -0.5``).
The slopes ``m_h`` are a geometric sequence; :func:`alibi_slopes` reproduces the
reference ``get_slopes`` of the paper's code for every head count.

Three forms of the bias, ``i`` the query position and ``j`` the key position:

* ``"causal"``: ``-m (i - j)`` (decoders; future keys are masked anyway).
* ``"key_only"``: ``m j``. Softmax is shift invariant per row,
  ``softmax(s + c) = softmax(s)`` for a constant ``c``, and ``-m(i-j) = m j - m i``
  differs from ``m j`` by ``-m i``, constant along a row. So both give the *same*
  attention weights; this is the form of the paper's code and of BLOOM, and it is
  a ``(H, 1, L_k)`` row that broadcasts over queries. Its values grow with ``j``,
  so use it in float32 only.
* ``"symmetric"``: ``-m |i - j|`` (encoders, bidirectional attention).

The bias is always float32 (float64 when the slopes are float64, e.g. for gradcheck),
whatever the dtype of q and k, and it is built on the device of the positions: the
slopes are constants, moved there (a table built for a GPU is built on the GPU).
"""

from __future__ import annotations

import math

import torch

from .._checks import as_positions, check_choice, check_nonneg_int, check_positive_int

try:  # the type of a FlexAttention score_mod (torch >= 2.5)
    from torch.nn.attention.flex_attention import _score_mod_signature
except ImportError:  # pragma: no cover - older torch
    from collections.abc import Callable as _score_mod_signature

__all__ = ["ALIBI_MODES", "alibi_slopes", "alibi_bias", "alibi_score_mod"]

#: The forms of the ALiBi bias (see the module docs).
ALIBI_MODES = ("causal", "key_only", "symmetric")


def _slopes_power_of_2(n: int) -> list[float]:
    # start = 2 ** (-8 / n): the slopes 2^(-8/n), 2^(-16/n), ..., 2^(-8) span (0, 1)
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]


def alibi_slopes(n_heads: int, *, device=None) -> torch.Tensor:
    """Per-head slopes ``m_h`` of Press et al. (2022), any number of heads.

    For ``n`` a power of two: ``m_h = 2 ** (-8 h / n)``, ``h = 1..n``. Otherwise the
    slopes of the closest smaller power of two ``p``, followed by every other slope
    of ``2p`` heads (those interleave between the first ones), as in the paper's
    reference ``get_slopes``.

    Args:
        n_heads: number of attention heads (>= 1).
        device: device of the result.

    Returns:
        float32 tensor ``(n_heads,)``.
    """
    check_positive_int("n_heads", n_heads)
    p = 2 ** math.floor(math.log2(n_heads))
    slopes = _slopes_power_of_2(p)
    if p != n_heads:
        slopes += _slopes_power_of_2(2 * p)[0::2][: n_heads - p]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def _as_slopes(slopes) -> torch.Tensor:
    if isinstance(slopes, int) and not isinstance(slopes, bool):
        return alibi_slopes(slopes)
    if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1:
        raise TypeError(
            "slopes must be an int head count or a 1-D tensor (n_heads,), got "
            f"{type(slopes).__name__}"
        )
    # at least float32: half-precision slopes are upcast, float64 ones kept (gradcheck)
    return slopes.to(torch.promote_types(slopes.dtype, torch.float32))


def _positions(name: str, positions, device) -> torch.Tensor:
    # (L,) or an int L, or [b, L] (one row of positions per sequence)
    if isinstance(positions, torch.Tensor) and positions.dim() == 2:
        if positions.is_floating_point() or positions.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got dtype {positions.dtype}")
        return positions.long()
    return as_positions(name, positions, device=device)


def alibi_bias(slopes, q_pos, k_pos=None, *, mode: str = "causal") -> torch.Tensor:
    """The ALiBi bias ``(H, s, L_k)`` in float32 (``(H, 1, L_k)`` for ``key_only``).

    Args:
        slopes: ``(H,)`` slopes, or an int head count for :func:`alibi_slopes`.
        q_pos: query positions: an int ``s``, an integer tensor ``(s,)``, or
            ``[b, s]`` (one row per sequence; the result is then ``(b, H, s, L_k)``).
            When decoding with a cache, the new query sits at position
            ``cache_length`` (the query offset).
        k_pos: key positions, like ``q_pos``; default ``q_pos``.
        mode: ``"causal"``, ``"key_only"`` or ``"symmetric"`` (see module docs).

    Returns:
        float32 tensor ``(H, s, L_k)``, or ``(b, H, s, L_k)`` for ``[b, L]``
        positions (float64 for float64 slopes); no mask is applied (attention masks).

    Example:
        >>> alibi_bias(torch.tensor([0.5]), 3)[0]
        tensor([[ 0.0000,  0.5000,  1.0000],
                [-0.5000,  0.0000,  0.5000],
                [-1.0000, -0.5000,  0.0000]])
    """
    slopes = _as_slopes(slopes)
    check_choice("mode", mode, ALIBI_MODES)
    q = _positions("q_pos", q_pos, slopes.device)
    k = q if k_pos is None else _positions("k_pos", k_pos, q.device)
    _check_same_device(q, k)
    return _alibi_bias(slopes, q, k, mode)


def _check_same_device(q_pos: torch.Tensor, k_pos: torch.Tensor) -> None:
    if q_pos.device != k_pos.device:
        raise ValueError(f"q_pos and k_pos must be on one device, got q_pos on {q_pos.device} "
                         f"and k_pos on {k_pos.device}")


def _alibi_bias(slopes: torch.Tensor, q: torch.Tensor, k: torch.Tensor, mode: str):
    """:func:`alibi_bias` on checked int64 positions ``(L,)`` or ``[b, L]``, no checks.

    Built on the positions' device: the slopes are moved there (a no-op when they
    are there already). Callers with *learned* slopes check their device first.
    """
    m = slopes.to(k.device)[:, None, None]
    if mode == "key_only":
        return m * k.to(m.dtype)[..., None, None, :]  # (H, 1, L_k) or (b, H, 1, L_k)
    distance = (q[..., :, None] - k[..., None, :]).to(m.dtype)  # i - j, exact up to 2**24
    if mode == "symmetric":
        distance = distance.abs()
    # (H, s, L_k) or (b, H, s, L_k); + 0.0 turns -0.0 (the diagonal) into 0.0
    return -m * distance[..., None, :, :] + 0.0


def alibi_score_mod(
    slopes: torch.Tensor,
    *,
    mode: str = "causal",
    q_offset: int = 0,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
) -> _score_mod_signature:
    """A FlexAttention ``score_mod`` adding the ALiBi bias, never materialising it.

    Positions are ``q_offset + q_idx`` for queries and ``kv_idx`` for keys (a whole
    sequence, or a chunk after ``q_offset`` cached tokens), or, when ``q_pos`` and
    ``k_pos`` are given, read from them: ``q_pos[b, q_idx]``, ``k_pos[b, kv_idx]``
    (left padding, packed documents).

    Args:
        slopes: ``(H,)`` float32 slopes (captured by the function; moved to the
            device of ``q_pos`` when positions are given, else used where they are).
        mode: ``"causal"``/``"key_only"``/``"symmetric"``.
        q_offset: position of query index 0 (the KV-cache length when decoding).
        q_pos: optional int64 ``[b, s]`` query positions (one row per batch entry).
        k_pos: optional int64 ``[b, L_k]`` key positions; given together with ``q_pos``.

    Returns:
        ``score_mod(score, b, h, q_idx, kv_idx) -> score + bias``.
    """
    check_choice("mode", mode, ALIBI_MODES)
    check_nonneg_int("q_offset", q_offset)
    slopes = _as_slopes(slopes)
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos and k_pos must be given together")
    if q_pos is not None:
        for name, t in (("q_pos", q_pos), ("k_pos", k_pos)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.is_floating_point():
                raise ValueError(f"{name} must be an integer tensor [b, L], got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
        _check_same_device(q_pos, k_pos)
        return _gathered_score_mod(slopes.to(q_pos.device), mode, q_pos, k_pos)

    if mode == "key_only":

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * kv_idx

    elif mode == "symmetric":

        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx + q_offset - kv_idx).abs()

    else:

        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx + q_offset - kv_idx)

    return score_mod


def _gathered_score_mod(slopes, mode, q_pos, k_pos) -> _score_mod_signature:
    if mode == "key_only":

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * k_pos[b, kv_idx]

    elif mode == "symmetric":

        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_pos[b, q_idx] - k_pos[b, kv_idx]).abs()

    else:

        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_pos[b, q_idx] - k_pos[b, kv_idx])

    return score_mod
