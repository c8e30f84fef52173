"""Tests of tutorial_pkg.experiments.retrieval: the copy test and its control."""

from __future__ import annotations

import pytest
import torch

from tutorial_pkg.experiments.data import load_splits
from tutorial_pkg.experiments.retrieval import copy_distances, retrieval_test
from tutorial_pkg.experiments.training import ExperimentConfig, train
from tutorial_pkg.models.tiny_lm import TinyLM

TINY = ExperimentConfig(
    d_model=32, n_layers=1, n_heads=2, train_len=16, steps=20, batch_size=8, lr=1e-2,
    warmup=5, eval_multiples=(1, 2), eval_tokens=512, eval_batch_tokens=256, device="cpu",
)


@pytest.fixture(scope="module")
def ids():
    train_ids, heldout_ids = load_splits()
    return train_ids[:100_000], heldout_ids[:20_000]


@pytest.fixture(scope="module")
def models(ids):
    return {name: train(name, TINY, ids[0], progress=False)[0] for name in ("rope", "learned")}


class _Oracle(TinyLM):
    """A 'model' that predicts token t+1 = the token after the same token's earlier copy."""

    def __init__(self, distance):
        super().__init__("nope", d_model=8, n_layers=1, n_heads=1)
        self.distance = distance

    def forward(self, ids, **kwargs):
        logits = torch.zeros(*ids.shape, 256)
        d = self.distance
        # at position i >= d the copy predicts ids[i - d + 1]
        nxt = torch.zeros_like(ids)
        nxt[:, d:] = ids[:, 1 : ids.shape[1] - d + 1]
        logits.scatter_(-1, nxt[..., None], 30.0)
        return logits


def test_retrieval_test_measures_copying(ids):
    heldout = ids[1]
    d, s = 40, 8
    perfect = retrieval_test(_Oracle(d), heldout, [d], segment_len=s, n_trials=8)[0]
    assert perfect["nll_copy"] < 1e-6 and perfect["acc_copy"] == 1.0
    assert perfect["acc_control"] < 0.5 and perfect["gain"] > 5
    assert perfect["window_len"] == d + s and perfect["note"] == ""
    # a model that copies from another distance gains nothing at d
    other = retrieval_test(_Oracle(d + 3), heldout, [d], segment_len=s, n_trials=8)[0]
    assert abs(other["gain"]) < 1.0 and other["acc_copy"] < 0.5


def test_retrieval_test_fixed_window(ids, models):
    heldout = ids[1]
    d, s, n = 40, 8, 100
    fixed = retrieval_test(_Oracle(d), heldout, [d], segment_len=s, n_trials=8, window_len=n)[0]
    assert fixed["window_len"] == n and fixed["first_position"] == n - d - s
    assert fixed["acc_copy"] == 1.0 and fixed["gain"] > 5  # the copy is found at the end
    # the default window is d + s, and window_len = d + s gives the same records
    model = models["rope"]
    default = retrieval_test(model, heldout, [8, 24], segment_len=4, n_trials=4)
    same = retrieval_test(model, heldout, [8], segment_len=4, n_trials=4, window_len=12)
    assert default[0] == same[0] and default[0]["first_position"] == 0
    with pytest.raises(ValueError, match="window_len"):
        retrieval_test(model, heldout, [8, 24], segment_len=4, window_len=20)


def test_retrieval_test_deterministic_and_limits(models, ids):
    model = models["rope"]
    a = retrieval_test(model, ids[1], [8, 24], segment_len=4, n_trials=4)
    b = retrieval_test(model, ids[1], [8, 24], segment_len=4, n_trials=4)
    assert a == b and [r["distance"] for r in a] == [8, 24]
    learned = retrieval_test(models["learned"], ids[1], [8, 24], segment_len=4,
                                         n_trials=4)
    assert learned[0]["gain"] is not None  # window 12 <= 16 positions
    assert learned[1]["gain"] is None and "cannot represent" in learned[1]["note"]
    with pytest.raises(ValueError, match="distances"):
        retrieval_test(model, ids[1], [2], segment_len=4)
    with pytest.raises(ValueError, match="segment_len"):
        retrieval_test(model, ids[1], [8], segment_len=1)
    with pytest.raises(TypeError, match="model"):
        retrieval_test("rope", ids[1], [8])
    with pytest.raises(ValueError, match="heldout_ids"):
        retrieval_test(model, ids[1][:20], [16], segment_len=4)
    assert copy_distances(64) == (32, 128, 256, 496)


def test_retrieval_test_restores_mode_and_refuses_bad_input(models, ids):
    model = models["rope"]
    model.train()
    retrieval_test(model, ids[1], [8], segment_len=4, n_trials=2)
    assert model.training
    model.eval()
    with pytest.raises(TypeError, match="heldout_ids"):
        retrieval_test(model, ids[1][None], [8], segment_len=4)
    with pytest.raises(TypeError, match="distances"):
        retrieval_test(model, ids[1], 8, segment_len=4)
    with pytest.raises(ValueError, match="seed"):
        retrieval_test(model, ids[1], [8], segment_len=4, seed=-1)
    with pytest.raises(ValueError, match="segment_len"):
        copy_distances(64, 0)
