"""A whole Hugging Face model run by the package's attention: :func:`swap_attention`.

Every attention module of a decoder whose layers call ``self_attn`` the Llama way (Llama,
Mistral, Qwen2, Qwen3, SmolLM3, Gemma 2, gpt-oss, Llama 4, Gemma 4: :data:`SWAP_FAMILIES`)
is replaced, in place, by :class:`PackageAttention`: the layer
:func:`~tutorial_pkg.models.hf.from_hf_attention` builds from it, called the way the
family's decoder layer calls its attention. So the package computes the projections, its
own RoPE (:class:`~tutorial_pkg.encodings.rope.RotaryEmbedding`, from the config), the
masks and the backend; the model's own rotary tables (``position_embeddings``) are not
used. What the model then computes can be changed through the package: a scaling rule
set on each layer's ``encoding.rope``
(:meth:`~tutorial_pkg.encodings.rope.RotaryEmbedding.set_scaling`, or
:func:`set_rope_scaling` for every layer) applies at the next call.

Module replacement, not transformers' ``AttentionInterface``: an attention function
registered there receives q and k already rotated by the model's RoPE, so it could not
change the encoding.

The KV cache stays Hugging Face's (``generate`` reads its length): each layer stores its
rotated keys and values there (:class:`HFCacheView`) and keeps their positions itself; a
sliding or chunked layer's cache returns only the keys inside its window, and the layer
reads exactly those.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..attention.layer import KVCache, MultiHeadAttention
from .hf import from_hf_attention

__all__ = ["SWAP_FAMILIES", "PackageAttention", "HFCacheView", "swap_attention",
           "set_rope_scaling"]

#: ``model_type``s whose decoder layers call ``self_attn(hidden_states, position_embeddings,
#: attention_mask, cache, position_ids=...)``, the call :class:`PackageAttention` takes.
SWAP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma2", "gpt_oss",
                 "llama4_text", "gemma4_text")


class HFCacheView(KVCache):
    """One layer's view of a Hugging Face ``Cache``: keys and values are stored there (so
    ``generate`` sees its length), the key positions ``[b, t]`` here."""

    def __init__(self, cache, layer_idx: int, positions: torch.Tensor | None) -> None:
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        length = int(cache.get_seq_length(layer_idx))  # every token the layer has seen
        if length and (positions is None or positions.shape[-1] != length):
            raise ValueError(f"the cache holds {length} tokens of layer {layer_idx} but this "
                             f"layer saw {0 if positions is None else positions.shape[-1]}: a "
                             "cache filled, cropped or reordered elsewhere is not supported")
        self.positions = positions if length else None
        self.default_positions = False  # positions always come from the model

    @property
    def length(self) -> int:
        """The number of keys the next call reads from the cache (a sliding-window cache
        layer holds only the last ``window - 1`` tokens it has seen)."""
        layers = getattr(self.cache, "layers", None)
        if layers is not None and self.layer_idx < len(layers):
            held = layers[self.layer_idx]
            if not getattr(held, "is_initialized", False):
                return 0
            return int(held.keys.shape[-2])
        return int(self.cache.get_seq_length(self.layer_idx))

    def _append(self, k, v, positions, document_ids, *, default: bool):
        if document_ids is not None:
            raise ValueError("packed documents are not supported through a Hugging Face cache")
        positions = positions[None] if positions.dim() == 1 else positions
        k, v = self.cache.update(k, v, self.layer_idx)
        old = self.positions
        if old is not None and old.shape[0] != positions.shape[0]:
            rows = max(old.shape[0], positions.shape[0])
            old, positions = old.expand(rows, -1), positions.expand(rows, -1)
        self.positions = positions if old is None else torch.cat((old, positions), dim=-1)
        # a sliding-window cache layer returns only the keys still inside the window
        return k, v, self.positions[..., -k.shape[-2]:], None


class PackageAttention(nn.Module):
    """The package's layer in a Hugging Face decoder layer's place.

    Takes the family's call (``hidden_states [b, s, d_model]``, ``attention_mask`` the
    model's 4-D mask ``[b, 1, s, L_k]`` or None, ``cache``, ``position_ids [1 or b, s]``)
    and returns ``(output [b, s, d_model], None)``.
    """

    def __init__(self, layer: MultiHeadAttention, layer_idx: int) -> None:
        super().__init__()
        self.layer, self.layer_idx = layer, layer_idx
        self._positions: torch.Tensor | None = None  # key positions of the cache in use
        self._cache_ref = None
        # the decoder layer's position_ids, for families whose layer does not pass them on
        # (Llama 4: its attention reads positions only through the rotary tables)
        self.layer_position_ids: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None,
                attention_mask: torch.Tensor | None = None, cache=None, *,
                position_ids: torch.Tensor | None = None, past_key_values=None, **kwargs):
        """The family's attention call (the class docs); other keyword arguments of the
        model (``use_cache``, ``cache_position``, ...) are accepted and not needed."""
        cache = cache if cache is not None else past_key_values
        b, s, _ = hidden_states.shape
        if position_ids is None:
            position_ids = self.layer_position_ids
        if position_ids is None:
            start = 0 if cache is None else int(cache.get_seq_length(self.layer_idx))
            position_ids = torch.arange(start, start + s, device=hidden_states.device)[None]
        positions = position_ids.expand(b, -1)
        kv = None
        if cache is not None:
            same = self._cache_ref is not None and self._cache_ref() is cache
            kv = HFCacheView(cache, self.layer_idx, self._positions if same else None)
        padding = None
        if attention_mask is not None:
            # a key no query may see is padding (a real token sees itself; a key outside
            # every query's window is hidden either way)
            allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            padding = ~allowed[:, 0].any(dim=-2)
        out = self.layer(hidden_states, positions=positions, key_padding_mask=padding,
                         kv_cache=kv)
        if kv is not None:
            self._positions, self._cache_ref = kv.positions, weakref.ref(cache)
        return out, None


def swap_attention(model: nn.Module, *, backend: str = "auto") -> nn.Module:
    """Replace every attention module of ``model`` (a Hugging Face model of one of
    :data:`SWAP_FAMILIES`) by a :class:`PackageAttention`, in place; returns ``model``.

    Raises:
        ValueError: naming the family, for another ``model_type`` (or one the loader
            refuses), or a model with no attention module found.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SWAP_FAMILIES:
        raise ValueError(f"swap_attention runs Llama-style decoders ({', '.join(SWAP_FAMILIES)}); "
                         f"got model_type {model_type!r}")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    swapped = 0
    for module in list(model.modules()):
        attention = getattr(module, "self_attn", None)
        if attention is None or isinstance(attention, PackageAttention):
            continue
        layer = from_hf_attention(attention, text_config, backend=backend)
        module.self_attn = PackageAttention(layer, int(attention.layer_idx))
        module.register_forward_pre_hook(_pass_position_ids, with_kwargs=True)
        swapped += 1
    if not swapped:
        raise ValueError(f"no attention module (self_attn) found in {type(model).__name__}")
    return model


def _pass_position_ids(decoder_layer: nn.Module, args, kwargs):
    """Forward pre-hook of a decoder layer: hand its ``position_ids`` to its attention."""
    decoder_layer.self_attn.layer_position_ids = kwargs.get("position_ids")


def set_rope_scaling(model: nn.Module, rule: dict | None) -> None:
    """Set the RoPE scaling ``rule`` (a Hugging Face ``rope_scaling`` dict, or None for
    the original frequencies) on every swapped layer of ``model``."""
    layers = [m.layer for m in model.modules() if isinstance(m, PackageAttention)]
    if not layers:
        raise ValueError("model has no PackageAttention layers: call swap_attention(model) first")
    for layer in layers:
        rope = getattr(layer.encoding, "rope", None)
        if rope is None:  # a NoPE layer (SmolLM3's no_rope_layers)
            continue
        rope.set_scaling(rule)
