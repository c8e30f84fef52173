"""Timing, memory, records and side-by-side comparison. Chapter 5.

``from tutorial_pkg import measure as bm`` gives all of it (the names of
:mod:`~tutorial_pkg.measure.cases`, which re-exports its parts):

* ``timing``: one function, timed honestly (warm-up, CUDA events, robust statistics).
* ``memory``: peak and held memory of one call.
* ``records``: :class:`~tutorial_pkg.measure.records.BenchRecord`, results files, tables.
* ``cases``: :class:`~tutorial_pkg.measure.cases.Case` and
  :func:`~tutorial_pkg.measure.cases.compare`, cases side by side with a limit reference.

Needs nothing of the rest of the package.
"""

from . import cases as _cases
from .cases import (  # noqa: F401 (the names of __all__)
    MEMORY_HEADROOM,
    MEMORY_RESERVE_BYTES,
    SCHEMA_VERSION,
    SDPA_KERNELS,
    BenchRecord,
    Case,
    Footprint,
    MemoryStat,
    Results,
    Timing,
    Work,
    attention_work,
    available_memory,
    compare,
    fit_problem,
    format_table,
    hardware_info,
    load_results,
    peak_memory,
    profiled,
    resolve_device,
    save_results,
    sdpa_kernels,
    text_table,
    time_fn,
)

__all__ = list(_cases.__all__)
