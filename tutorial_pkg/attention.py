"""Multi-head attention with pluggable encodings and backends; KV cache; block. Chapter 4.

Backends (all agree with ``"naive"`` to tolerance, tested for every encoding):

* ``"naive"``: matmul, softmax, matmul, in float32 (float64 for float64 inputs).
  The textbook form and the test oracle; it materialises the ``(b, H, L_q, L_k)``
  scores.
* ``"sdpa"``: :func:`torch.nn.functional.scaled_dot_product_attention`. Without a
  bias it uses ``is_causal=True`` (nothing ``L x L`` is built). With ALiBi/hybrid
  it passes the encoding's cached 4-D bias ``(1, H, L_q, L_k)``: a 3-D float
  mask makes CPU SDPA fall back silently to its slow math path (chapter 5).
* ``"flex"``: FlexAttention with the encoding's ``score_mod`` and a causal block
  mask, so no bias is ever materialised. Compiled once per shape (the compiled
  function and block masks are cached). Falls back to ``"sdpa"``, with a warning
  saying why, where this torch cannot run it: FlexAttention missing, backward
  on CPU (unsupported in torch 2.13), dropout, explicit position tensors, or
  single-token decoding steps.

Key padding masks are ``(b, L_k)`` booleans, ``True`` where the key is padding
(the convention of :class:`torch.nn.MultiheadAttention`). A query row whose keys
are all masked returns zeros, never NaN.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import as_positions, check_choice, check_float_tensor, check_positive_int
from .encodings import NoPE, PositionEncoding

__all__ = [
    "BACKENDS",
    "flex_available",
    "KVCache",
    "MultiHeadAttention",
    "TransformerBlock",
]

#: Attention backends, see the module docs.
BACKENDS = ("naive", "sdpa", "flex")

try:  # FlexAttention: torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _FLEX_IMPORT_ERROR = None
except ImportError as _err:  # pragma: no cover - depends on the installed torch
    flex_attention = create_block_mask = None
    _FLEX_IMPORT_ERROR = str(_err)

_compiled_flex = None
_block_masks: dict = {}
_warned: set = set()


def flex_available() -> tuple[bool, str]:
    """Whether FlexAttention can be imported here, and why not if it cannot."""
    if flex_attention is None:
        return False, f"torch.nn.attention.flex_attention is unavailable ({_FLEX_IMPORT_ERROR})"
    return True, ""


def _flex_fn(compile: bool):
    """The (compiled, cached once per process) flex_attention function."""
    global _compiled_flex
    if not compile:
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flex backend falls back to sdpa: {reason}", RuntimeWarning, stacklevel=3)


class KVCache:
    """Keys and values of the tokens seen so far, for one attention layer.

    Keys are stored *after* rotation, so RoPE is applied once per token. Tensors
    are ``[b, n_kv, t, h_d]``; ``positions`` is ``(t,)``.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Number of cached tokens ``t`` (the position offset of the next token)."""
        return 0 if self.k is None else self.k.shape[-2]

    def update(self, k, v, positions):
        """Append new keys/values; return all keys, values and key positions."""
        if self.k is None:
            self.k, self.v, self.positions = k, v, positions
        else:
            if k.shape[:2] != self.k.shape[:2] or k.shape[-1] != self.k.shape[-1]:
                raise ValueError(
                    f"kv_cache holds keys of shape {tuple(self.k.shape)}; new keys "
                    f"{tuple(k.shape)} differ outside the sequence axis"
                )
            self.k = torch.cat((self.k, k), dim=-2)
            self.v = torch.cat((self.v, v), dim=-2)
            self.positions = torch.cat((self.positions, positions))
        return self.k, self.v, self.positions

    def reset(self) -> None:
        """Forget every cached token."""
        self.k = self.v = self.positions = None


class MultiHeadAttention(nn.Module):
    """Multi-head (optionally grouped-query) self-attention with a position encoding.

    The encoding's ``rotate`` and ``bias``/``score_mod`` hooks are called here;
    its ``embed`` hook is called once by the model, before the first block.

    Args:
        d_model: model width.
        n_heads: query heads; ``d_model`` must be divisible by it.
        encoding: a :class:`~tutorial_pkg.encodings.PositionEncoding` (default NoPE).
            Its head count (ALiBi) must equal ``n_heads``.
        causal: mask future keys (decoder) or not (encoder).
        backend: ``"naive"``, ``"sdpa"`` or ``"flex"``.
        dropout: attention dropout probability (training only).
        n_kv_heads: key/value heads for grouped-query attention (divides ``n_heads``);
            default ``n_heads``.
        bias: whether the projections have biases.
        compile_flex: compile FlexAttention (``False``: eager, slow, for debugging).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        encoding: PositionEncoding | None = None,
        *,
        causal: bool = True,
        backend: str = "sdpa",
        dropout: float = 0.0,
        n_kv_heads: int | None = None,
        bias: bool = False,
        compile_flex: bool = True,
    ) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        check_positive_int("n_heads", n_heads)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        n_kv_heads = n_heads if n_kv_heads is None else check_positive_int("n_kv_heads", n_kv_heads)
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
        if encoding is None:
            encoding = NoPE()
        if not isinstance(encoding, PositionEncoding):
            raise TypeError(
                f"encoding must be a PositionEncoding (see make_encoding), got "
                f"{type(encoding).__name__}"
            )
        enc_heads = getattr(encoding, "n_heads", n_heads)
        if enc_heads != n_heads:
            raise ValueError(f"encoding has n_heads={enc_heads} but attention has {n_heads}")
        rope = getattr(encoding, "rope", None)
        if rope is not None and rope.head_dim != d_model // n_heads:
            raise ValueError(
                f"encoding's head_dim ({rope.head_dim}) must equal d_model // n_heads "
                f"({d_model // n_heads})"
            )
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.causal = bool(causal)
        self.backend = check_choice("backend", backend, BACKENDS)
        self.dropout = float(dropout)
        self.compile_flex = compile_flex
        self.encoding = encoding
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)

    # ----------------------------------------------------------------------------- forward
    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_weights: bool = False,
    ):
        """Attend.

        Args:
            x: ``[b, s, d_model]`` floating-point input.
            positions: optional ``(s,)`` integer positions of the ``s`` tokens;
                default ``t + arange(s)`` with ``t`` the cache length (0 without cache).
            key_padding_mask: optional ``(b, L_k)`` bool, ``True`` = padding, where
                ``L_k`` counts cached plus new keys.
            kv_cache: a :class:`KVCache` to read and extend (incremental decoding).
            return_weights: also return the attention weights ``[b, H, s, L_k]``
                (computed with the naive backend).

        Returns:
            ``[b, s, d_model]``, and the weights if ``return_weights``.
        """
        check_float_tensor("x", x, ndim=3)
        b, s, d = x.shape
        if d != self.d_model:
            raise ValueError(f"x must have last dimension d_model={self.d_model}, got {d}")
        start = kv_cache.length if kv_cache is not None else 0
        explicit = positions is not None
        if explicit:
            q_pos = as_positions("positions", positions).to(x.device)
            if q_pos.numel() != s:
                raise ValueError(f"positions must have length s={s}, got {q_pos.numel()}")
        else:
            q_pos = torch.arange(start, start + s, device=x.device)

        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.encoding.rotate(q, k, q_pos, q_pos)
        k_pos = q_pos
        if kv_cache is not None:
            k, v, k_pos = kv_cache.update(k, v, q_pos)
        k_len = k.shape[-2]
        pad = self._check_padding(key_padding_mask, b, k_len, x.device)

        backend = "naive" if return_weights else self.backend
        if backend == "flex":
            reason = self._flex_blocker(q, explicit, s)
            if reason:
                _warn_once(reason)
                backend = "sdpa"
        weights = None
        if backend == "naive":
            out, weights = self._naive(q, k, v, q_pos, k_pos, pad)
        elif backend == "sdpa":
            out = self._sdpa(q, k, v, q_pos, k_pos, pad, start if not explicit else None)
        else:
            out = self._flex(q, k, v, pad, start)
        out = out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)
        out = self.out_proj(out)
        return (out, weights) if return_weights else out

    # ----------------------------------------------------------------------------- masks
    @staticmethod
    def _check_padding(mask, b, k_len, device):
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(
                "key_padding_mask must be a bool tensor (True = padding), got "
                f"{getattr(mask, 'dtype', type(mask).__name__)}"
            )
        if mask.shape != (b, k_len):
            raise ValueError(
                f"key_padding_mask must have shape (batch, L_k)=({b}, {k_len}), "
                f"got {tuple(mask.shape)}"
            )
        return mask.to(device)

    def _allowed(self, q_pos, k_pos, pad):
        """Bool ``(b or 1, 1, L_q, L_k)`` of allowed (query, key) pairs, or None if all."""
        allowed = None
        if self.causal:
            allowed = (k_pos[None, :] <= q_pos[:, None])[None, None]
        if pad is not None:
            keep = ~pad[:, None, None, :]
            allowed = keep if allowed is None else allowed & keep
        return allowed

    def _zero_empty_rows(self, out, allowed):
        # A query with no allowed key gets zeros (never NaN, never a uniform average).
        if allowed is None:
            return out
        has_key = allowed.any(dim=-1, keepdim=True)
        return torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))

    def _repeat_kv(self, t):
        rep = self.n_heads // self.n_kv_heads
        return t if rep == 1 else t.repeat_interleave(rep, dim=1)

    # ----------------------------------------------------------------------------- naive
    def _naive(self, q, k, v, q_pos, k_pos, pad):
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        # at least float32 (half inputs are upcast); float64 stays float64 (gradcheck)
        dt = torch.promote_types(q.dtype, torch.float32)
        scores = (q.to(dt) @ k.to(dt).transpose(-2, -1)) / math.sqrt(self.head_dim)
        bias = self.encoding.bias(q_pos, k_pos)
        if bias is not None:
            scores = scores + bias
        allowed = self._allowed(q_pos, k_pos, pad)
        if allowed is not None:
            # A finite fill (not -inf) keeps fully masked rows NaN-free; they are zeroed below.
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1)
        weights = self._zero_empty_rows(weights, allowed)
        if self.training and self.dropout:
            weights = F.dropout(weights, self.dropout)
        return (weights @ v.to(dt)).to(q.dtype), weights

    # ----------------------------------------------------------------------------- sdpa
    def _sdpa(self, q, k, v, q_pos, k_pos, pad, start):
        s, k_len = q.shape[-2], k.shape[-2]
        dropout = self.dropout if self.training else 0.0
        gqa = self.n_kv_heads != self.n_heads
        if not gqa:
            kw = {}
        else:
            kw = {"enable_gqa": True}
        if not self.encoding.has_bias and pad is None:
            if not self.causal or (s == 1 and start is not None):
                mask, is_causal = None, False  # one new token sees every cached key
            elif start == 0 and s == k_len:
                mask, is_causal = None, True  # the fused causal kernel: nothing L x L built
            else:
                mask, is_causal = self._allowed(q_pos, k_pos, None), False
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, **kw
            )
        if self.encoding.has_bias and start is not None:
            mask = self.encoding.attn_bias(start, s, k_len, causal=self.causal,
                                           device=q.device, dtype=q.dtype)
        elif self.encoding.has_bias:
            mask = self.encoding.bias(q_pos, k_pos).unsqueeze(0)
            if self.causal:
                mask = mask.masked_fill(~self._allowed(q_pos, k_pos, None), float("-inf"))
            mask = mask.to(q.dtype)
        else:
            mask = None
            if self.causal:
                causal = self._allowed(q_pos, k_pos, None)
                mask = torch.zeros(causal.shape, dtype=q.dtype, device=q.device)
                mask = mask.masked_fill(~causal, float("-inf"))
        allowed = None
        if pad is not None:
            # finite (not -inf) for padding, so a row with no key left stays NaN-free
            pad_bias = torch.zeros(pad.shape, dtype=q.dtype, device=q.device)
            pad_bias = pad_bias.masked_fill(pad, torch.finfo(q.dtype).min)[:, None, None, :]
            mask = pad_bias if mask is None else mask + pad_bias
            allowed = self._allowed(q_pos, k_pos, pad)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=False, **kw
        )
        return self._zero_empty_rows(out, allowed)

    # ----------------------------------------------------------------------------- flex
    def _flex_blocker(self, q, explicit, s):
        ok, why = flex_available()
        if not ok:
            return why
        if explicit:
            return "explicit position tensors (flex indexes positions as start + q_idx)"
        if s == 1:
            return "single-token decoding step (the cached bias row is cheaper)"
        if self.training and self.dropout:
            return "attention dropout is not supported by FlexAttention"
        if q.device.type == "cpu" and torch.is_grad_enabled() and (
            q.requires_grad or any(p.requires_grad for p in self.parameters())
        ):
            return "FlexAttention has no CPU backward in this torch (use torch.no_grad())"
        return ""

    def _flex(self, q, k, v, pad, start):
        s, k_len = q.shape[-2], k.shape[-2]
        causal = self.causal
        if pad is None:
            key = (s, k_len, start, causal, q.device)
            block_mask = _block_masks.get(key)
            if block_mask is None and causal:

                def mask_mod(b, h, q_idx, kv_idx):
                    return kv_idx <= q_idx + start

                block_mask = create_block_mask(mask_mod, None, None, s, k_len, device=q.device)
                _block_masks[key] = block_mask
        else:

            def mask_mod(b, h, q_idx, kv_idx):
                keep = ~pad[b, kv_idx]
                return keep & (kv_idx <= q_idx + start) if causal else keep

            block_mask = create_block_mask(mask_mod, q.shape[0], None, s, k_len, device=q.device)
        out = _flex_fn(self.compile_flex)(
            q, k, v,
            score_mod=self.encoding.score_mod(q_offset=start),
            block_mask=block_mask,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        if pad is not None:
            out = self._zero_empty_rows(out, self._allowed(
                torch.arange(start, start + s, device=q.device),
                torch.arange(k_len, device=q.device), pad))
        return out

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"causal={self.causal}, backend={self.backend!r}"
        )


class TransformerBlock(nn.Module):
    """Attention + MLP with residuals; pre-norm (default) or post-norm.

    Pre-norm ``x + f(LN(x))`` keeps an identity path from input to output, so
    gradients are well scaled at initialisation and no warm-up is needed
    (Xiong et al., 2020); post-norm ``LN(x + f(x))`` is the original Transformer's
    form and the seeds'.

    Args:
        d_model: model width.
        n_heads: attention heads.
        encoding: shared position encoding (see :class:`MultiHeadAttention`).
        d_ff: MLP hidden width (default ``4 * d_model``).
        dropout: dropout on attention weights and residual branches.
        norm_first: pre-norm (``True``) or post-norm (``False``).
        causal, backend, n_kv_heads, compile_flex: see :class:`MultiHeadAttention`.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        encoding: PositionEncoding | None = None,
        *,
        d_ff: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        causal: bool = True,
        backend: str = "sdpa",
        n_kv_heads: int | None = None,
        compile_flex: bool = True,
    ) -> None:
        super().__init__()
        d_ff = 4 * d_model if d_ff is None else check_positive_int("d_ff", d_ff)
        self.norm_first = bool(norm_first)
        self.attn = MultiHeadAttention(
            d_model, n_heads, encoding, causal=causal, backend=backend, dropout=dropout,
            n_kv_heads=n_kv_heads, compile_flex=compile_flex,
        )
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, *, positions=None, key_padding_mask=None, kv_cache=None):
        """``[b, s, d_model] -> [b, s, d_model]``; see :meth:`MultiHeadAttention.forward`."""
        kw = {"positions": positions, "key_padding_mask": key_padding_mask, "kv_cache": kv_cache}
        if self.norm_first:
            x = x + self.drop(self.attn(self.norm1(x), **kw))
            return x + self.drop(self.mlp(self.norm2(x)))
        x = self.norm1(x + self.drop(self.attn(x, **kw)))
        return self.norm2(x + self.drop(self.mlp(x)))
