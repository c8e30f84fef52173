"""The source articles' ALiBi attention, kept as a measured baseline (deliberately slow).

Both articles ("Stop looking only at RoPE: reproduce ALiBi in PyTorch step by step" and
"RoPE and ALiBi in PyTorch: the mathematics and the engineering", see
``book/05_benchmarking.ipynb``) precompute the whole ALiBi bias into a fixed
``(H, max_positions, max_positions)`` buffer and add it to materialised scores. The suite
measures that code next to the package's paths (``alibi/article``), so that the book can say how
much the package's default path saves. It is not part of ``tutorial_pkg``: nobody should
import it into a model.
"""

from __future__ import annotations

import math

import torch

from tutorial_pkg.encodings.alibi import alibi_slopes


class ArticlesALiBiAttention:
    """The articles' ALiBi attention, reconstructed as they describe it.

    Slopes as in Press et al.'s ``get_slopes``; the bias ``-m (i - j)`` precomputed
    into a fixed ``(H, max_positions, max_positions)`` buffer in ``__init__`` and sliced
    (the articles' buffer holds 2048 positions, so their code breaks past 2048 tokens); a
    causal mask built with ``torch.tril`` on every call; ``masked_fill(mask == 0, -inf)``;
    softmax; weighted sum. Everything ``L x L`` is materialised, in float32.

    Args:
        n_heads: heads ``H``.
        max_positions: side of the precomputed buffer.
        device: where the buffer lives.
    """

    def __init__(self, n_heads: int, max_positions: int = 2048, device=None) -> None:
        slopes = alibi_slopes(n_heads, device=device)
        pos = torch.arange(max_positions, device=device)
        distance = (pos[:, None] - pos[None, :]).float()
        self.alibi_biases = -slopes[:, None, None] * distance  # (H, max_positions, max_positions)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[b, H, L, d]`` heads in, ``[b, H, L, d]`` out (float32 arithmetic, q's dtype)."""
        L = q.shape[-2]
        scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
        scores = scores + self.alibi_biases[:, :L, :L]  # past max_positions: a shape error
        mask = torch.tril(torch.ones(L, L, device=q.device))
        scores = scores.masked_fill(mask == 0, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)
