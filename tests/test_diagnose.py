"""Tests of tutorial_pkg.diagnose: every probe passes a correct implementation and
catches a deliberately broken one (each broken one is a bug of chapter 9)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tutorial_pkg as tp
from tutorial_pkg import diagnose as dg
from tutorial_pkg.models.tiny_lm import TinyLM

ROOT = Path(__file__).resolve().parents[1]


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


# --------------------------------------------------------------------------- KV cache
@pytest.fixture(scope="module")
def learned_lm():
    return TinyLM("learned", d_model=32, n_layers=2, n_heads=2, max_positions=32).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))


class OffsetBug(dg.TutorialAdapter):
    """A decoding loop whose positions restart at 0 on every call."""

    def step(self, chunk, positions, padding, cache):
        return super().step(chunk, positions - positions[:, :1], padding, cache)


def test_check_kv_cache_tutorial_models(learned_lm, ids):
    r = dg.check_kv_cache(learned_lm, ids)
    assert r.ok and set(r.scenarios) == {"decode", "left padding, one pass",
                                         "left padding, decode"}, str(r)
    # without per-row positions, the padded rows of an absolute encoding shift
    nopos = dg.check_kv_cache(dg.TutorialAdapter(learned_lm, pass_positions=False), ids)
    assert nopos.scenarios["decode"][0] is None
    assert nopos.scenarios["left padding, one pass"][0] == 0 and not nopos.ok
    offset = dg.check_kv_cache(OffsetBug(learned_lm), ids, prefill=4)
    assert offset.scenarios["decode"][0] == 4 and not offset.ok


def test_check_kv_cache_attention_layer():
    attn = tp.MultiHeadAttention(16, 2, tp.make_encoding("rope", d_model=16, n_heads=2)).eval()
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(0))
    assert dg.check_kv_cache(attn, x, n_pad=2).ok


class ToyHF:
    """A Hugging Face-style causal LM around a TinyLM (logits and cache in a namespace)."""

    def __init__(self, lm, restart_positions=False):
        self.lm, self.restart = lm, restart_positions

    def __call__(self, input_ids, position_ids=None, past_key_values=None, attention_mask=None):
        caches = past_key_values or self.lm.new_caches()
        if self.restart and position_ids is not None:
            position_ids = position_ids - position_ids[:, :1]
        padding = None if attention_mask is None else attention_mask == 0
        logits = self.lm(input_ids, positions=position_ids, caches=caches,
                         key_padding_mask=padding)
        return SimpleNamespace(logits=logits, past_key_values=caches)


def test_check_kv_cache_hf_convention(learned_lm, ids):
    assert dg.check_kv_cache(ToyHF(learned_lm), ids, convention="hf").ok
    bad = dg.check_kv_cache(ToyHF(learned_lm, restart_positions=True), ids, convention="hf")
    assert bad.scenarios["decode"][0] == 1 and "position 1" in str(bad)


class ToyHF5:
    """transformers 5.24's names: ``cache=``, ``use_cache`` (default off, as MPT's config),
    the cache back as ``.cache``; none when not asked for."""

    def __init__(self, lm):
        self.lm, self.calls = lm, []

    def __call__(self, input_ids, position_ids=None, cache=None, use_cache=None,
                 attention_mask=None, **kwargs):
        assert "past_key_values" not in kwargs
        self.calls.append(use_cache)
        caches = cache if use_cache and cache is not None else self.lm.new_caches()
        padding = None if attention_mask is None else attention_mask == 0
        logits = self.lm(input_ids, positions=position_ids, caches=caches,
                         key_padding_mask=padding)
        return SimpleNamespace(logits=logits, cache=caches if use_cache else None)


def test_check_kv_cache_hf_convention_current_names(learned_lm, ids):
    """The cache is asked for (use_cache=True on each step, False on the full pass) and
    passed as ``cache``; a model that returns none is an error, not a wrong report."""
    model = ToyHF5(learned_lm)
    adapter = dg.HFAdapter(model)
    adapter.start = lambda: learned_lm.new_caches()  # a cache object of its own kind
    assert dg.check_kv_cache(adapter, ids).ok
    assert set(model.calls) == {True, False}

    class NoCache(ToyHF5):
        def __call__(self, *args, use_cache=None, **kwargs):
            return super().__call__(*args, use_cache=False, **kwargs)

    with pytest.raises(ValueError, match="returned no cache"):
        dg.check_kv_cache(NoCache(learned_lm), ids, convention="hf")


def test_hf_adapter_start_without_a_config_makes_no_cache(learned_lm):
    assert dg.HFAdapter(ToyHF(learned_lm)).start() is None


# --------------------------------------------------------------------------- masking
def naive_attention(x, key_padding_mask=None, document_ids=None, causal=True, nan_safe=True):
    """softmax(q k^T) v on x [b, s, d] used as q, k and v, with a -inf mask."""
    b, s, d = x.shape
    scores = x @ x.transpose(-1, -2) / d**0.5
    mask = torch.zeros(b, s, s, dtype=torch.bool)
    if causal:
        mask |= torch.ones(s, s, dtype=torch.bool).triu(1)
    if key_padding_mask is not None:
        mask |= key_padding_mask[:, None, :]
    if document_ids is not None:
        mask |= document_ids[:, :, None] != document_ids[:, None, :]
    w = scores.masked_fill(mask, float("-inf")).softmax(-1)
    if nan_safe:
        w = w.nan_to_num(0.0)  # a row with every key masked gives zeros
    return w @ x


def test_probe_masking_nan_rows():
    x = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))
    assert dg.probe_masking(naive_attention, x, pad_tokens=2).ok
    bad = dg.probe_masking(lambda x, **kw: naive_attention(x, nan_safe=False, **kw), x,
                           pad_tokens=2)
    assert bad.nonfinite == (0, 0) and not bad.ok


def test_probe_masking_future_leak(ids):
    x = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))
    leak = dg.probe_masking(lambda x: naive_attention(x, causal=False), x)
    assert leak.future_leak == 0 and not leak.ok
    lm = TinyLM("rope", d_model=16, n_layers=1, n_heads=2).eval()
    assert dg.probe_masking(lm, ids).ok
    encoder = tp.MultiHeadAttention(4, 1, causal=False)
    assert dg.probe_masking(encoder, x).future_leak == 0


def test_probe_masking_packed_documents(ids):
    lm = TinyLM("learned", d_model=16, n_layers=1, n_heads=2, max_positions=16).eval()
    docs = torch.tensor([0] * 4 + [1] * 3 + [2] * 3)

    def packed(x, document_ids):
        return lm(x, positions=tp.positions_from_documents(document_ids),
                  document_ids=document_ids)

    def leaky(x, document_ids):  # positions restart, attention crosses documents
        return lm(x, positions=tp.positions_from_documents(document_ids))

    good = dg.probe_masking(packed, ids, document_ids=docs)
    assert good.ok and good.alone_error < 1e-5, str(good)
    bad = dg.probe_masking(leaky, ids, document_ids=docs)
    assert bad.document_leak == (0, 4, 0) and not bad.ok


# --------------------------------------------------------------------------- ALiBi
def pow2_slopes(n_heads):
    """attention-gym's exp2(-(h + 1) * 8 / H): Press et al.'s slopes only for powers of two."""
    return torch.exp2(-(torch.arange(n_heads) + 1.0) * 8 / n_heads)


@pytest.mark.parametrize("n_heads", [6, 8, 12])
def test_probe_alibi_slopes(n_heads):
    assert dg.probe_alibi(tp.alibi_slopes(n_heads), n_heads).ok
    r = dg.probe_alibi(lambda L: tp.alibi_bias(pow2_slopes(n_heads), L), n_heads, seq_len=64)
    assert r.ok == (n_heads == 8), str(r)
    assert r.first_rounded_distance is None


def test_probe_alibi_half_precision_bias():
    full = dg.probe_alibi(tp.alibi_bias(tp.alibi_slopes(8), 2048), 8)
    assert full.ok and full.rounding_error < 1e-3
    # power-of-two slopes times integer distances are exact in float16 up to 2048...
    assert dg.probe_alibi(tp.alibi_bias(tp.alibi_slopes(8), 2048).half(), 8).ok
    # ...not in bfloat16 (8 significant bits), nor with 12 heads' slopes in float16
    for n_heads, dtype in ((8, torch.bfloat16), (12, torch.float16)):
        bias = tp.alibi_bias(tp.alibi_slopes(n_heads), 2048).to(dtype)
        half = dg.probe_alibi(lambda L, bias=bias: bias[:, :L, :L], n_heads, seq_len=2048)
        assert not half.ok and half.wrong_heads == [], str(half)
        assert 0 < half.first_rounded_distance < 2048


# --------------------------------------------------------------------------- weight conversion
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_check_weight_conversion_gqa(n_kv_heads):
    gen = torch.Generator().manual_seed(0)
    wq, wk = torch.randn(4 * 8, 32, generator=gen), torch.randn(n_kv_heads * 8, 32, generator=gen)
    right = dg.check_weight_conversion(
        wq, wk, tp.interleaved_to_half(wq, 4), tp.interleaved_to_half(wk, n_kv_heads),
        n_heads=4, n_kv_heads=n_kv_heads)
    assert right.ok and max(right.head_errors) < 1e-12, str(right)
    copied = dg.check_weight_conversion(wq, wk, wq, wk, n_heads=4, n_kv_heads=n_kv_heads)
    assert not copied.ok and copied.bad_heads == [1, 2, 3, 4]
    assert "W_q was copied without permuting its rows" in copied.hints
    if n_kv_heads == 2:  # W_k permuted as if it had 4 heads
        wrong = dg.check_weight_conversion(
            wq, wk, tp.interleaved_to_half(wq, 4), tp.interleaved_to_half(wk, 4),
            n_heads=4, n_kv_heads=2)
        assert not wrong.ok and any("permuted with 4 heads" in h for h in wrong.hints)


# --------------------------------------------------------------------------- bad input
def test_bad_input_names_the_argument(ids, learned_lm):
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
        (TypeError, "model", lambda: dg.TutorialAdapter(3)),
        (TypeError, "n_pad", lambda: dg.check_kv_cache(learned_lm, ids, n_pad=True)),
        (ValueError, "convention", lambda: dg.check_kv_cache(learned_lm, ids, convention="x")),
        (ValueError, "n_pad", lambda: dg.check_kv_cache(learned_lm, ids, n_pad=10)),
        (ValueError, "prefill", lambda: dg.check_kv_cache(learned_lm, ids, prefill=11)),
        (TypeError, "inputs", lambda: dg.check_kv_cache(learned_lm, [1, 2])),
        (ValueError, "pad_tokens", lambda: dg.probe_masking(learned_lm, ids, pad_tokens=-1)),
        (ValueError, "document_ids", lambda: dg.probe_masking(
            learned_lm, ids, document_ids=torch.zeros(3, 10, dtype=torch.long))),
        (ValueError, "inputs", lambda: dg.probe_masking(learned_lm, torch.zeros(2, 4).long())),
        (ValueError, "bias", lambda: dg.probe_alibi(torch.zeros(4, 3, 3), 8)),
        (TypeError, "bias", lambda: dg.probe_alibi("slopes", 8)),
        (TypeError, "bias", lambda: dg.probe_alibi(lambda L: torch.zeros(8, L, L).long(), 8)),
        (TypeError, "w_q", lambda: dg.check_weight_conversion(
            "w", torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(8, 4), n_heads=2)),
        (ValueError, "new_w_q", lambda: dg.check_weight_conversion(
            torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(8), torch.zeros(8, 4), n_heads=2)),
        (ValueError, "n_kv_heads", lambda: dg.check_weight_conversion(
            torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(8, 4),
            n_heads=2, n_kv_heads=3)),
        (ValueError, "new_w_k", lambda: dg.check_weight_conversion(
            torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(6, 4),
            n_heads=2)),
    ]
    for err, name, call in cases:
        with pytest.raises(err, match=name):
            call()


def test_readme_diagnose_snippet_runs():
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"<!-- diagnose-snippet.*?-->\n```python\n(.*?)```", readme, re.S)
    assert snippet, "README.md has no diagnose snippet"
    exec(compile(snippet.group(1), "README.md", "exec"), {})  # the asserts inside must hold


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
