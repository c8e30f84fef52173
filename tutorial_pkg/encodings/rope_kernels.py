"""The RoPE rotation as it runs: :func:`rotate_pairs`, and the compiled kernel. Chapters 2, 5.

:func:`~tutorial_pkg.encodings.rope.apply_rope`,
:class:`~tutorial_pkg.encodings.rope.RotaryEmbedding` and every encoding that rotates call
:func:`rotate_pairs`; ``rope._rope`` is the spec it is tested against (the pair rotation
computed in float32 at least, rounded once to ``x``'s dtype; the fast forms may fuse a
product into a sum, one rounding fewer). It takes checked arguments and checks nothing
itself. Per layout and dtype it picks the form with the fewest passes over memory:

* **half layout** (pairs ``i, i + r/2``): the *three-kernel form* ``out = x * [cos, cos]``,
  then ``out[..., :r/2] -= x2 * sin`` and ``out[..., r/2:] += x1 * sin`` in place on the
  fresh output (``addcmul_`` may fuse its product into the sum). On a CPU, for a large
  contiguous ``x`` without autograd, it runs block by block (whole ``[s, d]`` slices, or
  rows of one) so that ``x`` and the output cross memory about once; same bits.
* **interleaved layout** (pairs ``2i, 2i + 1``) in float32/float64: one complex
  multiplication (Meta's form); elsewhere the three-kernel form on strided views.
* **16-bit x** (bfloat16, float16): the same forms in float32, with float32 tables, and
  one rounding to ``x``'s dtype at the end (each block upcast on the blocked path).
* **partial rotary** (``2 * cos.shape[-1] < x.shape[-1]``): the first ``r`` features are
  rotated, the rest copied.

:func:`fused_rope` (``RotaryEmbedding(fused=True)``) is one ``torch.compile``-d kernel for
the half layout, each element computed in float32 and rounded once. Where compiling fails
(no C++ compiler, unsupported platform) it warns once and returns ``None``; the caller
falls back to :func:`rotate_pairs`.

Shapes: ``x`` is ``[..., s, d]``; ``cos``/``sin`` are ``[s, r/2]`` or broadcastable (e.g.
``[b, 1, s, r/2]``), any floating dtype (they are cast to the compute dtype).
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["BLOCK_BYTES", "rotate_pairs", "fused_rope"]

#: Bytes of ``x`` per block of the blocked CPU rotation: large enough that the kernel
#: calls per block cost little next to their work, small enough that the block's output
#: (and its float32 scratch, for 16-bit ``x``) are still in cache for the later passes.
BLOCK_BYTES = 512 * 1024


def rotate_pairs(cos: torch.Tensor, sin: torch.Tensor, layout: str,
                 *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rotate the first ``r = 2 * cos.shape[-1]`` features of each of ``xs``.

    Args:
        cos: ``[s, r/2]`` (or broadcastable to ``x[..., : r/2]``).
        sin: same shape as ``cos``.
        layout: ``"half"`` or ``"interleaved"`` (not checked).
        xs: ``x`` or ``q, k``: ``[..., s, d]`` floating tensors of one dtype and device,
            ``d >= r``. The tables are cast (and, block by block, laid out) once for all.

    Returns:
        New tensors of the shapes and dtype of ``xs``; they keep autograd (the in-place
        updates touch only the fresh outputs, which no backward formula saved).
    """
    # 16-bit x is computed in float32 (tables too) and rounded once at the end
    c, s = (t.to(_compute_dtype(xs[0].dtype)) for t in (cos, sin))
    rot = 2 * c.shape[-1]
    shared: dict = {}  # tables laid out once for q and k: blocks per (s, d), complex
    out = []
    for x in xs:
        if rot < x.shape[-1]:  # partial rotary: the other features pass through
            out.append(torch.cat((_rotate(x[..., :rot], c, s, layout, shared), x[..., rot:]),
                                 dim=-1))
        else:
            out.append(_rotate(x, c, s, layout, shared))
    return tuple(out)


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, layout: str,
            shared: dict) -> torch.Tensor:
    """All features of ``x`` rotated, tables already in the compute dtype."""
    if layout != "half":
        return _rope_interleaved(x, c, s, shared)
    if _blockable(x, c):
        key = x.shape[-2:]
        if key not in shared:
            shared[key] = _block_tables(x, c, s)
        return _rope_half_blocked(x, *shared[key])
    if x.dtype != c.dtype:  # 16-bit: the blocked form's ops on all of x at once
        return _rope_half_upcast(x, c, s)
    half = c.shape[-1]
    y = x * torch.cat((c, c), dim=-1)
    y[..., :half].addcmul_(x[..., half:], s, value=-1)
    y[..., half:].addcmul_(x[..., :half], s)
    return y


def _rope_half_upcast(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x`` in ``c``'s dtype, ``x * [c, c] + [x2, x1] * [-s, s]`` there, rounded once to
    ``x``'s dtype: the 16-bit half-layout rotation without blocks (any ``x``, autograd)."""
    half = c.shape[-1]
    xf = x.to(c.dtype)
    y = xf * torch.cat((c, c), dim=-1)
    y.addcmul_(torch.cat((xf[..., half:], xf[..., :half]), dim=-1), torch.cat((-s, s), dim=-1))
    return y.to(x.dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the rotation is computed in: float32 for 16-bit ``x``, else ``x``'s."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _rope_interleaved(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor,
                      shared: dict) -> torch.Tensor:
    if x.dtype != c.dtype:  # 16-bit x: in float32 (c, s are), one rounding at the end
        return _rope_interleaved(x.to(c.dtype), c, s, shared).to(x.dtype)
    half = c.shape[-1]
    pairs = x.unflatten(-1, (half, 2))
    if (
        x.dtype in (torch.float32, torch.float64)
        and pairs.stride(-1) == 1
        and pairs.storage_offset() % 2 == 0
        and all(st % 2 == 0 for st in pairs.stride()[:-1])
    ):
        if "cis" not in shared:
            shared["cis"] = torch.complex(c, s)  # e^{i m theta}, built once for q and k
        rotated = torch.view_as_complex(pairs) * shared["cis"]
        return torch.view_as_real(rotated).flatten(-2)
    out = x * torch.stack((c, c), dim=-1).flatten(-2)
    out[..., 0::2].addcmul_(x[..., 1::2], s, value=-1)
    out[..., 1::2].addcmul_(x[..., 0::2], s)
    return out


def _blockable(x: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether the blocked form applies: a large contiguous CPU ``x``, one ``[s, d/2]``
    table (leading axes of size 1) for every leading index, and no autograd (``out=``
    records none)."""
    return (
        x.device.type == "cpu"
        and x.dim() >= 2
        and c.dim() >= 2
        and all(n == 1 for n in c.shape[:-2])
        and c.shape[-2] == x.shape[-2]
        and x.is_contiguous()
        and x.numel() * x.element_size() > 2 * BLOCK_BYTES
        and not (torch.is_grad_enabled() and (x.requires_grad or c.requires_grad))
    )


def _block_tables(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor):
    """``(per_slice, step, cos blocks, sin blocks)`` for :func:`_rope_half_blocked`.

    A block is ``per_slice`` whole ``[s, d]`` slices of ``x``, or ``step`` positions
    of one slice, about :data:`BLOCK_BYTES` of ``x``. Per block the tables are ``[cos,
    cos]`` and, for 16-bit ``x`` (tables in float32), ``[-sin, sin]`` (one ``addcmul_``
    over whole rows), else ``sin``.
    """
    seq, dim = x.shape[-2], x.shape[-1]
    c, s = c.reshape(seq, dim // 2), s.reshape(seq, dim // 2)
    row_bytes = dim * x.element_size()
    per_slice = max(1, BLOCK_BYTES // (seq * row_bytes))
    step = seq if per_slice > 1 else max(1, BLOCK_BYTES // row_bytes)
    sin_rows = torch.cat((-s, s), dim=-1) if x.dtype != c.dtype else s
    return per_slice, step, torch.cat((c, c), dim=-1).split(step), sin_rows.split(step)


def _rope_half_blocked(x: torch.Tensor, per_slice: int, step: int, cos_blocks,
                       sin_blocks) -> torch.Tensor:
    """The three-kernel half-layout form, block by block into one preallocated output.

    Per block: ``out = x * [cos, cos]`` (streams the block from memory), then the sine
    terms on the block while it is in cache: ``out1 -= x2 sin`` and ``out2 += x1 sin``,
    each element with the same two roundings as the three-kernel form (``x1 * cos``,
    then ``- x2 * sin`` added), so the same bits.

    16-bit ``x`` (float32 tables): per block, ``x`` upcast into a float32 scratch block,
    its halves swapped into a second one, ``xf * [cos, cos]``, then ``+ [x2, x1] * [-sin,
    sin]`` (one ``addcmul`` over whole rows) in float32, written into the 16-bit output
    (one rounding): the ops of the unblocked 16-bit form, so the same bits.
    """
    seq, dim = x.shape[-2], x.shape[-1]
    half = dim // 2
    out = torch.empty_like(x)
    n_pos = len(cos_blocks)

    def blocks(t: torch.Tensor):
        # every block's view made by one split call, not sliced in the loop
        groups = t.split(per_slice)
        return groups if n_pos == 1 else [b for g in groups for b in g.split(step, dim=1)]

    xs, outs = x.view(-1, seq, dim), out.view(-1, seq, dim)
    if x.dtype != cos_blocks[0].dtype:
        x_blocks = blocks(xs)
        scratch = torch.empty(2, x_blocks[0].numel(), dtype=cos_blocks[0].dtype)
        for i, (xb, ob) in enumerate(zip(x_blocks, blocks(outs), strict=True)):
            xf, swapped = (t[: xb.numel()].view(xb.shape) for t in scratch)
            xf.copy_(xb)
            torch.cat((xf[..., half:], xf[..., :half]), dim=-1, out=swapped)
            xf.mul_(cos_blocks[i % n_pos])
            # computed in float32, rounded once on the store into the 16-bit output
            torch.addcmul(xf, swapped, sin_blocks[i % n_pos], out=ob)
        return out
    x1_blocks, x2_blocks = blocks(xs[..., :half]), blocks(xs[..., half:])
    x_blocks = blocks(xs)
    for i, (xb, x1, x2, ob, o1, o2) in enumerate(zip(
        x_blocks, x1_blocks, x2_blocks, blocks(outs), blocks(outs[..., :half]),
        blocks(outs[..., half:]), strict=True,
    )):
        torch.mul(xb, cos_blocks[i % n_pos], out=ob)
        o1.addcmul_(x2, sin_blocks[i % n_pos], value=-1)
        o2.addcmul_(x1, sin_blocks[i % n_pos])
    return out


# --------------------------------------------------------------------------- fused (compiled)
def _rope_half_body(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """The rotation ``torch.compile`` fuses into one kernel (half layout).

    ``cs`` is ``[s, 2, d/2]``: ``cos`` and ``sin`` stacked (one table: one stream of loads
    per row) in the compute dtype, float32 for 16-bit ``x``: ``x`` is upcast inside the
    kernel and each element rounded once to ``x``'s dtype, as the eager path does.
    """
    half = cs.shape[-1]
    cos, sin = cs[..., 0, :], cs[..., 1, :]
    xf = x.to(cs.dtype)  # fused into the kernel's loads: no extra pass
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _rope_half_body_pair(q, k, cs):
    # q and k in one compiled call: one launch, one guard check, and (same shapes)
    # one loop that loads each table row once for both
    return _rope_half_body(q, cs), _rope_half_body(k, cs)


#: The compiled bodies ("one", "pair"), built at first use; None once compiling failed.
_compiled: dict = {}


def _compiled_body(pair: bool):
    key = "pair" if pair else "one"
    if key not in _compiled:
        # dynamic=True: one compilation serves every batch, head count and length, and
        # q and k of one shape share their size symbols, so both run in one loop
        _compiled[key] = torch.compile(_rope_half_body_pair if pair else _rope_half_body,
                                       dynamic=True)
    return _compiled[key]


def fused_rope(cs: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """Rotate one or two tensors (half layout, full rotary) with one compiled kernel.

    Args:
        cs: ``[..., s, 2, d/2]``: ``cos`` and ``sin`` stacked, in the compute dtype
            (float32 for 16-bit ``xs``, else theirs); the results are in the dtype of ``xs``.
        xs: ``x`` or ``q, k``, each ``[..., s, d]``, one dtype and device.

    Returns:
        The rotated tensors (a tuple of ``len(xs)``), or ``None`` (with a
        ``RuntimeWarning``, once) where compiling fails here.
    """
    pair = len(xs) == 2
    fn = _compiled_body(pair)
    if fn is None:
        return None
    try:
        out = fn(*xs, cs)
    except Exception as err:  # pragma: no cover - no C++ compiler / unsupported platform
        warnings.warn(f"fused RoPE failed to compile, using eager ops: {err}", RuntimeWarning,
                      stacklevel=3)
        _compiled["one"] = _compiled["pair"] = None
        return None
    return out if pair else (out,)
