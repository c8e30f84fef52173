"""What the backends assume of each device type's kernels (private to ``attention``).

A :class:`KernelRules` per device type in :data:`KERNEL_RULES`; :func:`assume_kernels`
changes one within a ``with`` block, so that tests run the GPU's rules on a CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

__all__ = ["KernelRules", "KERNEL_RULES", "kernel_rules", "assume_kernels"]


@dataclass(frozen=True)
class KernelRules:
    """What the backends assume of the kernels of one device type.

    Attributes:
        key_bias: the answer of
            :func:`~tutorial_pkg.attention._probe.key_bias_supported` for every dtype;
            None = probe.
        flex: FlexAttention runs on this device type.
        flex_backward: FlexAttention has a backward there (not on CPU in torch 2.13).
    """

    key_bias: bool | None = None
    flex: bool = False
    flex_backward: bool = False


#: What the backends assume per device type; a type not listed gets ``KernelRules()``,
#: nothing assumed. torch 2.13's FlexAttention devices (its ``_validate_device``). The key
#: row with ``is_causal`` (an undocumented call) is probed on the CPU only, where the tests
#: check it; a GPU picks among several fused kernels by shape, and no GPU run of the call is
#: recorded, so elsewhere ``"auto"`` makes the documented call (``key_bias=False``).
KERNEL_RULES: dict[str, KernelRules] = {
    "cpu": KernelRules(flex=True),
    "mps": KernelRules(key_bias=False, flex=True),
    **{t: KernelRules(key_bias=False, flex=True, flex_backward=True)
       for t in ("cuda", "xpu", "hpu")},
}


def kernel_rules(device_type: str) -> KernelRules:
    """The :class:`KernelRules` the backends follow on ``device_type`` (e.g. ``"cuda"``)."""
    return KERNEL_RULES.get(device_type) or KernelRules()


@contextlib.contextmanager
def assume_kernels(device_type: str, **rules):
    """Within the ``with`` block, follow ``rules`` (fields of :class:`KernelRules`) on
    ``device_type``: e.g. the GPU's ``key_bias=False`` on ``"cpu"``.
    Unknown fields raise ``TypeError``."""
    missing = object()
    before = KERNEL_RULES.get(device_type, missing)
    KERNEL_RULES[device_type] = replace(kernel_rules(device_type), **rules)
    try:
        yield KERNEL_RULES[device_type]
    finally:
        if before is missing:
            KERNEL_RULES.pop(device_type, None)
        else:
            KERNEL_RULES[device_type] = before
