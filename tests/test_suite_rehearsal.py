"""``benchmarks/suite.py --device cuda`` rehearsed without a GPU: every group built and run on
PyTorch's ``meta`` device.

``meta`` tensors have shapes, dtypes and a device but no data. A CPU tensor mixed into a
computation on them raises ("Tensor on device cpu is not on the expected device meta!"),
as a CPU tensor mixed into a CUDA computation does on a GPU, and autograd runs, so the
training groups are rehearsed too. (The other stand-in of torch 2.13 without CUDA,
``FakeTensorMode`` tensors that report ``cuda:0``, cannot do what the suite does: in a
CPU-only build ``Module.to`` cannot swap their parameters, and the first backward pass
aborts the process. So here: ``meta``.)

What a real GPU would do differently, and how it is stood in for:

* the plan: the suite reads ``torch.cuda.get_device_capability``; here it answers 7.5
  (a T4), so the RoPE part has the GPU's three dtypes and no bfloat16 fused kernel;
* the ``auto`` backend's key row: its probe compares numbers, which ``meta`` has not, so
  the probe's answer is set to what a GPU answers in float16 (no: the cached table);
* the kernels: ``meta`` runs each operator's shape function, not a kernel, so this checks
  devices, shapes and dtypes, not values or memory (``tests/test_benchmark.py`` checks the
  footprints against measured CPU memory; ``benchmarks/gpu_check.py`` against a GPU's).

The suite of commit 2f2624b fails the first test: its ``alibi/sdpa-3d-mask`` case built its
table from an encoding left on the CPU (``cached_bias(enc3, ..., device=device)``), when
the group was built, so ``python benchmarks/suite.py --device cuda`` stopped at its first
group.
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest
import torch

from benchmarks import suite as bs
from tutorial_pkg import backends
from tutorial_pkg.encodings.builtin import PositionEncoding

pytestmark = pytest.mark.usefixtures("one_thread")

META = torch.device("meta")


@pytest.fixture
def gpu_like(monkeypatch):
    """The GPU's answers where ``meta`` has none: compute capability 7.5, no key row."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with backends.assume_kernels("meta", key_bias=False):
        yield
    backends.clear_caches()


def _args(*argv: str, dtype: str = "float16"):
    """Arguments as the command line completes them, then pointed at the stand-in device."""
    args = bs.parse_args(["--device", "cpu", "--dtype", dtype, "--heads", "2",
                          "--head-dim", "8", "--lengths", "64", "128",
                          "--passes", "fwd", "fwd+bwd", "--rope-shape", "1", "2", "16", "8",
                          "--lm-batch", "2", "--lm-len", "8", *argv])
    args.device = "meta"
    if hasattr(bs, "device_plan"):  # the plan of a GPU (capability mocked by gpu_like)
        args.plan = bs.device_plan("cuda")
    return args


def _reachable(obj, depth: int = 0, seen: set | None = None) -> Iterator[object]:
    """Objects a case reaches: its closures, defaults, bound objects, containers, lazy
    values, modules and the tables the backends cache for its encodings."""
    seen = set() if seen is None else seen
    if depth > 8 or id(obj) in seen or isinstance(obj, (type, types.ModuleType, str, bytes)):
        return
    seen.add(id(obj))
    yield obj
    children: list = []
    if isinstance(obj, torch.Tensor):
        return
    if isinstance(obj, torch.nn.Module):
        children += list(obj.parameters()) + list(obj.buffers())
        children += [backends.cached_tensors(m) for m in obj.modules()
                     if isinstance(m, PositionEncoding)]
    elif isinstance(obj, types.MethodType):
        children += [obj.__self__, obj.__func__]
    elif isinstance(obj, types.FunctionType):
        children += [c.cell_contents for c in (obj.__closure__ or ()) if _filled(c)]
        children += list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
    elif isinstance(obj, dict):
        children += list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        children += list(obj)
    elif isinstance(obj, torch.optim.Optimizer):
        children += [obj.param_groups, list(obj.state.values())]
    elif type(obj).__module__.startswith(("benchmarks", "tutorial_pkg")):  # Lazy, the
        children += list(vars(obj).values())  # articles' attention, ...
    for child in children:
        yield from _reachable(child, depth + 1, seen)


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell (a name not yet bound)
        return False
    return True


def _tensors(obj) -> list[torch.Tensor]:
    # 0-dim CPU tensors are the scalars PyTorch mixes with any device (AdamW's step count)
    return [t for t in _reachable(obj) if isinstance(t, torch.Tensor)
            and not (t.dim() == 0 and t.device.type == "cpu")]


def _outputs(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in (result or ()) if isinstance(t, torch.Tensor)]


def test_attention_groups_build_for_a_device_that_is_not_the_cpu(gpu_like):
    """What failed on the GPU: building the groups (old code: a CPU encoding's table)."""
    entries = list(bs.attention_suite(_args()))
    assert [e.group for e in entries] == [
        "attn L=64 fwd", "attn L=64 fwd+bwd", "attn L=128 fwd", "attn L=128 fwd+bwd"]
    for entry in entries:
        assert {"alibi/article", "alibi/sdpa-3d-mask", "alibi/auto", "hybrid/flex"} <= set(
            entry.cases)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_every_case_of_every_group_runs_on_the_device(gpu_like, dtype):
    """Every group of the standard suite: inputs, layers, encodings, what a case builds on
    its first call (tables, the articles' buffer, the 3-D mask) and its outputs are all
    on the device, and its release leaves no table behind."""
    args = _args(dtype=dtype)
    groups, ran = [], 0
    for entry in bs.default_suite(args):
        groups.append(entry.group)
        for name, case in entry.cases.items():
            before = _tensors(case.fn)
            assert before, name  # the walk finds the case's inputs
            off = {str(t.device) for t in before if t.device != META}
            assert not off, f"{entry.group} / {name}: tensors on {off} before its first call"
            if getattr(case, "skip", None):
                continue
            result = case.fn()
            ran += 1
            outputs = _outputs(result)
            assert outputs and all(t.device == META for t in outputs), (entry.group, name)
            off = {str(t.device) for t in _tensors(case.fn) if t.device != META}
            assert not off, f"{entry.group} / {name}: tensors on {off} after its first call"
            if getattr(case, "release", None) is not None:
                case.release()
                for obj in _reachable(case.fn):
                    if isinstance(obj, PositionEncoding):
                        assert not backends.cached_tensors(obj), (entry.group, name)
                    if isinstance(obj, bs.Lazy):
                        assert obj.value is None, (entry.group, name)
    assert groups == ["attn L=64 fwd", "attn L=64 fwd+bwd", "attn L=128 fwd",
                      "attn L=128 fwd+bwd", "rope float32", "rope float16", "rope bfloat16",
                      "lm step L=8"]
    assert ran >= 90  # 4 attention groups of 17 cases, 17 RoPE cases, 7 LM steps, less skips


def test_the_t4_plan_skips_the_bf16_fused_rope_and_gives_every_case_a_footprint(gpu_like):
    entries = {e.group: e for e in bs.default_suite(_args())}
    fused = entries["rope bfloat16"].cases["rotate fused"]
    assert fused.skip and "sm75" in fused.skip and "8.0" in fused.skip
    assert entries["rope float16"].cases["rotate fused"].skip is None
    for entry in entries.values():
        for name, case in entry.cases.items():
            assert case.footprint is not None and case.footprint.need > 0, (entry.group, name)
    # what the sdpa path holds on a GPU in float16: the float32 (1, H, T, T) table, T = 128
    sdpa = entries["attn L=64 fwd"].cases["alibi/sdpa"].footprint
    assert sdpa.held == 2 * 128 * 128 * 4
