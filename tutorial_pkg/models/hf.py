"""Load a Hugging Face attention layer into
:class:`~tutorial_pkg.attention.layer.MultiHeadAttention`.

:func:`from_hf_attention` builds the package's layer from a transformers attention
module and its model config: the q/k/v/o weights (split from a fused projection where
the family fuses them), grouped-query heads, ``head_dim``, the biases of each
projection, the softmax scale, QK-norm, the sliding window and RoPE (read from the
config with :func:`~tutorial_pkg.encodings.rope_config.read_rope_config`, per layer type where
the config has one RoPE per layer type). Its output equals the module's on every
backend, causal and left-padded (tests/test_hf_oracle.py holds it to that for each
family below). :func:`padding_mask` turns Hugging Face's ``attention_mask``
(``1`` = token) into the package's key padding mask (``True`` = padding); positions
then come from :func:`~tutorial_pkg.attention.positions.positions_from_padding`.

==================  ============================================================
family              what is read
==================  ============================================================
Llama               q/k/v/o_proj (biases if ``attention_bias``), GQA, head_dim
Mistral             as Llama, and ``config.sliding_window`` as the window
Qwen2               as Llama: q/k/v biases, none on o_proj; window per layer type
Qwen3               as Qwen2 without biases, and ``q_norm``/``k_norm`` (copied)
Gemma 3 (text)      as Qwen3, scale ``query_pre_attn_scalar ** -0.5``, RoPE and
                    window of the layer's type
Phi-3               fused ``qkv_proj`` (q rows, then k, then v), LongRoPE,
                    ``config.sliding_window`` (Phi-3-mini's 2047)
GPT-NeoX            fused ``query_key_value`` (per head: q, k, v), partial rotary
BLOOM               fused ``query_key_value`` (per head: q, k, v), ALiBi
Falcon              fused ``query_key_value``: per group of ``num_kv_heads``
                    (``new_decoder_architecture``), one shared k/v head
                    (``multi_query``) or per head q, k, v; RoPE, or ALiBi with
                    ``bias_scale=head_dim ** -0.5`` (``config.alibi``); biases
                    if ``config.bias``
GPT-J               q/k/v/out_proj (no biases), ``rotary_dim`` features in
                    adjacent pairs (interleaved), scale ``head_dim ** -0.5``
MPT                 fused ``Wqkv`` (q rows, then k, then v), ALiBi (slopes for
                    ``alibi_bias_max`` 8), ``softmax_scale``; the default
                    ``attn_config`` only (no ``clip_qkv``, no ``qk_ln``)
SmolLM3             as Llama; a layer whose ``no_rope_layers`` entry is 0 (1 =
                    RoPE) is loaded with NoPE (the module's ``layer_idx``)
Gemma 2             as Llama, scale ``query_pre_attn_scalar ** -0.5``, logit
                    soft-capping (``attn_logit_softcapping``), the window of
                    sliding layers
GPT-OSS             as Llama with biases, learned sinks (``sinks``, one per query
                    head), the window of sliding layers, YaRN
Gemma 4 (text)      as Gemma 3 with the module's own ``head_dim`` (global layers:
                    ``global_head_dim``) and its layer type's RoPE (global:
                    ``proportional``, p-RoPE), scale 1, the weightless ``v_norm``,
                    values from the keys where ``attention_k_eq_v``; layers that
                    reuse another layer's keys and values are refused
Qwen2(.5)-VL text   as Qwen2 (q/k/v biases) with M-RoPE
                    (:class:`~tutorial_pkg.encodings.mrope.MRotary`, ``mrope_section``);
                    call the layer with ``[3, b, s]`` positions
Qwen3-VL (text)     as Qwen3 (QK-norm) with interleaved M-RoPE
Llama 4 (text)      as Llama, interleaved RoPE; per layer ``use_rope``: RoPE layers
                    with the weightless ``qk_norm`` and, where the layer type is
                    ``chunked_attention``, chunks of ``attention_chunk_size``
                    positions; NoPE layers with the attention temperature tuning
                    (``floor_scale``, ``attn_scale``)
==================  ============================================================

A family the package cannot express is refused by name (``ValueError``), never
approximated: DeepSeek-V2/V3 (multi-head latent attention), T5 and any other
``model_type``. A supported family's module with something the loader does not know (an
extra submodule, soft-capping or sinks outside Gemma 2 and GPT-OSS, a norm of another
class, MPT's ``clip_qkv`` or ``qk_ln``) is refused too.

**Falcon's bfloat16 ALiBi.** Falcon's ``build_alibi_tensor`` rounds the slopes and
each ``m_h * j`` to bfloat16 whatever the model's dtype; the loaded layer's ALiBi
keeps them in float32 (see :class:`~tutorial_pkg.encodings.builtin.ALiBi`). With a
power-of-two head count and key positions below 256 both are exact and the outputs
agree; otherwise they differ by that rounding, and the ALiBi docstring's
``FalconBF16ALiBi`` recipe, set as the loaded layer's ``encoding``, reproduces it.

Differences that are conventions, not numbers: BLOOM's attention module adds the
residual to its output (``dense(context) + residual``); the loaded layer returns
``dense(context)``, as every other family's module does. QK-norm modules are
copies of the family's own (``copy.deepcopy``), so they compute as the family does
in every dtype. transformers is never imported here: the loader reads the module's
attributes and ``config.to_dict()``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn

from ..attention.layer import MultiHeadAttention
from ..encodings.builtin import ALiBi, NoPE, PositionEncoding, Rotary
from ..encodings.mrope import MRotary
from ..encodings.rope_config import read_rope_config

__all__ = ["SUPPORTED_FAMILIES", "REFUSED_FAMILIES", "from_hf_attention", "padding_mask"]

#: ``model_type`` -> the family's name, for every family :func:`from_hf_attention` loads.
SUPPORTED_FAMILIES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma 3",
    "phi3": "Phi-3",
    "gpt_neox": "GPT-NeoX",
    "bloom": "BLOOM",
    "falcon": "Falcon",
    "gptj": "GPT-J",
    "mpt": "MPT",
    "smollm3": "SmolLM3",
    "gemma2": "Gemma 2",
    "gpt_oss": "GPT-OSS",
    "llama4_text": "Llama 4 (text)",
    "gemma4_text": "Gemma 4 (text)",
    "qwen2_vl_text": "Qwen2-VL (text)",
    "qwen2_5_vl_text": "Qwen2.5-VL (text)",
    "qwen3_vl_text": "Qwen3-VL (text)",
}

#: ``model_type`` -> why :func:`from_hf_attention` refuses the family.
REFUSED_FAMILIES = {
    "gemma3": "this is Gemma 3's multimodal config: pass its text config (config.text_config, "
              "model_type 'gemma3_text') with the language model's attention module",
    "gemma4": "this is Gemma 4's multimodal config: pass its text config (config.text_config, "
              "model_type 'gemma4_text') with the language model's attention module",
    "deepseek_v2": "DeepSeek-V2 uses multi-head latent attention (low-rank q and kv, decoupled "
                   "RoPE on part of each head): not one MultiHeadAttention",
    "deepseek_v3": "DeepSeek-V3 uses multi-head latent attention (low-rank q and kv, decoupled "
                   "RoPE on part of each head): not one MultiHeadAttention",
    "llama4": "this is Llama 4's multimodal config: pass its text config (config.text_config, "
              "model_type 'llama4_text') with the language model's attention module",
    "t5": "T5's attention is not scaled and its bias is learned per bucket: build it with "
          "T5RelativeBias (tests/test_hf_oracle.py shows how), the loader does not",
}

#: Norm classes whose copies act on each head (``[..., head_dim]``), as the loader needs.
_HEAD_NORMS = {"Qwen3RMSNorm", "Gemma3RMSNorm", "Gemma4RMSNorm", "Qwen3VLTextRMSNorm"}

#: The submodules each layout of attention module may have, and nothing else.
_LLAMA_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_CHILDREN = {
    "llama": _LLAMA_CHILDREN,
    "mistral": _LLAMA_CHILDREN,
    "qwen2": _LLAMA_CHILDREN,
    "qwen3": _LLAMA_CHILDREN | {"q_norm", "k_norm"},
    "gemma3_text": _LLAMA_CHILDREN | {"q_norm", "k_norm"},
    "phi3": {"qkv_proj", "o_proj"},
    "gpt_neox": {"query_key_value", "dense"},
    "bloom": {"query_key_value", "dense", "attention_dropout"},
    "falcon": {"query_key_value", "dense", "attention_dropout"},
    "gptj": {"q_proj", "k_proj", "v_proj", "out_proj", "resid_dropout"},
    "mpt": {"Wqkv", "out_proj"},
    "smollm3": _LLAMA_CHILDREN,
    "gemma2": _LLAMA_CHILDREN,
    "gpt_oss": _LLAMA_CHILDREN,
    "llama4_text": _LLAMA_CHILDREN | {"qk_norm"},
    "gemma4_text": _LLAMA_CHILDREN | {"q_norm", "k_norm", "v_norm"},
    "qwen2_vl_text": _LLAMA_CHILDREN,
    "qwen2_5_vl_text": _LLAMA_CHILDREN,
    "qwen3_vl_text": _LLAMA_CHILDREN | {"q_norm", "k_norm"},
}
#: M-RoPE families: (``mrope_section`` default of their rotary module, interleaved).
_MROPE = {"qwen2_vl_text": ((16, 24, 24), False), "qwen2_5_vl_text": ((16, 24, 24), False),
          "qwen3_vl_text": ((24, 20, 20), True)}

#: Subclasses of ``nn.Linear`` whose forward is ``x @ weight.T + bias``, as nn.Linear's.
_PLAIN_LINEARS = {"FalconLinear"}


def padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``attention_mask`` (``[b, L]``, 1 = token, 0 = padding) as the
    package's key padding mask (bool ``[b, L]``, ``True`` = padding).

    Example:
        >>> padding_mask(torch.tensor([[0, 0, 1, 1]]))
        tensor([[ True,  True, False, False]])
    """
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor [b, L] (1 = token), got "
                        f"{type(attention_mask).__name__}")
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must have shape [b, L] (Hugging Face's 2-D mask, "
                         f"1 = token), got {tuple(attention_mask.shape)}")
    if attention_mask.dtype == torch.bool:
        return ~attention_mask
    return attention_mask == 0


def _config_dict(config) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        raise TypeError(f"config must be a Hugging Face config (with to_dict()) or a dict, got "
                        f"{type(config).__name__}")
    return to_dict()


def _refuse(family: str, reason: str):
    raise ValueError(f"tutorial_pkg.models.hf cannot load a {family} attention layer: {reason}")


def _rope_layer_type(cfg: dict, attention) -> str | None:
    """The layer type whose RoPE to read, where the config has one RoPE per layer type."""
    rope = cfg.get("rope_parameters")
    nested = isinstance(rope, Mapping) and any(isinstance(v, Mapping) or v is None
                                               for v in rope.values())
    if not nested:
        return None
    layer_type = getattr(attention, "layer_type", None)
    if layer_type is None:
        idx, types = getattr(attention, "layer_idx", None), cfg.get("layer_types")
        if idx is None or not types:
            _refuse(cfg.get("model_type"), "the config has one RoPE per layer type and the "
                    "module says neither its layer_type nor its layer_idx")
        layer_type = types[idx]
    return layer_type


def _rotary(cfg: dict, attention, head_dim: int, family: str) -> PositionEncoding:
    layer_type = _rope_layer_type(cfg, attention)
    rope = read_rope_config(cfg, layer_type=layer_type)
    if rope.head_dim != head_dim:
        _refuse(family, f"the config's RoPE has head_dim={rope.head_dim} but the module's heads "
                f"have {head_dim}")
    return Rotary(**rope.kwargs())


def _linear(module, name: str, family: str) -> nn.Linear:
    lin = getattr(module, name, None)
    if type(lin) is not nn.Linear and not (isinstance(lin, nn.Linear)
                                           and type(lin).__name__ in _PLAIN_LINEARS):
        _refuse(family, f"its {name} is a {type(lin).__name__}, not an nn.Linear")
    return lin


def _copy(dst: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    dst.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        dst.weight.copy_(weight)
        if bias is not None:
            dst.bias.copy_(bias)


def _split_per_head(t: torch.Tensor, n_heads: int, head_dim: int):
    """Rows of a fused per-head projection ``[heads, 3, head_dim]`` -> q, k, v rows (GPT-NeoX
    views its output as ``[heads, 3 * head_dim]`` chunked in three: the same rows; BLOOM
    as ``[heads, 3, head_dim]``)."""
    per = t.reshape(n_heads, 3, head_dim, *t.shape[1:])
    return [per[:, i].reshape(n_heads * head_dim, *t.shape[1:]) for i in range(3)]


def _check_children(attention, family: str, model_type: str) -> None:
    extra = {name for name, _ in attention.named_children()} - _CHILDREN[model_type]
    if extra:
        _refuse(family, f"its module {type(attention).__name__} has submodule(s) "
                f"{sorted(extra)} the loader does not know")


def _norm_copy(attention, name: str, family: str, head_dim: int) -> nn.Module:
    norm = getattr(attention, name)
    if type(norm).__name__ not in _HEAD_NORMS:
        _refuse(family, f"its {name} is a {type(norm).__name__}, not one of the per-head "
                f"norms the loader knows ({sorted(_HEAD_NORMS)})")
    weight = getattr(norm, "weight", None)
    if weight is None or tuple(weight.shape) != (head_dim,):
        _refuse(family, f"its {name} does not act on one head (weight of shape "
                f"{None if weight is None else tuple(weight.shape)}, head_dim {head_dim})")
    return copy.deepcopy(norm)


def from_hf_attention(attention: nn.Module, config, *, backend: str = "auto",
                      compile_flex: bool = True) -> MultiHeadAttention:
    """Build a :class:`~tutorial_pkg.attention.layer.MultiHeadAttention` that computes what a
    Hugging Face attention module computes (see the module docs for the families).

    Args:
        attention: the family's attention module (``model.layers[i].self_attn``,
            GPT-NeoX's ``layers[i].attention``, BLOOM's and Falcon's ``h[i].self_attention``,
            GPT-J's ``h[i].attn``, MPT's ``blocks[i].attn``).
        config: the model's config (a ``PretrainedConfig`` or its ``to_dict()``); for
            Gemma 3 the text config. Its ``model_type`` names the family.
        backend, compile_flex: as in :class:`~tutorial_pkg.attention.layer.MultiHeadAttention`.

    Returns:
        The layer, with copies of the module's weights, on their device and dtype (the
        encoding's tables are built on the call's device, in float32). Call it with
        ``key_padding_mask=padding_mask(attention_mask)`` and ``positions`` (HF's
        ``position_ids``, or :func:`~tutorial_pkg.attention.positions.positions_from_padding`).

    Raises:
        ValueError: naming the family, for a family the package cannot express (the
            module docs list them) or a module with something the loader does not know.
        TypeError: ``attention`` is not an ``nn.Module`` or ``config`` not a config.
    """
    if not isinstance(attention, nn.Module):
        raise TypeError(f"attention must be a Hugging Face attention module (nn.Module), got "
                        f"{type(attention).__name__}")
    cfg = _config_dict(config)
    model_type = cfg.get("model_type")
    if model_type in REFUSED_FAMILIES:
        _refuse(model_type, REFUSED_FAMILIES[model_type])
    if model_type not in SUPPORTED_FAMILIES:
        _refuse(repr(model_type), f"the loader knows {sorted(SUPPORTED_FAMILIES)} (and refuses "
                f"{sorted(REFUSED_FAMILIES)} by name); another family is never approximated")
    family = SUPPORTED_FAMILIES[model_type]
    _check_children(attention, family, model_type)
    softcap = getattr(attention, "attn_logit_softcapping", None)
    if softcap is not None and model_type != "gemma2":
        _refuse(family, "this layer soft-caps its attention logits (attn_logit_softcapping), "
                "which its family's code does not: the loader reads it for Gemma 2 only")
    sinks = getattr(attention, "sinks", None)
    if (sinks is not None) != (model_type == "gpt_oss"):
        _refuse(family, "attention sinks (a sinks parameter) are read for GPT-OSS only, and "
                "every GPT-OSS layer has them")
    causal = bool(getattr(attention, "is_causal", True))

    if model_type == "bloom":
        return _bloom(attention, cfg, backend, compile_flex)
    if model_type == "gpt_neox":
        return _gpt_neox(attention, cfg, backend, compile_flex, causal)
    if model_type == "falcon":
        return _falcon(attention, cfg, backend, compile_flex, causal)
    if model_type == "gptj":
        return _gptj(attention, cfg, backend, compile_flex, causal)
    if model_type == "mpt":
        return _mpt(attention, cfg, backend, compile_flex, causal)

    o = _linear(attention, "o_proj", family)
    head_dim = int(attention.head_dim)
    d_model = o.out_features
    n_heads = o.in_features // head_dim
    if model_type == "phi3":
        qkv = _linear(attention, "qkv_proj", family)
        n_kv = int(attention.num_key_value_heads)
        sizes = [n_heads * head_dim, n_kv * head_dim, n_kv * head_dim]
        if qkv.out_features != sum(sizes):
            _refuse(family, f"qkv_proj has {qkv.out_features} rows, not {sum(sizes)}")
        ws = qkv.weight.split(sizes)
        bs = [None] * 3 if qkv.bias is None else qkv.bias.split(sizes)
        has_bias = [qkv.bias is not None] * 3
    else:
        if model_type == "gemma4_text":
            _gemma4_checks(attention, family)
        names = ["q_proj", "k_proj"] + ([] if _values_from_keys(attention) else ["v_proj"])
        projs = [_linear(attention, n, family) for n in names]
        n_kv = projs[1].out_features // head_dim
        ws = [p.weight for p in projs] + [None] * (3 - len(projs))
        bs = [p.bias for p in projs] + [None] * (3 - len(projs))
        has_bias = [p.bias is not None for p in projs] + [False] * (3 - len(projs))
    if n_heads * n_kv == 0 or n_heads % n_kv:
        _refuse(family, f"{n_heads} query heads and {n_kv} key/value heads")
    norms, extra = {}, {}
    window = getattr(attention, "sliding_window", None)
    if model_type in ("mistral", "phi3"):  # their masks read the window from the config
        window = cfg.get("sliding_window")
    if model_type in ("qwen3", "gemma3_text", "gemma4_text", "qwen3_vl_text"):
        norms = {n: _norm_copy(attention, n, family, head_dim) for n in ("q_norm", "k_norm")}
    if model_type == "gemma4_text":
        norms["v_norm"] = _weightless_norm_copy(attention, "v_norm", family)
        extra["values_from_keys"] = _values_from_keys(attention)
    if model_type == "smollm3":
        encoding = _smollm3_encoding(attention, cfg, head_dim, family)
    elif model_type == "llama4_text":
        encoding, norms, extra = _llama4(attention, cfg, head_dim, family)
    elif model_type in _MROPE:
        encoding = _mrope(cfg, head_dim, family, *_MROPE[model_type])
    else:
        encoding = _rotary(cfg, attention, head_dim, family)
    ours = MultiHeadAttention(
        d_model, n_heads, encoding, causal=causal,
        backend=backend, dropout=float(getattr(attention, "attention_dropout", 0.0) or 0.0),
        n_kv_heads=n_kv, compile_flex=compile_flex, window=window, head_dim=head_dim,
        scale=float(attention.scaling), q_bias=has_bias[0], k_bias=has_bias[1],
        v_bias=has_bias[2], o_bias=o.bias is not None, **norms,
        softcap=None if softcap is None else float(softcap), sinks=sinks is not None,
        **extra,
    )
    for dst, w, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), ws, bs, strict=True):
        if dst is not None:  # no v_proj: the values are the keys (Gemma 4)
            _copy(dst, w, b)
    _copy(ours.out_proj, o.weight, o.bias)
    if sinks is not None:
        if tuple(sinks.shape) != (n_heads,):
            _refuse(family, f"its sinks have shape {tuple(sinks.shape)}, not ({n_heads},)")
        ours.sinks.data = sinks.detach().clone()  # the module's dtype and device
    return _place(ours, o.weight)


def _place(ours: MultiHeadAttention, weight: torch.Tensor) -> MultiHeadAttention:
    # the encoding to the weights' device (its tables stay float32); norms as copied
    ours.encoding.to(device=weight.device)
    return ours


def _fused(attention, family, n_heads, head_dim, encoding, cfg, backend, compile_flex, causal,
           scale, dropout):
    qkv, dense = _linear(attention, "query_key_value", family), _linear(attention, "dense", family)
    d_model = dense.out_features
    if qkv.out_features != 3 * n_heads * head_dim:
        _refuse(family, f"query_key_value has {qkv.out_features} rows, not 3 * {n_heads} heads "
                f"* {head_dim}")
    has_bias = qkv.bias is not None
    ours = MultiHeadAttention(
        d_model, n_heads, encoding, causal=causal, backend=backend, dropout=dropout,
        compile_flex=compile_flex, head_dim=head_dim, scale=scale, q_bias=has_bias,
        k_bias=has_bias, v_bias=has_bias, o_bias=dense.bias is not None,
    )
    ws = _split_per_head(qkv.weight, n_heads, head_dim)
    bs = _split_per_head(qkv.bias, n_heads, head_dim) if has_bias else [None] * 3
    for dst, w, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), ws, bs, strict=True):
        _copy(dst, w, b)
    _copy(ours.out_proj, dense.weight, dense.bias)
    return _place(ours, dense.weight)


def _gpt_neox(attention, cfg, backend, compile_flex, causal):
    family = "GPT-NeoX"
    head_dim = int(attention.head_size)
    n_heads = int(cfg["num_attention_heads"])
    encoding = _rotary(cfg, attention, head_dim, family)
    if encoding.rope.rotary_dim != int(attention.rotary_ndims):
        _refuse(family, f"the config's rotary_dim {encoding.rope.rotary_dim} is not the "
                f"module's rotary_ndims {attention.rotary_ndims}")
    return _fused(attention, family, n_heads, head_dim, encoding, cfg, backend, compile_flex,
                  causal, float(attention.scaling),
                  float(getattr(attention, "attention_dropout", 0.0) or 0.0))


def _bloom(attention, cfg, backend, compile_flex):
    family = "BLOOM"
    n_heads, head_dim = int(attention.num_heads), int(attention.head_dim)
    if float(getattr(attention, "beta", 1.0)) != 1.0:
        _refuse(family, f"beta={attention.beta}: the ALiBi bias would be scaled")
    drop = getattr(attention, "attention_dropout", None)
    dropout = float(drop.p) if isinstance(drop, nn.Dropout) else 0.0
    return _fused(attention, family, n_heads, head_dim, ALiBi(n_heads), cfg, backend,
                  compile_flex, True, float(attention.inv_norm_factor), dropout)


def _copy_all(ours: MultiHeadAttention, ws, bs, out: nn.Linear) -> MultiHeadAttention:
    for dst, w, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), ws, bs, strict=True):
        _copy(dst, w, b)
    _copy(ours.out_proj, out.weight, out.bias)
    return _place(ours, out.weight)


def _mrope(cfg: dict, head_dim: int, family: str, section, interleaved) -> PositionEncoding:
    """M-RoPE from ``rope_parameters`` (``mrope_section``, else the rotary module's default)."""
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        _refuse(family, f"rope_type {rope.get('rope_type')!r} with M-RoPE: the loader reads "
                f"the default rule only")
    section = rope.get("mrope_section", section)
    try:
        return MRotary(head_dim, float(rope.get("rope_theta", 10000.0)), mrope_section=section,
                       interleaved=interleaved)
    except ValueError as err:
        _refuse(family, str(err))


def _values_from_keys(attention) -> bool:
    """Gemma 4's ``attention_k_eq_v`` global layers: no ``v_proj``, the values are the keys."""
    return bool(getattr(attention, "use_alternative_attention", False))


def _gemma4_checks(attention, family) -> None:
    if getattr(attention, "is_kv_shared_layer", False):
        _refuse(family, "this layer reuses the keys and values of an earlier layer "
                "(kv_sharing_modes 'reuse'): it is not one attention layer on its own")
    if _values_from_keys(attention) != (getattr(attention, "v_proj", None) is None):
        _refuse(family, "use_alternative_attention and the presence of v_proj disagree")


def _weightless_norm_copy(attention, name: str, family: str) -> nn.Module:
    norm = getattr(attention, name)
    if type(norm).__name__ not in _HEAD_NORMS or list(norm.parameters()):
        _refuse(family, f"its {name} is a {type(norm).__name__} with weights, not the "
                f"weightless per-head norm the loader knows")
    return copy.deepcopy(norm)


def _llama4(attention, cfg, head_dim, family):
    """Llama 4's layer: RoPE (interleaved) or NoPE per ``use_rope``; on RoPE layers the
    weightless ``qk_norm`` (an RMS norm of each head, after RoPE in its code: rotations
    keep the norm, so the package applies it before) and the chunk of chunked layers; on
    NoPE layers the temperature tuning."""
    idx = getattr(attention, "layer_idx", None)
    types = cfg.get("layer_types") or []
    if idx is None or not 0 <= int(idx) < len(types):
        _refuse(family, f"the module's layer_idx ({idx}) does not index the config's "
                f"layer_types")
    norms, extra = {}, {}
    qk_norm = getattr(attention, "qk_norm", None)
    if qk_norm is not None:
        if type(qk_norm).__name__ != "Llama4TextL2Norm" or list(qk_norm.parameters()):
            _refuse(family, f"its qk_norm is a {type(qk_norm).__name__}, not the weightless "
                    f"Llama4TextL2Norm")
        norms = {"q_norm": copy.deepcopy(qk_norm), "k_norm": copy.deepcopy(qk_norm)}
    if types[int(idx)] == "chunked_attention":
        extra["chunk"] = int(cfg["attention_chunk_size"])
    if attention.use_rope:
        return _rotary(cfg, attention, head_dim, family), norms, extra
    if attention.attn_temperature_tuning:
        extra["temperature_tuning"] = (float(attention.floor_scale), float(attention.attn_scale))
    return NoPE(), norms, extra


def _smollm3_encoding(attention, cfg, head_dim, family) -> PositionEncoding:
    """RoPE, or NoPE where the layer's ``no_rope_layers`` entry is 0 (its entries say
    "uses RoPE": ``SmolLM3Attention.use_rope = config.no_rope_layers[layer_idx]``)."""
    idx, flags = getattr(attention, "layer_idx", None), cfg.get("no_rope_layers")
    if idx is None or flags is None or not 0 <= int(idx) < len(flags):
        _refuse(family, f"the module's layer_idx ({idx}) does not index the config's "
                f"no_rope_layers ({flags}): the loader cannot tell whether it uses RoPE")
    use_rope = bool(flags[int(idx)])
    if hasattr(attention, "use_rope") and bool(attention.use_rope) != use_rope:
        _refuse(family, f"the module's use_rope ({attention.use_rope}) is not the config's "
                f"no_rope_layers[{idx}] ({flags[int(idx)]})")
    return _rotary(cfg, attention, head_dim, family) if use_rope else NoPE()


def _falcon(attention, cfg, backend, compile_flex, causal):
    """Falcon's fused ``query_key_value``, as ``FalconAttention._split_heads`` reads it."""
    family = "Falcon"
    qkv, dense = _linear(attention, "query_key_value", family), _linear(attention, "dense", family)
    n_heads, head_dim = int(attention.num_heads), int(attention.head_dim)
    if cfg.get("new_decoder_architecture"):
        # [groups, heads per group + 2, head_dim]: the group's queries, then its k, then its v
        n_kv = int(cfg["num_kv_heads"])
        if n_kv < 1 or n_heads % n_kv:
            _refuse(family, f"{n_heads} query heads and num_kv_heads={n_kv}")
        layout = (n_kv, n_heads // n_kv + 2, head_dim)

        def split(t):
            per = t.reshape(*layout, *t.shape[1:])
            return [per[:, :-2].reshape(n_heads * head_dim, *t.shape[1:]),
                    per[:, -2].reshape(n_kv * head_dim, *t.shape[1:]),
                    per[:, -1].reshape(n_kv * head_dim, *t.shape[1:])]
    elif cfg.get("multi_query"):
        # [heads + 2, head_dim]: every query head, then the one key head, then the value head
        n_kv = 1

        def split(t):
            return list(t.split([n_heads * head_dim, head_dim, head_dim]))
    else:  # [heads, 3, head_dim], as BLOOM
        n_kv = n_heads
        if int(getattr(attention, "num_kv_heads", n_heads)) != n_heads:
            _refuse(family, f"num_kv_heads={attention.num_kv_heads} with the per-head layout "
                    f"(neither new_decoder_architecture nor multi_query): its code needs "
                    f"{n_heads}")

        def split(t):
            return _split_per_head(t, n_heads, head_dim)
    expected = (n_heads + 2 * n_kv) * head_dim
    if qkv.out_features != expected:
        _refuse(family, f"query_key_value has {qkv.out_features} rows, not ({n_heads} + 2 * "
                f"{n_kv}) heads * {head_dim}")
    if cfg.get("alibi"):
        encoding = ALiBi(n_heads, bias_scale=head_dim ** -0.5)
    else:
        encoding = _rotary(cfg, attention, head_dim, family)
    drop = getattr(attention, "attention_dropout", None)
    dropout = float(drop.p) if isinstance(drop, nn.Dropout) else 0.0
    has_bias = qkv.bias is not None
    ours = MultiHeadAttention(
        dense.out_features, n_heads, encoding, causal=causal, backend=backend, dropout=dropout,
        n_kv_heads=n_kv, compile_flex=compile_flex, head_dim=head_dim,
        scale=float(attention.inv_norm_factor), q_bias=has_bias, k_bias=has_bias,
        v_bias=has_bias, o_bias=dense.bias is not None,
    )
    bs = split(qkv.bias) if has_bias else [None] * 3
    return _copy_all(ours, split(qkv.weight), bs, dense)


def _gptj(attention, cfg, backend, compile_flex, causal):
    family = "GPT-J"
    if getattr(attention, "rotary_dim", None) is None:
        _refuse(family, "rotary_dim is None: its code then builds tables of n_embd features "
                "for every head, not one head's")
    projs = [_linear(attention, n, family) for n in ("q_proj", "k_proj", "v_proj")]
    out = _linear(attention, "out_proj", family)
    head_dim, n_heads = int(attention.head_dim), int(attention.num_attention_heads)
    encoding = _rotary(cfg, attention, head_dim, family)
    if encoding.rope.rotary_dim != int(attention.rotary_dim):
        _refuse(family, f"the config's rotary_dim {encoding.rope.rotary_dim} is not the "
                f"module's {attention.rotary_dim}")
    ours = MultiHeadAttention(
        out.out_features, n_heads, encoding, causal=causal, backend=backend,
        dropout=float(getattr(attention, "attention_dropout", 0.0) or 0.0),
        compile_flex=compile_flex, head_dim=head_dim, scale=float(attention.scaling),
        q_bias=projs[0].bias is not None, k_bias=projs[1].bias is not None,
        v_bias=projs[2].bias is not None, o_bias=out.bias is not None,
    )
    return _copy_all(ours, [p.weight for p in projs], [p.bias for p in projs], out)


#: MPT ``attn_config`` keys and the only values :func:`from_hf_attention` loads, with why.
_MPT_DEFAULTS = {
    "clip_qkv": (None, "clip_qkv clamps q, k and v: MultiHeadAttention has no clamp"),
    "qk_ln": (False, "qk_ln (a LayerNorm on q and k over the whole width) is not in "
                     "transformers' MptAttention: the loader cannot copy it"),
    "alibi": (True, "alibi=False: transformers' MptModel adds ALiBi anyway"),
    "alibi_bias_max": (8, "transformers' MptModel builds its ALiBi with alibi_bias_max 8 "
                          "whatever the config says"),
    "prefix_lm": (False, "prefix_lm (bidirectional attention over a prefix) is not in "
                         "transformers' MptModel"),
    "attn_uses_sequence_id": (False, "attn_uses_sequence_id is not in transformers' MptModel"),
    "attn_type": ("multihead_attention", "attn_type other than multihead_attention is not in "
                                         "transformers' MptAttention"),
}


def _mpt(attention, cfg, backend, compile_flex, causal):
    family = "MPT"
    attn_cfg = cfg.get("attn_config") or {}
    if not isinstance(attn_cfg, Mapping):
        attn_cfg = _config_dict(attn_cfg)
    for key, (default, why) in _MPT_DEFAULTS.items():
        value = attn_cfg.get(key, default)
        if key == "clip_qkv":  # its code clips where the value is truthy (0 does not clip)
            value = getattr(attention, "clip_qkv", value) or None
        if value != default:
            _refuse(family, f"attn_config {key}={value!r}: {why}")
    qkv, out = _linear(attention, "Wqkv", family), _linear(attention, "out_proj", family)
    n_heads, head_dim = int(attention.n_heads), int(attention.head_dim)
    if qkv.out_features != 3 * n_heads * head_dim:
        _refuse(family, f"Wqkv has {qkv.out_features} rows, not 3 * {n_heads} heads * {head_dim}")
    sizes = [n_heads * head_dim] * 3
    ours = MultiHeadAttention(
        out.out_features, n_heads, ALiBi(n_heads), causal=causal, backend=backend,
        dropout=float(getattr(attention, "attn_dropout_p", 0.0) or 0.0),
        compile_flex=compile_flex, head_dim=head_dim, scale=float(attention.softmax_scale),
        q_bias=qkv.bias is not None, k_bias=qkv.bias is not None,
        v_bias=qkv.bias is not None, o_bias=out.bias is not None,
    )
    bs = [None] * 3 if qkv.bias is None else qkv.bias.split(sizes)
    return _copy_all(ours, qkv.weight.split(sizes), bs, out)
