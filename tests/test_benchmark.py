"""Tests of the measuring library's side-by-side comparison (tutorial_pkg.measure.cases, and
the package tutorial_pkg.measure that re-exports it) and of the suite that uses it
(benchmarks/): CPU only, tiny sizes.

They check that :func:`~tutorial_pkg.measure.cases.compare` measures what it claims (ratios to
the reference, first calls and held bytes apart, cases that would not fit skipped), not how
fast our code is; that every case of the standard suite computes what its name says (the same
attention as the naive oracle). Timings are never asserted here.

The parts ``cases`` builds on have their own files: test_timing.py (``measure.timing``),
test_memory.py (``measure.memory``), test_records.py (``measure.records``). The fast paths
the suite measures are tested with their modules: the ``"auto"`` attention backend in
test_attention.py, the few-pass and fused RoPE in test_rope.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import suite as bs
from benchmarks.allocator import keep_freed_memory
from tutorial_pkg import measure as bm

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    pytest.mark.usefixtures("one_thread"),
]

REPO_ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- #
# benchmarks/allocator.py
# --------------------------------------------------------------------------- #
def test_keep_freed_memory_stops_page_faults_on_fresh_outputs():
    resource = pytest.importorskip("resource")
    with pytest.raises(ValueError, match="threshold_bytes"):
        keep_freed_memory(64 * 2**20)
    with pytest.raises(TypeError, match="threshold_bytes"):
        keep_freed_memory(1.5)
    x = torch.randn(2**20)  # 4 MiB: above glibc's default mmap threshold before it adapts

    def faults_per_clone(n: int = 5) -> float:
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(n):
            y = x.clone()
            y.zero_()
            del y
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / n

    if not keep_freed_memory():
        pytest.skip("not glibc")
    # the first blocks come from the OS: up to 8 clones' worth when this test runs first in
    # its process (when others ran before it, the heap had grown already and 5 were enough)
    faults_per_clone(20)
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


def test_compare_measures_one_case_at_a_time_and_releases_each():
    """held is read before release; release follows every round of a case, so when the next
    case runs, the previous one holds nothing; a later round rebuilds untimed."""
    log, state = [], {"a": None, "b": None}

    def make(name):
        def fn():
            if state[name] is None:
                log.append(f"build {name}")
                state[name] = torch.ones(1000)
            others = [n for n in state if n != name and state[n] is not None]
            assert not others, f"{name} runs while {others} hold memory"

        def release():
            log.append(f"release {name}")
            state[name] = None

        return bm.Case(fn, held=lambda: 0 if state[name] is None else state[name].nbytes,
                       release=release)

    records = bm.compare({"a": make("a"), "b": make("b")}, "a", device="cpu", warmup=0,
                         min_runs=2, max_time_s=0.001, rounds=2)
    assert all(r.ok for r in records), [r.error for r in records]
    assert all(r.held_bytes == 4000 for r in records)  # read before the release
    assert log == ["build a", "release a", "build b", "release b"] * 2
    assert state == {"a": None, "b": None}


def test_compare_skips_what_would_not_fit_and_says_why():
    called = []
    small = bm.Footprint(held=0, call=2**20)
    big = bm.Footprint(held=3 * 2**30, call=2 * 2**30, build=4 * 2**30, inputs=2**20)
    cases = {
        "ref": bm.Case(lambda: called.append("ref"), footprint=small),
        "big": bm.Case(lambda: called.append("big"), footprint=big,
                       release=lambda: called.append("released big")),
        "no kernel": bm.Case(lambda: called.append("no kernel"), skip="no bf16 on sm75"),
        "undeclared": lambda: called.append("undeclared"),
    }
    records = {r.case: r for r in bm.compare(cases, "ref", device="cpu", warmup=0, min_runs=2,
                                            max_time_s=0.001, memory_limit=2 * 2**30)}
    assert "big" not in called and "no kernel" not in called and "released big" not in called
    assert {"ref", "undeclared"} <= set(called)
    big_rec = records["big"]
    assert big_rec.skipped and not big_rec.ok and big_rec.median_ms is None
    assert big_rec.error == ("skipped: needs about 5.00 GiB (held 3.00 GiB, per call 2.00 GiB,"
                             " first call 4.00 GiB), 6.25 GiB with headroom; 2.00 GiB available")
    assert big_rec.footprint_bytes == 5 * 2**30 and records["ref"].footprint_bytes == 2**20
    assert records["no kernel"].skipped and records["no kernel"].error == (
        "skipped: no bf16 on sm75")
    assert records["ref"].ok and records["undeclared"].ok and not records["ref"].skipped
    table = bm.format_table(list(records.values()))
    assert "skipped" in table and "6.25 GiB with headroom" in table
    # the new fields go through a results file; files without them still load
    back = bm.BenchRecord.from_dict(json.loads(json.dumps(big_rec.to_dict())))
    assert back.skipped and back.footprint_bytes == 5 * 2**30
    old = {k: v for k, v in big_rec.to_dict().items() if k not in ("skipped", "footprint_bytes")}
    assert bm.BenchRecord.from_dict(old).skipped is False


# ------------------------------------------------------------ footprints, by hand
GIB, MIB = 2**30, 2**20
T4_FWD = {"batch": 1, "heads": 8, "seq_len": 8192, "head_dim": 64, "dtype": torch.float16,
          "train": False, "device": "cuda", "key_bias": False}


def test_attention_footprint_of_the_t4_plan_by_hand():
    """Chapter 5's GPU setting (8 heads of 64, L = 8192, float16) on a GPU's rules.

    B = H L^2 = 2**29 elements; N = H L d = 2**22 elements, 8 MiB in float16."""
    sdpa = bs.attention_footprint("alibi", "sdpa", **T4_FWD)
    assert sdpa.held == 2 * GIB  # the (1, 8, 8192, 8192) float32 table
    # per call: its float32 shifted slice (2 GiB) and float16 copy (1 GiB), the output
    # (8 MiB), the log-sum-exp (8 x 8192 float32 = 256 KiB)
    assert sdpa.call == 3 * GIB + 8 * MIB + 256 * 1024
    assert sdpa.build == 4 * GIB + 256 * MIB  # two float32 tables and the distances
    assert sdpa.need == sdpa.held + sdpa.call and sdpa.inputs == 24 * MIB
    naive = bs.attention_footprint("alibi", "naive", **T4_FWD)
    # three float32 (8, L, L) tensors while the bias is built next to the scores, plus the
    # (L, L) float32 distances (256 MiB); the causal mask and its negation (2 x 64 MiB); the
    # float32 v and output (2 x 16 MiB); the float16 output (8 MiB)
    assert naive.held == 0 and naive.need == 6 * GIB + 256 * MIB + 128 * MIB + 40 * MIB
    article = bs.attention_footprint("alibi", "article", **T4_FWD)
    assert article.held == 2 * GIB  # its float32 buffer, side max(2048, L)
    assert article.call == 4 * GIB + 5 * 64 * MIB + 32 * MIB + 8 * MIB
    mask3 = bs.attention_footprint("alibi", "sdpa-3d-mask", **T4_FWD)
    assert mask3.held == GIB and mask3.build == 5 * GIB  # float32, shifted, float16 at once
    row = bs.attention_footprint("alibi", "auto", **{**T4_FWD, "key_bias": True})
    assert row.held == 8 * 8192 * 4 and row.need < 10 * MIB  # a row per head
    auto = bs.attention_footprint("alibi", "auto", **T4_FWD)  # no key row: the table path
    assert auto.need == sdpa.need
    on_cpu = bs.attention_footprint("alibi", "sdpa", **{**T4_FWD, "device": "cpu"})
    assert on_cpu.call == sdpa.call  # masks of q's dtype on every device: the same copies
    train = bs.attention_footprint("alibi", "sdpa", **{**T4_FWD, "train": True})
    assert train.inputs == 32 * MIB and train.call == sdpa.call + 3 * 8 * MIB + 16 * MIB
    for name, fp in (("sdpa", sdpa), ("naive", naive), ("article", article)):
        assert sum(v for k, v in fp.parts.items() if not k.startswith(("inputs", "first"))) \
            == fp.held + fp.call, name  # the parts are the terms
    assert bm.fit_problem(naive, int(14.5 * GIB)) is None
    at_16k = bs.attention_footprint("alibi", "naive", **{**T4_FWD, "seq_len": 16384})
    assert bm.fit_problem(at_16k, int(14.5 * GIB)) is not None


def _measured_need(case) -> int:
    first = bm.peak_memory(case.fn, device="cpu", warmup=0).peak_bytes  # builds what it holds
    steady = bm.peak_memory(case.fn, device="cpu", warmup=0).peak_bytes
    held = case.held() if case.held is not None else 0
    if case.release is not None:
        case.release()
    return max(first, held + steady)


@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize(("dtype", "rules"), [("float32", "cpu"), ("float16", "cpu"),
                                              ("float16", "gpu")])  # float32: the same rules
def test_attention_footprints_bound_the_memory_measured_on_cpu(rules, pass_, dtype):
    """Every case, measured with the profiler, against its footprint: never more than the
    estimate plus 2 MiB (CPU kernels' scratch buffers, a constant left to the 256 MiB
    reserve), and, where the quadratic terms dominate (4 MiB and up here), not wasteful
    either (under 1.35x the measurement). With the GPU's rules the backends cast masks to
    q's dtype and take no key row, so the GPU-only terms are measured too."""
    import contextlib

    from tutorial_pkg import backends

    gpu_rules = backends.assume_kernels("cpu", key_bias=False)
    with gpu_rules if rules == "gpu" else contextlib.nullcontext():
        args = _args("--dtype", dtype, "--heads", "4", "--head-dim", "16", "--lengths", "512",
                     "--passes", pass_, "--encodings", "alibi", "--backends", "naive", "sdpa",
                     "auto")
        (entry,) = bs.attention_suite(args)
        try:
            quadratic = 0
            for name, case in entry.cases.items():
                need, measured = case.footprint.need, _measured_need(case)
                assert measured <= need + 2 * 2**20, (name, measured, need)
                if need >= 4 * 2**20:
                    quadratic += 1
                    assert need <= 1.35 * measured, (name, measured, need)
            # naive, sdpa, article, the 3-D mask (and auto without its row)
            assert quadratic >= 4
        finally:
            backends.clear_caches()


def test_rope_and_lm_footprints_bound_their_memory():
    args = _args("--parts", "rope", "lm", "--rope-shape", "2", "4", "512", "32",
                 "--lm-batch", "4", "--lm-len", "32")
    for entry in bs.default_suite(args):
        for name, case in entry.cases.items():
            if name == "rotate fused":
                continue  # compiling: its memory is the copy's
            measured = bm.peak_memory(case.fn, device="cpu", warmup=1).peak_bytes
            held = case.held() if case.held is not None else 0
            assert held + measured <= case.footprint.need, (entry.group, name)


# ------------------------------------------------------------ the plan, by compute capability
@pytest.mark.parametrize(("capability", "bf16"), [((7, 5), False), ((8, 0), True),
                                                  ((9, 0), True)])
def test_device_plan_follows_the_compute_capability(monkeypatch, capability, bf16):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    plan = bs.device_plan("cuda")
    assert plan.capability == capability and plan.dtype == "float16"
    assert plan.bf16 is bf16 and plan.fused_bf16 is bf16
    assert plan.rope_dtypes == ("float32", "float16", "bfloat16")
    assert bool(plan.notes) is not bf16 and (bf16 or "sm75" in plan.notes[0])
    args = bs.parse_args(["--parts", "rope", "--rope-shape", "1", "2", "8", "16"])
    args.plan = plan  # the GPU's plan, its cases built on the CPU
    (entry,) = [e for e in bs.rope_suite(args) if e.group == "rope bfloat16"]
    assert (entry.cases["rotate fused"].skip is None) is bf16
    if not bf16:  # recorded as skipped, with the reason, and never called
        (rec,) = [r for r in bm.compare(entry.cases, bs.ROPE_LIMIT, device="cpu", warmup=0,
                                        min_runs=1, max_time_s=0.001, measure_memory=False)
                  if r.case == "rotate fused"]
        assert rec.skipped and "compute capability 8.0" in rec.error and "sm75" in rec.error
    cpu = bs.device_plan("cpu")
    assert cpu.dtype == "float32" and cpu.fused_bf16 and cpu.capability is None


def test_the_command_line_takes_the_plan_on_cuda(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(bs.bm, "resolve_device", lambda device=None: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    args = bs.parse_args(["--device", "cuda"])
    assert args.dtype == "float16" and args.lengths == [1024, 2048, 4096, 8192, 16384]
    assert args.plan.fused_bf16 is False
    with pytest.raises(ValueError, match="bfloat16.*sm75"):
        bs.parse_args(["--device", "cuda", "--dtype", "bfloat16"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert bs.parse_args(["--device", "cuda", "--dtype", "bfloat16"]).dtype == "bfloat16"


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
        assert entry.reference == bs.ATTENTION_LIMIT and entry.reference in entry.cases
        names = set(entry.cases)
        assert {"nope/sdpa", "alibi/auto", "alibi/article", "alibi/sdpa-3d-mask"} <= names
        assert "nope/auto" not in names  # auto is the sdpa path without a bias
        outs = {name: _outputs(case.fn) for name, case in entry.cases.items()}

        def same(a, b, outs=outs):
            for x, y in zip(outs[a], outs[b], strict=True):
                torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)

        same("nope/sdpa", bs.ATTENTION_LIMIT)  # NoPE through the package == the limit
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
        ref = _outputs(entry.cases["spec"].fn)
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
    assert set(records) == {bs.ATTENTION_LIMIT, bs.ATTENTION_AA, "alibi/sdpa", "alibi/auto",
                            "alibi/article", "alibi/sdpa-3d-mask"}
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

    for module in ("__init__", "cases", "timing", "memory", "records"):
        tree = ast.parse((REPO_ROOT / "tutorial_pkg" / "measure" / f"{module}.py").read_text())
        imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                     for a in n.names}
        assert not {"model", ".model", "tutorial_pkg.models.tiny_lm", "attention", "encodings",
                    "..models", "..attention", "..encodings", "..experiments",
                    "benchmarks", "matplotlib"} & imported, module
        assert all(not m.startswith("..") or m == ".._checks" for m in imported), module


def test_make_bench_runs_a_command_that_takes_its_options():
    """``make bench`` names a program that exists and parses the options it is given (the
    old target ran the library module itself, which has no ``__main__``: it
    exited 0, printed nothing and wrote nothing)."""
    import shlex
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make here")
    proc = subprocess.run(["make", "-s", "-n", "bench"], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=True)
    (line,) = [ln for ln in proc.stdout.splitlines() if "python" in ln]
    python, *args = shlex.split(line)
    assert Path(python).name.startswith("python") and "--out" in args
    if args[0] == "-m":
        assert args[1].startswith("benchmarks.") or args[1].startswith("tutorial_pkg.")
    else:
        assert (REPO_ROOT / args[0]).is_file(), f"make bench runs {args[0]}, which is missing"
    help_ = subprocess.run([sys.executable, *args, "--help"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0, help_.stderr
    assert "--out" in help_.stdout  # the option make passes is one the program reads


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
        rec("rope bfloat16", "rotate", 6.0, shape=[4, 8, 2048, 64]),
        rec("lm step L=64", "rope", 1.5, batch=32, seq_len=64),
        rec("x", "slow", 2.0),
    ]
    verdicts = {t.name: v for t, _, v in suite.check_targets(records)}
    assert verdicts["P1 fwd L=2048"] == "PASS" and verdicts["P1 fwd L=4096"] == "not measured"
    assert verdicts["P1 article L=2048"] == "PASS"  # 4.0 / 1.05 >= 3
    assert verdicts["P3 float32 rotate fused"] == "PASS"
    assert verdicts["P3 bfloat16 rotate fused"] == "not measured"
    assert verdicts["P3 bfloat16 rotate"] == "MISS" and verdicts["P3 float32 rotate"] == (
        "not measured")
    assert verdicts["P4 rope"] == "MISS"
    assert "slow" in suite.one_off_costs(records)


# --------------------------------------------------------------------------- #
# benchmarks/gpu_check.py (the machinery; the GPU run itself needs a GPU)
# --------------------------------------------------------------------------- #
def _notebook(path: Path, *sources: str) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook()
    for source in sources:
        cell = nbformat.v4.new_code_cell(source)
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="stored\n")]
        cell.execution_count = 7
        nb.cells.append(cell)
    nbformat.write(nb, path)
    return path


def test_gpu_check_executes_a_copy_and_reports_the_first_failing_cell(tmp_path):
    import nbformat

    from benchmarks import gpu_check

    book = tmp_path / "book"
    book.mkdir()
    (book / "data.txt").write_text("x")
    ok = _notebook(book / "ok.ipynb", "import os\nprint(os.path.exists('data.txt'))")
    bad = _notebook(book / "bad.ipynb", "x = 1", "raise ValueError('broken here')",
                    "print('never')")
    stored = bad.read_bytes()
    out = tmp_path / "out"
    stage = gpu_check.run_chapter(ok, out, cap=120)
    assert stage["status"] == "ok" and stage["name"] == "ok"
    run = nbformat.read(out / stage["notebook"], as_version=4)
    assert run.cells[0].outputs[0]["text"] == "True\n"  # in book/, as the chapters expect
    stage = gpu_check.run_chapter(bad, out, cap=120,
                                  first_cell="print('inserted, e.g. by --as-t4')")
    assert stage["status"] == "error" and stage["failed_cell"] == 1  # the stored index
    assert stage["error"] == "ValueError: broken here"
    run = nbformat.read(out / stage["notebook"], as_version=4)
    assert run.cells[0].source.startswith("print('inserted")
    assert run.cells[3].outputs == []  # never ran: no stored output passes for this run's
    assert bad.read_bytes() == stored  # the chapter itself is only read


def test_gpu_check_stops_a_chapter_at_its_cap(tmp_path):
    from benchmarks import gpu_check

    slow = _notebook(tmp_path / "slow.ipynb", "x = 1", "import time\ntime.sleep(120)")
    start = time.monotonic()
    stage = gpu_check.run_chapter(slow, tmp_path / "out", cap=15)
    assert stage["status"] == "timeout" and stage["failed_cell"] == 1
    assert time.monotonic() - start < 90


def test_gpu_check_compares_footprints_with_measurements():
    from benchmarks import gpu_check

    def rec(case, estimate, held, peak, **extra):
        return {"group": "attn L=4096 fwd", "case": case, "footprint_bytes": estimate,
                "held_bytes": held, "peak_bytes": peak, "error": None, **extra}

    gib = 2**30
    rows = gpu_check.footprint_rows([
        rec("fits", 100 * 2**20, 40 * 2**20, 50 * 2**20),
        rec("within headroom", 4 * gib, gib, 4 * gib),  # 5 <= 4 x 1.2 + 0.25 GiB
        rec("over", 4 * gib, gib, 4 * gib + 200 * 2**20),
        rec("skipped", 100 * 2**20, None, None, error="skipped: ...", skipped=True),
        rec("undeclared", None, 0, 1),
    ])
    assert [(r["case"], r["over"]) for r in rows] == [
        ("fits", False), ("within headroom", False), ("over", True)]
    assert rows[0]["measured_mib"] == 90.0 and rows[0]["estimate_mib"] == 100.0
    assert rows[0]["ratio"] == 0.9
    summary = {"hardware": {"device_name": "GPU", "compute_capability": "7.5"},
               "budget_s": 540, "total_s": 12.0, "as_t4": True, "footprints": rows,
               "stages": [{"name": "05_benchmarking", "status": "error", "cap_s": 210,
                           "seconds": 3.0, "failed_cell": 12, "error": "RuntimeError: x"}]}
    lines = gpu_check.summary_lines(summary)
    assert "compute capability 7.5" in lines[0] and "as a T4" in lines[0]
    assert "cell 12: RuntimeError: x" in lines[1] and "OVER" in lines[-1]
    assert sum(cap for _, cap in gpu_check.CHAPTERS) > gpu_check.BUDGET_S  # hence the order
    assert gpu_check.CHAPTERS[0][0] == "05_benchmarking"
    assert {name for name, _ in gpu_check.CHAPTERS} == {
        p.stem for p in (REPO_ROOT / "book").glob("[0-9][0-9]_*.ipynb")}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_gpu_check_without_a_gpu_says_so(tmp_path, capsys):
    from benchmarks import gpu_check

    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_cli_memory_limit_skips_with_the_reason_and_records_it(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bs.main(["--quick", "--device", "cpu", "--parts", "attention", "--encodings",
                    "alibi", "--backends", "sdpa", "--lengths", "32", "--no-memory",
                    "--no-progress", "--default-malloc", "--memory-limit", "0.3",
                    "--out", str(out)]) == 0
    hardware, records = bm.load_results(out)
    by_case = {r.case: r for r in records}
    # the articles' float32 buffer, 8 x 2048 x 2048 x 4 = 128 MiB, does not fit 0.3 GiB
    # with the headroom (128 MiB x 1.2 + 256 MiB); everything else does
    assert by_case["alibi/article"].skipped and "307.2 MiB available" in by_case[
        "alibi/article"].error
    assert all(r.ok for name, r in by_case.items() if name != "alibi/article")
    assert by_case["alibi/sdpa"].footprint_bytes > 0
    assert hardware["memory_limit_gib"] == 0.3 and hardware["plan"]["dtype"] == "float32"
    assert "skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bs.main(["--quick", "--device", "cpu", "--memory-limit", "0"])


# --------------------------------------------------------------------------- #
# The L2 flush on a GPU, work per call, the SDPA kernel
# --------------------------------------------------------------------------- #
def test_compare_flushes_l2_on_a_cuda_device(monkeypatch):
    """compare asks time_fn to flush L2 on CUDA (default) and not on a CPU; the CUDA path is
    rehearsed through the library's public names and torch.cuda's, no GPU needed."""
    from tutorial_pkg.measure import cases as bench  # the module compare() reads

    seen = []

    def fake_time_fn(fn, *, device, flush_l2=False, **kwargs):
        fn()
        seen.append((str(device), flush_l2))
        return bm.Timing.from_times([1.0, 1.0], device=str(device), method="cuda-events")

    monkeypatch.setattr(bench, "time_fn", fake_time_fn)
    cases = {"ref": lambda: None, "b": lambda: None}
    bm.compare(cases, "ref", device="cpu", measure_memory=False)
    assert seen and all(flush is False for _, flush in seen)  # a CPU has no L2 to flush here
    seen.clear()
    bm.compare(cases, "ref", device="cpu", measure_memory=False, flush_l2=True)
    assert all(flush is True for _, flush in seen)  # passed through as given
    seen.clear()
    monkeypatch.setattr(bench, "resolve_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    recs = bm.compare(cases, "ref", device="cuda", measure_memory=False)
    assert [r.ok for r in recs] == [True, True]
    assert seen and all(dev == "cuda:0" and flush is True for dev, flush in seen)
    seen.clear()
    bm.compare(cases, "ref", device="cuda", measure_memory=False, flush_l2=False)
    assert all(flush is False for _, flush in seen)  # warm-cache timing, when asked for
    with pytest.raises(TypeError, match="flush_l2"):
        bm.compare(cases, "ref", device="cpu", flush_l2="yes")


def test_attention_work_counts_the_flops_of_the_two_products():
    from torch.utils.flop_counter import FlopCounterMode

    b, h, n, d = 2, 3, 16, 8
    q = torch.randn(b, h, n, d)
    with FlopCounterMode(display=False) as counter:  # the naive attention's two matmuls
        torch.softmax(q @ q.transpose(-2, -1), -1) @ q
    full = bm.attention_work(b, h, n, n, d, dtype=torch.float32, causal=False)
    assert full.flops == counter.get_total_flops() == 4 * b * h * n * n * d
    causal = bm.attention_work(b, h, n, n, d, dtype=torch.float32)
    assert causal.flops == 4 * b * h * d * n * (n + 1) // 2  # pairs j <= i
    # a KV-cache chunk of 4 queries against 16 keys, top-left aligned as is_causal is
    chunk = bm.attention_work(1, 1, 4, 16, d, dtype=torch.float32)
    assert chunk.flops == 4 * d * (1 + 2 + 3 + 4)
    assert bm.attention_work(1, 1, 20, 16, d).flops == 4 * d * (16 * 17 // 2 + 4 * 16)
    # bytes: q, k, v in and out once, in the dtype's width
    fp16 = bm.attention_work(b, h, n, n, d, dtype=torch.float16)
    assert fp16.bytes == 2 * 4 * b * h * n * d
    assert bm.attention_work(b, h, n, n, d, dtype=torch.float32).bytes == 2 * fp16.bytes
    gqa = bm.attention_work(b, 4, n, n, d, kv_heads=2, dtype=torch.float16)
    assert gqa.bytes == 2 * (2 * b * 4 * n * d + 2 * b * 2 * n * d) and gqa.flops == 4 / 3 * (
        causal.flops)
    train = bm.attention_work(b, h, n, n, d, dtype=torch.float16, backward=True)
    assert train.flops == 3.5 * fp16.flops
    assert train.bytes == 2 * (2 + 4) * 2 * b * h * n * d + 2 * b * h * n * 4
    biased = bm.attention_work(b, h, n, n, d, extra_bytes=2 * h * n * n)
    assert biased.bytes == fp16.bytes + 2 * h * n * n
    # rates: 1 TFLOP in 1 s is 1 TFLOP/s
    tflops, gbs = bm.Work(flops=10**12, bytes=10**9).rates(1000.0)
    assert math.isclose(tflops, 1.0) and math.isclose(gbs, 1.0)
    assert math.isclose(bm.Work(flops=300, bytes=2).intensity, 150.0)
    with pytest.raises(ValueError):
        bm.Work(1, 1).rates(0.0)
    with pytest.raises(ValueError, match="kv_heads"):
        bm.attention_work(1, 4, 8, 8, 8, kv_heads=3)
    with pytest.raises(ValueError):
        bm.attention_work(0, 4, 8, 8, 8)
    with pytest.raises(TypeError):
        bm.attention_work(1, 4, 8, 8, 8, dtype="float16")


def test_sdpa_kernels_names_the_kernel_that_ran():
    import torch.nn.functional as F

    q = torch.randn(1, 2, 32, 16)
    bias = torch.zeros(1, 2, 32, 32)
    assert bm.sdpa_kernels(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)) == [
        "flash (CPU)"]
    assert bm.sdpa_kernels(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=bias)) == [
        "flash (CPU)"]
    # the silent fallback: a 3-D float mask sends CPU SDPA to the math path
    assert bm.sdpa_kernels(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=bias[0])) == [
        "math"]
    assert bm.sdpa_kernels(lambda: q @ q.transpose(-2, -1)) == []
    with pytest.raises(TypeError):
        bm.sdpa_kernels(None)


# --------------------------------------------------------------------------- #
# Random order per round, A/A controls, and the claims fixed before a run
# --------------------------------------------------------------------------- #
def test_compare_draws_a_recorded_random_order_per_round_from_its_seed():
    calls = []
    cases = {name: (lambda name=name: calls.append(name)) for name in "abcdef"}

    def orders(seed):
        calls.clear()
        recs = bm.compare(cases, "a", device="cpu", warmup=0, min_runs=1, max_time_s=1e-4,
                          rounds=6, measure_memory=False, order_seed=seed)
        return {r.case: r.round_positions for r in recs}

    first = orders(3)
    assert orders(3) == first  # the seed fixes the orders
    for round_ in range(6):  # a permutation in every round
        assert sorted(p[round_] for p in first.values()) == list(range(6))
    assert len({tuple(p) for p in zip(*first.values(), strict=True)}) > 1  # not one order
    assert first["a"] != [0] * 6  # the reference is not always first
    fixed = bm.compare(cases, "a", device="cpu", warmup=0, min_runs=1, max_time_s=1e-4,
                       rounds=2, measure_memory=False)
    assert all(r.round_positions == [] for r in fixed)  # without a seed: the fixed order
    with pytest.raises(ValueError):
        bm.compare(cases, "a", device="cpu", order_seed=-1)


def test_save_results_stores_extra_keys_and_refuses_to_replace_the_layout(tmp_path):
    rec = bm.BenchRecord(group="g", case="c", round_positions=[1, 0])
    path = bm.save_results([rec], tmp_path / "r.json", {"device": "cpu"},
                           extra={"claims": [{"id": "X"}], "alpha": 0.05})
    data = json.loads(path.read_text())
    assert data["claims"] == [{"id": "X"}] and data["alpha"] == 0.05
    assert bm.load_results(path).records[0].round_positions == [1, 0]
    with pytest.raises(ValueError, match="records"):
        bm.save_results([rec], tmp_path / "s.json", {}, extra={"records": []})


def test_every_part_times_its_reference_twice_as_the_same_callable():
    args = _args("--lengths", "16", "--passes", "fwd", "--encodings", "nope",
                 "--backends", "sdpa", "--rope-shape", "1", "2", "8", "16",
                 "--lm-batch", "2", "--lm-len", "8")
    entries = list(bs.default_suite(args))
    twins = {"attention": bs.ATTENTION_AA, "rope": bs.ROPE_AA, "lm train step": bs.LM_AA}
    for entry in entries:
        aa = entry.cases[twins[entry.params["op"]]]
        assert aa.fn is entry.cases[entry.reference].fn, entry.group
    assert {e.params["op"] for e in entries} == set(twins)


def test_the_lm_group_times_chapter_7s_model():
    record = json.loads(bs.CHAPTER7_RECORD.read_text())["config"]
    want = {k: record[k] for k in ("d_model", "n_layers", "n_heads")}
    assert bs.lm_model_config() == want
    (entry,) = bs.lm_suite(_args("--lm-batch", "2", "--lm-len", "8"))
    assert (entry.params["d_model"], entry.params["layers"], entry.params["heads"]) == (
        want["d_model"], want["n_layers"], want["n_heads"])
    assert bs.lm_model_config(Path("/nonexistent.json")) == bs.LM_MODEL_DEFAULT


def test_naive_for_limits_the_naive_backend_to_the_encodings_named():
    args = _args("--lengths", "16", "--passes", "fwd", "--backends", "naive", "sdpa",
                 "--naive-for", "alibi")
    (entry,) = bs.attention_suite(args)
    assert [c for c in entry.cases if c.endswith("/naive")] == ["alibi/naive"]


def _records(group, params, ratios):
    """Records of one group from per-case round ratios (the reference's are all 1)."""
    out = []
    for case, rr in ratios.items():
        out.append(bm.BenchRecord(group=group, case=case, params=params, reference="ref",
                                  ratio=float(sorted(rr)[len(rr) // 2]), round_ratios=rr,
                                  median_ms=1.0))
    return out


def test_decide_claims_pairs_rounds_pools_lengths_and_corrects_for_the_family():
    gen = torch.Generator().manual_seed(0)
    records = []
    for n in (512, 1024):
        params = {"op": "attention", "pass": "fwd", "seq_len": n}
        drift = (0.1 * torch.randn(20, generator=gen)).exp()  # shared by a round's cases
        noise = lambda: (0.005 * torch.randn(20, generator=gen)).exp()  # noqa: E731
        records += _records(f"attn L={n} fwd", params, {
            "ref": [1.0] * 20,
            "aa": (noise()).tolist(),
            "slow": (1.05 * drift * noise()).tolist(),
            "base": (drift * noise()).tolist(),
        })
    sel = {"op": "attention", "pass": "fwd"}
    claims = bs.claim_dicts([
        ("C1", "A/A", sel, "aa", "ref", "A/A", 1.0),
        ("C2", "slow > base", sel, "slow", "base", ">", 1.0),  # the drift cancels in pairs
        ("C3", "slow < 1.02 base", sel, "slow", "base", "<", 1.02),
        ("C4", "slow > 1.05 base", sel, "slow", "base", ">", 1.05),  # the truth: unresolved
        ("C5", "only 1024", {**sel, "lengths": [1024]}, "slow", "base", ">", 1.0),
        ("C6", "absent", sel, "missing", "base", ">", 1.0),
    ])
    decided = {d["id"]: d for d in bs.decide_claims(records, claims)}
    assert decided["C1"]["verdict"] == "holds"
    assert decided["C2"]["verdict"] == "holds" and 1.04 < decided["C2"]["ratio"] < 1.06
    assert decided["C3"]["verdict"] == "refuted"
    assert decided["C4"]["verdict"] == "not resolved"
    assert decided["C5"]["groups"] == ["attn L=1024 fwd"] and decided["C5"]["rounds"] == 20
    assert decided["C6"]["verdict"] == "not measured"
    assert decided["C2"]["confidence"] == pytest.approx(1 - 0.05 / 6)
    assert decided["C2"]["rounds"] == 40 and decided["C2"]["groups"] == [
        "attn L=1024 fwd", "attn L=512 fwd"]
    # unpaired, the shared drift would swamp a 5 % difference: the pairing is what resolves it
    logs = bs.paired_log_ratios(records, "slow", "base", sel)
    assert all(len(v) == 20 for v in logs.values())


def test_the_recorded_family_is_written_before_anything_is_timed(tmp_path):
    out = tmp_path / "r.json"
    seen = {}

    def suite(args: argparse.Namespace):
        def ref():
            if not seen:
                seen.update(json.loads(out.read_text()))
        yield bs.SuiteEntry("tiny", {"ref": ref, "b": lambda: None}, "ref", {"op": "x"})

    bs.main(["--quick", "--device", "cpu", "--no-progress", "--no-memory", "--rounds", "2",
             "--out", str(out)], suite=suite)
    assert seen["status"] == "running" and seen["claims"] == bs.claim_dicts()
    assert seen["alpha"] == bs.ALPHA and "records" not in seen
    data = json.loads(out.read_text())
    assert data["status"] == "done" and data["claims"] == seen["claims"]
    assert data["claims_written"] == seen["claims_written"]
    assert [d["id"] for d in data["decided"]] == [c["id"] for c in data["claims"]]
    assert data["design"]["order_seed"] == 0
    assert all(len(r["round_positions"]) == 2 for r in data["records"])


def test_each_group_draws_its_own_case_orders(tmp_path):
    """One order seed for every group gave every group the same orders (the A/A before the
    limit in the same rounds everywhere): each group's seed is the run's plus its name's."""
    out = tmp_path / "r.json"

    def suite(args: argparse.Namespace):
        for group in ("g1", "g2"):
            cases = {name: (lambda: None) for name in ("ref", "a", "b", "c", "d")}
            yield bs.SuiteEntry(group, cases, "ref", {"op": "x"})

    bs.main(["--quick", "--device", "cpu", "--no-progress", "--no-memory", "--rounds", "8",
             "--out", str(out)], suite=suite)
    data = json.loads(out.read_text())
    seeds = data["design"]["group_order_seeds"]
    assert seeds == {g: bs.group_seed(0, g) for g in ("g1", "g2")} and len(set(seeds.values())) == 2
    orders = {g: [r["round_positions"] for r in data["records"] if r["group"] == g]
              for g in ("g1", "g2")}
    assert orders["g1"] != orders["g2"]
