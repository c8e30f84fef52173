"""Read the RoPE settings of a Hugging Face model config. Chapter 8.

Hugging Face configs describe RoPE in two forms:

* the older one (transformers 4): ``rope_theta`` at the top level and
  ``rope_scaling = None`` or ``{"rope_type": ..., **params}`` (older still:
  ``"type"`` instead of ``"rope_type"``);
* the newer one (transformers 5): ``rope_parameters = {"rope_type": ...,
  "rope_theta": ..., **params}``, or one such dict per layer type, e.g. Gemma 3's
  ``{"full_attention": {...}, "sliding_attention": {...}}``.

:func:`read_rope_config` reads both and returns a :class:`RopeConfig`, the
arguments of :class:`~tutorial_pkg.rope.RotaryEmbedding`. It follows how
transformers 5 interprets the keys (which length is the original one, which
factor sets the attention factor, which defaults apply), and it refuses what
transformers only warns about or silently falls back from: an unknown
``rope_type``, an unknown key, a missing key, or two forms that disagree raise a
``ValueError`` naming the key. The classic failure it prevents: a config renamed
to the new form whose scaling is then read from the old key, finds nothing, and
runs plain RoPE at 128k tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ._checks import check_number
from .rope import scaled_inv_freq

__all__ = ["HF_ROPE_TYPES", "RopeConfig", "read_rope_config"]

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
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
_NEEDS_ORIGINAL = ("yarn", "longrope", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """The RoPE settings read from a model config: the arguments of RotaryEmbedding.

    Attributes:
        head_dim: features per head ``h_d`` (``qk_rope_head_dim`` for DeepSeek's
            decoupled RoPE).
        base: RoPE base (``rope_theta``).
        rotary_dim: features rotated per head, ``int(head_dim * partial_rotary_factor)``.
        layout: ``"half"`` (Hugging Face ``rotate_half``), or ``"interleaved"`` when
            the config says ``rope_interleave`` (DeepSeek-V3's checkpoints).
        scaling: the package's scaling dict (see
            :func:`~tutorial_pkg.rope.scaled_inv_freq`) or ``None``.
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
        """Keyword arguments of :class:`~tutorial_pkg.rope.RotaryEmbedding`."""
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


def read_rope_config(config, *, layer_type: str | None = None) -> RopeConfig:
    """Read the RoPE settings of a Hugging Face model config.

    Args:
        config: the model's ``config.json`` as a dict (or a ``PretrainedConfig``):
            ``rope_theta`` + ``rope_scaling`` (older form, ``"rope_type"`` or the
            legacy ``"type"`` key) or ``rope_parameters`` (newer form, possibly one
            dict per layer type); ``head_dim`` (or ``qk_rope_head_dim``, or
            ``hidden_size`` and ``num_attention_heads``); optional
            ``partial_rotary_factor`` (top level or in the RoPE dict),
            ``max_position_embeddings``, ``original_max_position_embeddings``,
            ``rope_interleave``.
        layer_type: the entry of a per-layer-type ``rope_parameters`` to read
            (required there); for an older-form Gemma 3 config with
            ``rope_local_base_freq``, ``"sliding_attention"`` reads the local base.

    Returns:
        A :class:`RopeConfig`; ``RotaryEmbedding(**cfg.kwargs())`` builds the module.

    Raises:
        ValueError: naming an unknown ``rope_type``, an unknown or missing key, a
            value the rule rejects, or two forms of the config that disagree.
        TypeError: ``config`` is not a dict.
    """
    config = _as_dict(config)
    if layer_type is not None and not isinstance(layer_type, str):
        raise TypeError(f"layer_type must be a str or None, got {type(layer_type).__name__}")
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
        scaling = {"type": "dynamic", "factor": rope["factor"], "original_max_position": max_pos}
    elif rope_type == "yarn":
        scaling = {"type": "yarn", "factor": rope["factor"], "original_max_position": original,
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
                   "long_factor": list(rope["long_factor"]), "original_max_position": original,
                   "factor": factor}
        if rope.get("attention_factor") is not None:
            scaling["attention_factor"] = rope["attention_factor"]
    elif rope_type == "llama3":
        scaling = {"type": "llama3", "factor": rope["factor"],
                   "low_freq_factor": rope["low_freq_factor"],
                   "high_freq_factor": rope["high_freq_factor"], "original_max_position": original}
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"the rotary dimension int(head_dim * partial_rotary_factor) = "
                         f"{rotary_dim} must be even and >= 2 (head_dim={head_dim}, "
                         f"partial_rotary_factor={prf})")
    scaled_inv_freq(rotary_dim, base, scaling)  # the rule checks its values now, not later
    layout = "interleaved" if config.get("rope_interleave") is True else "half"
    return RopeConfig(head_dim=head_dim, base=base, rotary_dim=rotary_dim, layout=layout,
                      scaling=scaling, p_rope=p_rope, rope_type=rope_type,
                      max_position_embeddings=max_pos)
