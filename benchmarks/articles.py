"""The source articles' ALiBi attention, kept as a measured baseline (deliberately slow).

Both articles ("Stop looking only at RoPE: reproduce ALiBi in PyTorch step by step", 000, and
"RoPE and ALiBi in PyTorch: the mathematics and the engineering", 002, see
``book/05_benchmarking.ipynb``) add an ALiBi bias to materialised scores. Neither layer builds
a causal mask: 000's ``ALiBiAttention`` builds the symmetric bias ``-m |i - j|`` in
every forward (no buffer) and masks only if a ``mask`` is passed; 002's registers a symmetric
bias for 2048 positions as a buffer and takes only a ``key_padding_mask``. The suite's
``alibi/article`` case is a causal layer written their way: what both share, 002's precomputed
buffer, and a causal mask (which neither builds) made on every call. The book's verdicts on this
case (claim A10) are about this class, not about either article's layer as written. It is not
part of ``tutorial_pkg``: nobody should import it into a model.
"""

from __future__ import annotations

import math

import torch

from tutorial_pkg.encodings.alibi import alibi_slopes


class ArticlesALiBiAttention:
    """Causal ALiBi attention written the articles' way (see the module docstring).

    Kept from the articles: slopes as in Press et al.'s ``get_slopes``; float32 scores
    materialised, the bias added, ``masked_fill(mask == 0, -inf)``, softmax, weighted sum;
    from article 002, the bias precomputed into a fixed ``(H, max_positions, max_positions)``
    buffer in ``__init__`` and sliced (002's buffer holds 2048 positions, so its code breaks
    past 2048 tokens). Added: a causal mask built with ``torch.tril`` on every call, which
    neither article's layer builds (000's applies one only if the caller passes it). The
    buffer holds the signed bias ``-m (i - j)`` (the articles build ``-m |i - j|``), equal to
    it wherever the causal mask lets a key through.
    No projections. Everything ``L x L`` is materialised, in float32.

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
