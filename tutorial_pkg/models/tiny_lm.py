"""A tiny decoder-only language model, any encoding by name. Chapter 7.

Token embedding -> ``encoding.embed`` (absolute encodings only) -> ``n_layers``
:class:`~tutorial_pkg.attention.layer.TransformerBlock` sharing one encoding -> final
LayerNorm -> output head tied to the embedding.

Or one encoding per layer: a list (one name or instance per layer) or a
:class:`~tutorial_pkg.encodings.schedules.LayerSchedule` (``"irope"``: NoPE every 4th layer;
``"local_global"``: Gemma 3's sliding-window local layers and global layers), which
also gives each layer its sliding window.

Same initial weights for every encoding: the encoding is built on a forked RNG,
so a learned position table does not shift the random stream that initialises
the rest of the model. Two models built with the same ``seed`` and different
encodings therefore start from identical embeddings and blocks.

Devices: token ids, targets, positions and masks are moved to the model's device (a
reader's CPU batch works with a GPU model). Their values (ids in the vocabulary, no
negative position) are checked where that is free, on CPU tensors; on a GPU that read
would synchronise every step, so there the model checks only what it knows on the host:
default positions against the encoding's declared ``max_positions``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import as_batched_positions, check_positive_int, values_readable
from ..attention.layer import KVCache, TransformerBlock
from ..encodings.builtin import PositionEncoding
from ..encodings.registry import make_encoding
from ..encodings.schedules import LayerSchedule, PerLayer

__all__ = ["TinyLM"]


class TinyLM(nn.Module):
    """Decoder-only LM for byte-level text.

    Args:
        encoding: an encoding name for :func:`~tutorial_pkg.encodings.registry.make_encoding` (an
            encoding or a schedule) or an instance (shared by every layer); a
            :class:`~tutorial_pkg.encodings.schedules.LayerSchedule` (or its name, e.g. ``"irope"``,
            ``"local_global"``): layer ``i`` gets ``schedule.layer(i)``; or a list of ``n_layers``
            names or instances, one per layer (a
            :class:`~tutorial_pkg.encodings.schedules.PerLayer`). The model's ``encoding`` holds the
            instance or the schedule.
        vocab_size: vocabulary size (256 for bytes).
        d_model: width.
        n_layers: number of blocks.
        n_heads: attention heads.
        max_positions: positions the learned encoding knows (needed only for ``"learned"``;
            the other encodings take any position and ignore it).
        d_ff: MLP width (default ``4 * d_model``).
        dropout: dropout probability.
        backend: attention backend (``"auto"``, the default of
            :class:`~tutorial_pkg.attention.layer.MultiHeadAttention`, or ``"naive"``,
            ``"sdpa"``, ``"flex"``; chapter 4).
        norm_first: pre-norm blocks (``True``) or post-norm.
        n_kv_heads: grouped-query attention heads.
        seed: seed of the initial weights (identical across encodings).
        encoding_kwargs: extra arguments for :func:`~tutorial_pkg.encodings.registry.make_encoding`
            (for a list, passed for each name in it).
        window: sliding window of every layer (see
            :class:`~tutorial_pkg.attention.layer.MultiHeadAttention`); a schedule that sets
            windows itself cannot take one too.
    """

    def __init__(
        self,
        encoding: str | PositionEncoding | LayerSchedule | list = "rope",
        *,
        vocab_size: int = 256,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        max_positions: int | None = None,
        d_ff: int | None = None,
        dropout: float = 0.0,
        backend: str = "auto",
        norm_first: bool = True,
        n_kv_heads: int | None = None,
        seed: int = 0,
        encoding_kwargs: dict | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("vocab_size", vocab_size)
        check_positive_int("n_layers", n_layers)
        if window is not None:
            check_positive_int("window", window)
        if isinstance(encoding, (list, tuple)):
            if len(encoding) != n_layers:
                raise ValueError(f"encoding must list one encoding per layer (n_layers="
                                 f"{n_layers}), got {len(encoding)}")
            if not all(isinstance(e, (str, PositionEncoding)) for e in encoding):
                raise TypeError("encoding must list names or PositionEncoding instances")
        elif not isinstance(encoding, (str, PositionEncoding, LayerSchedule)):
            raise TypeError(
                f"encoding must be a name, a PositionEncoding, a LayerSchedule or a list of "
                f"names or PositionEncodings, got {type(encoding).__name__}"
            )
        if encoding_kwargs and "max_positions" in encoding_kwargs:
            # one max_positions per model: the learned table's size, which RoPE ignores
            raise ValueError("encoding_kwargs must not hold 'max_positions' (TinyLM's own "
                             "argument); a RoPE that refuses positions past N is an instance: "
                             "Rotary(head_dim, max_positions=N)")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            build = lambda name: make_encoding(  # noqa: E731
                name, d_model=d_model, n_heads=n_heads, max_positions=max_positions,
                **(encoding_kwargs or {}),
            )
            if isinstance(encoding, str):
                encoding = build(encoding)
            elif isinstance(encoding, (list, tuple)):
                encoding = PerLayer([build(e) if isinstance(e, str) else e for e in encoding])
        if isinstance(encoding, LayerSchedule):
            if encoding.n_layers is not None and encoding.n_layers != n_layers:
                raise ValueError(f"encoding is a schedule of {encoding.n_layers} layers, "
                                 f"the model has n_layers={n_layers}")
            layers = [encoding.layer(i) for i in range(n_layers)]
            if window is not None and any(w is not None for _, w in layers):
                raise ValueError("window is given, but the schedule sets windows itself")
            layers = [(e, window if w is None else w) for e, w in layers]
        else:
            layers = [(encoding, window)] * n_layers
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            self.tok_emb = nn.Embedding(vocab_size, d_model)
            self.blocks = nn.ModuleList(
                TransformerBlock(
                    d_model, n_heads, layer_encoding, d_ff=d_ff, dropout=dropout,
                    norm_first=norm_first, backend=backend, n_kv_heads=n_kv_heads,
                    window=layer_window,
                )
                for layer_encoding, layer_window in layers
            )
            self.norm = nn.LayerNorm(d_model)
            # Skip the encoding (a child of every attention layer): a learned table was
            # initialised on the forked RNG above; re-drawing it here would shift this
            # stream and give the learned model different block weights.
            own = {id(m) for m in encoding.modules()}
            for module in self.modules():
                if id(module) not in own:
                    self._init_weights(module)
        finally:
            torch.random.set_rng_state(generator_state)
        self.encoding = encoding
        self.drop = nn.Dropout(dropout)
        self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2 style: small normal weights, zero biases.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def _embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # a schedule holds relative encodings only: nothing is added to the embeddings
        if isinstance(self.encoding, LayerSchedule):
            return x
        return self.encoding.embed(x, positions)

    @property
    def device(self) -> torch.device:
        """The device of the model's weights (where its inputs are moved)."""
        return self.tok_emb.weight.device

    def new_caches(self) -> list[KVCache]:
        """One empty :class:`~tutorial_pkg.attention.layer.KVCache` per layer (incremental
        decoding)."""
        return [KVCache() for _ in self.blocks]

    def _check_ids(self, ids) -> torch.Tensor:
        """Check ``ids`` (values on CPU only, see the module docs); move them to the model."""
        integer = (torch.long, torch.int, torch.int16, torch.uint8)
        if not isinstance(ids, torch.Tensor) or ids.dtype not in integer:
            got = getattr(ids, "dtype", type(ids).__name__)
            raise TypeError(f"ids must be an integer tensor [b, s], got {got}")
        if ids.dim() != 2:
            raise ValueError(f"ids must have shape [b, s], got {tuple(ids.shape)}")
        if ids.numel() and values_readable(ids):
            low, high = (int(t) for t in torch.aminmax(ids))  # one kernel
            if low < 0 or high >= self.vocab_size:
                raise ValueError(
                    f"ids must be in [0, vocab_size={self.vocab_size}), got values in "
                    f"[{low}, {high}]"
                )
        return ids.to(self.device)

    def _check_caches(self, caches):
        if caches is None:
            return
        if not isinstance(caches, (list, tuple)) or len(caches) != self.n_layers or not all(
            isinstance(c, KVCache) for c in caches
        ):
            raise ValueError(
                f"caches must be a list of {self.n_layers} KVCache (one per layer, see "
                f"new_caches()), got {type(caches).__name__}"
                + (f" of length {len(caches)}" if isinstance(caches, (list, tuple)) else "")
            )

    def forward(self, ids, *, positions=None, caches=None, key_padding_mask=None,
                document_ids=None):
        """Next-token logits.

        Args:
            ids: integer token ids ``[b, s]`` in ``[0, vocab_size)``.
            positions: optional ``(s,)`` or ``[b, s]`` positions (default: after the
                cached tokens). For a left-padded batch, use
                :func:`~tutorial_pkg.attention.positions.positions_from_padding`.
            caches: optional list of :class:`~tutorial_pkg.attention.layer.KVCache`
                from :meth:`new_caches`, one per layer.
            key_padding_mask: optional ``(b, L_k)`` bool, ``True`` = padding, over the
                cached and the new tokens.
            document_ids: optional ``[b, s]`` ids of packed documents (a token attends
                only within its document); see
                :meth:`~tutorial_pkg.attention.layer.MultiHeadAttention.forward`.

        Returns:
            float logits ``[b, s, vocab_size]``.
        """
        ids = self._check_ids(ids)
        self._check_caches(caches)
        b, s = ids.shape
        if positions is None:
            start = caches[0].length if caches is not None else 0
            pos = torch.arange(start, start + s, device=ids.device)
            if not values_readable(pos):  # the encoding cannot read them: check on the host
                self._check_max_positions(start + s)
        else:  # checked once here (values read once, on CPU), not in every layer
            pos = as_batched_positions("positions", positions, b, s).to(ids.device)
        x = self.drop(self._embed(self.tok_emb(ids.long()), pos))
        explicit = pos if positions is not None else None
        for i, block in enumerate(self.blocks):
            x = block(x, positions=explicit, key_padding_mask=key_padding_mask,
                      document_ids=document_ids, kv_cache=None if caches is None else caches[i])
        return self.norm(x) @ self.tok_emb.weight.T  # output head tied to the embedding

    def _check_max_positions(self, end: int) -> None:
        limit = self.encoding.max_positions
        if limit is not None and end > limit:
            raise ValueError(f"positions must be < max_positions={limit} of the "
                             f"{self.encoding.name!r} encoding, got up to {end - 1}")

    def loss(self, ids, targets) -> torch.Tensor:
        """Mean cross-entropy (nats per token) of ``targets [b, s]`` given ``ids [b, s]``."""
        logits = self(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               targets.reshape(-1).to(logits.device))

    @torch.no_grad()
    def attention_weights(self, ids, layer: int = -1) -> torch.Tensor:
        """Attention weights ``[b, H, s, s]`` of one layer on ``ids`` (naive backend).

        Args:
            ids: ``[b, s]`` token ids.
            layer: block index (negative counts from the end).
        """
        ids = self._check_ids(ids)
        if isinstance(layer, bool) or not isinstance(layer, int) or not (
            -self.n_layers <= layer < self.n_layers
        ):
            raise ValueError(
                f"layer must be an int in [-{self.n_layers}, {self.n_layers}), got {layer!r}"
            )
        layer = range(self.n_layers)[layer]
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self._embed(self.tok_emb(ids.long()), pos)
        for block in self.blocks[:layer]:
            x = block(x)
        block = self.blocks[layer]
        h = block.norm1(x) if block.norm_first else x
        _, weights = block.attn(h, return_weights=True)
        return weights
