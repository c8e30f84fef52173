"""Multi-head attention with pluggable encodings and backends; KV cache; block. Chapter 4.

:class:`MultiHeadAttention` projects ``x`` to q, k, v, calls the encoding's hooks
(``rotate``; the bias hooks through the backend), describes the call once as an
:class:`~tutorial_pkg.attention.masks.AttentionPlan` (positions, cache offset, causality,
padding, documents, window, scale) and hands it to ``BACKENDS[backend]`` of
:mod:`tutorial_pkg.attention.backends`: ``"naive"``, ``"sdpa"``, ``"flex"`` or ``"auto"`` (the
default: the fastest exact path without compiling; see that module).

Positions are ``(s,)`` or ``[b, s]`` (Hugging Face ``position_ids``), so left-padded
batches (:func:`~tutorial_pkg.attention.positions.positions_from_padding`) and packed documents
(``document_ids``, with :func:`~tutorial_pkg.attention.positions.positions_from_documents`) are
correct for every encoding, with or without a KV cache. Key padding masks are
``(b, L_k)`` booleans, ``True`` where the key is padding (the convention of
:class:`torch.nn.MultiheadAttention`). A query row whose keys are all masked returns
zeros, never NaN.

Real checkpoints' layers: ``head_dim`` need not be ``d_model / n_heads`` (Qwen3, Gemma,
Mistral-NeMo), the softmax scale need not be ``1 / sqrt(head_dim)`` (``scale``: Gemma's
``query_pre_attn_scalar ** -0.5``, DeepSeek's ``mscale ** 2``), each projection has its
own bias flag (Qwen2: q, k, v biases, none on the output), and ``q_norm`` / ``k_norm``
normalise each head before RoPE (Qwen3, Gemma 3). :func:`tutorial_pkg.models.hf.from_hf_attention`
builds such a layer from a Hugging Face attention module.

``window=w`` makes a layer attend within a sliding window (Mistral; Gemma's local
layers): the query at cache slot ``i`` sees the key slots ``i - w < j <= i``, Hugging
Face's convention (see :mod:`tutorial_pkg.attention.masks`). Per-layer choices (NoPE layers,
local and global layers) are :mod:`tutorial_pkg.encodings.schedules`.

Devices: positions, masks and document ids follow the device of ``q`` (they are moved
there, and their values are read back only when they are CPU tensors, where that is
free); the encoding's constants are moved by its hooks. Tensors that must not be copied
per call raise ``ValueError`` naming both devices instead: ``x`` on another device than
the layer's weights, ``q``, ``k`` and ``v`` on different devices, the encoding's learned
parameters elsewhere than ``q``, a :class:`KVCache` holding keys on another device.
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import (
    as_batched_positions,
    check_choice,
    check_device,
    check_float_tensor,
    check_positive_float,
    check_positive_int,
)
from ..encodings.builtin import NoPE, PositionEncoding, check_learned_device
from ..encodings.schedules import LayerSchedule
from ._caches import clear_caches
from .backends import BACKENDS, flex_available
from .masks import AttentionPlan

__all__ = [
    "BACKENDS",
    "flex_available",
    "KVCache",
    "MultiHeadAttention",
    "TransformerBlock",
]

class KVCache:
    """Keys and values of the tokens seen so far, for one attention layer.

    Keys are stored *after* rotation, so RoPE is applied once per token. Tensors
    are ``[b, H_kv, t, d]``; ``positions`` is int64 ``[1 or b, t]`` and
    ``document_ids`` (when packing) ``[1 or b, t]``.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.document_ids: torch.Tensor | None = None
        self.default_positions = True  # every token so far sat at its cache slot

    @property
    def length(self) -> int:
        """Number of cached tokens ``t`` (the cache slot of the next token)."""
        return 0 if self.k is None else self.k.shape[-2]

    def update(self, k, v, positions, document_ids=None):
        """Append new keys/values; return all keys, values, key positions and documents.

        Args:
            k, v: ``[b, H_kv, s, d]`` new keys (rotated) and values.
            positions: ``(s,)`` or ``[1 or b, s]`` positions of the new tokens.
            document_ids: optional ``[1 or b, s]`` document ids of the new tokens.

        Raises ``ValueError`` if the new keys differ from the cached ones in device or
        outside the sequence axis, or if ``document_ids`` are given on some calls only.
        """
        return self._append(k, v, positions, document_ids, default=False)

    def _append(self, k, v, positions, document_ids, *, default: bool):
        # default: the positions are length + arange(s), so attention may keep using
        # cached tables (only attention knows it; positions given by hand never are)
        positions = positions[None] if positions.dim() == 1 else positions
        self.default_positions = self.default_positions and default
        if self.k is None:
            self.k, self.v, self.positions, self.document_ids = k, v, positions, document_ids
            return self.k, self.v, self.positions, self.document_ids
        check_device("the new keys", k, self.k.device,
                     fix="a KVCache holds one layer's keys on one device (reset() it, or "
                         "keep the model on one device)")
        if k.shape[:2] != self.k.shape[:2] or k.shape[-1] != self.k.shape[-1]:
            raise ValueError(
                f"kv_cache holds keys of shape {tuple(self.k.shape)}; new keys "
                f"{tuple(k.shape)} differ outside the sequence axis"
            )
        if (document_ids is None) != (self.document_ids is None):
            raise ValueError("document_ids must be given on every call that uses this kv_cache, "
                             "or on none")
        self.k = torch.cat((self.k, k), dim=-2)
        self.v = torch.cat((self.v, v), dim=-2)
        self.positions = _cat_rows(self.positions, positions)
        if document_ids is not None:
            self.document_ids = _cat_rows(self.document_ids, document_ids)
        return self.k, self.v, self.positions, self.document_ids

    def reset(self) -> None:
        """Forget every cached token."""
        self.k = self.v = self.positions = self.document_ids = None
        self.default_positions = True


def _cat_rows(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    # [1 or b, t] + [1 or b, s]: a shared row is broadcast when the other has b rows
    if old.shape[0] != new.shape[0]:
        rows = max(old.shape[0], new.shape[0])
        old, new = old.expand(rows, -1), new.expand(rows, -1)
    return torch.cat((old, new), dim=-1)


class MultiHeadAttention(nn.Module):
    """Multi-head (optionally grouped-query) self-attention with a position encoding.

    The encoding's ``rotate`` and bias hooks are called here; its ``embed`` hook is
    called once by the model, before the first block.

    ``forward(x)`` is ``out_proj(attend(q_proj(x), k_proj(x), v_proj(x)))`` with the heads
    split and merged; :meth:`attend` normalises (``q_norm``, ``k_norm``), rotates, masks
    and computes ``softmax(scale * q k^T + bias) v``.

    Args:
        d_model: model width.
        n_heads: query heads; without ``head_dim``, ``d_model`` must be divisible by it.
        encoding: a :class:`~tutorial_pkg.encodings.builtin.PositionEncoding` (default NoPE).
            Its declared ``n_heads`` and ``head_dim`` (when not None) must match.
        head_dim: features per head (Hugging Face's and torchtune's name); default
            ``d_model // n_heads``. The projections are ``d_model -> n_heads * head_dim``
            (q), ``d_model -> n_kv_heads * head_dim`` (k, v) and
            ``n_heads * head_dim -> d_model`` (out), whatever ``d_model`` is.
        scale: the softmax scale ``c`` in ``softmax(c q k^T + bias)`` (SDPA's and
            torchtune's name; Hugging Face's ``scaling``), a positive finite number;
            default ``head_dim ** -0.5``. Every backend and the KV cache path use it;
            a bias is added after it, unscaled.
        causal: mask future keys (decoder) or not (encoder).
        backend: ``"auto"`` (default), ``"naive"``, ``"sdpa"``, ``"flex"``, or another
            name of the registry :data:`~tutorial_pkg.attention.backends.BACKENDS`; checked here
            and at each call (``ValueError`` naming it).
        dropout: attention dropout probability (training only).
        n_kv_heads: key/value heads for grouped-query attention (divides ``n_heads``);
            default ``n_heads``.
        bias: whether the projections have biases (the default of the four flags below).
        q_bias, k_bias, v_bias, o_bias: a bias on ``q_proj``, ``k_proj``, ``v_proj``,
            ``out_proj`` (bools; each defaults to ``bias``). Qwen2: ``bias=True,
            o_bias=False``.
        q_norm, k_norm: optional modules applied to each query / key head
            (``[b, heads, s, head_dim] -> same shape``, acting on the last axis) before
            RoPE, as Qwen3's and Gemma 3's RMSNorm over ``head_dim`` (torchtune's
            ``q_norm``/``k_norm``). Keys are cached after them. Default: none.
        v_norm: optional module applied to each value head (Gemma 4's weightless RMS
            norm of the values). Default: none.
        values_from_keys: the values are the key projection before ``k_norm`` and RoPE,
            and there is no ``v_proj`` (Gemma 4's ``attention_k_eq_v`` global layers).
        compile_flex: compile FlexAttention (``False``: eager, slow, for debugging).
        window: sliding window ``w`` (a positive int): the query at cache slot ``i``
            sees key slots ``i - w < j <= i`` (``|i - j| < w`` when not causal);
            ``None`` (default) = every key.
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``, a positive
            number): the scores become ``softcap * tanh(scale q k^T / softcap)`` before
            the bias and the mask. ``None`` (default): none.
        sinks: learned attention sinks (gpt-oss): a parameter ``sinks`` ``[n_heads]``
            (zeros at first), one logit per query head that joins each row's softmax
            denominator and takes no value, so a query may give less than all its weight
            to the keys. Default False.
        chunk: chunked attention (Llama 4's ``attention_chunk_size``, a positive int): a
            query sees the keys whose *position* lies in its own chunk of ``chunk``
            positions (with causality: back to the chunk's start). Default None.
        temperature_tuning: ``(floor_scale, attn_scale)``: Llama 4's attention temperature
            of its NoPE layers, the queries multiplied by ``1 + attn_scale *
            log1p(floor((i + 1) / floor_scale))`` at cache slot ``i`` (the slot, as
            Hugging Face's ``cache_position``, not the position). Default None.

    Soft-capping and sinks are exact in the ``"naive"`` and ``"flex"`` backends;
    ``"auto"`` computes them with ``"naive"``, and ``"sdpa"`` warns and does the same
    (:mod:`~tutorial_pkg.attention.backends`).
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
        window: int | None = None,
        head_dim: int | None = None,
        scale: float | None = None,
        q_bias: bool | None = None,
        k_bias: bool | None = None,
        v_bias: bool | None = None,
        o_bias: bool | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        chunk: int | None = None,
        temperature_tuning: tuple[float, float] | None = None,
        v_norm: nn.Module | None = None,
        values_from_keys: bool = False,
    ) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        check_positive_int("n_heads", n_heads)
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model ({d_model}) must be divisible by n_heads "
                                 f"({n_heads}), or give head_dim")
            head_dim = d_model // n_heads
        else:
            check_positive_int("head_dim", head_dim)
        if scale is not None:
            scale = check_positive_float("scale", scale)
        biases = {}
        for name, flag in (("q_bias", q_bias), ("k_bias", k_bias), ("v_bias", v_bias),
                           ("o_bias", o_bias)):
            if flag is not None and not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool or None (= bias), got "
                                f"{type(flag).__name__}")
            biases[name] = bool(bias) if flag is None else flag
        for name, norm in (("q_norm", q_norm), ("k_norm", k_norm), ("v_norm", v_norm)):
            if norm is not None and not isinstance(norm, nn.Module):
                raise TypeError(f"{name} must be an nn.Module (applied to each head, "
                                f"[..., head_dim]) or None, got {type(norm).__name__}")
        n_kv_heads = n_heads if n_kv_heads is None else check_positive_int("n_kv_heads", n_kv_heads)
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
        if encoding is None:
            encoding = NoPE()
        if isinstance(encoding, LayerSchedule):
            raise TypeError(
                f"encoding is a {type(encoding).__name__}, one encoding per layer: give each "
                f"layer its own, encoding.layer(i) (TinyLM does this)"
            )
        if not isinstance(encoding, PositionEncoding):
            raise TypeError(
                f"encoding must be a PositionEncoding (see make_encoding), got "
                f"{type(encoding).__name__}"
            )
        for attr, want in (("n_heads", n_heads), ("head_dim", head_dim)):
            got = getattr(encoding, attr, None)
            if got is not None and got != want:
                raise ValueError(f"encoding has {attr}={got} but attention has {attr}={want}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not (
            0.0 <= dropout < 1.0
        ):
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = head_dim
        self.causal = bool(causal)
        self.backend = backend  # checked by the property
        self.dropout = float(dropout)
        self.compile_flex = compile_flex
        self.window = None if window is None else check_positive_int("window", window)
        self.encoding = encoding
        #: the softmax scale (``head_dim ** -0.5`` unless given); may be reassigned
        self.scale = head_dim**-0.5 if scale is None else scale
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=biases["q_bias"])
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=biases["k_bias"])
        if not isinstance(values_from_keys, bool):
            raise TypeError(f"values_from_keys must be a bool, got "
                            f"{type(values_from_keys).__name__}")
        self.v_proj = None if values_from_keys else nn.Linear(d_model, n_kv_heads * head_dim,
                                                              bias=biases["v_bias"])
        self.out_proj = nn.Linear(n_heads * head_dim, d_model, bias=biases["o_bias"])
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.v_norm = v_norm
        self.softcap = None if softcap is None else check_positive_float("softcap", softcap)
        if not isinstance(sinks, bool):
            raise TypeError(f"sinks must be a bool, got {type(sinks).__name__}")
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None
        self.chunk = None if chunk is None else check_positive_int("chunk", chunk)
        if temperature_tuning is not None:
            if not isinstance(temperature_tuning, (tuple, list)) or len(temperature_tuning) != 2:
                raise TypeError(f"temperature_tuning must be (floor_scale, attn_scale), got "
                                f"{temperature_tuning!r}")
            temperature_tuning = (check_positive_float("floor_scale", temperature_tuning[0]),
                                  check_positive_float("attn_scale", temperature_tuning[1]))
        self.temperature_tuning = temperature_tuning

    # ----------------------------------------------------------------------------- forward
    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_weights: bool = False,
    ):
        """Attend.

        Args:
            x: ``[b, s, d_model]`` floating-point input.
            positions: optional integer positions ``(s,)`` or ``[b, s]`` of the ``s``
                tokens; default ``t + arange(s)`` with ``t`` the cache length (0
                without cache). ``[3, b, s]`` (time, height, width) for an M-RoPE
                encoding (:class:`~tutorial_pkg.encodings.mrope.MRotary`): the masks and
                the cache then use the time axis. For a left-padded batch use
                :func:`~tutorial_pkg.attention.positions.positions_from_padding`.
            key_padding_mask: optional ``(b, L_k)`` bool, ``True`` = padding, where
                ``L_k`` counts cached plus new keys.
            document_ids: optional integer ``[b, s]`` (or ``(s,)``): packed documents;
                a token attends only to tokens of its own document (with ``causal``,
                a document-causal mask). Positions are not derived from them: pass
                :func:`~tutorial_pkg.attention.positions.positions_from_documents` as
                ``positions`` to restart them per document.
            kv_cache: a :class:`KVCache` to read and extend (incremental decoding).
            return_weights: also return the attention weights ``[b, H, s, L_k]``
                (computed with the ``"naive"`` backend, whatever ``backend`` is).

        Returns:
            ``[b, s, d_model]``, and the weights if ``return_weights``.
        """
        check_float_tensor("x", x, ndim=3)
        b, s, d = x.shape
        if d != self.d_model:
            raise ValueError(f"x must have last dimension d_model={self.d_model}, got {d}")
        check_device("x", x, self.q_proj.weight.device,
                     fix="move x (or the layer, with .to(device)) to one device")
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = k if self.v_proj is None else (  # values from keys: before k_norm and RoPE
            self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2))
        out, weights = self._attend(q, k, v, positions, key_padding_mask, document_ids,
                                    kv_cache, return_weights)
        out = self.out_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))
        return (out, weights) if return_weights else out

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """The attention core on already projected heads: what :meth:`forward` does
        between the input and output projections.

        ``q_norm`` / ``k_norm`` (when set), the encoding's ``rotate`` and bias hooks, the
        masks, the scale and the backend, exactly as in :meth:`forward` (which calls it).
        For models that project q, k, v themselves, and for benchmarks that time
        attention alone (chapter 5).

        Args:
            q: ``[b, n_heads, s, head_dim]`` queries (not yet normalised nor rotated).
            k: ``[b, n_kv_heads, s, head_dim]`` keys (not yet normalised nor rotated).
            v: ``[b, n_kv_heads, s, head_dim]`` values.
            positions, key_padding_mask, document_ids, kv_cache: as in :meth:`forward`.

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
        for name, t in (("k", k), ("v", v)):
            check_device(name, t, q.device, fix="q, k and v must be on one device")
        return self._attend(q, k, v, positions, key_padding_mask, document_ids, kv_cache,
                            False)[0]

    @property
    def backend(self) -> str:
        """The name of the backend in :data:`~tutorial_pkg.attention.backends.BACKENDS`
        (checked when set)."""
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        self._backend = check_choice("backend", name, BACKENDS)

    def clear_cache(self) -> None:
        """Free the bias tables and key rows the backends keep for this layer's encoding.

        ``"sdpa"`` and ``"auto"`` keep one table per encoding, device, dtype and causal flag,
        sized for the longest length seen (rounded up to a power of two) and never shrunk,
        so one long call keeps a large table. This drops them for the encoding (every layer
        that shares it); the next call builds what it needs again. A :class:`KVCache` is
        the caller's, not touched here.
        """
        clear_caches(self.encoding)

    # ----------------------------------------------------------------------------- the plan
    def _attend(self, q, k, v, positions, key_padding_mask, document_ids, kv_cache,
                return_weights):
        q, k, v, plan = self._prepare(q, k, v, positions, key_padding_mask, document_ids,
                                      kv_cache)
        dropout = self.dropout if self.training else 0.0
        if return_weights:  # only the textbook form has weights
            return BACKENDS["naive"](q, k, v, plan, self.encoding, dropout_p=dropout,
                                     need_weights=True)
        attend = BACKENDS[self._backend]  # checked when set
        return attend(q, k, v, plan, self.encoding, dropout_p=dropout,
                      compile=self.compile_flex), None

    def _prepare(self, q, k, v, positions, key_padding_mask, document_ids, kv_cache):
        # checks of what forward and attend share (theirs are at their entry), q_norm /
        # k_norm, rotation and the KV cache; the call as a plan
        if kv_cache is not None and not isinstance(kv_cache, KVCache):
            raise TypeError(f"kv_cache must be a KVCache or None, got {type(kv_cache).__name__}")
        b, _, s, _ = q.shape
        device = q.device
        check_learned_device(self.encoding, device)  # a shared encoding may sit elsewhere
        start = kv_cache.length if kv_cache is not None else 0
        # default positions (start + arange): known without reading any tensor
        default = positions is None and (kv_cache is None or kv_cache.default_positions)
        rot_pos = None  # M-RoPE's [3, b, s] (time, height, width), for the encoding only
        if isinstance(positions, torch.Tensor) and positions.dim() == 3:
            rot_pos = self._axes_positions(positions, b, s, device)
            positions = rot_pos[0]  # the plan's positions: the time axis (text's index)
        if positions is None:
            q_pos = torch.arange(start, start + s, device=device)[None]
        else:
            # values are read back (not negative) only on CPU, where it costs no
            # device synchronisation (as_batched_positions); models check them once
            q_pos = as_batched_positions("positions", positions, b, s).to(device)
        # checked before anything is rotated or cached: a bad call leaves the cache as it was
        pad = self._check_padding(key_padding_mask, b, start + s, device)
        q_doc = None
        if document_ids is not None:
            q_doc = as_batched_positions("document_ids", document_ids, b, s,
                                         check_values=False).to(device)

        if self.q_norm is not None:  # per head, before RoPE (Qwen3, Gemma 3)
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.v_norm is not None:  # per head (Gemma 4)
            v = self.v_norm(v)
        rot = q_pos if rot_pos is None else rot_pos
        q, k = self.encoding.rotate(q, k, rot, rot)
        if self.temperature_tuning is not None:  # Llama 4's NoPE layers, by cache slot
            floor_scale, attn_scale = self.temperature_tuning
            slots = torch.arange(start, start + s, device=device, dtype=torch.float32)
            tau = torch.log1p(torch.floor((slots + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * tau[:, None]).to(q.dtype)  # [s, 1] against q [b, H, s, d]
        k_pos, k_doc = q_pos, q_doc
        if kv_cache is not None:
            k, v, k_pos, k_doc = kv_cache._append(k, v, q_pos, q_doc, default=positions is None)
        plan = AttentionPlan(
            q_pos=q_pos, k_pos=k_pos, start=start, default_positions=default,
            causal=self.causal, key_padding_mask=pad, q_doc=q_doc, k_doc=k_doc,
            window=self.window, scale=self._plan_scale(), softcap=self.softcap,
            sinks=self.sinks, chunk=self.chunk,
        )
        return q, k, v, plan

    def _axes_positions(self, positions, b, s, device):
        if getattr(self.encoding, "position_axes", 1) != 3:
            raise ValueError(f"positions of shape {tuple(positions.shape)} are M-RoPE's [3, b, s] "
                             f"(time, height, width); this layer's encoding "
                             f"{type(self.encoding).__name__} takes (s,) or [b, s]")
        if positions.shape[0] != 3 or positions.shape[2] != s or positions.shape[1] not in (1, b):
            raise ValueError(f"positions [3, b, s] must have shape (3, {b} or 1, {s}), got "
                             f"{tuple(positions.shape)}")
        rows = [as_batched_positions("positions", p, b, s) for p in positions]
        return torch.stack(rows).to(device)

    def _plan_scale(self) -> float | None:
        # None: the default 1/sqrt(head_dim), computed by each backend as it always was
        if self.scale == self.head_dim**-0.5:
            return None
        return check_positive_float("scale", self.scale)

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

    def extra_repr(self) -> str:
        extra = ""
        if self.head_dim * self.n_heads != self.d_model:
            extra += f", head_dim={self.head_dim}"
        if self.scale != self.head_dim**-0.5:
            extra += f", scale={self.scale!r}"
        if self.window is not None:
            extra += f", window={self.window}"
        if self.softcap is not None:
            extra += f", softcap={self.softcap:g}"
        if self.sinks is not None:
            extra += ", sinks=True"
        if self.chunk is not None:
            extra += f", chunk={self.chunk}"
        if self.temperature_tuning is not None:
            extra += f", temperature_tuning={self.temperature_tuning}"
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"causal={self.causal}, backend={self.backend!r}" + extra
        )


class TransformerBlock(nn.Module):
    """Attention + MLP with residuals; pre-norm (default) or post-norm.

    Pre-norm ``x + f(LN(x))`` keeps an identity path from input to output (the
    layout of GPT-2 and Llama); post-norm ``LN(x + f(x))`` is the original
    Transformer's form and the source articles'. Xiong et al. (2020) analyse the
    two at initialisation (chapter 4 sums it up in a paragraph).

    Args:
        d_model: model width.
        n_heads: attention heads.
        encoding: shared position encoding (see :class:`MultiHeadAttention`).
        d_ff: MLP hidden width (default ``4 * d_model``).
        dropout: dropout on attention weights and residual branches.
        norm_first: pre-norm (``True``) or post-norm (``False``).
        causal, backend, n_kv_heads, compile_flex, window: see :class:`MultiHeadAttention`.
        attention: a ready :class:`MultiHeadAttention` to use instead of building one
            (for its other options: ``head_dim``, ``scale``, per-projection biases,
            q/k norms). Its ``d_model`` and ``n_heads`` must match; then ``encoding``,
            ``causal``, ``backend``, ``n_kv_heads``, ``compile_flex`` and ``window``
            must be left at their defaults (they are the layer's own), else
            ``ValueError`` names them.
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
        window: int | None = None,
        attention: MultiHeadAttention | None = None,
    ) -> None:
        super().__init__()
        d_ff = 4 * d_model if d_ff is None else check_positive_int("d_ff", d_ff)
        self.norm_first = bool(norm_first)
        if attention is None:
            attention = MultiHeadAttention(
                d_model, n_heads, encoding, causal=causal, backend=backend, dropout=dropout,
                n_kv_heads=n_kv_heads, compile_flex=compile_flex, window=window,
            )
        else:
            if not isinstance(attention, MultiHeadAttention):
                raise TypeError(f"attention must be a MultiHeadAttention, got "
                                f"{type(attention).__name__}")
            if (attention.d_model, attention.n_heads) != (d_model, n_heads):
                raise ValueError(
                    f"attention has d_model={attention.d_model}, n_heads={attention.n_heads}; "
                    f"the block has d_model={d_model}, n_heads={n_heads}")
            given = {"encoding": encoding is not None, "causal": causal is not True,
                     "backend": backend != "auto", "n_kv_heads": n_kv_heads is not None,
                     "compile_flex": compile_flex is not True, "window": window is not None}
            if any(given.values()):
                raise ValueError(
                    f"{sorted(k for k, v in given.items() if v)} belong to the attention "
                    f"layer given as attention: set them on it")
        self.attn = attention
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, *, positions=None, key_padding_mask=None, document_ids=None,
                kv_cache=None):
        """``[b, s, d_model] -> [b, s, d_model]``; see :meth:`MultiHeadAttention.forward`."""
        kw = {"positions": positions, "key_padding_mask": key_padding_mask,
              "document_ids": document_ids, "kv_cache": kv_cache}
        if self.norm_first:
            x = x + self.drop(self.attn(self.norm1(x), **kw))
            return x + self.drop(self.mlp(self.norm2(x)))
        x = self.norm1(x + self.drop(self.attn(x, **kw)))
        return self.norm2(x + self.drop(self.mlp(x)))
