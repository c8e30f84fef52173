"""Tests of the measuring library (tutorial_pkg.benchmark) and of the suite that uses it
(benchmarks/suite.py): CPU only, tiny sizes.

They check that the harness measures what it claims (a 2 ms sleep reads ~2 ms,
a known allocation reads its size), not how fast our code is; that every case
of the standard suite computes what its name says (the same attention as the
naive oracle). Timings are never asserted here.

The fast paths the suite measures are tested with their modules: the ``"auto"``
attention backend in test_attention.py, the few-pass and fused RoPE in test_rope.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import suite as bs
from tutorial_pkg import benchmark as bm

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    pytest.mark.usefixtures("one_thread"),
]

REPO_ROOT = Path(__file__).resolve().parents[1]
# Set TUTORIAL_PKG_SKIP_SLOW=1 to skip the torch.compile test (inductor codegen, seconds).
slow = pytest.mark.skipif(os.environ.get("TUTORIAL_PKG_SKIP_SLOW") == "1",
                          reason="TUTORIAL_PKG_SKIP_SLOW=1")
FAST = {"device": "cpu", "warmup": 1, "min_runs": 5, "max_time_s": 0.02}
FOUR_MB = 4_000_000
# The CPU allocator reports exact request sizes; allow a little for the odd
# scalar or bookkeeping tensor that an op may allocate.
SLACK = 64 * 1024


# --------------------------------------------------------------------------- #
# time_fn / naive_time_fn
# --------------------------------------------------------------------------- #
def test_timing_fields_are_consistent():
    x = torch.randn(32, 32)
    t = bm.time_fn(lambda: x @ x, **FAST)
    assert t.n_runs >= FAST["min_runs"]
    assert len(t.times_ms) == t.n_runs
    assert 0 < t.min_ms <= t.p25_ms <= t.median_ms <= t.p75_ms <= t.max_ms
    assert t.iqr_ms == pytest.approx(t.p75_ms - t.p25_ms)
    assert t.min_ms <= t.mean_ms <= t.max_ms
    assert t.device == "cpu" and t.method == "torch-timer" and t.calls_per_run >= 1


def test_sleep_of_2ms_measures_about_2ms():
    t = bm.time_fn(lambda: time.sleep(0.002), **FAST)
    assert 1.5 <= t.median_ms <= 50


def test_slow_function_still_gets_min_runs_quickly():
    start = time.perf_counter()
    t = bm.time_fn(lambda: time.sleep(0.01), device="cpu", warmup=1, min_runs=4,
                   max_time_s=0.001)
    assert t.n_runs >= 4
    assert time.perf_counter() - start < 2.0


def test_time_fn_respects_callers_thread_setting():
    before = torch.get_num_threads()
    seen = []
    try:
        torch.set_num_threads(1)
        bm.time_fn(lambda: seen.append(torch.get_num_threads()), **FAST)
        assert set(seen) == {1}
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_timing_from_times_statistics():
    t = bm.Timing.from_times([4.0, 1.0, 3.0, 2.0, 100.0], device="cpu", method="x")
    assert t.median_ms == pytest.approx(3.0) and t.min_ms == pytest.approx(1.0)
    assert t.max_ms == pytest.approx(100.0) and t.p25_ms == pytest.approx(2.0)
    assert t.p75_ms == pytest.approx(4.0) and t.iqr_ms == pytest.approx(2.0)
    with pytest.raises(ValueError):
        bm.Timing.from_times([], device="cpu", method="x")


def test_timing_wraps_a_torch_measurement():
    import torch.utils.benchmark as tb

    t = bm.Timing.from_times([2.0, 4.0], device="cpu", method="x", calls_per_run=10)
    assert isinstance(t.measurement, tb.Measurement)
    assert t.measurement.number_per_run == 10 and t.calls_per_run == 10
    assert t.measurement.raw_times == pytest.approx([0.02, 0.04])  # seconds per block
    assert t.times_ms == pytest.approx([2.0, 4.0]) and t.n_runs == 2
    x = torch.randn(16, 16)
    timed = bm.time_fn(lambda: x @ x, **FAST)
    assert isinstance(timed.measurement, tb.Measurement)
    assert timed.median_ms == pytest.approx(timed.measurement.median * 1e3)


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"min_runs": 0}, ValueError, "min_runs"),
        ({"min_runs": -3}, ValueError, "min_runs"),
        ({"warmup": -1}, ValueError, "warmup"),
        ({"max_time_s": 0}, ValueError, "max_time_s"),
        ({"min_runs": 2.5}, TypeError, "min_runs"),
        ({"device": "tpu9"}, ValueError, "device"),
        ({"device": "not a device"}, ValueError, "device"),
        ({"device": 3}, TypeError, "device"),
    ],
)
def test_time_fn_rejects_bad_arguments(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        bm.time_fn(lambda: None, **kwargs)


def test_non_callable_fn_is_rejected():
    for func in (bm.time_fn, bm.peak_memory):
        with pytest.raises(TypeError, match="fn"):
            func(42)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_requested_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="device"):
        bm.time_fn(lambda: None, device="cuda")


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


# --------------------------------------------------------------------------- #
# hardware_info, records, files, table
# --------------------------------------------------------------------------- #
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


def test_keep_freed_memory_stops_page_faults_on_fresh_outputs():
    resource = pytest.importorskip("resource")
    with pytest.raises(ValueError, match="threshold_bytes"):
        bm.keep_freed_memory(64 * 2**20)
    with pytest.raises(TypeError, match="threshold_bytes"):
        bm.keep_freed_memory(1.5)
    x = torch.randn(2**20)  # 4 MiB: above glibc's default mmap threshold before it adapts

    def faults_per_clone(n: int = 5) -> float:
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(n):
            y = x.clone()
            y.zero_()
            del y
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / n

    if not bm.keep_freed_memory():
        pytest.skip("not glibc")
    faults_per_clone()  # the first block comes from the OS once
    assert faults_per_clone() < 16  # 4 MiB = 1024 pages: reused, not faulted in again


# --------------------------------------------------------------------------- #
# compare
# --------------------------------------------------------------------------- #
def test_compare_fills_ratios_relative_to_reference():
    x = torch.randn(64, 64)

    def broken():
        raise RuntimeError("backend not available")

    cases = {
        "fast": lambda: x + 1,
        "slow": lambda: time.sleep(0.002),
        "extra": bm.Case(lambda: x * 2, {"backend": "mul"}),
        "broken": broken,
    }
    records = bm.compare(cases, "fast", device="cpu", group="grp", params={"seq_len": 64},
                         warmup=1, min_runs=3, max_time_s=0.01)
    by_name = {r.case: r for r in records}
    assert [r.case for r in records] == list(cases)
    assert by_name["fast"].ratio == 1.0 and by_name["fast"].peak_ratio in (None, 1.0)
    assert by_name["slow"].ratio > 1.0
    assert all(r.reference == "fast" and r.group == "grp" for r in records)
    assert by_name["extra"].params == {"seq_len": 64, "backend": "mul"}
    assert by_name["fast"].peak_bytes is not None
    assert by_name["broken"].error.startswith("RuntimeError")
    assert by_name["broken"].median_ms is None and by_name["broken"].ratio is None
    assert "broken" in bm.format_table(records)


def test_compare_reports_first_call_and_held_memory_apart():
    state = {"calls": 0}

    def slow_first_call():
        state["calls"] += 1
        if state["calls"] == 1:
            time.sleep(0.05)  # a one-off cost, like compiling

    records = bm.compare({"a": bm.Case(slow_first_call, held=lambda: 1234), "b": lambda: None},
                         "a", device="cpu", warmup=1, min_runs=3, max_time_s=0.01,
                         measure_memory=False)
    rec = {r.case: r for r in records}
    assert rec["a"].first_call_ms >= 45 and rec["a"].median_ms < 20  # not in the median
    assert rec["a"].held_bytes == 1234 and rec["b"].held_bytes is None


def test_compare_rounds_pool_samples():
    records = bm.compare({"a": lambda: None}, "a", device="cpu", warmup=0, min_runs=3,
                         max_time_s=0.005, rounds=2, measure_memory=False)
    assert records[0].n_runs >= 6 and records[0].peak_bytes is None


def test_compare_rejects_bad_arguments():
    with pytest.raises(ValueError, match="reference"):
        bm.compare({"a": lambda: None}, "b", device="cpu")
    with pytest.raises(TypeError, match="callable"):
        bm.compare({"a": 1}, "a", device="cpu")
    with pytest.raises(ValueError, match="min_runs"):
        bm.compare({"a": lambda: None}, "a", device="cpu", min_runs=0)

    def boom():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        bm.compare({"a": boom}, "a", device="cpu", catch_errors=False, warmup=0)


# --------------------------------------------------------------------------- #
# Suite and CLI
# --------------------------------------------------------------------------- #

def _args(*extra: str) -> argparse.Namespace:
    return bs.parse_args(["--quick", "--device", "cpu", *extra])


def _outputs(fn):
    out = fn()
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def test_attention_suite_cases_compute_the_same_attention():
    args = _args("--parts", "attention", "--lengths", "16", "--passes", "fwd", "fwd+bwd",
                 "--backends", "naive", "sdpa", "auto")
    entries = list(bs.default_suite(args))
    assert [e.params["pass"] for e in entries] == ["fwd", "fwd+bwd"]
    for entry in entries:
        assert entry.reference == bm.ATTENTION_LIMIT and entry.reference in entry.cases
        names = set(entry.cases)
        assert {"nope/sdpa", "alibi/auto", "alibi/article", "alibi/sdpa-3d-mask"} <= names
        assert "nope/auto" not in names  # auto is the sdpa path without a bias
        outs = {name: _outputs(case.fn) for name, case in entry.cases.items()}

        def same(a, b, outs=outs):
            for x, y in zip(outs[a], outs[b], strict=True):
                torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)

        same("nope/sdpa", bm.ATTENTION_LIMIT)  # NoPE through the package == the limit
        for enc in bs.ATTENTION_ENCODINGS:
            same(f"{enc}/sdpa", f"{enc}/naive")
        for enc in ("alibi", "hybrid"):
            same(f"{enc}/auto", f"{enc}/naive")
        same("alibi/article", "alibi/naive")
        same("alibi/sdpa-3d-mask", "alibi/naive")


def test_rope_and_lm_suites_run_at_tiny_sizes():
    args = _args("--parts", "rope", "lm", "--rope-shape", "1", "2", "8", "16",
                 "--lm-batch", "2", "--lm-len", "8")
    entries = list(bs.default_suite(args))
    assert [e.group for e in entries] == ["rope float32", "rope bfloat16", "lm step L=8"]
    for entry in entries[:2]:
        ref = _outputs(entry.cases["apply_rope"].fn)
        for name in ("rotate", "rotate_half", "complex"):
            got = _outputs(entry.cases[name].fn)
            tol = 1e-5 if entry.params["dtype"] == "float32" else 3e-2
            for g, r in zip(got, ref, strict=True):
                assert g.dtype == r.dtype
                if name != "complex":  # the complex form pairs features differently
                    torch.testing.assert_close(g.float(), r.float(), atol=tol, rtol=tol)
    lm = entries[2]
    assert lm.reference == "nope"
    assert {"nope", "sinusoidal", "learned", "rope", "alibi", "hybrid"} <= set(lm.cases)
    loss = lm.cases["alibi"].fn()
    assert loss.shape == () and torch.isfinite(loss)


def test_cli_quick_writes_json(tmp_path):
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "suite.py"), "--quick", "--device", "cpu",
         "--parts", "attention", "--encodings", "alibi", "--backends", "sdpa", "auto",
         "--lengths", "32", "--no-memory", "--no-progress", "--out", str(out)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "median ms" in proc.stdout and "held MiB" in proc.stdout
    data = json.loads(out.read_text())
    assert data["hardware"]["device"] == "cpu"
    assert data["hardware"]["malloc"] in ("glibc keeps freed blocks (mmap threshold 32 MiB)",
                                          "default")
    records = {r["case"]: r for r in data["records"]}
    assert set(records) == {bm.ATTENTION_LIMIT, "alibi/sdpa", "alibi/auto", "alibi/article",
                            "alibi/sdpa-3d-mask"}
    assert all(r["ratio"] is not None and r["first_call_ms"] > 0 for r in records.values())
    # the cached (1, H, 128, 128) table vs a (1, H, 1, 128) row (both rounded up to 128)
    assert records["alibi/sdpa"]["held_bytes"] >= 8 * 128 * 128 * 4
    assert records["alibi/auto"]["held_bytes"] < 8 * 128 * 4 * 2


def test_cli_help_from_its_new_home():
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "suite.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--device {cpu,cuda}" in proc.stdout and "benchmark_gpu.json" in proc.stdout


def test_library_does_not_import_the_model():
    # the suites build models; the measuring library must not need them
    import ast

    tree = ast.parse((REPO_ROOT / "tutorial_pkg" / "benchmark.py").read_text())
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {"model", ".model", "tutorial_pkg.model", "attention", "encodings"} & imported


def test_cli_custom_suite_hook(tmp_path, capsys):
    def suite(args: argparse.Namespace):
        yield bs.SuiteEntry("tiny", {"ref": lambda: None, "b": lambda: None}, "ref", {"n": 1})

    out = tmp_path / "r.json"
    assert bs.main(["--quick", "--device", "cpu", "--no-progress", "--no-memory",
                    "--out", str(out)], suite=suite) == 0
    hardware, records = bm.load_results(out)
    assert [r.case for r in records] == ["ref", "b"] and records[0].ratio == 1.0
    assert "tiny" in capsys.readouterr().out


def test_cli_rejects_bad_suite_spec():
    with pytest.raises(SystemExit):
        bs.main(["--quick", "--device", "cpu", "--suite", "no_colon_here"])


def test_suite_script_checks_targets_on_records():
    suite = bs

    def rec(group, case, ratio, **params):
        return bm.BenchRecord(group=group, case=case, params=params, ratio=ratio,
                              median_ms=ratio, first_call_ms=5000.0 if case == "slow" else 1.0)

    records = [
        rec("attn L=2048 fwd", "alibi/auto", 1.05, heads=8, seq_len=2048),
        rec("attn L=2048 fwd", "alibi/article", 4.0, heads=8, seq_len=2048),
        rec("rope float32", "rotate fused", 1.2, shape=[4, 8, 2048, 64]),
        rec("rope bfloat16", "rotate fused", 1.2, shape=[1, 4, 128, 64]),  # other sizes
        rec("lm step L=64", "rope", 1.5, batch=32, seq_len=64),
        rec("x", "slow", 2.0),
    ]
    verdicts = {t.name: v for t, _, v in suite.check_targets(records)}
    assert verdicts["P1 fwd L=2048"] == "PASS" and verdicts["P1 fwd L=4096"] == "not measured"
    assert verdicts["P1 article L=2048"] == "PASS"  # 4.0 / 1.05 >= 3
    assert verdicts["P3 float32 rotate fused"] == "PASS"
    assert verdicts["P3 bfloat16 rotate fused"] == "not measured"
    assert verdicts["P4 rope"] == "MISS"
    assert "slow" in suite.one_off_costs(records)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_events_and_memory():
    x = torch.randn(1024, 1024, device="cuda")
    t = bm.time_fn(lambda: x @ x, device="cuda", warmup=2, min_runs=5, max_time_s=0.05)
    assert t.method == "cuda-events" and t.n_runs >= 5 and t.min_ms > 0
    m = bm.peak_memory(lambda: torch.empty(2**20, device="cuda"), device="cuda")
    assert 4 * 2**20 <= m.peak_bytes <= 4 * 2**20 + 2**20
