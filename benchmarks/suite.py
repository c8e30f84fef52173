"""The book's benchmark suite: its cases, its command line, and the performance targets.

Usage (from the repository root)::

    python benchmarks/suite.py --quick                  # smoke test: tiny sizes, seconds
    python benchmarks/suite.py                          # full suite on the default device
    python benchmarks/suite.py --parts attention --lengths 2048 4096 --passes fwd
    python benchmarks/suite.py --device cuda --out book/data/benchmark_gpu.json
    python benchmarks/suite.py --help                   # every option

The suite (:func:`default_suite`) measures attention per encoding x backend x length x
pass (:func:`attention_suite`), RoPE applied to q and k (:func:`rope_suite`) and a
training step of the tiny LM (:func:`lm_suite`), every case next to its limit reference
with :func:`tutorial_pkg.measure.cases.compare`. The command line prints one table per group,
writes the JSON results file (``--out``), reads it back and prints one line per
performance target with the ratio it reached. Every case carries its expected memory
(:func:`attention_footprint`, :func:`rope_footprint`, :func:`lm_footprint`) and frees what it
holds once measured, so that a group's cases never hold their tables together and a case that
would not fit the GPU (or ``--memory-limit``) is skipped with the reason; dtypes and
compilation follow the GPU's compute capability (:func:`device_plan`). Each ratio compares
two cases measured side by side in the same run (interleaved rounds, each in a random order
of the cases, drawn per group from ``--order-seed`` and the group's name (:func:`group_seed`),
medians), never numbers from different runs; every
group times its reference's own callable twice (the A/A control). With ``--out`` the family
of claims the run is made to test (:data:`CLAIMS`, with its error rate :data:`ALPHA`) is
written into the file before anything is timed, and each claim's verdict
(:func:`decide_claims`) is added at the end. The exit status is 0 whatever the targets and
claims say: timings are evidence to read, not a test. ``--suite module:function`` runs any
other suite with the same signature.

The measuring library is the package's :mod:`tutorial_pkg.measure.cases`; this folder holds
what uses it and what no model should import: the cases' expected memory
(``footprints.py``), the targets (``targets.py``), the allocator setting of the command line
(``allocator.py``) and the articles' code (``articles.py``).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import shlex
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.allocator import keep_freed_memory  # noqa: E402
from benchmarks.articles import ArticlesALiBiAttention  # noqa: E402
from benchmarks.footprints import (  # noqa: E402
    attention_footprint,
    key_bias_here,
    lm_footprint,
    rope_footprint,
)
from benchmarks.targets import check_targets, format_targets, one_off_costs  # noqa: E402
from tutorial_pkg import measure as bm  # noqa: E402
from tutorial_pkg.measure.cases import Case  # noqa: E402

#: Name of the attention groups' reference case in the book's results files:
#: ``scaled_dot_product_attention(is_causal=True)`` with no encoding.
ATTENTION_LIMIT = "limit: sdpa causal"
#: Name of the RoPE groups' reference case, a copy of q and k (one read, one write).
ROPE_LIMIT = "limit: clone q,k"
#: Name of the LM-step group's reference case: the step of the model with no positions.
LM_REFERENCE = "nope"
#: The A/A control of each part: the reference's own callable (the same object), timed a
#: second time under this name in every round. With the cases in a random order per round
#: (``--order-seed``), the log of its per-round ratio is symmetric about 0: what it shows
#: is the run's noise, and a test that calls it different has made a false claim.
ATTENTION_AA = "A/A: sdpa causal again"
ROPE_AA = "A/A: clone q,k again"
LM_AA = "A/A: nope again"
#: Chapter 7's record, whose model the LM-step group times (``config``: width, layers, heads).
CHAPTER7_RECORD = (Path(__file__).resolve().parents[1] / "book" / "data"
                   / "extrapolation_results.json")
#: The model of the LM-step group when chapter 7's record is absent.
LM_MODEL_DEFAULT = {"d_model": 64, "n_layers": 2, "n_heads": 4}


# --------------------------------------------------------------------------- #
# Suites
# --------------------------------------------------------------------------- #
class SuiteEntry(NamedTuple):
    """One group of a suite: cases measured side by side with their reference.

    Attributes:
        group: Group label.
        cases: Case name -> zero-argument callable (or :class:`Case`).
        reference: Name of the reference case in ``cases``.
        params: Parameters shared by the group's cases.
    """

    group: str
    cases: Mapping[str, Callable[[], Any] | Case]
    reference: str
    params: Mapping[str, Any]


#: The type of a suite, parsed CLI arguments -> groups to measure (generated lazily, so only
#: one group's inputs need to exist at a time).
SuiteFn = Callable[[argparse.Namespace], Iterable[SuiteEntry]]

#: Presets of the command line (``--quick`` is a smoke test, not a measurement).
_QUICK = {
    "lengths": [64, 128], "warmup": 1, "min_runs": 3, "max_time": 0.02, "rounds": 1,
    "rope_rounds": 1, "lm_rounds": 1,
    "passes": ["fwd"], "backends": ["naive", "sdpa", "auto"], "rope_shape": [1, 4, 128, 64],
    "lm_batch": 4, "lm_len": 32,
}
_FULL = {
    "warmup": 3, "min_runs": 5, "max_time": 0.5, "rounds": 10, "rope_rounds": 30,
    "lm_rounds": 30, "passes": ["fwd", "fwd+bwd"],
    "backends": ["naive", "sdpa", "flex", "auto"], "rope_shape": [4, 8, 2048, 64],
    "lm_batch": 32, "lm_len": 64,
}
_FULL_LENGTHS = {"cpu": [512, 1024, 2048, 4096], "cuda": [1024, 2048, 4096, 8192, 16384]}
#: Parts of the standard suite, in the order they run.
SUITE_PARTS = ("attention", "rope", "lm")
#: The encodings of the attention part; the others (sinusoidal, learned) act on the
#: embeddings, so their attention is NoPE's; they appear in the ``lm`` part.
ATTENTION_ENCODINGS = ("nope", "rope", "alibi", "hybrid")
#: Below this compute capability a GPU has no bfloat16 in its fused kernels (FlashAttention,
#: memory-efficient SDPA) nor in Triton, which compiles the fused RoPE kernel: sm75 (T4).
BF16_CAPABILITY = (8, 0)


# --------------------------------------------------------------------------- #
# What a device can run
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class DevicePlan:
    """Dtypes and compilations the suite (and chapter 5) use on one device.

    Chosen by the GPU's compute capability (:func:`device_plan`): every GPU measures
    attention in float16, which all of them run in their fused kernels; bfloat16, and
    compiling the fused RoPE kernel in bfloat16, only from :data:`BF16_CAPABILITY` (sm80,
    A100 and later): a T4 (sm75) has neither, so there the ``rope bfloat16`` group runs
    its eager cases and records ``rotate fused`` as skipped, with the reason.

    Attributes:
        device: The device (``"cpu"``, ``"cuda:0"``, ...).
        capability: ``(major, minor)`` of a CUDA GPU, else ``None``.
        dtype: Default dtype of the attention part.
        rope_dtypes: Dtypes of the RoPE part, in order.
        bf16: bfloat16 is supported by the fast kernels.
        fused_bf16: The fused RoPE kernel may be compiled in bfloat16.
        notes: Why something is left out (one line each), for the reader.
    """

    device: str
    capability: tuple[int, int] | None
    dtype: str
    rope_dtypes: tuple[str, ...]
    bf16: bool
    fused_bf16: bool
    notes: tuple[str, ...] = field(default_factory=tuple)


def _sm(capability: tuple[int, int] | None) -> str:
    return "unknown" if capability is None else f"sm{capability[0]}{capability[1]}"


def device_plan(device: str | torch.device) -> DevicePlan:
    """The :class:`DevicePlan` of ``device``: on CUDA from ``torch.cuda.get_device_capability``.

    CPU: float32 attention; RoPE in float32 and bfloat16, both compiled when fused.
    CUDA: float16 attention; RoPE in float32, float16 and bfloat16; bfloat16 in the fast
    kernels and the bfloat16 fused RoPE kernel only from compute capability 8.0.
    Any other device type (``meta``, for rehearsals) is planned as a GPU of unknown
    capability: the conservative, sm75 plan.
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return DevicePlan(str(dev), None, "float32", ("float32", "bfloat16"), True, True)
    capability = None
    if dev.type == "cuda":
        capability = tuple(int(v) for v in torch.cuda.get_device_capability(dev))
    bf16 = capability is not None and capability >= BF16_CAPABILITY
    notes = ()
    if not bf16:
        have = _sm(capability)
        notes = (f"compute capability {have} < sm80: no bfloat16 in the fused kernels or "
                 "Triton; attention in float16, the bfloat16 fused RoPE kernel not compiled",)
    return DevicePlan(str(dev), capability, "float16", ("float32", "float16", "bfloat16"),
                      bf16, bf16, notes)


class Lazy:
    """A value built on first use and dropped by :meth:`release`.

    What a case holds (the articles' buffer, a 3-D mask) is built by its first call, so
    that it exists only while that case is measured, not from the moment the group is
    built; :meth:`release` is the case's :attr:`~tutorial_pkg.measure.cases.Case.release`.
    """

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build, self.value = build, None

    def get(self) -> Any:
        if self.value is None:
            self.value = self._build()
        return self.value

    def release(self) -> None:
        self.value = None


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _held_bytes(*modules: Any) -> int:
    """Bytes of the buffers and caches a module keeps between calls (encodings, baselines)."""
    from tutorial_pkg import backends
    from tutorial_pkg.encodings.builtin import PositionEncoding

    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:  # views of one cache count once
                seen.add(storage.data_ptr())
                total += storage.nbytes()

    for m in modules:
        if m is None:  # a lazy value not built (or already released)
            continue
        if isinstance(m, torch.nn.Module):
            for sub in m.modules():
                for t in sub.buffers(recurse=False):
                    add(t)
                if isinstance(sub, PositionEncoding):  # tables cached by the backends
                    for t in backends.cached_tensors(sub):
                        add(t)
        else:
            for t in vars(m).values():
                add(t)
    return total


def _make_call(
    attn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    pass_: str,
    grad_out: torch.Tensor | None,
) -> Callable[[], Any]:
    if pass_ == "fwd":
        def run() -> Any:
            # the inference path: no autograd graph (FlexAttention on CPU needs it)
            with torch.no_grad():
                return attn(*inputs)
    else:
        def run() -> Any:
            # autograd.grad returns the gradients instead of accumulating them
            # into .grad, so every call does the same work and memory is not
            # held between calls.
            out = attn(*inputs)
            return torch.autograd.grad(out, inputs[:3], grad_out)
    return run


def _suite_dtype(args: argparse.Namespace) -> torch.dtype:
    return getattr(torch, args.dtype)


def _release(*encodings: Any, lazies: Sequence[Lazy] = ()) -> Callable[[], None]:
    """Free what a case holds: the backends' tables of its encodings, its lazy values."""
    from tutorial_pkg import backends

    def release() -> None:
        for lazy in lazies:
            lazy.release()
        for enc in encodings:
            backends.clear_caches(enc)

    return release


def attention_suite(args: argparse.Namespace) -> Iterator[SuiteEntry]:
    """Attention alone, per length and pass: every encoding x backend next to the limit.

    One group per (length, pass). In each: the limit reference
    (:data:`ATTENTION_LIMIT`, ``scaled_dot_product_attention(..., is_causal=True)``
    without any encoding), then ``{encoding}/{backend}`` for
    ``args.encodings`` x ``args.backends`` through
    :meth:`~tutorial_pkg.attention.layer.MultiHeadAttention.attend` (q, k, v already
    projected: projections cost the same for every case and would only dilute the
    ratios), the A/A control :data:`ATTENTION_AA` (the limit's own callable object, timed
    a second time), and for ALiBi two extra points: ``alibi/article``
    (:class:`~benchmarks.articles.ArticlesALiBiAttention`, its buffer grown to the
    length) and
    ``alibi/sdpa-3d-mask`` (the bias passed as a 3-D ``(H, L, L)`` mask, which
    CPU SDPA silently runs on its slow math path). ``auto`` is listed only for
    encodings with a bias (otherwise it is the ``sdpa`` path), and ``naive`` only for the
    encodings in ``args.naive_for`` when it is set (``--naive-for``: the naive backend
    costs the same for every encoding, and at 4096 tokens a call takes seconds). ``flex``
    has no CPU backward in torch 2.13: that case is recorded as skipped, not measured.

    ``fwd`` runs under ``torch.no_grad()`` (inference); ``fwd+bwd`` returns the
    gradients of q, k, v. Every case of an encoding gets its own encoding object,
    moved to the device with its layer, so each record's ``held_bytes`` is that
    path's own cache. What a case holds (the backends' tables of its encoding, the
    articles' buffer, the 3-D mask) is built by its first call and freed by its
    :attr:`~tutorial_pkg.measure.cases.Case.release` once it is measured, and each case
    carries its :func:`attention_footprint`, so that :func:`~tutorial_pkg.measure.cases.compare`
    skips, with the reason, what would not fit in the device's memory.

    Args:
        args: Parsed arguments (``device``, ``dtype``, ``lengths``, ``passes``,
            ``batch``, ``heads``, ``head_dim``, ``encodings``, ``backends``).

    Yields:
        One :class:`SuiteEntry` per (length, pass); inputs are created when the
        entry is generated, so only one group's tensors are alive at a time.
    """
    from tutorial_pkg import backends
    from tutorial_pkg.attention.layer import MultiHeadAttention
    from tutorial_pkg.encodings.registry import make_encoding

    device = torch.device(args.device)
    dtype = _suite_dtype(args)
    batch, heads, head_dim = args.batch, args.heads, args.head_dim
    key_bias = key_bias_here(device, dtype)
    for seq_len in args.lengths:
        for pass_ in args.passes:
            train = pass_ == "fwd+bwd"
            gen = torch.Generator().manual_seed(seq_len)  # same inputs on every run
            shape = (batch, heads, seq_len, head_dim)
            q, k, v = (
                torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
                .requires_grad_(train)
                for _ in range(3)
            )
            grad_out = torch.randn(shape, generator=gen).to(device, dtype) if train else None
            sizes = {"batch": batch, "heads": heads, "seq_len": seq_len, "head_dim": head_dim,
                     "dtype": dtype, "train": train, "device": device, "key_bias": key_bias}
            limit_call = _make_call(_sdpa_causal, (q, k, v), pass_, grad_out)
            limit_fp = attention_footprint("none", "sdpa", **sizes)
            cases: dict[str, Case] = {
                ATTENTION_LIMIT: Case(limit_call, {"encoding": "none", "backend": "sdpa"},
                                      footprint=limit_fp),
                # the same callable object again: the A/A control
                ATTENTION_AA: Case(limit_call, {"encoding": "none", "backend": "sdpa"},
                                   footprint=limit_fp),
            }
            naive_for = getattr(args, "naive_for", None)
            for enc_name in args.encodings:
                for backend in args.backends:
                    if backend == "naive" and naive_for is not None and enc_name not in naive_for:
                        continue
                    enc = make_encoding(enc_name, d_model=heads * head_dim, n_heads=heads,
                                        max_positions=seq_len)
                    if backend == "auto" and enc.key_bias(torch.arange(1)) is None:
                        continue  # auto is exactly the sdpa path here
                    layer = MultiHeadAttention(heads * head_dim, heads, enc, backend=backend)
                    layer = layer.to(device)  # the encoding too: its tables are built there
                    skip = None
                    if backend == "flex" and train and device.type == "cpu":
                        skip = "FlexAttention has no CPU backward in this torch"
                    cases[f"{enc_name}/{backend}"] = Case(
                        _make_call(layer.attend, (q, k, v), pass_, grad_out),
                        {"encoding": enc_name, "backend": backend},
                        held=lambda enc=layer.encoding: _held_bytes(enc),
                        release=_release(layer.encoding),
                        footprint=attention_footprint(enc_name, backend, **sizes),
                        skip=skip,
                    )
                if enc_name == "alibi":
                    article = Lazy(lambda seq_len=seq_len: ArticlesALiBiAttention(
                        heads, max(2048, seq_len), device=device))

                    def article_call(q_, k_, v_, article=article):
                        return article.get()(q_, k_, v_)

                    cases["alibi/article"] = Case(
                        _make_call(article_call, (q, k, v), pass_, grad_out),
                        {"encoding": "alibi", "backend": "article"},
                        held=lambda article=article: _held_bytes(article.value),
                        release=_release(lazies=[article]),
                        footprint=attention_footprint("alibi", "article", **sizes),
                    )
                    enc3 = make_encoding("alibi", n_heads=heads).to(device)
                    mask3 = Lazy(lambda enc3=enc3, seq_len=seq_len: backends.cached_bias(
                        enc3, 0, seq_len, seq_len, causal=True, device=device,
                        dtype=dtype)[0])  # the (1, H, L, L) table's 3-D view

                    def sdpa_3d(q_, k_, v_, mask3=mask3):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q_, k_, v_, attn_mask=mask3.get())

                    cases["alibi/sdpa-3d-mask"] = Case(
                        _make_call(sdpa_3d, (q, k, v), pass_, grad_out),
                        {"encoding": "alibi", "backend": "sdpa-3d-mask"},
                        held=lambda enc3=enc3: _held_bytes(enc3),
                        release=_release(enc3, lazies=[mask3]),
                        footprint=attention_footprint("alibi", "sdpa-3d-mask", **sizes),
                    )
            params = {
                "op": "attention", "seq_len": seq_len, "batch": batch, "heads": heads,
                "head_dim": head_dim, "dtype": args.dtype, "pass": pass_,
            }
            yield SuiteEntry(f"attn L={seq_len} {pass_}", cases, ATTENTION_LIMIT, params)
            # nothing of this group outlives its measurement in this generator's frame
            del q, k, v, grad_out, cases


def rope_suite(args: argparse.Namespace) -> Iterator[SuiteEntry]:
    """Applying RoPE to q and k, per dtype, next to copying them (:data:`ROPE_LIMIT`).

    Cases: ``spec`` (``rope._rope``, the readable form the package's rotation is tested
    against; until commit b64d261 this case was ``apply_rope``, which then ran that form
    in q's dtype), ``rotate`` (the default
    path: :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding` on q and k, no compiling; on a
    CPU the three kernels run block by block so that q and k cross memory about once),
    ``rotate fused`` (the same with ``fused=True``: one compiled call for q and k;
    its compile time is the record's ``first_call_ms``), ``rotate_half`` (Hugging Face's
    ``x * cos + rotate_half(x) * sin``), ``complex`` (Meta's
    ``view_as_complex`` form, interleaved layout; float32 arithmetic) and ``rotate
    interleaved`` (the default path on the interleaved layout,
    ``RotaryEmbedding(layout="interleaved")``), and the A/A control :data:`ROPE_AA` (the
    copy's own callable, timed again). Shape
    ``args.rope_shape`` = (batch, heads, length, head_dim); the dtypes of the device's
    :class:`DevicePlan` (float32 and bfloat16 on a CPU; float16 too on a GPU, where
    ``rotate fused`` in bfloat16 is skipped below compute capability 8.0). Inference
    (no autograd).

    Every call allocates its outputs, as a model would. With glibc's default
    settings a freed block of 32 MiB or less may go back to the OS, and then every
    first touch of a 4 KiB page of a new output faults, a cost that depends on what the
    allocator did before and is not the arithmetic's. The command line therefore
    asks glibc to keep freed blocks (:func:`benchmarks.allocator.keep_freed_memory`,
    ``--default-malloc`` to skip) and records its choice in the results file.
    """
    device = torch.device(args.device)
    plan = _plan(args)
    for dtype_name in plan.rope_dtypes:
        yield _rope_entry(device, tuple(args.rope_shape), dtype_name, plan)


def _plan(args: argparse.Namespace) -> DevicePlan:
    plan = getattr(args, "plan", None)
    return plan if plan is not None else device_plan(args.device)


def _rope_entry(device: torch.device, shape: tuple[int, ...], dtype_name: str,
                plan: DevicePlan | None = None) -> SuiteEntry:
    from tutorial_pkg.encodings.rope import (
        RotaryEmbedding,
        _rope,
        apply_rope_complex,
        precompute_freqs_cis,
    )
    from tutorial_pkg.encodings.rope import rotate_half as hf_rotate_half

    plan = plan if plan is not None else device_plan(device)
    b, h, s, d = shape
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(s)
    q, k = (torch.randn(b, h, s, d, generator=gen).to(device, dtype) for _ in range(2))
    eager = RotaryEmbedding(d).to(device)
    fused = RotaryEmbedding(d, fused=True).to(device)
    cos, sin = eager.cos_sin(start=0, length=s)
    cos_full = torch.cat((cos, cos), -1).to(dtype)
    sin_full = torch.cat((sin, sin), -1).to(dtype)
    freqs = precompute_freqs_cis(d, s).to(device)
    footprint = rope_footprint(shape, dtype)
    fused_skip = None
    if dtype == torch.bfloat16 and not plan.fused_bf16:
        fused_skip = ("no bfloat16 fused RoPE below compute capability 8.0 (Triton has no "
                      "bfloat16 there); this device: "
                      + _sm(plan.capability))

    def run(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad():
                return fn(q), fn(k)
        return call

    def run_pair(module: torch.nn.Module) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad():
                return module(q, k)  # RotaryEmbedding.forward: q and k at positions 0..s-1
        return call

    inter = RotaryEmbedding(d, layout="interleaved").to(device)
    copy = run(torch.clone)
    cases = {
        ROPE_LIMIT: Case(copy, {"impl": "clone"}, footprint=footprint),
        ROPE_AA: Case(copy, {"impl": "clone"}, footprint=footprint),  # the same callable
        "spec": Case(run(lambda x: _rope(x, cos, sin, "half")), {"impl": "reference"},
                     footprint=footprint),
        "rotate": Case(run_pair(eager), {"impl": "eager"}, footprint=footprint),
        "rotate fused": Case(run_pair(fused), {"impl": "compiled"}, footprint=footprint,
                             skip=fused_skip),
        "rotate_half": Case(run(lambda x: x * cos_full + hf_rotate_half(x) * sin_full),
                            {"impl": "hugging face"}, footprint=footprint),
        "complex": Case(run(lambda x: apply_rope_complex(x, freqs)), {"impl": "meta"},
                        footprint=footprint),
        "rotate interleaved": Case(run_pair(inter), {"impl": "eager, interleaved"},
                                   footprint=footprint),
    }
    params = {"op": "rope", "shape": [b, h, s, d], "dtype": dtype_name, "pass": "fwd"}
    return SuiteEntry(f"rope {dtype_name}", cases, ROPE_LIMIT, params)


def lm_model_config(path: Path = CHAPTER7_RECORD) -> dict[str, int]:
    """Width, layers and heads of chapter 7's model, read from its record's ``config``.

    :data:`LM_MODEL_DEFAULT` where the record is absent or lacks them.
    """
    import json

    try:
        config = json.loads(path.read_text(encoding="utf-8"))["config"]
        return {key: int(config[key]) for key in LM_MODEL_DEFAULT}
    except (OSError, KeyError, TypeError, ValueError):
        return dict(LM_MODEL_DEFAULT)


def lm_suite(args: argparse.Namespace) -> Iterator[SuiteEntry]:
    """One training step of the tiny LM per encoding, next to the NoPE step.

    The step: zero the gradients, forward, cross-entropy, backward, AdamW step,
    on a batch of ``args.lm_batch`` windows of ``args.lm_len`` tokens, with the
    model of chapter 7's record (:func:`lm_model_config`: width, layers and heads) on
    the ``"auto"`` backend, plus ``alibi (sdpa backend)`` for comparison. The reference
    is ``nope`` (:data:`LM_REFERENCE`): the same model with no position information,
    i.e. what a step costs before any encoding adds work; :data:`LM_AA` is that step's
    own callable timed again (the A/A control). Every step updates its model's weights;
    the values do not change the work.
    """
    from tutorial_pkg.models.tiny_lm import TinyLM

    device = torch.device(args.device)
    batch, length = args.lm_batch, args.lm_len
    model_cfg = lm_model_config()
    d_model, layers, heads = model_cfg["d_model"], model_cfg["n_layers"], model_cfg["n_heads"]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (batch, length + 1), generator=gen).to(device)
    x, y = ids[:, :-1], ids[:, 1:]
    encodings = ["nope", "sinusoidal", "learned", "rope", "alibi", "hybrid"]
    variants = [(name, "auto") for name in encodings] + [("alibi", "sdpa")]
    cases: dict[str, Case] = {}
    for name, backend in variants:
        model = TinyLM(name, d_model=d_model, n_layers=layers, n_heads=heads,
                       max_positions=length, backend=backend).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model=model, opt=opt) -> Any:
            opt.zero_grad(set_to_none=True)
            loss = model.loss(x, y)
            loss.backward()
            opt.step()
            return loss.detach()

        label = name if backend == "auto" else f"{name} ({backend} backend)"
        cases[label] = Case(step, {"encoding": name, "backend": backend},
                            held=lambda model=model: _held_bytes(model.encoding),
                            footprint=lm_footprint(model, batch, length, d_model=d_model,
                                                   layers=layers, heads=heads))
    cases[LM_AA] = cases[LM_REFERENCE]  # the same Case, the same callable: A/A
    params = {"op": "lm train step", "batch": batch, "seq_len": length, "d_model": d_model,
              "layers": layers, "heads": heads, "pass": "fwd+bwd+adamw"}
    yield SuiteEntry(f"lm step L={length}", cases, LM_REFERENCE, params)


def default_suite(args: argparse.Namespace) -> Iterator[SuiteEntry]:
    """The standard suite: the parts in ``args.parts`` (default all of :data:`SUITE_PARTS`).

    ``attention`` (:func:`attention_suite`), ``rope`` (:func:`rope_suite`) and
    ``lm`` (:func:`lm_suite`); each group measures its cases side by side with
    its limit reference. ``benchmarks/suite.py`` runs it and checks the book's
    performance targets; any other suite can be run with ``--suite
    module:function`` (a function with this signature).

    Args:
        args: Parsed and completed arguments of :func:`build_parser`.

    Yields:
        :class:`SuiteEntry` groups, generated lazily.
    """
    parts = {"attention": attention_suite, "rope": rope_suite, "lm": lm_suite}
    for part in getattr(args, "parts", None) or SUITE_PARTS:
        yield from parts[part](args)


def _load_suite(spec: str) -> SuiteFn:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--suite must look like 'module:function', got {spec!r}")
    suite = getattr(importlib.import_module(module_name), attr)
    if not callable(suite):
        raise TypeError(f"--suite: {spec!r} is not callable")
    return suite


# --------------------------------------------------------------------------- #
# The claims a recorded run tests, fixed before it measures anything
# --------------------------------------------------------------------------- #
#: Family-wise error rate of :data:`CLAIMS`: each claim's interval is at ``1 - ALPHA / k``
#: (Bonferroni over the ``k`` claims), so that the chance that any verdict of the family is
#: wrong is at most ``ALPHA`` (under the interval's assumptions: see :func:`decide_claims`).
ALPHA = 0.05
_F, _B = {"op": "attention", "pass": "fwd"}, {"op": "attention", "pass": "fwd+bwd"}
_F32, _B16 = {"op": "rope", "dtype": "float32"}, {"op": "rope", "dtype": "bfloat16"}
_LM = {"op": "lm train step"}
_LONG = [1024, 2048, 4096]
#: The claims the recorded run is made to test: ``(id, claim, groups, case, against, test,
#: bound)``. ``groups`` selects the groups by their params (``lengths``: only those
#: sequence lengths); ``test`` is ``">"`` (``case / against`` above ``bound``), ``"<"``
#: (below it) or ``"A/A"`` (the identical callable: the interval must contain 1). Written
#: into the results file before the first case is timed; :func:`decide_claims` decides
#: them from the records. Chosen from the previous recorded run (commit af44af7) and the
#: targets of ``benchmarks/README.md``, before this run.
CLAIMS = (
    ("A1", "A/A: the limit timed twice reads alike, forward", _F, ATTENTION_AA,
     ATTENTION_LIMIT, "A/A", 1.0),
    ("A2", "A/A: the limit timed twice reads alike, forward and backward", _B, ATTENTION_AA,
     ATTENTION_LIMIT, "A/A", 1.0),
    ("A3", "the layer with no encoding costs under 5 % more than the direct SDPA call, "
     "forward", _F, "nope/sdpa", ATTENTION_LIMIT, "<", 1.05),
    ("A4", "ALiBi's default path costs more than no encoding, forward", _F, "alibi/auto",
     "nope/sdpa", ">", 1.0),
    ("A5", "ALiBi's default path costs more than no encoding, forward and backward", _B,
     "alibi/auto", "nope/sdpa", ">", 1.0),
    ("A6", "ALiBi's default path costs under 10 % more than no encoding, forward", _F,
     "alibi/auto", "nope/sdpa", "<", 1.10),
    ("A7", "ALiBi's default path costs under 10 % more than no encoding, forward and "
     "backward", _B, "alibi/auto", "nope/sdpa", "<", 1.10),
    ("A8", "the cached 4-D bias is slower than the default path from 1024 tokens, forward",
     {**_F, "lengths": _LONG}, "alibi/sdpa", "alibi/auto", ">", 1.0),
    ("A9", "the cached 4-D bias is slower than the default path from 1024 tokens, forward "
     "and backward", {**_B, "lengths": _LONG}, "alibi/sdpa", "alibi/auto", ">", 1.0),
    ("A10", "the articles' ALiBi takes over 3 times the default path at 2048 and 4096 "
     "tokens, forward", {**_F, "lengths": [2048, 4096]}, "alibi/article", "alibi/auto", ">",
     3.0),
    ("A11", "compiled FlexAttention's ALiBi forward is slower than the limit from 1024 "
     "tokens", {**_F, "lengths": _LONG}, "alibi/flex", ATTENTION_LIMIT, ">", 1.0),
    ("A12", "RoPE costs more than no encoding inside attention, forward", _F, "rope/sdpa",
     "nope/sdpa", ">", 1.0),
    ("R1", "A/A: the copy timed twice reads alike, float32", _F32, ROPE_AA, ROPE_LIMIT, "A/A",
     1.0),
    ("R2", "A/A: the copy timed twice reads alike, bfloat16", _B16, ROPE_AA, ROPE_LIMIT,
     "A/A", 1.0),
    ("R3", "the default rotation (half layout) is slower than Meta's complex form, float32",
     _F32, "rotate", "complex", ">", 1.0),
    ("R4", "the default rotation is faster on the interleaved layout than on the half "
     "layout, float32", _F32, "rotate interleaved", "rotate", "<", 1.0),
    ("R5", "the fused kernel is faster than the default rotation, float32", _F32,
     "rotate fused", "rotate", "<", 1.0),
    ("R6", "the fused kernel is faster than the default rotation, bfloat16", _B16,
     "rotate fused", "rotate", "<", 1.0),
    ("R7", "the default rotation takes more than 5 copies of q and k, bfloat16", _B16,
     "rotate", ROPE_LIMIT, ">", 5.0),
    ("L1", "A/A: the NoPE step timed twice reads alike", _LM, LM_AA, LM_REFERENCE, "A/A",
     1.0),
    ("L2", "a RoPE step costs more than a NoPE step", _LM, "rope", LM_REFERENCE, ">", 1.0),
    ("L3", "a hybrid step costs more than a NoPE step", _LM, "hybrid", LM_REFERENCE, ">",
     1.0),
    ("L4", "an ALiBi step costs under 5 % more than a NoPE step", _LM, "alibi", LM_REFERENCE,
     "<", 1.05),
    ("L5", "a RoPE step costs under 10 % more than a NoPE step", _LM, "rope", LM_REFERENCE,
     "<", 1.10),
)
_CLAIM_KEYS = ("id", "claim", "groups", "case", "against", "test", "bound")


def claim_dicts(claims: Sequence[Sequence[Any]] = CLAIMS) -> list[dict[str, Any]]:
    """:data:`CLAIMS` as the dicts a results file stores."""
    return [dict(zip(_CLAIM_KEYS, c, strict=True)) for c in claims]


def _selected(rec: bm.BenchRecord, groups: Mapping[str, Any]) -> bool:
    for key, want in groups.items():
        if key == "lengths":
            if rec.params.get("seq_len") not in want:
                return False
        elif rec.params.get(key) != want:
            return False
    return True


def paired_log_ratios(records: Iterable[bm.BenchRecord], case: str, against: str,
                      groups: Mapping[str, Any] | None = None) -> dict[str, list[float]]:
    """Per group, the per-round ``log(case / against)``: both timed in the same round.

    Each round's ratio of a case is to the reference of its group measured in that round
    (:attr:`~tutorial_pkg.measure.records.BenchRecord.round_ratios`), so the quotient of
    two cases' round ratios is their own ratio within the round, the reference cancelling.
    Groups (selected by ``groups``, as in :data:`CLAIMS`) where either case failed or ran
    fewer than two rounds are left out.
    """
    by_group: dict[str, dict[str, bm.BenchRecord]] = {}
    for r in records:
        if groups is None or _selected(r, groups):
            by_group.setdefault(r.group, {})[r.case] = r
    out = {}
    for group, recs in by_group.items():
        a, b = recs.get(case), recs.get(against)
        if a is None or b is None or not (a.ok and b.ok):
            continue
        ra = a.round_ratios or []
        rb = b.round_ratios or ([1.0] * len(ra) if against == a.reference else [])
        if len(ra) < 2 or len(ra) != len(rb):
            continue
        out[group] = [math.log(x / y) for x, y in zip(ra, rb, strict=True)]
    return out


def decide_claims(records: Iterable[bm.BenchRecord],
                  claims: Sequence[Mapping[str, Any]] | None = None,
                  alpha: float = ALPHA) -> list[dict[str, Any]]:
    """Each claim decided from the records of one run (see :data:`CLAIMS`).

    For each claim: per selected group, the per-round ``log(case / against)``
    (:func:`paired_log_ratios`); their mean over the groups' means with a Student t interval
    (:func:`~tutorial_pkg.experiments.stats.stratified_interval`: rounds independent,
    each length weighted alike), at ``1 - alpha / k`` for ``k`` claims (Bonferroni), then
    back to ratios. ``">"`` holds where the whole interval lies above ``bound``, is refuted
    where it lies below, else is not resolved; ``"<"`` mirrors it; ``"A/A"`` holds where
    the interval contains 1 (the test does not call the identical callable different) and
    is refuted where it does not. Under the interval's assumptions each holds-or-refuted
    verdict is wrong with probability at most ``alpha / (2 k)``, and the family's
    verdicts are all right with probability at least ``1 - alpha``.

    Args:
        records: The records of one run.
        claims: The claims (dicts as :func:`claim_dicts` returns, e.g. as stored in a
            results file); default :data:`CLAIMS`.
        alpha: The family-wise error rate.

    Returns:
        One dict per claim: its id and text, ``ratio`` (the geometric mean over the groups
        of the within-round ratio), ``low``, ``high``, ``confidence``, ``df``, ``rounds``
        (pairs used), ``groups`` and ``verdict`` (``"not measured"`` where no group has
        two rounds of both cases).
    """
    from tutorial_pkg.experiments.stats import stratified_interval

    records = list(records)
    claims = claim_dicts() if claims is None else [dict(c) for c in claims]
    confidence = 1 - alpha / len(claims)
    out = []
    for c in claims:
        logs = paired_log_ratios(records, c["case"], c["against"], c["groups"])
        row = {"id": c["id"], "claim": c["claim"], "test": c["test"], "bound": c["bound"]}
        if not logs:
            out.append({**row, "verdict": "not measured"})
            continue
        r = stratified_interval(list(logs.values()), confidence=confidence)
        low, high, bound = r["low"], r["high"], math.log(c["bound"])
        if c["test"] == "A/A":
            verdict = "holds" if low <= 0 <= high else "refuted"
        else:
            above, below = low > bound, high < bound
            if c["test"] == "<":
                above, below = below, above
            verdict = "holds" if above else "refuted" if below else "not resolved"
        out.append({**row, "ratio": math.exp(r["mean"]), "low": math.exp(low),
                    "high": math.exp(high), "confidence": confidence, "df": r["df"],
                    "rounds": r["n"], "groups": sorted(logs), "verdict": verdict})
    return out


def format_claims(decided: Sequence[Mapping[str, Any]]) -> str:
    """One line per decided claim."""
    lines = []
    for d in decided:
        if d["verdict"] == "not measured":
            lines.append(f"  {d['id']:<4} not measured   {d['claim']}")
            continue
        lines.append(f"  {d['id']:<4} {d['verdict']:<13} x{d['ratio']:.3f} "
                     f"[{d['low']:.3f}, {d['high']:.3f}]  {d['claim']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #
def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (suites may read any of its arguments)."""
    p = argparse.ArgumentParser(
        prog="python benchmarks/suite.py",
        description="Time and measure memory of benchmark cases side by side with their "
        "reference, print a table of ratios and write a JSON results file.",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON results file to write")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, few runs (a smoke test, not a measurement)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda if available, else cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=None, metavar="L",
                   help="sequence lengths (default depends on --device and --quick)")
    p.add_argument("--passes", nargs="+", choices=["fwd", "fwd+bwd"], default=None)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="default: float16 on cuda, float32 on cpu (bfloat16 needs compute "
                   "capability 8.0 on cuda)")
    p.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                   help="device memory the run may use, in GiB: cases whose expected "
                   "footprint does not fit are skipped and recorded with the reason; on "
                   "cuda it also caps PyTorch's allocator there (rehearse a 16 GB T4 on a "
                   "larger GPU with --memory-limit 14.5); default: the GPU's free memory, "
                   "no check on cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--parts", nargs="+", choices=list(SUITE_PARTS), default=None,
                   help="parts of the standard suite to run (default: all)")
    p.add_argument("--encodings", nargs="+", choices=list(ATTENTION_ENCODINGS), default=None,
                   help="encodings of the attention part (default: all four)")
    p.add_argument("--backends", nargs="+", choices=["naive", "sdpa", "flex", "auto"],
                   default=None, help="attention backends (default: all; --quick: no flex)")
    p.add_argument("--rope-shape", type=int, nargs=4, default=None, metavar=("B", "H", "S", "D"),
                   help="q/k shape of the rope part (default 4 8 2048 64)")
    p.add_argument("--lm-batch", type=int, default=None, help="batch of the lm part (32)")
    p.add_argument("--lm-len", type=int, default=None, help="window of the lm part (64)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--min-runs", type=int, default=None)
    p.add_argument("--max-time", type=float, default=None, help="seconds per case and round")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved measuring rounds over a group's cases (default 10)")
    p.add_argument("--rope-rounds", type=int, default=None,
                   help="rounds of the rope groups (default 30; --quick: 1)")
    p.add_argument("--lm-rounds", type=int, default=None,
                   help="rounds of the lm group (default 30; --quick: 1)")
    p.add_argument("--order-seed", type=int, default=0,
                   help="seed of the random order of the cases in every round; each group "
                   "draws from its own seed, this one plus a hash of its name (default 0; "
                   "give each run its own; -1: the fixed order, the reference first)")
    p.add_argument("--naive-for", nargs="+", choices=list(ATTENTION_ENCODINGS), default=None,
                   help="encodings that get the naive backend (default: all of --encodings)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for this process (default: torch's own)")
    p.add_argument("--no-memory", action="store_true", help="skip peak-memory measurement")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's malloc settings alone (default: keep freed blocks, so "
                   "that page faults on fresh outputs do not dominate CPU timings)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--suite", default=None, metavar="MODULE:FUNCTION",
                   help="suite to run instead of default_suite")
    return p


def _finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --device and --quick."""
    args.device = str(bm.resolve_device(args.device))
    kind = torch.device(args.device).type
    args.plan = device_plan(args.device)
    preset = _QUICK if args.quick else _FULL
    if args.lengths is None:
        args.lengths = list(preset.get("lengths", _FULL_LENGTHS[kind]))
    if args.passes is None:
        args.passes = list(preset["passes"])
    if args.dtype is None:
        args.dtype = args.plan.dtype
    if args.dtype == "bfloat16" and kind == "cuda" and not args.plan.bf16:
        raise ValueError(f"--dtype bfloat16: {args.plan.notes[0]}; use float16")
    if getattr(args, "memory_limit", None) is not None and args.memory_limit <= 0:
        raise ValueError(f"--memory-limit must be > 0 GiB, got {args.memory_limit}")
    for name in ("warmup", "min_runs", "max_time", "rounds", "backends", "rope_shape",
                 "lm_batch", "lm_len"):
        if getattr(args, name, None) is None:
            setattr(args, name, copy.copy(preset[name]))
    for name in ("rope_rounds", "lm_rounds"):
        if getattr(args, name, None) is None:
            setattr(args, name, preset[name] if preset[name] is not None else args.rounds)
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if getattr(args, "order_seed", None) is None:
        args.order_seed = 0
    if getattr(args, "encodings", None) is None:
        args.encodings = list(ATTENTION_ENCODINGS)
    if getattr(args, "parts", None) is None:
        args.parts = list(SUITE_PARTS)
    return args


def group_seed(order_seed: int, group: str) -> int:
    """The seed of ``group``'s case orders: ``order_seed`` plus the CRC-32 of its name.

    One seed for every group would give every group the same sequence of orders (the same
    case first in the same rounds everywhere), so pooled comparisons over groups would not
    be over independent randomisations."""
    return (order_seed + zlib.crc32(group.encode("utf-8"))) % 2**31


def _cap_allocator(device: str, limit: int) -> None:
    """On CUDA, make PyTorch's allocator refuse more than ``limit`` bytes (a smaller GPU)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), dev)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line style arguments, parsed and completed: what a suite function takes.

    Example: ``attention_suite(parse_args(["--lengths", "256", "--passes", "fwd"]))``.
    """
    return _finish_args(build_parser().parse_args([] if argv is None else list(argv)))


def _git_commit() -> str | None:
    """The checkout's commit (with ``+dirty`` for local changes), or ``None`` outside git."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty.strip() else "")


def run(argv: Sequence[str] | None = None, *, suite: SuiteFn | None = None
        ) -> list[bm.BenchRecord]:
    """Run a suite, print one table per group, optionally write the JSON results file.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).
        suite: Suite function; default ``--suite`` if given, else :func:`default_suite`.

    Returns:
        The records, in the order measured.
    """
    from tqdm import tqdm

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args = _finish_args(args)
        if suite is None:
            suite = _load_suite(args.suite) if args.suite else default_suite
    except (ValueError, ImportError, AttributeError, TypeError) as exc:
        parser.error(str(exc))
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)  # the CLI is the caller: its choice to make

    kept = False if args.default_malloc else keep_freed_memory()
    memory_limit = None
    if args.memory_limit is not None:
        memory_limit = int(args.memory_limit * 2**30)
        _cap_allocator(args.device, memory_limit)
    hardware = bm.hardware_info(args.device)
    hardware["command"] = shlex.join(["python", "benchmarks/suite.py", *argv])
    hardware["commit"] = _git_commit()
    hardware["malloc"] = "glibc keeps freed blocks (mmap threshold 32 MiB)" if kept else "default"
    hardware["memory_limit_gib"] = args.memory_limit
    hardware["plan"] = {"dtype": args.dtype, "rope_dtypes": list(args.plan.rope_dtypes),
                        "bf16": args.plan.bf16, "fused_bf16": args.plan.fused_bf16,
                        "notes": list(args.plan.notes)}
    print(f"{hardware['device_name']} ({hardware['device']}), torch {hardware['torch']}, "
          f"{hardware['num_threads']} threads, load average {hardware['loadavg']}", flush=True)
    order_seed = None if args.order_seed < 0 else args.order_seed
    design = {"order_seed": order_seed, "group_order_seeds": {},
              "rounds": {"attention": args.rounds, "rope": args.rope_rounds,
                         "lm train step": args.lm_rounds},
              "warmup": args.warmup, "min_runs": args.min_runs, "max_time_s": args.max_time}
    claims = claim_dicts()
    if args.out is not None:  # the claims go into the file before anything is timed
        args.out.parent.mkdir(parents=True, exist_ok=True)
        stub = {"status": "running", "claims": claims, "alpha": ALPHA, "design": design,
                "claims_written": bm.hardware_info("cpu")["date"], "hardware": hardware}
        args.out.write_text(json.dumps(stub, indent=1) + "\n", encoding="utf-8")
        print(f"{len(claims)} claims written to {args.out} before timing", flush=True)
    start = time.perf_counter()
    entries = suite(args)
    total = sum(len(e.cases) for e in entries) if isinstance(entries, Sequence) else None
    records: list[bm.BenchRecord] = []
    load_by_group: dict[str, list[float] | None] = {}
    with tqdm(total=total, unit="case", disable=args.no_progress, file=sys.stderr) as bar:
        for group, cases, reference, params in entries:
            bar.set_description(group)
            rounds = design["rounds"].get(params.get("op"), args.rounds)
            group_records = bm.compare(
                cases, reference, device=args.device, group=group, params=params,
                warmup=args.warmup, min_runs=args.min_runs, max_time_s=args.max_time,
                rounds=rounds, measure_memory=not args.no_memory,
                memory_limit=memory_limit, on_case_done=lambda _name: bar.update(1),
                order_seed=None if order_seed is None else group_seed(order_seed, group),
            )
            if order_seed is not None:
                design["group_order_seeds"][group] = group_seed(order_seed, group)
            records.extend(group_records)
            load_by_group[group] = bm.hardware_info("cpu")["loadavg"]
            # one table per group as soon as it is measured (long runs show progress)
            bar.clear()
            print(bm.format_table(group_records) + "\n", flush=True)
    hardware["loadavg_end"] = bm.hardware_info(args.device)["loadavg"]
    hardware["run_time_s"] = round(time.perf_counter() - start, 1)
    decided = decide_claims(records, claims)
    print(f"Claims fixed before the run ({len(claims)}, family-wise alpha {ALPHA}):")
    print(format_claims(decided))
    if args.out is not None:
        bm.save_results(records, args.out, hardware, extra={
            "status": "done", "claims": claims, "alpha": ALPHA, "design": design,
            "claims_written": stub["claims_written"], "decided": decided,
            "load_by_group": load_by_group})
        print(f"wrote {args.out}")
        print(f"\nload average at start {hardware['loadavg']}, at end "
              f"{hardware['loadavg_end']} ({hardware['cpu_count']} CPUs)")
    return records



def main(argv: Sequence[str] | None = None, *, suite: SuiteFn | None = None) -> int:
    """Run the suite with the given options (:func:`run`), then print the targets.

    Returns:
        The exit status (0, whatever the targets say).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
    records = run(argv, suite=suite)  # --help: argparse prints the options and exits
    print("\nOne-off costs (compiling), not included in any median:")
    print(one_off_costs(records))
    print("\nPerformance targets (ratios of cases measured side by side in this run; a target "
          "is 'not measured' when its case is absent or was run at other sizes):")
    print(format_targets(check_targets(records)))
    if "--quick" in argv:
        print("(--quick is a smoke test: tiny sizes, few runs; its timings mean nothing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
