"""Chapter 6's controlled experiment: two synthetic tasks, one per parent of the hybrid.

* ``"offset"`` (offset copy) needs a *precise relative position*: RoPE's strength.
* ``"latest"`` (latest signal) needs *content plus recency*: ALiBi's strength.

:func:`task_batch` draws batches of either task, :func:`train_task` trains a one-layer
:class:`~tutorial_pkg.models.tiny_lm.TinyLM` on one and measures its accuracy at several lengths.
The chapter's control for the articles' alpha-mix is the additive hybrid at half slopes,
``Hybrid(head_dim, n_heads, bias_scale=0.5)``.

Example:
    >>> acc, model = train_task("offset", "hybrid", seed=0, steps=20)
    >>> sorted(acc)
    [32, 64, 128]
"""

from __future__ import annotations

from collections.abc import Sequence

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

__all__ = ["TASKS", "task_batch", "train_task"]

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
    device: str | torch.device = "cpu",
) -> tuple[dict[int, float], TinyLM]:
    """Train a one-layer TinyLM on a task of :func:`task_batch`; test it at ``eval_lens``.

    AdamW (no weight decay) at a constant ``lr`` for ``steps`` batches of ``batch``
    windows of ``train_len`` tokens. ``seed`` (int >= 0) sets the initial weights and the
    training batches; the test batches (``eval_batch`` windows per length) come from a
    generator seeded with 1000, the same for every model.

    Args:
        task: one of :data:`TASKS`.
        encoding: an encoding name or a :class:`~tutorial_pkg.encodings.builtin.PositionEncoding`
            instance (e.g. ``Hybrid(8, 4, bias_scale=0.5)``), as
            :class:`~tutorial_pkg.models.tiny_lm.TinyLM`
            takes it.
        encoding_kwargs: extra arguments for a named encoding.
        device: where the model trains (batches are drawn on the CPU and moved there).

    Returns:
        ``(accuracy, model)``: ``{length: top-1 accuracy over positions with a target}``
        and the trained model (eval mode).

    Raises:
        TypeError, ValueError: for an unknown ``task``, a bad ``seed`` or ``steps``, and
            as :func:`task_batch` for bad sizes.
    """
    check_choice("task", task, TASKS)
    check_nonneg_int("seed", seed)
    check_positive_int("steps", steps)
    model = TinyLM(encoding, vocab_size=vocab, d_model=d_model, n_layers=1, n_heads=n_heads,
                   seed=seed, encoding_kwargs=encoding_kwargs).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = task_batch(task, batch, train_len, gen, vocab=vocab)
        logits = model(x.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    test_gen, acc = torch.Generator().manual_seed(1000), {}
    with torch.no_grad():
        for n in eval_lens:
            x, y = task_batch(task, eval_batch, n, test_gen, vocab=vocab)
            pred, y = model(x.to(device)).argmax(-1), y.to(device)
            acc[n] = ((pred == y) & (y != IGNORE)).sum().item() / (y != IGNORE).sum().item()
    return acc, model
