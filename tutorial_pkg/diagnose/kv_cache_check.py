"""Does your model decode through its KV cache as it runs in one pass? Chapter 9.

:func:`check_kv_cache` decodes token by token and in left-padded batches and compares
every output with one full forward pass. An adapter says how your model is called:
:class:`TutorialAdapter` (this package's convention), :class:`HFAdapter` (Hugging
Face's), or your own object with the same three methods, which reproduces your
decoding loop. Re-exported by :mod:`tutorial_pkg.diagnose`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .._checks import (
    check_callable,
    check_choice,
    check_ids_or_features,
    check_int_in_range,
    check_positive_float,
    check_positive_int,
)
from ..attention.positions import positions_from_padding
from .reports import Report, first_true, measured

__all__ = ["TutorialAdapter", "HFAdapter", "KVCacheReport", "check_kv_cache"]


class TutorialAdapter:
    """The cache convention of this package, for :func:`check_kv_cache`.

    A model with ``new_caches()`` (:class:`~tutorial_pkg.models.tiny_lm.TinyLM`) is called as
    ``model(ids, positions=, caches=, key_padding_mask=)``; any other module
    (:class:`~tutorial_pkg.attention.layer.MultiHeadAttention`,
    :class:`~tutorial_pkg.attention.layer.TransformerBlock`) as
    ``model(x, positions=, kv_cache=, key_padding_mask=)`` with one
    :class:`~tutorial_pkg.attention.layer.KVCache`.

    An adapter has three methods, which your own adapter (any object with them) can
    override to reproduce your decoding loop: ``start()`` returns an empty cache;
    ``full(inputs, positions, padding)`` returns the outputs ``[b, s, ...]`` of one
    pass without cache; ``step(chunk, positions, padding, cache)`` returns
    ``(outputs, cache)`` for new tokens. ``positions`` are the correct ``[b, s]``
    positions, ``padding`` is ``None`` or a bool ``[b, L]`` (``True`` = padding) over
    every token so far.

    Args:
        model: the model.
        pass_positions: give the model ``positions`` (``False``: let it derive them
            from the cache, as a loop that ignores padding does).
    """

    def __init__(self, model, *, pass_positions: bool = True) -> None:
        check_callable("model", model)
        self.model, self.pass_positions = model, bool(pass_positions)

    def start(self):
        from ..attention.layer import KVCache

        return self.model.new_caches() if hasattr(self.model, "new_caches") else KVCache()

    def _call(self, inputs, positions, padding, cache):
        key = "caches" if hasattr(self.model, "new_caches") else "kv_cache"
        kw = {key: cache} if cache is not None else {}
        return self.model(inputs, positions=positions if self.pass_positions else None,
                          key_padding_mask=padding, **kw)

    def full(self, inputs, positions, padding):
        return self._call(inputs, positions, padding, None)

    def step(self, chunk, positions, padding, cache):
        return self._call(chunk, positions, padding, cache), cache


class HFAdapter(TutorialAdapter):
    """The Hugging Face convention, for :func:`check_kv_cache`.

    A transformers causal LM (or any callable with its signature): each decoding step
    is ``model(input_ids, position_ids=, cache=, use_cache=True, attention_mask=)``
    (``inputs_embeds=`` for float inputs); the full pass has ``use_cache=False``. The
    cache is asked for explicitly, so a model whose config says ``use_cache=False``
    (MPT's) still decodes through one. :meth:`start` returns an empty
    ``transformers.DynamicCache`` built from ``model.config`` (transformers is imported
    there, when a check runs, never by this module), or ``None`` for a model without a
    ``config`` or where transformers is not installed (the model then makes its own).
    The cache argument is named as the model's ``forward`` names it: ``cache``
    (transformers >= 5.24) or ``past_key_values`` (earlier; 5.24 still accepts it,
    with a deprecation warning);
    the cache comes back as the output's ``.cache`` (``.past_key_values`` before),
    or as the second item of a tuple ``(logits, cache)``. ``attention_mask`` is ``1``
    for real tokens, over past and new tokens, and only passed with padding.
    """

    def start(self):
        config = getattr(self.model, "config", None)
        if config is None:  # not a transformers model: it makes its own cache
            return None
        try:
            from transformers import DynamicCache
        except ImportError:  # a model of this convention without transformers
            return None
        return DynamicCache(config=config)

    def _params(self):
        import inspect

        fn = getattr(self.model, "forward", self.model)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # no signature to read: the current names
            return {"cache", "use_cache"}, True
        any_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        return set(params), any_kw

    def _run(self, inputs, positions, padding, cache, use_cache):
        names, any_kw = self._params()
        cache_name = "past_key_values" if (
            "cache" not in names and "past_key_values" in names) else "cache"
        kw = {"inputs_embeds" if inputs.is_floating_point() else "input_ids": inputs,
              "position_ids": positions if self.pass_positions else None}
        if use_cache or cache is not None:
            kw[cache_name] = cache
        if "use_cache" in names or any_kw:
            kw["use_cache"] = use_cache
        if padding is not None:
            kw["attention_mask"] = (~padding).long()
        out = self.model(**kw)
        if isinstance(out, tuple):
            return out[0], (out[1] if len(out) > 1 else None)
        fields = getattr(out, "__dataclass_fields__", None) or {}
        name = "cache" if "cache" in fields or not fields and hasattr(out, "cache") else (
            "past_key_values")
        return out.logits, getattr(out, name, None)

    def full(self, inputs, positions, padding):
        return self._run(inputs, positions, padding, None, False)[0]

    def step(self, chunk, positions, padding, cache):
        out, cache = self._run(chunk, positions, padding, cache, True)
        if cache is None:
            raise ValueError("the model returned no cache from a step with use_cache=True: "
                             "it cannot decode through a cache (write an adapter for its "
                             "loop, see TutorialAdapter)")
        return out, cache


@dataclass(repr=False)
class KVCacheReport(Report):
    """What :func:`check_kv_cache` measured.

    Attributes:
        scenarios: name -> ``(first differing position or None, max |difference|)``;
            positions count the real tokens of a row (padding excluded).
        problems: what is wrong, in words.
        atol: the absolute tolerance of the comparison.
        rtol: its relative tolerance.
    """

    scenarios: dict
    problems: list = field(default_factory=list)
    atol: float | None = None
    rtol: float | None = None

    def _lines(self):
        head = ([] if self.atol is None else
                [f"compared with one full pass, within atol {self.atol:g} + rtol {self.rtol:g}:"])
        return head + [f"{name:<28s} " + ("same" if first is None else
                                          f"differs from position {first} (max |diff| "
                                          f"{measured(err)})")
                       for name, (first, err) in self.scenarios.items()]


def _first_difference(got, want, atol, rtol, offset=None):
    """``(first differing position or None, max |got - want|)`` of outputs ``[b, s, ...]``;
    row ``i`` of ``got`` is shifted right by ``offset[i]`` (its left padding)."""
    b, s = want.shape[:2]
    bad = torch.zeros(s, dtype=torch.bool)
    worst = 0.0
    for i in range(b):
        p = 0 if offset is None else offset[i]
        g, w = got[i, p:].double(), want[i, : s - p].double()
        diff = (g - w).abs().reshape(s - p, -1).nan_to_num(math.inf)
        limit = atol + rtol * w.abs().reshape(s - p, -1)
        bad[: s - p] |= (diff > limit).any(-1)
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    return first_true(bad), worst


def _decode(adapter, x, positions, padding, prefill):
    """Outputs of ``prefill`` tokens, then one token per step, through one cache."""
    s = x.shape[1]
    cache, outs, t = adapter.start(), [], 0
    while t < s:
        c = prefill if t == 0 else 1
        pad = None if padding is None else padding[:, : t + c]
        out, cache = adapter.step(x[:, t : t + c], positions[:, t : t + c], pad, cache)
        outs.append(out)
        t += c
    return torch.cat(outs, dim=1)


def _left_padded(inputs, n_pad, pad_value):
    """Every even row shifted right by ``n_pad`` padding tokens (its last ``n_pad`` tokens
    dropped): ``(padded, padding [b, s] bool, offset per row)``."""
    b, s = inputs.shape[:2]
    offset = [n_pad if i % 2 == 0 else 0 for i in range(b)]
    padded = inputs.clone()
    padding = torch.zeros(b, s, dtype=torch.bool, device=inputs.device)
    for i, p in enumerate(offset):
        if p:
            padded[i, p:] = inputs[i, : s - p]
            padded[i, :p] = pad_value
            padding[i, :p] = True
    return padded, padding, offset


def check_kv_cache(
    model,
    inputs: torch.Tensor,
    *,
    convention: str = "tutorial",
    n_pad: int = 3,
    prefill: int = 1,
    pad_value: int = 0,
    atol: float = 1e-4,
    rtol: float = 1e-3,
) -> KVCacheReport:
    """Token-by-token decoding and left-padded batches against one full forward pass.

    The reference is one pass over ``inputs`` without cache or padding. Then:
    decoding (``prefill`` tokens, then one at a time, through the cache) must give
    the same outputs; so must a left-padded batch (every even row gets ``n_pad``
    padding tokens on the left and loses its last ``n_pad`` tokens; odd rows stay
    unpadded), in one pass and decoded. The model must be causal (an output depends
    on earlier tokens only). Runs under ``torch.no_grad()``; call ``model.eval()``
    first if it has dropout.

    Args:
        model: the model, or an adapter (any object with ``start``, ``full`` and
            ``step``, see :class:`TutorialAdapter`) that describes your decoding loop.
        inputs: ``[b, s]`` token ids or ``[b, s, d]`` features.
        convention: ``"tutorial"`` (:class:`TutorialAdapter`) or ``"hf"``
            (:class:`HFAdapter`), when ``model`` is not an adapter.
        n_pad: padding tokens (0: skip the padded scenarios); must be < ``s``.
        prefill: tokens of the first decoding call.
        pad_value: the padding token id (zeros for features).
        atol, rtol: tolerances of the comparison.

    Returns:
        A :class:`KVCacheReport`.

    Raises:
        TypeError: ``inputs`` is not ``[b, s]`` ids or ``[b, s, d]`` features, ``model``
            not callable.
        ValueError: an argument out of range (naming it), an unknown ``convention``, or
            outputs that are not ``[b, s, ...]``.
    """
    adapters = {"tutorial": TutorialAdapter, "hf": HFAdapter}
    if all(hasattr(model, a) for a in ("start", "full", "step")):
        adapter = model
    else:
        adapter = adapters[check_choice("convention", convention, adapters)](model)
    check_ids_or_features("inputs", inputs)
    b, s = inputs.shape[:2]
    check_int_in_range("n_pad", n_pad, 0, s, high_name="s")
    if check_positive_int("prefill", prefill) > s:
        raise ValueError(f"prefill must be <= s={s}, got {prefill}")
    check_positive_float("atol", atol)
    check_positive_float("rtol", rtol)
    scenarios, problems = {}, []
    arange = torch.arange(s, device=inputs.device)[None].expand(b, s)
    with torch.no_grad():
        ref = adapter.full(inputs, arange, None)
        if not isinstance(ref, torch.Tensor) or tuple(ref.shape[:2]) != (b, s):
            raise ValueError(f"model must return outputs [b={b}, s={s}, ...], got "
                             f"{getattr(ref, 'shape', type(ref).__name__)}")
        if not torch.isfinite(ref).all():
            problems.append("the full pass returns non-finite values")

        def compare(name, got, offset=None):  # against the full unpadded pass
            first, worst = _first_difference(got, ref, atol, rtol, offset)
            scenarios[name] = (first, worst)
            if first is not None:
                problems.append(f"{name}: outputs differ from the full unpadded pass from "
                                f"position {first}")

        compare("decode", _decode(adapter, inputs, arange, None, prefill))
        if n_pad:
            padded, padding, offset = _left_padded(inputs, n_pad, pad_value)
            positions = positions_from_padding(padding)
            compare("left padding, one pass", adapter.full(padded, positions, padding), offset)
            compare("left padding, decode", _decode(adapter, padded, positions, padding,
                                                    prefill), offset)
    return KVCacheReport(scenarios, problems, atol, rtol)
