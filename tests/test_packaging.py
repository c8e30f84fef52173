"""What installing the package brings: matplotlib is an extra, not a dependency.

A reader who imports the layers into a model needs torch, not the book's figures: the core
dependencies leave matplotlib out, ``import tutorial_pkg`` (and the measuring library) never
imports it, and ``tutorial_pkg.plotting`` says which extra to install when it is missing.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_matplotlib_is_an_extra_not_a_dependency():
    project = _project()
    assert "matplotlib" not in {_name(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    for extra in ("plot", "book", "test"):  # the figures, the chapters, the tests
        assert "matplotlib" in {_name(r) for r in extras[extra]}, extra


def test_importing_the_package_and_its_measuring_library_imports_no_matplotlib():
    proc = _python("import sys\n"
                   "import tutorial_pkg, tutorial_pkg.measure, tutorial_pkg.experiments.training\n"
                   "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_plotting_without_matplotlib_names_the_extra():
    # sys.modules[name] = None makes `import name` raise ImportError, as if not installed
    proc = _python("import sys\n"
                   "sys.modules['matplotlib'] = sys.modules['matplotlib.pyplot'] = None\n"
                   "import tutorial_pkg.plotting\n")
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "tutorial_pkg[plot]" in proc.stderr


def test_slider_figure_stores_rounded_frames_and_refuses_ragged_ones():
    """The HTML the book's slider-figure.js draws: the spec in data-figure, rounded to
    ``digits`` (stored outputs must not depend on a CPU's last bits), escaped; bad input
    refused by argument."""
    import html
    import json
    import re

    import numpy as np
    import pytest

    plotting = pytest.importorskip("tutorial_pkg.plotting")
    x = np.arange(3)
    frames = {"a": {"c": [0.123456789, 1, 2]}, "b": {"c": [3, 4, 5.55555555]}}
    out = plotting.slider_figure("fig-1", x, frames, slider='p <"&">', digits=3)
    spec = json.loads(html.unescape(re.search(r'data-figure="([^"]*)"', out).group(1)))
    assert spec["x"] == [0, 1, 2] and spec["slider"] == 'p <"&">'
    assert [f["value"] for f in spec["frames"]] == ["a", "b"]
    assert spec["frames"][0]["ys"] == [[0.123, 1, 2]]
    assert spec["frames"][1]["ys"] == [[3, 4, 5.556]]
    assert 'id="fig-1"' in out and "only this line shows" in out and "static figure" not in out
    own = plotting.slider_figure("fig-2", x, frames, slider="p", fallback="a <b> & c")
    assert "<p>a &lt;b&gt; &amp; c</p>" in own and "only this line" not in own
    with pytest.raises(ValueError, match="name must be"):
        plotting.slider_figure("1 bad", x, frames, slider="p")
    with pytest.raises(ValueError, match="frame 'b' has curves"):
        plotting.slider_figure("f", x, {"a": {"c": [1, 2, 3]}, "b": {"d": [1, 2, 3]}},
                               slider="p")
    with pytest.raises(ValueError, match="len\\(x\\) = 3"):
        plotting.slider_figure("f", x, {"a": {"c": [1, 2]}}, slider="p")
    with pytest.raises(ValueError, match="at least one frame"):
        plotting.slider_figure("f", x, {}, slider="p")
