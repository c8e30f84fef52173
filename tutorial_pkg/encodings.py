"""One interface for every position encoding, and a registry. Chapters 4 and 6.

Encodings act at three different places of attention. Every encoding has the same
three hooks, and :class:`~tutorial_pkg.attention.MultiHeadAttention` calls all
three, so adding an encoding never touches attention:

==============================  =========================  ===========================
hook                            used by                    returns
==============================  =========================  ===========================
``embed(x, positions)``         sinusoidal, learned        ``x`` plus positions
``rotate(q, k, q_pos, k_pos)``  RoPE, hybrid               rotated ``q, k``
``bias(q_pos, k_pos)``          ALiBi, hybrid              fp32 ``(H, L_q, L_k)`` or None
``score_mod(q_offset)``         ALiBi, hybrid (Flex)       a FlexAttention score_mod
``key_bias(k_pos)``             ALiBi, hybrid (fast path)  ``(H, 1, L_k)`` or None
==============================  =========================  ===========================

``key_bias`` is an optional fourth view of the ``bias`` hook, for speed: when the bias
equals a per-key row *up to a constant per query*, softmax cannot tell them apart
(``softmax(s + c) = softmax(s)``), so attention may add the row ``(H, 1, L_k)`` instead of
the ``(H, L_q, L_k)`` matrix. Causal ALiBi is such a bias: ``-m (i - j) = m j - m i``.

Positions are explicit integer tensors, so decoding with a KV cache is correct for
every encoding: a new token at position ``t`` is embedded, rotated and biased as
position ``t``.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

import torch
from torch import nn

from ._checks import (
    as_positions,
    check_choice,
    check_even,
    check_float_tensor,
    check_positive_int,
)
from .alibi import ALIBI_MODES, alibi_bias, alibi_score_mod, alibi_slopes
from .rope import RotaryEmbedding
from .sinusoidal import SinusoidalPositionalEmbedding

__all__ = [
    "PositionEncoding",
    "NoPE",
    "Sinusoidal",
    "Learned",
    "Rotary",
    "ALiBi",
    "Hybrid",
    "ENCODINGS",
    "make_encoding",
]


class PositionEncoding(nn.Module):
    """Base class: every hook is the identity / ``None``.

    Subclasses override the hooks they need. ``static_bias`` says whether
    :meth:`bias` depends on positions only (then attention may cache it).
    """

    name: ClassVar[str] = "base"
    static_bias: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self._bias_cache: dict = {}
        self._row_cache: dict = {}

    # -- the three hooks --------------------------------------------------------------
    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Add absolute positions to embeddings ``[b, s, d]``; identity by default."""
        return x

    def rotate(self, q, k, q_pos, k_pos):
        """Rotate ``q`` ``[b, n_h, s_q, h_d]`` and ``k`` ``[b, n_kv, s_k, h_d]``; identity."""
        return q, k

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Additive float32 score bias ``(H, L_q, L_k)``, or ``None``."""
        return None

    def score_mod(self, q_offset: int = 0):
        """FlexAttention ``score_mod`` equal to adding :meth:`bias`, or ``None``."""
        return None

    def key_bias(self, k_pos: torch.Tensor) -> torch.Tensor | None:
        """The bias as one row per head, float32 ``(H, 1, L_k)``, or ``None``.

        Only for a bias that depends on the query through a per-query constant
        alone, ``bias(i, j) = row(j) + c(i)``: softmax is shift invariant along each
        query's row, so adding ``row`` gives the same attention weights as adding
        :meth:`bias`. ``None`` (the default) means the bias has no such form (or
        there is no bias). Used by the ``"auto"`` attention backend.
        """
        return None

    @property
    def has_bias(self) -> bool:
        """Whether :meth:`bias` returns a tensor (attention then adds it)."""
        return type(self).bias is not PositionEncoding.bias

    # -- cached bias for fused kernels ---------------------------------------------------
    def attn_bias(
        self, q_start: int, q_len: int, k_len: int, *, causal: bool, device, dtype=torch.float32
    ) -> torch.Tensor:
        """The bias as a 4-D additive mask ``(1, H, q_len, k_len)`` for SDPA, cached.

        Queries sit at positions ``q_start..q_start+q_len-1``, keys at
        ``0..k_len-1``; with ``causal`` the future keys hold ``-inf``. One square
        table per (device, dtype, causal) is built for the longest length seen
        (rounded up to a power of two) and sliced, so the ``L x L`` bias is built
        once per length, not on every forward call. A learnable bias
        (``static_bias = False``) is rebuilt on every call instead.
        """
        n = max(q_start + q_len, k_len)
        if not self.static_bias:
            return self._masked_bias(torch.arange(q_start, q_start + q_len, device=device),
                                     torch.arange(k_len, device=device), causal, dtype)
        key = (torch.device(device), dtype, causal)
        table = self._bias_cache.get(key)
        if table is None or table.shape[-1] < n:
            size = max(128, 1 << (n - 1).bit_length())
            pos = torch.arange(size, device=device)
            table = self._masked_bias(pos, pos, causal, dtype)
            self._bias_cache[key] = table
        return table[:, :, q_start : q_start + q_len, :k_len]

    def _masked_bias(self, q_pos, k_pos, causal, dtype):
        # A static bias is a cached constant: never record a graph for it.
        with torch.no_grad() if self.static_bias else contextlib.nullcontext():
            bias = self.bias(q_pos, k_pos)
            bias = bias.expand(-1, q_pos.numel(), -1)
            if causal:
                future = k_pos[None, :] > q_pos[:, None]
                bias = bias.masked_fill(future, float("-inf"))
        return bias.to(dtype).unsqueeze(0)

    def attn_key_bias(self, k_len: int, *, device) -> torch.Tensor | None:
        """:meth:`key_bias` for keys ``0..k_len-1`` as a 4-D mask ``(1, H, 1, k_len)``, cached.

        Float32 whatever the dtype of q and k (float64 for float64 slopes): the row
        holds ``m_h j``, which grows with ``j``; rounded to bfloat16 it would lose the
        small differences between neighbouring keys (in float32 the absolute error is
        about ``m_h j 2**-24``, ~1e-4 for ``m = 1/2`` at ``j = 4096``). One row per
        device is built for the longest length seen (rounded up to a power of two)
        and sliced: ``H`` floats per position, not ``H L`` as for :meth:`attn_bias`.
        A learnable bias (``static_bias = False``) is rebuilt on every call.
        ``None`` if the encoding has no :meth:`key_bias`.
        """
        if not self.static_bias:
            row = self.key_bias(torch.arange(k_len, device=device))
            return None if row is None else row.unsqueeze(0)
        key = torch.device(device)
        row = self._row_cache.get(key)
        if row is None or row.shape[-1] < k_len:
            size = max(128, 1 << (k_len - 1).bit_length())
            with torch.no_grad():
                row = self.key_bias(torch.arange(size, device=device))
            if row is None:
                return None
            row = row.unsqueeze(0)
            self._row_cache[key] = row
        return row[..., :k_len]

    def clear_cache(self) -> None:
        """Drop cached bias tables and rows (after changing slopes or scaling by hand)."""
        self._bias_cache.clear()
        self._row_cache.clear()

    def _apply(self, fn, *args, **kwargs):
        # .to()/.cuda()/.half() invalidate caches built for the old device or dtype.
        self.clear_cache()
        out = super()._apply(fn, *args, **kwargs)
        slopes = getattr(self, "slopes", None)
        if isinstance(slopes, torch.Tensor) and slopes.dtype != torch.float32:
            # A dtype cast must not round the ALiBi slopes (the bias is float32).
            self.slopes = alibi_slopes(self.n_heads, device=slopes.device)
        return out


class NoPE(PositionEncoding):
    """No position information at all (causal masking alone leaks some order)."""

    name = "nope"


class Sinusoidal(PositionEncoding):
    """Absolute sinusoidal encoding added to the embeddings (Vaswani et al., 2017).

    Args:
        d_model: model width (even).
        base: wavelength base.
    """

    name = "sinusoidal"

    def __init__(self, d_model: int, base: float = 10000.0) -> None:
        super().__init__()
        self.pe = SinusoidalPositionalEmbedding(d_model, base)

    def embed(self, x, positions):
        return self.pe(x, positions)


class Learned(PositionEncoding):
    """Learned absolute position embeddings (GPT-2 style); at most ``max_len`` positions.

    Args:
        d_model: model width.
        max_len: number of learned positions; later positions raise ``ValueError``.
    """

    name = "learned"

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        self.max_len = check_positive_int("max_len", max_len)
        self.table = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.table.weight, std=0.02)

    def embed(self, x, positions):
        check_float_tensor("x", x, ndim=3)
        positions = as_positions("positions", positions)
        if positions.numel() and int(positions.max()) >= self.max_len:
            raise ValueError(
                f"positions must be < max_len={self.max_len} for learned embeddings, got "
                f"{int(positions.max())} (they cannot extrapolate)"
            )
        return x + self.table(positions).to(x.dtype)


class Rotary(PositionEncoding):
    """RoPE on queries and keys (Su et al., 2021); see :class:`~tutorial_pkg.rope.RotaryEmbedding`.

    Args:
        head_dim: features per head.
        base: RoPE base ("theta").
        rotary_dim: rotated features per head (default all).
        layout: ``"half"`` (Hugging Face) or ``"interleaved"`` (Meta).
        scaling: context extension rule, e.g. ``{"type": "yarn", "factor": 4, ...}``.
        max_position: optional hard limit on positions.
        fused: one compiled kernel for the rotation (see
            :class:`~tutorial_pkg.rope.RotaryEmbedding`).
    """

    name = "rope"

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        *,
        rotary_dim: int | None = None,
        layout: str = "half",
        scaling: dict | None = None,
        max_position: int | None = None,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.rope = RotaryEmbedding(
            head_dim, base, rotary_dim=rotary_dim, layout=layout, scaling=scaling,
            max_position=max_position, fused=fused,
        )

    def rotate(self, q, k, q_pos, k_pos):
        return self.rope(q, k, q_pos, k_pos)  # cos/sin looked up once when q_pos is k_pos

    def set_scaling(self, scaling: dict | None) -> None:
        """Change the RoPE scaling rule (e.g. at evaluation).

        See :func:`~tutorial_pkg.rope.scaled_inv_freq`.
        """
        self.rope.set_scaling(scaling)


class ALiBi(PositionEncoding):
    """ALiBi linear biases (Press et al., 2022); no parameters, nothing added to ``x``.

    Args:
        n_heads: number of query heads (one slope each).
        mode: ``"causal"`` (``-m(i-j)``), ``"key_only"`` (``m j``) or
            ``"symmetric"`` (``-m|i-j|``, for encoders).
    """

    name = "alibi"

    def __init__(self, n_heads: int, *, mode: str = "causal") -> None:
        super().__init__()
        self.n_heads = check_positive_int("n_heads", n_heads)
        self.mode = check_choice("mode", mode, ALIBI_MODES)
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def bias(self, q_pos, k_pos):
        return alibi_bias(self.slopes, q_pos, k_pos, mode=self.mode)

    def score_mod(self, q_offset: int = 0):
        return alibi_score_mod(self.slopes, mode=self.mode, q_offset=q_offset)

    def key_bias(self, k_pos):
        # -m (i - j) = m j - m i: the key-only row, for the causal and key_only forms
        if self.mode == "symmetric":
            return None
        return alibi_bias(self.slopes, k_pos[:1], k_pos, mode="key_only")


class Hybrid(PositionEncoding):
    """RoPE on ``q, k`` plus the ALiBi bias on the scores. Chapter 6.

    ``mix="add"`` (default, the sound form): ``score = (R q).(R k)/sqrt(d) - s_h m_h (i-j)``
    where ``s_h`` is 1, or a learnable positive per-head scale with
    ``learnable_scale=True`` (initialised at 1, stored as its log).

    ``mix="alpha"`` reproduces the seeds' ``HybridPositionEncoding``:
    ``score = alpha (R q).(R k)/sqrt(d) + (1 - alpha) bias``. Note that ``alpha``
    also scales the *content* term (it acts as a softmax temperature), which is
    why it is not the default. It is implemented exactly through the hooks:
    ``q`` is multiplied by ``alpha`` and the bias by ``1 - alpha``.

    Args:
        head_dim: features per head.
        n_heads: number of query heads.
        base: RoPE base.
        mix: ``"add"`` or ``"alpha"``.
        alpha: weight of the RoPE scores for ``mix="alpha"`` (in ``[0, 1]``).
        learnable_scale: learn a per-head multiplier of the ALiBi slopes.
        mode: ALiBi form, see :class:`ALiBi`.
        layout, rotary_dim, scaling, max_position, fused: as for :class:`Rotary`.
    """

    name = "hybrid"

    def __init__(
        self,
        head_dim: int,
        n_heads: int,
        base: float = 10000.0,
        *,
        mix: str = "add",
        alpha: float = 0.5,
        learnable_scale: bool = False,
        mode: str = "causal",
        layout: str = "half",
        rotary_dim: int | None = None,
        scaling: dict | None = None,
        max_position: int | None = None,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.rope = RotaryEmbedding(
            head_dim, base, rotary_dim=rotary_dim, layout=layout, scaling=scaling,
            max_position=max_position, fused=fused,
        )
        self.n_heads = check_positive_int("n_heads", n_heads)
        self.mode = check_choice("mode", mode, ALIBI_MODES)
        self.mix = check_choice("mix", mix, ("add", "alpha"))
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)
        self.learnable_scale = bool(learnable_scale)
        if self.learnable_scale:
            self.log_scale = nn.Parameter(torch.zeros(n_heads))
            self.static_bias = False  # the bias changes as training moves log_scale

    def effective_slopes(self) -> torch.Tensor:
        """Slopes actually applied: ``m_h * s_h`` (times ``1 - alpha`` for ``mix='alpha'``)."""
        slopes = self.slopes
        if self.learnable_scale:
            slopes = slopes * self.log_scale.exp()
        if self.mix == "alpha":
            slopes = slopes * (1.0 - self.alpha)
        return slopes

    def rotate(self, q, k, q_pos, k_pos):
        q, k = self.rope(q, k, q_pos, k_pos)
        if self.mix == "alpha":
            q = q * self.alpha  # the seeds' alpha multiplies the content scores too
        return q, k

    def bias(self, q_pos, k_pos):
        return alibi_bias(self.effective_slopes(), q_pos, k_pos, mode=self.mode)

    def score_mod(self, q_offset: int = 0):
        return alibi_score_mod(self.effective_slopes(), mode=self.mode, q_offset=q_offset)

    def key_bias(self, k_pos):
        if self.mode == "symmetric":
            return None
        return alibi_bias(self.effective_slopes(), k_pos[:1], k_pos, mode="key_only")

    def set_scaling(self, scaling: dict | None) -> None:
        """Change the RoPE scaling rule (e.g. at evaluation)."""
        self.rope.set_scaling(scaling)


#: The registry of encodings, by name.
ENCODINGS: dict[str, type[PositionEncoding]] = {
    cls.name: cls for cls in (NoPE, Sinusoidal, Learned, Rotary, ALiBi, Hybrid)
}


def make_encoding(
    name: str,
    *,
    d_model: int | None = None,
    n_heads: int | None = None,
    head_dim: int | None = None,
    max_len: int | None = None,
    **kwargs,
) -> PositionEncoding:
    """Build an encoding by name from the model's sizes.

    Each encoding takes what it needs: ``sinusoidal`` and ``learned`` use
    ``d_model`` (``learned`` also ``max_len``), ``rope`` uses ``head_dim``
    (default ``d_model // n_heads``), ``alibi`` uses ``n_heads``, ``hybrid`` both.
    Extra keyword arguments go to the encoding's constructor.

    Example:
        >>> enc = make_encoding("alibi", n_heads=8)
        >>> enc.slopes.shape
        torch.Size([8])
    """
    check_choice("name", name, ENCODINGS)
    if head_dim is None and d_model is not None and n_heads is not None:
        check_positive_int("n_heads", n_heads)
        check_positive_int("d_model", d_model)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        head_dim = d_model // n_heads

    def need(arg: str, value):
        if value is None:
            raise ValueError(f"make_encoding({name!r}) needs {arg}")
        return value

    if name == "nope":
        if kwargs:
            raise TypeError(f"make_encoding('nope') got unexpected arguments {sorted(kwargs)}")
        return NoPE()
    if name == "sinusoidal":
        return Sinusoidal(check_even("d_model", need("d_model", d_model)), **kwargs)
    if name == "learned":
        return Learned(need("d_model", d_model), need("max_len", max_len), **kwargs)
    if name == "rope":
        return Rotary(need("head_dim", head_dim), **kwargs)
    if name == "alibi":
        return ALiBi(need("n_heads", n_heads), **kwargs)
    return Hybrid(need("head_dim", head_dim), need("n_heads", n_heads), **kwargs)

