"""Rotary position embedding (RoPE; Su et al., 2021): the math. Chapter 2.

RoPE rotates each pair of query/key features by an angle proportional to the
token position, ``m * theta_i`` with ``theta_i = base ** (-2i / d)``, so that
``<R_m q, R_n k>`` depends on positions only through ``m - n``.

Two pair layouts exist in real checkpoints (:data:`~tutorial_pkg.encodings.rope_config.LAYOUTS`),
and mixing them silently gives wrong attention scores:

* ``"half"``: pair ``(x[i], x[i + d/2])``. Hugging Face Llama / GPT-NeoX
  (``rotate_half``).
* ``"interleaved"``: pair ``(x[2i], x[2i + 1])``. Meta's original Llama code and
  RoFormer (``torch.view_as_complex``).

They are the same rotation up to a fixed permutation of the feature axis;
:func:`interleaved_to_half` / :func:`half_to_interleaved` permute q/k projection
weights from one to the other (what Hugging Face's Llama conversion script does).

Angles are always computed in float32 (or float64 on request), and so is the rotation of
16-bit q/k, rounded once to their dtype at the end.

Shapes: q and k are ``[b, H, s, d]`` (the layout of
``torch.nn.functional.scaled_dot_product_attention``).

Where things live: the scaling rules and
:func:`~tutorial_pkg.encodings.rope_scaling.scaled_inv_freq` in
:mod:`tutorial_pkg.encodings.rope_scaling`; reading a Hugging Face config in
:mod:`tutorial_pkg.encodings.rope_config` (which :meth:`RotaryEmbedding.from_config` calls);
the rotation every caller runs, :func:`~tutorial_pkg.encodings.rope_kernels.rotate_pairs`, in
:mod:`tutorial_pkg.encodings.rope_kernels` (``_rope`` here is its spec).
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import (
    as_batched_positions,
    as_positions,
    check_choice,
    check_even,
    check_float_tensor,
    check_positive_float,
    check_positive_int,
    values_readable,
)
from .rope_config import LAYOUTS, read_rope_config
from .rope_kernels import fused_rope, rotate_pairs
from .rope_scaling import (  # noqa: F401  (ROPE_SCALINGS re-exported)
    ROPE_SCALINGS,
    depends_on_length,
    p_rope_inv_freq,
    scaled_inv_freq,
    seq_len_after,
)

__all__ = [
    "LAYOUTS",
    "inv_freq",
    "rope_angles",
    "rotate_half",
    "apply_rope",
    "precompute_freqs_cis",
    "apply_rope_complex",
    "interleaved_to_half_permutation",
    "interleaved_to_half",
    "half_to_interleaved",
    "RotaryEmbedding",
]


# --------------------------------------------------------------------------- frequencies
def inv_freq(dim: int, base: float = 10000.0, *, device=None) -> torch.Tensor:
    """Inverse frequencies ``theta_i = base ** (-2i / dim)`` in float32.

    Args:
        dim: rotary dimension (even): the number of features rotated per head.
        base: RoPE base ("theta"); 10000 in RoFormer and Llama 2, 500000 in Llama 3.
        device: device of the result.

    Returns:
        float32 tensor ``(dim // 2,)``, decreasing from 1.
    """
    check_even("dim", dim)
    base = check_positive_float("base", base)
    exponent = torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim
    return (base**-exponent).float()


def rope_angles(positions, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotation angles ``m * theta_i``, always in float32 (or float64 if given).

    Args:
        positions: int length or integer tensor ``(s,)``.
        inv_freq: ``(d / 2,)`` frequencies.

    Returns:
        ``(s, d / 2)`` angles in float32 (float64 if ``inv_freq`` is float64).
    """
    if not isinstance(inv_freq, torch.Tensor) or not inv_freq.is_floating_point() or (
        inv_freq.dim() != 1
    ):
        raise TypeError(
            f"inv_freq must be a 1-D floating-point tensor (see inv_freq()), got "
            f"{type(inv_freq).__name__}"
            + (f" of shape {tuple(inv_freq.shape)}" if isinstance(inv_freq, torch.Tensor) else "")
        )
    dtype = torch.float64 if inv_freq.dtype == torch.float64 else torch.float32
    pos = as_positions("positions", positions, device=inv_freq.device).to(dtype)
    return torch.outer(pos, inv_freq.to(dtype))


# --------------------------------------------------------------------------- apply
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``rotate_half``: ``[x1, x2] -> [-x2, x1]`` on the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half"
) -> torch.Tensor:
    """Rotate feature pairs of ``x`` by the angles whose ``cos``/``sin`` are given.

    Partial rotary: when ``cos`` has ``r/2`` columns with ``r < d``, only the
    first ``r`` features are rotated and the rest pass through (GPT-NeoX style).

    **One column per pair, not Hugging Face's tables.** ``cos``/``sin`` hold one angle
    per rotated pair, ``[..., r/2]`` (what :meth:`RotaryEmbedding.cos_sin` returns).
    Hugging Face's are ``[b, s, r]`` with the halves duplicated (``cat(freqs, freqs)``):
    pass their first half, ``cos[..., : r // 2]`` and ``sin[..., : r // 2]`` (``[:, None]``
    for the head axis), with ``layout="half"``. HF's form raises ``ValueError``: by
    shape where it covers more than ``d`` features, and by value (both halves equal,
    some angle not 0) where reading the tables is free (a CPU tensor, outside
    compilation; on a GPU only the shape check runs).

    Args:
        x: ``[..., s, d]`` queries or keys (e.g. ``[b, H, s, d]``).
        cos: ``[s, r/2]`` (or broadcastable, e.g. ``[b, 1, s, r/2]``), float32.
        sin: same shape as ``cos``.
        layout: ``"half"`` (pairs ``i, i + r/2``) or ``"interleaved"`` (``2i, 2i+1``).

    Returns:
        Tensor of ``x``'s shape and dtype: the rotation computed in float32 at least (16-bit
        ``x`` upcast, the tables never rounded) and rounded once, by
        :func:`~tutorial_pkg.encodings.rope_kernels.rotate_pairs`, the code
        :class:`RotaryEmbedding` runs (the same bits).
    """
    check_choice("layout", layout, LAYOUTS)
    check_float_tensor("x", x)  # an integer x would silently truncate cos/sin to 0/1
    _check_cos_sin(x, cos, sin)
    _refuse_hf_tables(cos, sin)
    return rotate_pairs(cos, sin, layout, x)[0]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """The rotation as the math reads: the spec :func:`apply_rope` is tested against.

    Pairs ``(x1, x2)`` become ``(x1 cos - x2 sin, x2 cos + x1 sin)``, computed in float32
    at least (16-bit ``x`` is upcast, the tables are not rounded) and rounded once to
    ``x``'s dtype; features past the ``r = 2 * cos.shape[-1]`` rotated ones pass through.
    No checks.
    """
    work = torch.promote_types(x.dtype, torch.float32)
    half = cos.shape[-1]
    x_rot, x_pass = x[..., : 2 * half].to(work), x[..., 2 * half :]
    c, s = cos.to(work), sin.to(work)
    if layout == "half":
        x1, x2 = x_rot[..., :half], x_rot[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    elif layout == "interleaved":
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        check_choice("layout", layout, LAYOUTS)
    return torch.cat((out.to(x.dtype), x_pass), dim=-1)


_HF_TABLES = ("Hugging Face's rotary tables are [b, s, r] with the halves duplicated "
              "(cat(freqs, freqs)); apply_rope takes one column per pair: pass "
              "cos[..., : cos.shape[-1] // 2] and sin[..., : sin.shape[-1] // 2] "
              "(and [:, None] for the head axis)")


def _check_cos_sin(x: torch.Tensor, cos, sin) -> None:
    for name, t in (("cos", cos), ("sin", sin)):
        check_float_tensor(name, t)
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if cos.dim() == 0 or 2 * cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"cos/sin cover {2 * cos.shape[-1] if cos.dim() else 0} features but "
                         f"x has {x.shape[-1]} (one column per rotated pair: they must cover "
                         f"an even number <= it). {_HF_TABLES}")
    try:
        fits = torch.broadcast_shapes(cos.shape[:-1], x.shape[:-1]) == x.shape[:-1]
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"cos/sin of shape {tuple(cos.shape)} must broadcast to x's {tuple(x.shape[:-1])} "
            f"(one row per position of x: slice the table, cos[start:start + s])"
        )


def _refuse_hf_tables(cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise where ``cos``/``sin`` are Hugging Face's duplicated-halves tables: both halves
    equal and some angle not 0 (distinct frequencies never give equal halves then). Reads
    the tables, so only where that is free (:func:`~tutorial_pkg._checks.values_readable`)."""
    w = cos.shape[-1]
    if w % 2 or not values_readable(cos) or not values_readable(sin):
        return
    h = w // 2
    if (torch.equal(cos[..., :h], cos[..., h:]) and torch.equal(sin[..., :h], sin[..., h:])
            and bool(sin.ne(0).any())):
        raise ValueError(f"cos/sin of shape {tuple(cos.shape)} have equal halves: they look like "
                         f"{_HF_TABLES[0].lower()}{_HF_TABLES[1:]}")


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """Meta's Llama ``precompute_freqs_cis``: ``exp(i m theta_j)`` as complex64.

    The teaching form of RoPE: a feature pair is a complex number, a rotation is a
    multiplication by ``e^{i m theta}``.

    Returns:
        complex64 tensor ``(end, dim // 2)``.
    """
    check_positive_int("end", end)
    angles = rope_angles(end, inv_freq(dim, theta))
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """RoPE in the complex form (interleaved layout), as in Meta's ``apply_rotary_emb``.

    Args:
        x: ``[..., s, d]`` real tensor; pairs ``(x[2i], x[2i+1])`` are complex numbers.
        freqs_cis: complex ``(s, d/2)`` from :func:`precompute_freqs_cis`.

    Returns:
        Tensor of ``x``'s shape and dtype.
    """
    check_float_tensor("x", x)
    if x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., s, d] with an even d (pairs are complex numbers), "
                         f"got shape {tuple(x.shape)}")
    if not isinstance(freqs_cis, torch.Tensor) or not freqs_cis.is_complex():
        raise TypeError("freqs_cis must be a complex tensor (s, d/2) from "
                        "precompute_freqs_cis")
    if tuple(freqs_cis.shape[-2:]) != (x.shape[-2], x.shape[-1] // 2):
        raise ValueError(
            f"freqs_cis must have shape (s, d/2)=({x.shape[-2]}, {x.shape[-1] // 2}), got "
            f"{tuple(freqs_cis.shape)} (slice the table: freqs_cis[start:start + s])"
        )
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(-2).type_as(x)


# --------------------------------------------------------------------------- layouts
def interleaved_to_half_permutation(head_dim: int, rotary_dim: int | None = None):
    """Index ``perm`` with ``x_half = x_interleaved[..., perm]`` for one head.

    Even features go first, odd second; features past ``rotary_dim`` stay put.
    """
    check_even("head_dim", head_dim)
    rotary_dim = head_dim if rotary_dim is None else check_even("rotary_dim", rotary_dim)
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be <= head_dim={head_dim}, got {rotary_dim}")
    return torch.cat(
        (
            torch.arange(0, rotary_dim, 2),
            torch.arange(1, rotary_dim, 2),
            torch.arange(rotary_dim, head_dim),
        )
    )


def _permute_heads(w: torch.Tensor, n_heads: int, perm: torch.Tensor) -> torch.Tensor:
    head_dim = w.shape[0] // n_heads
    per_head = w.reshape(n_heads, head_dim, *w.shape[1:])
    return per_head[:, perm.to(w.device)].reshape(w.shape)


def _head_dim(w: torch.Tensor, n_heads: int) -> int:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(w).__name__}")
    check_positive_int("n_heads", n_heads)
    if w.dim() == 0 or w.shape[0] % n_heads:
        raise ValueError(
            f"weight's first dimension must be n_heads * head_dim with n_heads={n_heads}, "
            f"got shape {tuple(w.shape)}"
        )
    return w.shape[0] // n_heads


def interleaved_to_half(w: torch.Tensor, n_heads: int, rotary_dim: int | None = None):
    """Permute q/k projection rows from Meta's interleaved layout to the half layout.

    The same permutation as ``permute`` in Hugging Face's
    ``convert_llama_weights_to_hf.py``: after it, a model using ``rotate_half``
    computes exactly the scores the Meta model computed.

    Args:
        w: ``(H * d, in)`` weight (or ``(H * d,)`` bias) of q or k.
        n_heads: heads of that projection (``n_kv_heads`` for k under GQA).
        rotary_dim: rotated features per head (default: all).

    Returns:
        The permuted weight, same shape.
    """
    head_dim = _head_dim(w, n_heads)
    return _permute_heads(w, n_heads, interleaved_to_half_permutation(head_dim, rotary_dim))


def half_to_interleaved(w: torch.Tensor, n_heads: int, rotary_dim: int | None = None):
    """Inverse of :func:`interleaved_to_half` (Hugging Face -> Meta layout)."""
    head_dim = _head_dim(w, n_heads)
    perm = interleaved_to_half_permutation(head_dim, rotary_dim)
    return _permute_heads(w, n_heads, torch.argsort(perm))


def _check_start(start) -> int:
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    return start


# --------------------------------------------------------------------------- module
class RotaryEmbedding(nn.Module):
    """RoPE for ``[b, H, s, d]`` queries and keys, with a cos/sin cache.

    The cache holds ``cos``/``sin`` of the fp32 angles for positions ``0..N-1`` and
    grows (doubling) when a larger position arrives; it is a non-persistent buffer,
    so it is not saved in ``state_dict`` and follows ``.to(device)``. Casting the
    module (``.half()``) recomputes the frequencies in float32.

    Args:
        head_dim: features per head ``d`` (even).
        base: RoPE base ("theta").
        rotary_dim: features rotated per head (even, <= ``head_dim``); default all.
            The rest pass through (partial rotary, GPT-NeoX style).
        layout: ``"half"`` (Hugging Face) or ``"interleaved"`` (Meta).
        scaling: context extension, see
            :func:`~tutorial_pkg.encodings.rope_scaling.scaled_inv_freq`.
            Rules that depend on the current length (``"dynamic"``, ``"longrope"``) are
            re-evaluated at each call for ``seq_len`` = the largest position + 1, as
            Hugging Face's ``dynamic_rope_update`` does: ``"longrope"`` uses its long
            factors when ``seq_len > original_max_position_embeddings``; ``"dynamic"`` grows its
            base when ``seq_len`` exceeds the largest length seen so far and returns
            to the original base when ``seq_len < original_max_position_embeddings``. Keys
            already in a KV cache keep the angles they were rotated with.
        p_rope: p-RoPE's ``p`` in ``[0, 1]``: only the highest fraction ``p`` of the
            frequencies rotate (:func:`~tutorial_pkg.encodings.rope_scaling.p_rope_inv_freq`),
            applied after ``scaling``; ``None``: all rotate.
        max_positions: optional hard limit; positions >= it raise ``ValueError``.
        fused: rotate (half layout, full rotary) with one ``torch.compile``-d kernel
            (:func:`~tutorial_pkg.encodings.rope_kernels.fused_rope`): compiles on first use and
            once more per new dtype, grad mode or q/k shape pair; needs a C++ compiler
            (Triton on GPU), else it warns and stays eager. Equal to the eager path up
            to rounding (each element computed in float32, rounded once).

    :meth:`rotate` and :meth:`forward` run the code :func:`apply_rope` runs
    (:func:`~tutorial_pkg.encodings.rope_kernels.rotate_pairs`), so they give its bits; only
    ``fused=True`` rounds differently.

    Raises:
        ValueError: naming an argument that is out of range.
        TypeError: naming an argument of the wrong type.
    """

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        *,
        rotary_dim: int | None = None,
        layout: str = "half",
        scaling: dict | None = None,
        p_rope: float | None = None,
        max_positions: int | None = None,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = check_even("head_dim", head_dim)
        self.rotary_dim = head_dim if rotary_dim is None else check_even("rotary_dim", rotary_dim)
        if self.rotary_dim > head_dim:
            raise ValueError(f"rotary_dim must be <= head_dim={head_dim}, got {rotary_dim}")
        self.base = check_positive_float("base", base)
        self.layout = check_choice("layout", layout, LAYOUTS)
        self.max_positions = (
            None if max_positions is None else check_positive_int("max_positions", max_positions)
        )
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {type(fused).__name__}")
        self.fused = fused
        if p_rope is not None:
            p_rope_inv_freq(torch.ones(1), p_rope)  # checks p_rope in [0, 1]
            p_rope = float(p_rope)
        self.p_rope = p_rope
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("cos_cached", torch.empty(0, self.rotary_dim // 2), persistent=False)
        self.register_buffer("sin_cached", torch.empty(0, self.rotary_dim // 2), persistent=False)
        self.set_scaling(scaling)

    @classmethod
    def from_config(cls, config, layer_type: str | None = None, *, layout: str | None = None,
                    **kwargs) -> RotaryEmbedding:
        """The RoPE of a Hugging Face model config (dict or ``PretrainedConfig``).

        Reads it with :func:`~tutorial_pkg.encodings.rope_config.read_rope_config` (which raises
        ``ValueError`` naming an unknown ``rope_type``, an unknown key or a missing
        one, and ``layout`` where it cannot know the pair layout: a ``model_type`` it
        does not know, or none); ``layer_type`` picks one entry of a per-layer-type
        ``rope_parameters`` (Gemma 3: ``"full_attention"`` / ``"sliding_attention"``);
        ``layout`` (``"half"``/``"interleaved"``) overrides the config's. ``kwargs``
        (``max_positions``, ``fused``) go to the constructor.
        """
        cfg = read_rope_config(config, layer_type=layer_type, layout=layout)
        return cls(**{**cfg.kwargs(), **kwargs})

    # ----------------------------------------------------------------------- frequencies
    def set_scaling(self, scaling: dict | None) -> None:
        """Change the context-extension rule (e.g. at evaluation time); clears the cache."""
        theta, factor = scaled_inv_freq(
            self.rotary_dim, self.base, scaling, device=self.inv_freq.device
        )
        self.scaling = None if scaling is None else dict(scaling)
        self._follows_length = scaling is not None and depends_on_length(scaling["type"])
        self._freq_len = None  # the seq_len of the current frequencies (None: original)
        self._set_frequencies(theta, factor)

    def _set_frequencies(self, theta: torch.Tensor, attention_factor: float) -> None:
        device = self.inv_freq.device
        if self.p_rope is not None:
            theta = p_rope_inv_freq(theta, self.p_rope)
        self.inv_freq, self.attention_factor = theta.to(device), attention_factor
        self.cos_cached = torch.empty(0, self.rotary_dim // 2, device=device)
        self.sin_cached = torch.empty(0, self.rotary_dim // 2, device=device)

    def _check_end(self, end: int) -> None:
        """Raise if ``end`` (the largest position + 1) passes ``max_positions``."""
        if self.max_positions is not None and end > self.max_positions:
            raise ValueError(
                f"positions must be < max_positions={self.max_positions}, got up to {end - 1}"
            )

    def _follow_length(self, end: int) -> None:
        """Re-evaluate a length-dependent rule once positions up to ``end - 1`` arrive."""
        if not self._follows_length:
            return
        seq_len = seq_len_after(self.scaling, end, self._freq_len)
        if seq_len != self._freq_len:
            theta, factor = scaled_inv_freq(self.rotary_dim, self.base, self.scaling,
                                            seq_len=seq_len, device=self.inv_freq.device)
            self._set_frequencies(theta, factor)
            self._freq_len = seq_len

    def _apply(self, fn, *args, **kwargs):
        # .half()/.to(torch.bfloat16) would round inv_freq and the cos/sin cache:
        # recompute the frequencies in float32 after any cast
        out = super()._apply(fn, *args, **kwargs)
        self.set_scaling(self.scaling)
        return out

    # ----------------------------------------------------------------------- tables
    def _grow(self, n: int, device: torch.device) -> None:
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
            self.cos_cached = self.cos_cached[:0].to(device)
        if self.cos_cached.shape[0] >= n:
            return
        size = max(n, 2 * self.cos_cached.shape[0], 256)
        angles = rope_angles(torch.arange(size, device=device), self.inv_freq)
        self.cos_cached = angles.cos() * self.attention_factor
        self.sin_cached = angles.sin() * self.attention_factor

    def cos_sin(self, positions: torch.Tensor | None = None, *, start: int = 0, length=None):
        """``cos``/``sin`` (float32, ``(s, rotary_dim/2)``) for positions.

        Either ``positions`` (integer tensor ``(s,)``) or ``start`` and ``length``
        (positions ``start..start+length-1``, served as a view of the cache).
        Explicit positions are read back to size the cache: on a GPU that is a
        synchronisation (:meth:`rotate` and attention never need it).
        """
        if positions is None:
            check_positive_int("length", length)
            end = _check_start(start) + length
            device = self.inv_freq.device
            rows = slice(start, end)
        else:
            rows = as_positions("positions", positions)
            end = int(rows.max()) + 1 if rows.numel() else 0
            device = rows.device
        self._check_end(end)
        self._follow_length(end)
        self._grow(end, torch.device(device))
        return self.cos_cached[rows], self.sin_cached[rows]

    def _angle_tables(self, positions: torch.Tensor, device: torch.device):
        """float32 ``cos, sin`` of ``positions`` (any shape), built on ``device`` with the
        same float32 products as the cache (so the same values)."""
        inv = self.inv_freq.to(device)  # a constant: moved to where the call runs
        angles = positions.to(inv.dtype)[..., None] * inv
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1:  # (x * 1.0 is x: skip the two passes)
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def _tables(self, x: torch.Tensor, positions, start: int, name: str, check_values: bool):
        """float32 ``(cos, sin, rows)`` broadcastable to ``x``; ``None`` if ``x`` has no
        positions. ``rows``: the slice of the cache they are a view of, or ``None``.

        Default positions read a view of the cache (or, for ``x`` on another device,
        angles built there): nothing read back from the device. Explicit positions
        ``(s,)`` or ``[b, s]`` become angles directly, which needs no bound on them, as
        Hugging Face does with ``position_ids``; only ``max_positions`` (when
        ``check_values``) and a length-dependent rule read their maximum back.
        """
        self._check(name, x)
        seq = x.shape[-2]
        if seq == 0:
            return None
        if positions is None:
            end = _check_start(start) + seq
            self._check_end(end)
            self._follow_length(end)
            if x.device == self.inv_freq.device:
                self._grow(end, x.device)
                rows = slice(start, end)  # a view: no copy, nothing read back
                return self.cos_cached[rows], self.sin_cached[rows], rows
            return (*self._angle_tables(torch.arange(start, end, device=x.device), x.device),
                    None)
        if not isinstance(positions, torch.Tensor):
            positions = as_positions("positions", positions, device=x.device)
        if positions.dim() == 1:
            positions = as_positions("positions", positions) if check_values else positions
            if positions.numel() != seq:
                raise ValueError(f"positions must have length s={seq}, got {positions.numel()}")
            positions = positions.long().to(x.device)
        elif x.dim() != 4:
            raise ValueError(
                f"positions [b, s] need {name} as [b, H, s, d], got shape {tuple(x.shape)}"
                f" (pass positions as (s,) for other shapes)"
            )
        else:  # one row per sequence, broadcast over heads
            positions = as_batched_positions("positions", positions, x.shape[0], seq,
                                             check_values=check_values)[:, None, :].to(x.device)
        if (self.max_positions is not None and check_values) or self._follows_length:
            # a device synchronisation per call on a GPU: opt-in (plain RoPE has neither)
            end = int(positions.max()) + 1
            if check_values:
                self._check_end(end)
            self._follow_length(end)
        return (*self._angle_tables(positions, x.device), None)

    def _check(self, name: str, x: torch.Tensor) -> None:
        check_float_tensor(name, x)
        if x.dim() < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"{name} must be [..., s, head_dim={self.head_dim}], got shape {tuple(x.shape)}"
            )

    # ----------------------------------------------------------------------- rotation
    def _rotate(self, tables, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate tensors of one dtype and device by the ``(cos, sin, rows)`` of
        :meth:`_tables`: fused (one compiled call on the stacked float32 tables),
        else :func:`~tutorial_pkg.encodings.rope_kernels.rotate_pairs`."""
        cos, sin, rows = tables
        x = xs[0]
        if self.fused and self.layout == "half" and self.rotary_dim == self.head_dim:
            compute = torch.promote_types(x.dtype, torch.float32)  # 16-bit: float32 tables
            out = fused_rope(torch.stack((cos, sin), dim=-2).to(x.device, compute), *xs)
            if out is not None:
                return out
        return rotate_pairs(cos.to(x.device), sin.to(x.device), self.layout, *xs)

    def rotate(
        self, x: torch.Tensor, positions=None, *, start: int = 0, check_positions: bool = True
    ) -> torch.Tensor:
        """Apply RoPE to ``x`` ``[b, H, s, d]`` (or ``[..., s, d]``).

        Args:
            x: queries or keys, floating point, last axis ``head_dim``.
            positions: ``(s,)`` or ``[b, s]`` integer positions (Hugging Face
                ``position_ids``; ``[b, s]`` needs a 4-D ``x``); default
                ``start + arange(s)``.
            start: first position when ``positions`` is not given (int >= 0).
            check_positions: check the values of explicit positions (not negative,
                below ``max_positions``): this reads them back from the device, so
                attention, which checks them once per forward pass, turns it off.

        Returns:
            Tensor of ``x``'s shape and dtype.
        """
        tables = self._tables(x, positions, start, "x", check_positions)
        return x if tables is None else self._rotate(tables, x)[0]

    def forward(self, q, k, q_pos=None, k_pos=None, *, start: int = 0,
                check_positions: bool = True):
        """Rotate queries and keys; see :meth:`rotate`. Returns ``(q, k)``.

        When q and k sit at the same positions (``q_pos is k_pos``, e.g. both
        ``None``) and have the same length, the tables are built once, and the fused
        path rotates both in one compiled call.
        """
        if q_pos is not k_pos or q.shape[-2] != k.shape[-2]:
            return (self.rotate(q, q_pos, start=start, check_positions=check_positions),
                    self.rotate(k, k_pos, start=start, check_positions=check_positions))
        tables = self._tables(q, q_pos, start, "q", check_positions)
        self._check("k", k)
        if tables is None:
            return q, k
        if k.dtype != q.dtype or k.device != q.device or (
            tables[2] is None and q.shape[0] != k.shape[0]
        ):
            return self._rotate(tables, q)[0], self._rotate(tables, k)[0]
        return self._rotate(tables, q, k)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base:g}, "
            f"layout={self.layout!r}, scaling={self.scaling}"
        ) + (f", p_rope={self.p_rope:g}" if self.p_rope is not None else "") + (
            ", fused=True" if self.fused else "")
