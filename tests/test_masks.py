"""Tests of tutorial_pkg.attention.masks: one rule per concern, composed; every backend's mask from
them.

Each rule is checked against its definition written out here (Hugging Face's
``masking_utils`` conventions for causal and sliding-window masks); the plan's dense mask,
its "has a key" rows and FlexAttention's block mask are checked to be the same rules.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tutorial_pkg import backends
from tutorial_pkg.attention.masks import (
    AttentionPlan,
    and_masks,
    causal_mask,
    dense_mask,
    key_padding,
    same_document,
    sliding_window,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def by_hand(start, s, k_len, *, causal, window=None, docs=None, pad=None, b=2):
    """bool [b, s, k_len] from the definitions, one pair at a time."""
    out = torch.zeros(b, s, k_len, dtype=torch.bool)
    for r, i, j in itertools.product(range(b), range(s), range(k_len)):
        q = start + i
        ok = (not causal or j <= q) and (window is None or abs(q - j) < window)
        ok = ok and (docs is None or docs[r, q] == docs[r, j])
        out[r, i, j] = ok and (pad is None or not pad[r, j])
    return out


def plan_of(start, s, k_len, *, causal, window=None, docs=None, pad=None):
    return AttentionPlan(q_pos=torch.arange(start, start + s)[None],
                         k_pos=torch.arange(k_len)[None], start=start, default_positions=True,
                         causal=causal, key_padding_mask=pad,
                         q_doc=None if docs is None else docs[:, start:],
                         k_doc=docs, window=window)


CASES = [  # (start, s, k_len): a whole sequence, a chunk after cached keys, one token
    (0, 9, 9), (5, 4, 9), (8, 1, 9),
]


def _inputs():
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1, 1]])
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[0, -2:] = True  # right padding
    pad[1, :6] = True  # left padding: early queries see no key
    return docs, pad


def test_each_rule_is_its_definition():
    q = torch.arange(6)[:, None]
    kv = torch.arange(6)[None, :]
    assert torch.equal(causal_mask(None, None, q, kv), kv <= q)  # HF: kv_idx <= q_idx
    near = sliding_window(3)(None, None, q, kv)
    assert torch.equal(near, (q - kv).abs() < 3)
    # with causality: HF's sliding_window_overlay, kv_idx > q_idx - w: w keys with itself
    both = and_masks(causal_mask, sliding_window(3))(None, None, q, kv)
    assert torch.equal(both, (kv <= q) & (kv > q - 3))
    assert both.sum(-1).tolist() == [1, 2, 3, 3, 3, 3]
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    b = torch.zeros(1, 1, 1, dtype=torch.long)
    same = same_document(docs)(b, None, q[None], kv[None])[0]
    assert torch.equal(same, docs[0][:, None] == docs[0][None, :])
    pad = torch.tensor([[True, False, False, True, False, False]])
    keep = key_padding(pad)(b, None, q[None], kv[None])[0]  # depends on the key only
    assert torch.equal(keep.expand(6, -1), ~pad.expand(6, -1))


def test_and_masks_of_one_rule_is_the_rule():
    assert and_masks(causal_mask) is causal_mask


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("use_docs, use_pad", [(False, False), (True, False), (False, True),
                                               (True, True)], ids=["-", "docs", "pad", "both"])
@pytest.mark.parametrize("start, s, k_len", CASES)
def test_the_plan_mask_is_the_rules_and_has_key_is_its_any(start, s, k_len, use_docs, use_pad,
                                                          window, causal):
    docs, pad = _inputs()
    docs, pad = (docs if use_docs else None), (pad if use_pad else None)
    plan = plan_of(start, s, k_len, causal=causal, window=window, docs=docs, pad=pad)
    want = by_hand(start, s, k_len, causal=causal, window=window, docs=docs, pad=pad)
    allowed = plan.allowed()
    if allowed is None:  # nothing masked
        assert want.all()
        assert plan.has_key() is None
        return
    assert torch.equal(allowed.expand(2, 1, s, k_len)[:, 0], want)
    # the dense mask is the composed rule, evaluated on every pair
    rule = plan.mask_rule(batch=2)
    dense = dense_mask(rule, start, s, k_len, batch=2)
    assert torch.equal(dense.expand(2, -1, -1, -1), allowed.expand(2, -1, -1, -1))
    has_key = plan.has_key()
    if pad is None:
        assert has_key is None and want.any(-1).all()  # only padding can empty a row
    else:
        assert torch.equal(has_key.expand(2, 1, s, 1)[:, 0, :, 0], want.any(-1))


@pytest.mark.skipif(not backends.flex_available()[0], reason="FlexAttention unavailable")
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("use_docs, use_pad", [(False, False), (True, True)],
                         ids=["plain", "docs-pad"])
@pytest.mark.parametrize("start, s, k_len", CASES[:2])
def test_flex_block_mask_is_the_same_rules(start, s, k_len, use_docs, use_pad, window):
    docs, pad = _inputs()
    docs, pad = (docs if use_docs else None), (pad if use_pad else None)
    plan = plan_of(start, s, k_len, causal=True, window=window, docs=docs, pad=pad)
    block_mask = backends.flex_block_mask(plan, batch=2, device="cpu")
    # Flex counts queries from 0; the block mask's mask_mod sees them at their cache slots
    idx = (torch.arange(2)[:, None, None, None], torch.zeros(1, 1, 1, 1, dtype=torch.long),
           torch.arange(s)[None, None, :, None], torch.arange(k_len)[None, None, None, :])
    got = block_mask.mask_mod(*idx).expand(2, 1, s, k_len)
    assert torch.equal(got, plan.allowed().expand(2, 1, s, k_len))


def test_a_bidirectional_plan_without_masks_masks_nothing():
    plan = plan_of(0, 5, 5, causal=False)
    assert plan.mask_rule() is None and plan.allowed() is None and plan.has_key() is None
    assert backends.flex_block_mask(plan) is None


def test_same_chunk_is_by_position_so_a_left_padded_row_chunks_from_its_first_token():
    from tutorial_pkg.attention.masks import AttentionPlan, same_chunk

    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]])  # row 1: 2 pads
    rule = same_chunk(pos, 3)
    q_idx, kv_idx = torch.arange(7)[:, None], torch.arange(7)[None, :]
    for b in range(2):
        want = (pos[b][:, None] // 3) == (pos[b][None, :] // 3)
        assert torch.equal(rule(b, 0, q_idx, kv_idx), want)
    pad = torch.tensor([[False] * 7, [True, True] + [False] * 5])
    plan = AttentionPlan(q_pos=pos, k_pos=pos, start=0, default_positions=False, causal=True,
                         key_padding_mask=pad, chunk=3)
    allowed = plan.allowed()[:, 0]
    # row 1's tokens at positions 0..4: chunks {0,1,2} and {3,4}, causal within them
    assert allowed[1, 6].tolist() == [False] * 5 + [True, True]
    assert allowed[1, 4].tolist() == [False, False, True, True, True, False, False]
    assert torch.equal(plan.has_key(), allowed.any(-1)[:, None, :, None])
