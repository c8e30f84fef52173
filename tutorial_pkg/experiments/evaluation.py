"""Perplexity by length: the same held-out tokens scored at many lengths. Chapter 7.

* :func:`evaluate` scores the **same held-out tokens** at every length ``m * train_len``
  (:func:`evaluation_blocks`), over all tokens and over the **last quarter** of each
  window, where every position is past the familiar ones.
* RoPE scaling rules are applied **at evaluation only**, with ``factor = eval_len /
  train_len``, and the original rule is restored afterwards (:func:`scaled_rope`).
* :func:`nll_by_length` is the loop every evaluation by length runs (this module's
  :func:`evaluate` and :mod:`~tutorial_pkg.experiments.context_eval`'s fixed-target and
  all-token measures): the windows of each length scored under its rule, in eval mode.

An encoding that cannot represent a position (:func:`position_limit`) gets ``None``
perplexities and a ``note`` for those lengths: the run neither crashes nor reports numbers
it did not measure. :mod:`~tutorial_pkg.experiments.training` trains the models and
re-exports these names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .._checks import check_choice, check_positive_int, check_positive_ints
from ..models.tiny_lm import TinyLM
from .data import eval_windows

__all__ = [
    "SCALING_TYPES",
    "autocast",
    "position_limit",
    "scaling_for",
    "check_scalable",
    "scaled_rope",
    "evaluation_blocks",
    "token_nll",
    "check_evaluation",
    "nll_by_length",
    "evaluate",
]

#: RoPE scaling rules an evaluation can apply (``scaling=``).
SCALING_TYPES = ("linear", "ntk", "yarn")


def autocast(amp: bool, device: torch.device):
    """bfloat16 autocast on CUDA when ``amp``; a CPU run stays float32 whatever ``amp``."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp and device.type == "cuda")


def position_limit(model: TinyLM) -> int | None:
    """The number of positions the model's encoding can represent, or ``None`` if unbounded.

    The learned table knows ``max_positions`` positions; a RoPE with ``max_positions`` set
    refuses positions past it. Every other encoding accepts any position.
    """
    return model.encoding.max_positions  # declared by the encoding (None: any position)


def scaling_for(scaling: str | None, eval_len: int, train_len: int) -> dict | None:
    """The RoPE scaling dict for evaluating at ``eval_len`` a model trained at ``train_len``.

    ``factor = eval_len / train_len``: ``"linear"`` (position interpolation, Chen et al.,
    2023), ``"ntk"`` (NTK-aware base change, bloc97), ``"yarn"`` (Peng et al., 2024,
    with ``original_max_position_embeddings = train_len``). ``None``: no scaling.
    """
    if scaling is None:
        return None
    check_choice("scaling", scaling, SCALING_TYPES)
    check_positive_int("eval_len", eval_len)
    check_positive_int("train_len", train_len)
    factor = eval_len / train_len
    if scaling == "yarn":
        return {"type": "yarn", "factor": factor, "original_max_position_embeddings": train_len}
    return {"type": scaling, "factor": factor}


def check_scalable(model: TinyLM) -> None:
    """``ValueError`` unless ``model``'s encoding supports RoPE scaling rules."""
    if not model.encoding.supports_scaling:
        raise ValueError(
            f"scaling applies to encodings with RoPE (rope, hybrid); this model uses "
            f"{getattr(model.encoding, 'name', type(model.encoding).__name__)!r}"
        )


@contextmanager
def scaled_rope(model: TinyLM, scaling: dict | None):
    """Context manager: evaluate ``model`` with a RoPE scaling rule, then restore the old one.

    ``scaling=None`` changes nothing. The previous rule is restored even if the body
    raises, so a later evaluation never runs with a stale scaling.

    Raises:
        ValueError: if ``scaling`` is given and the model's encoding has no RoPE.
    """
    if scaling is None:
        yield model
        return
    check_scalable(model)
    previous = model.encoding.scaling
    model.encoding.set_scaling(scaling)
    try:
        yield model
    finally:
        model.encoding.set_scaling(previous)


def evaluation_blocks(
    heldout_ids: torch.Tensor, block_len: int, eval_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out blocks of ``block_len`` tokens that every evaluation length shares.

    ``eval_tokens // block_len`` non-overlapping blocks, evenly spaced over the
    held-out text (:func:`~tutorial_pkg.experiments.data.eval_windows`). A window length that
    divides ``block_len`` cuts each block into windows, so every length scores
    exactly the same tokens.

    Returns:
        ``(x, y)``: int64 ``[n_blocks, block_len]``; ``y`` is ``x`` shifted by one.
    """
    check_positive_int("block_len", block_len)
    check_positive_int("eval_tokens", eval_tokens)
    if eval_tokens < block_len:
        raise ValueError(f"eval_tokens ({eval_tokens}) must be >= block_len ({block_len})")
    return eval_windows(heldout_ids, block_len, max_windows=eval_tokens // block_len)


@torch.no_grad()
def token_nll(model, x, y, batch_windows, device, amp, bar) -> torch.Tensor:
    """Negative log-likelihood of every target token, ``[W, T]`` float64 on the CPU."""
    out = []
    for i in range(0, x.shape[0], batch_windows):
        xb, yb = x[i : i + batch_windows].to(device), y[i : i + batch_windows].to(device)
        with autocast(amp, device):
            logits = model(xb)
        nll = F.cross_entropy(logits.float().transpose(1, 2), yb, reduction="none")
        out.append(nll.double().cpu())
        bar.update(xb.numel())
    return torch.cat(out)


def check_evaluation(model, train_len: int, multiples, scaling: str | None,
                     batch_tokens: int) -> tuple[int, ...]:
    """The arguments every evaluation by length shares, checked; returns ``multiples``."""
    if not isinstance(model, TinyLM):
        raise TypeError(f"model must be a TinyLM, got {type(model).__name__}")
    check_positive_int("train_len", train_len)
    multiples = check_positive_ints("multiples", multiples)
    if scaling is not None:
        check_choice("scaling", scaling, SCALING_TYPES)
        check_scalable(model)
    check_positive_int("batch_tokens", batch_tokens)
    return multiples


def nll_by_length(
    model: TinyLM,
    train_len: int,
    multiples: Sequence[int],
    scaling: str | None,
    windows: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    *,
    batch_tokens: int,
    amp: bool = False,
    encoding_name: str | None = None,
    bar=None,
) -> Iterator[tuple[dict, torch.Tensor | None]]:
    """The loop of every evaluation by length: for each multiple ``m``, in order,
    ``(record, nll)``.

    ``record`` holds what every evaluation reports of a length ``N = m * train_len``:
    ``encoding``, ``scaling`` (``"none"`` or the rule), ``factor``, ``train_len``,
    ``eval_len``, ``ratio`` and ``note``. ``nll`` is :func:`token_nll` of the windows
    ``windows(N)`` returns (``x, y`` of ``[W, N]``), scored with the scaling rule for ``N``
    (:func:`scaling_for`, removed afterwards), or ``None`` (and ``note`` says why) where the
    encoding cannot represent ``N`` positions (:func:`position_limit`). Runs in
    ``model.eval()`` under ``torch.no_grad()``; the previous mode is restored when the
    loop ends. Arguments are checked by the caller (:func:`check_evaluation`).
    """
    name = encoding_name or model.encoding.name
    device = next(model.parameters()).device
    limit = position_limit(model)
    bar = _NoBar() if bar is None else bar
    was_training = model.training
    model.eval()
    try:
        for m in multiples:
            n = m * train_len
            rule = scaling_for(scaling, n, train_len)
            record = {"encoding": name, "scaling": scaling or "none",
                      "factor": None if rule is None else rule["factor"],
                      "train_len": train_len, "eval_len": n, "ratio": m, "note": ""}
            if limit is not None and n > limit:
                record["note"] = f"cannot represent positions >= {limit}"
                yield record, None
                continue
            x, y = windows(n)
            with scaled_rope(model, rule):
                nll = token_nll(model, x, y, max(1, batch_tokens // n), device, amp, bar)
            yield record, nll
    finally:
        model.train(was_training)


class _NoBar:
    def update(self, n: int) -> None:
        pass


def evaluate(
    model: TinyLM,
    heldout_ids: torch.Tensor,
    train_len: int,
    multiples: Sequence[int] = (1, 2, 4, 8),
    scaling: str | None = None,
    *,
    eval_tokens: int = 16384,
    batch_tokens: int = 8192,
    amp: bool = False,
    encoding_name: str | None = None,
    keep_positions: bool = False,
    progress: bool = False,
) -> list[dict]:
    """Held-out perplexity of ``model`` at ``m * train_len`` tokens for each multiple ``m``.

    Runs in ``model.eval()`` under ``torch.no_grad()`` (the previous mode is restored),
    on batches of windows. The same ``eval_tokens`` held-out tokens are scored at every
    length (see :func:`evaluation_blocks`). For lengths the encoding cannot represent
    (:func:`position_limit`) the perplexities are ``None`` and ``note`` says why.

    Args:
        model: a trained :class:`~tutorial_pkg.models.tiny_lm.TinyLM`.
        heldout_ids: ``(N,)`` held-out tokens.
        train_len: the training length ``L``.
        multiples: evaluation lengths as multiples of ``L``.
        scaling: ``None`` or a RoPE scaling rule in :data:`SCALING_TYPES`, applied with
            ``factor = eval_len / L`` (:func:`scaling_for`) and removed afterwards.
        eval_tokens: tokens scored per length (rounded down to a multiple of the
            longest length).
        batch_tokens: tokens per forward pass.
        amp: bfloat16 autocast on CUDA.
        encoding_name: name written in the records (default: the encoding's ``name``).
        keep_positions: add ``nll_by_position`` (mean NLL at each position, a list of
            ``eval_len`` floats) to each record that was measured.
        progress: show a tqdm progress bar.

    Returns:
        One record (dict) per multiple with keys ``encoding``, ``scaling`` (``"none"`` or
        the rule), ``factor``, ``train_len``, ``eval_len``, ``ratio``, ``ppl_all``,
        ``ppl_last_quarter``, ``nll_all``, ``nll_last_quarter`` (nats per token; ``None``
        where not measurable), ``n_windows``, ``n_tokens``, ``n_tokens_last_quarter``
        and ``note``.
    """
    multiples = check_evaluation(model, train_len, multiples, scaling, batch_tokens)
    name = encoding_name or model.encoding.name
    x_blocks, y_blocks = evaluation_blocks(heldout_ids, max(multiples) * train_len, eval_tokens)
    limit = position_limit(model)
    total = x_blocks.numel() * sum(1 for m in multiples if limit is None or m * train_len <= limit)
    bar = tqdm(total=total, desc=f"eval {name}" + (f" ({scaling})" if scaling else ""),
               unit="tok", unit_scale=True, disable=not progress, mininterval=2.0)
    records = []
    try:
        for record, nll in nll_by_length(
            model, train_len, multiples, scaling,
            lambda n: (x_blocks.reshape(-1, n), y_blocks.reshape(-1, n)),
            batch_tokens=batch_tokens, amp=amp, encoding_name=name, bar=bar,
        ):
            n = record["eval_len"]
            quarter = n - n // 4  # first position of the last quarter
            record.update(ppl_all=None, ppl_last_quarter=None, nll_all=None,
                          nll_last_quarter=None, n_windows=x_blocks.numel() // n,
                          n_tokens=0, n_tokens_last_quarter=0)
            if nll is None:
                record["n_windows"] = 0
            else:
                nll_all, nll_last = nll.mean().item(), nll[:, quarter:].mean().item()
                record.update(
                    ppl_all=math.exp(nll_all), ppl_last_quarter=math.exp(nll_last),
                    nll_all=nll_all, nll_last_quarter=nll_last,
                    n_tokens=nll.numel(), n_tokens_last_quarter=nll[:, quarter:].numel(),
                )
                if keep_positions:
                    record["nll_by_position"] = nll.mean(dim=0).tolist()
            records.append(_ordered(record, _EVALUATE_KEYS))
    finally:
        bar.close()
    return records


#: The key order of :func:`evaluate`'s records (as before the loop was shared).
_EVALUATE_KEYS = ("encoding", "scaling", "factor", "train_len", "eval_len", "ratio", "ppl_all",
                  "ppl_last_quarter", "nll_all", "nll_last_quarter", "n_windows", "n_tokens",
                  "n_tokens_last_quarter", "note")


def _ordered(record: dict, keys: Sequence[str]) -> dict:
    """``record`` with ``keys`` first, in that order, then any others."""
    return {**{k: record[k] for k in keys}, **record}


