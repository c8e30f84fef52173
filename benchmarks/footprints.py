"""The memory each case of the book's suite is expected to need, computed from its shapes.

:func:`attention_footprint`, :func:`rope_footprint` and :func:`lm_footprint` follow what
each path allocates (``tutorial_pkg.attention.backends``, ``benchmarks/articles.py``) and return a
:class:`tutorial_pkg.measure.memory.Footprint`; ``suite.py`` gives each case its footprint, so
that :func:`tutorial_pkg.measure.cases.compare` skips a case that would not fit, with the
reason, before its first call. ``tests/test_benchmark.py`` holds them to measured CPU
memory, ``gpu_check.py`` to a GPU's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tutorial_pkg.measure.memory import Footprint  # noqa: E402

__all__ = ["attention_footprint", "key_bias_here", "lm_footprint", "rope_footprint"]


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _table_side(n: int) -> int:
    """Side of the square bias table the backends cache for length ``n`` (a power of two)."""
    return max(128, 1 << (max(n, 1) - 1).bit_length())


def _mask_cast(device: torch.device, dtype: torch.dtype) -> bool:
    """Does the ``sdpa`` path cast its float32 table to q's dtype in every call?

    In 16 bits, yes, on every device: the kernel is handed a mask of q's dtype, so each
    call shifts the float32 slice (a float32 temporary) and rounds it (a 16-bit copy)
    (``tutorial_pkg.attention.masks.additive_mask``).
    """
    return dtype not in (torch.float32, torch.float64)


def key_bias_here(device: torch.device, dtype: torch.dtype) -> bool:
    """Does ``auto`` take its key row here (else the cached table of ``sdpa``)?"""
    from tutorial_pkg import backends

    try:
        return bool(backends.key_bias_supported(device, dtype, False))
    except (RuntimeError, NotImplementedError):  # a device whose probe cannot run (meta)
        return False  # the table path: the larger footprint


def _part(parts: dict[str, int], label: str, nbytes: int) -> int:
    parts[label] = int(nbytes)
    return int(nbytes)


def attention_footprint(
    encoding: str,
    backend: str,
    *,
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    dtype: torch.dtype,
    train: bool,
    device: str | torch.device,
    key_bias: bool | None = None,
) -> Footprint:
    """The memory one attention case of :func:`attention_suite` needs, from its shapes.

    Counted in bytes from the shapes and element sizes, by following what each path
    allocates (``tutorial_pkg.attention.backends``, ``benchmarks/articles.py``), with
    ``N = b H L d`` (one of q, k, v), ``S = b H L^2`` (the scores), ``B = H L^2`` (one
    bias), ``T`` the side of the cached table (``L`` rounded up to a power of two,
    at least 128), ``e`` the element size of ``dtype``, ``f`` that of float32 (the
    dtype of scores, biases and the naive backend's arithmetic):

    * **inputs** (not in :attr:`~tutorial_pkg.measure.memory.Footprint.need`: they exist
      before any case): q, k, v ``3 N e``, and the output gradient ``N e`` in training;
    * **output** ``N e``; RoPE and the hybrid add the rotated q and k, ``2 N e``;
    * **tables held**: ``sdpa`` (and ``auto`` where it has no key row) a float32
      ``(1, H, T, T)`` table, ``H T^2 f``; built from a float32 bias and its masked copy
      (first call: ``2 H T^2 f`` plus the ``T^2`` distances); on a GPU each call then
      shifts the ``(1, H, L, L)`` slice (``B f``) and rounds it to q's dtype (``B e``);
      ``auto`` with its key row holds ``H T f``; ``sdpa-3d-mask`` holds the table in
      q's dtype, ``H T^2 e`` (built through the float32 table, its shifted copy and the
      16-bit one, ``H T^2 (2 f + e)`` at once); the articles' code a float32 buffer of
      side ``M = max(2048, L)``, built from ``M^2`` float32 distances;
    * **attention weights**, for the naive backend and the articles' code: the
      ``S``-sized float32 scores, their masked copy and the softmax, of which two are
      alive at once, next to the bias ``B f`` (three at once while the bias is built);
      a CPU's SDPA also materialises them for a 3-D mask (its math path);
    * **autograd** (training): the gradients of q, k, v ``3 N e``; a fused kernel's
      log-sum-exp and float32 accumulator of dq (``N f``); the naive path keeps the
      float32 copies of q, k, v and the softmax output for backward, where the output's
      gradient, the softmax's gradient and the weights are alive at once (``3 S f``).

    On a GPU, a mask whose last dimension is not a multiple of 16 is copied, padded, by the
    memory-efficient kernel: one more mask. Small terms (positions, the causal mask's
    ``L^2`` booleans, block masks) are counted where they coexist with the large ones; the
    rest (kernels' workspaces, the allocator's rounding) is left to the headroom of
    :func:`tutorial_pkg.measure.memory.fit_problem`.

    Args:
        encoding: ``"nope"``, ``"rope"``, ``"alibi"`` or ``"hybrid"``, or ``"none"``
            (the limit reference).
        backend: ``"naive"``, ``"sdpa"``, ``"flex"``, ``"auto"``, ``"article"`` or
            ``"sdpa-3d-mask"``.
        batch, heads, seq_len, head_dim: The shapes.
        dtype: Dtype of q, k, v.
        train: Forward and backward (``fwd+bwd``) instead of inference.
        device: Where it runs (the mask rules differ between CPU and GPU).
        key_bias: Whether ``auto`` takes its key row; default: asks
            ``tutorial_pkg.attention._probe.key_bias_supported``.

    Returns:
        The :class:`~tutorial_pkg.measure.memory.Footprint`, with its terms in ``parts``.
    """
    dev = torch.device(device)
    b, h, L, d = batch, heads, seq_len, head_dim
    e, f = _esize(dtype), _esize(torch.promote_types(dtype, torch.float32))
    n, scores, bias = b * h * L * d, b * h * L * L, h * L * L
    side = _table_side(L)
    table = h * side * side
    parts: dict[str, int] = {"inputs: q, k, v" + (", grad_out" if train else ""):
                             (4 if train else 3) * n * e}
    held = build = 0
    call = _part(parts, "output", n * e)
    lse = b * h * L * 4  # the fused kernels' log-sum-exp rows (float32)
    has_bias = encoding in ("alibi", "hybrid")
    if encoding in ("rope", "hybrid"):
        call += _part(parts, "rotated q, k", 2 * n * e)
    if train:
        call += _part(parts, "gradients of q, k, v", 3 * n * e)
    path = backend
    if backend == "auto":
        if key_bias is None:
            key_bias = key_bias_here(dev, dtype)
        path = "row" if (has_bias and key_bias) else "sdpa"
    if path == "sdpa" and not has_bias:
        path = "fused"
    if backend == "flex" or encoding == "none":
        path = "fused"

    if path in ("fused", "row"):
        call += _part(parts, "kernel: log-sum-exp", lse)
        if train:
            call += _part(parts, "kernel: float32 dq accumulator", n * 4)
        if path == "row":
            held = _part(parts, "held: key row (1, H, 1, T) float32", h * side * 4)
    elif path == "sdpa":
        held = _part(parts, "held: table (1, H, T, T) float32", table * f)
        build = parts["first call: table built from two float32 biases, rotated q, k"] = (
            2 * table * f + 4 * side * side + parts.get("rotated q, k", 0))
        call += _part(parts, "kernel: log-sum-exp", lse)
        cast = _mask_cast(dev, dtype)
        if cast:
            call += _part(parts, "per call: shifted slice, float32, and its 16-bit copy",
                          bias * (f + e))
        if dev.type != "cpu" and L % 16:
            call += _part(parts, "kernel: padded copy of the mask (L not a multiple of 16)",
                          h * L * (L + 16 - L % 16) * (e if cast else f))
        if train:
            call += _part(parts, "kernel: float32 dq accumulator", n * 4)
    elif path == "sdpa-3d-mask":
        held = _part(parts, "held: table (1, H, T, T) in q's dtype", table * e)
        build = 2 * table * f + 4 * side * side  # the float32 bias and its masked copy
        if e != f:  # then the masked copy, its shifted copy and the 16-bit table
            build = max(build, table * (2 * f + e))
        parts["first call: float32 biases, the shift and the 16-bit table"] = build
        if dev.type == "cpu":  # a 3-D mask sends CPU SDPA to its math path: scores built
            call += _part(parts, "CPU math path: scores, weights",
                          (4 if train else 3) * scores * f)
        else:
            call += _part(parts, "kernel: log-sum-exp", lse)
            if L % 16:
                call += _part(parts, "kernel: padded copy of the mask (L not a multiple of 16)",
                              h * L * (L + 16 - L % 16) * e)
            if train:
                call += _part(parts, "kernel: float32 dq accumulator", n * 4)
    elif path == "naive":
        upcast = n * f if e != f else 0
        weights = (2 * scores + (bias if has_bias else 0)) * f
        if has_bias:  # building the bias: the scores, the bias and its +0.0 copy
            weights = max(weights, (scores + 2 * bias) * f + 4 * L * L)
        call += _part(parts, "scores, masked scores / weights" + (", bias" if has_bias else ""),
                      weights)
        call += _part(parts, "causal mask (L, L) bool and its negation", 2 * L * L)
        call += _part(parts, "float32 v and output", upcast + n * f)
        if train:
            call += _part(parts, "autograd: float32 q, k kept", 2 * upcast)
            back = 3 * scores * f - weights
            if back > 0:
                call += _part(parts, "backward: weights and two gradients of their size", back)
    elif path == "article":
        side_a = max(2048, L)
        held = _part(parts, "held: buffer (H, M, M) float32", h * side_a * side_a * 4)
        build = held + side_a * side_a * 4
        parts["first call: buffer and the (M, M) distances"] = build
        call += _part(parts, "scores, masked scores / weights", 2 * scores * 4)
        call += _part(parts, "causal mask: float32 tril and its bool", 5 * L * L)
        call += _part(parts, "float32 v and output", 2 * n * 4)
        if train:
            call += _part(parts, "autograd: float32 q, k kept", 2 * n * 4)
            call += _part(parts, "backward: weights and two gradients of their size", scores * 4)
    else:
        raise ValueError(f"no footprint for backend {backend!r}")
    return Footprint(held=held, call=call, build=build, inputs=(4 if train else 3) * n * e,
                     parts=parts)


def rope_footprint(shape: Sequence[int], dtype: torch.dtype) -> Footprint:
    """The memory of one RoPE case of :func:`rope_suite`, from its shape (an upper bound).

    ``Q = b h s d`` elements each for q and k (the inputs, ``2 Q e``); a call writes
    two outputs (``2 Q e``) and, for one of them at a time, at most three float32
    temporaries of its size (the readable and Hugging Face forms: the products and the
    rotated half; the complex form: the float32 copy and the complex product), plus
    the cos/sin tables in float32 and in q's dtype.
    """
    b, h, s, d = shape
    e = _esize(dtype)
    q = b * h * s * d
    parts = {"inputs: q, k": 2 * q * e, "outputs": 2 * q * e,
             "temporaries (three float32 of q's size)": 3 * q * 4,
             "cos, sin tables": 4 * s * d * (4 + e)}
    return Footprint(call=parts["outputs"] + parts["temporaries (three float32 of q's size)"]
                     + parts["cos, sin tables"], inputs=parts["inputs: q, k"], parts=parts)


def lm_footprint(model: torch.nn.Module, batch: int, length: int, *, d_model: int,
                 layers: int, heads: int, vocab: int = 256) -> Footprint:
    """The memory of one training step of :func:`lm_suite`, from the model's shapes.

    ``P`` bytes of parameters (inputs: the models exist before the group runs); held
    after the first step: AdamW's two moments (``2 P``); a step: the gradients (``P``)
    and, an upper bound, per layer 24 float32 tensors of the activations' size
    ``batch x length x d_model`` (norms, q, k, v, the attention output, the MLP's
    hidden layer of 4 d_model twice, their gradients) and three of the scores'
    ``batch x heads x length^2``, the logits ``batch x length x 256`` three times
    (logits, softmax, gradient), and the bias table a ``sdpa`` layer caches.
    """
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    acts = layers * (24 * batch * length * d_model + 3 * batch * heads * length**2) * 4
    logits = 3 * batch * length * vocab * 4
    table = heads * _table_side(length) ** 2 * 4
    parts = {"inputs: parameters": params, "held: AdamW moments": 2 * params,
             "gradients": params, "activations (upper bound)": acts, "logits": logits,
             "bias table (sdpa)": table}
    return Footprint(held=2 * params, call=params + acts + logits + table, inputs=params,
                     parts=parts)
