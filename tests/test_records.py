"""Tests of tutorial_pkg.measure.records: :func:`~tutorial_pkg.measure.records.hardware_info`
(JSON, no local paths), :class:`~tutorial_pkg.measure.records.BenchRecord` and its ratio range,
results files (:func:`~tutorial_pkg.measure.records.save_results` /
:func:`~tutorial_pkg.measure.records.load_results`: a round trip, and what they refuse) and the
text tables (:func:`~tutorial_pkg.measure.records.format_table`,
:func:`~tutorial_pkg.measure.records.text_table`). CPU only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tutorial_pkg import measure as bm

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    pytest.mark.usefixtures("one_thread"),
]

REPO_ROOT = Path(__file__).resolve().parents[1]
FAST = {"device": "cpu", "warmup": 1, "min_runs": 5, "max_time_s": 0.02}


def test_hardware_info_is_json_and_has_no_paths():
    info = bm.hardware_info("cpu")
    for key in ("device", "device_name", "num_threads", "torch", "cuda", "python", "os", "date",
                "loadavg"):
        assert key in info
    assert info["device"] == "cpu" and info["torch"] == torch.__version__
    text = json.dumps(info)
    assert str(REPO_ROOT) not in text and os.path.expanduser("~") not in text


def _record(case: str, median: float, **params) -> bm.BenchRecord:
    t = bm.Timing.from_times([median, median * 1.1], device="cpu", method="torch-timer")
    mem = bm.MemoryStat(peak_bytes=3 * 2**20, net_bytes=2**20, device="cpu", method="m")
    return bm.BenchRecord.from_measurements(
        group="g", case=case, params=params, device="cpu", timing=t, memory=mem, reference="ref"
    )


def test_save_results_refuses_what_is_not_a_record(tmp_path):
    with pytest.raises(TypeError, match=r"records\[0\]"):
        bm.save_results([{"case": "a"}], tmp_path / "r.json", {})
    with pytest.raises(TypeError, match="hardware"):
        bm.save_results([], tmp_path / "r.json", ["cpu"])
    assert not (tmp_path / "r.json").exists()


def test_save_load_round_trip(tmp_path):
    records = [
        _record("ref", 1.0, seq_len=128, dtype=torch.float16, stage="fwd"),
        _record("other", 2.0, seq_len=128, dtype=torch.float16, stage="fwd"),
    ]
    records[1].error = None
    records[1].ratio = 2.0
    records[1].held_bytes, records[1].first_call_ms = 3 * 2**20, 1234.5
    hw = bm.hardware_info("cpu")
    path = bm.save_results(records, tmp_path / "sub" / "r.json", hw)
    raw = json.loads(path.read_text())
    assert set(raw) >= {"hardware", "records"}
    assert raw["records"][0]["params"]["dtype"] == "float16"
    hardware, loaded = bm.load_results(path)
    assert hardware == hw
    assert [r.to_dict() for r in loaded] == [r.to_dict() for r in records]


def test_load_results_rejects_other_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError):
        bm.load_results(path)


def test_format_table_lists_cases():
    recs = [_record("ref", 1.0, seq_len=64), _record("other", 2.0, seq_len=128)]
    recs[0].ratio, recs[1].ratio = 1.0, 2.0
    table = bm.format_table(recs)
    assert "median ms" in table and "peak MiB" in table
    assert "1.00 ref" in table and "2.00" in table and "3.00" in table
    assert "seq_len=128" in table
    assert "held MiB" not in table and "1st call ms" not in table  # only when present
    recs[1].held_bytes, recs[1].first_call_ms = 2**21, 9000.0
    table = bm.format_table(recs)
    assert "held MiB" in table and "2.00" in table and "1st call ms" in table
    assert "9,000.00" in table
    assert bm.format_table([]) == "(no records)"
    narrow = bm.format_table(recs, columns=["case", "median ms", "ratio"]).splitlines()
    header = next(line for line in narrow if line.startswith("case"))
    assert header.split() == ["case", "median", "ms", "ratio"]
    assert "peak MiB" not in "\n".join(narrow)
    with pytest.raises(ValueError, match="columns"):
        bm.format_table(recs, columns=["nope"])


def test_text_table_aligns_text_left_and_numbers_right():
    lines = bm.text_table(["name", "value"], [["a", "1.5"], ["longer", "10.25"]])
    assert lines == ["name    value", "------  -----", "a         1.5", "longer  10.25"]
    with pytest.raises(ValueError, match="rows"):
        bm.text_table(["a", "b"], [["only one"]])


def test_ratio_range_is_the_spread_of_the_round_ratios():
    rec = _record("a", 2.0)
    assert rec.ratio_range is None  # no ratio yet
    rec.ratio, rec.round_ratios = 1.02, [1.04, 0.99, 1.02]
    assert rec.ratio_range == (0.99, 1.04)
    rec.round_ratios = [1.02]
    assert rec.ratio_range is None  # one round has no spread
    recs = bm.compare({"ref": lambda: None, "b": lambda: sum(range(50))}, "ref", rounds=2,
                      measure_memory=False, **FAST)
    lo, hi = recs[1].ratio_range
    assert lo <= recs[1].ratio <= hi and recs[0].ratio_range == (1.0, 1.0)
    table = bm.format_table(recs)
    assert "ratio range" in table and "1.00-1.00" in table
    assert "ratio range" not in bm.format_table([_record("ref", 1.0)])  # only with rounds
    # a stored file (no such field) still loads, and its rounds give the range
    stored = bm.BenchRecord.from_dict({**recs[1].to_dict(), "unknown_future_key": 1})
    assert stored.ratio_range == recs[1].ratio_range
