"""Tests of tutorial_pkg.diagnose.rope_probes: :func:`~tutorial_pkg.diagnose.probe_rope` reads a
RoPE function's layout, base, partial rotary, scaling and output permutation, and catches a broken
one; :func:`~tutorial_pkg.diagnose.probe_rope_precision` catches bf16 angles;
:func:`~tutorial_pkg.diagnose.compare_rope` names what differs from a reference; bad input is
refused naming the argument. The functions probed are written here (Hugging Face's and Meta's
forms, and the bugs of chapter 9).
"""

from __future__ import annotations

import pytest
import torch

import tutorial_pkg as tp
from tutorial_pkg import diagnose as dg


# --------------------------------------------------------------------------- user RoPE functions
def hf_rope(x, base=10000.0, angle_dtype=torch.float32):
    """rotate_half RoPE as in Hugging Face Llama, positions 0..s-1, x [b, h, s, d]."""
    s, d = x.shape[-2:]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.outer(torch.arange(s).to(angle_dtype), inv.to(angle_dtype))
    emb = torch.cat((ang, ang), dim=-1)
    return x * emb.cos().to(x.dtype) + tp.rotate_half(x) * emb.sin().to(x.dtype)


def mixed_rope(x):
    """Bug: rotate_half pairs with an interleaved (repeat_interleave) cos/sin table."""
    s, d = x.shape[-2:]
    emb = torch.outer(torch.arange(s).float(), tp.inv_freq(d)).repeat_interleave(2, dim=-1)
    return x * emb.cos() + tp.rotate_half(x) * emb.sin()


def meta_rope(x):
    """Meta's complex form, interleaved pairs."""
    rope = tp.encodings.rope
    return rope.apply_rope_complex(x, rope.precompute_freqs_cis(x.shape[-1], x.shape[-2]))


# --------------------------------------------------------------------------- probe_rope
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_probe_rope_reads_layout_base_and_partial_rotary(layout, base, rotary_dim):
    rope = tp.RotaryEmbedding(32, base, layout=layout, rotary_dim=rotary_dim)
    r = dg.probe_rope(rope.rotate, 32, expect_layout=layout, expect_base=base)
    assert r.ok, str(r)
    assert (r.layout, r.base, r.rotary_dim) == (layout, base, rotary_dim)
    assert r.unrotated == list(range(rotary_dim, 32))
    assert r.frequency_scale == 1.0 and r.magnitude == pytest.approx(1.0)
    assert f"layout {layout}" in str(r) and "OK" in str(r)


def test_probe_rope_on_plain_functions():
    assert dg.probe_rope(hf_rope, 64).layout == "half"
    meta = dg.probe_rope(meta_rope, 64)
    assert (meta.layout, meta.base, meta.ok) == ("interleaved", 10000.0, True)
    wrong = dg.probe_rope(meta_rope, 64, expect_layout="half")
    assert not wrong.ok and "expected half" in str(wrong)
    bshd = dg.probe_rope(lambda x: hf_rope(x.transpose(1, 2)).transpose(1, 2), 64, axes="bshd",
                         n_heads=3)
    assert bshd.ok and bshd.layout == "half"
    # the tuple form (q, k) -> (q, k) is read through its first item
    assert dg.probe_rope(lambda x: (hf_rope(x), hf_rope(x)), 64).ok


def test_probe_rope_catches_a_mixed_table_and_a_missing_rotation():
    bad = dg.probe_rope(mixed_rope, 64)
    assert not bad.ok and bad.relative_error > 1e-2
    assert any("absolute positions" in p for p in bad.problems)
    none = dg.probe_rope(lambda x: x, 16)
    assert not none.ok and none.layout is None and none.rotary_dim == 0


def test_probe_rope_notes_scaling():
    pi = dg.probe_rope(tp.RotaryEmbedding(32, scaling={"type": "linear", "factor": 4}).rotate, 32)
    assert pi.ok and pi.frequency_scale == 4.0 and pi.base == 10000.0
    yarn = tp.RotaryEmbedding(32, scaling={"type": "yarn", "factor": 4,
                                           "original_max_position_embeddings": 64})
    r = dg.probe_rope(yarn.rotate, 32)
    assert r.ok and r.magnitude == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


def test_probe_rope_precision_catches_bf16_angles():
    good = dg.probe_rope_precision(tp.RotaryEmbedding(64).rotate, 64, seq_len=2048)
    assert good.ok and good.first_bad_position is None, str(good)
    bad = dg.probe_rope_precision(lambda x: hf_rope(x, angle_dtype=x.dtype), 64, seq_len=2048)
    assert not bad.ok and bad.first_bad_position < 256
    assert bad.buckets[-1][2] > 10 * good.buckets[-1][2]


def test_probe_rope_precision_under_autocast():
    def autocast_rope(x):  # angles by a matmul, which autocast runs in bf16 (transformers #29285)
        s, d = x.shape[-2:]
        ang = torch.arange(s, dtype=torch.float32)[:, None] @ tp.inv_freq(d)[None]
        emb = torch.cat((ang, ang), -1)
        return x * emb.cos().to(x.dtype) + tp.rotate_half(x) * emb.sin().to(x.dtype)

    assert dg.probe_rope_precision(autocast_rope, 64, seq_len=1024).ok
    assert not dg.probe_rope_precision(autocast_rope, 64, seq_len=1024, autocast=True).ok


# --------------------------------------------------------------------------- permuted output
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_probe_rope_sees_through_an_output_permutation(layout):
    """A RoPE that returns its features permuted (DeepSeek-V3 de-interleaves) is still a
    relative rotation: the report gives the input's layout and base, and the permutation."""
    rope = tp.RotaryEmbedding(16, 500_000.0, layout=layout)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(3))
    report = dg.probe_rope(lambda x: rope.rotate(x)[..., perm], 16)
    assert report.ok, str(report)
    assert (report.layout, report.base, report.rotary_dim) == (layout, 500_000.0, 16)
    assert [report.output_permutation[int(j)] for j in perm] == list(range(16))
    assert "output permuted" in str(report) and "scores unaffected" in str(report)
    plain = dg.probe_rope(rope.rotate, 16)
    assert plain.output_permutation is None and "permuted" not in str(plain)


def test_probe_rope_reports_a_permutation_that_rotates_nothing():
    """Swapping two features is a permutation, not a rotation: nothing is rotated, and the
    report still prints (the layout is None)."""
    report = dg.probe_rope(lambda x: x[..., torch.tensor([1, 0, 2, 3])], 4)
    assert not report.ok and report.layout is None and report.output_permutation == [1, 0, 2, 3]
    assert "layout None, output permuted" in str(report)
    assert "nothing is rotated" in str(report)


def test_probe_rope_names_a_de_interleaved_output():
    """Adjacent pairs in, evens' results first and odds' second out (DeepSeek-V3's form),
    here with 8 of 12 features rotated."""
    rope = tp.RotaryEmbedding(12, rotary_dim=8, layout="interleaved")
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7, 8, 9, 10, 11])
    report = dg.probe_rope(lambda x: rope.rotate(x)[..., order], 12)
    assert report.ok, str(report)
    assert (report.layout, report.rotary_dim, report.unrotated) == ("interleaved", 8,
                                                                    [8, 9, 10, 11])
    assert "interleaved, de-interleaved output" in str(report)


# --------------------------------------------------------------------------- compare_rope
def _yarn(attention_factor=None):
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    if attention_factor is not None:
        scaling["attention_factor"] = attention_factor
    return tp.RotaryEmbedding(16, layout="interleaved", scaling=scaling).rotate


def test_compare_rope_same_function_is_ok():
    ref = tp.RotaryEmbedding(32, rotary_dim=16).rotate
    r = dg.compare_rope(ref, ref, 32)
    assert r.ok and r.max_output_error <= r.tol and r.magnitude_ratio == pytest.approx(1.0)
    assert "RopeComparison: OK" in str(r) and "rotates features 0-15 of 32" in str(r)


def test_compare_rope_names_the_wrong_slice():
    ref = tp.RotaryEmbedding(16, rotary_dim=8).rotate

    def last_slice(x):  # rotates features 8-15 instead of 0-7
        y = ref(torch.cat((x[..., 8:], x[..., :8]), -1))
        return torch.cat((y[..., 8:], y[..., :8]), -1)

    r = dg.compare_rope(last_slice, ref, 16)
    assert not r.ok and "wrong slice" in r.problems[0] and "features 8-15" in r.problems[0]


def test_compare_rope_names_layout_base_and_scaling():
    half, inter = (tp.RotaryEmbedding(16, layout=lay).rotate for lay in ("half", "interleaved"))
    assert "as half; the reference as interleaved" in dg.compare_rope(half, inter, 16).problems[0]
    other_base = tp.RotaryEmbedding(16, 1e6, layout="interleaved").rotate
    assert "another base" in dg.compare_rope(other_base, inter, 16).problems[0]
    r = dg.compare_rope(_yarn(), inter, 16)
    assert "another scaling of the frequencies" in r.problems[0] and len(r.problems) == 2


def test_compare_rope_names_a_dropped_or_doubled_attention_factor():
    factor = tp.encodings.rope_scaling.yarn_mscale(4.0)
    dropped = dg.compare_rope(_yarn(1.0), _yarn(), 16)
    assert len(dropped.problems) == 1 and "dropped" in dropped.problems[0]
    assert dropped.magnitude_ratio == pytest.approx(1 / factor, rel=1e-4)
    twice = dg.compare_rope(_yarn(factor**2), _yarn(), 16)
    assert len(twice.problems) == 1 and "applied twice" in twice.problems[0]


def test_compare_rope_bad_input_names_the_argument():
    ref = tp.RotaryEmbedding(16).rotate
    with pytest.raises(TypeError, match="reference"):
        dg.compare_rope(ref, "not a function", 16)
    with pytest.raises(ValueError, match="tol"):
        dg.compare_rope(ref, ref, 16, tol=-1.0)


# --------------------------------------------------------------------------- bad input
def test_rope_probes_bad_input_names_the_argument():
    cases = [
        (TypeError, "rope", lambda: dg.probe_rope(3, 8)),
        (ValueError, "head_dim", lambda: dg.probe_rope(hf_rope, 0)),
        (ValueError, "axes", lambda: dg.probe_rope(hf_rope, 8, axes="bsdh")),
        (ValueError, "seq_len", lambda: dg.probe_rope(hf_rope, 8, seq_len=2)),
        (TypeError, "dtype", lambda: dg.probe_rope(hf_rope, 8, dtype=torch.int32)),
        (ValueError, "rope", lambda: dg.probe_rope(lambda x: x[..., :2], 8)),
        (TypeError, "reference", lambda: dg.probe_rope_precision(hf_rope, 8, reference=1)),
        (TypeError, "autocast", lambda: dg.probe_rope_precision(hf_rope, 8, autocast=1)),
        (TypeError, "dtype", lambda: dg.probe_rope_precision(hf_rope, 8, dtype="bfloat16")),
    ]
    for err, name, call in cases:
        with pytest.raises(err, match=name):
            call()
