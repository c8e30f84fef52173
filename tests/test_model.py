"""Tests of tutorial_pkg.models.tiny_lm.TinyLM: shapes, shared initial weights, training, KV
cache."""

from __future__ import annotations

import pytest
import torch

from tutorial_pkg import backends, make_encoding
from tutorial_pkg.models.tiny_lm import TinyLM

NAMES = ["nope", "sinusoidal", "learned", "rope", "alibi", "hybrid"]
SMALL = dict(d_model=32, n_layers=2, n_heads=4, max_positions=32)


def tiny(name, **kw):
    return TinyLM(name, **{**SMALL, **kw})


def ids(b=2, s=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, s), generator=g)


@pytest.mark.parametrize("name", NAMES)
def test_logits_shape_and_finite(name):
    model = tiny(name)
    x = ids(3, 10)
    logits = model(x)
    assert logits.shape == (3, 10, 256)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    loss = model.loss(x, ids(3, 10, seed=1))
    assert loss.dim() == 0 and torch.isfinite(loss)


def _shared_state(model):
    # the encoding's own tensors (a learned table, RoPE caches) are not shared by design
    return {k: v for k, v in model.state_dict().items() if "encoding" not in k}


def test_same_initial_weights_across_encodings():
    ref = _shared_state(tiny("nope", seed=3))
    for name in NAMES[1:]:
        state = _shared_state(tiny(name, seed=3))
        assert state.keys() == ref.keys(), name
        for k in ref:
            assert torch.equal(state[k], ref[k]), (name, k)
    other = _shared_state(tiny("nope", seed=4))
    assert not torch.equal(other["tok_emb.weight"], ref["tok_emb.weight"])


def test_construction_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny("learned")
    assert torch.equal(torch.rand(3), expected)


def test_output_head_is_tied_to_embedding():
    model = tiny("rope")
    x = ids(1, 5)
    h = model.norm(model.blocks[1](model.blocks[0](model.tok_emb(x))))
    torch.testing.assert_close(model(x), h @ model.tok_emb.weight.T)


@pytest.mark.parametrize("name", ["rope", "alibi", "learned"])
def test_loss_decreases_over_a_few_steps(name):
    torch.manual_seed(0)
    model = tiny(name, n_layers=1)
    x = ids(4, 16, seed=5)
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["naive", "sdpa", "auto"])
def test_kv_cache_decoding_equals_full_forward(name, backend):
    torch.manual_seed(0)
    model = tiny(name, backend=backend).eval()
    x = ids(2, 14, seed=2)
    with torch.no_grad():
        full = model(x)
        # a 5-token prefill, then one token at a time
        caches = model.new_caches()
        steps = [model(x[:, :5], caches=caches)]
        steps += [model(x[:, t : t + 1], caches=caches) for t in range(5, 14)]
    assert all(c.length == 14 for c in caches)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["sinusoidal", "rope", "alibi", "hybrid"])
def test_explicit_positions_equal_default(name):
    model = tiny(name).eval()
    x = ids(1, 9)
    with torch.no_grad():
        torch.testing.assert_close(model(x, positions=torch.arange(9)), model(x))


@pytest.mark.parametrize("name", NAMES)
def test_attention_weights_rows_sum_to_one_and_causal(name):
    model = tiny(name)
    x = ids(2, 11)
    for layer in (0, -1):
        w = model.attention_weights(x, layer=layer)
        assert w.shape == (2, 4, 11, 11)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 11))
        future = torch.triu(torch.ones(11, 11, dtype=torch.bool), diagonal=1)
        assert (w[..., future] == 0).all()
        assert (w >= 0).all()


def test_attention_weights_match_the_layer_output():
    # the weights returned are the ones the layer uses: weights @ v reproduces attention
    model = tiny("alibi")
    x = ids(1, 7)
    w = model.attention_weights(x, layer=1)
    with torch.no_grad():
        h = model.encoding.embed(model.tok_emb(x), torch.arange(7))
        h = model.blocks[0](h)
        block = model.blocks[1]
        n = block.norm1(h)
        attn = block.attn
        v = attn.v_proj(n).view(1, 7, 4, 8).transpose(1, 2)
        out = attn.out_proj((w @ v).transpose(1, 2).reshape(1, 7, 32))
        torch.testing.assert_close(out, attn(n), atol=1e-5, rtol=1e-5)


def test_learned_refuses_positions_past_max_positions():
    model = tiny("learned", max_positions=8)
    model(ids(1, 8))
    with pytest.raises(ValueError, match="max_positions"):
        model(ids(1, 9))


def test_encoding_instance_accepted():
    enc = make_encoding("alibi", n_heads=4)
    model = TinyLM(enc, d_model=32, n_layers=1, n_heads=4)
    assert model.encoding is enc
    assert model(ids(1, 4)).shape == (1, 4, 256)


def test_bad_inputs_raise():
    model = tiny("rope")
    with pytest.raises(TypeError, match="ids"):
        model(torch.rand(1, 4))
    with pytest.raises(TypeError, match="ids"):
        model([[1, 2, 3]])
    with pytest.raises(ValueError, match="ids"):
        model(torch.arange(4))
    with pytest.raises(TypeError, match="ids"):
        model.attention_weights(torch.rand(1, 4))
    with pytest.raises(ValueError, match="layer"):
        model.attention_weights(ids(1, 4), layer=2)
    with pytest.raises(TypeError, match="encoding"):
        TinyLM(3.0, d_model=32, n_heads=4)
    with pytest.raises(ValueError, match="name"):
        TinyLM("absolute", d_model=32, n_heads=4)
    with pytest.raises(ValueError, match="n_layers"):
        TinyLM("rope", d_model=32, n_heads=4, n_layers=0)
    with pytest.raises(ValueError, match="divisible"):
        TinyLM("rope", d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="max_positions"):
        TinyLM("learned", d_model=32, n_heads=4)
    with pytest.raises(ValueError, match="max_positions"):  # one per model, not per encoding
        TinyLM("rope", d_model=32, n_heads=4, encoding_kwargs={"max_positions": 8})


def test_default_backend_is_the_attention_default():
    # the same default as MultiHeadAttention: ALiBi adds a key row, no (H, L, L) table is held
    model = TinyLM("alibi", d_model=32, n_heads=4, n_layers=1)
    assert model.blocks[0].attn.backend == "auto"
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 300)))
    held = backends.cached_tensors(model.blocks[0].attn.encoding)
    assert held and all(t.shape[-2] == 1 for t in held)  # key rows only


def test_a_schedule_by_name_or_instance_gives_each_layer_its_encoding():
    from tutorial_pkg import NoPEEvery, PositionEncoding, Rotary
    from tutorial_pkg.encodings.schedules import LayerSchedule

    by_name = tiny("irope", n_layers=4)
    assert isinstance(by_name.encoding, LayerSchedule)
    assert not isinstance(by_name.encoding, PositionEncoding)  # a schedule is not an encoding
    kinds = [type(block.attn.encoding).__name__ for block in by_name.blocks]
    assert kinds == ["Rotary", "Rotary", "Rotary", "NoPE"]
    # an instance built from a shared RoPE part gives the same model, bit for bit
    instance = tiny(NoPEEvery(Rotary(SMALL["d_model"] // SMALL["n_heads"])), n_layers=4)
    x = ids()
    assert torch.equal(by_name(x), instance(x))
