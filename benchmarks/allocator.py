"""The CPU allocator setting under which the book's suite times large outputs.

glibc's ``malloc`` serves a large request with a fresh ``mmap`` and returns it to the OS
when freed, so a function that writes a large output pays a page fault at the first touch of
each 4 KiB page, in every call: its time then measures the kernel's page handling, not its
arithmetic and memory traffic. :func:`keep_freed_memory` asks glibc to keep such blocks;
``suite.py`` calls it unless ``--default-malloc`` is given, and chapter 5 counts the page
faults both ways.

This is a setting of the process that measures, not of the measuring library
(:mod:`tutorial_pkg.measure.cases`): it changes the whole process for the rest of its life.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tutorial_pkg._checks import check_positive_int  # noqa: E402

__all__ = ["keep_freed_memory"]

#: glibc caps ``M_MMAP_THRESHOLD`` at 32 MiB on 64-bit systems.
MAX_THRESHOLD_BYTES = 32 * 2**20


def keep_freed_memory(threshold_bytes: int = MAX_THRESHOLD_BYTES) -> bool:
    """Ask glibc's ``malloc`` to keep freed blocks for reuse instead of returning them.

    By default glibc serves a large request (over a threshold that adapts between
    128 KiB and 32 MiB) with a fresh ``mmap`` and gives it back to the OS when freed,
    so a function that allocates a large output pays a page fault at the first touch
    of each 4 KiB page, in every call. This sets ``M_MMAP_THRESHOLD`` to
    ``threshold_bytes`` and ``M_TRIM_THRESHOLD`` to 2 GiB with ``mallopt``, as the
    environment variables ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``
    would at start-up: freed blocks up to that size stay in the process and are
    reused. It changes the whole process, for the rest of its life.

    Args:
        threshold_bytes: Largest block kept (glibc caps it at 32 MiB on 64-bit).

    Returns:
        True if glibc accepted both settings, False elsewhere (other C libraries).

    Raises:
        TypeError: If ``threshold_bytes`` is not an int.
        ValueError: If it is not in ``1..32 MiB``.
    """
    check_positive_int("threshold_bytes", threshold_bytes)
    if threshold_bytes > MAX_THRESHOLD_BYTES:
        raise ValueError(f"threshold_bytes must be <= 32 MiB (glibc's cap), got {threshold_bytes}")
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, threshold_bytes)) and bool(
        mallopt(m_trim_threshold, 2**31 - 1)
    )
