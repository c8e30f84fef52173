"""FlexAttention's parts for the ``"flex"`` backend (private to ``attention``). Chapters 4, 5.

Whether it can run (:func:`flex_available`, :func:`flex_blocker`), the function to call,
compiled once per process (:func:`flex_kernel`), and the plan's rules as a block mask,
cached (:func:`flex_block_mask`).
"""

from __future__ import annotations

import sys

import torch

from .._checks import check_device, fake_mode_active
from ..encodings.builtin import PositionEncoding
from . import _caches
from ._caches import _block_masks, _compiled_flex, _overrides
from ._kernel_rules import kernel_rules
from .masks import AttentionPlan, offset_queries

try:  # FlexAttention: torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _FLEX_IMPORT_ERROR = None
except ImportError as _err:  # pragma: no cover - depends on the installed torch
    flex_attention = create_block_mask = None
    _FLEX_IMPORT_ERROR = str(_err)

__all__ = ["FLEX_TILE", "flex_available", "flex_compiles_on_cpu", "flex_blocker", "flex_kernel",
           "flex_block_mask", "flex_score_mod", "without_sinks"]

#: FlexAttention's tile (block) size; below it, CPU calls run eagerly (``backends.flex``).
FLEX_TILE = 128


def flex_available() -> tuple[bool, str]:
    """Whether FlexAttention can be imported here, and why not if it cannot."""
    if flex_attention is None:
        return False, f"torch.nn.attention.flex_attention is unavailable ({_FLEX_IMPORT_ERROR})"
    return True, ""


def flex_compiles_on_cpu() -> bool:
    """Whether torch's compiled FlexAttention kernel builds on this CPU.

    torch 2.13's CPU template needs AVX2 or better and refuses under
    ``ATEN_CPU_CAPABILITY=default``, on macOS and where an XPU is present
    (``torch/_inductor/kernel/flex/flex_cpu.py``, ``check_cpu_supported``): it raises an
    ``InductorError`` at the first compiled call."""
    xpu = getattr(torch, "xpu", None)
    return (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
            and sys.platform != "darwin" and not (xpu is not None and xpu.is_available()))


def flex_blocker(q, k, v, plan: AttentionPlan, encoding: PositionEncoding, *,
                 dropout_p: float, compiled: bool = False) -> str:
    """Why FlexAttention cannot run this call here (``""`` if it can).

    ``compiled``: the call would run compiled (not eagerly). torch 2.13's compiled CPU
    kernel refuses ``return_lse`` (which sinks need) and fails to build a soft-capped
    ``score_mod``, so those calls are blocked there."""
    ok, why = flex_available()
    if not ok:
        return why
    rules = kernel_rules(q.device.type)
    if not rules.flex:
        return f"FlexAttention does not run on {q.device.type} tensors"
    if plan.s == 1:
        return "single-token decoding step (the cached bias row is cheaper)"
    if encoding.has_bias and not _overrides(encoding, "score_mod"):
        return f"{type(encoding).__name__} has a bias hook but no score_mod"
    if dropout_p:
        return "attention dropout is not supported by FlexAttention"
    if not rules.flex_backward:
        # torch refuses inputs that require grad there, whatever the grad mode
        learnable = torch.is_grad_enabled() and any(
            p.requires_grad for p in encoding.parameters()
        )
        if q.requires_grad or k.requires_grad or v.requires_grad or learnable:
            return (f"FlexAttention has no {q.device.type.upper()} backward in this torch "
                    f"(use torch.no_grad())")
    if compiled and q.device.type == "cpu" and plan.shapes_scores:
        return ("sinks or soft-capping with the compiled CPU kernel (torch 2.13 supports "
                "neither return_lse nor a capped score_mod there)")
    return ""


def flex_kernel(compiled: bool, dynamic: bool = False):
    """What :func:`~tutorial_pkg.attention.backends.flex` calls: ``flex_attention``
    itself, or compiled (once per process and ``dynamic``).

    ``dynamic=True`` serves the common call (a whole causal sequence, no padding): one
    compilation for every length. Other calls compile statically, once per shape (with
    dynamic shapes torch 2.13's CPU template fails to build some of them).
    """
    if not compiled:
        return flex_attention
    fn = _compiled_flex.get(dynamic)
    if fn is None:
        fn = _compiled_flex[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return fn


def capped_score_mod(score_mod, cap: float):
    """``score_mod`` (or none) after Gemma 2's soft-capping of the scaled score."""

    def capped(score, b, h, q_idx, kv_idx):
        score = cap * torch.tanh(score / cap)
        return score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx)

    return capped



def flex_score_mod(plan: AttentionPlan, encoding: PositionEncoding, batch: int, device):
    """The encoding's ``score_mod`` for the plan (soft-capped where the plan caps), or None.

    ``ValueError`` naming both devices if a tensor of the encoding is not on ``device``: a
    ``score_mod`` captures the encoding's tensors as they are."""
    if plan.default_positions:
        score_mod = encoding.score_mod(q_offset=plan.start)
    else:
        score_mod = encoding.score_mod(0, plan.q_pos.expand(batch, -1).contiguous(),
                                       plan.k_pos.expand(batch, -1).contiguous())
    if plan.softcap is not None:
        score_mod = capped_score_mod(score_mod, plan.softcap)
    if score_mod is not None:
        for name, t in (*encoding.named_buffers(), *encoding.named_parameters()):
            check_device(f"{type(encoding).__name__}'s tensor {name}", t, device,
                         fix="FlexAttention's score_mod captures it; move the encoding (or "
                             "the layer) to that device with .to(device)")
    return score_mod


def without_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out`` ``[b, H, s, d]`` rescaled by ``sigmoid(lse - sink_h)``: the share of the softmax
    denominator ``e^lse + e^sink`` that the keys keep (``sum_j e^x_j = e^lse``)."""
    work = torch.promote_types(out.dtype, torch.float32)  # float64 stays float64
    keep = torch.sigmoid(lse.to(work) - sinks.to(work).view(1, -1, 1))[..., None]
    return (out.to(work) * keep).to(out.dtype)

def _mark_block_mask_dynamic(block_mask) -> None:
    # The block counts and indices grow with L / 128; unmarked, the first compile
    # specialises on their sizes and the next block count recompiles once more.
    for t in block_mask.as_tuple():
        if isinstance(t, torch.Tensor):
            for dim in range(2, t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, dim)


def flex_block_mask(plan: AttentionPlan, *, batch: int = 1, device="cpu",
                    mark_dynamic: bool = False):
    """The plan's mask rules as a FlexAttention block mask (None: nothing is masked).

    Tiles that no rule allows are skipped, not computed. Masks of padding or documents
    (data) are built per call; the others are cached
    (:data:`~tutorial_pkg.attention._caches.MAX_BLOCK_MASKS`).
    ``mark_dynamic`` marks the mask's block axes dynamic for a dynamic-shape compile.
    """
    rule = plan.mask_rule(batch=batch)
    if rule is None:
        return None
    mask_mod = offset_queries(rule, plan.start)  # Flex counts queries from 0
    if plan.key_padding_mask is not None or plan.reads_data:  # data-dependent: per call
        return create_block_mask(mask_mod, batch, None, plan.s, plan.k_len, device=device)
    window = plan.window if plan.windowed else None
    key = (plan.s, plan.k_len, plan.start, plan.causal, window, torch.device(device),
           mark_dynamic)
    fake = fake_mode_active()  # fake masks are neither stored nor served
    block_mask = None if fake else _block_masks.get(key)
    if block_mask is None:
        block_mask = create_block_mask(mask_mod, None, None, plan.s, plan.k_len, device=device)
        if mark_dynamic:
            _mark_block_mask_dynamic(block_mask)
        if fake:
            return block_mask
        _block_masks[key] = block_mask
    _block_masks.move_to_end(key)
    while len(_block_masks) > _caches.MAX_BLOCK_MASKS:
        _block_masks.popitem(last=False)
    return block_mask
