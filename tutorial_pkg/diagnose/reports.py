"""What every probe of :mod:`tutorial_pkg.diagnose` returns: a :class:`Report`.

A report is a dataclass with ``ok`` (pass/fail), the measured quantities, a list of
``problems`` in words, and a readable ``str()``. The ``str()`` prints what a check
claims, not rounding noise: a residual that passes is printed as the bound it passed
(:func:`bound`: ``max |diff| <= 0.0001``), one that fails with two significant digits
(:func:`measured`); the exact values are the report's attributes.
"""

from __future__ import annotations

import math

import torch

__all__ = ["Report"]


class Report:
    """The base of every report: ``ok`` is True when ``problems`` is empty; ``str()`` is
    the readable report (a ``OK``/``FAIL`` headline, the measurements, the problems)."""

    problems: list

    @property
    def ok(self) -> bool:
        return not self.problems

    def _lines(self) -> list[str]:
        raise NotImplementedError

    def __str__(self) -> str:
        head = f"{type(self).__name__[:-6]}: {'OK' if self.ok else 'FAIL'}"
        return "\n".join([head, *("  " + s for s in self._lines()),
                          *("  problem: " + p for p in self.problems)])


def bound(x: float) -> str:
    """``x`` rounded up to one significant digit (``1e-05``, ``2e-05``, ``0.05``): a bound to
    print in place of a residual, whose digits depend on how the CPU's kernels round."""
    if not x > 0:
        return f"{x:g}"
    exp = math.floor(math.log10(x))
    digit = math.ceil(round(x / 10.0**exp, 9))
    return f"{float(f'{digit}e{exp}'):g}"


def measured(x: float) -> str:
    """A residual that failed its check, to two significant digits (``5.3``, ``0.0012``)."""
    return f"{x:.2g}"


def first_true(mask: torch.Tensor) -> int | None:
    """Index (along the first axis) of the first ``True`` of ``mask``; ``None`` if none."""
    idx = mask.nonzero()
    return None if idx.numel() == 0 else int(idx[0, 0])
