"""Bad input fails early, with ValueError/TypeError naming the argument.

Each case is ``(id, exception, argument name the message must contain, call)``.
"""

from __future__ import annotations

import pytest
import torch

from tutorial_pkg import (
    ALiBi,
    Hybrid,
    KVCache,
    Learned,
    MultiHeadAttention,
    Rotary,
    RotaryEmbedding,
    TransformerBlock,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    half_to_interleaved,
    interleaved_to_half,
    inv_freq,
    make_encoding,
    sinusoidal_table,
)
from tutorial_pkg.encodings.alibi import alibi_score_mod
from tutorial_pkg.encodings.rope import (
    apply_rope_complex,
    interleaved_to_half_permutation,
    precompute_freqs_cis,
    rope_angles,
)
from tutorial_pkg.encodings.rope_scaling import scaled_inv_freq
from tutorial_pkg.encodings.sinusoidal import SinusoidalPositionalEmbedding

D, H = 16, 4
X = torch.zeros(2, 5, D)


def mha(**kw):
    return MultiHeadAttention(D, H, **kw)


def grow_cache(n_kv_heads):
    """Append keys with another head count to a cache holding 2 heads."""
    cache = KVCache()
    k = torch.zeros(1, 2, 1, 4)
    cache.update(k, k, torch.arange(1))
    k = torch.zeros(1, n_kv_heads, 1, 4)
    cache.update(k, k, torch.tensor([1]))


def rot_x(head_dim=8, s=3):
    return torch.zeros(1, 2, s, head_dim)


CASES = [
    # ----------------------------------------------------------------- sizes
    ("n_heads_zero", ValueError, "n_heads", lambda: MultiHeadAttention(D, 0)),
    ("n_heads_bool", TypeError, "n_heads", lambda: MultiHeadAttention(D, True)),
    ("d_model_not_divisible", ValueError, "n_heads", lambda: MultiHeadAttention(18, 4)),
    ("d_model_float", TypeError, "d_model", lambda: MultiHeadAttention(16.0, 4)),
    ("n_kv_heads_not_dividing", ValueError, "n_kv_heads", lambda: mha(n_kv_heads=3)),
    ("n_kv_heads_zero", ValueError, "n_kv_heads", lambda: mha(n_kv_heads=0)),
    ("d_ff_zero", ValueError, "d_ff", lambda: TransformerBlock(D, H, d_ff=0)),
    ("alibi_n_heads_zero", ValueError, "n_heads", lambda: alibi_slopes(0)),
    ("learned_max_positions_zero", ValueError, "max_positions", lambda: Learned(D, 0)),
    # ----------------------------------------------------------------- RoPE
    ("rope_odd_head_dim", ValueError, "head_dim", lambda: RotaryEmbedding(7)),
    ("rope_odd_rotary_dim", ValueError, "rotary_dim", lambda: RotaryEmbedding(8, rotary_dim=3)),
    ("rope_rotary_dim_too_big", ValueError, "rotary_dim",
     lambda: RotaryEmbedding(8, rotary_dim=16)),
    ("permutation_rotary_dim_too_big", ValueError, "rotary_dim",
     lambda: interleaved_to_half_permutation(8, rotary_dim=10)),
    ("rope_base_zero", ValueError, "base", lambda: RotaryEmbedding(8, base=0)),
    ("inv_freq_base_negative", ValueError, "base", lambda: inv_freq(8, base=-10000.0)),
    ("inv_freq_base_nan", ValueError, "base", lambda: inv_freq(8, base=float("nan"))),
    ("rope_layout", ValueError, "layout", lambda: RotaryEmbedding(8, layout="meta")),
    ("apply_rope_layout", ValueError, "layout",
     lambda: apply_rope(rot_x(), torch.ones(3, 4), torch.zeros(3, 4), layout="complex")),
    ("apply_rope_integer_x", TypeError, "x",
     lambda: apply_rope(rot_x().long(), torch.ones(3, 4), torch.zeros(3, 4))),
    ("rope_max_position_zero", ValueError, "max_positions",
     lambda: RotaryEmbedding(8, max_positions=0)),
    ("rope_past_max_positions", ValueError, "max_positions",
     lambda: RotaryEmbedding(8, max_positions=16).rotate(rot_x(s=1), torch.tensor([16]))),
    ("rope_x_head_dim", ValueError, "head_dim",
     lambda: RotaryEmbedding(8).rotate(rot_x(head_dim=6), torch.arange(3))),
    ("rope_q_k_head_dim_mismatch", ValueError, "head_dim",
     lambda: Rotary(8).rotate(rot_x(), rot_x(head_dim=6), torch.arange(3), torch.arange(3))),
    ("rope_integer_x", TypeError, "x",
     lambda: RotaryEmbedding(8).rotate(rot_x().int(), torch.arange(3))),
    ("rope_positions_wrong_length", ValueError, "positions",
     lambda: RotaryEmbedding(8).rotate(rot_x(), torch.arange(4))),
    ("rope_negative_start", ValueError, "start",
     lambda: RotaryEmbedding(8).cos_sin(start=-1, length=2)),
    ("freqs_cis_end_zero", ValueError, "end", lambda: precompute_freqs_cis(8, 0)),
    # ----------------------------------------------------------------- scaling
    ("scaling_unknown_type", ValueError, "scaling",
     lambda: scaled_inv_freq(8, scaling={"type": "dynamic", "factor": 2})),
    ("scaling_not_a_dict", TypeError, "scaling", lambda: RotaryEmbedding(8, scaling="linear")),
    ("scaling_without_type", TypeError, "scaling",
     lambda: scaled_inv_freq(8, scaling={"factor": 2})),
    ("scaling_factor_zero", ValueError, "factor",
     lambda: scaled_inv_freq(8, scaling={"type": "linear", "factor": 0})),
    ("scaling_factor_missing", ValueError, "factor",
     lambda: scaled_inv_freq(8, scaling={"type": "ntk"})),
    ("scaling_unknown_param", ValueError, "scaling",
     lambda: scaled_inv_freq(8, scaling={"type": "linear", "factor": 2, "alpha": 1})),
    ("yarn_missing_original", ValueError, "original_max_position_embeddings",
     lambda: scaled_inv_freq(8, scaling={"type": "yarn", "factor": 4})),
    ("yarn_original_zero", ValueError, "original_max_position_embeddings",
     lambda: scaled_inv_freq(8, scaling={"type": "yarn", "factor": 4,
                                         "original_max_position_embeddings": 0})),
    ("ntk_dim_two", ValueError, "dim", lambda: scaled_inv_freq(2, scaling={"type": "ntk",
                                                                          "factor": 2})),
    # ----------------------------------------------------------------- converters
    ("converter_weight_not_tensor", TypeError, "weight",
     lambda: interleaved_to_half([[1.0, 2.0]], 1)),
    ("converter_rows_not_divisible", ValueError, "n_heads",
     lambda: half_to_interleaved(torch.zeros(10, 4), 4)),
    ("converter_n_heads_zero", ValueError, "n_heads",
     lambda: interleaved_to_half(torch.zeros(8, 4), 0)),
    # ----------------------------------------------------------------- sinusoidal / learned
    ("sinusoidal_odd_dim", ValueError, "dim", lambda: sinusoidal_table(4, 7)),
    ("sinusoidal_module_odd_dim", ValueError, "dim", lambda: SinusoidalPositionalEmbedding(9)),
    ("sinusoidal_x_width", ValueError, "dim", lambda: SinusoidalPositionalEmbedding(8)(X)),
    ("sinusoidal_float_positions", TypeError, "positions",
     lambda: sinusoidal_table(torch.tensor([0.0, 1.0]), 8)),
    ("sinusoidal_2d_positions", ValueError, "positions",
     lambda: sinusoidal_table(torch.zeros(2, 2, dtype=torch.long), 8)),
    ("learned_past_max_positions", ValueError, "max_positions",
     lambda: Learned(D, 4).embed(X, torch.arange(5))),
    # ----------------------------------------------------------------- ALiBi / hybrid
    ("alibi_mode", ValueError, "mode", lambda: ALiBi(4, mode="bidirectional")),
    ("alibi_bias_mode", ValueError, "mode", lambda: alibi_bias(4, 5, mode="both")),
    ("alibi_slopes_type", TypeError, "slopes", lambda: alibi_bias("8", 5)),
    ("alibi_negative_q_pos", ValueError, "q_pos", lambda: alibi_bias(4, -3)),
    ("alibi_float_k_pos", TypeError, "k_pos", lambda: alibi_bias(4, 3, torch.ones(3))),
    ("score_mod_negative_offset", ValueError, "q_offset",
     lambda: alibi_score_mod(alibi_slopes(4), q_offset=-1)),
    ("hybrid_alpha_above_one", ValueError, "alpha",
     lambda: Hybrid(8, 4, mix="alpha", alpha=1.5)),
    ("hybrid_alpha_negative", ValueError, "alpha", lambda: Hybrid(8, 4, alpha=-0.1)),
    ("hybrid_mix", ValueError, "mix", lambda: Hybrid(8, 4, mix="multiply")),
    # ----------------------------------------------------------------- registry
    ("unknown_encoding_name", ValueError, "name", lambda: make_encoding("sinusoids", d_model=D)),
    ("make_encoding_missing_max_positions", ValueError, "max_positions",
     lambda: make_encoding("learned", d_model=D)),
    ("make_encoding_missing_head_dim", ValueError, "head_dim", lambda: make_encoding("rope")),
    ("make_encoding_not_divisible", ValueError, "n_heads",
     lambda: make_encoding("hybrid", d_model=18, n_heads=4)),
    # ----------------------------------------------------------------- attention construction
    ("unknown_backend", ValueError, "backend", lambda: mha(backend="flash")),
    ("dropout_one", ValueError, "dropout", lambda: mha(dropout=1.0)),
    ("dropout_negative", ValueError, "dropout", lambda: mha(dropout=-0.1)),
    ("encoding_not_an_encoding", TypeError, "encoding", lambda: mha(encoding="rope")),
    ("encoding_head_count_mismatch", ValueError, "n_heads", lambda: mha(encoding=ALiBi(8))),
    ("encoding_head_dim_mismatch", ValueError, "head_dim", lambda: mha(encoding=Rotary(8))),
    # ----------------------------------------------------------------- attention forward
    ("integer_x", TypeError, "x", lambda: mha()(X.long())),
    ("x_two_dims", ValueError, "x", lambda: mha()(X[0])),
    ("x_wrong_width", ValueError, "d_model", lambda: mha()(torch.zeros(2, 5, 8))),
    ("padding_mask_shape", ValueError, "key_padding_mask",
     lambda: mha()(X, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))),
    ("padding_mask_float", TypeError, "key_padding_mask",
     lambda: mha()(X, key_padding_mask=torch.zeros(2, 5))),
    ("negative_positions", ValueError, "positions",
     lambda: mha()(X, positions=torch.tensor([-1, 0, 1, 2, 3]))),
    ("positions_wrong_length", ValueError, "positions",
     lambda: mha()(X, positions=torch.arange(4))),
    ("positions_float", TypeError, "positions",
     lambda: mha()(X, positions=torch.arange(5.0))),
    ("positions_past_rope_max_positions", ValueError, "max_positions",
     lambda: mha(encoding=Rotary(4, max_positions=8))(X, positions=torch.arange(6, 11))),
    ("kv_cache_head_mismatch", ValueError, "kv_cache", lambda: grow_cache(n_kv_heads=3)),
    # ------------------------------------------- the review's escapes (issue 12)
    ("yarn_base_one", ValueError, "base",
     lambda: scaled_inv_freq(8, 1.0, {"type": "yarn", "factor": 2,
                                      "original_max_position_embeddings": 16})),
    ("rope_angles_list_inv_freq", TypeError, "inv_freq", lambda: rope_angles(4, [1.0, 0.5])),
    ("apply_rope_cos_too_short", ValueError, "cos",
     lambda: apply_rope(rot_x(s=3), torch.ones(2, 4), torch.zeros(2, 4))),
    ("apply_rope_cos_sin_differ", ValueError, "sin",
     lambda: apply_rope(rot_x(s=3), torch.ones(3, 4), torch.zeros(3, 2))),
    ("apply_rope_cos_too_wide", ValueError, "cos",
     lambda: apply_rope(rot_x(s=3), torch.ones(3, 8), torch.zeros(3, 8))),
    ("apply_rope_complex_odd_dim", ValueError, "even d",
     lambda: apply_rope_complex(torch.zeros(1, 3, 5), precompute_freqs_cis(4, 3))),
    ("apply_rope_complex_short_table", ValueError, "freqs_cis",
     lambda: apply_rope_complex(torch.zeros(1, 5, 8), precompute_freqs_cis(8, 3))),
    ("kv_cache_not_a_cache", TypeError, "kv_cache", lambda: mha()(X, kv_cache=[])),
    ("tinylm_token_256", ValueError, "ids", lambda: tiny_lm()(torch.tensor([[1, 256]]))),
    ("tinylm_token_negative", ValueError, "ids", lambda: tiny_lm()(torch.tensor([[-1, 2]]))),
    ("tinylm_caches_wrong_length", ValueError, "caches",
     lambda: tiny_lm()(torch.tensor([[1, 2]]), caches=[KVCache()])),
    ("yarn_attention_factor_string", TypeError, "attention_factor",
     lambda: scaled_inv_freq(8, 10000.0, {"type": "yarn", "factor": 2,
                                           "original_max_position_embeddings": 16,
                                           "attention_factor": "1.2"})),
    ("yarn_attention_factor_negative", ValueError, "attention_factor",
     lambda: scaled_inv_freq(8, 10000.0, {"type": "yarn", "factor": 2,
                                           "original_max_position_embeddings": 16,
                                           "attention_factor": -1.0})),
    ("yarn_beta_fast_below_slow", ValueError, "beta_fast",
     lambda: scaled_inv_freq(8, 10000.0, {"type": "yarn", "factor": 2,
                                           "original_max_position_embeddings": 16,
                                           "beta_fast": 1.0, "beta_slow": 2.0})),
    ("sinusoidal_negative_offset", ValueError, "offset",
     lambda: SinusoidalPositionalEmbedding(D)(X, offset=-1)),
    ("positions_wrong_batch", ValueError, "positions",
     lambda: mha()(X, positions=torch.zeros(3, 5, dtype=torch.long))),
    ("rope_batched_positions_for_3d_x", ValueError, "positions",
     lambda: RotaryEmbedding(8).rotate(torch.zeros(2, 5, 8), torch.zeros(1, 5).long())),
    ("document_ids_float", TypeError, "document_ids",
     lambda: mha()(X, document_ids=torch.zeros(2, 5))),
]


def tiny_lm():
    from tutorial_pkg.models.tiny_lm import TinyLM

    return TinyLM("alibi", d_model=16, n_heads=2, n_layers=2)


@pytest.mark.parametrize("exc, name, call", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument_raises_naming_it(exc, name, call):
    with pytest.raises(exc, match=name):
        call()

