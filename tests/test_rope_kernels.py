"""Tests of tutorial_pkg.encodings.rope_kernels: rotate_pairs, the one rotation that
apply_rope, RotaryEmbedding and the encodings run, held to the spec (rope._rope) bit for bit
where its forms round alike; its blocked and 16-bit forms; the compiled fused kernel; and the
recorded speed run (book/data/rope_speed_cpu.json)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.test_rope import cos_sin, float64_rope, randn
from tutorial_pkg.encodings.rope import RotaryEmbedding, _rope, apply_rope
from tutorial_pkg.encodings.rope_kernels import rotate_pairs

pytestmark = pytest.mark.usefixtures("one_thread")
# Set TUTORIAL_PKG_SKIP_SLOW=1 to skip the torch.compile tests (inductor codegen, seconds).
slow = pytest.mark.skipif(os.environ.get("TUTORIAL_PKG_SKIP_SLOW") == "1",
                          reason="TUTORIAL_PKG_SKIP_SLOW=1")
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest distance in units of the last place of ``want``'s dtype."""
    mant = {torch.float32: 23, torch.float64: 52, torch.bfloat16: 7, torch.float16: 10}[want.dtype]
    w = want.double()
    ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(torch.finfo(want.dtype).tiny)))
                     - mant)
    return float(((got.double() - w).abs() / ulp).max())


# --------------------------------------------------------------------------- one rotation
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [None, 48])
@pytest.mark.parametrize("seq", [7, 3000])  # 3000: large enough for the blocked CPU form
def test_apply_rope_and_rotate_give_the_same_bits(layout, dtype, rotary_dim, seq):
    """apply_rope, RotaryEmbedding.rotate and forward(q, k) run one code: the same bits in
    every dtype, layout, partial rotary, blocked or not, with autograd or without."""
    rot = RotaryEmbedding(64, rotary_dim=rotary_dim, layout=layout)
    x = randn(2, 2, seq, 64, seed=seq, dtype=dtype)
    cos, sin = rot.cos_sin(start=3, length=seq)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            xg = x.clone().requires_grad_(grad)
            want = apply_rope(xg, cos, sin, layout)
            assert torch.equal(rot.rotate(xg, start=3), want)
            q, k = rot(xg, x.flip(1), start=3)
            assert torch.equal(q, want) and torch.equal(k, apply_rope(x.flip(1), cos, sin, layout))


def _terms(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """``|x1 cos| + |x2 sin|`` per output feature (float64): the scale of its roundings."""
    half = cos.shape[-1]
    xd, c, s = x[..., : 2 * half].double(), cos.double().abs(), sin.double().abs()
    x1, x2 = (xd[..., :half], xd[..., half:]) if layout == "half" else (xd[..., 0::2],
                                                                          xd[..., 1::2])
    t1, t2 = x1.abs() * c + x2.abs() * s, x2.abs() * c + x1.abs() * s
    out = torch.cat((t1, t2), -1) if layout == "half" else torch.stack((t1, t2), -1).flatten(-2)
    return torch.cat((out, x[..., 2 * half :].double().abs()), -1)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 48])
def test_rotation_rounds_as_the_spec_up_to_a_fused_product(layout, dtype, rotary_dim):
    """The spec rounds x1 cos, x2 sin and their difference; the fast forms may fuse one
    product into the sum (addcmul, the complex kernel: one rounding less). So in float32
    and float64 they are within one rounding of the terms of each other, and in 16 bits,
    both computed in float32 and rounded once, equal or one unit in the last place apart.
    Blocked (4096 positions, 4 MiB) or not."""
    rot = RotaryEmbedding(64, rotary_dim=rotary_dim, layout=layout)
    for seq in (5, 4096):
        x = randn(2, 4, seq, 64, seed=1, dtype=dtype)
        cos, sin = rot.cos_sin(start=0, length=seq)
        with torch.no_grad():
            got, spec = rotate_pairs(cos, sin, layout, x)[0], _rope(x, cos, sin, layout)
        assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])
        if dtype in (torch.float32, torch.float64):
            bound = 2 * torch.finfo(dtype).eps * _terms(x, cos, sin, layout)
            assert bool(((got.double() - spec.double()).abs() <= bound).all())
        else:  # one unit, or float32's rounding of the terms where they cancel
            mant = {torch.bfloat16: 7, torch.float16: 10}[dtype]
            w = spec.double().abs().clamp_min(torch.finfo(dtype).tiny)
            ulp = torch.exp2(torch.floor(torch.log2(w)) - mant)
            off = (got.double() - spec.double()).abs()
            assert bool((off <= torch.maximum(ulp, 2.0**-22 * _terms(x, cos, sin, layout))).all())
            assert (got == spec).double().mean() > 0.999


def test_interleaved_is_the_half_rotation_on_permuted_features():
    rot = RotaryEmbedding(64, layout="interleaved")
    x = randn(3, 4, 300, 64, seed=2)
    cos, sin = rot.cos_sin(start=0, length=300)
    perm = torch.cat((torch.arange(0, 64, 2), torch.arange(1, 64, 2)))
    got = rotate_pairs(cos, sin, "interleaved", x)[0]
    torch.testing.assert_close(rotate_pairs(cos, sin, "half", x[..., perm])[0], got[..., perm],
                               rtol=0, atol=4e-7 * float(x.abs().max()))


def test_16bit_apply_rope_is_as_accurate_as_rotate():
    """Before one rotation, apply_rope computed 16-bit x in its own dtype (max error 0.0134
    against float64 where rotate had 0.0076, the figures of the design issue): now both are
    the float32 rotation rounded once, and closer to float64 than the 16-bit product."""
    d = 64
    pos = torch.arange(0, 32768, 16)
    x = randn(1, 4, len(pos), d, seed=3, dtype=torch.bfloat16)
    cos, sin = RotaryEmbedding(d).cos_sin(pos)
    exact = float64_rope(x, pos, d)
    err = (apply_rope(x, cos, sin).double() - exact).abs().max()
    err16 = (_16bit_tables_rope(x, cos, sin).double() - exact).abs().max()
    assert err < err16
    assert err <= torch.finfo(torch.bfloat16).eps * exact.abs().max()


def test_rotate_pairs_rotates_q_and_k_of_other_shapes_in_one_call():
    cos, sin = cos_sin(5, 16)
    q, k = randn(2, 4, 5, 16, seed=4), randn(2, 2, 5, 16, seed=5)
    got = rotate_pairs(cos, sin, "half", q, k)
    assert torch.equal(got[0], rotate_pairs(cos, sin, "half", q)[0])
    assert torch.equal(got[1], rotate_pairs(cos, sin, "half", k)[0])


# --------------------------------------------------------------------------- fast paths (chapter 5)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rotary_fast_path_equals_apply_rope_with_gradients(layout, dtype):
    gen = torch.Generator().manual_seed(0)
    rot = RotaryEmbedding(16, layout=layout)
    x = torch.randn(2, 6, 3, 16, generator=gen).to(dtype).transpose(1, 2)  # like q from MHA
    x.requires_grad_(True)
    cos, sin = rot.cos_sin(start=5, length=6)
    got, want = rot.rotate(x, start=5), apply_rope(x, cos, sin, layout)
    tol = {torch.bfloat16: 2e-2}.get(dtype, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    g = torch.randn(got.shape, generator=gen).to(dtype)
    (g_got,) = torch.autograd.grad(got, x, g)
    (g_want,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(g_got, g_want, atol=tol, rtol=tol)


def _16bit_tables_rope(x, cos, sin):
    """The rotation in x's dtype, as a 16-bit model without an upcast computes it: tables
    rounded to x's dtype, x * [cos, cos] rounded, then -/+ x * sin added and rounded again."""
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    half = c.shape[-1]
    y = x * torch.cat((c, c), dim=-1)
    y[..., :half].addcmul_(x[..., half:], s, value=-1)
    y[..., half:].addcmul_(x[..., :half], s)
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_rope_is_computed_in_float32_and_rounded_once(dtype):
    """16-bit q/k are rotated in float32 with float32 tables and rounded once: at random
    positions up to 1e5, at least as close to float64 as the old 16-bit form (three
    roundings) and as Hugging Face's bf16 apply_rotary_pos_emb, and within one ulp of the
    correctly rounded rotation (equal to it but where float32 cancellation decides)."""
    d, half = 64, 32
    gen = torch.Generator().manual_seed(25)
    pos = torch.randint(0, 100_001, (4096,), generator=gen)
    x = torch.randn(2, 4, len(pos), d, generator=gen).to(dtype)  # 4 MiB: the blocked path
    rope = RotaryEmbedding(d)
    cos, sin = rope.cos_sin(pos)
    xd, c, s = x.double(), cos.double(), sin.double()
    x1, x2 = xd[..., :half], xd[..., half:]
    ref = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)  # float64 on the same tables
    exact = float64_rope(x, pos, d)  # float64 angles too
    with torch.no_grad():
        new = rope.rotate(x, pos)
        xt = x.transpose(0, 1)
        assert torch.equal(new, rotate_pairs(cos, sin, "half", xt)[0].transpose(0, 1))
    old = _16bit_tables_rope(x, cos, sin)
    for target in (ref, exact):
        err_new, err_old = (new.double() - target).abs(), (old.double() - target).abs()
        assert err_new.max() <= err_old.max() and err_new.pow(2).mean() < err_old.pow(2).mean()
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf = apply_rotary_pos_emb(x, x, torch.cat((cos, cos), -1)[None].to(dtype),
                              torch.cat((sin, sin), -1)[None].to(dtype))[0]
    assert (new.double() - ref).abs().max() <= (hf.double() - ref).abs().max()
    # one rounding: within one ulp of the correctly rounded value, where a result much
    # smaller than its two terms (cancellation) may also carry float32's error of them
    rounded = ref.to(dtype)
    mant = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    tiny = torch.finfo(dtype).tiny
    ulp = torch.exp2(torch.floor(torch.log2(rounded.double().abs().clamp_min(tiny))) - mant)
    terms = torch.cat(((x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()), -1)
    off = (new.double() - rounded.double()).abs()
    assert bool((off <= torch.maximum(ulp, 2.0**-22 * terms)).all())
    assert (off <= ulp).double().mean() > 0.9999
    assert (new == rounded).double().mean() > 0.999
    assert (old == rounded).double().mean() < 0.8  # the old form: a third of them off


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_rope_same_bits_blocked_or_not_and_backward_matches_float32(dtype):
    rot = RotaryEmbedding(64)
    x = torch.randn(2, 4, 3000, 64).to(dtype)
    cos, sin = rot.cos_sin(start=0, length=3000)
    with torch.no_grad():
        blocked = rot.rotate(x)
    xg = x.clone().requires_grad_(True)
    out = rot.rotate(xg)  # autograd: not block by block
    assert torch.equal(out.detach(), blocked)
    g = torch.randn(out.shape).to(dtype)
    (grad,) = torch.autograd.grad(out, xg, g)
    x32 = x.float().requires_grad_(True)
    (grad32,) = torch.autograd.grad(rot.rotate(x32), x32, g.float())
    # the backward runs in float32 too and rounds once: float32's gradient, rounded
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.float(), grad32.to(dtype).float(), rtol=0,
                               atol=torch.finfo(dtype).eps * grad32.abs().max().item())
    assert (grad == grad32.to(dtype)).double().mean() > 0.999


def test_16bit_rope_function_gradcheck_in_float64():
    # the ops of the unblocked 16-bit path (_rope_half_upcast), run in float64
    from tutorial_pkg.encodings.rope_kernels import _rope_half_upcast

    rot = RotaryEmbedding(8)
    cos, sin = (t.double() for t in rot.cos_sin(start=3, length=5))
    x = randn(2, 5, 8, seed=17, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: _rope_half_upcast(t, cos, sin), (x,))
    torch.testing.assert_close(_rope_half_upcast(x, cos, sin), apply_rope(x, cos, sin))


def test_rotary_pair_equals_two_rotations():
    rot = RotaryEmbedding(16)
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    pos = torch.tensor([3, 4, 5, 6, 7])
    for q_pos, k_pos in ((None, None), (pos, pos), (pos, pos.flip(0))):
        got = rot(q, k, q_pos, k_pos)
        want = (rot.rotate(q, q_pos), rot.rotate(k, k_pos))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    with pytest.raises(ValueError, match="k must be"):
        rot(q, torch.randn(2, 2, 5, 8))


def test_rotary_partial_rotation_passes_the_tail_through():
    rot = RotaryEmbedding(16, rotary_dim=8)
    x = torch.randn(1, 2, 5, 16)
    cos, sin = rot.cos_sin(start=0, length=5)
    torch.testing.assert_close(rot.rotate(x), apply_rope(x, cos, sin))
    assert torch.equal(rot.rotate(x)[..., 8:], x[..., 8:])


@slow
def test_fused_rope_equals_eager():
    # compiles one small elementwise kernel (a few seconds cold)
    fused, eager = RotaryEmbedding(16, fused=True), RotaryEmbedding(16)
    assert "fused=True" in repr(fused) and "fused" not in repr(eager)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 4e-2)):
        x, k = torch.randn(2, 3, 7, 16).to(dtype), torch.randn(2, 1, 7, 16).to(dtype)
        got = fused.rotate(x, start=2)
        assert got.dtype == dtype
        torch.testing.assert_close(got, eager.rotate(x, start=2), atol=tol, rtol=tol)
        for got, want in zip(fused(x, k, start=2), eager(x, k, start=2), strict=True):  # q, k
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    with pytest.raises(TypeError, match="fused"):
        RotaryEmbedding(16, fused=1)


@slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_rope_rounds_16_bit_once_from_float32_tables(dtype):
    # the fused path must round as the eager one: float32 tables, x upcast, one rounding
    # (it used to round the tables to x's dtype first: 76 % of bf16 elements nearest)
    fused, eager = RotaryEmbedding(64, fused=True), RotaryEmbedding(64)
    x = torch.randn(1, 2, 256, 64).to(dtype)
    want = float64_rope(x, torch.arange(256), 64).to(dtype)  # nearest value of the exact
    got, eager_got = fused.rotate(x), eager.rotate(x)
    assert got.dtype == dtype
    assert (got == eager_got).double().mean().item() > 0.999  # a float32 FMA may differ
    assert (got == want).double().mean().item() > 0.99  # float32 tables: rare misses


@slow
def test_fused_rope_positions_scaling_and_gradients():
    # the fused path keeps its own cast cos/sin table per dtype: it must follow explicit
    # positions, a change of scaling and cache growth, and it must train like the eager one
    fused, eager = RotaryEmbedding(16, fused=True), RotaryEmbedding(16)
    x, k = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16)
    pos = torch.tensor([7, 0, 300, 2, 2])  # 300 grows the cache past its first 256 rows
    torch.testing.assert_close(fused.rotate(x, pos), eager.rotate(x, pos))
    for rope in (fused, eager):
        rope.set_scaling({"type": "linear", "factor": 4.0})
    torch.testing.assert_close(fused.rotate(x, start=3), eager.rotate(x, start=3))
    torch.testing.assert_close(fused.rotate(x, pos), eager.rotate(x, pos))
    grads = []
    for rope in (fused, eager):
        xq, xk = x.clone().requires_grad_(), k.clone().requires_grad_()
        q_rot, k_rot = rope(xq, xk, start=1)
        (q_rot * k_rot.flip(-1)).sum().backward()
        grads.append((xq.grad, xk.grad))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------- the speed record
SPEED_RECORD = Path(__file__).resolve().parents[1] / "book" / "data" / "rope_speed_cpu.json"


def test_rope_speed_cases_compute_the_rotation():
    # the benchmark's cases, on a small shape: each returns q and k rotated as apply_rope
    # does, in the case's layout
    from benchmarks.rope_speed import REFERENCE, rope_cases

    b, h, s, d = 1, 2, 16, 8
    cases = rope_cases((b, h, s, d), torch.float64)
    gen = torch.Generator().manual_seed(s)  # the cases' own inputs
    q, k = (torch.randn(b, h, s, d, generator=gen).to(torch.float64) for _ in range(2))
    cos, sin = cos_sin(s, d)
    assert {REFERENCE, "rotate (attention)", "rotate", "apply_rope", "spec",
            "rotate interleaved", "meta complex", "rotate fused", "one multiply"} <= set(cases)
    for name, call in cases.items():
        if name == "rotate fused":  # compiles (seconds); the fused tests above hold it
            continue
        if name == "one multiply":  # the floor case: one pass, not a rotation
            for g, x in zip(call(), (q, k), strict=True):
                torch.testing.assert_close(g, x * torch.cat((cos, cos), -1).double())
            continue
        layout = "interleaved" if name in ("rotate interleaved", "meta complex") else "half"
        want = (apply_rope(q, cos, sin, layout), apply_rope(k, cos, sin, layout))
        expected = (q, k) if name == REFERENCE else want
        for g, w in zip(call(), expected, strict=True):
            torch.testing.assert_close(g, w, msg=name)


def test_rope_speed_targets_are_decided_from_paired_rounds():
    from benchmarks.rope_speed import TARGETS, decide_targets
    from tutorial_pkg.measure.records import BenchRecord

    def rec(dtype, case, ratios):
        return BenchRecord(group=f"rope {dtype}", case=case, params={"dtype": dtype},
                           device="cpu", reference="copy q,k", ratio=ratios[0],
                           round_ratios=ratios, median_ms=1.0)

    records = [rec("float32", "rotate interleaved", [1.1, 1.3, 1.15]),
               rec("float32", "copy q,k", [1.0, 1.0, 1.0]),
               rec("float32", "rotate", [2.5, 2.1, 2.2]),
               rec("bfloat16", "rotate", [6.0, 6.0, 7.0]),
               rec("bfloat16", "hf apply_rotary_pos_emb", [8.0, 10.0, 7.0])]
    got = {d["target"]: d for d in decide_targets(records)}
    assert set(got) == {t[0] for t in TARGETS}
    inter, half, bf16 = (got[t[0]] for t in TARGETS)
    assert inter["median"] == 1.15 and inter["met"] and inter["round_max"] == 1.3
    assert half["median"] == 2.2 and not half["met"]
    assert bf16["median"] == 0.75 and bf16["met"]  # 6/8, 6/10, 7/7: paired per round
    assert bf16["round_min"] == 0.6 and bf16["round_max"] == 1.0


def test_rope_speed_record_is_well_formed_and_states_ratios():
    """The recorded run (benchmarks/rope_speed.py): where it ran, how busy the machine was,
    and per dtype each case's ratio to the copy of q and k with its range over rounds."""
    from tutorial_pkg.measure.cases import load_results

    hardware, records = load_results(SPEED_RECORD)
    for key in ("cpu", "torch", "date", "loadavg", "loadavg_end", "malloc", "command"):
        assert hardware.get(key) is not None, key
    assert hardware["num_threads"] == 1
    summary = json.loads(SPEED_RECORD.read_text(encoding="utf-8"))["summary"]
    assert set(summary) == {"float32", "bfloat16"}
    for dtype, cases in summary.items():
        group = [r for r in records if r.params["dtype"] == dtype]
        assert {r.reference for r in group} == {"copy q,k"}
        assert {"copy q,k", "rotate (attention)", "rotate", "apply_rope", "spec",
                "rotate interleaved", "meta complex", "rotate fused", "one multiply",
                "hf apply_rotary_pos_emb"} <= set(cases)
        for r in group:
            assert r.ok and len(r.round_ratios) >= 3, (dtype, r.case)
            stated = cases[r.case]
            assert stated["ratio"] == pytest.approx(r.ratio, abs=1e-3)
            assert stated["round_min"] <= stated["ratio"] <= stated["round_max"]
        assert cases["copy q,k"]["ratio"] == 1.0
    # the targets the script fixed before the run, each decided from the stored rounds
    from benchmarks.rope_speed import TARGETS, decide_targets

    data = json.loads(SPEED_RECORD.read_text(encoding="utf-8"))
    assert [t["target"] for t in data["targets"]] == [t[0] for t in TARGETS]
    assert data["decided"] == decide_targets(records)
