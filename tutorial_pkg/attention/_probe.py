"""The probe behind ``"auto"``'s key row (private to ``attention``). Chapter 4.

``"auto"`` hands SDPA a float key row together with ``is_causal=True``, a pair PyTorch's
documentation calls an error: an undocumented fast path, checked on the CPU by the tests and
unverified on CUDA. :func:`key_bias_supported` answers, once per (device type, dtype, GQA,
head width), whether the kernels here compute it within tolerance of a float64 reference
(a GPU picks its kernel by dtype and head width among others, so the probe runs at the
layer's head width);
:func:`probe_key_bias` is the check itself.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._checks import fake_mode_active
from ._caches import _key_bias_ok
from ._kernel_rules import kernel_rules
from .masks import causal_mask, dense_mask

__all__ = ["key_bias_supported", "probe_key_bias"]


def key_bias_supported(device: torch.device, dtype: torch.dtype, gqa: bool,
                       head_dim: int = 8) -> bool:
    """Does SDPA add a float key row *and* apply ``is_causal`` here, within tolerance? (cached).

    ``"auto"`` relies on it, although PyTorch's documentation calls ``attn_mask`` with
    ``is_causal=True`` an error. :func:`probe_key_bias` answers, once per (device type,
    dtype, GQA, ``head_dim``: ``"auto"`` passes q's); where nothing can run (meta,
    ``FakeTensorMode``, tracing) the answer is False and is not kept. A
    :class:`~tutorial_pkg.attention._kernel_rules.KernelRules` ``key_bias`` answers instead.
    """
    device = torch.device(device)
    assumed = kernel_rules(device.type).key_bias
    if assumed is not None:
        return assumed
    key = (device.type, dtype, gqa, head_dim)
    if key in _key_bias_ok:
        return _key_bias_ok[key]
    if torch.compiler.is_compiling():
        return False  # never probe while tracing; the next eager call will
    ok = probe_key_bias(device, dtype, gqa, head_dim)
    if ok is None:
        return False
    _key_bias_ok[key] = ok
    return ok


#: The fused SDPA kernels the key-row path may land on; each must be exact where it runs.
_FUSED = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
          SDPBackend.CUDNN_ATTENTION)


def probe_key_bias(device, dtype: torch.dtype, gqa: bool, head_dim: int = 8) -> bool | None:
    """The check of :func:`key_bias_supported`, run now (nothing cached).

    A tiny problem (2 heads, 16 tokens, ``head_dim`` features) whose keys sit at positions
    4096+ (a row rounded to 16 bits fails there):
    ``scaled_dot_product_attention(q, k, v, attn_mask=row, is_causal=True)``, the row of q's
    dtype, forward and gradients, against a float64 reference; once with the
    kernel PyTorch selects and once restricted to each fused kernel (flash,
    memory-efficient, cuDNN) that takes the call on this device. True if the selected one
    runs and every one that runs is within tolerance: a largest error of at most 1e-3 times
    the reference's largest value (at least 1) in float32 and float64, 5e-2 in 16 bits,
    whose inputs alone are rounded to about 1e-2 (``"auto"`` never takes the row in 16
    bits; a row rounded to 16 bits is off by whole units at these keys and fails either
    way). None where tensors hold no data (meta, ``FakeTensorMode``). Reads its errors back
    to the host (a synchronisation).
    """
    device = torch.device(device)
    if device.type == "meta" or fake_mode_active():
        return None
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    heads, kv_heads, length, dim, offset = 2, 1 if gqa else 2, 16, head_dim, 4096
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, length, dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, length, dim, generator=gen) for _ in range(2))
    grad_out = torch.randn(1, heads, length, dim, generator=gen)
    slopes = torch.tensor([0.5, 1 / 16])
    row_dtype = dtype  # a float mask of q's dtype: the only one PyTorch documents
    row = (slopes[:, None, None] * torch.arange(offset, offset + length).double())[None]

    def run(tensors, mask, fused):
        q_, k_, v_ = (t.detach().requires_grad_(True) for t in tensors)
        if fused:
            kw = {"enable_gqa": True} if gqa else {}
            out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, is_causal=True, **kw)
        else:
            rep = heads // kv_heads
            kk, vv = k_.repeat_interleave(rep, 1), v_.repeat_interleave(rep, 1)
            scores = q_ @ kk.transpose(-2, -1) / math.sqrt(dim) + mask
            future = ~dense_mask(causal_mask, 0, length, length, device=q_.device)
            out = scores.masked_fill(future, float("-inf")).softmax(-1) @ vv
        grads = torch.autograd.grad(out, (q_, k_, v_), grad_out.to(out))
        return [out, *grads]

    # float32 rounds m j ~ 2048 to ~1e-4; a row rounded to 16 bits is off by ~1 or more.
    tol = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2

    def within_tolerance(got, want) -> bool:  # float() reads each error back: a sync
        return all(float((g.detach().double() - w.detach()).abs().max())
                   <= tol * max(1.0, float(w.detach().abs().max()))
                   for g, w in zip(got, want, strict=True))

    inputs = [t.to(device, dtype) for t in (q, k, v)]
    with torch.enable_grad():
        want = run([t.double() for t in inputs], row.to(device), fused=False)
        try:  # the kernel PyTorch selects: it must take the pair ...
            if not within_tolerance(run(inputs, row.to(device, row_dtype), fused=True), want):
                return False
        except RuntimeError:  # e.g. "attn_mask should not be set when is_causal=True"
            return False
        for kernel in _FUSED:  # ... and so must every fused kernel it may select
            try:
                with sdpa_kernel([kernel]), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a refusing kernel warns why
                    got = run(inputs, row.to(device, row_dtype), fused=True)
            except (RuntimeError, ValueError):  # it does not take the call: never selected
                continue
            if not within_tolerance(got, want):
                return False
    return True
