"""Does a model use distant context? A copy test with a positive control. Chapter 7.

Flat perplexity past the training length says a model is not *hurt* by a long input;
it does not say the model *uses* it. :func:`retrieval_test` asks directly: a segment
appears, then filler, then the same segment again ``d`` tokens after the first; a
model that can look back ``d`` tokens predicts the repeat almost perfectly. A control
window with the same tokens at the same positions but nothing to copy cancels every
position effect, so the difference of the two losses measures retrieval alone.
:func:`copy_distances` gives the distances chapter 7 tests.

Example:
    >>> from tutorial_pkg.experiments.data import load_splits
    >>> from tutorial_pkg.models.tiny_lm import TinyLM
    >>> _, heldout = load_splits()
    >>> model = TinyLM("alibi", d_model=32, n_layers=1, n_heads=2)
    >>> records = retrieval_test(model, heldout, copy_distances(16), segment_len=4)
    >>> [r["distance"] for r in records]
    [8, 32, 64, 124]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .._checks import check_nonneg_int, check_positive_int
from ..models.tiny_lm import TinyLM

__all__ = ["copy_distances", "retrieval_test"]


def copy_distances(train_len: int, segment_len: int | None = None) -> tuple[int, ...]:
    """The copy distances chapter 7 tests: ``L/2`` (inside ``L``), ``2L``, ``4L`` and ``8L - s``.

    ``s = segment_len`` (default ``L // 4``); the longest window, ``8L - s + s = 8L``, is the
    longest evaluation length of :class:`~tutorial_pkg.experiments.training.ExperimentConfig`'s
    default multiples.

    Raises:
        TypeError, ValueError: if ``train_len`` or ``segment_len`` is not a positive int.
    """
    check_positive_int("train_len", train_len)
    s = train_len // 4 if segment_len is None else check_positive_int("segment_len", segment_len)
    return (train_len // 2, 2 * train_len, 4 * train_len, 8 * train_len - s)


def _check_distances(distances: Sequence[int], s: int) -> tuple[int, ...]:
    if isinstance(distances, (str, bytes)) or not isinstance(distances, Sequence) or not distances:
        raise TypeError(f"distances must be a non-empty sequence of ints, got {distances!r}")
    distances = tuple(check_positive_int("distances[i]", d) for d in distances)
    for d in distances:
        if d < s:
            raise ValueError(f"distances must be >= segment_len ({s}), got {d}")
    return distances


@torch.no_grad()
def retrieval_test(
    model: TinyLM,
    heldout_ids: torch.Tensor,
    distances: Sequence[int],
    *,
    segment_len: int = 16,
    n_trials: int = 64,
    batch_tokens: int = 8192,
    seed: int = 0,
    encoding_name: str | None = None,
    window_len: int | None = None,
) -> list[dict]:
    """Can the model copy a segment it saw ``d`` tokens earlier? A copy test past ``L``.

    For each distance ``d`` and each of ``n_trials`` trials, three held-out chunks are
    drawn (a segment ``A`` and a control segment ``B`` of ``segment_len = s`` tokens,
    a filler of ``d - s`` tokens) and two windows of ``d + s`` tokens are scored:

    * **copy**: ``A + filler + A``: the second ``A`` repeats the first, ``d`` tokens back;
    * **control**: ``B + filler + A``: the same tokens at the same positions, nothing to copy.

    The scored targets are the last ``s - 1`` tokens of the second ``A`` (its first token
    cannot be known to start a copy). With the default ``window_len=None`` the window is
    ``d + s`` tokens, so the scored tokens sit at positions ``d + 1 .. d + s - 1``: a longer
    distance is also a later position. A fixed ``window_len`` (``>= max(distances) + s``)
    puts ``window_len - d - s`` filler tokens in front of the first segment, so that the
    scored tokens sit at the end of the window at every distance: the distance changes,
    the positions do not. A model that retrieves from ``d`` tokens back
    predicts them far better in the copy window (``nll_copy`` near 0) than in the control
    window, whose loss is the ordinary language-model loss: ``gain = nll_control -
    nll_copy`` (nats per token) measures retrieval, with position effects cancelled.
    The chunks come from a ``torch.Generator`` seeded with ``seed``, so every model sees
    the same windows. Runs in ``model.eval()`` under ``torch.no_grad()``; the previous
    mode is restored.

    Args:
        model: a trained :class:`~tutorial_pkg.models.tiny_lm.TinyLM` (on any device; the windows
            are moved to it).
        heldout_ids: ``(N,)`` integer held-out tokens on the CPU, ``N > max(distances) + 2 s``.
        distances: copy distances ``d >= s`` (ints).
        segment_len: ``s``, tokens per segment (``>= 2``).
        n_trials: windows per distance and kind.
        batch_tokens: tokens per forward pass.
        seed: seed (int >= 0) of the chunk positions.
        encoding_name: name written in the records (default: the encoding's ``name``).
        window_len: the length of every window (default ``d + s``, see above).

    Returns:
        A list with one record (dict) per distance, with the keys ``encoding``,
        ``distance``, ``window_len``, ``first_position`` (of the first segment),
        ``segment_len``, ``n_trials``, ``nll_copy``,
        ``nll_control``, ``gain``, ``acc_copy``, ``acc_control`` (top-1 accuracy of the
        scored tokens; floats) and ``note``.
        Where the encoding cannot represent the window (its ``max_positions``, see
        :func:`~tutorial_pkg.experiments.evaluation.position_limit`) the measures are ``None`` and
        ``note`` says why.

    Raises:
        TypeError: for a ``model`` that is not a TinyLM, ``heldout_ids`` that is not a
            1-D tensor, or a non-int size.
        ValueError: for a size out of range or ``heldout_ids`` too short.
    """
    if not isinstance(model, TinyLM):
        raise TypeError(f"model must be a TinyLM, got {type(model).__name__}")
    if not isinstance(heldout_ids, torch.Tensor) or heldout_ids.dim() != 1:
        raise TypeError("heldout_ids must be a 1-D tensor of token ids")
    s = check_positive_int("segment_len", segment_len)
    if s < 2:
        raise ValueError(f"segment_len must be >= 2, got {s}")
    distances = _check_distances(distances, s)
    check_positive_int("n_trials", n_trials)
    check_positive_int("batch_tokens", batch_tokens)
    check_nonneg_int("seed", seed)
    if window_len is not None:
        check_positive_int("window_len", window_len)
        if window_len < max(distances) + s:
            raise ValueError(f"window_len must be >= max(distances) + segment_len "
                             f"({max(distances) + s}), got {window_len}")
    n = heldout_ids.numel()
    if n <= max(window_len or 0, max(distances) + s) + s:
        raise ValueError(
            f"heldout_ids has {n} tokens; the longest test needs more than "
            f"{max(distances) + 2 * s}"
        )
    name = encoding_name or model.encoding.name
    device = next(model.parameters()).device
    limit = model.encoding.max_positions  # declared by the encoding (None: any position)
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    records = []
    try:
        for d in distances:
            window = d + s if window_len is None else window_len
            p = window - d - s  # filler in front of the first segment
            record = {"encoding": name, "distance": d, "window_len": window,
                      "first_position": p, "segment_len": s,
                      "n_trials": n_trials, "nll_copy": None, "nll_control": None,
                      "gain": None, "acc_copy": None, "acc_control": None, "note": ""}
            # chunk starts are drawn for every distance, so the draws do not depend on
            # which distances a model can represent
            starts = torch.randint(0, n - window, (n_trials, 3), generator=gen)
            if limit is not None and window > limit:
                record["note"] = f"cannot represent positions >= {limit}"
                records.append(record)
                continue
            ar = torch.arange(window)
            base = heldout_ids[starts[:, :1] + ar]  # filler around the segments
            seg_a = heldout_ids[starts[:, 1:2] + torch.arange(s)]
            seg_b = heldout_ids[starts[:, 2:3] + torch.arange(s)]
            copy = base.clone()
            copy[:, p : p + s], copy[:, p + d :] = seg_a, seg_a
            control = copy.clone()
            control[:, p : p + s] = seg_b
            x_all = torch.cat([copy, control]).long()
            rows = max(1, batch_tokens // window)
            nll, hit = [], []
            for i in range(0, x_all.shape[0], rows):
                xb = x_all[i : i + rows].to(device)
                # predict the tokens p+d+1 .. p+d+s-1 (the second A after its first token)
                logits = model(xb[:, :-1])[:, p + d :].float()
                target = xb[:, p + d + 1 :]
                nll.append(F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
                           .double().cpu())
                hit.append((logits.argmax(-1) == target).double().cpu())
            nll_t, hit_t = torch.cat(nll), torch.cat(hit)
            record.update(
                nll_copy=nll_t[:n_trials].mean().item(),
                nll_control=nll_t[n_trials:].mean().item(),
                acc_copy=hit_t[:n_trials].mean().item(),
                acc_control=hit_t[n_trials:].mean().item(),
            )
            record["gain"] = record["nll_control"] - record["nll_copy"]
            records.append(record)
    finally:
        model.train(was_training)
    return records
