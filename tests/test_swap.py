"""A whole Hugging Face model run by the package's attention (tutorial_pkg.models.swap),
held to transformers' own classes: tiny random Llama, Qwen3 and Mistral models built from
configs (nothing downloaded), left-padded batches, greedy ``generate`` through the KV
cache, and a RoPE scaling rule set through the package against the config's own.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tutorial_pkg.models.swap import PackageAttention, set_rope_scaling, swap_attention

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

SIZES = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 10000.0}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),
}


def _model(name: str, **overrides):
    config_cls, model_cls, extra = FAMILIES[name]
    config = getattr(transformers, config_cls)(**{**SIZES, **extra, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).eval()


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, 9), generator=gen)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    ids[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("name", list(FAMILIES))
def test_swapped_model_logits_equal_hugging_face_on_a_left_padded_batch(name):
    hf = _model(name)
    ours = swap_attention(copy.deepcopy(hf))
    assert sum(isinstance(m, PackageAttention) for m in ours.modules()) == 2
    ids, mask = _batch()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_swapped_model_generates_the_same_tokens_through_the_kv_cache(name):
    hf = _model(name)
    ours = swap_attention(copy.deepcopy(hf))
    ids, mask = _batch()
    kw = {"attention_mask": mask, "max_new_tokens": 32, "do_sample": False,
          "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        want = hf.generate(ids, **kw)
        got = ours.generate(ids, **kw)
        again = ours.generate(ids, **kw)  # a new cache: the layers forget the old one
    assert got.shape == (2, 9 + 32)
    assert torch.equal(got, want) and torch.equal(again, want)


@pytest.mark.parametrize("rule", [{"rope_type": "linear", "factor": 4.0},
                                  {"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 64}],
                         ids=["linear", "yarn"])
def test_a_scaling_rule_set_through_the_package_equals_the_configs(rule):
    scaled = _model("llama", rope_parameters={"rope_theta": 10000.0, **rule})
    ours = swap_attention(_model("llama"))  # the same seed: the same weights, no rule
    torch.testing.assert_close(ours.lm_head.weight, scaled.lm_head.weight, rtol=0, atol=0)
    ids, mask = _batch()
    with torch.no_grad():
        before = ours(ids, attention_mask=mask).logits
        set_rope_scaling(ours, {"type": rule["rope_type"], **{k: v for k, v in rule.items()
                                                              if k != "rope_type"}})
        got = ours(ids, attention_mask=mask).logits
        want = scaled(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)
    assert (before[real] - want[real]).abs().max() > 1e-3  # the rule changes the model


def test_swap_refuses_another_family_by_name():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=32)
    with pytest.raises(ValueError, match="got model_type 'gpt2'"):
        swap_attention(transformers.GPT2LMHeadModel(config))
    with pytest.raises(ValueError, match="call swap_attention"):
        set_rope_scaling(_model("llama"), None)


def test_a_cache_filled_elsewhere_is_refused():
    hf = _model("llama")
    ours = swap_attention(copy.deepcopy(hf))
    ids, mask = _batch()
    with torch.no_grad():
        cache = hf(ids, attention_mask=mask, use_cache=True).past_key_values
        with pytest.raises(ValueError, match="filled, cropped or reordered elsewhere"):
            ours(ids[:, -1:], past_key_values=cache, use_cache=True)


#: The 2025-26 families (tests/hf_families.py's tiny configs), each with its mechanism:
#: Gemma 2's soft-capping on a sliding and a global layer, gpt-oss's sinks and 4-token
#: windows, Llama 4's chunks of 4 with QK-norm and its NoPE layer's temperature tuning,
#: Gemma 4's two head sizes and proportional RoPE. Held to HF's eager attention in float32
#: (transformers' own float64 Gemma gives NaN rows on left padding).
MODERN = {
    "gemma2": ("GEMMA2", "Gemma2ForCausalLM",
               {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}),
    "gpt_oss": ("GPT_OSS", "GptOssForCausalLM", {"experts_implementation": "eager"}),
    "llama4_text": ("LLAMA4", "Llama4ForCausalLM",
                    {"attention_chunk_size": 4, "floor_scale": 3, "attn_scale": 0.5,
                     "experts_implementation": "eager"}),
    "gemma4_text": ("GEMMA4", "Gemma4ForCausalLM", {}),
}


def _modern(name: str):
    from tests import hf_families

    family, model_cls, overrides = MODERN[name]
    config = getattr(hf_families, family).make_config(**overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).eval()


@pytest.mark.parametrize("name", list(MODERN))
def test_modern_families_swapped_equal_hugging_face_logits_and_generate(name):
    """Logits on a left-padded batch, and 16 greedy tokens through HF's cache, whose
    sliding and chunked layers keep only the last window - 1 keys."""
    hf = _modern(name)
    ours = swap_attention(copy.deepcopy(hf), backend="naive")
    swapped = sum(isinstance(m, PackageAttention) for m in ours.modules())
    assert swapped == hf.config.num_hidden_layers
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, hf.config.vocab_size, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate passes
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask, position_ids=positions).logits
        kw = {"attention_mask": mask, "max_new_tokens": 16, "do_sample": False}
        want_ids, got_ids = hf.generate(ids, **kw), ours.generate(ids, **kw)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-6)
    assert got_ids.shape == (2, 12 + 16) and torch.equal(got_ids, want_ids)


def test_a_sliding_window_model_generates_the_same_tokens_past_its_window():
    """Mistral's window of 6 and 32 new tokens: HF's sliding cache layer returns only the
    keys inside the window, and the package's layer reads exactly those."""
    hf = _model("mistral")
    ours = swap_attention(copy.deepcopy(hf))
    ids, mask = _batch()
    kw = {"attention_mask": mask, "max_new_tokens": 32, "do_sample": False,
          "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))
