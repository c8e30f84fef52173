"""Training under ``torchrun`` with ``DistributedDataParallel``: the larger setting.

One process per GPU (NCCL) or per CPU worker (gloo), launched by PyTorch's own launcher;
this module starts no processes itself::

    torchrun --nproc_per_node 8 -m tutorial_pkg.experiments.distributed --larger --encoding rope
    --out rope.pt
    torchrun --nproc_per_node 2 -m tutorial_pkg.experiments.distributed --device cpu --steps 20
    --out t.pt

:func:`train_ddp` splits each **global** batch of
:func:`~tutorial_pkg.experiments.training.training_batches` (``cfg.batch_size`` windows, the same
batches as single-process :func:`~tutorial_pkg.experiments.training.train`) into equal shards, one
per rank. DDP averages the gradients over ranks, and the mean of equal-sized shard means
is the global mean, so every step equals a single-process step on the whole batch, up to
the order of floating-point sums (``tests/test_ddp.py`` checks it with 2 gloo processes).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..encodings.builtin import PositionEncoding
from ..models.tiny_lm import TinyLM
from .data import load_splits
from .training import (
    ExperimentConfig,
    autocast,
    build_model,
    check_config,
    lr_factor,
    make_optimizer,
    training_batches,
)

__all__ = ["train_ddp", "main"]


def _init() -> tuple[int, int, int]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("train_ddp runs under torchrun (RANK and WORLD_SIZE are not set)")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))


def train_ddp(
    encoding: str | PositionEncoding,
    cfg: ExperimentConfig,
    train_ids: torch.Tensor | None = None,
    *,
    encoding_kwargs: dict | None = None,
) -> tuple[TinyLM, list[float]]:
    """:func:`~tutorial_pkg.experiments.training.train`, data-parallel over the torchrun processes.

    Must run inside a process started by ``torchrun`` (it joins the process group: NCCL
    when CUDA is available, gloo otherwise). On CUDA each process uses ``cuda:LOCAL_RANK``.
    Every rank draws the same global batches and keeps its shard
    ``x.chunk(world_size)[rank]``.

    Returns:
        ``(model, losses)`` on every rank: the trained (unwrapped) model in eval mode and
        the global mean loss of every step (averaged over ranks).

    Raises:
        RuntimeError: outside torchrun, or if the loss becomes NaN or infinite.
        ValueError: if ``cfg.batch_size`` is not a multiple of the number of processes.
    """
    cfg = check_config(cfg)
    rank, world, local_rank = _init()
    if cfg.batch_size % world:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be a multiple of the number of "
                         f"processes ({world})")
    if cfg.resolved_device().type == "cuda":
        cfg = dataclasses.replace(cfg, device=f"cuda:{local_rank}")
        torch.cuda.set_device(local_rank)
    device = cfg.resolved_device()
    if train_ids is None:
        train_ids, _ = load_splits(cfg.heldout_fraction)
    model = build_model(encoding, cfg, encoding_kwargs)  # same seed: same weights on every rank
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = make_optimizer(model, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
    losses: list[float] = []
    ddp.train()
    for step, (x, y) in enumerate(training_batches(train_ids, cfg)):
        xs, ys = x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
        with autocast(cfg.amp, device):
            logits = ddp(xs)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), ys.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        value = mean_loss.item() / world
        if not math.isfinite(value):
            raise RuntimeError(f"training diverged: loss {value} at step {step}")
        losses.append(value)
    model.eval()
    return model, losses


def main(argv: list[str] | None = None) -> None:
    """Command line: ``torchrun --nproc_per_node N -m tutorial_pkg.experiments.distributed
    [options]``.

    Rank 0 saves ``{"state_dict", "losses", "config", "world_size"}`` to ``--out``.
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--encoding", default="rope")
    p.add_argument("--larger", action="store_true",
                   help="ExperimentConfig.gpu(): the larger setting of benchmarks/README.md")
    p.add_argument("--d-model", type=int)
    p.add_argument("--n-layers", type=int)
    p.add_argument("--n-heads", type=int)
    p.add_argument("--train-len", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--device")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    fields = {k: v for k, v in (("d_model", args.d_model), ("n_layers", args.n_layers),
                                 ("n_heads", args.n_heads), ("train_len", args.train_len),
                                 ("steps", args.steps), ("batch_size", args.batch_size),
                                 ("seed", args.seed), ("device", args.device)) if v is not None}
    if args.amp:
        fields["amp"] = True
    if "train_len" in fields:  # keep the evaluation fields consistent with a short window
        fields.setdefault("eval_tokens", max(16384, 8 * fields["train_len"]))
    cfg = ExperimentConfig.gpu(**fields) if args.larger else ExperimentConfig(**fields)
    model, losses = train_ddp(args.encoding, cfg)
    if dist.get_rank() == 0:
        torch.save({"state_dict": model.state_dict(), "losses": losses,
                    "config": cfg.to_dict(), "world_size": dist.get_world_size()}, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
