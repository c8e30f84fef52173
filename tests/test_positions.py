"""Batched positions ``[b, s]``: left padding with a KV cache, packed documents.

The contract every real model needs: a left-padded row decoded token by token with a
KV cache gives the logits of the same row decoded alone without padding, and a row
of packed documents gives the logits of each document run alone; for every encoding
and every backend.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tutorial_pkg import backends
from tutorial_pkg.attention.positions import positions_from_documents, positions_from_padding
from tutorial_pkg.models.tiny_lm import TinyLM

BACKENDS = ["naive", "sdpa", "auto",
            pytest.param("flex", marks=pytest.mark.skipif(not backends.flex_available()[0],
                                                          reason="FlexAttention unavailable"))]

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex backend falls back to sdpa"),
    pytest.mark.usefixtures("one_thread"),
]


# per-layer schedules sized so that both kinds of layer occur in 2 layers, the window
# (3 tokens) shorter than the rows; T5's bias initialised large enough to matter
SCHEDULE_KWARGS = {"irope": {"every": 2}, "local_global": {"pattern": 2, "window": 3},
                   "t5": {"init_std": 1.0}}


def tiny(encoding: str, backend: str) -> TinyLM:
    model = TinyLM(encoding, d_model=32, n_layers=2, n_heads=4, max_positions=64, backend=backend,
                   n_kv_heads=2, seed=3, encoding_kwargs=SCHEDULE_KWARGS.get(encoding))
    return model.eval()


def test_positions_from_padding_counts_real_tokens():
    pad = torch.tensor([[True, True, False, False, False], [False, False, False, True, True]])
    assert positions_from_padding(pad).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 0, 0]]
    with pytest.raises(TypeError, match="key_padding_mask"):
        positions_from_padding(pad.long())


def test_positions_from_documents_restart_per_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert positions_from_documents(docs).tolist() == [[0, 1, 2, 0, 1, 0], list(range(6))]
    with pytest.raises(TypeError, match="document_ids"):
        positions_from_documents(docs.float())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("encoding", ["rope", "alibi", "hybrid", "sinusoidal", "learned", "nope",
                                      "t5", "irope", "local_global"])
def test_left_padded_decoding_with_kv_cache_equals_each_row_alone(encoding, backend):
    torch.manual_seed(0)
    model = tiny(encoding, backend)
    lengths, total, new = (3, 6), 6, 3  # prompts of 3 and 6 tokens, then 3 decoded tokens
    rows = [torch.randint(0, 256, (n + new,)) for n in lengths]
    ids = torch.zeros(2, total + new, dtype=torch.long)
    pad = torch.ones(2, total + new, dtype=torch.bool)
    for r, row in enumerate(rows):  # left padding
        ids[r, total - lengths[r]:] = row
        pad[r, total - lengths[r]:] = False
    positions = positions_from_padding(pad)
    with torch.no_grad():
        alone = [model(row[None])[0] for row in rows]
        # prefill the padded prompts in one call, then one token at a time
        caches = model.new_caches()
        logits = [model(ids[:, :total], positions=positions[:, :total], caches=caches,
                        key_padding_mask=pad[:, :total])]
        for t in range(total, total + new):
            logits.append(model(ids[:, t:t + 1], positions=positions[:, t:t + 1],
                                caches=caches, key_padding_mask=pad[:, :t + 1]))
        batched = torch.cat(logits, dim=1)
        # and token by token from the first token, padding included
        caches = model.new_caches()
        steps = torch.cat([model(ids[:, t:t + 1], positions=positions[:, t:t + 1],
                                 caches=caches, key_padding_mask=pad[:, :t + 1])
                           for t in range(total + new)], dim=1)
    for r in range(2):
        real = ~pad[r]
        torch.testing.assert_close(batched[r, real], alone[r], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(steps[r, real], alone[r], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(batched).all() and torch.isfinite(steps).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("encoding", ["rope", "alibi", "hybrid", "sinusoidal", "learned", "nope",
                                      "t5", "irope", "local_global"])
def test_packed_documents_equal_each_document_alone(encoding, backend):
    torch.manual_seed(0)
    model = tiny(encoding, backend)
    lengths = (4, 7, 3)
    docs = [torch.randint(0, 256, (n,)) for n in lengths]
    ids = torch.cat(docs)[None]
    document_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    positions = positions_from_documents(document_ids)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="flex backend falls back", category=RuntimeWarning)
        packed = model(ids, positions=positions, document_ids=document_ids)[0]  # no fallback
    with torch.no_grad():
        alone = torch.cat([model(doc[None])[0] for doc in docs])
        # the same with a KV cache: two chunks, the cut inside the second document
        caches = model.new_caches()
        chunks = [model(ids[:, a:b], positions=positions[:, a:b], caches=caches,
                        document_ids=document_ids[:, a:b]) for a, b in ((0, 6), (6, 14))]
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(chunks, dim=1)[0], alone, rtol=1e-4, atol=1e-4)


def test_batched_positions_per_row_equal_shared_positions():
    # [b, s] positions with equal rows == (s,) positions, on every backend
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 9))
    for backend in ("naive", "sdpa", "auto"):
        model = tiny("hybrid", backend)
        with torch.no_grad():
            shared = model(ids, positions=torch.arange(5, 14))
            per_row = model(ids, positions=torch.arange(5, 14).expand(2, -1))
        torch.testing.assert_close(per_row, shared)
