"""A CPU rehearsal of chapter 5's GPU path, so that a dtype bug shows before anyone opens Colab.

On a GPU, chapter 5 runs in float16: the float mask has q's dtype (so the cached table is
cast per call, as on every device in 16 bits), and the fused GPU kernels may refuse a key row
together with ``is_causal`` (so ``"auto"`` falls back to the cached table). That rule is
``tutorial_pkg.attention._kernel_rules.KernelRules.key_bias``; here it is set the GPU's
way on the CPU (``backends.assume_kernels``), the chapter's own memory cell (tagged
``gpu-rehearsal``) is run on suite records measured in float16 and bfloat16, and the
half-precision paths are checked against the float64 oracle. The old cell
(``n_bias = H * L * L * 4`` and an unconditional "auto holds one row") fails this
rehearsal; the test says so.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
import torch

import tutorial_pkg as tp
from benchmarks import suite as bs
from tutorial_pkg import backends
from tutorial_pkg import measure as bm
from tutorial_pkg.encodings.rope_kernels import rotate_pairs

pytestmark = pytest.mark.usefixtures("one_thread")

CHAPTER = Path(__file__).resolve().parents[1] / "book" / "05_benchmarking.ipynb"
HALF = [torch.float16, torch.bfloat16]
#: The chapter's memory cell as it was before it counted bytes by dtype (kept to show that
#: this rehearsal catches it).
OLD_CELL = """
n_bias = H * L_MAX * L_MAX * 4  # bytes of one (H, L, L) float32 tensor
limit = rec(bs.ATTENTION_LIMIT)
assert rec("alibi/naive").peak_bytes >= n_bias
assert rec("alibi/article").held_bytes >= n_bias
assert rec("alibi/sdpa").held_bytes >= n_bias
assert rec("alibi/auto").held_bytes < n_bias / 100
assert rec("alibi/auto").peak_bytes <= 1.5 * limit.peak_bytes
"""


def _chapter_cell(tag: str) -> str:
    nb = nbformat.read(CHAPTER, as_version=4)
    (cell,) = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    return cell.source


@pytest.fixture
def gpu_rules():
    """The GPU's SDPA rule on the CPU: no key row with is_causal (masks are in q's dtype
    on every device)."""
    with backends.assume_kernels("cpu", key_bias=False):
        yield


def _namespace(dtype: torch.dtype, lengths=(64, 128), heads=2, head_dim=16) -> dict:
    """What the chapter's memory cell reads: suite records and the chapter's helpers."""
    dtype_name = str(dtype).removeprefix("torch.")
    args = bs.parse_args(["--device", "cpu", "--dtype", dtype_name, "--heads", str(heads),
                          "--head-dim", str(head_dim), "--lengths", *map(str, lengths),
                          "--passes", "fwd", "--encodings", "alibi",
                          "--backends", "naive", "sdpa", "auto"])
    records = []
    for entry in bs.attention_suite(args):
        records += bm.compare(entry.cases, entry.reference, device="cpu", group=entry.group,
                              params=entry.params, warmup=0, min_runs=1, max_time_s=0.001)
    assert not [r.error for r in records if r.error]

    def rec(case, length=lengths[-1], pool=records):
        (r,) = [r for r in pool if r.case == case and r.params["seq_len"] == length]
        return r

    return {"torch": torch, "tp": tp, "bm": bm, "bs": bs, "device": "cpu", "DTYPE": dtype_name,
            "H": heads, "D": head_dim, "LENGTHS": list(lengths), "L_MAX": lengths[-1],
            "BACKENDS": ["naive", "sdpa", "auto"], "records": records, "rec": rec}


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_chapter5_memory_cell_holds_in_half_precision_with_gpu_rules(gpu_rules, dtype):
    ns = _namespace(dtype)
    assert not backends.key_bias_supported(torch.device("cpu"), dtype, False)
    exec(_chapter_cell("gpu-rehearsal"), ns)  # the chapter's own asserts
    assert ns["row_ok"] is False
    # "auto" is the cached-table path here: it holds the float32 table, as the cell says
    assert ns["rec"]("alibi/auto").held_bytes >= ns["bias_bytes"]("alibi/sdpa")


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_chapter5_memory_cell_holds_in_half_precision_with_cpu_rules(dtype):
    ns = _namespace(dtype)
    exec(_chapter_cell("gpu-rehearsal"), ns)
    # a 16-bit key row would lose m j's low bits, and a float32 one is not documented: the
    # probe refuses the row in q's dtype and auto holds the float32 table, on a CPU too
    assert ns["row_ok"] is False
    assert ns["rec"]("alibi/auto").held_bytes >= ns["bias_bytes"]("alibi/sdpa")


def test_the_old_float32_byte_count_fails_the_rehearsal(gpu_rules):
    ns = _namespace(torch.float16)
    with pytest.raises(AssertionError):
        exec(OLD_CELL, ns)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("rules", ["cpu", "gpu"])
def test_auto_in_half_precision_matches_the_float64_oracle(request, dtype, rules):
    if rules == "gpu":
        request.getfixturevalue("gpu_rules")
    heads, length, dim = 4, 512, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, dim, generator=gen) for _ in range(3))
    enc = tp.make_encoding("alibi", n_heads=heads)
    want = tp.MultiHeadAttention(heads * dim, heads, enc, backend="naive").attend(
        q.double(), k.double(), v.double())
    layer = tp.MultiHeadAttention(heads * dim, heads, tp.make_encoding("alibi", n_heads=heads),
                                  backend="auto")
    with torch.no_grad():
        got = layer.attend(q.to(dtype), k.to(dtype), v.to(dtype))
    assert got.dtype == dtype
    # the inputs' own rounding bounds what any 16-bit kernel can reach
    tol = 2e-2 if dtype == torch.float16 else 6e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_key_bias_stays_float32_and_a_sixteen_bit_row_would_not_do():
    enc = tp.make_encoding("alibi", n_heads=8)
    row = backends.cached_key_bias(enc, 8192, device="cpu")
    assert row.dtype == torch.float32
    for dtype, worst in ((torch.float16, 1.0), (torch.bfloat16, 4.0)):
        err = (row.to(dtype).float() - row).abs().max().item()
        assert err >= worst  # whole logits lost near j = 8192: why the row is never rounded


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_peak_memory_counts_bytes_by_dtype(dtype):
    n = 1_000_000
    stat = bm.peak_memory(lambda: torch.empty(n, dtype=dtype), device="cpu")
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert n * itemsize <= stat.peak_bytes <= n * itemsize + 64 * 1024


# --------------------------------------------------------------------------- RoPE default path
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF], ids=str)
@pytest.mark.parametrize("shape", [(4, 8, 2048, 64), (1, 2, 9000, 64), (3, 5000, 32)])
def test_default_rope_is_bit_for_bit_the_three_kernel_form(dtype, shape):
    # large CPU inputs without autograd run block by block: the same bits as the plain
    # three-kernel form x * [cos, cos], then -= x2 sin and += x1 sin in place, computed in
    # x's dtype for float32/float64 and in float32, rounded once, for 16-bit x
    x = torch.randn(shape).to(dtype)
    rot = tp.RotaryEmbedding(shape[-1])
    cos, sin = rot.cos_sin(start=0, length=shape[-2])
    work = torch.promote_types(dtype, torch.float32)
    xw, c, s = x.to(work), cos.to(work), sin.to(work)
    half = shape[-1] // 2
    want = xw * torch.cat((c, c), dim=-1)
    want[..., :half].addcmul_(xw[..., half:], s, value=-1)
    want[..., half:].addcmul_(xw[..., :half], s)
    want = want.to(dtype)
    with torch.no_grad():
        assert torch.equal(rotate_pairs(cos, sin, "half", x)[0], want)
        assert torch.equal(rot.rotate(x), want)  # the default path takes it
        if x.dim() == 4:
            assert all(torch.equal(t, want) for t in rot(x, x))  # q and k, as attention calls
    torch.testing.assert_close(rot.rotate(x).double(), tp.apply_rope(x.double(), cos, sin),
                               atol=3e-2 if dtype in HALF else 1e-5, rtol=1e-2)


def test_default_rope_gives_the_same_bits_on_every_path():
    # a table that does not cover x's positions, a non-contiguous x, a small x and an x
    # that needs gradients do not run block by block: same values, and autograd works
    rot = tp.RotaryEmbedding(64)
    cos, sin = rot.cos_sin(start=0, length=4096)
    big = torch.randn(2, 4, 4096, 64)

    def three_kernel(x, c, s):
        out = x * torch.cat((c, c), dim=-1)
        out[..., :32].addcmul_(x[..., 32:], s, value=-1)
        out[..., 32:].addcmul_(x[..., :32], s)
        return out

    with torch.no_grad():
        for x in (big, big.transpose(0, 1), big[:1, :1, :1024]):
            n = x.shape[-2]
            want = three_kernel(x, cos[:n], sin[:n])
            assert torch.equal(rotate_pairs(cos[:n], sin[:n], "half", x)[0], want)
            assert torch.equal(rot.rotate(x), want)
        # a broadcast [1, 1, s, d/2] table (attention's positions [1, s]), q and k at once
        for got in rotate_pairs(cos[None, None], sin[None, None], "half", big, big[:1]):
            assert torch.equal(got, three_kernel(big[: len(got)], cos, sin))
    x = big.clone().requires_grad_(True)
    out = rot.rotate(x)
    assert torch.equal(out.detach(), three_kernel(big, cos, sin))
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert grad.shape == x.shape
    # the rotation is orthogonal: the gradient of sum(R x) is R^T 1
    ones = torch.ones(1, 1, 4096, 64)
    torch.testing.assert_close(grad[0, 0], tp.apply_rope(ones, cos, -sin)[0, 0])


# ----------------------------------------------------- chapter 5: failed and skipped records
def _chapter_cells(tag: str) -> list[str]:
    nb = nbformat.read(CHAPTER, as_version=4)
    return [c.source for c in nb.cells if tag in c.metadata.get("tags", [])]


def _chapter_globals() -> dict:
    import math
    import time

    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    return {"torch": torch, "tp": tp, "bm": bm, "bs": bs, "plt": plt, "math": math,
            "time": time, "Path": Path, "NullLocator": NullLocator}


def _failed(rec: bm.BenchRecord, error: str) -> bm.BenchRecord:
    """A record of the same case that raised (as a GPU out of memory would): no numbers."""
    return bm.BenchRecord(group=rec.group, case=rec.case, params=dict(rec.params),
                          device=rec.device, reference=rec.reference, error=error)


def test_chapter5_live_cells_handle_failed_and_skipped_records(monkeypatch):
    """The chapter's own cells (live suite, both figures, the memory claims) on records where
    the memory check skipped cases and one case failed, as on a small GPU."""
    import functools
    import types

    import matplotlib.pyplot as plt

    lengths, heads, head_dim = [64, 256], 2, 16
    args = bs.parse_args(["--device", "cpu", "--heads", str(heads), "--head-dim", str(head_dim),
                          "--lengths", *map(str, lengths), "--passes", "fwd"])
    naive = {e.params["seq_len"]: e.cases["alibi/naive"].footprint
             for e in bs.attention_suite(args)}
    # a budget that lets alibi/naive run at 64 tokens, not at 256: the real skip path
    limit = int(bm.MEMORY_RESERVE_BYTES + (1 + bm.MEMORY_HEADROOM) * naive[256].need) - 1
    assert bm.fit_problem(naive[64], limit) is None and bm.fit_problem(naive[256], limit)
    small_gpu = types.ModuleType("small_gpu_benchmark")
    small_gpu.__dict__.update(vars(bm))
    small_gpu.compare = functools.partial(bm.compare, memory_limit=limit)
    ns = {**_chapter_globals(), "bm": small_gpu, "device": "cpu", "DTYPE": "float32",
          "H": heads, "D": head_dim, "LENGTHS": lengths, "BACKENDS": ["naive", "sdpa", "auto"]}
    (live,) = _chapter_cells("live-suite")
    exec(live.replace("min_runs=2, max_time_s=0.03", "min_runs=1, max_time_s=0.001"), ns)
    records, rec = ns["records"], ns["rec"]
    assert rec("alibi/naive").skipped and "needs about" in rec("alibi/naive").error
    assert rec("alibi/naive", 64).ok and rec("alibi/article").skipped  # its 2048-side buffer
    # and one that raised instead: the cached-table path out of memory
    i = records.index(rec("alibi/sdpa"))
    records[i] = _failed(records[i], "OutOfMemoryError: CUDA out of memory.")
    cells = _chapter_cells("reads-records")
    assert len(cells) == 3  # the time figure, the memory figure, the memory claims
    try:
        for source in cells:
            exec(source, ns)  # no TypeError on a None field, no claim on a missing number
    finally:
        plt.close("all")
    assert ns["row_ok"] is True and ns["claims"]["alibi/sdpa"] is not None


def test_chapter5_recorded_cells_handle_failed_records(tmp_path, monkeypatch):
    """The recorded-run cells: every one runs on the record as stored; a failed record is
    printed with its error, a claim the run could not decide ("not measured", as the suite
    stores it for a failed case) stops the claims cell with an AssertionError, and a GPU file
    with skipped and failed cases plots."""
    import shutil

    import matplotlib.pyplot as plt

    data = CHAPTER.parent / "data"
    (tmp_path / "data").mkdir()
    for name in ("benchmark_cpu.json", "benchmark_cpu_loaded.json", "rope_speed_cpu.json"):
        shutil.copy(data / name, tmp_path / "data" / name)
    hardware, records = bm.load_results(data / "benchmark_cpu.json")
    longest = max(r.params["seq_len"] for r in records if r.params.get("op") == "attention")
    gpu = [r if r.case != "alibi/naive" or r.params.get("seq_len") != longest else
           bm.BenchRecord(group=r.group, case=r.case, params=r.params, skipped=True,
                          error="skipped: needs about 6.41 GiB, 2.00 GiB available")
           for r in records]
    gpu[0] = _failed(gpu[0], "OutOfMemoryError: CUDA out of memory.")
    bm.save_results(gpu, tmp_path / "data" / "benchmark_gpu.json",
                    {**hardware, "device_name": "rehearsed GPU", "device": "cuda:0"})
    monkeypatch.chdir(tmp_path)
    (load,) = _chapter_cells("recorded-file")
    cells = _chapter_cells("reads-recorded")
    (claims,) = [c for c in cells if 'decided = stored["decided"]' in c]
    (table,) = [c for c in cells if "def recorded_table" in c]
    ns = _chapter_globals()
    exec(load, ns)
    try:
        for source in cells:  # every record as recorded: each cell runs and its claims hold
            exec(source, ns)
        # now the recorded run with failed records where the claims read
        broken = {("alibi/sdpa", longest, "fwd"), ("rotate", None, None), ("rope", None, None)}
        ns["recorded"] = [
            _failed(r, "RuntimeError: rehearsed failure")
            if (r.case, r.params.get("seq_len"), r.params.get("pass")) in broken
            or (r.case, None, None) in broken and r.params.get("op") in ("rope", "lm train step")
            else r
            for r in ns["recorded"]]
        ns["stored"] = {**ns["stored"], "decided": [
            {**d, "verdict": "not measured"} if d["id"] == "A4" else d
            for d in ns["stored"]["decided"]]}
        with pytest.raises(AssertionError):
            exec(claims, ns)
        exec(table, ns)  # prints the error line, no TypeError
        assert not ns["rows_fwd"]["alibi/sdpa"].ok
    finally:
        plt.close("all")
