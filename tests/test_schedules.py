"""Per-layer schedules (tutorial_pkg.encodings.schedules): the layer rules of Hugging Face's Llama 4
/ SmolLM3 (``no_rope_layers``) and Gemma 3 (``layer_types``) configs, transcribed here; TinyLM by
name, by list, decoding with a cache.
"""

from __future__ import annotations

import pytest
import torch

from tutorial_pkg.attention.layer import MultiHeadAttention
from tutorial_pkg.encodings.builtin import NoPE, Rotary
from tutorial_pkg.encodings.registry import ENCODINGS, make_encoding
from tutorial_pkg.encodings.relative_bias import T5RelativeBias
from tutorial_pkg.encodings.schedules import LayerSchedule, LocalGlobal, NoPEEvery, PerLayer
from tutorial_pkg.models.tiny_lm import TinyLM

from .layer_cases import (
    ALL_BACKENDS,
    LAYER_MARKS,
    D,
    H,
)

pytestmark = LAYER_MARKS


# --------------------------------------------------------------------------- schedules
def test_nope_every_follows_hugging_faces_no_rope_layers():
    # Llama4TextConfig / SmolLM3Config: no_rope_layers[i] = int((i + 1) % interval != 0)
    for every in (2, 3, 4):
        schedule = NoPEEvery(8, every=every)
        for i in range(12):
            rope = int((i + 1) % every != 0)
            enc, window = schedule.layer(i)
            assert (enc is schedule.rope) == bool(rope) and window is None
            assert isinstance(enc, NoPE) == (not rope)
    assert NoPEEvery(8).describe(8) == ["rope", "rope", "rope", "nope"] * 2  # 3 : 1


def test_local_global_follows_gemma3_layer_types():
    # Gemma3TextConfig: layer_types[i] = "sliding_attention" if (i + 1) % pattern else
    # "full_attention"; rope_local_base_freq 10 000 on sliding layers, rope_theta 1e6 on full
    schedule = LocalGlobal(8, window=16, global_scaling={"type": "linear", "factor": 8.0})
    for i in range(14):
        enc, window = schedule.layer(i)
        sliding = bool((i + 1) % 6)
        assert window == (16 if sliding else None)
        assert enc.rope.base == (10_000.0 if sliding else 1_000_000.0)
    assert schedule.describe(6) == ["rope/w=16"] * 5 + ["rope"]
    assert schedule.global_rope.scaling["factor"] == 8.0 and schedule.local_rope.scaling is None
    schedule.set_scaling({"type": "linear", "factor": 2.0})  # the global layers only
    assert schedule.scaling["factor"] == 2.0 and schedule.local_rope.scaling is None
    assert LocalGlobal(8).window == 1024  # Gemma 3's local span


def test_schedules_are_built_by_name():
    for name, cls in (("irope", NoPEEvery), ("local_global", LocalGlobal), ("t5", T5RelativeBias)):
        assert ENCODINGS[name] is cls
        assert isinstance(make_encoding(name, d_model=D, n_heads=H), cls)
    model = TinyLM("irope", d_model=D, n_layers=8, n_heads=H)
    names = [type(b.attn.encoding).__name__ for b in model.blocks]
    assert names == ["Rotary"] * 3 + ["NoPE"] + ["Rotary"] * 3 + ["NoPE"]
    assert model.blocks[0].attn.encoding is model.blocks[5].attn.encoding  # one shared RoPE
    model = TinyLM("local_global", d_model=D, n_layers=6, n_heads=H,
                   encoding_kwargs={"window": 5})
    assert [b.attn.window for b in model.blocks] == [5] * 5 + [None]
    assert model.encoding.supports_scaling and model.encoding.max_positions is None


def test_single_encoding_and_per_layer_list_agree():
    # the old call is unchanged (one shared instance); a list of the same names gives the
    # same model (same seed, RoPE has no parameters)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    single = TinyLM("rope", d_model=D, n_layers=3, n_heads=H).eval()
    assert all(b.attn.encoding is single.encoding for b in single.blocks)
    listed = TinyLM(["rope"] * 3, d_model=D, n_layers=3, n_heads=H).eval()
    assert isinstance(listed.encoding, PerLayer) and listed.encoding.n_layers == 3
    with torch.no_grad():
        torch.testing.assert_close(listed(ids), single(ids))
    shared = Rotary(D // H)
    model = TinyLM(PerLayer([shared, NoPE(), shared], windows=[2, None, 2]), d_model=D,
                   n_layers=3, n_heads=H)
    assert model.blocks[0].attn.encoding is model.blocks[2].attn.encoding is shared
    assert [b.attn.window for b in model.blocks] == [2, None, 2]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("schedule", ["irope", "local_global", "mixed"])
def test_schedule_kv_cache_decoding_equals_full_forward(schedule, backend):
    torch.manual_seed(0)
    if schedule == "mixed":
        enc, kw = ["rope", "t5", "alibi", "nope"], {"encoding_kwargs": None}
    else:
        enc, kw = schedule, {"encoding_kwargs": {"window": 3} if schedule == "local_global"
                             else {"every": 2}}
    model = TinyLM(enc, d_model=D, n_layers=4, n_heads=H, backend=backend, **kw).eval()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        full = model(ids)
        caches = model.new_caches()
        steps = torch.cat([model(ids[:, t : t + 1], caches=caches) for t in range(9)], 1)
        caches = model.new_caches()
        chunks = torch.cat([model(ids[:, a:b], caches=caches) for a, b in ((0, 5), (5, 9))], 1)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunks, full, rtol=1e-4, atol=1e-4)


def test_schedule_bad_input_raises_naming_the_argument():
    with pytest.raises(ValueError, match="every"):
        NoPEEvery(8, every=1)
    with pytest.raises(ValueError, match="pattern"):
        LocalGlobal(8, pattern=1)
    with pytest.raises(TypeError, match="window"):
        LocalGlobal(8, window=None)
    with pytest.raises(ValueError, match="i must be"):
        PerLayer([NoPE()]).layer(1)
    with pytest.raises(ValueError, match="i must be"):
        NoPEEvery(8).layer(-1)
    with pytest.raises(ValueError, match="embeddings"):
        PerLayer([make_encoding("sinusoidal", d_model=D)])
    with pytest.raises(TypeError, match=r"encodings\[1\]"):
        PerLayer([NoPE(), "rope"])
    with pytest.raises(ValueError, match="windows"):
        PerLayer([NoPE(), NoPE()], windows=[1])
    with pytest.raises(ValueError, match="n_layers"):
        TinyLM(["rope", "nope"], d_model=D, n_layers=3, n_heads=H)
    with pytest.raises(ValueError, match="n_layers"):
        TinyLM(PerLayer([NoPE(), NoPE()]), d_model=D, n_layers=3, n_heads=H)
    with pytest.raises(ValueError, match="window"):
        TinyLM("local_global", d_model=D, n_layers=2, n_heads=H, window=4)
    with pytest.raises(TypeError, match="encoding"):
        MultiHeadAttention(D, H, NoPEEvery(D // H))
    with pytest.raises(TypeError, match="encoding"):
        TinyLM([1, 2], d_model=D, n_layers=2, n_heads=H)
    with pytest.raises(ValueError, match="scaling"):
        PerLayer([NoPE()]).set_scaling({"type": "linear", "factor": 2.0})
    assert issubclass(NoPEEvery, LayerSchedule)
