"""Shared pytest options."""

from pathlib import Path


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
