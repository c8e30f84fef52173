"""Checks of chapter 3 (book/03_alibi.ipynb) that a reader's cell would not hold.

The chapter shows the plain recipe for a 16-bit ALiBi mask (build the key-only row in float32,
subtract each row's largest visible value, then cast to q's dtype) and says that the package's
``"sdpa"`` backend does the same. These tests check that claim on the layer: its bfloat16 output
against float32, and the mask it hands ``scaled_dot_product_attention``.
"""

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from tutorial_pkg import ALiBi, MultiHeadAttention


@pytest.fixture(scope="module")
def layers():
    """An 8-head key-only ALiBi layer on 1024 tokens, uniform content (q = 0), in float32 and
    bfloat16."""
    torch.manual_seed(0)
    layer32 = MultiHeadAttention(64, 8, ALiBi(8, mode="key_only"), backend="sdpa")
    with torch.no_grad():
        layer32.q_proj.weight.zero_()  # q = 0: the bias alone sets the weights
    layer16 = copy.deepcopy(layer32).bfloat16()
    x16 = torch.randn(1, 1024, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    return layer32, layer16, x16


def test_key_only_rows_are_large_before_the_shift(layers):
    layer32, _, x16 = layers
    keys = torch.arange(x16.shape[1])
    # lambda_1 * m for the last query: unshifted, bfloat16 would drop these rows' low bits
    assert layer32.encoding.bias(keys[-1:], keys).amax().item() > 100


def test_bfloat16_sdpa_layer_matches_float32(layers):
    layer32, layer16, x16 = layers
    with torch.no_grad():
        gap = (layer16(x16).float() - layer32(x16.float())).abs().max().item()
    assert gap < 0.01


def test_bfloat16_sdpa_layer_hands_a_shifted_bfloat16_mask(layers):
    _, layer16, x16 = layers
    with torch.no_grad(), mock.patch.object(
            F, "scaled_dot_product_attention", wraps=F.scaled_dot_product_attention) as kernel:
        layer16(x16)
    handed = kernel.call_args.kwargs["attn_mask"]
    assert handed.dtype == torch.bfloat16  # rounded to q's dtype, not kept in float32
    assert (handed.amax(-1) == 0).all()  # each row's largest visible value is 0: shifted first


def test_falcon_record_labels_each_value_by_its_source():
    """book/data/falcon_configs.json, which chapter 3 reads: a 'transcription' names a pinned copy
    of config.json (repo, path, 40-hex commit); the card's values say they are the card's and
    name no copy."""
    import json
    import re
    from pathlib import Path

    record = json.loads((Path(__file__).resolve().parents[1] / "book/data/falcon_configs.json")
                        .read_text(encoding="utf-8"))["models"]
    seven, rw = record["Falcon-7B"], record["Falcon-RW-1B"]
    assert seven["provenance"] == "transcription" and seven["keys"]["alibi"] is False
    assert seven["copy"]["path"].endswith("config.json")
    assert re.fullmatch(r"[0-9a-f]{40}", seven["copy"]["commit"])
    assert rw["provenance"] == "model card" and rw["copy"] is None and rw["keys"]["alibi"] is True
    assert rw["keys"]["d_model"] % rw["keys"]["head_dim"] == 0  # the chapter derives the heads
