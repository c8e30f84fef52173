"""Train at a short length, evaluate perplexity at longer ones. Chapter 7.

* :func:`train` trains a :class:`~tutorial_pkg.models.tiny_lm.TinyLM` with one encoding on
  windows of ``train_len`` tokens. For one :class:`ExperimentConfig` every encoding starts
  from the **same initial weights** and sees the **same batches in the same order**
  (:func:`training_batches`), so the encodings differ in nothing but the encoding.
* :func:`~tutorial_pkg.experiments.evaluation.evaluate` scores the **same held-out
  tokens** at every length ``m * train_len``, with RoPE scaling rules applied at
  evaluation only (:mod:`~tutorial_pkg.experiments.evaluation`, whose names this module
  re-exports).
* :func:`run_extrapolation` does both for a list of encodings and returns flat records
  (dicts) for :func:`format_table` and, over several training seeds,
  :func:`summarize_seeds`.

The last quarter scores different tokens at each length;
its neighbours in ``tutorial_pkg.experiments`` score the same targets at every length
(``context_eval``, with ``stats``' intervals), train under ``torchrun`` (``distributed``),
run the copy test (``retrieval``) and chapter 6's synthetic tasks (``tasks``).

Example:
    >>> cfg = ExperimentConfig(d_model=32, n_layers=1, steps=20, train_len=16,
    ...                        eval_multiples=(1, 2), eval_tokens=1024)
    >>> records = run_extrapolation(["alibi", "learned"], cfg, progress=False)
    >>> print(format_table(records))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .._checks import (
    check_choice,
    check_nonneg_int,
    check_number,
    check_positive_float,
    check_positive_int,
    check_positive_ints,
)
from ..encodings.builtin import PositionEncoding
from ..encodings.registry import ENCODINGS
from ..encodings.schedules import LayerSchedule
from ..measure.records import text_table
from ..models.tiny_lm import TinyLM
from .data import batch_iterator, load_splits
from .evaluation import (  # noqa: F401 (re-exported: importable from here, as before)
    SCALING_TYPES,
    autocast,
    check_evaluation,
    check_scalable,
    evaluate,
    evaluation_blocks,
    nll_by_length,
    position_limit,
    scaled_rope,
    scaling_for,
    token_nll,
)

__all__ = [
    "ExperimentConfig",
    "training_batches",
    "build_model",
    "train",
    "run_extrapolation",
    "format_table",
    "summarize_seeds",
    "check_config",
    "lr_factor",
    "make_optimizer",
]



@dataclass(frozen=True)
class ExperimentConfig:
    """Sizes and hyper-parameters of the length-extrapolation experiment.

    The defaults are the CPU setting; :meth:`gpu` is the larger setting for a GPU.
    Every field is checked when the config is built (``TypeError`` for a wrong type,
    ``ValueError`` for a value out of range, naming the field).

    Attributes:
        d_model: model width.
        n_layers: Transformer blocks.
        n_heads: attention heads.
        train_len: training window ``L`` (tokens = bytes).
        steps: optimiser steps.
        batch_size: windows per training batch.
        lr: peak learning rate (AdamW).
        warmup: linear warm-up steps.
        schedule: ``"cosine"`` (decay to ``min_lr_ratio * lr``) or ``"constant"``.
        min_lr_ratio: final learning rate of the cosine schedule, relative to ``lr``.
        weight_decay: AdamW weight decay of the matrices (not of norms/biases).
        grad_clip: max global gradient norm.
        seed: seed (int >= 0) of the initial weights and of the batch generator.
        eval_multiples: evaluation lengths as multiples of ``train_len``.
        eval_tokens: held-out tokens scored at each length (cap; the same tokens at
            every length, rounded down to a multiple of the longest length).
        eval_batch_tokens: tokens per evaluation forward pass.
        heldout_fraction: fraction of plays held out (see
            :func:`~tutorial_pkg.experiments.data.load_splits`).
        backend: attention backend for training and evaluation (default ``"sdpa"``;
            :class:`~tutorial_pkg.models.tiny_lm.TinyLM` defaults to ``"auto"``, which holds no
            ``(H, L, L)`` ALiBi table).
        device: ``"cpu"``, ``"cuda"``, ... or ``None`` for CUDA when available.
        amp: bfloat16 autocast (CUDA only).
        copy_fraction: fraction of training windows in which the first ``copy_len`` tokens
            are repeated later in the window (:func:`training_batches`): a model that
            learns to copy, the copy test's positive control (chapter 7). ``0``: plain text.
        copy_len: tokens of each repeated segment (``2 * copy_len <= train_len``).
    """

    d_model: int = 96
    n_layers: int = 3
    n_heads: int = 4
    train_len: int = 64
    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 50
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_multiples: tuple[int, ...] = (1, 2, 4, 8)
    eval_tokens: int = 16384
    eval_batch_tokens: int = 8192
    heldout_fraction: float = 0.1
    backend: str = "sdpa"
    device: str | None = None
    amp: bool = False
    copy_fraction: float = 0.0
    copy_len: int = 16

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "train_len", "steps", "batch_size",
                     "eval_tokens", "eval_batch_tokens", "copy_len"):
            check_positive_int(name, getattr(self, name))
        check_nonneg_int("warmup", self.warmup)
        check_nonneg_int("seed", self.seed)
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        check_positive_float("lr", self.lr)
        check_positive_float("grad_clip", self.grad_clip)
        check_choice("schedule", self.schedule, ("cosine", "constant"))
        if not 0.0 <= check_number("min_lr_ratio", self.min_lr_ratio) <= 1.0:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio!r}")
        if check_number("weight_decay", self.weight_decay) < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if not 0.0 <= check_number("copy_fraction", self.copy_fraction) <= 1.0:
            raise ValueError(f"copy_fraction must lie in [0, 1], got {self.copy_fraction!r}")
        if self.copy_fraction and 2 * self.copy_len > self.train_len:
            raise ValueError(f"copy_len ({self.copy_len}) must be <= train_len // 2 "
                             f"({self.train_len // 2}) when copy_fraction > 0")
        multiples = check_positive_ints("eval_multiples", self.eval_multiples)
        object.__setattr__(self, "eval_multiples", multiples)
        if self.eval_tokens < max(multiples) * self.train_len:
            raise ValueError(
                f"eval_tokens ({self.eval_tokens}) must be >= the longest evaluation length "
                f"max(eval_multiples) * train_len = {max(multiples) * self.train_len}"
            )

    @classmethod
    def gpu(cls, **overrides) -> ExperimentConfig:
        """The LARGER setting, for a GPU: 256-token training, evaluated up to 2048.

        About 4.8 M parameters (d_model 256, 6 layers, 8 heads), 2000 steps of 32 x 256
        tokens per encoding, evaluated at the lengths of the seed's table (256 -> 2048).
        float32 like the CPU default (pass ``amp=True`` for bfloat16 autocast).
        Keyword arguments override single fields, e.g. ``gpu(steps=4000)``.
        """
        params = dict(
            d_model=256, n_layers=6, n_heads=8, train_len=256, steps=2000, batch_size=32,
            lr=1e-3, warmup=200, eval_tokens=131072, eval_batch_tokens=65536, device="cuda",
        )
        params.update(overrides)
        return cls(**params)

    larger = gpu  # alias: ``ExperimentConfig.larger()``

    def resolved_device(self) -> torch.device:
        """The device to run on (``device``, or CUDA when available if ``None``)."""
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def to_dict(self) -> dict:
        """The configuration as a JSON-ready dict."""
        out = dataclasses.asdict(self)
        out["eval_multiples"] = list(self.eval_multiples)
        return out


# --------------------------------------------------------------------------- training
def check_config(cfg) -> ExperimentConfig:
    """``cfg`` itself if it is an :class:`ExperimentConfig` (``TypeError`` otherwise)."""
    if not isinstance(cfg, ExperimentConfig):
        raise TypeError(f"cfg must be an ExperimentConfig, got {type(cfg).__name__}")
    return cfg


def training_batches(
    train_ids: torch.Tensor, cfg: ExperimentConfig
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The ``cfg.steps`` training batches, identical on every call with the same config.

    They come from a fresh ``torch.Generator`` seeded with ``cfg.seed`` and nothing
    else, so every encoding is trained on exactly the same windows in the same order.
    With ``cfg.copy_fraction > 0`` each window (``L + 1`` tokens, ``x`` and the last target)
    is, with that probability, given a copy of its first ``s = cfg.copy_len`` tokens at a
    position ``d`` drawn uniformly from ``[s, L + 1 - s]``: the text is that of the plain
    batches (the copies come from a second generator), so the two settings pair up.

    Args:
        train_ids: ``(N,)`` int64 training tokens.
        cfg: the experiment configuration.

    Yields:
        ``(x, y)``: int64 ``[batch_size, train_len]`` on the CPU, ``y`` = ``x`` shifted by one.
    """
    cfg = check_config(cfg)
    generator = torch.Generator().manual_seed(cfg.seed)
    batches = batch_iterator(train_ids, cfg.batch_size, cfg.train_len, generator, cfg.steps)
    return _with_copies(batches, cfg) if cfg.copy_fraction else batches


#: Offset of the copies' generator seed from ``cfg.seed`` (a stream apart from the text's).
_COPY_SEED = 1_000_003


def _with_copies(batches, cfg: ExperimentConfig):
    generator = torch.Generator().manual_seed(cfg.seed + _COPY_SEED)
    s, n = cfg.copy_len, cfg.train_len + 1
    for x, y in batches:
        window = torch.cat([x, y[:, -1:]], dim=1)  # the L + 1 tokens x and y come from
        rows = torch.rand(x.shape[0], generator=generator) < cfg.copy_fraction
        starts = torch.randint(s, n - s + 1, (x.shape[0],), generator=generator)
        where = starts[:, None] + torch.arange(s)  # (B, s): positions d .. d + s - 1
        copied = window.scatter(1, where, window[:, :s])
        window = torch.where(rows[:, None], copied, window)
        yield window[:, :-1], window[:, 1:]


def build_model(
    encoding: str | PositionEncoding | LayerSchedule, cfg: ExperimentConfig,
    encoding_kwargs: dict | None = None,
) -> TinyLM:
    """A fresh :class:`~tutorial_pkg.models.tiny_lm.TinyLM` for ``encoding`` (same weights for all).

    Args:
        encoding: an encoding name, or a :class:`~tutorial_pkg.encodings.builtin.PositionEncoding`
            or :class:`~tutorial_pkg.encodings.schedules.LayerSchedule` instance (a variant of your
            own; it is used as is, not copied).
        cfg: the experiment configuration.
        encoding_kwargs: extra arguments for a named encoding.

    The learned table gets ``max_positions = cfg.train_len``: it can represent exactly the
    positions it is trained on.
    """
    cfg = check_config(cfg)
    if isinstance(encoding, (PositionEncoding, LayerSchedule)):
        if encoding_kwargs:
            raise ValueError("encoding_kwargs apply to an encoding name, not an instance")
    else:
        check_choice("encoding", encoding, ENCODINGS)
    return TinyLM(
        encoding, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
        max_positions=cfg.train_len, backend=cfg.backend, seed=cfg.seed,
        encoding_kwargs=encoding_kwargs,
    ).to(cfg.resolved_device())


def lr_factor(cfg: ExperimentConfig) -> Callable[[int], float]:
    """The learning-rate multiplier per step: linear warm-up, then constant or cosine
    decay to ``cfg.min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        if cfg.schedule == "constant":
            return 1.0
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine

    return factor


def make_optimizer(model: torch.nn.Module, cfg: ExperimentConfig) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters; weight decay on matrices (projections,
    embeddings), not on LayerNorm gains or biases."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def train(
    encoding: str | PositionEncoding,
    cfg: ExperimentConfig,
    train_ids: torch.Tensor | None = None,
    *,
    encoding_kwargs: dict | None = None,
    progress: bool = True,
) -> tuple[TinyLM, list[float]]:
    """Train a TinyLM with one encoding at length ``cfg.train_len``.

    AdamW (betas 0.9/0.95, decoupled weight decay on matrices), linear warm-up then
    cosine (or constant) learning rate, global gradient-norm clipping. Deterministic:
    the weights come from ``cfg.seed`` and the batches from :func:`training_batches`.

    Args:
        encoding: an encoding name (``"nope"``, ``"sinusoidal"``, ``"learned"``,
            ``"rope"``, ``"alibi"``, ``"hybrid"``) or a ``PositionEncoding`` instance
            (see :func:`build_model`).
        cfg: the experiment configuration.
        train_ids: ``(N,)`` training tokens (default: the training plays of
            :func:`~tutorial_pkg.experiments.data.load_splits`).
        encoding_kwargs: extra arguments for the encoding (e.g. ``{"base": 500000.0}``).
        progress: show a tqdm progress bar.

    Returns:
        ``(model, losses)``: the trained model in eval mode, and the training loss
        (nats per token) of every step, ``len(losses) == cfg.steps``.

    Raises:
        RuntimeError: if the loss becomes NaN or infinite.
    """
    cfg = check_config(cfg)
    if train_ids is None:
        train_ids, _ = load_splits(cfg.heldout_fraction)
    device = cfg.resolved_device()
    model = build_model(encoding, cfg, encoding_kwargs)
    label = model.encoding.name if isinstance(encoding, PositionEncoding) else encoding
    optimizer = make_optimizer(model, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
    losses: list[float] = []
    model.train()
    bar = tqdm(training_batches(train_ids, cfg), total=cfg.steps, desc=f"train {label}",
               disable=not progress, mininterval=2.0, leave=True)
    for step, (x, y) in enumerate(bar):
        x, y = x.to(device), y.to(device)
        with autocast(cfg.amp, device):
            loss = model.loss(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        value = loss.item()
        if not math.isfinite(value):
            raise RuntimeError(f"training {label!r} diverged: loss {value} at step {step}")
        losses.append(value)
        if step % 50 == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{value:.3f}", refresh=False)
    bar.close()
    model.eval()
    return model, losses


def run_extrapolation(
    encodings: Sequence[str],
    cfg: ExperimentConfig,
    rope_scalings: Sequence[str] = SCALING_TYPES,
    *,
    train_ids: torch.Tensor | None = None,
    heldout_ids: torch.Tensor | None = None,
    encoding_kwargs: Mapping[str, dict] | None = None,
    keep_positions: bool = False,
    models: dict | None = None,
    progress: bool = True,
) -> list[dict]:
    """Train each encoding at ``cfg.train_len`` and evaluate it at every multiple.

    Every encoding is evaluated without scaling; encodings with RoPE (``rope``,
    ``hybrid``) are evaluated again with each rule of ``rope_scalings``, at evaluation
    time only (the trained weights are the same).

    Args:
        encodings: encoding names, e.g. ``["nope", "sinusoidal", "learned", "rope",
            "alibi", "hybrid"]``.
        cfg: the experiment configuration.
        rope_scalings: rules from
            :data:`~tutorial_pkg.experiments.evaluation.SCALING_TYPES` (``()`` for none).
        train_ids, heldout_ids: token tensors (default:
            :func:`~tutorial_pkg.experiments.data.load_splits`).
        encoding_kwargs: ``{name: kwargs}`` for encodings that need options.
        keep_positions: keep per-position NLL in the records (see
            :func:`~tutorial_pkg.experiments.evaluation.evaluate`).
        models: optional dict that receives ``{name: (model, losses)}`` for each
            trained encoding, for attention maps and loss curves.
        progress: show tqdm progress bars.

    Returns:
        The records of :func:`~tutorial_pkg.experiments.evaluation.evaluate`, each with
        ``final_train_loss`` (mean of the last 10% of steps) added, in the order encodings x
        scalings x multiples.
    """
    cfg = check_config(cfg)
    if isinstance(encodings, str) or not isinstance(encodings, Sequence) or not encodings:
        raise TypeError(f"encodings must be a non-empty list of names, got {encodings!r}")
    for name in encodings:
        check_choice("encodings[i]", name, ENCODINGS)
    if len(set(encodings)) != len(encodings):
        raise ValueError(f"encodings must not repeat a name, got {list(encodings)}")
    if isinstance(rope_scalings, str):
        raise TypeError(f"rope_scalings must be a sequence of names, got {rope_scalings!r}")
    for rule in rope_scalings:
        check_choice("rope_scalings[i]", rule, SCALING_TYPES)
    if models is not None and not isinstance(models, dict):
        raise TypeError(f"models must be a dict or None, got {type(models).__name__}")
    if train_ids is None or heldout_ids is None:
        default_train, default_heldout = load_splits(cfg.heldout_fraction)
        train_ids = default_train if train_ids is None else train_ids
        heldout_ids = default_heldout if heldout_ids is None else heldout_ids
    kwargs = dict(encoding_kwargs or {})

    records: list[dict] = []
    for name in encodings:
        model, losses = train(name, cfg, train_ids, encoding_kwargs=kwargs.get(name),
                              progress=progress)
        tail = losses[-max(1, len(losses) // 10):]
        final_loss = sum(tail) / len(tail)
        rules = [None]
        if model.encoding.supports_scaling:
            rules += list(rope_scalings)
        for rule in rules:
            for record in evaluate(
                model, heldout_ids, cfg.train_len, cfg.eval_multiples, rule,
                eval_tokens=cfg.eval_tokens, batch_tokens=cfg.eval_batch_tokens, amp=cfg.amp,
                encoding_name=name, keep_positions=keep_positions, progress=progress,
            ):
                record["final_train_loss"] = final_loss
                records.append(record)
        if models is not None:
            models[name] = (model, losses)
    return records


# --------------------------------------------------------------------------- table
def format_table(
    records: Sequence[Mapping],
    value: str = "ppl_last_quarter",
    *,
    digits: int = 2,
) -> str:
    """A plain-text table: one row per (encoding, scaling), one column per evaluation length.

    Args:
        records: records from :func:`~tutorial_pkg.experiments.evaluation.evaluate` /
            :func:`run_extrapolation`.
        value: the record key to show (``"ppl_all"``, ``"ppl_last_quarter"``, ...).
        digits: decimals.

    Returns:
        The table, in the layout of the benchmark tables
        (:func:`tutorial_pkg.measure.records.text_table`) under a title line; ``n/a`` marks a
        value that was not measured, and each distinct ``note`` is listed below the table.

    Raises:
        TypeError: if ``records`` is not a non-empty list of dicts.
        ValueError: if ``value`` is not a record key.
    """
    if isinstance(records, Mapping) or not isinstance(records, Sequence) or not records:
        raise TypeError("records must be a non-empty list of dicts")
    check_nonneg_int("digits", digits)
    if value not in records[0]:
        raise ValueError(f"value must be a record key such as 'ppl_all', got {value!r}")
    lengths = sorted({(r["eval_len"], r["ratio"]) for r in records})
    rows: dict[tuple[str, str], dict[int, str]] = {}
    notes: dict[str, list[str]] = {}
    for r in records:
        key = (r["encoding"], r["scaling"])
        v = r[value]
        cell = "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"
        rows.setdefault(key, {})[r["eval_len"]] = cell
        if r.get("note"):
            notes.setdefault(r["note"], [])
            if r["encoding"] not in notes[r["note"]]:
                notes[r["note"]].append(r["encoding"])
    header = ["encoding", "scaling"] + [f"{n} ({m}x)" for n, m in lengths]
    body = [[enc, sc] + [cells.get(n, "") for n, _ in lengths] for (enc, sc), cells in rows.items()]
    out = [f"{value} by evaluation length (train_len = "
           f"{', '.join(str(t) for t in sorted({r['train_len'] for r in records}))})"]
    out += text_table(header, body, left=2)
    for note, encs in notes.items():
        out.append(f"n/a: {', '.join(encs)}: {note}")
    return "\n".join(out)

# --------------------------------------------------------------------------- seeds
def summarize_seeds(
    records: Sequence[Mapping],
    value: str,
    by: Sequence[str] = ("encoding", "scaling", "eval_len"),
) -> list[dict]:
    """Mean and spread over seeds: one row per distinct value of the ``by`` keys.

    Args:
        records: records of several seeds (each with a ``seed`` key).
        value: the key to summarise (e.g. ``"ppl_last_quarter"``); records where it is
            ``None`` are skipped (a row with none left is left out).
        by: the keys that identify a row.

    Returns:
        Dicts with the ``by`` keys and ``mean``, ``std`` (sample standard deviation,
        ``ddof=1``; 0 for one seed), ``min``, ``max``, ``n`` and ``seeds``, in the order
        the rows first appear.

    Raises:
        ValueError: if a record lacks ``seed``, ``value`` or a ``by`` key, or a row has
            the same seed twice.
    """
    if isinstance(records, Mapping) or not isinstance(records, Sequence) or not records:
        raise TypeError("records must be a non-empty list of dicts")
    if isinstance(by, str):
        by = (by,)
    groups: dict[tuple, list[tuple[int, float]]] = {}
    for r in records:
        for key in ("seed", value, *by):
            if key not in r:
                raise ValueError(f"every record needs the key {key!r} (by={tuple(by)}, "
                                 f"value={value!r})")
        row = tuple(r[k] for k in by)
        groups.setdefault(row, [])
        if r[value] is not None:
            groups[row].append((r["seed"], float(r[value])))
    out = []
    for row, pairs in groups.items():
        if not pairs:
            continue
        seeds = [sd for sd, _ in pairs]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"row {row} has a seed twice: {seeds}")
        v = torch.tensor([x for _, x in pairs], dtype=torch.float64)
        std = v.std().item() if len(pairs) > 1 else 0.0
        out.append({**dict(zip(by, row, strict=True)), "mean": v.mean().item(), "std": std,
                    "min": v.min().item(), "max": v.max().item(), "n": len(pairs),
                    "seeds": sorted(seeds)})
    return out
