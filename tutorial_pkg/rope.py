"""Rotary position embedding (RoPE; Su et al., 2021). Chapter 2.

RoPE rotates each pair of query/key features by an angle proportional to the
token position, ``m * theta_i`` with ``theta_i = base ** (-2i / d)``, so that
``<R_m q, R_n k>`` depends on positions only through ``m - n``.

Two pair layouts exist in real checkpoints, and mixing them silently gives wrong
attention scores:

* ``"half"``: pair ``(x[i], x[i + d/2])``. Hugging Face Llama / GPT-NeoX
  (``rotate_half``).
* ``"interleaved"``: pair ``(x[2i], x[2i + 1])``. Meta's original Llama code and
  RoFormer (``torch.view_as_complex``).

They are the same rotation up to a fixed permutation of the feature axis;
:func:`interleaved_to_half` / :func:`half_to_interleaved` permute q/k projection
weights from one to the other (what Hugging Face's Llama conversion script does).

Angles are always computed in float32 (or float64 on request): position ``m``
times a frequency in bfloat16 has an absolute error of about ``m * 2**-8``
radians, i.e. random rotations past a few hundred tokens (chapter 2 measures it).
Only the final ``cos``/``sin`` values are cast to the dtype of q/k.

Shapes: q and k are ``[b, n_h, s, h_d]`` (the layout of
``torch.nn.functional.scaled_dot_product_attention``).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import torch
from torch import nn

from ._checks import (
    as_batched_positions,
    as_positions,
    check_choice,
    check_even,
    check_float_tensor,
    check_positive_float,
    check_positive_int,
    values_readable,
)
from .rope_scaling import (
    dynamic_ntk_scaling,
    linear_scaling,
    llama3_scaling,
    longrope_scaling,
    no_scaling,
    ntk_scaling,
    p_rope_inv_freq,
    yarn_scaling,
)

__all__ = [
    "LAYOUTS",
    "ROPE_SCALINGS",
    "inv_freq",
    "scaled_inv_freq",
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

#: The RoPE pair layouts, "half" (Hugging Face rotate_half) and "interleaved" (Meta, complex).
LAYOUTS = ("half", "interleaved")


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


#: The registry of RoPE scaling rules, by name (see :mod:`tutorial_pkg.rope_scaling`);
#: each is ``fn(dim, base, **params) -> (inv_freq, attention_factor)``, and the rules
#: that depend on the current length (``"dynamic"``, ``"longrope"``) take ``seq_len``.
#: Add an entry to make a new rule available to :func:`scaled_inv_freq` and
#: :class:`RotaryEmbedding`.
ROPE_SCALINGS: dict[str, Callable[..., tuple[torch.Tensor, float]]] = {
    "none": no_scaling,
    "linear": linear_scaling,
    "ntk": ntk_scaling,
    "dynamic": dynamic_ntk_scaling,
    "yarn": yarn_scaling,
    "longrope": longrope_scaling,
    "llama3": llama3_scaling,
}


def _depends_on_length(rule) -> bool:
    return "seq_len" in inspect.signature(rule).parameters


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
            :data:`ROPE_SCALINGS` and the parameters of that rule
            (:mod:`tutorial_pkg.rope_scaling`): ``{"type": "linear", "factor": 4}``,
            ``{"type": "ntk", "factor": 4}``,
            ``{"type": "dynamic", "factor": 4, "original_max_position": 2048}``,
            ``{"type": "yarn", "factor": 4, "original_max_position": 2048}``,
            ``{"type": "longrope", "short_factor": [...], "long_factor": [...],
            "original_max_position": 4096, "factor": 32}``,
            ``{"type": "llama3", "factor": 8, "low_freq_factor": 1,
            "high_freq_factor": 4, "original_max_position": 8192}``.
            :func:`~tutorial_pkg.rope_config.read_rope_config` builds it from a
            Hugging Face config.
        seq_len: current sequence length, for the rules that depend on it
            (``"dynamic"``, ``"longrope"``); ignored by the others. ``None``: the
            original length.

    Returns:
        ``(inv_freq (dim // 2,) float32, attention_factor float)``.
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
    if _depends_on_length(rule):
        params["seq_len"] = seq_len
    try:  # unknown or missing parameter for this rule (a wrong value raises in the rule)
        inspect.signature(rule).bind(dim, base, device=device, **params)
    except TypeError as err:
        raise ValueError(f"scaling parameters for {kind!r} are invalid: {err}") from err
    return rule(dim, base, device=device, **params)


def rope_angles(positions, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotation angles ``m * theta_i``, always in float32 (or float64 if given).

    Args:
        positions: int length or integer tensor ``(s,)``.
        inv_freq: ``(h_d / 2,)`` frequencies.

    Returns:
        ``(s, h_d / 2)`` angles in float32 (float64 if ``inv_freq`` is float64).
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

    Partial rotary: when ``cos`` has ``r/2`` columns with ``r < h_d``, only the
    first ``r`` features are rotated and the rest pass through (GPT-NeoX style).

    **One column per pair, not Hugging Face's tables.** ``cos``/``sin`` hold one angle
    per rotated pair, ``[..., r/2]`` (what :meth:`RotaryEmbedding.cos_sin` returns).
    Hugging Face's rotary embeddings return ``[b, s, r]`` with the halves duplicated
    (``cat(freqs, freqs)``); read as pairs, those would rotate ``2r`` features by the
    wrong angles. Pass their first half, ``cos[..., : r // 2]`` and ``sin[..., : r // 2]``
    (``[:, None]`` for the head axis), with ``layout="half"``. ``apply_rope`` refuses
    HF's form with a ``ValueError`` saying so: by shape where it covers more than
    ``h_d`` features (full rotary), and by value (both halves of ``cos`` and of ``sin``
    equal, some angle not 0) where it fits, which it checks where reading the
    tables is free (a CPU tensor, outside compilation; not on a GPU, where the read
    would synchronise, so there only the shape check runs).

    Args:
        x: ``[..., s, h_d]`` queries or keys (e.g. ``[b, n_h, s, h_d]``).
        cos: ``[s, r/2]`` (or broadcastable, e.g. ``[b, 1, s, r/2]``), float32.
        sin: same shape as ``cos``.
        layout: ``"half"`` (pairs ``i, i + r/2``) or ``"interleaved"`` (``2i, 2i+1``).

    Returns:
        Tensor of ``x``'s shape and dtype.
    """
    check_float_tensor("x", x)  # an integer x would silently truncate cos/sin to 0/1
    _check_cos_sin(x, cos, sin)
    _refuse_hf_tables(cos, sin)
    return _rope(x, cos, sin, layout)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """:func:`apply_rope` on checked arguments (the package's own tables), no checks."""
    half = cos.shape[-1]
    rot = 2 * half
    # Cast the (fp32-computed) cos/sin once to x's dtype: the product then runs in
    # x's dtype, as Hugging Face does; the angles themselves were never rounded.
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if layout == "half":
        x1, x2 = x_rot[..., :half], x_rot[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    elif layout == "interleaved":
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        check_choice("layout", layout, LAYOUTS)
    if x_pass.shape[-1]:
        out = torch.cat((out, x_pass), dim=-1)
    return out


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


def _apply_rope_fast(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str):
    """:func:`apply_rope` in fewer passes over ``x``; equal up to rounding (chapter 5).

    :func:`apply_rope` is the readable form: four products, a difference, a sum and
    a concatenation, i.e. seven elementwise kernels and six temporaries of half
    the size of ``x``. Elementwise kernels are limited by memory traffic, so here:

    * half layout: ``out = x * [cos, cos]``, then ``out[:, :r/2] -= x2 sin`` and
      ``out[:, r/2:] += x1 sin`` in place (``addcmul_``): three kernels, one
      allocation; on a CPU, for large ``x`` without autograd, run block by block
      (:func:`_rope_half_chunked`) so that the tensors cross memory about once;
    * interleaved layout in float32/float64: one complex multiplication, the
      pairs ``(x[2i], x[2i+1])`` viewed as complex numbers (Meta's form);
      otherwise the three-kernel form on strided views.

    Both keep autograd (the in-place updates touch a fresh tensor that no
    backward formula saved). Partial rotary falls back to :func:`apply_rope`.
    """
    half = cos.shape[-1]
    if 2 * half != x.shape[-1]:
        return _rope(x, cos, sin, layout)
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    if layout == "half":
        if _chunkable(x, c):
            return _rope_half_chunked(x, c, s)
        out = x * torch.cat((c, c), dim=-1)
        out[..., :half].addcmul_(x[..., half:], s, value=-1)
        out[..., half:].addcmul_(x[..., :half], s)
        return out
    pairs = x.unflatten(-1, (half, 2))
    if (
        x.dtype in (torch.float32, torch.float64)
        and pairs.stride(-1) == 1
        and pairs.storage_offset() % 2 == 0
        and all(st % 2 == 0 for st in pairs.stride()[:-1])
    ):
        rotated = torch.view_as_complex(pairs) * torch.complex(c, s)
        return torch.view_as_real(rotated).flatten(-2)
    out = x * torch.stack((c, c), dim=-1).flatten(-2)
    out[..., 0::2].addcmul_(x[..., 1::2], s, value=-1)
    out[..., 1::2].addcmul_(x[..., 0::2], s)
    return out


#: Bytes of ``x`` per block of the chunked CPU rotation: a block of ``x`` and of the
#: output (2 x 256 KiB) stay in a core's L2 cache (512 KiB and up on current x86 CPUs).
_ROPE_CHUNK_BYTES = 256 * 1024


def _chunkable(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether :func:`_rope_half_chunked` applies: a large contiguous CPU ``x``, one
    ``[s, h_d/2]`` table for every leading index, and no autograd (``out=`` has none)."""
    return (
        x.device.type == "cpu"
        and cos.dim() == 2
        and x.dim() >= 2
        and cos.shape[0] == x.shape[-2]
        and x.is_contiguous()
        and x.numel() * x.element_size() > 2 * _ROPE_CHUNK_BYTES
        and not (torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad))
    )


def _rope_half_chunked(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The three-kernel half-layout rotation of :func:`_apply_rope_fast`, block by block.

    ``x`` ``[..., s, h_d]`` contiguous, ``c``/``s`` ``[s, h_d/2]`` in ``x``'s dtype. The
    same three kernels per element (``x * [cos, cos]``, then two ``addcmul_``), so the
    same bits, but run on blocks of about :data:`_ROPE_CHUNK_BYTES` written into one
    preallocated output: the first kernel streams a block from memory and the two
    others find it in cache, so ``x`` and the output cross the memory bus about once,
    as in a copy, instead of three times.
    """
    seq, dim = x.shape[-2], x.shape[-1]
    half = dim // 2
    out = torch.empty_like(x)
    row_bytes = dim * x.element_size()
    per_slice = max(1, _ROPE_CHUNK_BYTES // (seq * row_bytes))  # whole [s, h_d] slices
    step = seq if per_slice > 1 else max(1, _ROPE_CHUNK_BYTES // row_bytes)  # or positions

    def blocks(t: torch.Tensor) -> list[torch.Tensor]:
        # every block's view made up front (split is one call), not sliced in the loop
        return [b for sl in t.view(-1, seq, t.shape[-1]).split(per_slice)
                for b in sl.split(step, dim=1)]

    xs, outs = x.view(-1, seq, dim), out.view(-1, seq, dim)
    n_pos = len(range(0, seq, step))
    tables = list(zip(torch.cat((c, c), dim=-1).split(step), s.split(step), strict=True))
    for i, (xb, x1, x2, ob, o1, o2) in enumerate(zip(
        blocks(xs), blocks(xs[..., :half]), blocks(xs[..., half:]),
        blocks(outs), blocks(outs[..., :half]), blocks(outs[..., half:]), strict=True,
    )):
        cc, sb = tables[i % n_pos]
        torch.mul(xb, cc, out=ob)
        o1.addcmul_(x2, sb, value=-1)
        o2.addcmul_(x1, sb)
    return out


def _rope_half_body(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """The rotation that ``torch.compile`` fuses into one kernel (half layout).

    ``cs`` is ``[s, 2, h_d/2]``: ``cos`` and ``sin`` stacked, already in ``x``'s
    dtype, as in :func:`apply_rope` (one table: one stream of loads per row). The
    generated kernel computes each element in float32 and rounds once. Tables in
    float32 would be more precise for 16-bit ``x`` but measured slower in bfloat16
    on CPU (more bytes per element), and the eager path rounds them too.
    """
    half = cs.shape[-1]
    cos, sin = cs[..., 0, :], cs[..., 1, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope_half_body_pair(q, k, cs):
    # q and k in one compiled call: one launch, one guard check, and (same shapes)
    # one loop that loads and converts each table row once for both
    return _rope_half_body(q, cs), _rope_half_body(k, cs)


_fused_rope: dict = {}


def _fused_rope_fn(pair: bool = False):
    """The fused rotation compiled once per process, or None if compiling failed.

    ``dynamic=True``: one compilation serves all batch sizes, head counts and
    lengths, and q and k of the same shape share their size symbols, so inductor
    rotates both in the same loop. Marking each tensor's dimensions dynamic one by
    one instead (``maybe_mark_dynamic``) gave q and k separate symbols and two
    loops that each stream the cos/sin table again: measured 1.45x a copy of q and
    k instead of 1.2x in float32 on CPU, 2.3x instead of 1.7x in bfloat16.
    """
    key = "pair" if pair else "one"
    if key not in _fused_rope:  # compiling happens at the first call
        body = _rope_half_body_pair if pair else _rope_half_body
        _fused_rope[key] = torch.compile(body, dynamic=True)
    return _fused_rope[key]


def _call_fused(pair: bool, *args):
    """Run the fused rotation; None (and a warning, once) if it cannot compile here."""
    fn = _fused_rope_fn(pair)
    if fn is None:
        return None
    try:
        return fn(*args)
    except Exception as err:  # pragma: no cover - no C++ compiler / unsupported platform
        warnings.warn(f"fused RoPE failed to compile, using eager ops: {err}", RuntimeWarning,
                      stacklevel=3)
        _fused_rope["one"] = _fused_rope["pair"] = None
        return None


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
        x: ``[..., s, h_d]`` real tensor; pairs ``(x[2i], x[2i+1])`` are complex numbers.
        freqs_cis: complex ``(s, h_d/2)`` from :func:`precompute_freqs_cis`.

    Returns:
        Tensor of ``x``'s shape and dtype.
    """
    check_float_tensor("x", x)
    if x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., s, h_d] with an even h_d (pairs are complex numbers), "
                         f"got shape {tuple(x.shape)}")
    if not isinstance(freqs_cis, torch.Tensor) or not freqs_cis.is_complex():
        raise TypeError("freqs_cis must be a complex tensor (s, h_d/2) from "
                        "precompute_freqs_cis")
    if tuple(freqs_cis.shape[-2:]) != (x.shape[-2], x.shape[-1] // 2):
        raise ValueError(
            f"freqs_cis must have shape (s, h_d/2)=({x.shape[-2]}, {x.shape[-1] // 2}), got "
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
        w: ``(n_heads * h_d, in)`` weight (or ``(n_heads * h_d,)`` bias) of q or k.
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
    """RoPE for ``[b, n_h, s, h_d]`` queries and keys, with a cos/sin cache.

    The cache holds ``cos``/``sin`` of the fp32 angles for positions ``0..N-1`` and
    grows (doubling) when a larger position arrives; it is a non-persistent buffer,
    so it is not saved in ``state_dict`` and follows ``.to(device)``.

    Args:
        head_dim: features per head ``h_d``.
        base: RoPE base ("theta").
        rotary_dim: features rotated per head (even, <= ``head_dim``); default all.
        layout: ``"half"`` (Hugging Face) or ``"interleaved"`` (Meta).
        scaling: context extension, see :func:`scaled_inv_freq`. Rules that depend on
            the current length (``"dynamic"``, ``"longrope"``) are re-evaluated at
            each call for ``seq_len`` = the largest position + 1, as Hugging Face's
            ``dynamic_rope_update`` does: ``"longrope"`` uses its long factors when
            ``seq_len > original_max_position``; ``"dynamic"`` grows its base when
            ``seq_len`` exceeds the largest length seen so far and returns to the
            original base when ``seq_len < original_max_position``. Keys already
            in a KV cache keep the angles they were rotated with.
        p_rope: p-RoPE's ``p`` (Barbero et al., 2025): only the highest fraction
            ``p`` of the frequencies rotate, the other pairs pass unrotated
            (:func:`~tutorial_pkg.rope_scaling.p_rope_inv_freq`); ``None`` or 1:
            all rotate. Applied after ``scaling``.
        max_position: optional hard limit; positions >= it raise ``ValueError``.
        fused: rotate (half layout, full rotary) with one ``torch.compile``-d
            kernel that reads ``x`` once and writes the result once (each element
            computed in float32, rounded once). The eager path needs three
            passes; on CPU the fused one is ~4x faster for large q/k and within
            1.3x (float32) / 2x (bfloat16) of copying them (chapter 5).
            It compiles on first use (seconds; sizes are symbolic, so again only
            for a new dtype or grad mode, or once more when q and k differ in
            shape, as with grouped-query attention) and needs a C++ compiler
            (Triton on GPU); if compiling fails it warns and stays eager. After 8
            variants PyTorch runs the function uncompiled.

    :meth:`rotate` and :meth:`forward` compute what :func:`apply_rope` computes (up
    to rounding) in three elementwise passes over ``x`` instead of seven: on CPU
    ~1.5x faster (chapter 5).
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
        max_position: int | None = None,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = check_even("head_dim", head_dim)
        self.rotary_dim = head_dim if rotary_dim is None else check_even("rotary_dim", rotary_dim)
        if self.rotary_dim > head_dim:
            raise ValueError(f"rotary_dim must be <= head_dim={head_dim}, got {rotary_dim}")
        self.base = check_positive_float("base", base)
        self.layout = check_choice("layout", layout, LAYOUTS)
        self.max_position = (
            None if max_position is None else check_positive_int("max_position", max_position)
        )
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {type(fused).__name__}")
        self.fused = fused
        if p_rope is not None:
            p_rope_inv_freq(torch.ones(1), p_rope)  # checks p_rope in [0, 1]
            p_rope = float(p_rope)
        self.p_rope = p_rope
        self._fused_cs: dict = {}  # (dtype, device) -> stacked cos/sin for the fused kernel
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("cos_cached", torch.empty(0, self.rotary_dim // 2), persistent=False)
        self.register_buffer("sin_cached", torch.empty(0, self.rotary_dim // 2), persistent=False)
        self.set_scaling(scaling)

    @classmethod
    def from_config(cls, config, layer_type: str | None = None, *, layout: str | None = None,
                    **kwargs) -> RotaryEmbedding:
        """The RoPE of a Hugging Face model config (dict or ``PretrainedConfig``).

        Reads it with :func:`~tutorial_pkg.rope_config.read_rope_config` (which raises
        ``ValueError`` naming an unknown ``rope_type``, an unknown key or a missing
        one, and ``layout`` where it cannot know the pair layout: a ``model_type`` it
        does not know, or none); ``layer_type`` picks one entry of a per-layer-type
        ``rope_parameters`` (Gemma 3: ``"full_attention"`` / ``"sliding_attention"``);
        ``layout`` (``"half"``/``"interleaved"``) overrides the config's. ``kwargs``
        (``max_position``, ``fused``) go to the constructor.
        """
        from .rope_config import read_rope_config

        cfg = read_rope_config(config, layer_type=layer_type, layout=layout)
        return cls(**{**cfg.kwargs(), **kwargs})

    def set_scaling(self, scaling: dict | None) -> None:
        """Change the context-extension rule (e.g. at evaluation time); clears the cache."""
        theta, factor = scaled_inv_freq(
            self.rotary_dim, self.base, scaling, device=self.inv_freq.device
        )
        self.scaling = None if scaling is None else dict(scaling)
        rule = ROPE_SCALINGS[scaling["type"]] if scaling is not None else None
        # for a length-dependent rule: the original length, and the length its
        # current frequencies were computed for (None: the original ones)
        self._length_rule = None
        if rule is not None and _depends_on_length(rule):
            self._length_rule = (scaling["type"], scaling.get("original_max_position"))
        self._freq_len = None
        self._set_frequencies(theta, factor)

    def _set_frequencies(self, theta: torch.Tensor, attention_factor: float) -> None:
        device = self.inv_freq.device
        if self.p_rope is not None:
            theta = p_rope_inv_freq(theta, self.p_rope)
        self.inv_freq, self.attention_factor = theta.to(device), attention_factor
        self.cos_cached = torch.empty(0, self.rotary_dim // 2, device=device)
        self.sin_cached = torch.empty(0, self.rotary_dim // 2, device=device)
        self._fused_cs = {}

    def _follow_length(self, end: int) -> None:
        """Re-evaluate a length-dependent rule for ``seq_len = end`` (Hugging Face's
        ``dynamic_rope_update``); nothing for the other rules."""
        if self._length_rule is None or end <= 0:
            return
        kind, original = self._length_rule
        if kind == "longrope":  # long factors past the original length, short ones up to it
            current = self._freq_len is not None
            want = end > original
            if want != current:
                self._recompute(end if want else None)
            return
        cached = original if self._freq_len is None else self._freq_len
        if end > cached:  # growth: the base for this length
            self._recompute(end)
        elif end < original < cached:  # back under the original length: original base
            self._recompute(None)

    def _recompute(self, seq_len: int | None) -> None:
        theta, factor = scaled_inv_freq(self.rotary_dim, self.base, self.scaling,
                                        seq_len=seq_len, device=self.inv_freq.device)
        self._set_frequencies(theta, factor)
        self._freq_len = seq_len

    def _apply(self, fn, *args, **kwargs):
        # .half()/.to(torch.bfloat16) would round inv_freq (angle error ~ m * 2**-9 rad)
        # and the cos/sin cache: recompute the frequencies in float32 after any cast.
        out = super()._apply(fn, *args, **kwargs)
        self.set_scaling(self.scaling)
        return out

    def _grow(self, n: int, device: torch.device) -> None:
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
            self.cos_cached = self.cos_cached[:0].to(device)
        if self.cos_cached.shape[0] >= n:
            return
        size = max(n, 2 * self.cos_cached.shape[0], 256)
        self._fused_cs = {}
        angles = rope_angles(torch.arange(size, device=device), self.inv_freq)
        self.cos_cached = angles.cos() * self.attention_factor
        self.sin_cached = angles.sin() * self.attention_factor

    def cos_sin(self, positions: torch.Tensor | None = None, *, start: int = 0, length=None):
        """``cos``/``sin`` (float32, ``(s, rotary_dim/2)``) for positions.

        Either ``positions`` (integer tensor ``(s,)``) or ``start`` and ``length``
        (positions ``start..start+length-1``, served as a slice of the cache).
        Explicit positions are read back to size the cache: on a GPU that is a
        synchronisation (:meth:`rotate` and attention never need it).
        """
        rows = self._rows(positions, start, length)
        return self.cos_cached[rows], self.sin_cached[rows]

    def _rows(self, positions, start: int, length) -> slice | torch.Tensor:
        """Check the positions and grow the cache to them; the cache rows to read.

        A slice for ``start``/``length`` (a view, no copy), the checked integer
        tensor for explicit ``positions`` (the cache moves to its device). Explicit
        positions are read back to size the cache: a synchronisation on a GPU, so only
        :meth:`cos_sin` takes this path, never attention (:meth:`_tables`).
        """
        device = self.inv_freq.device if positions is None else positions.device
        if positions is None:
            check_positive_int("length", length)
            end = _check_start(start) + length
        else:
            positions = as_positions("positions", positions)
            end = int(positions.max()) + 1 if positions.numel() else 0
        if self.max_position is not None and end > self.max_position:
            raise ValueError(
                f"positions must be < max_position={self.max_position}, got up to {end - 1}"
            )
        self._follow_length(end)
        self._grow(end, torch.device(device))
        return slice(start, end) if positions is None else positions

    def _check(self, name: str, x: torch.Tensor) -> None:
        check_float_tensor(name, x)
        if x.dim() < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"{name} must be [..., s, head_dim={self.head_dim}], got shape {tuple(x.shape)}"
            )

    def _positions_for(self, x: torch.Tensor, positions, name: str, check_values: bool):
        """Checked explicit positions for ``x`` ``[b, n_h, s, h_d]``: int64 ``(s,)`` or
        ``[1 or b, 1, s]`` (one row per sequence, broadcast over heads)."""
        if positions.dim() == 1:
            positions = as_positions("positions", positions) if check_values else positions
            if positions.numel() != x.shape[-2]:
                raise ValueError(
                    f"positions must have length s={x.shape[-2]}, got {positions.numel()}"
                )
            return positions.long().to(x.device)
        if x.dim() != 4:
            raise ValueError(
                f"positions [b, s] need {name} as [b, n_h, s, h_d], got shape {tuple(x.shape)}"
                f" (pass positions as (s,) for other shapes)"
            )
        batch = x.shape[0]
        positions = as_batched_positions("positions", positions, batch, x.shape[-2],
                                         check_values=check_values)
        return positions[:, None, :].to(x.device)

    def _tables(self, x: torch.Tensor, positions, start: int, name: str, check_values: bool):
        """float32 ``cos, sin`` broadcastable to ``x``, and the cache rows they came from.

        Default positions (``start + arange(s)``) read a slice of the cache: no copy and
        nothing read back from the device. Explicit positions are turned into angles
        directly (the same float32 products as the cache, so the same values), which
        needs no bound on them and so no device synchronisation, as Hugging Face does
        with ``position_ids``. Returns None if ``x`` has no positions.
        """
        self._check(name, x)
        if x.shape[-2] == 0:
            return None
        if positions is None:
            if x.device == self.inv_freq.device:
                rows = self._rows(None, start, x.shape[-2])
                return self.cos_cached[rows], self.sin_cached[rows], rows
            # x lives elsewhere than this module: the angles are built on x's device,
            # from the frequencies moved there, not copied from the cache at every call;
            # the largest position is known on the host
            end = _check_start(start) + x.shape[-2]
            if self.max_position is not None and end > self.max_position:
                raise ValueError(
                    f"positions must be < max_position={self.max_position}, got up to {end - 1}"
                )
            self._follow_length(end)
            return (*self._angle_tables(torch.arange(start, end, device=x.device), x.device),
                    None)
        if not isinstance(positions, torch.Tensor):
            positions = as_positions("positions", positions, device=x.device)
        positions = self._positions_for(x, positions, name, check_values)
        # the two reads back below are opt-in (max_position, a length-dependent rule);
        # each is a device synchronisation per call on a GPU, and plain RoPE has neither
        if self.max_position is not None and check_values:
            end = int(positions.max()) + 1
            if end > self.max_position:
                raise ValueError(
                    f"positions must be < max_position={self.max_position}, got up to {end - 1}"
                )
        if self._length_rule is not None:  # reads the largest position back, as HF does
            self._follow_length(int(positions.max()) + 1)
        return (*self._angle_tables(positions, x.device), None)

    def _angle_tables(self, positions: torch.Tensor, device: torch.device):
        """float32 ``cos, sin`` of ``positions`` (any shape), built on ``device``."""
        inv = self.inv_freq.to(device)  # a constant: moved to where the call runs
        angles = positions.to(inv.dtype)[..., None] * inv
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor

    def _fusable(self) -> bool:
        return self.fused and self.layout == "half" and self.rotary_dim == self.head_dim

    def _rotate(self, tables, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate tensors of one dtype and device by the ``(cos, sin, rows)`` of :meth:`_tables`.

        Fused: one compiled call on a stacked ``[..., s, 2, h_d/2]`` cos/sin table in the
        tensors' dtype. For cache rows, the stacked table is kept per dtype and device
        (a few hundred KiB), so that a call slices it instead of casting two tables.
        Otherwise (or if compiling fails) the three-pass eager form on float32 tables.
        """
        cos, sin, rows = tables
        x = xs[0]
        if self._fusable():
            if rows is None:
                cs = torch.stack((cos, sin), dim=-2).to(x.dtype)
            else:
                key = (x.dtype, x.device)
                full = self._fused_cs.get(key)
                if full is None:
                    full = torch.stack((self.cos_cached, self.sin_cached), dim=-2)
                    full = self._fused_cs[key] = full.to(x.device, x.dtype)
                cs = full[rows]
            out = _call_fused(len(xs) == 2, *xs, cs)
            if out is not None:
                return out if len(xs) == 2 else (out,)
        cos, sin = cos.to(x.device), sin.to(x.device)
        return tuple(_apply_rope_fast(t, cos, sin, self.layout) for t in xs)

    def rotate(
        self, x: torch.Tensor, positions=None, *, start: int = 0, check_positions: bool = True
    ) -> torch.Tensor:
        """Apply RoPE to ``x`` ``[b, n_h, s, h_d]``.

        Args:
            x: queries or keys ``[b, n_h, s, h_d]`` (or ``[..., s, h_d]``).
            positions: ``(s,)`` or ``[b, s]`` integer positions (Hugging Face
                ``position_ids``); default ``start + arange(s)``.
            start: first position when ``positions`` is not given.
            check_positions: check the values of explicit positions (not negative,
                below ``max_position``): this reads them back from the device, so
                attention, which checks them once per forward pass, turns it off.
        """
        tables = self._tables(x, positions, start, "x", check_positions)
        return x if tables is None else self._rotate(tables, x)[0]

    def forward(self, q, k, q_pos=None, k_pos=None, *, start: int = 0,
                check_positions: bool = True):
        """Rotate queries and keys; see :meth:`rotate`. Returns ``(q, k)``.

        When q and k sit at the same positions (``q_pos is k_pos``, e.g. both
        ``None``), the tables are built once, and the fused path rotates both in
        one compiled call.
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
