"""Facts chapter 4 (book/04_attention.ipynb) states in its prose, checked here rather than in
hidden cells: the quoted documentation of the installed torch and of the pinned transformers,
the package's own ``and_masks``, the recorded benchmark's pairing and shared orders, the
probe's shape and the kept table's size, the rotate variants (QK-norm before RoPE, partial
rotary) and the slot/position formulas against transformers' code. The details of "auto"'s
CPU check and of Flex on the CPU, which the chapter states in one paragraph, live here, and so
do the checks its cells leave out: each SDPA kernel alone on the key-row call, the kept table's
bytes call by call, and the float mask's -inf and finfo(dtype).min.
A transformers other than the pinned 5.24 fails loudly: the chapter quotes that version's
source."""

import ast
import importlib.metadata
import inspect
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tutorial_pkg as tp
from tutorial_pkg.attention import masks

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "book" / "04_attention.ipynb"


def _cell(cell_id):
    cells = json.loads(CHAPTER.read_text())["cells"]
    (cell,) = [c for c in cells if c.get("id") == cell_id]
    return "".join(cell["source"])


def test_and_masks_is_the_packages_own_and_composes_like_torchs():
    """Cells 11 and 85: the package's and_masks, modelled on attention-gym's / PyTorch's."""
    flex_module = pytest.importorskip("torch.nn.attention.flex_attention")
    assert masks.and_masks is not flex_module.and_masks
    assert masks.and_masks.__module__ == "tutorial_pkg.attention.masks"
    q_idx = torch.arange(12)[:, None]
    kv_idx = torch.arange(12)[None, :]
    rules = (masks.causal_mask, masks.sliding_window(4))
    b = h = torch.tensor(0)  # torch's and_masks takes tensors for every index
    ours = masks.and_masks(*rules)(b, h, q_idx, kv_idx)
    theirs = flex_module.and_masks(*rules)(b, h, q_idx, kv_idx)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, (kv_idx <= q_idx) & (kv_idx > q_idx - 4))
    assert masks.and_masks(masks.causal_mask) is masks.causal_mask


def test_sdpa_documentation_quoted_in_the_chapter():
    """Cells 18, 20, 55 and 57 quote the installed torch's scaled_dot_product_attention."""
    doc = " ".join(F.scaled_dot_product_attention.__doc__.split())
    for quoted in ("An error is thrown if both attn_mask and is_causal are set.",
                   "if is_causal: assert attn_mask is None",
                   "A float mask of the same type as query, key, value that is added to the "
                   "attention score.",
                   "upper left causal bias due to the alignment",
                   "key = key.repeat_interleave(query.size(-3)//key.size(-3), -3)"):
        assert quoted in doc, quoted


def test_benchmark_record_pairs_every_case_in_every_round():
    """Cell 25's within-round ratios: every case timed in every round, one reference."""
    recorded = json.loads((ROOT / "book" / "data" / "benchmark_cpu.json").read_text())
    cases = ("nope/sdpa", "alibi/auto", "alibi/sdpa")
    timed = {(r["case"], r["params"]["seq_len"]): r for r in recorded["records"]
             if r["case"] in cases and r["params"].get("op") == "attention"
             and r["params"].get("pass") == "fwd" and r["params"].get("dtype") == "float32"
             and r["params"].get("seq_len") in (1024, 2048, 4096)}
    rounds = len(timed["alibi/auto", 1024]["round_ratios"])
    assert rounds >= 2
    for n in (1024, 2048, 4096):
        assert {len(timed[c, n]["round_ratios"]) for c in cases} == {rounds}, n
        assert len({timed[c, n]["reference"] for c in cases}) == 1, n


def _probe_shape():
    """(heads, length, dim, offset) of probe_key_bias's problem, read from its source."""
    from tutorial_pkg.attention import _probe

    tree = ast.parse(inspect.getsource(_probe.probe_key_bias))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                and [t.id for t in node.targets[0].elts][:2] == ["heads", "kv_heads"]):
            values = node.value.elts
            heads, length, dim, offset = (values[i] for i in (0, 2, 3, 4))
            return (ast.literal_eval(heads), ast.literal_eval(length),
                    ast.literal_eval(dim) if isinstance(dim, ast.Constant) else None,
                    ast.literal_eval(offset))
    raise AssertionError("probe_key_bias no longer assigns heads, kv_heads, length, dim, offset")


def test_chapter_table_runs_the_probes_shape():
    """Cell 24 says the package's probe runs the comparison of cell 21 at its shape."""
    heads, length, dim, offset = _probe_shape()
    source = _cell("23a66596")
    width = 8 if dim is None else dim  # a probe at the layer's head width: the chapter's is 8
    assert f"torch.randn(1, {heads}, {length}, {width}, generator=gen)" in source
    assert f"torch.arange({offset}, {offset + length}, dtype=torch.float64)" in source


def test_sdpa_keeps_the_table_for_the_length_rounded_up_to_a_power_of_two():
    """Cell 34: the kept (1, H, T, T) float32 table, T the length rounded up to a power of 2."""
    from tutorial_pkg.attention._caches import cached_tensors

    n_heads, length = 4, 600
    layer = tp.MultiHeadAttention(32, n_heads, tp.ALiBi(n_heads), backend="sdpa")
    with torch.no_grad():
        layer(torch.randn(1, length, 32))
    held = cached_tensors(layer.encoding)
    assert [tuple(t.shape) for t in held] == [(1, n_heads, 1024, 1024)]
    assert all(t.dtype == torch.float32 for t in held)


def test_block_mask_bytes_are_four_count_vectors_and_four_index_matrices():
    """Cell 34's model of FlexAttention's block mask."""
    flex_module = pytest.importorskip("torch.nn.attention.flex_attention")

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    for length in (256, 512, 1024):
        bm = flex_module.create_block_mask(causal, None, None, length, length, device="cpu")
        tiles = math.ceil(length / bm.BLOCK_SIZE[0])
        real = sum(t.nbytes for t in bm.as_tuple() if isinstance(t, torch.Tensor))
        assert real == 4 * 4 * tiles + 4 * 4 * tiles * tiles, length


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    version = importlib.metadata.version("transformers")
    if not version.startswith("5.24."):
        pytest.fail(f"chapter 4 quotes transformers 5.24's source (pyproject.toml pins it); "
                    f"installed: {version}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' import-time notices
        import transformers.cache_utils as hf_cache
        import transformers.generation.utils as hf_generation
        import transformers.masking_utils as hf_masking
    return transformers, hf_cache, hf_generation, hf_masking


def test_transformers_masking_quotes(hf):
    """Cells 59, 70 and exercise 3 quote masking_utils.py and cache_utils.py."""
    _, hf_cache, _, hf_masking = hf
    src = inspect.getsource(hf_masking)
    for quoted in ("return kv_idx <= q_idx", "return kv_idx > q_idx - sliding_window",
                   "q_arange = torch.arange(q_length, device=device) + q_offset",
                   "If `q_length == 1`, we then use `is_causal=False` in sdpa integration to "
                   "mimic lower-right",
                   "If `kv_length == q_length`,\n    # we use `is_causal=True` as upper-left "
                   "alignment (torch's default) is the same as lower-right in this case.",
                   "q_offset = cache.get_query_offset(layer_idx)"):
        assert quoted in src, quoted
    cache_doc = " ".join(inspect.getsource(hf_cache.Cache.get_query_offset).split())
    assert ("It's always equal to the cache length, i.e. `get_seq_length(layer_idx)`, "
            "except for MTP layers.") in cache_doc
    assert "Only cache the last `self.sliding_window - 1` tokens" in inspect.getsource(
        hf_cache.DynamicSlidingWindowLayer.update)


def test_transformers_generation_positions_quotes(hf):
    """Cell 68 quotes generate's position count and IDEFICS's fill."""
    _, _, hf_generation, _ = hf
    gen_src = inspect.getsource(
        hf_generation.GenerationMixin._prepare_position_ids_for_generation)
    assert "position_ids = attention_mask.long().cumsum(-1) - 1" in gen_src
    assert "position_ids = position_ids.masked_fill(attention_mask == 0, 0)" in gen_src
    assert "# We need this as otherwise padding tokens appear as -1 in position" in gen_src
    from transformers.models.idefics.modeling_idefics import IdeficsModel

    assert "position_ids.masked_fill_(attention_mask == 0, 1)" in inspect.getsource(
        IdeficsModel.forward)


def test_softcapping_defaults(hf):
    """Cell 16: Gemma 2's cap of 50, none in Gemma 3."""
    transformers = hf[0]
    assert transformers.Gemma2Config().attn_logit_softcapping == 50.0
    assert transformers.Gemma3TextConfig().attn_logit_softcapping is None


def test_transformers_cache_position_survives_only_for_remote_code(hf):
    """Cell 69: in 5.24 generate builds cache_position only for remote-code models."""
    _, _, hf_generation, _ = hf
    src = inspect.getsource(hf_generation)
    assert ("cache_position = torch.arange(sequence_length, device=input_ids.device) "
            "+ past_seen_tokens") in src
    assert 'self.is_remote_code() and "cache_position" in' in src
    assert "removed from the Transformers library" in src


# ---- what the chapter no longer teaches in its cells: "auto"'s checks on the CPU ----------


def test_auto_checks_the_key_row_per_probe_key_on_the_cpu():
    """The chapter says "auto" takes the key row on a CPU only where a check of the call
    passes, never for 16-bit inputs. The check: ``key_bias_supported`` keeps one answer per
    key (device type, dtype, whether key/value heads are shared (GQA), head width); before
    the first key-row call for a key it runs ``probe_key_bias`` once, forward and backward, at
    one small shape (2 heads, 16 tokens, keys from position 4096, the layer's head width),
    with the kernel PyTorch selects and each fused kernel alone. Its tolerance is not the
    chapter table's: a largest error of at most 1e-3 times the reference's largest value (at
    least 1) in float32 and float64 (the table uses 1e-3 and 1e-12 absolute, to show the
    float64 result is right to rounding). Where the answer is no, "auto" computes "sdpa"'s
    documented 4-D mask. On a GPU it runs no check: SDPA there picks its kernel by shape, so
    a check at one shape would not cover the kernels other shapes reach."""
    from tutorial_pkg.attention import _probe

    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.float64):
        assert _probe.key_bias_supported(cpu, dtype, False) is True  # the chapter's row_here
    assert _probe.probe_key_bias(cpu, torch.bfloat16, False) is False  # the row rounds
    doc = " ".join(_probe.probe_key_bias.__doc__.split())
    assert "at most 1e-3 times the reference's largest value (at least 1)" in doc
    assert "forward and gradients" in doc
    # the layer: "auto" with the key row == "sdpa" with the documented 4-D mask
    layer = tp.MultiHeadAttention(32, 4, tp.ALiBi(4), backend="sdpa")
    auto = tp.MultiHeadAttention(32, 4, layer.encoding, backend="auto")
    auto.load_state_dict(layer.state_dict())
    x = torch.randn(2, 40, 32)
    with torch.no_grad():
        torch.testing.assert_close(auto(x), layer(x), atol=1e-5, rtol=1e-4)


def test_flex_on_the_cpu_runs_short_calls_eagerly_and_falls_back_with_a_warning():
    """Cell 28's one sentence on the fallback, and what the chapter no longer prints: on the
    CPU the package runs Flex calls shorter than one 128-token tile eagerly (uncompiled), and
    a Flex layer called with gradients on (no CPU backward) computes "sdpa" and warns once."""
    from tutorial_pkg.attention import _flex

    assert _flex.FLEX_TILE == 128
    ok, why = tp.backends.flex_available()
    if not ok:
        pytest.skip(why)
    layer = tp.MultiHeadAttention(32, 4, tp.ALiBi(4), backend="flex")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(torch.randn(1, 16, 32))
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(messages) == 1 and "falls back to sdpa" in messages[0]


def test_benchmark_orders_are_shared_by_the_groups_of_a4_and_a8():
    """Cell 26's caveat: one order per case, reused in every group of A4 and of A8."""
    recorded = json.loads((ROOT / "book" / "data" / "benchmark_cpu.json").read_text())
    decided = {d["id"]: d for d in recorded["decided"]}
    for key, pair in (("A8", ("alibi/sdpa", "alibi/auto")), ("A4", ("alibi/auto", "nope/sdpa"))):
        for case in pair:
            orders = {tuple(r["round_positions"]) for r in recorded["records"]
                      if r["case"] == case and r["group"] in decided[key]["groups"]}
            assert len(orders) == 1, (key, case)
    assert decided["A8"]["rounds"] == 3 * len(next(iter(orders)))


# ---- the rotate variants, held to transformers' source --------------------------------------


def _forward_source(module_name, class_name):
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(f"transformers.models.{module_name}")
    cls = getattr(module, class_name)
    return inspect.getsource(cls.__init__), inspect.getsource(cls.forward)


@pytest.mark.parametrize("module_name, class_name, per_head", [
    ("qwen3.modeling_qwen3", "Qwen3Attention", True),
    ("gemma3.modeling_gemma3", "Gemma3Attention", True),
    ("olmo2.modeling_olmo2", "Olmo2Attention", False),
])
def test_qk_norm_comes_before_rope(hf, module_name, class_name, per_head):
    """The QK-norm cell: q_norm and k_norm before apply_rotary_pos_emb; per head in Qwen3
    and Gemma 3, over the whole projection in OLMo 2."""
    init, forward = _forward_source(module_name, class_name)
    rope_at = forward.index("apply_rotary_pos_emb(query_states, key_states, cos, sin)")
    assert -1 < forward.index("self.q_norm(") < rope_at
    assert -1 < forward.index("self.k_norm(") < rope_at
    if per_head:
        assert "head_dim" in init.split("self.q_norm = ")[1].split("\n")[0]
    else:
        assert "config.num_attention_heads * self.head_dim" in init.split("self.q_norm = ")[1]
    if module_name.startswith("qwen3"):
        assert ("query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))"
                ".transpose(1, 2)" in forward)
        assert ("`query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))"
                ".transpose(1, 2)`" in _cell("c4qknorm1"))


def test_package_layer_applies_qk_norm_before_rope_like_qwen3(hf):
    """The QK-norm cell's layer against transformers' Qwen3 rotation order, numerically."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
    d, s = 8, 6
    norm = torch.nn.RMSNorm(d)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    q, k = torch.randn(1, 2, s, d), torch.randn(1, 2, s, d)
    pos = torch.arange(s)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)[None]
    theirs = apply_rotary_pos_emb(norm(q), norm(k), emb.cos(), emb.sin())
    ours = tp.Rotary(d).rotate(norm(q), norm(k), pos, pos)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])


def test_partial_rotary_is_gpt_neox_slice(hf):
    """The partial-rotary cell: GPT-NeoX's slice, numerically and in its source."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers.models.gpt_neox import modeling_gpt_neox as neox
    src = inspect.getsource(neox.apply_rotary_pos_emb)
    assert "q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]" in src
    assert "q_embed = torch.cat([q_embed, q_pass], dim=-1)" in src
    from transformers.models.gpt_neox import configuration_gpt_neox
    from transformers.models.phi import modeling_phi

    assert 'kwargs.pop("rotary_pct"' in inspect.getsource(configuration_gpt_neox)
    assert "query_states[..., : self.rotary_ndims]" in inspect.getsource(
        modeling_phi.PhiAttention.forward)
    d, r, s = 16, 8, 5
    q, k = torch.randn(1, 2, s, d), torch.randn(1, 2, s, d)
    pos = torch.arange(s)
    inv = 1.0 / (10000.0 ** (torch.arange(0, r, 2).float() / r))
    emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)[None]
    theirs = neox.apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    ours = tp.Rotary(d, rotary_dim=r).rotate(q, k, pos, pos)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])


# ---- slot and position, held to transformers' functions -------------------------------------


def test_slots_and_positions_are_transformers(hf):
    """Cell 69's two formulas with plain tensors: the step's mask on slots
    (arange(q_len) + cache_len, key slot <= query slot, not padding) is transformers'
    sdpa_mask at that q_offset, and the positions (cumsum of the attention mask minus one,
    padding at 0) are generate's _prepare_position_ids_for_generation."""
    _, _, hf_generation, hf_masking = hf
    attention_mask = torch.tensor([[1] * 9, [0, 0] + [1] * 7])  # the chapter's batch, 3 steps on
    positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    theirs = hf_generation.GenerationMixin._prepare_position_ids_for_generation(
        None, torch.zeros(2, 9, dtype=torch.long), {"attention_mask": attention_mask})
    assert torch.equal(positions, theirs)
    assert positions[:, -1].tolist() == [8, 6]
    for cache_len, q_len in ((8, 1), (6, 3)):  # one decoding step; a chunk after the cache
        q_slots = torch.arange(q_len) + cache_len
        key_slots = torch.arange(cache_len + q_len)
        ours = (key_slots[None, :] <= q_slots[:, None])[None] & attention_mask.bool()[:, None, :]
        hf_mask = hf_masking.sdpa_mask(batch_size=2, q_length=q_len, kv_length=cache_len + q_len,
                                       q_offset=cache_len, attention_mask=attention_mask.bool(),
                                       allow_is_causal_skip=False)
        assert torch.equal(hf_mask[:, 0], ours), (cache_len, q_len)


# ---- moved out of the chapter: the A8/A4 records' shared orders, checked with rounds as clusters


def test_a8_and_a4_with_each_round_as_one_cluster():
    """The orders of A4's and A8's groups were drawn once and reused (the test above), so
    their pooled rounds rest on one randomisation per round. Each round taken as one cluster
    (its mean log ratio over the claim's lengths, a t interval at the family's confidence):
    A8 still holds and A4 still straddles 1. The chapter's A8 cell computes the same cluster
    interval, and its prose states it and the record's pooled one: the numbers are held here."""
    from tutorial_pkg.experiments.stats import t_interval

    recorded = json.loads((ROOT / "book" / "data" / "benchmark_cpu.json").read_text())
    decided = {d["id"]: d for d in recorded["decided"]}
    recs = {(r["case"], r["group"]): r for r in recorded["records"]}
    clustered = {}
    for key, (a, b) in (("A8", ("alibi/sdpa", "alibi/auto")), ("A4", ("alibi/auto", "nope/sdpa"))):
        per_group = [[math.log(x / y) for x, y in zip(recs[a, g]["round_ratios"],
                                                      recs[b, g]["round_ratios"], strict=True)]
                     for g in decided[key]["groups"]]
        clustered[key] = t_interval([sum(c) / len(c) for c in zip(*per_group, strict=True)],
                                    confidence=decided[key]["confidence"])
    assert decided["A8"]["verdict"] == "holds" and clustered["A8"]["low"] > 0
    assert clustered["A4"]["low"] < 0 < clustered["A4"]["high"]
    # the chapter's "4096 times at 4096 tokens": A8's longest length
    lengths = {recs[("alibi/sdpa", g)]["params"]["seq_len"] for g in decided["A8"]["groups"]}
    assert max(lengths) == 4096 and "L_A8 = 4096" in _cell_containing("a8 = ")
    a8 = decided["A8"]
    # the family: each claim at 1 - alpha / (number of claims), Bonferroni
    assert math.isclose(a8["confidence"], 1 - recorded["alpha"] / len(recorded["claims"]))
    prose = " ".join(_cell_containing("commit `5abe3be`").split())
    c = clustered["A8"]
    n_orders = len(recs["alibi/sdpa", a8["groups"][0]]["round_ratios"])  # one order per round
    confidence = f"{a8['confidence']:.1%}".replace("%", "\\,\\%")
    for said in (f"each randomisation as one cluster: {math.exp(c['mean']):.2f} "
                 f"[{math.exp(c['low']):.2f}, {math.exp(c['high']):.2f}]",
                 f"The record's interval, [{a8['low']:.2f}, {a8['high']:.2f}]",
                 f"its {a8['rounds']} rounds", f"rest on {n_orders} randomisations",
                 f"of the {len(recorded['claims'])} claims",
                 f"$1 - {recorded['alpha']}/{len(recorded['claims'])} = {confidence}$",
                 "over 1024, 2048 and 4096 tokens", "exploratory"):
        assert said in prose, said
    assert a8["rounds"] == len(decided["A8"]["groups"]) * n_orders


def _cell_containing(text):
    cells = json.loads(CHAPTER.read_text())["cells"]
    (cell,) = [c for c in cells if text in "".join(c["source"])]
    return "".join(cell["source"])


def test_kept_table_side_is_the_longest_length_rounded_up_and_never_shrinks():
    """The retention cell: side max(128, next power of two >= longest L seen), growing only;
    deleting the layer (and so the encoding) frees it."""
    import gc
    import weakref

    from tutorial_pkg.attention._caches import cached_tensors

    layer = tp.MultiHeadAttention(16, 2, tp.ALiBi(2), backend="sdpa")
    for length, side in ((64, 128), (129, 256), (300, 512), (40, 512)):
        with torch.no_grad():
            layer(torch.randn(1, length, 16))
        assert [tuple(t.shape) for t in cached_tensors(layer.encoding)] == [(1, 2, side, side)]
    table = weakref.ref(cached_tensors(layer.encoding)[0])
    del layer
    gc.collect()
    assert table() is None


def test_chapter_flex_comparison_runs_the_uncompiled_path_on_the_cpu(monkeypatch):
    """The Flex cells: at L_BACKEND (257 on the CPU, past two tiles) the chapter builds its
    Flex layers with compile_flex=LARGER, so on the CPU they run eagerly (the chapter says so);
    the compiled kernel is held by test_attention's
    test_compiled_flex_equals_naive_below_and_above_one_tile (136 tokens)."""
    from tutorial_pkg.attention import _flex, backends

    assert "L_BACKEND = 1024 if LARGER else 257" in _cell("4b8c616e")
    assert 2 * _flex.FLEX_TILE < 257
    assert 'rebuild(layers[name], "flex", compile_flex=LARGER)' in _cell("0dd33822")
    assert "compile_flex=LARGER" in _cell("c4grad2")
    ok, why = backends.flex_available()
    if not ok:
        pytest.skip(why)
    chosen = []
    real = backends.flex_kernel

    def spy(compiled, dynamic=False):
        chosen.append(compiled)
        return real(False, dynamic)  # run eagerly either way: no compile in this test

    monkeypatch.setattr(backends, "flex_kernel", spy)
    layer = tp.MultiHeadAttention(32, 4, tp.ALiBi(4), backend="flex")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer(torch.randn(1, 64, 32))
        layer(torch.randn(1, 128, 32))
        eager = tp.MultiHeadAttention(32, 4, tp.ALiBi(4), backend="flex", compile_flex=False)
        eager(torch.randn(1, 257, 32))
    assert chosen == [False, True, False]


def test_chapter_clear_cache_frees_the_kept_table():
    """Cell 36 teaches `keeper.clear_cache()`: after it the encoding keeps no table, and the
    next call builds one again."""
    from tutorial_pkg.attention._caches import cached_tensors

    assert "peak_memory(keeper.clear_cache, device=device, warmup=0)" in _cell("b0742498")
    layer = tp.MultiHeadAttention(16, 2, tp.make_encoding("alibi", d_model=16, n_heads=2,
                                                          max_positions=512), backend="sdpa")
    with torch.no_grad():
        layer(torch.randn(1, 300, 16))
        assert cached_tensors(layer.encoding)
        layer.clear_cache()
        assert not cached_tensors(layer.encoding)
        layer(torch.randn(1, 40, 16))
        assert cached_tensors(layer.encoding)


# ---- moved out of the chapter's cells: each SDPA kernel alone, and the kept table's bytes ------


def test_each_cpu_kernel_on_the_key_row_call():
    """The key-row cell runs the undocumented call (a float row with is_causal=True) with the
    kernel PyTorch selects and with math alone; here each kernel alone, on the CPU: flash, the
    CPU's one fused kernel, takes the call and is right in float32 and float64; math (the
    documented error), memory-efficient and cuDNN refuse it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen) for _ in range(3))
    slopes = torch.tensor([0.5, 1 / 16], dtype=torch.float64)
    row = (slopes[:, None, None] * torch.arange(4096, 4112, dtype=torch.float64))[None]
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(8) + row
    future = torch.ones(16, 16, dtype=torch.bool).triu(1)
    want = scores.masked_fill(future, float("-inf")).softmax(-1) @ v.double()
    for dtype, tol in ((torch.float32, 1e-3), (torch.float64, 1e-12)):
        q_, k_, v_, row_ = (t.to(dtype) for t in (q, k, v, row))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            got = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=row_, is_causal=True)
        assert (got.double() - want).abs().max() < tol, dtype
        for kernel in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION,
                       SDPBackend.CUDNN_ATTENTION):
            with sdpa_kernel([kernel]), warnings.catch_warnings(), \
                    pytest.raises((RuntimeError, ValueError)):
                warnings.simplefilter("ignore")  # a kernel that refuses the call warns why
                F.scaled_dot_product_attention(q_, k_, v_, attn_mask=row_, is_causal=True)


def test_kept_table_bytes_measured_call_by_call():
    """The kept-table cell measures only what clear_cache() frees; here the bytes each call
    leaves behind, measured as the chapter's cells measure (peak_memory's net_bytes, less a
    plain layer's output): after calls at 64, 129, 300 and 40 tokens the kept bytes are
    4 H T^2 with T the side for the longest call so far; clear_cache() returns them to 0; a
    layer that lives for one call leaves no table behind."""
    from tutorial_pkg.measure.memory import peak_memory

    heads, width = 8, 64

    def side(n):
        return max(128, 1 << (n - 1).bit_length())

    def alibi_layer():
        enc = tp.make_encoding("alibi", d_model=width, n_heads=heads, max_positions=4096)
        return tp.MultiHeadAttention(width, heads, enc, backend="sdpa")

    keeper = alibi_layer()
    plain = tp.MultiHeadAttention(width, heads, tp.NoPE(), backend="sdpa")
    kept, longest = 0, 0
    for length in (64, 129, 300, 40):
        x = torch.randn(1, length, width)
        with torch.no_grad():
            output = peak_memory(lambda x=x: plain(x), device="cpu", warmup=0).net_bytes
            kept += peak_memory(lambda x=x: keeper(x), device="cpu", warmup=0).net_bytes - output
        longest = max(longest, length)
        want = 4 * heads * side(longest) ** 2
        assert abs(kept - want) <= 0.01 * want, (length, kept)
    kept += peak_memory(keeper.clear_cache, device="cpu", warmup=0).net_bytes
    assert abs(kept) <= 0.01 * 4 * heads * side(300) ** 2

    def call_once():
        with torch.no_grad():
            alibi_layer()(torch.randn(1, 300, width))

    assert peak_memory(call_once, device="cpu", warmup=0).net_bytes < 0.01 * 4 * heads * 512**2


def test_masked_pairs_get_minus_inf_and_padding_the_most_negative_finite_value():
    """The backends section: in sdpa's float mask the keys the causal rule hides get -inf,
    padding keys torch.finfo(dtype).min (finite, so a query with no key stays NaN-free),
    also where causality hides them too."""
    s = 5
    pad = torch.zeros(1, s, dtype=torch.bool)
    pad[0, :2] = True
    plan = masks.AttentionPlan(q_pos=torch.arange(s)[None], k_pos=torch.arange(s)[None],
                               start=0, default_positions=True, causal=True,
                               key_padding_mask=pad)
    for dtype in (torch.float32, torch.bfloat16):
        mask = masks.additive_mask(plan, None, dtype)[0, 0]
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        assert mask.dtype == dtype
        padding = pad[0][None, :].expand(s, s)  # a padding key, hidden or not by causality
        assert bool(torch.isneginf(mask[future & ~padding]).all())
        assert bool((mask[padding] == torch.finfo(dtype).min).all())
        assert bool((mask[~future & ~padding] == 0).all())


def test_a8_claims_committed_before_both_recorded_runs():
    """The A8 prose states as a fact that chapter 5's claims were committed in 5abe3be on
    2026-12-02, before both recorded runs: the commit's date, and the claims_written of each
    record after it."""
    import shutil
    import subprocess
    from datetime import datetime

    source = _cell_containing("commit `5abe3be`")
    assert "2026-12-02" in source
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    out = subprocess.run(["git", "-C", str(ROOT), "show", "-s", "--format=%cI", "5abe3be"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"git show 5abe3be: {out.stderr.strip()[:80]} (a shallow clone?)")
    committed = datetime.fromisoformat(out.stdout.strip())
    assert committed.date().isoformat() == "2026-12-02"
    for name in ("benchmark_cpu.json", "benchmark_cpu_loaded.json"):
        stored = json.loads((ROOT / "book" / "data" / name).read_text())
        assert committed < datetime.fromisoformat(stored["claims_written"]), name


# ---- moved out of the chapter's cells: CPU-only verdicts the reader cells print -------------


def test_auto_key_row_adds_kilobytes_on_the_cpu():
    """The memory cell asserts, on every device, that "auto"'s float32 ALiBi call adds under
    1 % of sdpa's table; on the CPU, where it takes the key row, it adds kilobytes: under
    64 KiB, measured as the chapter measures (L = 1024, H = 8, width 64)."""
    from tutorial_pkg.measure.memory import peak_memory

    heads, width, length = 8, 64, 1024
    x = torch.randn(1, length, width)

    def peak(enc_name, backend):
        enc = tp.make_encoding(enc_name, d_model=width, n_heads=heads, max_positions=4096)
        layer = tp.MultiHeadAttention(width, heads, enc, backend=backend)
        with torch.no_grad():
            return peak_memory(lambda: layer(x), device="cpu", warmup=1).peak_bytes

    assert peak("alibi", "auto") - peak("nope", "sdpa") < 64 * 2**10


def test_cpu_sdpa_gives_zeros_for_fully_masked_rows_in_both_kernels():
    """The masks section prints, per kernel, that SDPA on this CPU returns zeros for a fully
    masked row and no NaN after two layers, for a boolean and a float -inf mask; held here on
    the CPU (another device's kernels may differ, which is why the chapter only prints it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, :2] = True
    allowed = (torch.ones(6, 6, dtype=torch.bool).tril()[None] & ~pad[:, None, :])[:, None]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    ref = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(~allowed, float("-inf"))
    ref = ref.softmax(-1) @ v  # NaN in the empty rows, right elsewhere
    for mask in (allowed, additive):
        for kernels in ([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], [SDPBackend.MATH]):
            with sdpa_kernel(kernels):
                one = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                two = F.scaled_dot_product_attention(one, one, one, attn_mask=mask)
            assert bool(torch.isfinite(two).all()) and bool((one[1, :, :2] == 0).all())
            torch.testing.assert_close(one[0], ref[0])
