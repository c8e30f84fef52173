"""Read the RoPE settings of a Hugging Face model config. Chapter 8.

Hugging Face configs describe RoPE in two forms:

* the older one (transformers 4): ``rope_theta`` at the top level and
  ``rope_scaling = None`` or ``{"rope_type": ..., **params}`` (older still:
  ``"type"`` instead of ``"rope_type"``);
* the newer one (transformers 5): ``rope_parameters = {"rope_type": ...,
  "rope_theta": ..., **params}``, or one such dict per layer type, e.g. Gemma 3's
  ``{"full_attention": {...}, "sliding_attention": {...}}``.

:func:`read_rope_config` reads both and returns a :class:`RopeConfig`, the
arguments of :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding`. It follows how
transformers 5 interprets the keys (which length is the original one, which
factor sets the attention factor, which defaults apply), and it refuses what
transformers only warns about or silently falls back from: an unknown
``rope_type``, an unknown key, a missing key, or two forms that disagree raise a
``ValueError`` naming the key. The classic failure it prevents: a config renamed
to the new form whose scaling is then read from the old key, finds nothing, and
runs plain RoPE at 128k tokens.

**The pair layout is never guessed.** Most configs do not say whether the checkpoint
rotates the halves ``(x[i], x[i + r/2])`` (``rotate_half``) or adjacent pairs
``(x[2i], x[2i + 1])``: the family's modeling code decides, and reading the wrong one
gives other attention scores with no error (Llama 4 rotates adjacent pairs, Llama 3
halves, with the same keys). :func:`read_rope_config` takes the layout from, in turn:

1. its ``layout=`` argument (``"half"`` or ``"interleaved"``), which overrides the rest;
2. the config's ``rope_interleave`` (DeepSeek-V3 and the families that read it);
3. the config's ``model_type`` in :data:`FAMILY_LAYOUTS` (each entry checked against
   transformers 5.24's ``modeling_<family>.py``).

Where none of them decides (a ``model_type`` it does not know, or a dict without
``model_type``: every ``config.json`` has one), it raises ``ValueError`` naming
``layout`` and ``model_type``.

**Family rules** a config does not state either: GPT-J's code hard-codes the base
10000 and rotates ``rotary_dim`` features (its key, a count, not a fraction) of
``n_embd // n_head``; Gemma 4 gives its global layers their own ``head_dim``: in a
``config.json`` as ``global_head_dim`` (512 where absent, as ``Gemma4TextConfig`` reads it),
in ``config.to_dict()`` as ``per_layer_config`` (layer index -> overrides); either is read
for the ``layer_type`` asked for, as transformers' ``config.per_layer_config[layer_type]``
is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .._checks import check_choice, check_number
from .rope_scaling import scaled_inv_freq

__all__ = ["LAYOUTS", "FAMILY_LAYOUTS", "HF_ROPE_TYPES", "RopeConfig", "read_rope_config"]

#: The two RoPE pair layouts, ``"half"`` (Hugging Face ``rotate_half``, pairs
#: ``(x[i], x[i + r/2])``) and ``"interleaved"`` (Meta's complex form, pairs
#: ``(x[2i], x[2i + 1])``). Defined here, below :mod:`tutorial_pkg.encodings.rope` (which
#: re-exports it), because reading a config must name the layout too.
LAYOUTS = ("half", "interleaved")

#: The Hugging Face ``rope_type`` values :func:`read_rope_config` reads, each with
#: its required and optional keys (besides ``rope_type``/``type``, ``rope_theta``
#: and ``partial_rotary_factor``, allowed everywhere). ``original_max_position_embeddings``
#: falls back as in transformers (top-level key, then ``max_position_embeddings``).
HF_ROPE_TYPES: dict[str, tuple[frozenset, frozenset]] = {
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor"}), frozenset()),
    "yarn": (
        frozenset({"factor"}),
        frozenset({"original_max_position_embeddings", "attention_factor", "beta_fast",
                   "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    ),
    "longrope": (
        frozenset({"short_factor", "long_factor"}),
        frozenset({"original_max_position_embeddings", "attention_factor", "factor"}),
    ),
    "llama3": (
        frozenset({"factor", "low_freq_factor", "high_freq_factor"}),
        frozenset({"original_max_position_embeddings"}),
    ),
    "proportional": (frozenset(), frozenset({"factor"})),
}
#: ``model_type`` -> the RoPE pair layout of the family's checkpoints, as its
#: transformers 5.24 ``modeling_<family>.py`` applies it: ``"half"`` where
#: ``apply_rotary_pos_emb`` uses ``rotate_half`` (first/second halves; GPT-OSS's
#: ``_apply_rotary_emb`` chunks the halves too), ``"interleaved"`` where it rotates
#: adjacent pairs (Llama 4 and DeepSeek-V2: ``view_as_complex`` on ``reshape(..., -1, 2)``;
#: GPT-J: ``rotate_every_two``). DeepSeek-V3 reads ``rope_interleave`` (default True in
#: ``DeepseekV3Config``, absent from its ``config.json``): the entry is that default. A
#: family not listed is refused (pass ``layout=``); Cohere, GLM and Helium, for example,
#: define a ``rotate_half`` that rotates adjacent pairs, so a name is no guide.
FAMILY_LAYOUTS: dict[str, str] = {
    **dict.fromkeys((
        "llama", "mistral", "mixtral", "ministral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
        "qwen3_next",
        "gemma", "gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "phi", "phi3",
        "phimoe", "gpt_neox", "smollm3", "gpt_oss", "starcoder2", "olmo", "olmo2", "olmoe",
        "granite", "stablelm", "falcon",
    ), "half"),
    **dict.fromkeys(("llama4", "llama4_text", "gptj", "deepseek_v2", "deepseek_v3"),
                    "interleaved"),
}
#: Families whose code reads ``config.rope_interleave`` (the key decides their layout).
_READS_INTERLEAVE = frozenset({"deepseek_v3"})
#: Keys of a ``per_layer_config`` override that change a layer's RoPE.
_ROPE_LAYER_KEYS = frozenset({"head_dim", "qk_rope_head_dim", "hidden_size",
                              "num_attention_heads", "partial_rotary_factor", "rope_theta",
                              "rope_scaling", "rope_parameters", "rope_interleave"})
_LAYOUT_HELP = ("layout='half' (rotate_half, pairs (x[i], x[i + r/2]): Llama 3, Qwen, Mistral, "
                "Gemma) or layout='interleaved' (adjacent pairs (x[2i], x[2i + 1]): Llama 4, "
                "GPT-J, Meta's code)")
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
_NEEDS_ORIGINAL = ("yarn", "longrope", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """The RoPE settings read from a model config: the arguments of RotaryEmbedding.

    Attributes:
        head_dim: features per head ``d`` (``qk_rope_head_dim`` for DeepSeek's
            decoupled RoPE).
        base: RoPE base (``rope_theta``).
        rotary_dim: features rotated per head, ``int(head_dim * partial_rotary_factor)``.
        layout: ``"half"`` (Hugging Face ``rotate_half``) or ``"interleaved"``
            (adjacent pairs): the ``layout=`` argument, else ``rope_interleave``, else
            the family's (:data:`FAMILY_LAYOUTS`); never a default.
        scaling: the package's scaling dict (see
            :func:`~tutorial_pkg.encodings.rope_scaling.scaled_inv_freq`) or ``None``.
        p_rope: the fraction of frequencies that rotate (``"proportional"``), or None.
        rope_type: the Hugging Face ``rope_type`` that was read.
        max_position_embeddings: the config's value, or None if absent.
    """

    head_dim: int
    base: float
    rotary_dim: int
    layout: str = "half"
    scaling: dict | None = None
    p_rope: float | None = None
    rope_type: str = "default"
    max_position_embeddings: int | None = None

    def kwargs(self) -> dict:
        """Keyword arguments of :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding`."""
        return {"head_dim": self.head_dim, "base": self.base, "rotary_dim": self.rotary_dim,
                "layout": self.layout, "scaling": self.scaling, "p_rope": self.p_rope}


def _as_dict(config) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):  # a transformers PretrainedConfig
        return dict(config.to_dict())
    raise TypeError(f"config must be a dict (config.json) or have to_dict(), "
                    f"got {type(config).__name__}")


def _int_key(config: dict, key: str) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config[{key!r}] must be a positive int, got {value!r}")
    return value


def _head_dim(config: dict) -> int:
    for key in ("qk_rope_head_dim", "head_dim"):
        if config.get(key) is not None:
            return _int_key(config, key)
    missing = [k for k in ("hidden_size", "num_attention_heads") if config.get(k) is None]
    if missing:
        raise ValueError(f"config has no head_dim and no {missing[0]!r} to derive it "
                         f"(head_dim = hidden_size // num_attention_heads)")
    hidden, heads = _int_key(config, "hidden_size"), _int_key(config, "num_attention_heads")
    if hidden % heads:
        raise ValueError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    return hidden // heads


def _rope_dict(config: dict, layer_type: str | None) -> tuple[dict, bool]:
    """The one RoPE dict for ``layer_type`` with ``rope_theta`` in it; whether it was nested."""
    old, new = config.get("rope_scaling"), config.get("rope_parameters")
    if old is not None and new is not None and old != new:
        raise ValueError("config has both 'rope_scaling' (older form) and 'rope_parameters' "
                         "(newer form) and they differ: keep one")
    if new is None:  # older form
        if old is not None and not isinstance(old, Mapping):
            raise ValueError(f"config['rope_scaling'] must be a dict or None, got {old!r}")
        rope = dict(old or {"rope_type": "default"})
        local = config.get("rope_local_base_freq")
        if layer_type is not None and local is not None:  # Gemma 3 before transformers 5
            if layer_type == "sliding_attention":
                return {"rope_type": "default", "rope_theta": local}, True
            if layer_type != "full_attention":
                raise ValueError(f"layer_type must be 'full_attention' or 'sliding_attention' "
                                 f"for a config with rope_local_base_freq, got {layer_type!r}")
        if "rope_theta" in rope and config.get("rope_theta") is not None and (
            rope["rope_theta"] != config["rope_theta"]
        ):
            raise ValueError("config['rope_theta'] and config['rope_scaling']['rope_theta'] differ")
        if "rope_theta" not in rope:
            if config.get("rope_theta") is None:
                raise ValueError("config has no 'rope_theta' (nor 'rope_parameters'): the RoPE "
                                 "base is missing")
            rope["rope_theta"] = config["rope_theta"]
        return rope, False
    if not isinstance(new, Mapping):
        raise ValueError(f"config['rope_parameters'] must be a dict, got {new!r}")
    nested = bool(new) and any(isinstance(v, Mapping) or v is None for v in new.values())
    if nested:
        if layer_type is None:
            raise ValueError(f"config['rope_parameters'] has one entry per layer type "
                             f"{sorted(new)}: pass layer_type")
        if layer_type not in new:
            raise ValueError(f"layer_type {layer_type!r} is not in config['rope_parameters'] "
                             f"(it has {sorted(new)})")
        rope = new[layer_type]
        if rope is None:
            raise ValueError(f"config['rope_parameters'][{layer_type!r}] is None: that layer "
                             f"type uses no RoPE")
        if not isinstance(rope, Mapping):
            raise ValueError(f"config['rope_parameters'][{layer_type!r}] must be a dict")
        rope = dict(rope)
    else:
        rope = dict(new)
    top = config.get("rope_theta")
    if "rope_theta" in rope and top is not None and rope["rope_theta"] != top:
        raise ValueError("config['rope_theta'] and the rope_theta in config['rope_parameters'] "
                         "differ")
    if "rope_theta" not in rope:
        if top is None:
            raise ValueError("config['rope_parameters'] has no 'rope_theta' (nor the config): "
                             "the RoPE base is missing")
        rope["rope_theta"] = top
    return rope, nested


def _gemma4_file_form(config: dict, layer_type: str | None) -> dict:
    """A Gemma 4 ``config.json`` read as ``Gemma4TextConfig`` reads it.

    A file without ``per_layer_config`` states the global layers' head size as
    ``global_head_dim`` (the key ``Gemma4TextConfig`` takes); the class makes it (512 where
    absent) the ``head_dim`` of every ``full_attention`` layer, and ignores it where
    ``per_layer_config`` is given. Other families have no such key: there it is refused, not
    dropped.
    """
    if config.get("model_type") != "gemma4_text":
        if config.get("global_head_dim") is not None:
            raise ValueError(f"config['global_head_dim'] is Gemma 4's key (model_type "
                             f"'gemma4_text'), but model_type is {config.get('model_type')!r}: "
                             f"which layers take that head size is unknown")
        return config
    if config.get("per_layer_config") is not None:
        return config
    global_head = config.get("global_head_dim", 512)  # Gemma4TextConfig's default
    if layer_type == "full_attention":
        return {**config, "head_dim": global_head}
    if layer_type is None and global_head != _head_dim(config):
        raise ValueError(f"a Gemma 4 config gives its full_attention layers head_dim "
                         f"{global_head} (global_head_dim, 512 where absent) "
                         f"and the others {_head_dim(config)}: pass layer_type")
    return config


def _layer_overrides(config: dict, layer_type: str | None) -> dict:
    """``config`` with the ``per_layer_config`` overrides of ``layer_type``'s layers on top
    (transformers' ``config.per_layer_config[layer_type]``: every layer of that type must
    have the same overrides)."""
    config = _gemma4_file_form(config, layer_type)
    overrides = config.get("per_layer_config")
    if not overrides:
        return config
    if not isinstance(overrides, Mapping) or not all(
        isinstance(v, Mapping) for v in overrides.values()
    ):
        raise ValueError("config['per_layer_config'] must map layer indices to dicts of "
                         "overrides")
    if layer_type is None:
        keys = sorted({k for o in overrides.values() for k in o} & _ROPE_LAYER_KEYS)
        if keys:
            raise ValueError(f"config['per_layer_config'] overrides {keys} for some layers: "
                             f"pass layer_type")
        return config
    types = config.get("layer_types")
    if not types or layer_type not in types:
        raise ValueError(f"layer_type {layer_type!r} is not in config['layer_types'] "
                         f"({types!r}), which config['per_layer_config'] needs")
    try:  # to_dict() writes the indices as zero-padded strings ("05")
        by_index = {int(i): v for i, v in overrides.items()}
    except (TypeError, ValueError):
        raise ValueError(f"config['per_layer_config'] keys must be layer indices, got "
                         f"{sorted(map(str, overrides))}") from None
    chosen = [by_index.get(i, {}) for i, t in enumerate(types) if t == layer_type]
    if any(c != chosen[0] for c in chosen):
        raise ValueError(f"the layers of type {layer_type!r} have different overrides in "
                         f"config['per_layer_config']: not one RoPE for the layer type")
    return {**config, **chosen[0]}


def _gptj(config: dict) -> tuple[dict, int]:
    """GPT-J's keys as the reader's (``n_embd``, ``n_head``, ``n_positions``; the base 10000
    its code hard-codes), and its ``rotary_dim`` (a count of features per head)."""
    for key in ("n_embd", "n_head", "rotary_dim"):
        if config.get(key) is None:
            raise ValueError(f"a GPT-J config (model_type 'gptj') needs {key!r}"
                             + (": with rotary_dim None its code builds tables of n_embd "
                                "features, not of one head's" if key == "rotary_dim" else ""))
    out = {**config, "hidden_size": _int_key(config, "n_embd"),
           "num_attention_heads": _int_key(config, "n_head")}
    if config.get("n_positions") is not None and config.get("max_position_embeddings") is None:
        out["max_position_embeddings"] = config["n_positions"]
    if config.get("rope_theta") is None and config.get("rope_parameters") is None:
        out["rope_theta"] = 10000.0  # create_sinusoidal_positions in modeling_gptj.py
    return out, _int_key(config, "rotary_dim")


def _layout(config: dict, layout: str | None) -> str:
    """The pair layout: ``layout``, else ``rope_interleave``, else the family's; never a guess."""
    if layout is not None:
        return check_choice("layout", layout, LAYOUTS)
    model_type = config.get("model_type")
    known = FAMILY_LAYOUTS.get(model_type) if isinstance(model_type, str) else None
    interleave = config.get("rope_interleave")
    if interleave is not None:
        if not isinstance(interleave, bool):
            raise ValueError(f"config['rope_interleave'] must be a bool, got {interleave!r}")
        said = "interleaved" if interleave else "half"
        if known is not None and model_type not in _READS_INTERLEAVE and known != said:
            raise ValueError(f"config['rope_interleave'] is {interleave} but the code of "
                             f"model_type {model_type!r} ignores that key and rotates the "
                             f"{known!r} layout: remove the key, or pass layout=")
        return said
    if known is not None:
        return known
    if model_type is None:
        raise ValueError("the config has no 'model_type' (every config.json has one) and no "
                         "'rope_interleave', so the RoPE pair layout is unknown: add the "
                         f"model_type, or pass {_LAYOUT_HELP}")
    raise ValueError(f"read_rope_config does not know the RoPE pair layout of model_type "
                     f"{model_type!r} (FAMILY_LAYOUTS lists the families it knows): read the "
                     f"family's apply_rotary_pos_emb and pass {_LAYOUT_HELP}")


def read_rope_config(config, *, layer_type: str | None = None,
                     layout: str | None = None) -> RopeConfig:
    """Read the RoPE settings of a Hugging Face model config.

    Args:
        config: the model's ``config.json`` as a dict (or a ``PretrainedConfig``):
            ``rope_theta`` + ``rope_scaling`` (older form, ``"rope_type"`` or the
            legacy ``"type"`` key) or ``rope_parameters`` (newer form, possibly one
            dict per layer type); ``head_dim`` (or ``qk_rope_head_dim``, or
            ``hidden_size`` and ``num_attention_heads``); optional
            ``partial_rotary_factor`` (top level or in the RoPE dict),
            ``max_position_embeddings``, ``original_max_position_embeddings``,
            ``rope_interleave``; ``model_type`` for the pair layout (see the module
            docs) and the family rules (GPT-J, ``per_layer_config``).
        layer_type: the entry of a per-layer-type ``rope_parameters`` to read
            (required there), and the layer type whose ``per_layer_config``
            overrides apply (Gemma 4's global ``head_dim``); for an older-form Gemma 3
            config with ``rope_local_base_freq``, ``"sliding_attention"`` reads the
            local base.
        layout: ``"half"`` or ``"interleaved"``: the checkpoint's pair layout, over
            what the config says. Required where the config's family is unknown
            (:data:`FAMILY_LAYOUTS`) and it has no ``rope_interleave``.

    Returns:
        A :class:`RopeConfig`; ``RotaryEmbedding(**cfg.kwargs())`` builds the module.

    Raises:
        ValueError: naming an unknown ``rope_type``, an unknown or missing key, a
            value the rule rejects, two forms of the config that disagree, or
            ``layout`` and ``model_type`` where the pair layout is unknown.
        TypeError: ``config`` is not a dict.
    """
    config = _as_dict(config)
    if layer_type is not None and not isinstance(layer_type, str):
        raise TypeError(f"layer_type must be a str or None, got {type(layer_type).__name__}")
    config = _layer_overrides(config, layer_type)
    fixed_rotary = None
    if config.get("model_type") == "gptj":
        config, fixed_rotary = _gptj(config)
    rope, nested = _rope_dict(config, layer_type)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if "type" in rope and "rope_type" in rope and rope["type"] != rope["rope_type"]:
        raise ValueError(f"the RoPE dict has 'type'={rope['type']!r} and "
                         f"'rope_type'={rope['rope_type']!r}: keep one")
    if rope_type not in HF_ROPE_TYPES:
        raise ValueError(f"unknown rope_type {rope_type!r}; this reader knows "
                         f"{sorted(HF_ROPE_TYPES)}")
    required, optional = HF_ROPE_TYPES[rope_type]
    unknown = set(rope) - required - optional - _COMMON_KEYS
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)} for rope_type {rope_type!r} "
                         f"(it takes {sorted(required | optional)})")
    missing = required - {k for k, v in rope.items() if v is not None}
    if missing:
        raise ValueError(f"missing key(s) {sorted(missing)} for rope_type {rope_type!r}")

    base = check_number("rope_theta", rope["rope_theta"])
    head_dim = _head_dim(config)
    prf = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    prf = 1.0 if prf is None else check_number("partial_rotary_factor", prf)
    if not 0 < prf <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {prf}")
    max_pos = config.get("max_position_embeddings")
    if max_pos is not None:
        max_pos = _int_key(config, "max_position_embeddings")

    original = None
    if rope_type in _NEEDS_ORIGINAL:  # as transformers' standardize_rope_params
        if not nested and config.get("original_max_position_embeddings") is not None:
            original = config["original_max_position_embeddings"]  # Phi-3: top level wins
        elif rope.get("original_max_position_embeddings") is not None:
            original = rope["original_max_position_embeddings"]
        elif max_pos is not None:
            original = max_pos
        else:
            raise ValueError(f"missing key 'original_max_position_embeddings' (or "
                             f"'max_position_embeddings') for rope_type {rope_type!r}")
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise ValueError(f"original_max_position_embeddings must be a positive int, "
                             f"got {original!r}")

    rotary_dim, p_rope, scaling = int(head_dim * prf), None, None
    if fixed_rotary is not None:  # GPT-J: rotary_dim features per head, not a fraction
        if fixed_rotary > head_dim:
            raise ValueError(f"config['rotary_dim']={fixed_rotary} exceeds head_dim={head_dim}")
        rotary_dim = fixed_rotary
    if rope_type == "proportional":  # p-RoPE: all pairs kept, the lowest ones at frequency 0
        rotary_dim, p_rope = head_dim, prf
        if rope.get("factor") not in (None, 1, 1.0):
            scaling = {"type": "linear", "factor": rope["factor"]}
    elif rope_type == "linear":
        scaling = {"type": "linear", "factor": rope["factor"]}
    elif rope_type == "dynamic":
        if max_pos is None:
            raise ValueError("missing key 'max_position_embeddings' (the length past which "
                             "dynamic NTK grows the base)")
        scaling = {"type": "dynamic", "factor": rope["factor"],
                   "original_max_position_embeddings": max_pos}
    elif rope_type == "yarn":
        scaling = {"type": "yarn", "factor": rope["factor"],
                   "original_max_position_embeddings": original,
                   "beta_fast": rope.get("beta_fast") or 32.0,
                   "beta_slow": rope.get("beta_slow") or 1.0,
                   "truncate": rope.get("truncate", True)}
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if rope.get(key) is not None:
                scaling[key] = rope[key]
    elif rope_type == "longrope":
        factor = rope.get("factor")
        if factor is None:
            if max_pos is None:
                raise ValueError("missing key 'factor' (or 'max_position_embeddings') for "
                                 "rope_type 'longrope'")
            factor = max_pos / original
        scaling = {"type": "longrope", "short_factor": list(rope["short_factor"]),
                   "long_factor": list(rope["long_factor"]),
                   "original_max_position_embeddings": original, "factor": factor}
        if rope.get("attention_factor") is not None:
            scaling["attention_factor"] = rope["attention_factor"]
    elif rope_type == "llama3":
        scaling = {"type": "llama3", "factor": rope["factor"],
                   "low_freq_factor": rope["low_freq_factor"],
                   "high_freq_factor": rope["high_freq_factor"],
                   "original_max_position_embeddings": original}
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"the rotary dimension int(head_dim * partial_rotary_factor) = "
                         f"{rotary_dim} must be even and >= 2 (head_dim={head_dim}, "
                         f"partial_rotary_factor={prf})")
    scaled_inv_freq(rotary_dim, base, scaling)  # the rule checks its values now, not later
    layout = _layout(config, layout)
    return RopeConfig(head_dim=head_dim, base=base, rotary_dim=rotary_dim, layout=layout,
                      scaling=scaling, p_rope=p_rope, rope_type=rope_type,
                      max_position_embeddings=max_pos)
