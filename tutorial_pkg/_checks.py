"""Argument checks shared by every module: one place, one message style.

Every public function validates its inputs with these helpers so that bad input
fails early with a message that names the argument and says what was expected.

**Values are read back only where that is free.** Shapes, dtypes and devices are
metadata and are checked everywhere. Checking a tensor's *values* (no negative
position, an id below the vocabulary size) means reading it back to the host: on
a GPU that is a synchronisation (the host waits for every queued kernel), and meta
or fake tensors (the device rehearsal, ``tests/test_device_rehearsal.py``) have no
values at all. So value checks run on CPU tensors only (:func:`values_readable`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor


def values_readable(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values back costs nothing: a CPU tensor, outside compilation.

    On an accelerator a read is a device synchronisation; meta and fake tensors hold
    no values. Value checks are skipped there (see the module docs).
    """
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and not _is_fake(t)


def _is_fake(t: torch.Tensor) -> bool:
    # a FakeTensor reports a device but holds no data
    return isinstance(t, FakeTensor)


def fake_mode_active() -> bool:
    """Whether a ``FakeTensorMode`` is active: tensors made now hold no data.

    Caches keyed by device must then neither store nor serve: a fake ``cuda`` tensor
    cached now would be handed to a real ``cuda`` call later (and a real one would
    leak into the fake run).
    """
    get_mode = getattr(torch._C, "_get_dispatch_mode", None)
    key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)
    return get_mode is not None and key is not None and get_mode(key) is not None


def check_device(name: str, t: torch.Tensor, device, *, fix: str = "") -> torch.Tensor:
    """Return ``t`` if it lives on ``device``, else raise ``ValueError`` naming both devices.

    For tensors that must not be moved silently: learned parameters (a copy would
    not be trained) and activations (a copy per call hides a slow program). ``fix``
    says how to resolve it, e.g. ``"move the encoding: encoding.to(device)"``.
    """
    device = torch.device(device)
    if not _same_device(t.device, device):
        raise ValueError(f"{name} is on {t.device} but this call runs on {device}"
                         + (f": {fix}" if fix else ""))
    return t


def _same_device(a: torch.device, b: torch.device) -> bool:
    # "cuda" (no index) means the current device; a tensor always reports an index
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an ``int`` > 0, else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def check_nonneg_int(name: str, value: object) -> int:
    """Return ``value`` if it is an ``int`` >= 0, else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_even(name: str, value: object) -> int:
    """Return ``value`` if it is a positive even ``int``, else raise naming ``name``."""
    check_positive_int(name, value)
    if value % 2:
        raise ValueError(f"{name} must be even (dimensions are rotated in pairs), got {value}")
    return value


def check_positive_float(name: str, value: object) -> float:
    """Return ``float(value)`` if it is a finite real number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def check_choice(name: str, value: object, choices) -> str:
    """Return ``value`` if it is one of ``choices``, else raise naming ``name``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def check_float_tensor(name: str, x: object, ndim: int | None = None) -> torch.Tensor:
    """Check that ``x`` is a floating-point tensor (optionally of rank ``ndim``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_number(name: str, value: object) -> float:
    """Return ``float(value)`` if it is a finite real number (not a bool), else raise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def as_positions(name: str, positions, device=None) -> torch.Tensor:
    """Turn an int length or an integer tensor into a 1-D int64 position tensor.

    Args:
        name: argument name for error messages.
        positions: an ``int`` ``L`` (meaning ``0..L-1``) or an integer tensor of
            shape ``(L,)`` with non-negative entries (checked on CPU, see the
            module docs).
        device: device for a tensor built from an int.

    Returns:
        ``LongTensor`` of shape ``(L,)``.
    """
    if isinstance(positions, bool):
        raise TypeError(f"{name} must be an int length or an integer tensor, got bool")
    if isinstance(positions, int):
        check_nonneg_int(name, positions)
        return torch.arange(positions, device=device)
    if not isinstance(positions, torch.Tensor):
        raise TypeError(
            f"{name} must be an int length or an integer tensor, got {type(positions).__name__}"
        )
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {positions.dtype}")
    if positions.dim() != 1:
        raise ValueError(f"{name} must be 1-D (L,), got shape {tuple(positions.shape)}")
    if positions.numel() and values_readable(positions):  # CPU only (module docs)
        low = int(positions.min())
        if low < 0:
            raise ValueError(f"{name} must be non-negative, got min {low}")
    return positions.long()


def as_batched_positions(
    name: str, positions, batch: int, length: int, *, check_values: bool = True
) -> torch.Tensor:
    """Check positions ``(s,)`` or ``[b, s]`` and return them as int64 ``[1 or b, s]``.

    The Hugging Face ``position_ids`` / torchtune ``input_pos`` convention: one row
    shared by the batch, or one row per sequence (left padding, packed documents).

    Args:
        name: argument name for error messages.
        positions: an integer tensor ``(s,)``, ``[1, s]`` or ``[b, s]``.
        batch: the batch size ``b``.
        length: the sequence length ``s``.
        check_values: also check that no position is negative. This reads the
            tensor, so callers do it once per forward pass, not once per layer; it
            is skipped where reading is not free (:func:`values_readable`: not on a
            GPU, where it would synchronise, nor on meta or fake tensors).
    """
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"{name} must be an integer tensor (s,) or [b, s], got "
                        f"{type(positions).__name__}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {positions.dtype}")
    if positions.dim() == 1:
        positions = positions[None]
    if positions.dim() != 2 or positions.shape[-1] != length or positions.shape[0] not in (
        1, batch
    ):
        raise ValueError(
            f"{name} must have shape (s,) or [b, s] with b={batch}, s={length}, "
            f"got {tuple(positions.shape)}"
        )
    if check_values and positions.numel() and values_readable(positions):
        low = int(positions.min())
        if low < 0:
            raise ValueError(f"{name} must be non-negative, got min {low}")
    return positions.long()


def check_callable(name: str, fn: object) -> object:
    """Return ``fn`` if it is callable, else raise ``TypeError`` naming ``name``."""
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    return fn


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``, else raise ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_float_dtype(name: str, dtype: object) -> torch.dtype:
    """Return ``dtype`` if it is a floating-point ``torch.dtype``, else raise ``TypeError``."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.dtype, got {dtype!r}")
    return dtype


def check_int_in_range(name: str, value: object, low: int, high: int, *,
                       high_name: str = "") -> int:
    """Return ``value`` if it is an ``int`` with ``low <= value < high``, else raise.

    ``high_name`` names the bound in the message (``"s"``: ``[0, s=10)``).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value < high:
        bound = f"{high_name}={high}" if high_name else f"{high}"
        raise ValueError(f"{name} must be an int in [{low}, {bound}), got {value}")
    return value


def check_ids_or_features(name: str, x: object) -> torch.Tensor:
    """Return ``x`` if it is a model input: ``[b, s]`` token ids or ``[b, s, d]`` features.

    Raises ``TypeError`` for anything else (not a tensor, another rank, complex).
    """
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.is_complex():
        raise TypeError(f"{name} must be a tensor [b, s] of ids or [b, s, d] of features, got "
                        f"{getattr(x, 'shape', type(x).__name__)}")
    return x


def check_positive_ints(name: str, values) -> tuple[int, ...]:
    """``values`` as a tuple of positive ints: a non-empty sequence (``TypeError`` otherwise)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise TypeError(f"{name} must be a non-empty sequence of ints, got {values!r}")
    return tuple(check_positive_int(f"{name}[i]", v) for v in values)
