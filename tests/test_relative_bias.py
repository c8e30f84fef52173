"""T5's relative bias (tutorial_pkg.encodings.relative_bias): the bucket function equals an
independent transcription of Hugging Face's ``T5Attention._relative_position_bucket``; the bias, its
Flex ``score_mod`` and its gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

from tutorial_pkg.attention.layer import MultiHeadAttention
from tutorial_pkg.encodings.registry import make_encoding
from tutorial_pkg.encodings.relative_bias import T5RelativeBias, t5_relative_position_bucket
from tutorial_pkg.models.tiny_lm import TinyLM

from .layer_cases import (
    LAYER_MARKS,
    D,
    H,
    encoding,
    x_of,
)

pytestmark = LAYER_MARKS


# --------------------------------------------------------------------------- T5
def hf_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """Hugging Face's T5Attention._relative_position_bucket, transcribed independently."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
    )
    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 64), (8, 20), (64, 33)])
def test_t5_bucket_equals_hugging_faces(bidirectional, num_buckets, max_distance):
    grid = torch.cat([torch.arange(-600, 601), torch.tensor([-100_000, 100_000])])
    ours = t5_relative_position_bucket(grid, bidirectional=bidirectional,
                                       num_buckets=num_buckets, max_distance=max_distance)
    assert torch.equal(ours, hf_bucket(grid, bidirectional, num_buckets, max_distance))
    assert ours.min() == 0 and ours.max() == num_buckets - 1
    # the last bucket of each direction is reached at max_distance and kept beyond
    per_direction = num_buckets // 2 if bidirectional else num_buckets
    assert ours[grid <= -max_distance].unique().tolist() == [per_direction - 1]
    assert ours[grid >= max_distance].unique().tolist() == [num_buckets - 1 if bidirectional
                                                             else 0]


def test_t5_bucket_of_a_2d_grid_of_positions():
    q, k = torch.arange(300)[:, None], torch.arange(300)[None, :]
    assert torch.equal(t5_relative_position_bucket(k - q), hf_bucket(k - q))
    assert torch.equal(t5_relative_position_bucket(k - q, bidirectional=False),
                       hf_bucket(k - q, bidirectional=False))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bias_is_the_learned_value_of_each_bucket(bidirectional):
    enc = T5RelativeBias(3, bidirectional=bidirectional, init_std=1.0)
    weight = enc.relative_attention_bias.weight  # (num_buckets, n_heads), HF's layout
    assert weight.shape == (32, 3) and weight.requires_grad
    q_pos = torch.tensor([0, 5, 140, 400])
    k_pos = torch.tensor([0, 3, 5, 150, 399, 1000])
    bias = enc.bias(q_pos, k_pos)
    assert bias.shape == (3, 4, 6) and bias.dtype == torch.float32
    want = weight[hf_bucket(k_pos[None] - q_pos[:, None], bidirectional)].permute(2, 0, 1)
    torch.testing.assert_close(bias, want, rtol=0, atol=0)
    batched = enc.bias(torch.stack([q_pos, q_pos + 7]), torch.stack([k_pos, k_pos + 7]))
    assert batched.shape == (2, 3, 4, 6)
    torch.testing.assert_close(batched[0], bias, rtol=0, atol=0)
    torch.testing.assert_close(batched[1], bias, rtol=0, atol=0)  # relative: shift invariant
    score_mod = enc.score_mod(q_offset=2)  # query index i sits at position i + 2
    got = score_mod(torch.zeros(()), 0, torch.tensor(1), torch.tensor(0), torch.tensor(150))
    torch.testing.assert_close(got, enc.bias(torch.tensor([2]), torch.tensor([150]))[1, 0, 0])


def test_t5_scores_are_scaled_content_plus_unscaled_bias():
    # score = q.k / sqrt(d_h) + b: the content term is scaled as for every encoding,
    # the learned bias is added as it is (module docs)
    torch.manual_seed(0)
    attn = MultiHeadAttention(D, H, encoding("t5"), backend="naive").eval()
    x = x_of(5, b=1, s=6)
    with torch.no_grad():
        _, weights = attn(x, return_weights=True)
        q = attn.q_proj(x).view(1, 6, H, D // H).transpose(1, 2)
        k = attn.k_proj(x).view(1, 6, H, D // H).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // H) + attn.encoding.bias(
            torch.arange(6), torch.arange(6))
        scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(weights, scores.softmax(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["naive", "sdpa", "auto"])
def test_t5_learns_per_head_parameters_through_every_backend(backend):
    torch.manual_seed(0)
    model = TinyLM("t5", d_model=D, n_layers=2, n_heads=H, backend=backend)
    assert model.blocks[0].attn.encoding is model.blocks[1].attn.encoding  # shared, as in T5
    ids = torch.randint(0, 256, (2, 12))
    model.loss(ids[:, :-1], ids[:, 1:]).backward()
    grad = model.encoding.relative_attention_bias.weight.grad
    assert grad is not None and torch.isfinite(grad).all()
    # 11 tokens, causal: buckets 0..10 are used (one per distance), by every head
    assert (grad[:11].abs() > 0).all() and (grad[11:] == 0).all()


def test_t5_bad_input_raises_naming_the_argument():
    with pytest.raises(TypeError, match="relative_position"):
        t5_relative_position_bucket(torch.tensor([0.5]))
    with pytest.raises(ValueError, match="num_buckets"):
        t5_relative_position_bucket(torch.tensor([1]), num_buckets=3)  # 1 per direction
    with pytest.raises(ValueError, match="max_distance"):
        t5_relative_position_bucket(torch.tensor([1]), num_buckets=32, max_distance=8)
    with pytest.raises(TypeError, match="bidirectional"):
        T5RelativeBias(4, bidirectional=1)
    with pytest.raises(ValueError, match="n_heads"):
        T5RelativeBias(0)
    with pytest.raises(ValueError, match="init_std"):
        T5RelativeBias(4, init_std=0.0)
    with pytest.raises(ValueError, match="n_heads"):
        make_encoding("t5")
    with pytest.raises(ValueError, match="q_pos and k_pos"):
        T5RelativeBias(4).score_mod(0, torch.zeros(1, 3, dtype=torch.long), None)
    with pytest.raises(ValueError, match="n_heads"):  # declared n_heads checked by attention
        MultiHeadAttention(D, H, T5RelativeBias(H + 1))
