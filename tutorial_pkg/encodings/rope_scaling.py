"""RoPE context-extension rules: every ``rope_type`` of Hugging Face, as formulas. Chapter 8.

Each rule turns the RoPE frequencies ``theta_j = base ** (-2j / dim)``,
``j = 0 .. dim/2 - 1``, into new ones for a longer context, and returns the
*attention factor* that multiplies ``cos`` and ``sin`` (so every score
``q . k`` by its square), as Hugging Face's ``ROPE_INIT_FUNCTIONS`` do:

==============  =====================  ===============================================
package name    Hugging Face name      what it changes
==============  =====================  ===============================================
``"none"``      ``"default"``          nothing
``"linear"``    ``"linear"``           every frequency divided by ``factor`` (PI)
``"ntk"``       (none)                 a fixed base ``base * factor ** (dim/(dim-2))``
``"dynamic"``   ``"dynamic"``          that base change, grown with the current length
``"yarn"``      ``"yarn"``             low frequencies / ``factor``, a ramp, a temperature
``"longrope"``  ``"longrope"``         one searched factor per frequency (short / long)
``"llama3"``    ``"llama3"``           low frequencies / ``factor``, a smooth band
==============  =====================  ===============================================

Every rule has the signature ``rule(dim, base, *, <parameters>, device=None) ->
(inv_freq, attention_factor)`` with ``inv_freq`` float32 ``(dim // 2,)``. Rules
whose result depends on the current sequence length (``dynamic``, ``longrope``)
take a keyword ``seq_len`` too (``None``: the original length);
:class:`~tutorial_pkg.encodings.rope.RotaryEmbedding` passes it. The rules compute in
float64 and round once to float32.

:func:`p_rope_inv_freq` is not a context extension but a change of the encoding
itself (p-RoPE, Barbero et al., 2025): only the highest fraction ``p`` of the
frequencies rotate.

The registry of these rules is :data:`ROPE_SCALINGS`; :func:`scaled_inv_freq`
applies one by name, from a dict ``{"type": name, **params}``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

import torch

from .._checks import (
    check_choice,
    check_even,
    check_number,
    check_positive_float,
    check_positive_int,
)

__all__ = [
    "ROPE_SCALINGS",
    "scaled_inv_freq",
    "depends_on_length",
    "seq_len_after",
    "no_scaling",
    "linear_scaling",
    "ntk_scaling",
    "dynamic_ntk_scaling",
    "yarn_scaling",
    "yarn_mscale",
    "longrope_scaling",
    "llama3_scaling",
    "p_rope_inv_freq",
]


def _theta64(dim: int, base: float, device=None) -> torch.Tensor:
    """``base ** (-2j / dim)`` in float64, ``(dim // 2,)``."""
    return base ** -(torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)


def no_scaling(dim: int, base: float, *, device=None) -> tuple[torch.Tensor, float]:
    """Plain RoPE (Hugging Face ``"default"``): ``theta_j = base ** (-2j / dim)``, factor 1."""
    return _theta64(dim, base, device).float(), 1.0


def linear_scaling(dim: int, base: float, *, factor: float, device=None):
    """Position interpolation (Chen et al., 2023): every frequency divided by ``factor``.

    Dividing every frequency by ``factor`` is the same as dividing positions, so a
    model trained to length ``L`` sees positions of ``factor * L`` squeezed into
    the range it knows. Hugging Face ``"linear"``.
    """
    factor = check_positive_float("factor", factor)
    return (_theta64(dim, base, device) / factor).float(), 1.0


def _ntk_base(dim: int, base: float, scale: float) -> float:
    if dim <= 2:
        raise ValueError(f"dim must be > 2 for an NTK-aware base change, got {dim}")
    return base * scale ** (dim / (dim - 2))


def ntk_scaling(dim: int, base: float, *, factor: float, device=None):
    """NTK-aware scaling (bloc97, 2023), a *fixed* base change.

    ``base' = base * factor ** (dim / (dim - 2))`` leaves the highest frequency
    unchanged (local order stays sharp) and divides the lowest one by ``factor``
    (the longest wavelength covers ``factor`` times more tokens). Hugging Face has
    no fixed form; its ``"dynamic"`` (:func:`dynamic_ntk_scaling`) grows this base
    with the current length.
    """
    factor = check_positive_float("factor", factor)
    return _theta64(dim, _ntk_base(dim, base, factor), device).float(), 1.0


def dynamic_ntk_scaling(
    dim: int, base: float, *, factor: float, original_max_position_embeddings: int,
    seq_len: int | None = None, device=None,
):
    """Dynamic NTK (emozilla, 2023; Hugging Face ``"dynamic"``): the base grows with the length.

    With ``L = max(seq_len, original_max_position_embeddings)`` (``seq_len=None``: ``L`` is the
    original length) and ``L0 = original_max_position_embeddings``::

        base' = base * (factor * L / L0 - (factor - 1)) ** (dim / (dim - 2))

    so up to ``L0`` nothing changes, and past it the NTK-aware base change grows
    with the length. Caveat (also Hugging Face's): the frequencies change with the
    length, but keys already rotated into a KV cache keep the angles of the base
    they were rotated with, so after the cache grows past ``L0``, old keys and new
    queries no longer share one rotation and ``q . k`` is no longer a function of
    ``m - n`` alone.
    """
    factor = check_positive_float("factor", factor)
    original = check_positive_int("original_max_position_embeddings",
                                  original_max_position_embeddings)
    length = original if seq_len is None else max(check_positive_int("seq_len", seq_len), original)
    new_base = _ntk_base(dim, base, factor * length / original - (factor - 1))
    return _theta64(dim, new_base, device).float(), 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    factor = check_positive_float("factor", factor)
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_scaling(
    dim: int,
    base: float,
    *,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    attention_factor: float | None = None,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    truncate: bool = True,
    device=None,
):
    """YaRN (Peng et al., 2024): interpolate only the low frequencies, plus a temperature.

    Pair ``j`` turns ``L0 * theta_j / (2 pi)`` times over the original context
    ``L0 = original_max_position_embeddings``. Pairs turning more than ``beta_fast`` times
    keep their frequency, those turning less than ``beta_slow`` times are divided
    by ``factor``, with a linear ramp over the pair index between (its ends
    rounded outwards when ``truncate``, as in the paper's code).

    The attention factor multiplies cos and sin: ``attention_factor`` if given,
    else ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` when
    both are given and non-zero (DeepSeek-V2/V3), else ``yarn_mscale(factor)`` =
    ``0.1 ln(factor) + 1``. Hugging Face ``"yarn"`` (transformers 5).
    """
    factor = check_positive_float("factor", factor)
    original = check_positive_int("original_max_position_embeddings",
                                  original_max_position_embeddings)
    beta_fast = check_positive_float("beta_fast", beta_fast)
    beta_slow = check_positive_float("beta_slow", beta_slow)
    if beta_fast <= beta_slow:
        raise ValueError(
            f"beta_fast must be > beta_slow (rotations of the fastest kept pair vs the slowest "
            f"interpolated one), got beta_fast={beta_fast}, beta_slow={beta_slow}"
        )
    if base <= 1:
        raise ValueError(f"base must be > 1 for YaRN (its ramp divides by log(base)), got {base}")
    if not isinstance(truncate, bool):
        raise TypeError(f"truncate must be a bool, got {type(truncate).__name__}")
    if attention_factor is not None:
        attention_factor = check_positive_float("attention_factor", attention_factor)
    else:
        if mscale is not None:
            mscale = check_number("mscale", mscale)
        if mscale_all_dim is not None:
            mscale_all_dim = check_number("mscale_all_dim", mscale_all_dim)
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(n_rotations: float) -> float:
        # the (fractional) dimension 2j whose pair turns n_rotations times over L0
        return dim * math.log(original / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=device) - low) / (high - low))
    keep = 1.0 - ramp.clamp(0.0, 1.0)  # 1: keep the frequency, 0: divide it by factor
    theta = _theta64(dim, base, device)
    return (theta / factor * (1 - keep) + theta * keep).float(), float(attention_factor)


def _factor_list(name: str, values, n: int, device) -> torch.Tensor:
    if isinstance(values, torch.Tensor):  # a configuration, read once when the rule is built
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise TypeError(f"{name} must be a list of {n} numbers (one per pair), "
                        f"got {type(values).__name__}")
    if len(values) != n:
        raise ValueError(f"{name} must have dim // 2 = {n} entries (one per pair), "
                         f"got {len(values)}")
    out = torch.tensor([check_positive_float(f"{name}[{i}]", v) for i, v in enumerate(values)],
                       dtype=torch.float64, device=device)
    return out


def longrope_scaling(
    dim: int,
    base: float,
    *,
    short_factor: Sequence[float],
    long_factor: Sequence[float],
    original_max_position_embeddings: int,
    factor: float | None = None,
    attention_factor: float | None = None,
    seq_len: int | None = None,
    device=None,
):
    """LongRoPE (Ding et al., 2024; Phi-3): one searched divisor per frequency.

    ``theta_j = base ** (-2j / dim) / f_j`` with ``f = long_factor`` when the
    current length ``seq_len`` exceeds ``original_max_position_embeddings``, ``short_factor``
    otherwise (and for ``seq_len=None``). Both lists have ``dim // 2`` entries.
    The attention factor is ``attention_factor`` if given, else
    ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` (1 for ``factor <= 1``),
    with ``factor`` the context extension ratio (Phi-3: ``max_position_embeddings /
    original_max_position_embeddings``). Hugging Face ``"longrope"``.
    """
    original = check_positive_int("original_max_position_embeddings",
                                  original_max_position_embeddings)
    short = _factor_list("short_factor", short_factor, dim // 2, device)
    long = _factor_list("long_factor", long_factor, dim // 2, device)
    if attention_factor is not None:
        attention_factor = check_positive_float("attention_factor", attention_factor)
    elif factor is None:
        raise ValueError("longrope needs factor (the extension ratio, e.g. max_position_embeddings"
                         " / original_max_position_embeddings) or attention_factor")
    else:
        factor = check_positive_float("factor", factor)
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    if seq_len is not None:
        check_positive_int("seq_len", seq_len)
    ext = long if seq_len is not None and seq_len > original else short
    return (_theta64(dim, base, device) / ext).float(), float(attention_factor)


def llama3_scaling(
    dim: int,
    base: float,
    *,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
    device=None,
):
    """Llama 3.1's rule (Hugging Face ``"llama3"``): long wavelengths / ``factor``, a smooth band.

    With ``L0 = original_max_position_embeddings`` and wavelength ``lambda_j = 2 pi / theta_j``:
    pairs with ``lambda_j < L0 / high_freq_factor`` keep their frequency, pairs with
    ``lambda_j > L0 / low_freq_factor`` are divided by ``factor``, and in between
    ``theta_j' = (1 - s) theta_j / factor + s theta_j`` with
    ``s = (L0 / lambda_j - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    Equal ``low_freq_factor`` and ``high_freq_factor`` (Llama 4) leave no band: a
    step at ``L0 / low_freq_factor``. Attention factor 1.
    """
    factor = check_positive_float("factor", factor)
    low = check_positive_float("low_freq_factor", low_freq_factor)
    high = check_positive_float("high_freq_factor", high_freq_factor)
    original = check_positive_int("original_max_position_embeddings",
                                  original_max_position_embeddings)
    if high < low:
        raise ValueError(f"high_freq_factor must be >= low_freq_factor, got "
                         f"high_freq_factor={high}, low_freq_factor={low}")
    theta = _theta64(dim, base, device)
    wavelength = 2 * math.pi / theta
    if high > low:
        smooth = (original / wavelength - low) / (high - low)
        band = (1 - smooth) * theta / factor + smooth * theta
    else:  # equal factors (Llama 4): no band, a step at wavelength L0 / low_freq_factor
        band = theta
    out = torch.where(wavelength > original / low, theta / factor, band)
    out = torch.where(wavelength < original / high, theta, out)
    return out.float(), 1.0


def p_rope_inv_freq(inv_freq: torch.Tensor, p: float) -> torch.Tensor:
    """p-RoPE (Barbero et al., 2025): keep the highest fraction ``p`` of frequencies, zero the rest.

    Pairs ``j >= int(p * dim // 2)`` (the lowest frequencies, ``dim = 2 *
    len(inv_freq)``) get frequency 0: angle 0 at every position, i.e. no rotation,
    so those features carry content only. ``p = 1`` is RoPE, ``p = 0`` is NoPE.
    The same count as the paper's code and Hugging Face's ``"proportional"``.

    Args:
        inv_freq: ``(dim // 2,)`` frequencies, highest first.
        p: fraction in ``[0, 1]``.

    Returns:
        A new tensor like ``inv_freq``.
    """
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1:
        raise TypeError("inv_freq must be a 1-D tensor (dim // 2,)")
    p = check_number("p", p)
    if not 0 <= p <= 1:
        raise ValueError(f"p must be in [0, 1] (the fraction of frequencies that rotate), got {p}")
    kept = int(p * (2 * inv_freq.numel()) // 2)
    out = inv_freq.clone()
    out[kept:] = 0
    return out



#: The registry of RoPE scaling rules, by name; each is ``fn(dim, base, **params) ->
#: (inv_freq, attention_factor)``, and the rules that depend on the current length
#: (``"dynamic"``, ``"longrope"``) take ``seq_len``. Add an entry to make a new rule
#: available to :func:`scaled_inv_freq` and :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding`.
ROPE_SCALINGS: dict[str, Callable[..., tuple[torch.Tensor, float]]] = {
    "none": no_scaling,
    "linear": linear_scaling,
    "ntk": ntk_scaling,
    "dynamic": dynamic_ntk_scaling,
    "yarn": yarn_scaling,
    "longrope": longrope_scaling,
    "llama3": llama3_scaling,
}


def depends_on_length(kind: str) -> bool:
    """Whether the rule ``ROPE_SCALINGS[kind]`` takes the current length ``seq_len``.

    Raises:
        ValueError: ``kind`` is not in :data:`ROPE_SCALINGS`.
    """
    check_choice("scaling['type']", kind, ROPE_SCALINGS)
    return "seq_len" in inspect.signature(ROPE_SCALINGS[kind]).parameters


def seq_len_after(scaling: dict | None, end: int, current: int | None) -> int | None:
    """The ``seq_len`` to evaluate a length-dependent rule for, once positions up to
    ``end - 1`` arrive, given the ``current`` one (``None``: the original length), as
    Hugging Face's ``dynamic_rope_update`` does.

    ``"longrope"``: ``end`` once it passes ``original_max_position_embeddings`` (the long factors),
    ``None`` (the short ones) once back under it. ``"dynamic"`` (and any other rule that
    takes ``seq_len``): ``end`` when it exceeds the longest length seen so far (the base
    grows), ``None`` when it falls below ``original_max_position_embeddings``. Otherwise, and for a
    rule that does not depend on the length, ``current``: nothing to recompute.
    """
    if scaling is None or end <= 0 or not depends_on_length(scaling["type"]):
        return current
    original = scaling.get("original_max_position_embeddings")
    if scaling["type"] == "longrope":
        if (end > original) == (current is not None):
            return current
        return end if end > original else None
    if end > (original if current is None else current):
        return end
    if current is not None and end < original < current:
        return None
    return current


def scaled_inv_freq(
    dim: int,
    base: float = 10000.0,
    scaling: dict | None = None,
    *,
    seq_len: int | None = None,
    device=None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies after a context-extension rule, and its attention factor.

    Args:
        dim: rotary dimension (even).
        base: RoPE base.
        scaling: ``None`` or a dict ``{"type": name, **params}`` with ``name`` in
            :data:`ROPE_SCALINGS` and the parameters of that rule:
            ``{"type": "linear", "factor": 4}``,
            ``{"type": "ntk", "factor": 4}``,
            ``{"type": "dynamic", "factor": 4, "original_max_position_embeddings": 2048}``,
            ``{"type": "yarn", "factor": 4, "original_max_position_embeddings": 2048}``,
            ``{"type": "longrope", "short_factor": [...], "long_factor": [...],
            "original_max_position_embeddings": 4096, "factor": 32}``,
            ``{"type": "llama3", "factor": 8, "low_freq_factor": 1,
            "high_freq_factor": 4, "original_max_position_embeddings": 8192}``.
            :func:`~tutorial_pkg.encodings.rope_config.read_rope_config` builds it from a
            Hugging Face config.
        seq_len: current sequence length, for the rules that depend on it
            (``"dynamic"``, ``"longrope"``); ignored by the others. ``None``: the
            original length.
        device: device of the result.

    Returns:
        ``(inv_freq (dim // 2,) float32, attention_factor float)``.

    Raises:
        TypeError: ``scaling`` is not ``None`` nor a dict with a ``"type"`` key.
        ValueError: an unknown ``"type"``, an unknown or missing parameter, a value
            the rule rejects, or ``"seq_len"`` inside ``scaling``.
    """
    check_even("dim", dim)
    base = check_positive_float("base", base)
    if scaling is None:
        return no_scaling(dim, base, device=device)
    if not isinstance(scaling, dict) or "type" not in scaling:
        raise TypeError(f"scaling must be None or a dict with a 'type' key, got {scaling!r}")
    params = dict(scaling)
    kind = check_choice("scaling['type']", params.pop("type"), ROPE_SCALINGS)
    rule = ROPE_SCALINGS[kind]
    if "seq_len" in params:
        raise ValueError("scaling must not hold 'seq_len' (the current length is an argument)")
    if depends_on_length(kind):
        params["seq_len"] = seq_len
    # an unknown key is named before a missing one, so a misspelt key is what the error says
    takes = [p for p in inspect.signature(rule).parameters
             if p not in ("dim", "base", "device", "seq_len")]
    unknown = sorted(set(params) - set(takes) - {"seq_len"})
    if unknown:
        raise ValueError(f"scaling parameters for {kind!r} are invalid: unknown key(s) "
                         f"{', '.join(map(repr, unknown))}; {kind!r} takes {', '.join(takes)}")
    try:  # a missing parameter for this rule (a wrong value raises in the rule)
        inspect.signature(rule).bind(dim, base, device=device, **params)
    except TypeError as err:
        raise ValueError(f"scaling parameters for {kind!r} are invalid: {err}") from err
    return rule(dim, base, device=device, **params)
