"""The Hugging Face model families that tests/test_hf_oracle.py holds the package to.

One :class:`Family` per model family: its config class, tiny sizes, its rotary
embedding class and how its own code applies the rotation (``apply``), so that the
test can ask transformers itself for the rotated queries and keys and for the
cos/sin tables it multiplies them by. Nothing here imports transformers at import
time: :func:`modeling` imports ``transformers.models.<module>.modeling_<module>`` when
a test asks for it, and skips that test (with the reason) where the installed
transformers has no such family.

Conventions read from transformers 5.24's sources (``modeling_<family>.py``):

============  ===============================================================================
``apply``     what the family's code does
============  ===============================================================================
``half``      ``cos, sin = rotary_emb(x, position_ids)``, ``[b, s, r]`` with duplicated halves
              (``cat(freqs, freqs)``); ``apply_rotary_pos_emb(q, k, cos, sin)`` on
              ``[b, h, s, d]`` (``rotate_half``); partial rotary inside (Phi-3, GPT-NeoX)
``gemma4``    as ``half`` but ``rotary_emb(x, position_ids, layer_type)`` and
              ``apply_rotary_pos_emb(x, cos, sin)`` one tensor at a time
``gemma3``    as ``half`` with ``rotary_emb(x, position_ids, layer_type)``
``deepseek``  tables as ``half``; ``apply_rotary_pos_emb_interleave`` when
              ``config.rope_interleave`` (adjacent pairs in, *de-interleaved* features out:
              evens' results first, odds' second)
``gpt_oss``   ``cos, sin`` ``[b, s, r/2]`` (no duplication); first/second half pairs
``gptj``      ``sin, cos = rotary_emb(x, position_ids)`` ``[b, s, r/2]``; ``[b, s, h, d]``
              tensors, ``rotate_every_two`` (adjacent pairs) on the first ``rotary_dim``
``llama4``    ``freqs_cis = rotary_emb(x, position_ids)``, complex ``[b, s, d/2]``;
              ``apply_rotary_emb(xq, xk, freqs_cis)`` on ``[b, s, h, d]``, adjacent pairs
              (``view_as_complex``), computed in float32
============  ===============================================================================
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

#: Sizes every tiny config shares (vocabulary 32, one layer), and no special tokens (the
#: families' default ids lie outside a 32-token vocabulary).
TINY = {"vocab_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}


@dataclasses.dataclass(frozen=True)
class Family:
    """A Hugging Face model family, as the oracle tests need it.

    Attributes:
        name: the family's name in test ids.
        module: ``transformers.models.<module>``.
        config: config class name (in ``transformers``).
        rotary: rotary embedding class name in ``modeling_<module>``, or None.
        apply: how the family applies RoPE (see the module docs).
        kwargs: tiny config keyword arguments.
    """

    name: str
    module: str
    config: str
    rotary: str | None
    apply: str
    kwargs: dict

    def make_config(self, **overrides):
        """The tiny config (``overrides`` on top of :attr:`kwargs`)."""
        transformers = pytest.importorskip("transformers")
        modeling(self)  # skips when this transformers has no such family
        cls = getattr(transformers, self.config, None)
        if cls is None:
            pytest.skip(f"transformers {transformers.__version__} has no {self.config}")
        return cls(**{**self.kwargs, **overrides})


def modeling(family: Family):
    """``transformers.models.<module>.modeling_<module>``, or skip the test with the reason."""
    pytest.importorskip("transformers")
    name = f"transformers.models.{family.module}.modeling_{family.module}"
    try:
        return importlib.import_module(name)
    except ImportError as err:
        pytest.skip(f"the installed transformers has no {family.name} ({name}: {err})")


def rotary_module(family: Family, config):
    """A fresh instance of the family's rotary embedding (its state starts at the config)."""
    return getattr(modeling(family), family.rotary)(config)


_GQA = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}

LLAMA = Family("llama", "llama", "LlamaConfig", "LlamaRotaryEmbedding", "half",
               {**TINY, **_GQA, "max_position_embeddings": 16})
LLAMA4 = Family("llama4", "llama4", "Llama4TextConfig", "Llama4TextRotaryEmbedding", "llama4",
                {**TINY, **_GQA, "head_dim": 16, "intermediate_size_mlp": 64,
                 "num_local_experts": 2, "num_experts_per_tok": 1,
                 "max_position_embeddings": 16, "num_hidden_layers": 4})
QWEN2 = Family("qwen2", "qwen2", "Qwen2Config", "Qwen2RotaryEmbedding", "half",
               {**TINY, **_GQA, "max_position_embeddings": 16})
QWEN3 = Family("qwen3", "qwen3", "Qwen3Config", "Qwen3RotaryEmbedding", "half",
               {**TINY, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "max_position_embeddings": 16})
GEMMA3 = Family("gemma3", "gemma3", "Gemma3TextConfig", "Gemma3RotaryEmbedding", "gemma3",
                {**TINY, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 4,
                 "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
                 "rope_parameters": {
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "linear", "factor": 8.0,
                                        "rope_theta": 1_000_000.0}}})
#: Gemma 2: a soft-capping cap small enough that tanh bends the tiny model's scores.
GEMMA2 = Family("gemma2", "gemma2", "Gemma2Config", "Gemma2RotaryEmbedding", "half",
                {**TINY, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 4,
                 "attn_logit_softcapping": 0.5, "num_hidden_layers": 1,
                 "layer_types": ["full_attention"]})
GEMMA4 = Family("gemma4", "gemma4", "Gemma4TextConfig", "Gemma4TextRotaryEmbedding", "gemma4",
                {**TINY, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "global_head_dim": 32, "sliding_window": 4,
                 "vocab_size_per_layer_input": 32, "hidden_size_per_layer_input": 8,
                 "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]})
#: LongRoPE factors for 8 pairs (head_dim 16): short ones near 1, long ones growing.
SHORT_FACTOR = [1.0, 1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.6]
LONG_FACTOR = [1.0, 1.3, 1.8, 2.5, 3.6, 5.0, 7.0, 9.0]
PHI3 = Family("phi3", "phi3", "Phi3Config", "Phi3RotaryEmbedding", "half",
              {**TINY, **_GQA, "max_position_embeddings": 64,
               "original_max_position_embeddings": 16,
               "rope_parameters": {"rope_type": "longrope", "rope_theta": 10_000.0,
                                   "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR}})
#: Phi-4-mini: partial_rotary_factor 0.75 with LongRoPE (here 12 of 16 features, 6 pairs).
PHI4_MINI = Family("phi4_mini", "phi3", "Phi3Config", "Phi3RotaryEmbedding", "half",
                   {**TINY, **_GQA, "max_position_embeddings": 64,
                    "original_max_position_embeddings": 16, "partial_rotary_factor": 0.75,
                    "rope_parameters": {"rope_type": "longrope", "rope_theta": 10_000.0,
                                        "partial_rotary_factor": 0.75,
                                        "short_factor": SHORT_FACTOR[:6],
                                        "long_factor": LONG_FACTOR[:6]}})
GPT_NEOX = Family("gpt_neox", "gpt_neox", "GPTNeoXConfig", "GPTNeoXRotaryEmbedding", "half",
                  {**TINY, "hidden_size": 64, "num_attention_heads": 4,
                   "max_position_embeddings": 64, "rotary_pct": 0.25})
GPTJ = Family("gptj", "gptj", "GPTJConfig", "GPTJRotaryEmbedding", "gptj",
              {"vocab_size": 32, "n_embd": 64, "n_head": 4, "n_layer": 1, "n_inner": 64,
               "n_positions": 64, "rotary_dim": 8, "bos_token_id": None, "eos_token_id": None})
_DEEPSEEK_TINY = {**TINY, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
                  "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                  "kv_lora_rank": 16, "q_lora_rank": 16, "moe_intermediate_size": 16,
                  "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                  "first_k_dense_replace": 1, "max_position_embeddings": 64}
DEEPSEEK_V3 = Family("deepseek_v3", "deepseek_v3", "DeepseekV3Config",
                     "DeepseekV3RotaryEmbedding", "deepseek", _DEEPSEEK_TINY)
GPT_OSS = Family("gpt_oss", "gpt_oss", "GptOssConfig", "GptOssRotaryEmbedding", "gpt_oss",
                 {**TINY, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16, "num_local_experts": 2, "num_experts_per_tok": 1,
                  "sliding_window": 4, "num_hidden_layers": 2})
MISTRAL = Family("mistral", "mistral", "MistralConfig", "MistralRotaryEmbedding", "half",
                 {**TINY, **_GQA, "head_dim": 16, "sliding_window": 4,
                  "max_position_embeddings": 64})
SMOLLM3 = Family("smollm3", "smollm3", "SmolLM3Config", "SmolLM3RotaryEmbedding", "half",
                 {**TINY, **_GQA, "num_hidden_layers": 4, "max_position_embeddings": 64})
#: A family the loader neither loads nor refuses by name (its "unknown family" case).
OLMO2 = Family("olmo2", "olmo2", "Olmo2Config", "Olmo2RotaryEmbedding", "half",
               {**TINY, **_GQA, "max_position_embeddings": 16})
BLOOM = Family("bloom", "bloom", "BloomConfig", None, "alibi",
               {"vocab_size": 32, "hidden_size": 48, "n_head": 6, "n_layer": 1})
MPT = Family("mpt", "mpt", "MptConfig", None, "alibi",
             {"vocab_size": 32, "d_model": 48, "n_heads": 6, "n_layers": 1, "max_seq_len": 16,
              "expansion_ratio": 2})
FALCON = Family("falcon", "falcon", "FalconConfig", None, "alibi",
                {"vocab_size": 32, "hidden_size": 48, "num_attention_heads": 6,
                 "num_hidden_layers": 1, "alibi": True, "new_decoder_architecture": False,
                 "multi_query": False, "parallel_attn": False, "bias": True})
T5 = Family("t5", "t5", "T5Config", None, "t5",
            {"vocab_size": 32, "d_model": 32, "d_kv": 8, "num_heads": 4, "d_ff": 64,
             "num_layers": 1, "num_decoder_layers": 1, "relative_attention_num_buckets": 32,
             "relative_attention_max_distance": 128, "dropout_rate": 0.0})


# --------------------------------------------------------------------------- RoPE
def hf_tables(family: Family, rotary, x: torch.Tensor, positions: torch.Tensor,
              layer_type: str | None = None):
    """transformers' own ``cos, sin`` for ``positions [b, s]``, as the family returns them.

    Returns ``(raw, cos, sin)``: ``raw`` what the rotary module returned (a tuple, or
    Llama 4's complex ``freqs_cis``), and ``cos``/``sin`` ``[b, s, r/2]`` in the
    package's layout (one column per pair, attention factor included). For the
    duplicated ``[b, s, r]`` layout the halves are checked to be equal first.
    """
    if family.apply in ("gemma3", "gemma4"):
        raw = rotary(x, positions, layer_type)
    else:
        raw = rotary(x, positions)
    if family.apply == "llama4":
        return raw, raw.real.double(), raw.imag.double()
    if family.apply == "gptj":
        sin, cos = raw
        return raw, cos.double(), sin.double()
    cos, sin = raw
    if family.apply == "gpt_oss":
        return raw, cos.double(), sin.double()
    half = cos.shape[-1] // 2
    for t in (cos, sin):  # the duplicated layout: cat(freqs, freqs)
        assert torch.equal(t[..., :half], t[..., half:])
    return raw, cos[..., :half].double(), sin[..., :half].double()


def hf_attention_factor(family: Family, rotary, layer_type: str | None = None) -> float:
    """The factor transformers multiplies cos and sin by (YaRN, LongRoPE), 1 for the rest."""
    if family.apply == "gptj":
        return 1.0
    if family.apply in ("gemma3", "gemma4"):
        return float(getattr(rotary, f"{layer_type}_attention_scaling"))
    return float(rotary.attention_scaling)


def hf_rotate(family: Family, config, raw, q: torch.Tensor, k: torch.Tensor):
    """Rotate ``q, k`` ``[b, h, s, d]`` with the family's own apply function and tables.

    Returns ``(q_rot, k_rot)`` as ``[b, h, s, d]``, in the feature order the family's
    code produces (DeepSeek's interleaved path returns de-interleaved features; scores
    ``q_rot @ k_rot^T`` do not see a common permutation).
    """
    mod = modeling(family)
    if family.apply == "gemma4":
        cos, sin = raw
        return mod.apply_rotary_pos_emb(q, cos, sin), mod.apply_rotary_pos_emb(k, cos, sin)
    if family.apply == "deepseek":
        cos, sin = raw
        fn = mod.apply_rotary_pos_emb_interleave if config.rope_interleave else (
            mod.apply_rotary_pos_emb)
        return fn(q, k, cos, sin)
    if family.apply == "llama4":
        qr, kr = mod.apply_rotary_emb(q.transpose(1, 2), k.transpose(1, 2), raw)
        return qr.transpose(1, 2), kr.transpose(1, 2)
    if family.apply == "gptj":  # GPTJAttention.forward: rotate the first rotary_dim features
        sin, cos = raw
        r = config.rotary_dim
        out = []
        for t in (q, k):
            t = t.transpose(1, 2)  # GPT-J's [b, s, h, d]
            rot = mod.apply_rotary_pos_emb(t[..., :r], sin, cos)
            out.append(torch.cat((rot, t[..., r:]), dim=-1).transpose(1, 2))
        return tuple(out)
    cos, sin = raw
    return mod.apply_rotary_pos_emb(q, k, cos, sin)
