"""Fast RoPE kernels: what :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding` runs. Chapter 5.

:func:`~tutorial_pkg.encodings.rope.apply_rope` is the readable form of the rotation. The
functions here compute the same rotation in fewer passes over memory, for full
rotary (``2 * cos.shape[-1] == x.shape[-1]``); they take checked arguments and
check nothing themselves:

* :func:`fast_rope`, the default path: the *three-kernel form* ``out = x * [cos, cos]``,
  then ``out[..., :r/2] -= x2 * sin`` and ``out[..., r/2:] += x1 * sin`` in place on
  the fresh output (half layout). On a CPU, for a large contiguous ``x`` without
  autograd, it runs block by block (the same roundings per element, in whole rows) so
  that ``x`` and the output cross memory about once. The interleaved layout in
  float32/float64 is one complex multiplication (Meta's form); otherwise the
  three-kernel form on strided views. In the half layout the result has the same bits
  whether or not it runs block by block. **16-bit** ``x`` (bfloat16, float16) is
  rotated in float32 with float32 tables (each block upcast, ``x * [cos, cos] +
  [x2, x1] * [-sin, sin]`` in float32, one rounding to ``x``'s dtype at the end): the
  exact rotation rounded once, up to float32 error (rounding the tables and the two
  partial results to 16 bits instead gives up to about 2 ulps).
* :func:`fused_rope`, opt-in (``RotaryEmbedding(fused=True)``): one
  ``torch.compile``-d kernel for the half layout, each element computed in float32
  and rounded once (so not always the same bits as :func:`fast_rope` in 16-bit dtypes).
  Where compiling fails (no C++ compiler, unsupported platform) it warns once and
  returns ``None``; the caller falls back to :func:`fast_rope`.

Shapes: ``x`` is ``[..., s, d]``; ``cos``/``sin`` are ``[s, d/2]`` or broadcastable
(e.g. ``[b, 1, s, d/2]``), any floating dtype (they are cast to ``x``'s).
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["BLOCK_BYTES", "fast_rope", "fused_rope"]

#: Bytes of ``x`` per block of the blocked CPU rotation: large enough that the kernel
#: calls per block cost little next to their work, small enough that the block's output
#: (and swapped copy) are still in cache for the second and third kernel.
BLOCK_BYTES = 512 * 1024


def fast_rope(cos: torch.Tensor, sin: torch.Tensor, layout: str,
              *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rotate all features of each of ``xs`` (full rotary); equal to ``apply_rope`` up to
    rounding.

    Args:
        cos: ``[s, d/2]`` (or broadcastable to ``x[..., : d/2]``).
        sin: same shape as ``cos``.
        layout: ``"half"`` or ``"interleaved"`` (not checked).
        xs: ``x`` or ``q, k``: ``[..., s, d]`` floating tensors of one dtype and device.
            The tables are cast (and, block by block, laid out) once for all of them.

    Returns:
        New tensors of the shapes and dtype of ``xs``; they keep autograd (the in-place
        updates touch only the fresh outputs, which no backward formula saved).
    """
    dtype = xs[0].dtype
    # 16-bit x is computed in float32 (tables too) and rounded once at the end
    c, s = (t.to(_compute_dtype(dtype)) for t in (cos, sin))
    half = c.shape[-1]
    blocks: dict = {}  # (s, d) -> the tables cut into blocks, shared by q and k
    out = []
    for x in xs:
        if layout != "half":
            out.append(_rope_interleaved(x, c, s))
        elif _blockable(x, c):
            key = x.shape[-2:]
            if key not in blocks:
                blocks[key] = _block_tables(x, c, s)
            out.append(_rope_half_blocked(x, *blocks[key]))
        elif x.dtype != c.dtype:  # 16-bit: the blocked form's ops on all of x at once
            out.append(_rope_half_upcast(x, c, s))
        else:
            y = x * torch.cat((c, c), dim=-1)
            y[..., :half].addcmul_(x[..., half:], s, value=-1)
            y[..., half:].addcmul_(x[..., :half], s)
            out.append(y)
    return tuple(out)


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


def _rope_interleaved(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if x.dtype != c.dtype:  # 16-bit x: in float32 (c, s are), one rounding at the end
        return _rope_interleaved(x.to(c.dtype), c, s).to(x.dtype)
    half = c.shape[-1]
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
    its halves swapped into a second one, ``xf * [cos, cos]`` and ``+= [x2, x1] * [-sin,
    sin]`` (one ``addcmul_`` over whole rows) in float32, and one rounding on the copy
    into the output: the ops of the unblocked 16-bit form, so the same bits.
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
            xf.addcmul_(swapped, sin_blocks[i % n_pos])
            ob.copy_(xf)
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

    ``cs`` is ``[s, 2, d/2]``: ``cos`` and ``sin`` stacked in ``x``'s dtype (one
    table: one stream of loads per row).
    """
    half = cs.shape[-1]
    cos, sin = cs[..., 0, :], cs[..., 1, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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
        cs: ``[..., s, 2, d/2]``: ``cos`` and ``sin`` stacked, in the dtype of ``xs``.
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
