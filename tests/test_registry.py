"""Tests of tutorial_pkg.encodings.registry: :data:`~tutorial_pkg.encodings.registry.ENCODINGS`
holds every built-in encoding and schedule under its name,
:func:`~tutorial_pkg.encodings.registry.register_encoding` adds a class (and refuses what is not
one, or a name taken by another class unless asked to replace it), and
:func:`~tutorial_pkg.encodings.registry.make_encoding` builds each class from the model's sizes,
dispatching through the registry (a user's encoding too: the classes of test_custom_encoding.py).
"""

from __future__ import annotations

import pytest

from tutorial_pkg.encodings.builtin import (
    ALiBi,
    Hybrid,
    Learned,
    NoPE,
    PositionEncoding,
    Rotary,
    Sinusoidal,
)
from tutorial_pkg.encodings.registry import (
    BUILTINS,
    ENCODINGS,
    make_encoding,
    register_encoding,
)
from tutorial_pkg.encodings.relative_bias import T5RelativeBias
from tutorial_pkg.encodings.schedules import LayerSchedule, LocalGlobal, NoPEEvery

from .test_custom_encoding import LogDistanceBias, SwitchableBias

D_MODEL, N_HEADS, HEAD_DIM = 16, 4, 4


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(ENCODINGS, "log_distance", LogDistanceBias)
    monkeypatch.setitem(ENCODINGS, "switchable", SwitchableBias)


def test_registry_names_and_classes():
    # every encoding of the book (other modules may register more, e.g. a test's own)
    assert {"nope", "sinusoidal", "learned", "rope", "alibi", "hybrid", "t5", "irope",
            "local_global"} <= set(ENCODINGS)
    for name, cls in ENCODINGS.items():
        assert cls.name == name and issubclass(cls, (PositionEncoding, LayerSchedule))
    # schedules are registered by name, but they are not encodings
    for name in ("irope", "local_global"):
        assert not issubclass(ENCODINGS[name], PositionEncoding)


def test_register_encoding_adds_a_class_and_refuses_what_is_not_one():
    class Mine(NoPE):
        name = "mine_test"

    try:
        assert register_encoding(Mine) is Mine and ENCODINGS["mine_test"] is Mine
        assert type(make_encoding("mine_test")) is Mine
        register_encoding(Mine)  # the same class again: nothing to refuse
        with pytest.raises(ValueError, match="mine_test"):
            register_encoding(type("Other", (NoPE,), {"name": "mine_test"}))
        assert register_encoding(Mine, "mine_alias") is Mine and ENCODINGS["mine_alias"] is Mine
    finally:
        ENCODINGS.pop("mine_test", None)
        ENCODINGS.pop("mine_alias", None)
    with pytest.raises(TypeError, match="cls"):
        register_encoding(NoPE())  # an instance, not a class
    with pytest.raises(TypeError, match="cls"):
        register_encoding(dict)
    with pytest.raises(TypeError, match="name"):
        register_encoding(Mine, "")
    with pytest.raises(ValueError, match="rope"):
        register_encoding(Mine, "rope")  # a built-in name is not overwritten by accident


@pytest.mark.parametrize(
    "name, cls, kwargs",
    [
        ("nope", NoPE, {}),
        ("sinusoidal", Sinusoidal, {}),
        ("learned", Learned, {"max_positions": 32}),
        ("rope", Rotary, {"base": 500000.0}),
        ("alibi", ALiBi, {"mode": "symmetric"}),
        ("hybrid", Hybrid, {"mix": "alpha", "alpha": 0.25}),
        ("t5", T5RelativeBias, {"num_buckets": 16}),
        ("irope", NoPEEvery, {"every": 3}),
        ("local_global", LocalGlobal, {"window": 64}),
    ],
)
def test_make_encoding_builds_each_class_from_model_sizes(name, cls, kwargs):
    enc = make_encoding(name, d_model=D_MODEL, n_heads=N_HEADS, **kwargs)
    assert type(enc) is cls
    if name in ("rope", "hybrid"):
        assert enc.rope.head_dim == HEAD_DIM  # derived as d_model // n_heads
    if name == "rope":
        assert enc.rope.base == 500000.0
    if name in ("alibi", "hybrid"):
        assert enc.n_heads == N_HEADS
    if name == "learned":
        assert enc.table.weight.shape == (32, D_MODEL)


def test_make_encoding_dispatches_through_the_registry(registered):
    enc = make_encoding("log_distance", d_model=32, n_heads=4)
    assert type(enc) is LogDistanceBias and enc.n_heads == 4  # not a Hybrid
    with pytest.raises(ValueError, match="n_heads"):
        make_encoding("log_distance", d_model=32)
    with pytest.raises(TypeError, match="colour"):
        make_encoding("log_distance", n_heads=4, colour="red")
    assert type(make_encoding("switchable", n_heads=4, on=True)) is SwitchableBias


def test_unregistered_names_are_refused():
    with pytest.raises(ValueError, match="name"):
        make_encoding("log_distance", n_heads=4)


# --------------------------------------------------------------------------- new tests
def test_every_builtin_is_registered_under_its_own_name():
    names = [cls.name for cls in BUILTINS]
    assert len(set(names)) == len(names)  # no built-in shadows another
    for cls in BUILTINS:
        assert ENCODINGS[cls.name] is cls, cls.name


def test_register_encoding_replaces_a_class_only_when_asked():
    class First(NoPE):
        name = "replace_test"

    class Second(NoPE):
        name = "replace_test"

    try:
        register_encoding(First)
        with pytest.raises(ValueError, match="replace=True"):
            register_encoding(Second)
        assert ENCODINGS["replace_test"] is First  # the refused call changed nothing
        assert register_encoding(Second, replace=True) is Second
        assert type(make_encoding("replace_test")) is Second
        with pytest.raises(TypeError, match="replace"):
            register_encoding(First, replace="yes")
        assert ENCODINGS["replace_test"] is Second
    finally:
        ENCODINGS.pop("replace_test", None)


def test_make_encoding_refuses_a_registered_value_that_is_not_a_class(monkeypatch):
    monkeypatch.setitem(ENCODINGS, "bogus", dict)  # written into the dict, past the checks
    with pytest.raises(TypeError, match=r"ENCODINGS\['bogus'\]"):
        make_encoding("bogus", d_model=D_MODEL, n_heads=N_HEADS)


def test_make_encoding_derives_head_dim_only_when_it_is_not_given():
    assert make_encoding("rope", d_model=32, n_heads=4).rope.head_dim == 8
    assert make_encoding("rope", d_model=32, n_heads=4, head_dim=16).rope.head_dim == 16
    assert make_encoding("rope", head_dim=6).rope.head_dim == 6  # no sizes needed beyond it
    with pytest.raises(ValueError, match="n_heads"):
        make_encoding("rope", d_model=32, n_heads=0)
    with pytest.raises(ValueError, match="d_model"):
        make_encoding("rope", d_model=-8, n_heads=4)
