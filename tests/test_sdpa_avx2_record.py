"""book/data/sdpa_avx2_mask.json, the record chapter 9's bug 16 reads.

It must be what ``benchmarks/sdpa_avx2_mask.py`` writes (every kernel level the script runs,
rounded values, a verdict per run against the script's tolerance), and the script's case
must be the chapter's: its function and its tensors are the chapter's cell, line for line.
"""

from __future__ import annotations

import inspect
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import sdpa_avx2_mask as script  # noqa: E402

RECORD = json.loads((ROOT / "book/data/sdpa_avx2_mask.json").read_text())


def chapter_cell(needle: str) -> str:
    nb = json.loads((ROOT / "book/09_debugging.ipynb").read_text(encoding="utf-8"))
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    found = [c for c in cells if needle in c]
    assert len(found) == 1, f"one code cell of chapter 9 must hold {needle!r}"
    return found[0]


def body_lines(function) -> list[str]:
    """The statements of a function's body (no docstring), stripped, one per source line."""
    lines = textwrap.dedent(inspect.getsource(function)).splitlines()[1:]
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith('"""')]


def test_the_script_runs_the_chapters_function_and_tensors():
    cell = chapter_cell("def my_alibi_attention(")
    assert inspect.getsource(script.my_alibi_attention) in cell
    cell_lines = [ln.strip() for ln in cell.splitlines()]
    for line in body_lines(script.case)[:-1]:  # all but its return
        assert line in cell_lines, line
    *statements, returned = body_lines(script.float64_attention)
    for line in statements:
        assert line in cell_lines, line
    assert "exact16 = " + returned.removeprefix("return ") in cell_lines


def test_the_record_has_every_kernel_level_rounded_and_judged():
    assert RECORD["tolerance"] == script.TOL and RECORD["torch"]
    runs = RECORD["runs"]
    assert [r["ATEN_CPU_CAPABILITY"] for r in runs] == list(script.CAPABILITIES)
    for r in runs:
        assert r["capability"] and (r["q_dtype"], r["mask_dtype"]) == ("float64", "float32")
        for error, right in ((r["max_error"], r["right"]),
                             (r["max_error_fixed"], r["right_fixed"])):
            assert (error is None) == right
            assert error is None or (error >= script.TOL and float(f"{error:.3g}") == error)
        assert r["output_scale"] > 0 and float(f"{r['output_scale']:.3g}") == r["output_scale"]
        assert r["right_fixed"]  # the mask in q's dtype is right at every level
    asked = {r["ATEN_CPU_CAPABILITY"]: r["capability"] for r in runs}
    assert asked["avx2"] == "AVX2" and asked["default"] == "DEFAULT"
    assert set(RECORD["cpu_flags"]) <= set(script.FLAGS)
    assert RECORD["command"].startswith("python benchmarks/sdpa_avx2_mask.py")
