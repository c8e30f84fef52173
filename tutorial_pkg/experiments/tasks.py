"""Chapter 6's controlled experiment: two synthetic tasks, one per parent of the hybrid.

* ``"offset"`` (offset copy) needs a *precise relative position*: RoPE's strength.
* ``"latest"`` (latest signal) needs *content plus recency*: ALiBi's strength.

:func:`task_batch` draws batches of either task, :func:`test_batches` the test sequences of
one test seed, :func:`train_task` trains a one-layer :class:`~tutorial_pkg.models.tiny_lm.TinyLM`
on one and measures its accuracy at several lengths (:func:`evaluate_task`, with the test-set
standard error). The chapter's control for the articles' alpha-mix is the additive hybrid at
half slopes, ``Hybrid(head_dim, n_heads, bias_scale=0.5)``.

The mechanism behind the offset task's failure past the training length is read and ablated on
trained models: :func:`far_attention` (how much attention goes to keys farther back than any
training distance) and :func:`with_encoding` (the trained weights under another encoding or a
sliding window, no retraining).

Example:
    >>> acc, model = train_task("offset", "hybrid", seed=0, steps=20)
    >>> sorted(acc)
    [32, 64, 128]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .._checks import (
    check_choice,
    check_nonneg_int,
    check_number,
    check_positive_int,
)
from ..encodings.builtin import PositionEncoding
from ..models.tiny_lm import TinyLM

__all__ = ["TASKS", "task_batch", "test_batches", "evaluate_task", "train_task",
           "far_attention", "with_encoding"]

#: The synthetic tasks of chapter 6.
TASKS = ("offset", "latest")

#: ``cross_entropy``'s ``ignore_index``: the target of a position that has none.
IGNORE = -100


def task_batch(
    task: str,
    batch: int,
    length: int,
    generator: torch.Generator,
    *,
    vocab: int = 32,
    offset: int = 3,
    n_signal: int = 8,
    p_signal: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of chapter 6's synthetic tasks: ``(x, y)``, int64 ``[batch, length]`` on the CPU.

    * ``"offset"`` (offset copy): ``x`` uniform over ``vocab``; ``y[:, i] = x[:, i - offset]``
      (a precise relative position).
    * ``"latest"`` (latest signal): tokens ``< n_signal`` are signals (probability
      ``p_signal``), the rest noise; at each noise position the target is the most recent
      signal before it (content plus recency).

    Positions without a target hold ``-100`` (``cross_entropy``'s ``ignore_index``).
    The same ``generator`` state gives the same batch.

    Raises:
        TypeError: for a non-int size or a ``generator`` that is not a ``torch.Generator``.
        ValueError: for an unknown ``task``, ``offset >= length``, ``n_signal >= vocab``
            or ``p_signal`` outside ``(0, 1)``.
    """
    check_choice("task", task, TASKS)
    check_positive_int("batch", batch)
    check_positive_int("length", length)
    check_positive_int("vocab", vocab)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if task == "offset":
        check_positive_int("offset", offset)
        if offset >= length:
            raise ValueError(f"offset ({offset}) must be < length ({length})")
        x = torch.randint(0, vocab, (batch, length), generator=generator)
        y = torch.full_like(x, IGNORE)
        y[:, offset:] = x[:, :-offset]
        return x, y
    check_positive_int("n_signal", n_signal)
    if n_signal >= vocab:
        raise ValueError(f"n_signal ({n_signal}) must be < vocab ({vocab})")
    if not 0.0 < check_number("p_signal", p_signal) < 1.0:
        raise ValueError(f"p_signal must lie in (0, 1), got {p_signal!r}")
    signal = torch.rand(batch, length, generator=generator) < p_signal
    x = torch.where(signal, torch.randint(0, n_signal, (batch, length), generator=generator),
                    torch.randint(n_signal, vocab, (batch, length), generator=generator))
    where = torch.where(signal, torch.arange(length).expand(batch, length), -1)
    last = torch.cummax(where, dim=1).values  # position of the latest signal so far
    y = torch.where(last >= 0, x.gather(1, last.clamp(min=0)), IGNORE)
    return x, y.masked_fill(signal, IGNORE)  # no target where the token is itself a signal


def test_batches(
    task: str,
    seed: int = 1000,
    eval_lens: Sequence[int] = (32, 64, 128),
    *,
    batch: int = 64,
    vocab: int = 32,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The test sequences of one test seed: ``{length: (x, y)}``, ``batch`` windows per length.

    Drawn from one generator seeded with ``seed``, one length after the other in the order
    of ``eval_lens``; the same arguments give the same sequences (CPU tensors).
    """
    check_choice("task", task, TASKS)
    check_nonneg_int("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    return {n: task_batch(task, batch, n, gen, vocab=vocab) for n in eval_lens}


@torch.no_grad()
def evaluate_task(
    model: torch.nn.Module, batches: dict, *, from_position: int = 0
) -> dict[int, dict[str, float]]:
    """Top-1 accuracy of ``model`` on each length of ``batches`` (:func:`test_batches`).

    ``from_position`` (int >= 0) counts only the targets at positions ``>= from_position``
    (e.g. the trained length: accuracy past it alone); a length with no such target is
    left out of the result.

    Returns ``{length: {"accuracy", "se"}}``: the accuracy over every position with a target,
    and its standard error over the test windows (the windows are independent draws; a
    window's positions are not, so the error is that of a ratio of per-window sums,
    ``sqrt(sum_w (c_w - acc t_w)^2 / (W (W - 1))) / mean_w t_w`` for ``c_w`` correct of
    ``t_w`` targets in window ``w``). It measures the **test-set noise** of one model.
    """
    check_nonneg_int("from_position", from_position)
    device = next(model.parameters()).device
    out = {}
    for n, (x, y) in batches.items():
        if y.shape[1] <= from_position:
            continue
        pred, y = model(x.to(device)).argmax(-1), y.to(device)
        has = y != IGNORE
        has[:, :from_position] = False
        c, t = ((pred == y) & has).sum(1).double(), has.sum(1).double()  # per window
        acc = (c.sum() / t.sum()).item()
        w = c.numel()
        se = ((c - acc * t).pow(2).sum() / (w * (w - 1))).sqrt().item() / t.mean().item() \
            if w > 1 else float("nan")
        out[n] = {"accuracy": acc, "se": se}
    return out


def train_task(
    task: str,
    encoding: str | PositionEncoding,
    seed: int = 0,
    *,
    encoding_kwargs: dict | None = None,
    train_len: int = 32,
    eval_lens: Sequence[int] = (32, 64, 128),
    steps: int = 300,
    batch: int = 32,
    eval_batch: int = 64,
    d_model: int = 32,
    n_heads: int = 4,
    lr: float = 3e-3,
    vocab: int = 32,
    test_seed: int = 1000,
    device: str | torch.device = "cpu",
    param_groups: Callable[[TinyLM], list[dict]] | None = None,
) -> tuple[dict[int, float], TinyLM]:
    """Train a one-layer TinyLM on a task of :func:`task_batch`; test it at ``eval_lens``.

    AdamW (no weight decay) at a constant ``lr`` for ``steps`` batches of ``batch``
    windows of ``train_len`` tokens. ``seed`` (int >= 0) sets the initial weights and the
    training batches; the test sequences (``eval_batch`` windows per length) are
    :func:`test_batches` of ``test_seed``: the same for every model given the same
    ``test_seed`` (a recorded run gives each training seed its own).

    Args:
        task: one of :data:`TASKS`.
        encoding: an encoding name or a :class:`~tutorial_pkg.encodings.builtin.PositionEncoding`
            instance (e.g. ``Hybrid(8, 4, bias_scale=0.5)``), as
            :class:`~tutorial_pkg.models.tiny_lm.TinyLM`
            takes it.
        encoding_kwargs: extra arguments for a named encoding.
        device: where the model trains (batches are drawn on the CPU and moved there).
        param_groups: called once with the model on ``device`` before training; returns
            AdamW's parameter groups (each may set its own ``lr`` and ``eps``; ``lr`` is the
            default of the others). It may change the weights in place first (an ablation
            that rescales one matrix). ``None``: every parameter in one group.

    Returns:
        ``(accuracy, model)``: ``{length: top-1 accuracy over positions with a target}``
        and the trained model (eval mode).

    Raises:
        TypeError, ValueError: for an unknown ``task``, a bad ``seed`` or ``steps``, a
            ``param_groups`` that is not callable, and
            as :func:`task_batch` for bad sizes.
    """
    check_choice("task", task, TASKS)
    check_nonneg_int("seed", seed)
    check_positive_int("steps", steps)
    if param_groups is not None and not callable(param_groups):
        raise TypeError("param_groups must be a callable or None, "
                        f"got {type(param_groups).__name__}")
    model = TinyLM(encoding, vocab_size=vocab, d_model=d_model, n_layers=1, n_heads=n_heads,
                   seed=seed, encoding_kwargs=encoding_kwargs).to(device)
    groups = model.parameters() if param_groups is None else param_groups(model)
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = task_batch(task, batch, train_len, gen, vocab=vocab)
        logits = model(x.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    scores = evaluate_task(model, test_batches(task, test_seed, eval_lens, batch=eval_batch,
                                               vocab=vocab))
    return {n: r["accuracy"] for n, r in scores.items()}, model


@torch.no_grad()
def far_attention(model: TinyLM, x: torch.Tensor, beyond: int) -> float:
    """Mean attention weight on keys ``beyond`` or more positions back, queries at ``beyond`` on.

    ``x``: token ids ``[b, s]``. The mean is over the windows, the heads (of the last layer)
    and the queries at positions ``>= beyond``; for a model trained on ``beyond`` tokens those
    keys sit at distances it never saw.
    """
    check_positive_int("beyond", beyond)
    device = next(model.parameters()).device
    w = model.attention_weights(x.to(device))  # (b, H, s, s)
    s = w.shape[-1]
    dist = torch.arange(s, device=device)[:, None] - torch.arange(s, device=device)[None, :]
    return (w * (dist >= beyond)).sum(-1)[:, :, beyond:].mean().item()


def with_encoding(model: TinyLM, encoding: str | PositionEncoding, **kwargs) -> TinyLM:
    """A TinyLM like ``model`` (as :func:`train_task` builds it) holding its trained weights,
    with another ``encoding`` and TinyLM options (``window=...``); in eval mode, on its device.

    No retraining: ``with_encoding(hybrid_model, "rope")`` is the trained hybrid with its ALiBi
    bias removed, ``with_encoding(model, "rope", window=32)`` hides every key 32 or more
    positions back. The encodings must hold no weights of their own (RoPE, ALiBi, the plain
    hybrid do).
    """
    device = next(model.parameters()).device
    new = TinyLM(encoding, vocab_size=model.tok_emb.num_embeddings, d_model=model.d_model,
                 n_layers=model.n_layers, n_heads=model.blocks[0].attn.n_heads, **kwargs)
    new.load_state_dict(model.state_dict())
    return new.to(device).eval()
