"""A new encoding, written here alone, runs everywhere: the hooks are the whole contract.

``LogDistanceBias`` (a Kerple-style logarithmic bias, ``-m_h log(1 + |i - j|)``) is
defined in this file only, registered in ``ENCODINGS``, and must work through
``make_encoding`` (that dispatch is tested in test_registry.py, with these classes),
``MultiHeadAttention`` on every backend, the KV cache, ``TinyLM`` and the experiments, with no
change under ``tutorial_pkg/``.
"""

from __future__ import annotations

import pytest
import torch

from tutorial_pkg import (
    ENCODINGS,
    MultiHeadAttention,
    PositionEncoding,
    alibi_slopes,
    backends,
)
from tutorial_pkg.experiments.training import ExperimentConfig, evaluate, train
from tutorial_pkg.models.tiny_lm import TinyLM

from .test_positions import BACKENDS  # every backend; flex where FlexAttention exists

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex backend falls back to sdpa"),
    pytest.mark.usefixtures("one_thread"),
]


class LogDistanceBias(PositionEncoding):
    """``-m_h log(1 + |i - j|)`` added to the scores: a bias without a key-only form."""

    name = "log_distance"

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def bias(self, q_pos, k_pos):
        distance = (q_pos[..., :, None] - k_pos[..., None, :]).abs().float()
        return -self.slopes[:, None, None] * torch.log1p(distance)[..., None, :, :]

    def score_mod(self, q_offset=0, q_pos=None, k_pos=None):
        slopes = self.slopes
        if q_pos is None:

            def score_mod(score, b, h, q_idx, kv_idx):
                return score - slopes[h] * torch.log1p((q_idx + q_offset - kv_idx).abs().float())

        else:

            def score_mod(score, b, h, q_idx, kv_idx):
                distance = (q_pos[b, q_idx] - k_pos[b, kv_idx]).abs().float()
                return score - slopes[h] * torch.log1p(distance)

        return score_mod


class SwitchableBias(LogDistanceBias):
    """A bias hook that may return None (the documented contract): then no bias at all."""

    name = "switchable"

    def __init__(self, n_heads: int, on: bool = False) -> None:
        super().__init__(n_heads)
        self.on = on

    def bias(self, q_pos, k_pos):
        return super().bias(q_pos, k_pos) if self.on else None

    def score_mod(self, q_offset=0, q_pos=None, k_pos=None):
        return super().score_mod(q_offset, q_pos, k_pos) if self.on else None


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(ENCODINGS, "log_distance", LogDistanceBias)
    monkeypatch.setitem(ENCODINGS, "switchable", SwitchableBias)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_new_encoding_runs_on_every_backend_with_the_kv_cache(registered, backend):
    torch.manual_seed(0)
    model = TinyLM("log_distance", d_model=32, n_heads=4, n_layers=2, backend=backend).eval()
    naive = TinyLM("log_distance", d_model=32, n_heads=4, n_layers=2, backend="naive").eval()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        want = naive(ids)
        full = model(ids)
        caches = model.new_caches()
        steps = torch.cat([model(ids[:, a:b], caches=caches)
                           for a, b in ((0, 4), (4, 5), (5, 9))], dim=1)
    torch.testing.assert_close(full, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps, want, rtol=1e-4, atol=1e-4)
    # the bias matters: without it the logits differ
    nope = TinyLM("nope", d_model=32, n_heads=4, n_layers=2, backend="naive").eval()
    with torch.no_grad():
        assert (nope(ids) - want).abs().max() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bias_hook_returning_none_means_no_bias(registered, backend):
    torch.manual_seed(0)
    off = MultiHeadAttention(32, 4, SwitchableBias(4, on=False), backend=backend,
                             compile_flex=False)
    nope = MultiHeadAttention(32, 4, backend="naive")
    nope.load_state_dict(off.state_dict())
    x = torch.randn(2, 7, 32)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, :2] = True
    with torch.no_grad():
        for mask in (None, pad):
            torch.testing.assert_close(off(x, key_padding_mask=mask),
                                       nope(x, key_padding_mask=mask), rtol=1e-4, atol=1e-5)


def test_a_new_encoding_trains_and_evaluates_in_the_experiments(registered):
    cfg = ExperimentConfig(d_model=32, n_layers=1, n_heads=2, train_len=16, steps=3,
                           batch_size=4, warmup=1, eval_multiples=(1, 2), eval_tokens=256,
                           eval_batch_tokens=128, device="cpu")
    ids = torch.randint(0, 256, (5000,))
    model, losses = train("log_distance", cfg, ids, progress=False)
    assert type(model.encoding) is LogDistanceBias and len(losses) == 3
    records = evaluate(model, ids[:2000], cfg.train_len, cfg.eval_multiples,
                       eval_tokens=cfg.eval_tokens, batch_tokens=cfg.eval_batch_tokens)
    assert [r["encoding"] for r in records] == ["log_distance"] * 2
    assert all(r["ppl_all"] > 1 for r in records)


class BiasOnly(LogDistanceBias):
    """Only the bias hook: Flex cannot apply it, so it must not silently drop it."""

    name = "bias_only"
    score_mod = PositionEncoding.score_mod


@pytest.mark.skipif(not backends.flex_available()[0], reason="FlexAttention unavailable")
def test_flex_falls_back_for_an_encoding_without_score_mod():
    torch.manual_seed(0)
    flex = MultiHeadAttention(32, 4, BiasOnly(4), backend="flex", compile_flex=False)
    naive = MultiHeadAttention(32, 4, BiasOnly(4), backend="naive")
    naive.load_state_dict(flex.state_dict())
    x = torch.randn(2, 7, 32)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="no score_mod"):
        got = flex(x)
    with torch.no_grad():
        torch.testing.assert_close(got, naive(x), rtol=1e-4, atol=1e-5)
