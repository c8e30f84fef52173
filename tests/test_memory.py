"""Tests of tutorial_pkg.measure.memory: :func:`~tutorial_pkg.measure.memory.peak_memory` (a
known allocation reads its size, sequential allocations do not add up, temporaries freed inside
the call are seen), the :class:`~tutorial_pkg.measure.memory.Footprint` of a case,
:func:`~tutorial_pkg.measure.memory.available_memory` (the CUDA arithmetic with torch.cuda's
answers mocked) and :func:`~tutorial_pkg.measure.memory.fit_problem`, and the arguments they
refuse by name. CPU only but for one test that needs a CUDA GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from tutorial_pkg import measure as bm
from tutorial_pkg.measure import memory

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    pytest.mark.usefixtures("one_thread"),
]

FOUR_MB = 4_000_000
# The CPU allocator reports exact request sizes; allow a little for the odd
# scalar or bookkeeping tensor that an op may allocate.
SLACK = 64 * 1024


# --------------------------------------------------------------------------- #
# peak_memory
# --------------------------------------------------------------------------- #
def test_peak_memory_of_a_known_tensor():
    n = 2_000_000  # float32 -> 8 MB

    def alloc():
        return torch.ones(n)

    m = bm.peak_memory(alloc, device="cpu")
    assert m.method == "cpu-profiler-events"
    assert 4 * n <= m.peak_bytes <= 4 * n + SLACK
    assert m.net_bytes == pytest.approx(4 * n, abs=SLACK)  # returned: still alive


def test_peak_memory_sequential_allocations_do_not_add_up():
    def two_in_turn():
        a = torch.ones(FOUR_MB // 4)
        del a
        b = torch.ones(FOUR_MB // 4)
        del b

    m = bm.peak_memory(two_in_turn, device="cpu")
    assert FOUR_MB <= m.peak_bytes <= FOUR_MB + SLACK  # ~4 MB, not 8 MB
    assert abs(m.net_bytes) <= SLACK


def test_peak_memory_simultaneous_allocations_add_up():
    def two_at_once():
        a = torch.ones(FOUR_MB // 4)
        b = torch.ones(FOUR_MB // 4)
        return a, b

    m = bm.peak_memory(two_at_once, device="cpu")
    assert 2 * FOUR_MB <= m.peak_bytes <= 2 * FOUR_MB + SLACK


def test_peak_memory_sees_temporaries_freed_inside_one_call():
    x = torch.randn(500, 500)  # allocated before: not counted

    def temp():
        return (x @ x).sum()  # a 1 MB product, freed before returning

    m = bm.peak_memory(temp, device="cpu")
    assert 500 * 500 * 4 <= m.peak_bytes <= 500 * 500 * 4 + SLACK
    assert m.net_bytes <= SLACK


def test_peak_memory_rejects_bad_arguments():
    with pytest.raises(ValueError, match="warmup"):
        bm.peak_memory(lambda: None, device="cpu", warmup=-1)
    with pytest.raises(ValueError, match="device"):
        bm.peak_memory(lambda: None, device="gpu")


def test_peak_memory_rejects_a_non_callable_fn():
    with pytest.raises(TypeError, match="fn"):
        bm.peak_memory(42)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_memory_of_a_known_tensor():
    m = bm.peak_memory(lambda: torch.empty(2**20, device="cuda"), device="cuda")
    assert 4 * 2**20 <= m.peak_bytes <= 4 * 2**20 + 2**20


# --------------------------------------------------------------------------- #
# Footprint, available_memory, fit_problem
# --------------------------------------------------------------------------- #
def test_fit_problem_leaves_the_stated_headroom():
    fp = bm.Footprint(held=2**30, call=2**30)
    need = 2 * 2**30 * (1 + bm.MEMORY_HEADROOM) + bm.MEMORY_RESERVE_BYTES  # 2.65 GiB
    assert bm.fit_problem(fp, math.ceil(need)) is None
    assert "2.65 GiB with headroom; 2.65 GiB available" in bm.fit_problem(fp, math.floor(need))
    assert bm.fit_problem(fp, None) is None  # no check (a CPU without a limit)
    assert bm.Footprint(held=1, call=2, build=10, inputs=5).need == 10
    assert bm.Footprint(held=1, call=2, build=10, inputs=5).total == 15


def test_available_memory_on_cpu_is_the_configured_limit_or_nothing():
    assert bm.available_memory("cpu") is None
    assert bm.available_memory("cpu", limit=123) == 123


def test_memory_check_rejects_what_it_cannot_read():
    fp = bm.Footprint(call=10)
    for kwargs, exc, name in [({"available": -1}, ValueError, "available"),
                              ({"available": 1.5}, TypeError, "available"),
                              ({"available": 10, "headroom": -0.1}, ValueError, "headroom"),
                              ({"available": 10, "reserve": -1}, ValueError, "reserve")]:
        with pytest.raises(exc, match=name):
            bm.fit_problem(fp, **kwargs)
    with pytest.raises(TypeError, match="footprint"):
        bm.fit_problem(10, 100)
    with pytest.raises(ValueError, match="limit"):
        bm.available_memory("cpu", limit=0)


def test_available_memory_on_cuda_counts_cached_blocks_and_caps(monkeypatch):
    """The CUDA arithmetic, with torch.cuda's answers mocked (no GPU here)."""
    gib = 2**30
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(memory, "resolve_device", lambda device=None: cuda)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 16 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 * gib)
    fraction = {"value": 1.0}
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction",
                        lambda device=None: fraction["value"])
    assert bm.available_memory("cuda") == 12 * gib  # free + reserved but unused
    assert bm.available_memory("cuda", limit=8 * gib) == 5 * gib  # a limit counts allocations
    fraction["value"] = 0.5
    assert bm.available_memory("cuda") == 5 * gib  # 8 GiB allowed, 3 allocated
