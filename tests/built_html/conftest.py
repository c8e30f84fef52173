"""Fixtures for the checks of the built book: where it is, and the pages of its toc."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import html_dir

ROOT = Path(__file__).resolve().parents[2]


def toc_pages() -> list[str]:
    """Every page of _toc.yml, as a path without suffix ("book/intro", ...)."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [toc["root"]] + [c["file"] for c in toc["chapters"]]


@pytest.fixture(scope="session")
def site(request) -> Path:
    """The built book (--html-dir); every test here is skipped without it."""
    path = html_dir(request.config)
    if path is None:
        pytest.skip("pass --html-dir _build/html (after building the book) to check it")
    path = path if path.is_absolute() else ROOT / path
    assert (path / "index.html").exists(), f"no built book in {path}"
    return path
