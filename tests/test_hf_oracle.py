"""Hugging Face's own model classes as the oracle (DESIGN.md: "tiny random models from
configs are the oracle for every family a chapter names").

The package claims to follow the checkpoints' conventions; here transformers' own
code (tiny random configs, no download) computes what a real checkpoint would, and
the package must give the same numbers:

1. RoPE: ``RotaryEmbedding.from_config(config.to_dict(), layer_type=...)`` against
   the family's rotary embedding + apply function, on ``q . k`` scores (invariant to
   a common permutation of the features, e.g. DeepSeek's de-interleaved output, not
   to the pair layout), on the cos/sin tables and on the attention factor; lengths
   below and above the original one for the length-dependent rules.
2. ALiBi against BLOOM's, MPT's and Falcon's bias builders.
3. T5's buckets and bias against ``T5Attention``.
4. Attention layers with copied weights against the family's attention module, causal
   and left-padded, for every backend.
5. Known bugs, pinned by strict xfails.

Everything that works today is a plain test; what does not is a strict xfail whose
reason says what is missing, with ``raises=`` the exception it fails with today, so
that the fix turns it into an XPASS (a failure: remove the mark) and a fix that fails
differently is reported as a failure. Sizes are tiny and the arithmetic float64
(transformers computes its RoPE angles in float32 whatever the dtype, as the package
does, so table tolerances are float32-sized); every tolerance is stated where it is
used. Measured errors are recorded with ``record_property`` (``--junitxml`` shows them).
"""

from __future__ import annotations

import copy
import importlib
import math
import warnings

import pytest
import torch

import tutorial_pkg as tp
from tutorial_pkg import diagnose

from . import hf_families as F

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from torch.manual_seed(0) (tests that draw more reseed on the way)."""
    torch.manual_seed(0)


#: |score difference| allowed on q.k of unit-variance float64 q, k (head_dim <= 32, so
#: |score| <~ 20). Both sides take cos/sin from float32 angles; the package's frequencies
#: are float64 rounded once to float32, transformers' are float32 powers, so they may
#: differ by an ulp or two: up to position 47 that is ~1e-6 relative (measured <= 1.3e-5).
SCORE_TOL = 5e-5
#: |cos/sin difference| allowed (values <= 1.35 with an attention factor): float32 tables,
#: a few ulps of the angle at position <= 47 (measured <= 1.2e-6).
TABLE_TOL = 5e-6
#: attention outputs (float64 layers, values ~1): transformers' eager attention takes its
#: softmax in float32 and both sides use float32 RoPE tables (measured <= 3.6e-7).
OUT_TOL = 2e-6
BACKENDS = ("naive", "sdpa", "auto")


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _padding(s: int, n_pad: int = 3) -> torch.Tensor:
    """``[2, s]`` bool, True = padding: row 0 unpadded, row 1 left-padded by ``n_pad``."""
    pad = torch.zeros(2, s, dtype=torch.bool)
    pad[1, :n_pad] = True
    return pad


# =========================================================================== 1. RoPE
def _rope(fam, overrides=None, layer_type=None, lengths=(12,), build="config", id=None):
    """A RoPE case: family, config overrides, layer type, lengths in turn, how we build ours."""
    return pytest.param(fam, overrides or {}, layer_type, lengths, build, id=id)


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
         "rope_theta": 10_000.0}
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
           "rope_theta": 10_000.0}
# original lengths of a few thousand tokens: YaRN's ramp then spans several of the 4-8 pairs
_DS_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10_000.0}

#: Qwen3-Next: partial_rotary_factor 0.25 (its class default) of head_dim 16, 4 features
#: rotated, in its full-attention layers (the others are linear attention, without RoPE).
QWEN3_NEXT = F.Family("qwen3_next", "qwen3_next", "Qwen3NextConfig", "Qwen3NextRotaryEmbedding",
                      "half", {**F.TINY, "hidden_size": 32, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 16,
                               "max_position_embeddings": 16,
                               "layer_types": ["full_attention"]})

ROPE_CASES = [
    _rope(F.LLAMA, id="llama-default"),
    _rope(F.LLAMA, {"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                        "rope_theta": 10_000.0}}, id="llama-linear"),
    # max_position_embeddings 16: below it, past it (the base grows), back between the
    # original and the largest length (the grown base stays), under it (reset)
    _rope(F.LLAMA, {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0,
                                        "rope_theta": 10_000.0}},
          lengths=(8, 40, 24, 8, 48), id="llama-dynamic"),
    _rope(F.LLAMA, {"rope_parameters": _YARN}, lengths=(12, 40), id="llama-yarn"),
    _rope(F.LLAMA, {"rope_parameters": _LLAMA3}, lengths=(12, 40), id="llama-llama3"),
    # Llama 4's checkpoints: llama3 with low_freq_factor == high_freq_factor (no band)
    _rope(F.LLAMA, {"rope_parameters": {**_LLAMA3, "factor": 16.0, "high_freq_factor": 1.0}},
          lengths=(12, 40), id="llama-llama3-equal-factors"),
    # Llama 4 rotates adjacent pairs; the layout given here (read from model_type below)
    _rope(F.LLAMA4, build="layout=interleaved", id="llama4-interleaved-given"),
    _rope(F.QWEN2, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 4096,
                                        "rope_theta": 1_000_000.0}},
          lengths=(12, 40), id="qwen2-yarn"),
    _rope(F.QWEN3, id="qwen3-head_dim16-hidden32"),
    _rope(F.GEMMA3, layer_type="sliding_attention", id="gemma3-sliding"),
    _rope(F.GEMMA3, layer_type="full_attention", id="gemma3-full-linear8"),
    _rope(F.GEMMA4, layer_type="sliding_attention", id="gemma4-sliding"),
    # the global layers' head_dim: global_head_dim in config.json (per_layer_config in to_dict)
    _rope(F.GEMMA4, layer_type="full_attention", build="gemma4 file",
          id="gemma4-full-proportional"),
    _rope(F.PHI3, lengths=(8, 40, 8, 16, 17), id="phi3-longrope"),
    _rope(F.PHI4_MINI, lengths=(8, 40, 8), id="phi4_mini-longrope-partial0.75"),
    _rope(F.GPT_NEOX, id="gpt_neox-rotary_pct0.25"),
    # GPT-J's config has no rope_theta (base 10000 is in its code; read from it below)
    _rope(F.GPTJ, build="gptj", id="gptj-rotary_dim8-interleaved"),
    _rope(F.DEEPSEEK_V3, id="deepseek_v3-interleave"),
    _rope(F.DEEPSEEK_V3, {"rope_interleave": False}, id="deepseek_v3-half"),
    _rope(F.DEEPSEEK_V3, {"rope_parameters": {**_DS_YARN, "mscale": 1.0, "mscale_all_dim": 1.0}},
          lengths=(12, 40), id="deepseek_v3-yarn-mscale1-all1"),
    _rope(F.DEEPSEEK_V3, {"rope_parameters": {**_DS_YARN, "mscale": 1.0,
                                              "mscale_all_dim": 0.707}},
          lengths=(12, 40), id="deepseek_v3-yarn-mscale1-all0.707"),
    _rope(F.GPT_OSS, lengths=(12, 40), id="gpt_oss-yarn32-truncate-false"),
    _rope(F.MISTRAL, id="mistral-default"),
    _rope(F.SMOLLM3, id="smollm3-default"),
    _rope(QWEN3_NEXT, id="qwen3_next-partial0.25"),
]


def _package_rope(build: str, config, layer_type):
    if build == "config":
        return tp.RotaryEmbedding.from_config(config.to_dict(), layer_type=layer_type)
    if build == "layout=interleaved":
        return tp.RotaryEmbedding.from_config(config.to_dict(), layer_type=layer_type,
                                              layout="interleaved")
    if build == "gemma4 file":  # config.json's form: global_head_dim, no per_layer_config
        file = {k: v for k, v in config.to_dict().items() if k != "per_layer_config"}
        file["global_head_dim"] = config.per_layer_config["full_attention"].head_dim
        return tp.RotaryEmbedding.from_config(file, layer_type=layer_type)
    if build == "gptj":  # create_sinusoidal_positions: base 10000, rotary_dim, adjacent pairs
        head_dim = config.n_embd // config.n_head
        return tp.RotaryEmbedding(head_dim, 10_000.0, rotary_dim=config.rotary_dim,
                                  layout="interleaved")
    raise AssertionError(build)


def _compare_rope(fam, config, rotary, rope, lengths, layer_type, record=None):
    """Scores, tables and attention factor of ``rope`` vs transformers' at each length in turn
    (the length-dependent rules keep state between calls, on both sides)."""
    worst = {"scores": 0.0, "tables": 0.0, "factor": 0.0}
    d = rope.head_dim
    for s in lengths:
        positions = tp.positions_from_padding(_padding(s))  # row 1 left-padded
        q = torch.randn(2, 2, s, d, dtype=torch.float64)
        k = torch.randn(2, 2, s, d, dtype=torch.float64)
        raw, cos, sin = F.hf_tables(fam, rotary, q, positions, layer_type)
        q_hf, k_hf = F.hf_rotate(fam, config, raw, q, k)
        q_rot, k_rot = rope(q, k, positions, positions)
        err = _max_err(q_rot @ k_rot.transpose(-1, -2), q_hf @ k_hf.transpose(-1, -2))
        assert err <= SCORE_TOL, f"length {s}: scores differ by {err:.3g}"
        assert 2 * cos.shape[-1] == rope.rotary_dim
        my_cos, my_sin = rope.cos_sin(torch.arange(s))
        t_err = max(_max_err(my_cos, cos[0]), _max_err(my_sin, sin[0]))
        assert t_err <= TABLE_TOL, f"length {s}: cos/sin differ by {t_err:.3g}"
        hf_factor = F.hf_attention_factor(fam, rotary, layer_type)
        assert rope.attention_factor == pytest.approx(hf_factor, rel=1e-12, abs=0)
        worst = {"scores": max(worst["scores"], err), "tables": max(worst["tables"], t_err),
                 "factor": max(worst["factor"], abs(rope.attention_factor - hf_factor))}
    if record is not None:
        for key, value in worst.items():
            record(f"max_err_{key}", f"{value:.3g}")
    return worst


@pytest.mark.parametrize(("fam", "overrides", "layer_type", "lengths", "build"), ROPE_CASES)
def test_rope_matches_hf(fam, overrides, layer_type, lengths, build, record_property):
    """Scores, cos/sin and attention factor equal the family's own, at every length."""
    torch.manual_seed(0)
    config = fam.make_config(**overrides)
    rotary = F.rotary_module(fam, config)
    rope = _package_rope(build, config, layer_type)
    _compare_rope(fam, config, rotary, rope, lengths, layer_type, record_property)


def test_rope_comparison_can_fail():
    """The comparison above catches a wrong layout, base, rotary_dim or scaling rule."""
    torch.manual_seed(0)
    config = F.LLAMA.make_config(rope_parameters=_YARN)
    good = tp.read_rope_config(config.to_dict()).kwargs()
    wrong = [{"layout": "interleaved"}, {"base": 10_100.0}, {"rotary_dim": 12},
             {"scaling": {**good["scaling"], "factor": 4.2}},
             {"scaling": {**good["scaling"], "truncate": False}},
             {"scaling": {**good["scaling"], "beta_slow": 2.0}}, {"scaling": None}]
    for change in wrong:
        rope = tp.RotaryEmbedding(**{**good, **change})
        with pytest.raises(AssertionError):
            _compare_rope(F.LLAMA, config, F.rotary_module(F.LLAMA, config), rope, (40,), None)


def test_llama4_layout_read_from_config():
    """Llama 4 rotates adjacent pairs (modeling_llama4.apply_rotary_emb: view_as_complex on
    pairs (2i, 2i+1)); its config has no rope_interleave: the layout comes from model_type."""
    torch.manual_seed(0)
    config = F.LLAMA4.make_config()
    assert tp.read_rope_config(config.to_dict()).layout == "interleaved"


def test_llama4_needs_the_interleaved_layout(record_property):
    """What reading the half layout would cost: Llama 4's RoPE with it gives other scores."""
    torch.manual_seed(0)
    config = F.LLAMA4.make_config()
    rope = tp.RotaryEmbedding.from_config(config.to_dict(), layout="half")
    rotary = F.rotary_module(F.LLAMA4, config)
    with pytest.raises(AssertionError, match="scores differ by") as err:
        _compare_rope(F.LLAMA4, config, rotary, rope, (12,), None)
    record_property("score_error_half_layout", str(err.value).split("by ")[1].split("\n")[0])


def test_gemma4_global_head_dim_read_from_config():
    """Gemma 4's global head_dim is kept in config.to_dict()'s per_layer_config; read for
    layer_type='full_attention' (transformers rotates 32 features there, 16 elsewhere)."""
    torch.manual_seed(0)
    config = F.GEMMA4.make_config()
    rope = tp.RotaryEmbedding.from_config(config.to_dict(), layer_type="full_attention")
    rotary = F.rotary_module(F.GEMMA4, config)
    assert rope.head_dim == config.per_layer_config["full_attention"].head_dim
    _compare_rope(F.GEMMA4, config, rotary, rope, (12,), "full_attention")


def test_gptj_read_from_config():
    """GPT-J's config has rotary_dim but no rope_theta: base 10000 and adjacent pairs from
    its code (model_type 'gptj')."""
    torch.manual_seed(0)
    config = F.GPTJ.make_config()
    rope = tp.RotaryEmbedding.from_config(config.to_dict())
    _compare_rope(F.GPTJ, config, F.rotary_module(F.GPTJ, config), rope, (12,), None)


def test_deepseek_softmax_scale_from_yarn_mscale():
    """DeepSeek's softmax scale ``mscale(factor, mscale_all_dim)**2 / sqrt(qk_head_dim)``
    from the package's :func:`yarn_mscale` (the rotary factor is tested above)."""
    config = F.DEEPSEEK_V3.make_config(rope_parameters={**_DS_YARN, "mscale": 1.0,
                                                        "mscale_all_dim": 0.707})
    attn = F.modeling(F.DEEPSEEK_V3).DeepseekV3Attention(config, layer_idx=0)
    rope = config.rope_parameters
    mscale = tp.encodings.rope_scaling.yarn_mscale(rope["factor"], rope["mscale_all_dim"])
    want = mscale**2 / math.sqrt(
        config.qk_nope_head_dim + config.qk_rope_head_dim)
    assert attn.scaling == pytest.approx(want, rel=1e-12)
    assert want != pytest.approx(config.qk_head_dim ** -0.5)  # the mscale matters here


# --------------------------------------------------------------------------- layer schedules
@pytest.mark.parametrize("fam", [F.LLAMA4, F.SMOLLM3], ids=lambda f: f.name)
def test_nope_layers_match_hf(fam):
    """NoPEEvery(every=no_rope_layer_interval) puts NoPE where the family's attention skips RoPE."""
    config = fam.make_config(num_hidden_layers=8)
    mod = F.modeling(fam)
    attn_cls = getattr(mod, "Llama4TextAttention" if fam is F.LLAMA4 else "SmolLM3Attention")
    schedule = tp.NoPEEvery(16, every=config.no_rope_layer_interval)
    ours = [not isinstance(schedule.layer(i)[0], tp.NoPE) for i in range(8)]
    assert ours == [bool(v) for v in config.no_rope_layers]
    assert ours == [bool(attn_cls(config, i).use_rope) for i in range(8)]
    assert ours.count(False) == 2


@pytest.mark.parametrize(("fam", "pattern", "attn_cls"), [
    (F.GEMMA3, 6, "Gemma3Attention"), (F.GEMMA4, 6, "Gemma4TextAttention"),
    (F.GPT_OSS, 2, "GptOssAttention"),
], ids=["gemma3", "gemma4", "gpt_oss"])
def test_local_global_layers_match_hf(fam, pattern, attn_cls):
    """LocalGlobal(pattern) puts the window where the family's attention layers have one, and
    (built from the config) gives each layer the RoPE of its layer type."""
    config = fam.make_config(num_hidden_layers=12, layer_types=None)
    n = config.num_hidden_layers
    if fam is F.GPT_OSS:  # one RoPE for both layer types
        rope_kw = {"local_base": config.rope_parameters["rope_theta"],
                   "global_base": config.rope_parameters["rope_theta"],
                   "global_scaling": tp.read_rope_config(config).scaling}
    else:
        local = tp.read_rope_config(config, layer_type="sliding_attention")
        glob = tp.read_rope_config(config, layer_type="full_attention")
        rope_kw = {"local_base": local.base, "global_base": glob.base,
                   "global_scaling": glob.scaling}
    schedule = tp.LocalGlobal(16, pattern=pattern, window=config.sliding_window,
                              **rope_kw)
    ours = [schedule.layer(i)[1] for i in range(n)]
    theirs = [getattr(F.modeling(fam), attn_cls)(config, i).sliding_window for i in range(n)]
    assert ours == theirs
    assert ours == [config.sliding_window if t == "sliding_attention" else None
                    for t in config.layer_types]
    assert ours.count(None) == n // pattern
    if fam is F.GEMMA3:  # the schedule's RoPE per layer = from_config of the layer's type
        for i, layer_type in enumerate(config.layer_types):
            want = tp.RotaryEmbedding.from_config(config, layer_type=layer_type)
            got = schedule.layer(i)[0].rope
            assert (got.base, got.scaling) == (want.base, want.scaling)
            assert torch.equal(got.inv_freq, want.inv_freq)


# =========================================================================== 2. ALiBi
@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 32, 40, 64])
def test_alibi_slopes_match_bloom_and_falcon(n_heads, record_property):
    """Slopes equal BLOOM's _get_alibi_slopes (its float32 powers: within 8 ulps) and
    Falcon's (the same, rounded to bfloat16)."""
    bloom = importlib.import_module("transformers.models.bloom.modeling_bloom")
    falcon = F.modeling(F.FALCON)
    ours = tp.alibi_slopes(n_heads)
    theirs = bloom._get_alibi_slopes(n_heads, torch.device("cpu"))
    assert theirs.shape == ours.shape
    err = float(((ours - theirs).abs() / theirs).max())
    record_property("max_rel_err", f"{err:.3g}")
    assert err <= 2.0**-20  # transformers' float32 powers: within 8 float32 ulps (5.5 seen)
    # Falcon: the same slopes, rounded to bfloat16 before the product
    ones = torch.ones(1, 2, dtype=torch.long)
    falcon_slopes = falcon.build_alibi_tensor(ones, n_heads, torch.float32)[:, 0, 1]
    assert torch.equal(falcon_slopes, ours.bfloat16().float())


def test_alibi_bias_matches_bloom_left_padded(record_property):
    """BLOOM's key-only bias (positions from its attention mask) = the package's key-only
    bias on positions_from_padding, and its softmax = the causal form's (shift invariance)."""
    torch.manual_seed(0)
    bloom = importlib.import_module("transformers.models.bloom.modeling_bloom")
    H, s = 6, 10
    pad = _padding(s)
    positions = tp.positions_from_padding(pad)
    theirs = bloom.build_alibi_tensor((~pad).long(), H, torch.float32).view(2, H, 1, s)
    ours = tp.alibi_bias(tp.alibi_slopes(H), positions, positions, mode="key_only")
    assert ours.shape == (2, H, 1, s)
    err = _max_err(ours, theirs)
    record_property("max_err_bias", f"{err:.3g}")
    assert err <= 1e-6
    # what attention does with it: the causal form + mask gives BLOOM's weights
    scores = torch.randn(2, H, s, s, dtype=torch.float64)
    allowed = torch.ones(s, s, dtype=torch.bool).tril() & ~pad[:, None, None, :]
    neg = torch.finfo(torch.float64).min

    def weights(bias):
        return (scores + bias.double()).masked_fill(~allowed, neg).softmax(-1)

    causal = tp.ALiBi(H).bias(positions, positions)
    real = ~pad  # query rows that are tokens
    w_err = _max_err(weights(causal)[real[:, None, :].expand(2, H, s)],
                     weights(theirs)[real[:, None, :].expand(2, H, s)])
    record_property("max_err_weights", f"{w_err:.3g}")
    assert w_err <= 1e-12


@pytest.mark.parametrize("n_heads", [4, 6, 8, 12, 16])
def test_alibi_matches_mpt(n_heads, record_property):
    """MPT's bias ``m (j - (L-1))`` is the last query row of the causal bias (its non-power-
    of-two slope order, odd then even slopes of 2^ceil heads, is Press et al.'s)."""
    mpt = F.modeling(F.MPT)
    L = 16
    theirs = mpt.build_mpt_alibi_tensor(n_heads, L)  # (H, 1, L)
    ours = tp.alibi_bias(tp.alibi_slopes(n_heads), L)[:, -1:, :]
    err = _max_err(ours, theirs)
    record_property("max_err", f"{err:.3g}")
    assert err <= 1e-6
    assert _max_err(tp.ALiBi(n_heads).bias(torch.arange(L), torch.arange(L))[:, -1:], theirs) \
        <= 1e-6


def test_alibi_matches_falcon_up_to_bfloat16(record_property):
    """Falcon builds the key-only bias with bfloat16 slopes and products: the package's
    float32 bias is within bfloat16 rounding of it, and equal where the slopes are powers
    of two (fewer than 16 heads, but for the extra slopes of 12)."""
    falcon = F.modeling(F.FALCON)
    s = 40
    pad = _padding(s)
    positions = tp.positions_from_padding(pad)
    for H in (6, 8, 12, 16):
        theirs = falcon.build_alibi_tensor((~pad).long(), H, torch.float32).view(2, H, 1, s)
        ours = tp.alibi_bias(tp.alibi_slopes(H), positions, positions, mode="key_only")
        rel = float(((ours - theirs).abs() / ours.abs().clamp_min(1e-30)).max())
        record_property(f"max_rel_err_H{H}", f"{rel:.3g}")
        assert rel <= 2.0**-8  # bfloat16: 8 significant bits
        if H in (6, 8):  # slopes 2^-1 .. 2^-8: exact in bfloat16, and so are the products
            assert rel == 0
        else:  # the rounding is really there (so the bound above is what is tested)
            assert rel > 0


# =========================================================================== 3. T5
@pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 64), (8, 20)])
def test_t5_bucket_matches_hf(bidirectional, num_buckets, max_distance):
    t5 = F.modeling(F.T5)
    rel = torch.arange(-300, 301)[None, :] + torch.arange(0, 3)[:, None]
    theirs = t5.T5Attention._relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    ours = tp.encodings.relative_bias.t5_relative_position_bucket(rel, bidirectional=bidirectional,
                                          num_buckets=num_buckets, max_distance=max_distance)
    assert torch.equal(ours, theirs.long())


def _t5_attention(is_decoder: bool):
    config = F.T5.make_config(is_decoder=is_decoder, attn_implementation="eager")
    t5 = F.modeling(F.T5)
    torch.manual_seed(0)
    attn = t5.T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    bias = tp.T5RelativeBias(config.num_heads, num_buckets=config.relative_attention_num_buckets,
                             max_distance=config.relative_attention_max_distance,
                             bidirectional=not is_decoder)
    with torch.no_grad():
        bias.relative_attention_bias.weight.copy_(attn.relative_attention_bias.weight)
    return config, attn.double().eval(), bias.double()


@pytest.mark.parametrize("is_decoder", [False, True], ids=["encoder", "decoder"])
def test_t5_bias_matches_compute_bias(is_decoder, record_property):
    """T5RelativeBias with T5's weights = compute_bias, past max_distance and with an offset."""
    _, attn, bias = _t5_attention(is_decoder)
    worst = 0.0
    for q_len, k_len, past in [(7, 7, 0), (1, 300, 299), (150, 300, 150), (300, 300, 0)]:
        with torch.no_grad():
            theirs = attn.compute_bias(q_len, k_len, past_seen_tokens=past)[0]
            ours = bias.bias(torch.arange(q_len) + past, torch.arange(k_len))
        assert ours.shape == theirs.shape
        worst = max(worst, _max_err(ours, theirs))
    record_property("max_err", f"{worst:.3g}")
    assert worst == 0.0  # a gather of the same weights


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_decoder", [False, True], ids=["encoder", "decoder"])
def test_t5_attention_matches_hf(is_decoder, backend, record_property):
    """A T5 self-attention layer: W_q times sqrt(d_kv) (T5 does not scale q.k), the bias
    weight as it is; the encoder with a padded row (T5's additive mask), the decoder causal."""
    config, attn, bias = _t5_attention(is_decoder)
    H, d_kv = config.num_heads, config.d_kv
    ours = tp.MultiHeadAttention(config.d_model, H, bias, causal=is_decoder,
                                 backend=backend).double()
    with torch.no_grad():
        ours.q_proj.weight.copy_(attn.q.weight * math.sqrt(d_kv))
        ours.k_proj.weight.copy_(attn.k.weight)
        ours.v_proj.weight.copy_(attn.v.weight)
        ours.out_proj.weight.copy_(attn.o.weight)
    s = 9
    torch.manual_seed(1)
    x = torch.randn(2, s, config.d_model, dtype=torch.float64)
    neg = torch.finfo(torch.float64).min
    if is_decoder:
        pad, kw = None, {}
        mask = torch.zeros(1, 1, s, s, dtype=torch.float64).masked_fill(
            ~torch.ones(s, s, dtype=torch.bool).tril(), neg)
    else:
        pad = _padding(s)
        kw = {"key_padding_mask": pad, "positions": tp.positions_from_padding(pad)}
        mask = torch.zeros(2, 1, 1, s, dtype=torch.float64).masked_fill(pad[:, None, None], neg)
    with torch.no_grad():
        theirs = attn(x, mask=mask)[0]
        out = ours(x, **kw)
    rows = torch.ones(2, s, dtype=torch.bool) if pad is None else ~pad
    err = _max_err(out[rows], theirs[rows])
    record_property("max_err", f"{err:.3g}")
    assert err <= 1e-10


# =========================================================================== 4. attention
def _randomize(module: torch.nn.Module, std: float = 0.15) -> None:
    """Weights large enough that attention is not uniform (HF initialises at std 0.02);
    norm weights (Qwen3's, Gemma's QK-norm) around 1."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, std)


def _capture(attn_module, run) -> dict:
    """Run ``run()`` and return the attention module's input and output."""
    seen = {}

    def pre(mod, args, kwargs):
        seen["x"] = args[0] if args else kwargs["hidden_states"]
        seen["residual"] = args[1] if len(args) > 1 else kwargs.get("residual")

    def post(mod, args, kwargs, out):
        seen["y"] = out[0] if isinstance(out, tuple) else out

    hooks = [attn_module.register_forward_pre_hook(pre, with_kwargs=True),
             attn_module.register_forward_hook(post, with_kwargs=True)]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def _hf_layer(fam, model_cls: str, attn_path: str, **overrides):
    """A one-layer float64 eager model of the family, its attention module randomised."""
    config = fam.make_config(attn_implementation="eager", **overrides)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).double().eval()
    attn = model.get_submodule(attn_path)
    _randomize(attn)
    return config, model, attn


def _run_hf(model, attn, s: int, padded: bool):
    """HF's attention input/output on random ids; causal, or row 1 left-padded by 3."""
    torch.manual_seed(2)
    ids = torch.randint(1, 32, (2, s))
    pad = _padding(s) if padded else torch.zeros(2, s, dtype=torch.bool)
    positions = tp.positions_from_padding(pad)
    kw = {"position_ids": positions}
    if padded:
        kw["attention_mask"] = (~pad).long()
    seen = _capture(attn, lambda: model(input_ids=ids, **kw))
    return seen, pad, positions


def _compare_attention(ours, seen, pad, positions, padded, record=None, post=None):
    x = seen["x"]
    kw = {"positions": positions}
    if padded:
        kw["key_padding_mask"] = pad
    with torch.no_grad():
        out = ours(x, **kw)
    if post is not None:
        out = post(out)
    real = ~pad
    err = _max_err(out[real], seen["y"][real])
    if record is not None:
        record("max_err", f"{err:.3g}")
    assert err <= OUT_TOL, f"attention outputs differ by {err:.3g}"
    return err


def _copy(dst: torch.nn.Linear, weight, bias=None) -> None:
    with torch.no_grad():
        dst.weight.copy_(weight)
        if bias is not None:
            dst.bias.copy_(bias)


def _llama_like(config, attn, backend, bias=False, window=None):
    """MultiHeadAttention with the q/k/v/o weights of a Llama-style attention module."""
    ours = tp.MultiHeadAttention(
        config.hidden_size, config.num_attention_heads,
        tp.Rotary(**tp.read_rope_config(config).kwargs()),
        n_kv_heads=config.num_key_value_heads, backend=backend, bias=bias, window=window,
    ).double()
    for name in ("q_proj", "k_proj", "v_proj"):
        src = getattr(attn, name)
        _copy(getattr(ours, name), src.weight, src.bias)
    _copy(ours.out_proj, attn.o_proj.weight, attn.o_proj.bias)
    if bias and attn.o_proj.bias is None:  # Qwen2: no o_proj bias, ours is one flag for four
        with torch.no_grad():
            ours.out_proj.bias.zero_()
    return ours


def _split_fused(weight, n_heads, head_dim):
    """Rows of a fused qkv projection -> (q, k, v) rows. BLOOM and Falcon view the output as
    [heads, 3, head_dim]; GPT-NeoX as [heads, 3 * head_dim] chunked in three: the same rows."""
    per = weight.reshape(n_heads, 3, head_dim, *weight.shape[1:])
    return tuple(per[:, i].reshape(n_heads * head_dim, *weight.shape[1:]) for i in range(3))


def _fused_like(config, attn, n_heads, encoding, backend):
    """MultiHeadAttention (biases on) with the weights of a fused-qkv attention module."""
    head_dim = config.hidden_size // n_heads
    ours = tp.MultiHeadAttention(config.hidden_size, n_heads, encoding, backend=backend,
                                 bias=True).double()
    ws = _split_fused(attn.query_key_value.weight, n_heads, head_dim)
    bs = _split_fused(attn.query_key_value.bias, n_heads, head_dim)
    for proj, w, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), ws, bs, strict=True):
        _copy(proj, w, b)
    _copy(ours.out_proj, attn.dense.weight, attn.dense.bias)
    return ours


def _build_llama(config, attn, backend):
    return _llama_like(config, attn, backend)


def _build_mistral(config, attn, backend):
    assert config.sliding_window == 4
    return _llama_like(config, attn, backend, window=config.sliding_window)


def _build_qwen2(config, attn, backend):
    # one bias flag for the four projections: bias=True and the o_proj bias set to zero
    # (test_qwen2_attention_per_projection_biases uses the per-projection flags)
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    return _llama_like(config, attn, backend, bias=True)


def _build_gpt_neox(config, attn, backend):
    encoding = tp.Rotary(**tp.read_rope_config(config).kwargs())
    assert encoding.rope.rotary_dim == 4  # rotary_pct 0.25 of head_dim 16
    return _fused_like(config, attn, config.num_attention_heads, encoding, backend)


def _build_bloom(config, attn, backend):
    return _fused_like(config, attn, config.n_head, tp.ALiBi(config.n_head), backend)


def _build_phi3(config, attn, backend):
    """Phi-3's qkv_proj: q rows, then k rows, then v rows (grouped-query)."""
    ours = tp.MultiHeadAttention(
        config.hidden_size, config.num_attention_heads,
        tp.Rotary(**tp.read_rope_config(config).kwargs()), n_kv_heads=config.num_key_value_heads,
        backend=backend).double()
    hd = config.hidden_size // config.num_attention_heads
    sizes = [config.num_attention_heads * hd] + 2 * [config.num_key_value_heads * hd]
    for proj, w in zip((ours.q_proj, ours.k_proj, ours.v_proj),
                       attn.qkv_proj.weight.split(sizes), strict=True):
        _copy(proj, w)
    _copy(ours.out_proj, attn.o_proj.weight)
    return ours


ATTENTION_FAMILIES = {
    # name: (family, model class, attention module, config overrides, builder, length)
    "llama-gqa": (F.LLAMA, "LlamaModel", "layers.0.self_attn", {}, _build_llama, 10),
    "llama-yarn": (F.LLAMA, "LlamaModel", "layers.0.self_attn", {"rope_parameters": _YARN},
                   _build_llama, 10),
    "mistral-window4": (F.MISTRAL, "MistralModel", "layers.0.self_attn", {}, _build_mistral, 10),
    "qwen2-bias-workaround": (F.QWEN2, "Qwen2Model", "layers.0.self_attn", {}, _build_qwen2, 10),
    "gpt_neox-partial": (F.GPT_NEOX, "GPTNeoXModel", "layers.0.attention", {}, _build_gpt_neox,
                         10),
    # LongRoPE at the layer: 20 tokens, past the original 16 (long factors, attention factor)
    "phi3-longrope-long": (F.PHI3, "Phi3Model", "layers.0.self_attn", {}, _build_phi3, 20),
    "phi4_mini-longrope-partial": (F.PHI4_MINI, "Phi3Model", "layers.0.self_attn", {},
                                   _build_phi3, 20),
    "bloom-alibi": (F.BLOOM, "BloomModel", "h.0.self_attention", {}, _build_bloom, 10),
}


def _residual_post(fam, seen):
    """BloomAttention returns dense(context) + residual: add it to ours."""
    if fam is not F.BLOOM:
        return None
    residual = seen["residual"]
    return lambda out: out + residual


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "left-padded"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(ATTENTION_FAMILIES))
def test_attention_matches_hf(name, backend, padded, record_property):
    """The family's attention layer (eager, float64) and MultiHeadAttention with its weights
    (Mistral: 10 tokens, longer than its window of 4)."""
    fam, model_cls, path, overrides, build, s = ATTENTION_FAMILIES[name]
    config, model, attn = _hf_layer(fam, model_cls, path, **overrides)
    ours = build(config, attn, backend)
    seen, pad, positions = _run_hf(model, attn, s, padded)
    _compare_attention(ours, seen, pad, positions, padded, record_property,
                       _residual_post(fam, seen))


def test_attention_comparison_can_fail():
    """The attention comparison catches a wrong window, pair layout or missing ALiBi."""
    config, model, attn = _hf_layer(F.MISTRAL, "MistralModel", "layers.0.self_attn")
    seen, pad, positions = _run_hf(model, attn, 10, True)
    wrong = [_llama_like(config, attn, "naive", window=None),
             _llama_like(config, attn, "naive", window=5),
             _llama_like(config, attn, "naive", window=3)]
    bad_layout = _llama_like(config, attn, "naive", window=4)
    bad_layout.encoding = tp.Rotary(**{**tp.read_rope_config(config).kwargs(),
                                       "layout": "interleaved"})
    wrong.append(bad_layout)
    for ours in wrong:
        with pytest.raises(AssertionError):
            _compare_attention(ours, seen, pad, positions, True)
    config, model, attn = _hf_layer(F.BLOOM, "BloomModel", "h.0.self_attention")
    seen, pad, positions = _run_hf(model, attn, 10, True)
    ours = _fused_like(config, attn, config.n_head, tp.NoPE(), "naive")
    with pytest.raises(AssertionError):
        _compare_attention(ours, seen, pad, positions, True, post=_residual_post(F.BLOOM, seen))


def _qk_norm_layer(fam, model_cls, layer_type=None):
    """A one-layer Qwen3 or Gemma 3 (of ``layer_type``) and its attention module.

    One layer: with left padding, a padded query row of Gemma 3's float64 eager attention is
    NaN, and in a second layer those NaN values would reach every row through v."""
    overrides = {} if layer_type is None else {"layer_types": [layer_type],
                                               "num_hidden_layers": 1}
    return _hf_layer(fam, model_cls, "layers.0.self_attn", **overrides)


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "left-padded"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("fam", "layer_type"), [
    (F.QWEN3, None), (F.GEMMA3, "sliding_attention"), (F.GEMMA3, "full_attention"),
], ids=["qwen3", "gemma3-sliding", "gemma3-full"])
def test_attention_core_with_qk_norm_matches_hf(fam, layer_type, backend, padded,
                                                 record_property):
    """Qwen3 and Gemma 3 through :meth:`MultiHeadAttention.attend`, the projections, QK-norm
    and (Gemma 3) the query_pre_attn_scalar scale done by hand with the family's modules:
    RoPE per layer type, head_dim != hidden / heads, GQA, Gemma's window and the masks."""
    model_cls = "Qwen3Model" if fam is F.QWEN3 else "Gemma3TextModel"
    config, model, attn = _qk_norm_layer(fam, model_cls, layer_type)
    H, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    assert d != config.hidden_size // H
    window = config.sliding_window if layer_type == "sliding_attention" else None
    if fam is F.GEMMA3:
        assert attn.sliding_window == window
    encoding = tp.Rotary(**tp.read_rope_config(config, layer_type=layer_type).kwargs())
    core = tp.MultiHeadAttention(H * d, H, encoding, n_kv_heads=kv, backend=backend,
                                 window=window).double()
    # the package scales q.k by 1/sqrt(head_dim); Gemma 3 by query_pre_attn_scalar**-0.5
    q_scale = 1.0 if fam is F.QWEN3 else math.sqrt(d) * config.query_pre_attn_scalar**-0.5
    s = 10
    seen, pad, positions = _run_hf(model, attn, s, padded)
    x = seen["x"]
    with torch.no_grad():
        q = attn.q_norm(attn.q_proj(x).view(2, s, H, d)).transpose(1, 2) * q_scale
        k = attn.k_norm(attn.k_proj(x).view(2, s, kv, d)).transpose(1, 2)
        v = attn.v_proj(x).view(2, s, kv, d).transpose(1, 2)
        heads = core.attend(q, k, v, positions=positions,
                            key_padding_mask=pad if padded else None)
        out = attn.o_proj(heads.transpose(1, 2).reshape(2, s, H * d))
    err = _max_err(out[~pad], seen["y"][~pad])
    record_property("max_err", f"{err:.3g}")
    assert err <= OUT_TOL


# ------------------------------------------------------------- head_dim, scale, biases, QK-norm
@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen2_attention_per_projection_biases(backend):
    config, model, attn = _hf_layer(F.QWEN2, "Qwen2Model", "layers.0.self_attn")
    ours = tp.MultiHeadAttention(
        config.hidden_size, config.num_attention_heads,
        tp.Rotary(**tp.read_rope_config(config).kwargs()), n_kv_heads=config.num_key_value_heads,
        backend=backend, q_bias=True, k_bias=True, v_bias=True, o_bias=False).double()
    assert ours.out_proj.bias is None and ours.q_proj.bias is not None
    assert sorted(ours.state_dict()) == sorted(
        k.replace("o_proj", "out_proj") for k in attn.state_dict())
    for n in ("q_proj", "k_proj", "v_proj"):
        _copy(getattr(ours, n), getattr(attn, n).weight, getattr(attn, n).bias)
    _copy(ours.out_proj, attn.o_proj.weight)
    seen, pad, positions = _run_hf(model, attn, 10, True)
    _compare_attention(ours, seen, pad, positions, True)


def _copy_llama_weights_and_compare(ours, model, attn):
    """Copy a Llama-style module's q/k/v/o weights (no biases) into ours, then compare the
    outputs on 10 tokens, causal and left-padded."""
    for n in ("q_proj", "k_proj", "v_proj"):
        _copy(getattr(ours, n), getattr(attn, n).weight)
    _copy(ours.out_proj, attn.o_proj.weight)
    seen, pad, positions = _run_hf(model, attn, 10, True)
    _compare_attention(ours, seen, pad, positions, True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_llama_attention_head_dim(backend):
    config, model, attn = _hf_layer(F.LLAMA, "LlamaModel", "layers.0.self_attn", head_dim=32)
    ours = tp.MultiHeadAttention(
        config.hidden_size, config.num_attention_heads,
        tp.Rotary(**tp.read_rope_config(config).kwargs()), n_kv_heads=config.num_key_value_heads,
        backend=backend, head_dim=config.head_dim).double()
    _copy_llama_weights_and_compare(ours, model, attn)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen3_attention_qk_norm(backend):
    config, model, attn = _qk_norm_layer(F.QWEN3, "Qwen3Model")
    ours = tp.MultiHeadAttention(
        config.hidden_size, config.num_attention_heads,
        tp.Rotary(**tp.read_rope_config(config).kwargs()), n_kv_heads=config.num_key_value_heads,
        backend=backend, head_dim=config.head_dim, q_norm=copy.deepcopy(attn.q_norm),
        k_norm=copy.deepcopy(attn.k_norm)).double()
    _copy_llama_weights_and_compare(ours, model, attn)


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"],
                         ids=["sliding", "full"])
def test_gemma3_attention_scale(layer_type):
    config, model, attn = _qk_norm_layer(F.GEMMA3, "Gemma3TextModel", layer_type)
    ours = tp.MultiHeadAttention(
        config.hidden_size, config.num_attention_heads,
        tp.Rotary(**tp.read_rope_config(config, layer_type=layer_type).kwargs()),
        n_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        scale=config.query_pre_attn_scalar**-0.5, q_norm=copy.deepcopy(attn.q_norm),
        k_norm=copy.deepcopy(attn.k_norm),
        window=config.sliding_window if layer_type == "sliding_attention" else None).double()
    _copy_llama_weights_and_compare(ours, model, attn)


@pytest.mark.parametrize("backend", BACKENDS)
def test_falcon_alibi_attention(backend):
    """Falcon (alibi=True) divides the ALiBi bias by sqrt(head_dim): ALiBi(n_heads,
    bias_scale=head_dim**-0.5). (Falcon's bfloat16 slopes and bias are exact here: 8 heads,
    slopes 2^-1..2^-8, positions below 10.)"""
    config, model, attn = _hf_layer(F.FALCON, "FalconModel", "h.0.self_attention",
                                    hidden_size=64, num_attention_heads=8)
    # transformers 5.24's eager Falcon adds the ALiBi bias twice (once in the mask the model
    # builds, once in the layer: the outputs equal doubled slopes'); SDPA adds it once
    config._attn_implementation = "sdpa"
    H = config.num_attention_heads
    head_dim = config.hidden_size // H
    ours = tp.MultiHeadAttention(config.hidden_size, H,
                                 tp.ALiBi(H, bias_scale=head_dim**-0.5),
                                 backend=backend, bias=True).double()
    ws = _split_fused(attn.query_key_value.weight, H, head_dim)
    bs = _split_fused(attn.query_key_value.bias, H, head_dim)
    for proj, w, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), ws, bs, strict=True):
        _copy(proj, w, b)
    _copy(ours.out_proj, attn.dense.weight, attn.dense.bias)
    seen, pad, positions = _run_hf(model, attn, 10, True)
    _compare_attention(ours, seen, pad, positions, True)


LOADER_CASES = {
    # name: (family, model class, attention module, config overrides, length)
    "llama": (F.LLAMA, "LlamaModel", "layers.0.self_attn", {}, 10),
    "llama-yarn": (F.LLAMA, "LlamaModel", "layers.0.self_attn", {"rope_parameters": _YARN}, 10),
    "llama-head_dim32": (F.LLAMA, "LlamaModel", "layers.0.self_attn", {"head_dim": 32}, 10),
    "llama-attention_bias": (F.LLAMA, "LlamaModel", "layers.0.self_attn",
                             {"attention_bias": True}, 10),
    "mistral": (F.MISTRAL, "MistralModel", "layers.0.self_attn", {}, 10),
    "qwen2": (F.QWEN2, "Qwen2Model", "layers.0.self_attn", {}, 10),
    "qwen3": (F.QWEN3, "Qwen3Model", "layers.0.self_attn", {}, 10),
    "gemma3-full": (F.GEMMA3, "Gemma3TextModel", "layers.0.self_attn",
                    {"layer_types": ["full_attention"], "num_hidden_layers": 1}, 10),
    "gemma3-sliding": (F.GEMMA3, "Gemma3TextModel", "layers.0.self_attn",
                       {"layer_types": ["sliding_attention"], "num_hidden_layers": 1}, 10),
    "gpt_neox": (F.GPT_NEOX, "GPTNeoXModel", "layers.0.attention", {}, 10),
    # 20 tokens: past Phi-3's original 16 (LongRoPE's long factors, attention factor)
    "phi3": (F.PHI3, "Phi3Model", "layers.0.self_attn", {}, 20),
    "phi4_mini": (F.PHI4_MINI, "Phi3Model", "layers.0.self_attn", {}, 20),
    "phi3-window4": (F.PHI3, "Phi3Model", "layers.0.self_attn", {"sliding_window": 4}, 20),
    "bloom": (F.BLOOM, "BloomModel", "h.0.self_attention", {}, 10),
    # (Falcon's new architecture is parallel attention: parallel_attn True, as its docs say)
    # Falcon's ALiBi: 8 heads (slopes 2^-1..2^-8) and 10 tokens, where its bfloat16 slopes
    # and bias are exact; held to HF's sdpa (_LOADER_SDPA)
    "falcon-alibi": (F.FALCON, "FalconModel", "h.0.self_attention",
                     {"hidden_size": 64, "num_attention_heads": 8}, 10),
    "falcon-alibi-new_arch": (F.FALCON, "FalconModel", "h.0.self_attention",
                              {"hidden_size": 64, "num_attention_heads": 8, "num_kv_heads": 2,
                               "new_decoder_architecture": True, "parallel_attn": True}, 10),
    "falcon-rope": (F.FALCON, "FalconModel", "h.0.self_attention", {"alibi": False}, 10),
    "falcon-rope-multi_query": (F.FALCON, "FalconModel", "h.0.self_attention",
                                {"alibi": False, "multi_query": True, "bias": False}, 10),
    "falcon-rope-new_arch": (F.FALCON, "FalconModel", "h.0.self_attention",
                             {"alibi": False, "new_decoder_architecture": True,
                              "parallel_attn": True, "num_kv_heads": 2}, 10),
    "gptj": (F.GPTJ, "GPTJModel", "h.0.attn", {}, 10),
    "mpt": (F.MPT, "MptModel", "blocks.0.attn", {}, 10),
    "mpt-softmax_scale": (F.MPT, "MptModel", "blocks.0.attn",
                          {"attn_config": {"softmax_scale": 0.3}}, 10),
    "smollm3": (F.SMOLLM3, "SmolLM3Model", "layers.0.self_attn", {}, 10),
    # soft-capping (Gemma 2), on a global and a sliding layer (window 4 of 10 tokens)
    "gemma2-full": (F.GEMMA2, "Gemma2Model", "layers.0.self_attn", {}, 10),
    "gemma2-sliding": (F.GEMMA2, "Gemma2Model", "layers.0.self_attn",
                       {"layer_types": ["sliding_attention"]}, 10),
    # learned sinks (GPT-OSS), with biases and YaRN, on a sliding and a full layer
    # Gemma 4: a sliding layer (head_dim 16, default RoPE, window 4) and a global one
    # (head_dim 32, proportional RoPE with partial_rotary_factor 0.25), both with q/k norms
    # and the weightless v_norm; the global one also with the values from the keys
    "gemma4-sliding": (F.GEMMA4, "Gemma4TextModel", "layers.0.self_attn",
                       {"num_hidden_layers": 1, "layer_types": ["sliding_attention"]}, 10),
    "gemma4-full": (F.GEMMA4, "Gemma4TextModel", "layers.0.self_attn",
                    {"num_hidden_layers": 1, "layer_types": ["full_attention"]}, 10),
    "gemma4-full-k_eq_v": (F.GEMMA4, "Gemma4TextModel", "layers.0.self_attn",
                           {"num_hidden_layers": 1, "layer_types": ["full_attention"],
                            "attention_k_eq_v": True}, 10),
    # Llama 4: a RoPE layer with qk_norm and chunks of 4 positions (of 10 tokens), and a
    # NoPE layer with the temperature tuning (floor_scale 3, attn_scale 0.5: it changes
    # within 10 tokens); layer 0 each time
    "llama4-chunked": (F.LLAMA4, "Llama4TextModel", "layers.0.self_attn",
                       {"num_hidden_layers": 1, "no_rope_layers": [1],
                        "layer_types": ["chunked_attention"], "attention_chunk_size": 4,
                        "experts_implementation": "eager"}, 10),
    "llama4-nope": (F.LLAMA4, "Llama4TextModel", "layers.0.self_attn",
                    {"num_hidden_layers": 1, "no_rope_layers": [0],
                     "layer_types": ["full_attention"], "floor_scale": 3, "attn_scale": 0.5,
                     "experts_implementation": "eager"}, 10),
    # (experts_implementation "eager": the grouped matmul of its MoE has no float64)
    "gpt_oss-sliding": (F.GPT_OSS, "GptOssModel", "layers.0.self_attn",
                        {"num_hidden_layers": 1, "layer_types": ["sliding_attention"],
                         "experts_implementation": "eager"}, 10),
    "gpt_oss-full": (F.GPT_OSS, "GptOssModel", "layers.0.self_attn",
                     {"num_hidden_layers": 1, "layer_types": ["full_attention"],
                      "experts_implementation": "eager"}, 10),
    # no_rope_layers [0] (1 = RoPE): one layer, without RoPE (a layer past the first would
    # see HF's NaN rows of left padding from the layers below; tests/test_hf_loader.py
    # checks that layers.3 of [1, 1, 1, 0] loads as NoPE)
    "smollm3-nope": (F.SMOLLM3, "SmolLM3Model", "layers.0.self_attn",
                     {"num_hidden_layers": 1, "no_rope_layers": [0]}, 10),
}
#: Cases held to HF's attn_implementation="sdpa": transformers 5.24's eager Falcon adds the
#: ALiBi bias twice (once in the mask its model builds, once in the layer).
_LOADER_SDPA = {"falcon-alibi", "falcon-alibi-new_arch"}


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "left-padded"])
@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("flex", marks=pytest.mark.skipif(
    not tp.backends.flex_available()[0], reason="FlexAttention unavailable"))])
@pytest.mark.parametrize("name", list(LOADER_CASES))
def test_loader_from_hf_attention(name, backend, padded, record_property):
    """tutorial_pkg.models.hf.from_hf_attention(module, config): the family's output, every backend
    (flex eagerly: 10-20 tokens are below one tile on CPU; it must not fall back to sdpa).
    BLOOM's module adds the residual inside; the loaded layer does not. Falcon's ALiBi
    against HF's sdpa (_LOADER_SDPA)."""
    fam, cls, path, overrides, s = LOADER_CASES[name]
    config, model, attn = _hf_layer(fam, cls, path, **overrides)
    if name in _LOADER_SDPA:
        config._attn_implementation = "sdpa"
    hf = importlib.import_module("tutorial_pkg.models.hf")
    ours = hf.from_hf_attention(attn, config, backend=backend)
    assert ours.q_proj.weight.dtype == torch.float64  # the module's dtype
    seen, pad, positions = _run_hf(model, attn, s, padded)
    with warnings.catch_warnings():  # flex must really run: a fallback warning raises
        warnings.filterwarnings("error", message="flex backend falls back", category=RuntimeWarning)
        _compare_attention(ours, seen, pad, positions, padded, record_property,
                           _residual_post(fam, seen))


@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("flex", marks=pytest.mark.skipif(
    not tp.backends.flex_available()[0], reason="FlexAttention unavailable"))])
@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_loader_mrope_families_on_text_and_image_positions(name, backend, record_property):
    """Qwen2.5-VL's and Qwen3-VL's text attention (M-RoPE, contiguous and interleaved),
    loaded and called with the [3, b, s] positions of a text + image sequence
    (mrope_positions, equal to transformers' get_rope_index in tests/test_mrope.py)."""
    from tutorial_pkg.encodings.mrope import mrope_positions

    cfg_cls, model_cls = {"qwen2_5_vl": ("Qwen2_5_VLTextConfig", "Qwen2_5_VLTextModel"),
                          "qwen3_vl": ("Qwen3VLTextConfig", "Qwen3VLTextModel")}[name]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    config = getattr(transformers, cfg_cls)(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=1, vocab_size=32, intermediate_size=64, pad_token_id=None,
        bos_token_id=None, eos_token_id=None, attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2]})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).double().eval()
    attn = model.layers[0].self_attn
    _randomize(attn)
    pos = mrope_positions([("text", 3), ("image", (1, 2, 3)), ("text", 2),
                           ("image", (2, 2, 2)), ("text", 1)]).expand(3, 2, -1)
    ids = torch.randint(1, 32, (2, pos.shape[-1]))
    seen = _capture(attn, lambda: model(input_ids=ids, position_ids=pos))
    ours = tp.hf.from_hf_attention(attn, config, backend=backend)
    assert type(ours.encoding).__name__ == "MRotary" and ours.encoding.interleaved == (
        name == "qwen3_vl")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="flex backend falls back", category=RuntimeWarning)
        out = ours(seen["x"], positions=pos)
    err = _max_err(out, seen["y"])
    record_property("max_err", f"{err:.3g}")
    assert err <= OUT_TOL, f"attention outputs differ by {err:.3g}"


# =========================================================================== 5. diagnose
def _hf_rope_fn(fam, config, layer_type=None):
    """``x [b, h, s, d] -> rotated x`` with the family's own code (for diagnose.probe_rope)."""
    rotary = F.rotary_module(fam, config)

    def rope(x):
        positions = torch.arange(x.shape[-2])[None].expand(x.shape[0], -1)
        raw, _, _ = F.hf_tables(fam, rotary, x, positions, layer_type)
        return F.hf_rotate(fam, config, raw, x, x)[0]

    return rope


@pytest.mark.parametrize(("fam", "layout", "rotary_dim", "base"), [
    (F.LLAMA, "half", 16, 10_000.0),
    (F.GPT_NEOX, "half", 4, 10_000.0),
    (F.GPTJ, "interleaved", 8, 10_000.0),
    (F.LLAMA4, "interleaved", 16, 500_000.0),
    (F.MISTRAL, "half", 16, 10_000.0),
], ids=lambda v: getattr(v, "name", None))
def test_probe_rope_reads_hf_families(fam, layout, rotary_dim, base):
    """probe_rope on transformers' own RoPE reports the family's layout, base, rotary_dim."""
    config = fam.make_config()
    head_dim = 16
    report = diagnose.probe_rope(_hf_rope_fn(fam, config), head_dim=head_dim,
                                 dtype=torch.float64)
    assert report.ok, str(report)
    assert (report.layout, report.rotary_dim, report.base) == (layout, rotary_dim, base)


def test_compare_rope_with_the_config_accepts_gemma4_proportional_rope():
    """Gemma 4's global layers rotate pairs (i, i + d/2) of the first frequencies only (the
    proportional rule): against the config's own RoPE, transformers' function is right;
    against a plain partial-rotary reference it reads as a wrong slice, and the report says
    that a rule may do so on purpose."""
    config = F.GEMMA4.make_config()
    fn = _hf_rope_fn(F.GEMMA4, config, "full_attention")
    report = diagnose.compare_rope(fn, None, 32, config=config, layer_type="full_attention",
                                   dtype=torch.float64)
    assert report.ok, str(report)
    partial = tp.RotaryEmbedding(32, 1_000_000.0, rotary_dim=8).rotate
    wrong = diagnose.compare_rope(fn, partial, 32, dtype=torch.float64)
    assert not wrong.ok and "wrong slice" in wrong.problems[0]
    assert "proportional" in wrong.problems[0]
    with pytest.raises(ValueError, match="exactly one of reference and config"):
        diagnose.compare_rope(fn, partial, 32, config=config)
    with pytest.raises(ValueError, match="head_dim=32, not head_dim=16"):
        diagnose.compare_rope(fn, None, 16, config=config, layer_type="full_attention")


def test_probes_tell_deepseek_v32s_two_layouts_apart():
    """DeepSeek-V3.2 runs two RoPE layouts in one model on one table: its MLA attention
    rotates adjacent pairs (apply_rotary_pos_emb_interleave), its sparse-attention indexer
    the halves (apply_rotary_pos_emb, "NON-interleaved" in its code). probe_rope reads each,
    and compare_rope names the difference, the bug of a kernel that rotates both alike."""
    mod = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
    config = transformers.DeepseekV32Config(**{**F._DEEPSEEK_TINY, "index_head_dim": 16,
                                                "index_n_heads": 2, "index_topk": 4})
    rotary = mod.DeepseekV32RotaryEmbedding(config)
    d = config.qk_rope_head_dim

    def tables(x):
        return rotary(x, torch.arange(x.shape[-2])[None].expand(x.shape[0], -1))

    def mla(x):  # [b, h, s, d]
        cos, sin = tables(x)
        return mod.apply_rotary_pos_emb_interleave(x, x, cos, sin)[0]

    def indexer(x):
        cos, sin = tables(x)
        return mod.apply_rotary_pos_emb(x, x, cos, sin)[0]

    probed = {name: diagnose.probe_rope(fn, head_dim=d, dtype=torch.float64)
              for name, fn in (("mla", mla), ("indexer", indexer))}
    assert all(r.ok for r in probed.values()), [str(r) for r in probed.values()]
    assert (probed["mla"].layout, probed["indexer"].layout) == ("interleaved", "half")
    assert probed["mla"].base == probed["indexer"].base == 10_000.0  # one table
    wrong = diagnose.compare_rope(indexer, mla, d, dtype=torch.float64)  # one rotation for both
    assert not wrong.ok and "pairs the rotated features as half" in wrong.problems[0]
    assert diagnose.compare_rope(indexer, indexer, d, dtype=torch.float64).ok


def test_probe_rope_deepseek_interleave():
    """DeepSeek-V3's apply_rotary_pos_emb_interleave rotates adjacent pairs and returns the
    features de-interleaved (a fixed permutation; its scores depend only on m - n, max
    deviation ~1e-7): probe_rope reports the interleaved layout, not a false alarm."""
    config = F.DEEPSEEK_V3.make_config()
    report = diagnose.probe_rope(_hf_rope_fn(F.DEEPSEEK_V3, config),
                                 head_dim=config.qk_rope_head_dim, dtype=torch.float64)
    assert report.relative_error <= 1e-6  # it is a relative rotation
    assert report.ok, str(report)
    assert (report.layout, report.base) == ("interleaved", 10_000.0)


def _mpt(use_cache: bool):
    config = F.MPT.make_config(use_cache=use_cache)
    torch.manual_seed(0)
    return transformers.MptForCausalLM(config).eval()


def test_check_kv_cache_hf_adapter_mpt_with_use_cache():
    """HFAdapter on MPT (ALiBi) when its config enables the cache: every scenario agrees."""
    torch.manual_seed(1)
    report = diagnose.check_kv_cache(_mpt(True), torch.randint(1, 32, (2, 8)), convention="hf")
    assert report.ok, str(report)


@pytest.mark.parametrize("n_pad", [0, 3], ids=["no-padding", "left-padding"])
def test_check_kv_cache_hf_adapter_mpt_default_config(n_pad):
    """MPT's config says use_cache=False: HFAdapter asks for the cache (use_cache=True, a
    DynamicCache passed as ``cache``), so decoding goes through one, padded or not."""
    torch.manual_seed(1)
    report = diagnose.check_kv_cache(_mpt(False), torch.randint(1, 32, (2, 8)), convention="hf",
                                     n_pad=n_pad)
    assert report.ok, str(report)


# --------------------------------------------------------------------------- apply_rope
def _neox_tables(s=10):
    config = F.GPT_NEOX.make_config()
    rotary = F.rotary_module(F.GPT_NEOX, config)
    torch.manual_seed(0)
    q = torch.randn(2, 4, s, 16, dtype=torch.float64)
    positions = torch.arange(s)[None].expand(2, s)
    raw, _, _ = F.hf_tables(F.GPT_NEOX, rotary, q, positions)
    want = F.hf_rotate(F.GPT_NEOX, config, raw, q, q)[0]
    cos, sin = (t.double()[:, None] for t in raw)  # HF's [b, 1, s, r], duplicated halves
    return q, cos, sin, want


def test_apply_rope_with_hf_tables_first_half(record_property):
    """HF's duplicated tables, first half taken ([b, 1, s, r/2]): apply_rope equals GPT-NeoX."""
    q, cos, sin, want = _neox_tables()
    half = cos.shape[-1] // 2
    err = _max_err(tp.apply_rope(q, cos[..., :half], sin[..., :half]), want)
    record_property("max_err", f"{err:.3g}")
    assert err <= 1e-12


def test_apply_rope_with_hf_tables_full_rotary():
    """Full rotary: HF's [b, 1, s, d] tables cover 2d features; apply_rope refuses them
    (today) or, should it learn HF's layout, must rotate as Llama does."""
    config = F.LLAMA.make_config()
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 16, dtype=torch.float64)
    raw = F.rotary_module(F.LLAMA, config)(q, torch.arange(6)[None].expand(2, 6))
    cos, sin = (t[:, None] for t in raw)
    try:
        got = tp.apply_rope(q, cos, sin)
    except ValueError as err:
        assert "cover" in str(err)
        return
    assert _max_err(got, F.hf_rotate(F.LLAMA, config, raw, q, q)[0]) <= 1e-12


def test_apply_rope_hf_tables_partial_rotary():
    """HF's [b, 1, s, r] duplicated-halves tables under partial rotary (GPT-NeoX, r=4 of 16)
    fit the shape check as r/2 = 4 pairs (features 0..7, angles [f0, f1, f0, f1]): apply_rope
    must refuse them (it does, by value) or rotate as GPT-NeoX does."""
    q, cos, sin, want = _neox_tables()
    try:
        got = tp.apply_rope(q, cos, sin)
    except ValueError:
        return  # refusing HF's layout is a fix too
    assert _max_err(got, want) <= 1e-12


def test_gemma4_global_head_dim_read_from_the_file_form():
    """A released Gemma 4 config.json has ``global_head_dim`` and no ``per_layer_config``
    (Gemma4TextConfig builds that from it, 512 where the key is absent): the reader gives
    the full-attention layers that head size, as transformers' rotary module does."""
    torch.manual_seed(0)
    made = F.GEMMA4.make_config().to_dict()
    for head in (32, None):  # given, and absent (transformers' default, 512)
        file = {k: v for k, v in made.items() if k != "per_layer_config"}
        if head is not None:
            file["global_head_dim"] = head
        config = type(F.GEMMA4.make_config()).from_dict(file)
        expected = config.per_layer_config["full_attention"].head_dim
        assert expected == (head or 512)
        rope = tp.RotaryEmbedding.from_config(file, layer_type="full_attention")
        assert rope.head_dim == expected
        _compare_rope(F.GEMMA4, config, F.rotary_module(F.GEMMA4, config), rope, (12,),
                      "full_attention")
    sliding = tp.read_rope_config({**file, "global_head_dim": 32},
                                  layer_type="sliding_attention")
    assert sliding.head_dim == made["head_dim"]
    with pytest.raises(ValueError, match="global_head_dim"):
        tp.read_rope_config({**F.LLAMA.make_config().to_dict(), "global_head_dim": 64})
