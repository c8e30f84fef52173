"""T5's relative position bias: learned, one scalar per (head, bucket of distance).

Raffel et al. (2020) add to every attention score a learned scalar that depends on the
head and on the relative position ``k - q`` (key minus query) through a *bucket*:
distances below ``max_exact = num_buckets // 2`` (per direction) get a bucket each,
longer ones share logarithmically wider buckets up to ``max_distance``, and every
distance from ``max_distance`` on shares the last bucket. With ``bidirectional=True``
(T5's encoder) half of the buckets are for keys after the query; with
``bidirectional=False`` (T5's decoder, causal) every key after the query falls in
bucket 0, the query's own. :func:`t5_relative_position_bucket` is the bucket function
of Hugging Face's ``T5Attention._relative_position_bucket`` (tested equal on a grid
of distances, negative ones and ones past ``max_distance`` included).

Because the bucket no longer changes from ``|k - q| = max_distance`` on, the bias is a
function of ``clamp(k - q, -max_distance, max_distance)``: :class:`T5RelativeBias`
gathers it from a table of ``2 max_distance + 1`` values per head, never from an
``L``-sized table, so it accepts any length.

**Scaling.** T5 does not divide ``q . k`` by ``sqrt(d_h)`` at all (the factor is folded
into the initialisation of ``W_q``). This package scales the content scores by
``1 / sqrt(d_h)`` for every encoding (as SDPA and FlexAttention do) and adds the bias
unscaled, as it adds ALiBi's: ``score = q . k / sqrt(d_h) + b_h(bucket(k - q))``. So
the learned bias lives on the same scale as the logits of every other encoding here,
and the backends need no special case. To load a T5 checkpoint, multiply ``W_q`` by
``sqrt(d_h)`` (then the scaled scores equal T5's unscaled ones) and copy the bias
weight ``(num_buckets, n_heads)`` as it is: :class:`T5RelativeBias` stores it in the
layout of Hugging Face's ``relative_attention_bias`` embedding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._checks import check_nonneg_int, check_positive_float, check_positive_int
from .builtin import PositionEncoding, check_learned_device

__all__ = ["T5_NUM_BUCKETS", "T5_MAX_DISTANCE", "t5_relative_position_bucket", "T5RelativeBias"]

#: T5's number of buckets (``relative_attention_num_buckets``).
T5_NUM_BUCKETS = 32
#: T5's ``relative_attention_max_distance``.
T5_MAX_DISTANCE = 128


def _check_buckets(num_buckets, max_distance, bidirectional) -> None:
    check_positive_int("num_buckets", num_buckets)
    check_positive_int("max_distance", max_distance)
    if not isinstance(bidirectional, bool):
        raise TypeError(f"bidirectional must be a bool, got {type(bidirectional).__name__}")
    per_direction = num_buckets // 2 if bidirectional else num_buckets
    if per_direction < 2:
        raise ValueError(
            f"num_buckets must leave at least 2 buckets per direction, got {num_buckets} "
            f"(bidirectional={bidirectional})"
        )
    if max_distance <= per_direction // 2:
        raise ValueError(
            f"max_distance must exceed the exact range num_buckets // "
            f"{4 if bidirectional else 2} = {per_direction // 2}, got {max_distance}"
        )


def t5_relative_position_bucket(
    relative_position: torch.Tensor,
    *,
    bidirectional: bool = True,
    num_buckets: int = T5_NUM_BUCKETS,
    max_distance: int = T5_MAX_DISTANCE,
) -> torch.Tensor:
    """The bucket of each relative position ``k - q``, as T5 computes it.

    Args:
        relative_position: integer tensor of any shape, key position minus query
            position (negative: the key is before the query).
        bidirectional: separate buckets for keys after the query (encoder); with
            ``False`` (decoder) every later key shares bucket 0.
        num_buckets: total number of buckets.
        max_distance: distances from here on share the last bucket of their direction.

    Returns:
        int64 buckets in ``[0, num_buckets)``, the shape of ``relative_position``.

    Example:
        >>> t5_relative_position_bucket(torch.tensor([-200, -20, -1, 0, 1, 20]))
        tensor([15, 10,  1,  0, 17, 26])
    """
    if not isinstance(relative_position, torch.Tensor) or (
        relative_position.is_floating_point() or relative_position.is_complex()
        or relative_position.dtype == torch.bool
    ):
        raise TypeError("relative_position must be an integer tensor, got "
                        f"{getattr(relative_position, 'dtype', type(relative_position).__name__)}")
    _check_buckets(num_buckets, max_distance, bidirectional)
    rel = relative_position.long()
    if bidirectional:
        per_direction = num_buckets // 2
        offset = (rel > 0).long() * per_direction  # keys after the query: upper half
        distance = rel.abs()
    else:
        per_direction, offset = num_buckets, 0
        distance = (-rel).clamp_min(0)  # keys after the query: distance 0
    exact = per_direction // 2
    # logarithmic buckets between exact and max_distance (float32, as T5 computes them);
    # clamp_min(1) only keeps log finite where the exact branch is taken anyway
    log_ratio = torch.log(distance.clamp_min(1).float() / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (per_direction - exact)).long()).clamp_max(per_direction - 1)
    return offset + torch.where(distance < exact, distance, large)


class T5RelativeBias(PositionEncoding):
    """T5's learned relative position bias (Raffel et al., 2020), through the bias hooks.

    ``bias(q, k)[h] = weight[bucket(k - q), h]``, float32, added to the scaled
    scores (see the module docs for why it is not divided by ``sqrt(d_h)``). The
    parameters are learnable, so attention rebuilds the bias on every call
    (``static_bias = False``); FlexAttention gets a ``score_mod`` that gathers from the
    ``(n_heads, 2 max_distance + 1)`` table. Shared by every layer of a
    :class:`~tutorial_pkg.models.tiny_lm.TinyLM`, as T5 shares the first layer's bias. The table
    is learned, so it is never copied to the device of a call: positions on another
    device than the encoding raise ``ValueError`` naming both.

    Args:
        n_heads: query heads (one learned value per head and bucket).
        num_buckets: buckets (T5: 32).
        max_distance: distance from which buckets stop growing (T5: 128).
        bidirectional: ``False`` (default, T5's decoder: causal models) or ``True``
            (T5's encoder: keys after the query get their own buckets).
        init_std: standard deviation of the normal initialisation.

    Attributes:
        relative_attention_bias: ``nn.Embedding(num_buckets, n_heads)``, Hugging
            Face's name and layout.
    """

    name = "t5"
    static_bias = False

    def __init__(
        self,
        n_heads: int,
        *,
        num_buckets: int = T5_NUM_BUCKETS,
        max_distance: int = T5_MAX_DISTANCE,
        bidirectional: bool = False,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.n_heads = check_positive_int("n_heads", n_heads)
        _check_buckets(num_buckets, max_distance, bidirectional)
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bidirectional
        self.relative_attention_bias = nn.Embedding(num_buckets, n_heads)
        nn.init.normal_(self.relative_attention_bias.weight,
                        std=check_positive_float("init_std", init_std))
        distances = torch.arange(-max_distance, max_distance + 1)
        self.register_buffer(
            "buckets",
            t5_relative_position_bucket(distances, bidirectional=bidirectional,
                                        num_buckets=num_buckets, max_distance=max_distance),
            persistent=False,
        )

    def table(self) -> torch.Tensor:
        """The bias per head and clamped distance: ``(n_heads, 2 max_distance + 1)``.

        Column ``max_distance + r`` holds the bias of ``k - q = r``, for
        ``|r| <= max_distance``; at least float32.
        """
        weight = self.relative_attention_bias.weight
        weight = weight.to(torch.promote_types(weight.dtype, torch.float32))
        return weight[self.buckets].T.contiguous()

    def _index(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        rel = k_pos[..., None, :] - q_pos[..., :, None]
        return rel.clamp(-self.max_distance, self.max_distance) + self.max_distance

    def bias(self, q_pos, k_pos):
        check_learned_device(self, k_pos.device)
        out = self.table()[:, self._index(q_pos, k_pos)]  # (H, [b,] s, L_k)
        return out.movedim(0, 1) if out.dim() == 4 else out

    def score_mod(self, q_offset=0, q_pos=None, k_pos=None):
        check_nonneg_int("q_offset", q_offset)
        if (q_pos is None) != (k_pos is None):
            raise ValueError("q_pos and k_pos must be given together")
        if q_pos is not None:
            check_learned_device(self, q_pos.device)
        table = self.table()
        # the bounds as tensors: a captured int becomes symbolic when Flex is compiled with
        # dynamic shapes, and torch 2.13's inductor cannot lower clamp with symbolic bounds
        low, high = (torch.tensor(v, device=table.device) for v in (0, 2 * self.max_distance))
        shift = self.max_distance

        if q_pos is None:

            def score_mod(score, b, h, q_idx, kv_idx):
                index = torch.minimum(torch.maximum(kv_idx - q_idx - q_offset + shift, low), high)
                return score + table[h, index]

        else:

            def score_mod(score, b, h, q_idx, kv_idx):
                rel = k_pos[b, kv_idx] - q_pos[b, q_idx]
                return score + table[h, torch.minimum(torch.maximum(rel + shift, low), high)]

        return score_mod

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, num_buckets={self.num_buckets}, "
                f"max_distance={self.max_distance}, bidirectional={self.bidirectional}")

