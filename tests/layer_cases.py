"""Cases shared by the window, schedule and T5 tests: sizes, backends, encodings by key."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from tutorial_pkg import backends
from tutorial_pkg.encodings.registry import make_encoding

HAS_FLEX = backends.flex_available()[0]
# compiles (inductor codegen): `pytest -m "not slow"` skips it while editing
slow = pytest.mark.slow
needs_flex = pytest.mark.skipif(not HAS_FLEX, reason="FlexAttention unavailable")
ALL_BACKENDS = ["naive", "sdpa", "auto", pytest.param("flex", marks=needs_flex)]
RELATIVE = ["nope", "rope", "alibi", "hybrid", "t5"]
D, H, KV = 32, 4, 2
#: the marks every layer test module applies (its `pytestmark`)
LAYER_MARKS = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.filterwarnings("ignore:flex backend falls back to sdpa"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    pytest.mark.usefixtures("one_thread"),
]


def encoding(key: str, causal: bool = True):
    if key in ("alibi", "hybrid"):
        return make_encoding(key, d_model=D, n_heads=H, mode="causal" if causal else "symmetric")
    if key == "t5":  # a large init, so that the bias matters in the comparisons
        return make_encoding("t5", n_heads=H, bidirectional=not causal, init_std=1.0)
    return make_encoding(key, d_model=D, n_heads=H, max_positions=64)


def x_of(seed, b=2, s=9):
    return torch.randn(b, s, D, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def no_fallback():
    """The backend must really run: a fallback to sdpa (its RuntimeWarning) raises."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flex backend falls back to sdpa",
                                category=RuntimeWarning)
        yield
