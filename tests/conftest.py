"""Shared pytest options and fixtures."""

import sys
from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--html-dir",
        action="store",
        default=None,
        help="built book to check (tests/built_html); those tests are skipped without it",
    )


def html_dir(config):
    value = config.getoption("--html-dir")
    return None if value is None else Path(value)


def pytest_configure(config):
    # Unit tests draw without a screen; set in-process only, so the notebook kernels
    # that nbval starts keep their inline backend.
    import matplotlib

    matplotlib.use("Agg")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is faster and immune to a busy machine's other jobs."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _clear_backend_caches():
    """No test inherits the bias tables and block masks of the one before it."""
    yield
    backends = sys.modules.get("tutorial_pkg.attention.backends")  # imported by the test, if at all
    if backends is not None:
        backends.clear_caches()
