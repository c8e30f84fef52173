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
  mask, so no bias is ever materialised. For a whole causal sequence without
  padding it is compiled with dynamic shapes: one compilation (~10-20 s cold on a
  2-core CPU) per ``score_mod`` serves every length of two tiles (256 tokens) or
  more; other calls (padding, non-causal, a query offset) compile once per shape.
  Block masks are cached per shape. Dynamo recompiles at most 8 times per
  function (all callers together), then runs FlexAttention eagerly, which
  materialises the scores. Falls back to ``"sdpa"``, with a warning saying why,
  where this torch cannot run it: FlexAttention missing, backward on CPU
  (unsupported in torch 2.13), dropout, explicit position tensors, or
  single-token decoding steps.
* ``"auto"`` (the default): the fastest exact path for the call at hand, without
  compiling anything. Encodings without a bias take ``"sdpa"`` (``is_causal=True``).
  ALiBi and the hybrid (causal or key-only form) add the bias as a *key row*
  ``m_h j`` of shape ``(1, H, 1, L_k)``, float32
  (:meth:`~tutorial_pkg.encodings.PositionEncoding.attn_key_bias`) to SDPA's
  fused causal kernel: softmax is shift invariant along a
  query's row and ``-m (i - j) = m j - m i``, so the weights are exactly those of
  the full causal bias, while nothing of size ``L x L`` is built or held and the
  kernel still skips the masked half. Measured on CPU (chapter 5): as fast as
  plain causal SDPA, forward and backward, with the same peak memory; the
  cached 4-D bias of ``"sdpa"`` costs ~1.3-2x the time and holds ``H L^2``
  floats, Flex is as fast but compiles and has no CPU backward. Passing a mask
  together with ``is_causal=True`` is accepted by the fused CPU kernel (and
  CUDA's memory-efficient one) but not by every kernel, so the path is checked
  once per (device type, dtype) against a float64 reference, forward and
  backward, before it is used; where the check fails, and for the symmetric
  form, explicit positions, chunked prefill with a KV cache, dropout or a
  learnable bias under autograd, ``"auto"`` uses ``"sdpa"``.

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
BACKENDS = ("naive", "sdpa", "flex", "auto")

try:  # FlexAttention: torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _FLEX_IMPORT_ERROR = None
except ImportError as _err:  # pragma: no cover - depends on the installed torch
    flex_attention = create_block_mask = None
    _FLEX_IMPORT_ERROR = str(_err)

_compiled_flex: dict = {}  # dynamic (bool) -> compiled flex_attention
_block_masks: dict = {}
_warned: set = set()
# (device type, dtype, gqa) -> whether SDPA adds a key row under is_causal correctly
_key_row_ok: dict = {}


def flex_available() -> tuple[bool, str]:
    """Whether FlexAttention can be imported here, and why not if it cannot."""
    if flex_attention is None:
        return False, f"torch.nn.attention.flex_attention is unavailable ({_FLEX_IMPORT_ERROR})"
    return True, ""


def _flex_fn(compile: bool, dynamic: bool = False):
    """The (compiled, cached once per process) flex_attention function.

    ``dynamic=True`` compiles with dynamic shapes, used for the common call (a
    whole causal sequence, no padding): with static shapes every new length
    recompiles (~10 s each on a 2-core CPU) and after 8 lengths dynamo gives up
    and runs FlexAttention eagerly, materialising the scores. Other calls
    (padding, non-causal, an offset) compile statically, once per shape: in
    torch 2.13 inductor's CPU FlexAttention template fails to build some of them
    with dynamic shapes (undeclared ``cur_qSplitSize`` in the generated C++).
    See also :func:`_mark_block_mask_dynamic`.
    """
    if not compile:
        return flex_attention
    fn = _compiled_flex.get(dynamic)
    if fn is None:
        fn = _compiled_flex[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return fn


def _causal_mask_mod(b, h, q_idx, kv_idx):
    # A plain function, not a closure over `start`: under dynamic shapes an int
    # captured by a mask_mod becomes symbolic, which the CPU template cannot build.
    return kv_idx <= q_idx


def _offset_causal_mask_mod(start: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + start

    return mask_mod


def _mark_block_mask_dynamic(block_mask) -> None:
    # The block counts and indices grow with L / 128; unmarked, the first compile
    # specialises on their sizes and the next block count recompiles once more.
    for t in block_mask.as_tuple():
        if isinstance(t, torch.Tensor):
            for dim in range(2, t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, dim)


def _check_key_row(device: torch.device, dtype: torch.dtype, gqa: bool) -> bool:
    """Does SDPA add a float key row *and* apply ``is_causal`` here, exactly? (cached).

    The ``"auto"`` path relies on it, and the PyTorch documentation does not
    promise it (its math path refuses a mask with ``is_causal=True``; a kernel
    could also round the float32 row to the dtype of q, which would destroy
    ``m j`` at large ``j``). So it is checked once per (device type, dtype, GQA)
    on a tiny problem whose keys sit at positions 4096+ (a row rounded to
    bfloat16 fails there): forward and gradients against a float64 reference.
    """
    key = (device.type, dtype, gqa)
    if key in _key_row_ok:
        return _key_row_ok[key]
    if torch.compiler.is_compiling():
        return False  # never probe while tracing; the next eager call will
    _key_row_ok[key] = ok = _probe_key_row(device, dtype, gqa)
    return ok


def _probe_key_row(device, dtype, gqa) -> bool:
    heads, kv_heads, length, dim, offset = 2, 1 if gqa else 2, 16, 8, 4096
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, length, dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, length, dim, generator=gen) for _ in range(2))
    grad_out = torch.randn(1, heads, length, dim, generator=gen)
    slopes = torch.tensor([0.5, 1 / 16])
    row_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    row = (slopes[:, None, None] * torch.arange(offset, offset + length).double())[None]

    def run(tensors, mask, fused):
        q_, k_, v_ = (t.detach().requires_grad_(True) for t in tensors)
        if fused:
            kw = {"enable_gqa": True} if gqa else {}
            out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, is_causal=True, **kw)
        else:
            rep = heads // kv_heads
            kk, vv = k_.repeat_interleave(rep, 1), v_.repeat_interleave(rep, 1)
            scores = q_ @ kk.transpose(-2, -1) / math.sqrt(dim) + mask
            future = torch.ones(length, length, dtype=torch.bool, device=q_.device).triu(1)
            out = scores.masked_fill(future, float("-inf")).softmax(-1) @ vv
        grads = torch.autograd.grad(out, (q_, k_, v_), grad_out.to(out))
        return [out, *grads]

    try:
        with torch.enable_grad():
            got = run([t.to(device, dtype) for t in (q, k, v)],
                      row.to(device, row_dtype), fused=True)
            want = run([t.to(device, dtype).double() for t in (q, k, v)],
                       row.to(device), fused=False)
    except RuntimeError:  # e.g. "attn_mask should not be set when is_causal=True"
        return False
    # float32 rounds m j ~ 2048 to ~1e-4; a row rounded to 16 bits is off by ~1 or more
    tol = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
    return all(
        float((g.detach().double() - w.detach()).abs().max())
        <= tol * max(1.0, float(w.detach().abs().max()))
        for g, w in zip(got, want, strict=True)
    )


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
        backend: ``"auto"`` (default), ``"naive"``, ``"sdpa"`` or ``"flex"`` (module docs).
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
        backend: str = "auto",
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
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        out, weights = self._attend(q, k, v, positions, key_padding_mask, kv_cache,
                                    return_weights)
        out = out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)
        out = self.out_proj(out)
        return (out, weights) if return_weights else out

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """The attention core on already projected heads: what :meth:`forward` does
        between the input and output projections.

        The encoding's ``rotate`` and bias hooks, the masks and the backend, exactly
        as in :meth:`forward` (which calls it). For models that project q, k, v
        themselves, and for benchmarks that time attention alone (chapter 5).

        Args:
            q: ``[b, n_heads, s, head_dim]`` queries (not yet rotated).
            k: ``[b, n_kv_heads, s, head_dim]`` keys (not yet rotated).
            v: ``[b, n_kv_heads, s, head_dim]`` values.
            positions, key_padding_mask, kv_cache: as in :meth:`forward`.

        Returns:
            ``[b, n_heads, s, head_dim]``, the heads before merging.
        """
        check_float_tensor("q", q, ndim=4)
        check_float_tensor("k", k, ndim=4)
        check_float_tensor("v", v, ndim=4)
        b, _, s, _ = q.shape
        want = {"q": (b, self.n_heads, s, self.head_dim),
                "k": (b, self.n_kv_heads, s, self.head_dim),
                "v": (b, self.n_kv_heads, s, self.head_dim)}
        for name, t in (("q", q), ("k", k), ("v", v)):
            if tuple(t.shape) != want[name]:
                raise ValueError(
                    f"{name} must have shape [b, heads, s, head_dim]={want[name]}, "
                    f"got {tuple(t.shape)}"
                )
        return self._attend(q, k, v, positions, key_padding_mask, kv_cache, False)[0]

    def _attend(self, q, k, v, positions, key_padding_mask, kv_cache, return_weights):
        b, _, s, _ = q.shape
        device = q.device
        start = kv_cache.length if kv_cache is not None else 0
        explicit = positions is not None
        if explicit:
            q_pos = as_positions("positions", positions).to(device)
            if q_pos.numel() != s:
                raise ValueError(f"positions must have length s={s}, got {q_pos.numel()}")
        else:
            q_pos = torch.arange(start, start + s, device=device)

        q, k = self.encoding.rotate(q, k, q_pos, q_pos)
        k_pos = q_pos
        if kv_cache is not None:
            k, v, k_pos = kv_cache.update(k, v, q_pos)
        k_len = k.shape[-2]
        pad = self._check_padding(key_padding_mask, b, k_len, device)

        backend = "naive" if return_weights else self.backend
        row = None
        if backend == "auto":
            row = self._auto_key_row(q, explicit, s, k_len, start)
            backend = "sdpa" if row is None else "key_row"
        if backend == "flex":
            reason = self._flex_blocker(q, explicit, s)
            if reason:
                _warn_once(reason)
                backend = "sdpa"
        weights = None
        if backend == "naive":
            out, weights = self._naive(q, k, v, q_pos, k_pos, pad)
        elif backend == "key_row":
            out = self._sdpa_key_row(q, k, v, row, pad, is_causal=self.causal and s > 1)
        elif backend == "sdpa":
            out = self._sdpa(q, k, v, q_pos, k_pos, pad, start if not explicit else None)
        else:
            out = self._flex(q, k, v, pad, start)
        return out, weights

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

    # ----------------------------------------------------------------------------- auto
    def _auto_key_row(self, q, explicit, s, k_len, start):
        """The float key row ``(1, H, 1, L_k)`` for the ``"auto"`` path, or None (use sdpa)."""
        enc = self.encoding
        if not enc.has_bias or explicit or (self.training and self.dropout):
            return None
        # is_causal aligns the mask top-left (query i sees keys <= i): right for a
        # whole sequence, and a single new token sees every cached key anyway.
        if self.causal and s > 1 and not (start == 0 and s == k_len):
            return None
        row = enc.attn_key_bias(k_len, device=q.device)
        if row is None or (row.requires_grad and torch.is_grad_enabled()):
            return None  # no key-only form, or a learnable bias (fused kernels give no mask grad)
        if not _check_key_row(q.device, q.dtype, self.n_kv_heads != self.n_heads):
            return None
        return row

    def _sdpa_key_row(self, q, k, v, row, pad, is_causal):
        mask = row.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        has_key = None
        if pad is not None:
            # padding depends on the key only, so the mask stays one row per head:
            # (b, H, 1, L_k); finite, so a query with no key left stays NaN-free
            pad_bias = torch.zeros(pad.shape, dtype=mask.dtype, device=q.device)
            pad_bias = pad_bias.masked_fill(pad, torch.finfo(mask.dtype).min)[:, None, None, :]
            mask = mask + pad_bias
            keep = ~pad
            # query i has a key iff a kept key j <= i (causal) or any kept key
            has_key = keep.cumsum(-1) > 0 if is_causal else keep.any(-1, keepdim=True)
            has_key = has_key[:, None, :, None]  # (b, 1, s or 1, 1)
        kw = {"enable_gqa": True} if self.n_kv_heads != self.n_heads else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **kw)
        if has_key is not None:
            out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out

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
                mask_mod = _causal_mask_mod if start == 0 else _offset_causal_mask_mod(start)
                block_mask = create_block_mask(mask_mod, None, None, s, k_len, device=q.device)
                if self.compile_flex and start == 0:
                    _mark_block_mask_dynamic(block_mask)
                _block_masks[key] = block_mask
        else:

            def mask_mod(b, h, q_idx, kv_idx):
                keep = ~pad[b, kv_idx]
                return keep & (kv_idx <= q_idx + start) if causal else keep

            block_mask = create_block_mask(mask_mod, q.shape[0], None, s, k_len, device=q.device)
        dynamic = pad is None and causal and start == 0
        out = _flex_fn(self.compile_flex, dynamic)(
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
        backend: str = "auto",
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
