"""Every encoding and schedule by name: the registry :data:`ENCODINGS`. Chapters 4 and 7.

``TinyLM("alibi")``, ``make_encoding("rope", head_dim=16)`` and the experiments of
chapter 7 build an encoding from its name. The names are listed here, in one place
(:data:`BUILTINS`), and nowhere else writes into the registry: a module that defines
an encoding does not register it as a side effect of being imported. Your own
encoding (a :class:`~tutorial_pkg.encodings.builtin.PositionEncoding` subclass) or schedule
(a :class:`~tutorial_pkg.encodings.schedules.LayerSchedule` subclass) is added with
:func:`register_encoding` (or ``ENCODINGS["mine"] = Mine``); its ``build``
classmethod receives the model's sizes.

This module sits above :mod:`~tutorial_pkg.encodings.builtin`,
:mod:`~tutorial_pkg.encodings.mrope`, :mod:`~tutorial_pkg.encodings.relative_bias`
and :mod:`~tutorial_pkg.encodings.schedules` (it names classes from all three); the three names
below are also importable from :mod:`~tutorial_pkg.encodings.builtin`.
"""

from __future__ import annotations

from .._checks import check_bool, check_choice, check_positive_int
from .builtin import ALiBi, Hybrid, Learned, NoPE, PositionEncoding, PRoPE, Rotary, Sinusoidal
from .mrope import MRotary
from .relative_bias import T5RelativeBias
from .schedules import LayerSchedule, LocalGlobal, NoPEEvery

__all__ = ["BUILTINS", "ENCODINGS", "register_encoding", "make_encoding"]

#: The built-in encodings and schedules, registered under their ``name``.
BUILTINS = (NoPE, Sinusoidal, Learned, Rotary, PRoPE, ALiBi, Hybrid, T5RelativeBias, MRotary,
            NoPEEvery, LocalGlobal)

#: The registry of encodings and schedules, by name. :func:`make_encoding` looks names
#: up here, so ``register_encoding(MyEncoding)`` (or ``ENCODINGS["mine"] = MyEncoding``)
#: makes ``make_encoding("mine", ...)`` and ``TinyLM("mine")`` build it (its ``build``
#: classmethod receives the model's sizes).
ENCODINGS: dict[str, type[PositionEncoding] | type[LayerSchedule]] = {}


def _check_class(arg: str, cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, (PositionEncoding, LayerSchedule))):
        raise TypeError(f"{arg} must be a PositionEncoding or LayerSchedule subclass, got "
                        f"{cls!r}")


def register_encoding(cls, name: str | None = None, *, replace: bool = False):
    """Register ``cls`` under ``name`` (default ``cls.name``) in :data:`ENCODINGS`.

    Args:
        cls: a :class:`~tutorial_pkg.encodings.builtin.PositionEncoding` or
            :class:`~tutorial_pkg.encodings.schedules.LayerSchedule` subclass (the class, not an
            instance).
        name: the name to build it by; default its ``name`` class attribute.
        replace: allow replacing another class registered under ``name``.

    Returns:
        ``cls``, so that it can decorate the class.

    Raises:
        TypeError: ``cls`` is not such a class, or ``name`` is not a non-empty str.
        ValueError: ``name`` is taken by another class and ``replace`` is false.

    Example:
        >>> @register_encoding
        ... class Mine(NoPE):
        ...     name = "mine"
        >>> make_encoding("mine").name
        'mine'
        >>> del ENCODINGS["mine"]
    """
    _check_class("cls", cls)
    name = cls.name if name is None else name
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    check_bool("replace", replace)
    if ENCODINGS.get(name, cls) is not cls and not replace:
        raise ValueError(f"name {name!r} is registered for {ENCODINGS[name].__name__}; pass "
                         f"replace=True to replace it")
    ENCODINGS[name] = cls
    return cls


for _cls in BUILTINS:
    register_encoding(_cls)
del _cls


def make_encoding(
    name: str,
    *,
    d_model: int | None = None,
    n_heads: int | None = None,
    head_dim: int | None = None,
    max_positions: int | None = None,
    **kwargs,
) -> PositionEncoding | LayerSchedule:
    """Build an encoding (or a schedule) by name from the model's sizes.

    The registry :data:`ENCODINGS` is the dispatch: the class registered under
    ``name`` is built by its ``build`` classmethod, which passes each size its
    constructor asks for. So ``sinusoidal`` and ``learned`` use ``d_model``
    (``learned`` also ``max_positions``, the size of its table), ``rope`` and the
    schedules use ``head_dim`` (default ``d_model // n_heads``), ``alibi`` uses
    ``n_heads``, ``hybrid`` both. ``max_positions`` is the model's size, like the
    others: the encodings that take any position ignore it (a RoPE that refuses
    positions past ``N`` is ``Rotary(head_dim, max_positions=N)``). Extra keyword
    arguments go to the constructor.

    Raises:
        ValueError: an unknown ``name``, a size the class needs that is missing, or
            ``d_model`` not divisible by ``n_heads``.
        TypeError: the registered value is not an encoding or schedule class, or the
            constructor does not take a keyword argument.

    Example:
        >>> enc = make_encoding("alibi", n_heads=8)
        >>> enc.slopes.shape
        torch.Size([8])
    """
    check_choice("name", name, ENCODINGS)
    if head_dim is None and d_model is not None and n_heads is not None:
        check_positive_int("n_heads", n_heads)
        check_positive_int("d_model", d_model)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        head_dim = d_model // n_heads
    cls = ENCODINGS[name]
    _check_class(f"ENCODINGS[{name!r}]", cls)
    return cls.build(d_model=d_model, n_heads=n_heads, head_dim=head_dim,
                     max_positions=max_positions, **kwargs)
