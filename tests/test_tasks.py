"""Tests of tutorial_pkg.experiments.tasks: chapter 6's synthetic tasks and the half-slope
control."""

from __future__ import annotations

import pytest
import torch

from tutorial_pkg.encodings.builtin import Hybrid
from tutorial_pkg.experiments.tasks import task_batch, train_task


def test_task_batches_and_half_slope_hybrid():
    g = torch.Generator().manual_seed(0)
    x, y = task_batch("offset", 4, 20, g)
    assert x.shape == y.shape == (4, 20)
    assert (y[:, :3] == -100).all() and torch.equal(y[:, 3:], x[:, :-3])
    x, y = task_batch("latest", 64, 50, g)
    signal = x < 8
    assert (y[signal] == -100).all()
    b, i = 5, 40  # the target is the latest signal before position i
    if y[b, i] != -100:
        last = max(j for j in range(i) if signal[b, j])
        assert y[b, i] == x[b, last]
    assert ((y == -100) | (y < 8)).all()
    with pytest.raises(ValueError, match="task"):
        task_batch("copy", 4, 20, g)
    half = Hybrid(8, 4, bias_scale=0.5)  # chapter 6's control
    full = Hybrid(8, 4)
    torch.testing.assert_close(half.effective_slopes(), 0.5 * full.effective_slopes())
    # the articles' alpha-mix = the half-slope hybrid with queries scaled by alpha
    alpha = Hybrid(8, 4, mix="alpha", alpha=0.5)
    pos = torch.arange(6)
    torch.testing.assert_close(alpha.bias(pos, pos), half.bias(pos, pos))


def test_train_task_is_deterministic():
    a, _ = train_task("offset", "rope", 0, steps=3, eval_lens=(8, 16), train_len=8)
    b, _ = train_task("offset", "rope", 0, steps=3, eval_lens=(8, 16), train_len=8)
    assert a == b and set(a) == {8, 16} and all(0 <= v <= 1 for v in a.values())


def test_bad_task_inputs_raise():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="offset"):
        task_batch("offset", 2, 3, g, offset=3)
    with pytest.raises(ValueError, match="n_signal"):
        task_batch("latest", 2, 8, g, n_signal=32)
    with pytest.raises(ValueError, match="p_signal"):
        task_batch("latest", 2, 8, g, p_signal=1.0)
    with pytest.raises(TypeError, match="p_signal"):
        task_batch("latest", 2, 8, g, p_signal="0.1")
    with pytest.raises(TypeError, match="generator"):
        task_batch("offset", 2, 8, 0)
    with pytest.raises(ValueError, match="seed"):
        train_task("offset", "rope", -1, steps=1)


def test_test_batches_evaluate_and_ablations():
    from tutorial_pkg.experiments.tasks import (
        evaluate_task,
        far_attention,
        test_batches,
        with_encoding,
    )

    acc, model = train_task("offset", "hybrid", 0, steps=3, eval_lens=(8, 16), train_len=8,
                            test_seed=7)
    batches = test_batches("offset", 7, (8, 16))
    scores = evaluate_task(model, batches)
    assert {n: r["accuracy"] for n, r in scores.items()} == acc  # the same test sequences
    assert all(r["se"] >= 0 for r in scores.values())
    assert not torch.equal(batches[16][0], test_batches("offset", 8, (8, 16))[16][0])
    same = with_encoding(model, "hybrid")
    assert evaluate_task(same, batches) == scores  # same weights, same encoding: same model
    no_bias = with_encoding(model, "rope")
    x = batches[16][0]
    assert not torch.equal(no_bias(x), model(x))
    far = far_attention(model, x, 8)
    assert 0 <= far <= 1
    windowed = with_encoding(model, "hybrid", window=8)
    assert far_attention(windowed, x, 8) == 0.0  # a window of 8 hides every key 8 back


def test_param_groups_seam():
    """One group is the default; a group of its own trains a weight at its own lr (0 freezes
    it) after the callable changed it in place; a non-callable is refused."""
    kw = dict(steps=3, eval_lens=(32,), eval_batch=4)
    base_acc, base = train_task("latest", "rope", 1, **kw)
    same_acc, same = train_task("latest", "rope", 1, param_groups=lambda m: m.parameters(), **kw)
    assert base_acc == same_acc
    assert all(torch.equal(a, b) for a, b in zip(base.parameters(), same.parameters(), strict=True))

    start = {}

    def frozen_q(model):
        w = model.blocks[0].attn.q_proj.weight
        with torch.no_grad():
            w.mul_(0.5)
        start["w"] = w.detach().clone()
        return [{"params": [p for p in model.parameters() if p is not w]},
                {"params": [w], "lr": 0.0}]

    _, model = train_task("latest", "rope", 1, param_groups=frozen_q, **kw)
    assert torch.equal(model.blocks[0].attn.q_proj.weight, start["w"])
    with pytest.raises(TypeError, match="param_groups"):
        train_task("latest", "rope", 1, param_groups=[], **kw)


def test_evaluate_task_from_position_counts_only_later_targets():
    from tutorial_pkg.experiments.tasks import IGNORE, evaluate_task, test_batches
    _, model = train_task("offset", "rope", 2, steps=2, eval_lens=(32,), eval_batch=4)
    batches = test_batches("offset", 7, (16, 48), batch=6)
    whole = evaluate_task(model, batches)
    assert evaluate_task(model, batches, from_position=0) == whole
    past = evaluate_task(model, batches, from_position=16)
    assert set(past) == {48}  # a length with no position past 16 is left out
    x, y = batches[48]
    with torch.no_grad():
        pred = model(x).argmax(-1)
    has = (y != IGNORE) & (torch.arange(48) >= 16)
    assert past[48]["accuracy"] == ((pred == y) & has).sum().item() / has.sum().item()
    with pytest.raises((TypeError, ValueError), match="from_position"):
        evaluate_task(model, batches, from_position=-1)
