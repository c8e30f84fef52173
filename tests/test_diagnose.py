"""Tests of tutorial_pkg.diagnose (its ``__init__``, the front door): the probes it holds itself
(masking, ALiBi, weight conversion) pass a correct implementation and catch a deliberately broken
one (each broken one is a bug of chapter 9), and README's diagnose snippet runs.

The probes of its other modules have their own files: test_rope_probes.py
(``diagnose.rope_probes``), test_kv_cache_check.py (``diagnose.kv_cache_check``),
test_kernel_masks.py (``diagnose.kernel_masks``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import tutorial_pkg as tp
from tutorial_pkg import diagnose as dg
from tutorial_pkg.models.tiny_lm import TinyLM

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def learned_lm():
    return TinyLM("learned", d_model=32, n_layers=2, n_heads=2, max_positions=32).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))


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
    if not r.ok:
        assert "powers of two" in r.problems[0]


@pytest.mark.parametrize("n_heads", [4, 6])
def test_probe_alibi_names_a_bias_scaled_in_every_head(n_heads):
    """Every slope off by one factor (a bias added twice, as transformers' eager Falcon path
    does, chapter 9's bug 18) is named as a scaled bias, not as a power-of-two formula."""
    r = dg.probe_alibi(lambda L: 2 * tp.alibi_bias(tp.alibi_slopes(n_heads), L), n_heads,
                       seq_len=64)
    assert not r.ok and r.wrong_heads == list(range(1, n_heads + 1))
    assert "2 times Press et al.'s" in r.problems[0] and "added 2 times" in r.problems[0]


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
