"""Tests of tutorial_pkg.diagnose.kv_cache_check: :func:`~tutorial_pkg.diagnose.check_kv_cache`
(token-by-token decoding against one full pass, with and without left padding) passes the
package's models and an attention layer, and catches a decoding loop whose positions are wrong;
through :class:`~tutorial_pkg.diagnose.TutorialAdapter` and
:class:`~tutorial_pkg.diagnose.HFAdapter` (Hugging Face's calling convention, old and current
names, on toy models written here); bad input is refused naming the argument.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import tutorial_pkg as tp
from tutorial_pkg import diagnose as dg
from tutorial_pkg.models.tiny_lm import TinyLM


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


# --------------------------------------------------------------------------- bad input
def test_check_kv_cache_bad_input_names_the_argument(ids, learned_lm):
    cases = [
        (TypeError, "model", lambda: dg.TutorialAdapter(3)),
        (TypeError, "n_pad", lambda: dg.check_kv_cache(learned_lm, ids, n_pad=True)),
        (ValueError, "convention", lambda: dg.check_kv_cache(learned_lm, ids, convention="x")),
        (ValueError, "n_pad", lambda: dg.check_kv_cache(learned_lm, ids, n_pad=10)),
        (ValueError, "prefill", lambda: dg.check_kv_cache(learned_lm, ids, prefill=11)),
        (TypeError, "inputs", lambda: dg.check_kv_cache(learned_lm, [1, 2])),
    ]
    for err, name, call in cases:
        with pytest.raises(err, match=name):
            call()
