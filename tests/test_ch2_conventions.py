"""The installed-library facts chapter 2 states in prose, held to the pinned transformers.

Chapter 2 says that transformers' ``glm5_next`` text config refuses a RoPE dimension (its
language layers take no RoPE) with the error "Expecting NoPE for the DSA attention layers", and
that Hugging Face has no static NTK-aware ``rope_type``: its ``ROPE_INIT_FUNCTIONS`` lists
``linear``, ``dynamic``, ``yarn``, ``longrope``, ``llama3`` and ``proportional``, where the
package names the static rule ``"ntk"``. These tests call transformers itself, so that a
transformers that changed either fact fails here rather than leaving the chapter's prose stale.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")


def test_glm5_next_text_config_refuses_a_rope_dimension():
    with pytest.raises(Exception, match="Expecting NoPE for the DSA attention layers") as err:
        transformers.Glm5NextTextConfig(qk_rope_head_dim=64)
    assert "but got 64 as RoPE dim" in str(err.value)


def test_glm5_next_text_config_accepts_no_rope_dimension():
    transformers.Glm5NextTextConfig()  # the defaults: NoPE language layers


def test_hugging_face_has_dynamic_ntk_but_no_static_ntk_rope_type():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert "ntk" not in ROPE_INIT_FUNCTIONS and "dynamic" in ROPE_INIT_FUNCTIONS
    # the list chapter 2 names
    assert set(ROPE_INIT_FUNCTIONS) == {"linear", "dynamic", "yarn", "longrope", "llama3",
                                        "proportional"}
