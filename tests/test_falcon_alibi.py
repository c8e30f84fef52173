"""transformers' Falcon with ``alibi=True``: the eager path adds the ALiBi bias twice.

Chapter 9's bug 18, found by the package's probes. In transformers 5 ``FalconModel.forward``
folds the bias (divided by ``sqrt(head_dim)``) into the causal mask, which the SDPA path hands
to the kernel as it is: the bias once, as TII's ``modelling_RW.py`` and transformers 4 apply
it, ``softmax((q k^T + alibi) / sqrt(d) + causal mask)``. The eager path of
``FalconAttention`` (``attn_implementation="eager"``, or any call with
``output_attentions=True``) adds ``alibi`` to the scores again before the scale and then adds
that mask: the bias twice.

These tests document the library as installed. ``test_the_eager_path_adds_the_bias_twice``
fails the day transformers fixes the eager path; chapter 9's section must then say so (the
other tests, the SDPA path and the workaround, keep holding).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tutorial_pkg import diagnose

transformers = pytest.importorskip("transformers")

H, D = 4, 16  # heads, head_dim


def _falcon():
    config = transformers.FalconConfig(vocab_size=64, hidden_size=H * D, num_hidden_layers=2,
                                       num_attention_heads=H, alibi=True, bias=False,
                                       pad_token_id=None, bos_token_id=None,
                                       eos_token_id=None)
    torch.manual_seed(0)
    return transformers.FalconForCausalLM(config).eval()


IDS = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))


def _blind(model):
    """A copy whose queries and keys are zero (multi_query: H query heads, one key head), so
    that every score is the bias alone and log(weights) reads it up to a constant per row."""
    blind = copy.deepcopy(model)
    for layer in blind.transformer.h:
        layer.self_attention.query_key_value.weight.data[: (H + 1) * D] = 0
    return blind


def _eager_reading(model):
    with torch.no_grad():
        weights = model(IDS, output_attentions=True).attentions[0][0]  # [H, L, L]
    return diagnose.probe_alibi(weights.log() * math.sqrt(D), H)


def _alibi_once(module, args, kwargs):
    return args, {**kwargs, "alibi": torch.zeros_like(kwargs["alibi"])}


def test_the_sdpa_path_adds_the_bias_once():
    """The float mask SDPA gets holds Press et al.'s slopes / sqrt(head_dim), once."""
    model = _falcon()
    with torch.no_grad(), diagnose.record_sdpa_masks() as calls:
        model(IDS)
    assert len(calls.calls) == 2  # one per layer
    report = diagnose.probe_alibi(calls.masks[0][0] * math.sqrt(D), H)
    assert report.ok, str(report)


def test_the_eager_path_adds_the_bias_twice():
    """The bug, as transformers 5.24 has it: the eager weights carry twice Press et al.'s
    slopes, and asking for the weights changes the logits (more than the 1e-3 of the
    transformers test that the two paths agree)."""
    model = _falcon()
    report = _eager_reading(_blind(model))
    assert not report.ok
    assert all(abs(s / r - 2) < 1e-3 for s, r in zip(report.slopes, report.reference,
                                                         strict=True))
    with torch.no_grad():
        sdpa, eager = model(IDS).logits, model(IDS, output_attentions=True).logits
    assert (eager - sdpa).abs().max() > 1e-2 * sdpa.abs().max()


def test_a_pre_hook_that_zeroes_alibi_makes_eager_equal_sdpa():
    """The workaround chapter 9 shows: the mask already holds the bias, so the eager path
    given a zero ``alibi`` adds it once, and equals the SDPA path."""
    model = _falcon()
    blind = _blind(model)
    with torch.no_grad():
        sdpa = model(IDS).logits
    hooks = [layer.self_attention.register_forward_pre_hook(_alibi_once, with_kwargs=True)
             for m in (model, blind) for layer in m.transformer.h]
    try:
        with torch.no_grad():
            eager = model(IDS, output_attentions=True).logits
        report = _eager_reading(blind)
    finally:
        for hook in hooks:
            hook.remove()
    assert report.ok, str(report)
    torch.testing.assert_close(eager, sdpa, rtol=0, atol=1e-5)
