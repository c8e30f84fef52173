"""Evaluations that measure context: the same targets at every length, with intervals.

:func:`~tutorial_pkg.experiments.evaluation.evaluate` scores the last quarter of each window; at
``m * L`` those are different tokens for each ``m``, so text difficulty mixes with context.
This module adds, alongside it (its results are unchanged):

* :func:`fixed_target_windows` / :func:`evaluate_fixed_targets`: for each of ``n_blocks``
  target blocks of ``T`` tokens, a window of ``N`` tokens that **ends with the same ``T``
  targets** for every evaluation length ``N``: ``N - T`` tokens of context before them. Only the
  context grows; the scored tokens are identical at every ``N``.
* :func:`all_token_perplexity`: perplexity over **all** tokens of non-overlapping windows of
  ``N`` tokens, the measure of Press et al.'s ALiBi paper, with a per-window NLL for intervals.

Both give a bootstrap interval over blocks
(:func:`~tutorial_pkg.experiments.stats.bootstrap_interval`,
fixed seed): the evaluation-set noise of each mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .._checks import check_nonneg_int, check_positive_int, check_positive_ints
from ..models.tiny_lm import TinyLM
from .evaluation import check_evaluation, evaluation_blocks, nll_by_length
from .stats import bootstrap_interval

__all__ = ["fixed_target_windows", "evaluate_fixed_targets", "all_token_perplexity"]


def fixed_target_windows(
    heldout_ids: torch.Tensor,
    lengths: Sequence[int],
    target_len: int,
    n_blocks: int,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Windows of each length ``N`` that end with the same ``target_len`` targets.

    ``n_blocks`` blocks of ``max(lengths)`` tokens, evenly spaced over the held-out text
    (:func:`~tutorial_pkg.experiments.evaluation.evaluation_blocks`); the window of length ``N`` is
    the last ``N`` tokens of each block, so its last ``target_len`` targets are the same for every
    ``N`` and only the ``N - target_len`` tokens of context before them change.

    Returns:
        ``{N: (x, y)}``, int64 ``[n_blocks, N]``; ``y`` is ``x`` shifted by one, and
        ``y[:, -target_len:]`` is the same tensor for every ``N``.

    Raises:
        TypeError, ValueError: for non-positive sizes, a length below ``target_len`` or too
            little held-out text.
    """
    lengths = check_positive_ints("lengths", lengths)
    check_positive_int("target_len", target_len)
    check_positive_int("n_blocks", n_blocks)
    if min(lengths) < target_len:
        raise ValueError(f"every length must be >= target_len ({target_len}), got {min(lengths)}")
    longest = max(lengths)
    x, y = evaluation_blocks(heldout_ids, longest, n_blocks * longest)
    if x.shape[0] < n_blocks:
        raise ValueError(f"the held-out text holds only {x.shape[0]} blocks of {longest} tokens")
    return {n: (x[:, longest - n :], y[:, longest - n :]) for n in lengths}


def _interval(per_block: torch.Tensor, seed: int) -> dict:
    r = bootstrap_interval(per_block, seed=seed)
    return {"ppl": math.exp(r["mean"]), "ppl_low": math.exp(r["low"]),
            "ppl_high": math.exp(r["high"]), "nll": r["mean"]}


def _prepare(model, train_len, multiples, scaling, batch_tokens, seed):
    multiples = check_evaluation(model, train_len, multiples, scaling, batch_tokens)
    check_nonneg_int("seed", seed)
    return multiples


_MEASURES = {"nll": None, "ppl": None, "ppl_low": None, "ppl_high": None, "nll_by_block": None}


@torch.no_grad()
def evaluate_fixed_targets(
    model: TinyLM,
    heldout_ids: torch.Tensor,
    train_len: int,
    multiples: Sequence[int] = (1, 2, 4, 8),
    scaling: str | None = None,
    *,
    target_len: int | None = None,
    n_blocks: int = 32,
    batch_tokens: int = 8192,
    amp: bool = False,
    seed: int = 0,
    encoding_name: str | None = None,
) -> list[dict]:
    """Perplexity of the **same targets** at every length ``N = m * train_len``.

    For each of ``n_blocks`` target blocks of ``T = target_len`` tokens (default
    ``train_len // 4``, at least 1), the model reads a window of ``N`` tokens ending with
    the block (:func:`fixed_target_windows`) and only the last ``T`` predictions are scored.
    The scored tokens are the same at every ``N``; their positions are not: every window
    starts at position 0, so the targets sit at positions ``N - T`` to ``N - 1``. A change
    of perplexity with ``N`` is therefore a change of the context before the targets *and*
    of the positions they are predicted at (for a relative encoding, of the largest
    query-key distance). Runs in ``model.eval()`` (the previous mode is restored).

    Args:
        model, heldout_ids, train_len, multiples, scaling, batch_tokens, amp, encoding_name:
            as :func:`~tutorial_pkg.experiments.evaluation.evaluate`.
        target_len: ``T``, scored tokens per block (``<= train_len``).
        n_blocks: target blocks (the bootstrap resamples them).
        seed: seed of the bootstrap.

    Returns:
        A list with a record per multiple, of keys ``encoding``, ``scaling``, ``factor``,
        ``train_len``, ``eval_len`` (``N``), ``ratio``, ``context_len`` (``N - T``), ``target_len``,
        ``n_blocks``, ``n_tokens`` (``n_blocks * T``), ``nll``, ``ppl``, ``ppl_low``, ``ppl_high``
        (95 % bootstrap over blocks), ``nll_by_block`` (list) and ``note``; the measures are
        ``None`` where the encoding cannot represent ``N`` positions.
    """
    multiples = _prepare(model, train_len, multiples, scaling, batch_tokens, seed)
    t = max(1, train_len // 4) if target_len is None else check_positive_int("target_len",
                                                                             target_len)
    if t > train_len:
        raise ValueError(f"target_len ({t}) must be <= train_len ({train_len})")
    lengths = [m * train_len for m in multiples]
    windows = fixed_target_windows(heldout_ids, lengths, t, n_blocks)
    records = []
    for record, nll in nll_by_length(model, train_len, multiples, scaling, windows.__getitem__,
                                     batch_tokens=batch_tokens, amp=amp,
                                     encoding_name=encoding_name):
        note = record.pop("note")
        record.update(context_len=record["eval_len"] - t, target_len=t, n_blocks=n_blocks,
                      n_tokens=n_blocks * t, **_MEASURES, note=note)
        if nll is not None:
            per_block = nll[:, -t:].mean(dim=1)
            record.update(_interval(per_block, seed), nll_by_block=per_block.tolist())
        records.append(record)
    return records


@torch.no_grad()
def all_token_perplexity(
    model: TinyLM,
    heldout_ids: torch.Tensor,
    train_len: int,
    multiples: Sequence[int] = (1, 2, 4, 8),
    scaling: str | None = None,
    *,
    eval_tokens: int = 16384,
    batch_tokens: int = 8192,
    amp: bool = False,
    seed: int = 0,
    encoding_name: str | None = None,
) -> list[dict]:
    """All-token perplexity on non-overlapping windows of ``N = m * train_len`` tokens.

    The measure of the ALiBi paper's extrapolation tables (every token of each window
    scored, windows not overlapping); the same tokens as ``ppl_all`` of
    :func:`~tutorial_pkg.experiments.evaluation.evaluate` for the same ``eval_tokens``. The interval
    resamples the blocks of ``max(multiples) * train_len`` tokens, the unit every length
    shares.

    Returns:
        A list with a record per multiple, of keys ``encoding``, ``scaling``, ``factor``,
        ``train_len``, ``eval_len``, ``ratio``, ``n_windows``, ``n_tokens``, ``nll``, ``ppl``,
        ``ppl_low``, ``ppl_high``, ``nll_by_block`` and ``note`` (``None`` measures where ``N``
        cannot be represented).
    """
    multiples = _prepare(model, train_len, multiples, scaling, batch_tokens, seed)
    longest = max(multiples) * train_len
    x_blocks, y_blocks = evaluation_blocks(heldout_ids, longest, eval_tokens)
    n_blocks = x_blocks.shape[0]
    records = []
    for record, nll in nll_by_length(
        model, train_len, multiples, scaling,
        lambda n: (x_blocks.reshape(-1, n), y_blocks.reshape(-1, n)),
        batch_tokens=batch_tokens, amp=amp, encoding_name=encoding_name,
    ):
        note = record.pop("note")
        measured = nll is not None
        record.update(n_windows=x_blocks.numel() // record["eval_len"] if measured else 0,
                      n_tokens=x_blocks.numel() if measured else 0, **_MEASURES, note=note)
        if measured:
            per_block = nll.reshape(n_blocks, longest).mean(dim=1)
            record.update(_interval(per_block, seed), nll_by_block=per_block.tolist())
            record["nll"] = nll.mean().item()  # the exact mean over all tokens
            record["ppl"] = math.exp(record["nll"])
        records.append(record)
    return records
