"""What reaches ``scaled_dot_product_attention``: a probe of the masks it is handed. Chapter 9.

PyTorch documents two masks: boolean, or "a float mask of the same type as query". Its
argument check lets a third through (float32 with other queries), and some kernels misread
it silently (torch 2.13's CPU kernel with float64 queries on AVX2 CPUs). Whether a kernel
misreads it depends on the machine; whether your code hands it over does not, so
:func:`record_sdpa_masks` checks the calls, not the outputs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .reports import Report

__all__ = ["SdpaMaskReport", "record_sdpa_masks"]


@dataclass(repr=False)
class SdpaMaskReport(Report):
    """What :func:`record_sdpa_masks` saw.

    Attributes:
        calls: one ``(q dtype, mask dtype or None, mask shape or None)`` per call.
        masks: the mask of each call as the kernel received it (None where there was none),
            so that what a 16-bit call was handed can be read back (chapter 9, bug 10).
        problems: the calls whose float mask has another dtype than q, in words.
    """

    calls: list = field(default_factory=list)
    masks: list = field(default_factory=list)
    problems: list = field(default_factory=list)

    def _lines(self):
        seen = sorted({(str(q).removeprefix("torch."),
                        "no mask" if m is None else str(m).removeprefix("torch."))
                       for q, m, _ in self.calls})
        return [f"{len(self.calls)} calls; q / mask dtypes: "
                + (", ".join(f"{q} / {m}" for q, m in seen) or "none")]


@contextlib.contextmanager
def record_sdpa_masks():
    """Within the ``with`` block, record every ``F.scaled_dot_product_attention`` call.

    Yields an :class:`SdpaMaskReport` that fills in as calls are made (each call's dtypes and
    its mask, as handed over); a float mask whose dtype is not q's is a problem. Catches code
    that calls the function through ``torch.nn.functional``
    (``F.scaled_dot_product_attention``), not a name imported from it before the block. The
    calls still run, unchanged.
    """
    report = SdpaMaskReport()
    real = F.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, *args, **kwargs):
        dtype = None if attn_mask is None else attn_mask.dtype
        report.calls.append((query.dtype, dtype,
                             None if attn_mask is None else tuple(attn_mask.shape)))
        report.masks.append(attn_mask)
        if dtype is not None and dtype not in (torch.bool, query.dtype):
            report.problems.append(f"call {len(report.calls)}: a {dtype} mask with "
                                   f"{query.dtype} q (documented: bool or q's dtype)")
        return real(query, key, value, attn_mask, *args, **kwargs)

    F.scaled_dot_product_attention = recording
    try:
        yield report
    finally:
        F.scaled_dot_product_attention = real
