"""Tests of tutorial_pkg.experiments.context_eval: :func:`fixed_target_windows` cuts the held-out
text into windows that end with the same targets at every length,
:func:`evaluate_fixed_targets` scores only those targets and :func:`all_token_perplexity` every
token of non-overlapping windows, each equal to a cross-entropy computed here by hand from the
model's logits; RoPE scaling is applied for the evaluation only, and bad arguments are refused
naming them. A TinyLM of width 16 on 640 held-out tokens of the Shakespeare corpus
(:mod:`tutorial_pkg.experiments.data`): seconds, CPU only.

(The contracts relating these measures to ``training.evaluate`` are in test_experiments.py.)
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tutorial_pkg.experiments.context_eval import (
    all_token_perplexity,
    evaluate_fixed_targets,
    fixed_target_windows,
)
from tutorial_pkg.experiments.data import load_splits
from tutorial_pkg.models.tiny_lm import TinyLM

pytestmark = pytest.mark.usefixtures("one_thread")

N_TOKENS = 640


@pytest.fixture(scope="module")
def heldout() -> torch.Tensor:
    return load_splits()[1][:N_TOKENS].clone()


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return TinyLM("rope", d_model=16, n_layers=1, n_heads=2, seed=0)


def _block_starts(n_tokens: int, block_len: int, n_blocks: int) -> list[int]:
    """Where the ``n_blocks`` evenly spaced blocks of ``block_len`` tokens start: block
    ``j * W // n_blocks`` of the ``W = (n_tokens - 1) // block_len`` consecutive ones."""
    w = (n_tokens - 1) // block_len
    return [(j * w // n_blocks) * block_len for j in range(n_blocks)]


def _nll(model: TinyLM, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood, ``[rows, N]``, float64."""
    with torch.no_grad():
        logits = model(x)
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").double()


# --------------------------------------------------------------------------- fixed_target_windows
def test_fixed_target_windows_are_the_ends_of_evenly_spaced_blocks_of_the_text(heldout):
    w = fixed_target_windows(heldout, (8, 32), target_len=4, n_blocks=3)
    assert list(w) == [8, 32]
    starts = _block_starts(N_TOKENS, 32, 3)
    assert starts == [0, 192, 384]  # 19 blocks of 32 tokens fit; every 6th is kept
    for n, (x, y) in w.items():
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, n)
        for row, s in enumerate(starts):
            end = s + 32  # every window ends where its block ends
            assert torch.equal(x[row], heldout[end - n : end])
            assert torch.equal(y[row], heldout[end - n + 1 : end + 1])


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"lengths": (4, 16), "target_len": 8}, ValueError, "target_len"),
        ({"target_len": 0}, ValueError, "target_len"),
        ({"target_len": 2.5}, TypeError, "target_len"),
        ({"n_blocks": 0}, ValueError, "n_blocks"),
        ({"lengths": ()}, TypeError, "lengths"),
        ({"lengths": (16, -32)}, ValueError, "lengths"),
        ({"n_blocks": 40}, ValueError, "held-out text"),  # 19 blocks of 32 tokens at most
    ],
)
def test_fixed_target_windows_name_the_bad_argument(heldout, kwargs, exc, name):
    args = {"lengths": (16, 32), "target_len": 4, "n_blocks": 3, **kwargs}
    with pytest.raises(exc, match=name):
        fixed_target_windows(heldout, **args)


# --------------------------------------------------------------------------- evaluate_fixed_targets
def test_evaluate_fixed_targets_scores_the_last_targets_of_each_window_by_hand(heldout, model):
    model.train()  # the evaluation runs in eval mode and gives the previous mode back
    records = evaluate_fixed_targets(model, heldout, 16, (1, 2), n_blocks=3)
    assert model.training
    model.eval()
    starts = _block_starts(N_TOKENS, 32, 3)
    for rec, n in zip(records, (16, 32), strict=True):
        t = 4  # the default target_len: train_len // 4
        assert (rec["eval_len"], rec["context_len"], rec["target_len"]) == (n, n - t, t)
        assert rec["n_blocks"] == 3 and rec["n_tokens"] == 3 * t and rec["note"] == ""
        x = torch.stack([heldout[s + 32 - n : s + 32] for s in starts])
        y = torch.stack([heldout[s + 33 - n : s + 33] for s in starts])
        per_block = _nll(model, x, y)[:, -t:].mean(dim=1)
        assert rec["nll_by_block"] == pytest.approx(per_block.tolist(), rel=1e-6)
        assert rec["nll"] == pytest.approx(per_block.mean().item(), rel=1e-6)
        assert rec["ppl"] == pytest.approx(math.exp(rec["nll"]), rel=1e-12)
        assert rec["ppl_low"] <= rec["ppl"] <= rec["ppl_high"]


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "name"),
    [
        ((16,), {"target_len": 32}, ValueError, "target_len"),
        ((0,), {}, ValueError, "train_len"),
        ((16, (1, 0)), {}, ValueError, "multiples"),
        ((16, (1,), "cubic"), {}, ValueError, "scaling"),
        ((16,), {"n_blocks": 0}, ValueError, "n_blocks"),
        ((16,), {"batch_tokens": 0}, ValueError, "batch_tokens"),
        ((16,), {"seed": -1}, ValueError, "seed"),
    ],
)
def test_evaluate_fixed_targets_names_the_bad_argument(heldout, model, args, kwargs, exc, name):
    with pytest.raises(exc, match=name):
        evaluate_fixed_targets(model, heldout, *args, **kwargs)


def test_scaling_needs_rope_and_is_undone_after_the_evaluation(heldout, model):
    nope = TinyLM("nope", d_model=16, n_layers=1, n_heads=2, seed=0)
    with pytest.raises(ValueError, match="scaling"):
        evaluate_fixed_targets(nope, heldout, 16, (1, 2), "linear", n_blocks=3)
    with pytest.raises(TypeError, match="model"):
        all_token_perplexity(nope.state_dict(), heldout, 16)
    plain = evaluate_fixed_targets(model, heldout, 16, (1, 2), n_blocks=3)
    scaled = evaluate_fixed_targets(model, heldout, 16, (1, 2), "linear", n_blocks=3)
    assert [r["factor"] for r in plain] == [None, None]
    assert [r["factor"] for r in scaled] == [1.0, 2.0] and scaled[1]["scaling"] == "linear"
    assert scaled[0]["nll"] == pytest.approx(plain[0]["nll"], rel=1e-9)  # factor 1: no change
    assert abs(scaled[1]["nll"] - plain[1]["nll"]) > 1e-6  # interpolated positions at 2 L
    assert model.encoding.scaling is None  # restored
    again = evaluate_fixed_targets(model, heldout, 16, (2,), n_blocks=3)
    assert again[0]["nll"] == pytest.approx(plain[1]["nll"], rel=1e-12)


# --------------------------------------------------------------------------- all_token_perplexity
def test_all_token_perplexity_scores_every_token_of_non_overlapping_windows(heldout, model):
    records = all_token_perplexity(model, heldout, 16, (1, 2), eval_tokens=128)
    starts = _block_starts(N_TOKENS, 32, 4)  # 128 tokens: 4 blocks of the longest length, 32
    blocks_x = torch.stack([heldout[s : s + 32] for s in starts])
    blocks_y = torch.stack([heldout[s + 1 : s + 33] for s in starts])
    for rec, n in zip(records, (16, 32), strict=True):
        assert (rec["eval_len"], rec["n_windows"], rec["n_tokens"]) == (n, 128 // n, 128)
        nll = _nll(model, blocks_x.reshape(-1, n), blocks_y.reshape(-1, n))  # cut, not slid
        assert rec["nll"] == pytest.approx(nll.mean().item(), rel=1e-6)
        assert rec["ppl"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-6)
        per_block = nll.reshape(4, 32).mean(dim=1)  # the unit every length shares
        assert rec["nll_by_block"] == pytest.approx(per_block.tolist(), rel=1e-6)
    assert records[0]["nll"] != pytest.approx(records[1]["nll"], rel=1e-6)  # context differs


def test_all_token_perplexity_leaves_out_lengths_past_the_position_limit(heldout):
    learned = TinyLM("learned", d_model=16, n_layers=1, n_heads=2, max_positions=16, seed=0)
    short, long = all_token_perplexity(learned, heldout, 16, (1, 2), eval_tokens=128)
    assert short["ppl"] is not None and short["n_windows"] == 8
    assert long["ppl"] is None and long["nll_by_block"] is None
    assert (long["n_windows"], long["n_tokens"]) == (0, 0)
    assert long["note"] == "cannot represent positions >= 16"
