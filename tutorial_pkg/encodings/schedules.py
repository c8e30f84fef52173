"""Per-layer schedules: a different encoding (and window) in different layers.

Recent models do not use one encoding in every layer:

* **NoPE every k-th layer.** Llama 4 ("iRoPE") and SmolLM3 leave every 4th layer
  without RoPE: in Hugging Face's configs, layer ``i`` (from 0) uses RoPE iff
  ``(i + 1) % no_rope_layer_interval != 0``, with an interval of 4 (3 RoPE : 1 NoPE).
  :class:`NoPEEvery` (``"irope"``). Llama 4 also limits its RoPE layers to chunks of
  8192 tokens and tunes the NoPE layers' softmax temperature at long lengths; neither
  is reproduced here.
* **Local and global layers.** Gemma 3 alternates 5 local layers (sliding window of
  1024 tokens, RoPE base 10 000) with 1 global layer (every key, RoPE base 1 000 000):
  layer ``i`` is global iff ``(i + 1) % sliding_window_pattern == 0`` with a pattern
  of 6. :class:`LocalGlobal` (``"local_global"``).
* Any list of encodings, one per layer: :class:`PerLayer`.

A schedule is not an encoding: it is a small :class:`LayerSchedule` that
:class:`~tutorial_pkg.models.tiny_lm.TinyLM` asks, layer by layer, for the encoding and the
sliding window (:meth:`LayerSchedule.layer`); a single attention layer refuses one (it
needs the layer's encoding). Schedules are registered by name in
:data:`~tutorial_pkg.encodings.registry.ENCODINGS` with the encodings, so ``TinyLM("irope")``
and the experiments of chapter 7 build them like any encoding (their ``build`` gets
the model's ``head_dim``). Schedules hold relative encodings only (an absolute one is
added once, to the embeddings, not per layer). Their RoPE layers take RoPE's options
as :class:`~tutorial_pkg.encodings.builtin.Rotary` does: a ready part, or the arguments of
:class:`~tutorial_pkg.encodings.rope.RotaryEmbedding`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from torch import nn

from .._checks import check_positive_int
from .builtin import NoPE, PositionEncoding, Rotary

__all__ = ["LayerSchedule", "PerLayer", "NoPEEvery", "LocalGlobal"]


def _check_window(name: str, window) -> int | None:
    return None if window is None else check_positive_int(name, window)


class LayerSchedule(nn.Module):
    """Base class: one encoding and one sliding window per layer (not itself an encoding).

    Subclasses implement :meth:`layer` and call ``self._summarise()`` once their members
    are set. ``n_layers`` is the number of layers the schedule was made for, or
    ``None`` when it is a repeating pattern that fits any depth. The declared
    attributes summarise the layers for :class:`~tutorial_pkg.models.tiny_lm.TinyLM` and the
    experiments: ``max_positions`` is the smallest of theirs, ``supports_scaling`` is
    true when some layer has RoPE (:meth:`set_scaling` then reaches the layers that
    :meth:`scaled_layers` lists). The members are submodules, so ``.to()`` and
    ``state_dict`` reach them.
    """

    name: ClassVar[str] = "schedule"
    n_layers: int | None = None
    max_positions: int | None = None
    supports_scaling: bool = False

    @classmethod
    def build(cls, *, d_model=None, n_heads=None, head_dim=None, max_positions=None,
              **kwargs):
        """``cls(head_dim, **kwargs)``, for :func:`~tutorial_pkg.encodings.registry.make_encoding`.

        A schedule's layers are relative encodings that need the model's ``head_dim``
        (``ValueError`` when it is ``None``); override this for other sizes.
        """
        if head_dim is None:
            raise ValueError(f"make_encoding({cls.name!r}) needs head_dim")
        return cls(head_dim, **kwargs)

    def layer(self, i: int) -> tuple[PositionEncoding, int | None]:
        """The encoding and the sliding window (``None``: every key) of layer ``i``."""
        raise NotImplementedError

    def _check_layer(self, i) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0 or (
            self.n_layers is not None and i >= self.n_layers
        ):
            bound = "" if self.n_layers is None else f" < {self.n_layers}"
            raise ValueError(f"i must be a layer index >= 0{bound}, got {i!r}")
        return i

    def describe(self, n_layers: int) -> list[str]:
        """One label per layer, e.g. ``["rope", "rope", "rope", "nope"]`` or ``"rope/w=1024"``."""
        check_positive_int("n_layers", n_layers)
        labels = []
        for i in range(n_layers):
            encoding, window = self.layer(i)
            labels.append(encoding.name + ("" if window is None else f"/w={window}"))
        return labels

    def _members(self) -> list[PositionEncoding]:
        return [m for m in self.children() if isinstance(m, PositionEncoding)] + [
            m for ml in self.children() if isinstance(ml, nn.ModuleList) for m in ml
        ]

    def _summarise(self) -> None:
        members = self._members()
        for m in members:
            if type(m).embed is not PositionEncoding.embed:
                raise ValueError(
                    f"{type(m).__name__} adds positions to the embeddings (once, not per "
                    f"layer): it cannot be one layer's encoding in a schedule"
                )
        limits = [m.max_positions for m in members if m.max_positions is not None]
        self.max_positions = min(limits) if limits else None
        self.supports_scaling = bool(self.scaled_layers())

    def scaled_layers(self) -> list[PositionEncoding]:
        """The members that :meth:`LayerSchedule.set_scaling` changes (default: all with RoPE)."""
        return [m for m in self._members() if m.supports_scaling]

    @property
    def scaling(self) -> dict | None:
        """The scaling rule of the first scaled member (they share one), or None."""
        scaled = self.scaled_layers()
        return scaled[0].scaling if scaled else None

    def set_scaling(self, scaling: dict | None) -> None:
        """Set the RoPE scaling rule of every member :meth:`scaled_layers` lists."""
        scaled = self.scaled_layers()
        if not scaled:
            raise ValueError(f"scaling applies to RoPE layers; {type(self).__name__} has none")
        for m in scaled:
            m.set_scaling(scaling)


class PerLayer(LayerSchedule):
    """An explicit list: ``encodings[i]`` (and ``windows[i]``) for layer ``i``.

    Args:
        encodings: one :class:`~tutorial_pkg.encodings.builtin.PositionEncoding` per layer (the
            same instance may appear several times: the layers then share it).
        windows: optional sliding window per layer (``None`` entries: every key).
    """

    name = "per_layer"

    def __init__(self, encodings: Sequence[PositionEncoding],
                 windows: Sequence[int | None] | None = None) -> None:
        super().__init__()
        if isinstance(encodings, (str, PositionEncoding)) or not isinstance(
            encodings, Sequence
        ) or not encodings:
            raise TypeError(f"encodings must be a non-empty list of PositionEncoding, got "
                            f"{type(encodings).__name__}")
        for i, enc in enumerate(encodings):
            if not isinstance(enc, PositionEncoding):
                raise TypeError(f"encodings[{i}] must be a PositionEncoding, got "
                                f"{type(enc).__name__}")
        windows = [None] * len(encodings) if windows is None else list(windows)
        if len(windows) != len(encodings):
            raise ValueError(f"windows must have one entry per layer ({len(encodings)}), "
                             f"got {len(windows)}")
        self.windows = [_check_window(f"windows[{i}]", w) for i, w in enumerate(windows)]
        self.n_layers = len(encodings)
        # each distinct module once (a shared instance is one member)
        unique = list({id(e): e for e in encodings}.values())
        self.members = nn.ModuleList(unique)
        self._order = [next(j for j, u in enumerate(unique) if u is e) for e in encodings]
        self._summarise()

    def layer(self, i):
        i = self._check_layer(i)
        return self.members[self._order[i]], self.windows[i]


class NoPEEvery(LayerSchedule):
    """RoPE in every layer but every ``every``-th, which has none (Llama 4, SmolLM3).

    Layer ``i`` (from 0) has no position encoding iff ``(i + 1) % every == 0``,
    Hugging Face's ``no_rope_layers`` rule; ``every=4`` gives 3 RoPE : 1 NoPE. The
    RoPE layers share one :class:`~tutorial_pkg.encodings.builtin.Rotary`.

    Args:
        rope: the RoPE layers' part: a :class:`~tutorial_pkg.encodings.builtin.Rotary` (shared),
            a :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding`, or ``head_dim``.
        every: period of the NoPE layers (>= 2).
        window: optional sliding window of the RoPE layers (the NoPE layers see every key).
        **rope_options: for ``rope`` given as ``head_dim``, the other arguments of
            :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding` (``base``, ``layout``,
            ``rotary_dim``, ``scaling``, ...).
    """

    name = "irope"

    def __init__(self, rope: Rotary | int, *, every: int = 4, window: int | None = None,
                 **rope_options) -> None:
        super().__init__()
        if check_positive_int("every", every) < 2:
            raise ValueError(f"every must be >= 2 (every=1 would be NoPE everywhere), "
                             f"got {every}")
        self.every = every
        self.window = _check_window("window", window)
        self.rope = Rotary.of(rope, **rope_options)
        self.nope = NoPE()
        self.head_dim = self.rope.head_dim
        self._summarise()

    def layer(self, i):
        i = self._check_layer(i)
        return (self.nope, None) if (i + 1) % self.every == 0 else (self.rope, self.window)


class LocalGlobal(LayerSchedule):
    """Gemma 3's layers: ``pattern - 1`` local layers, then one global layer, repeated.

    Layer ``i`` (from 0) is global iff ``(i + 1) % pattern == 0``. Local layers attend
    within a sliding window with RoPE base ``local_base``; global layers see every key
    with RoPE base ``global_base`` (and ``global_scaling``, e.g. Gemma 3's
    ``{"type": "linear", "factor": 8}``). :meth:`LayerSchedule.set_scaling` changes the
    global layers only, as Gemma 3 scales only them.

    Args:
        head_dim: features per head.
        pattern: period (Gemma 3: 6, i.e. 5 local : 1 global); >= 2.
        window: sliding window of the local layers (Gemma 3: 1024 tokens).
        local_base: RoPE base of the local layers (Gemma 3: 10 000).
        global_base: RoPE base of the global layers (Gemma 3: 1 000 000).
        global_scaling: RoPE scaling rule of the global layers, or None.
        **rope_options: the other arguments of :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding`
            for both (``layout``, ``rotary_dim``).
    """

    name = "local_global"

    def __init__(self, head_dim: int, *, pattern: int = 6, window: int = 1024,
                 local_base: float = 10_000.0, global_base: float = 1_000_000.0,
                 global_scaling: dict | None = None, **rope_options) -> None:
        super().__init__()
        if check_positive_int("pattern", pattern) < 2:
            raise ValueError(f"pattern must be >= 2 (one global layer per pattern), "
                             f"got {pattern}")
        self.pattern = pattern
        self.window = check_positive_int("window", window)
        self.local_rope = Rotary(head_dim, local_base, **rope_options)
        self.global_rope = Rotary(head_dim, global_base, scaling=global_scaling, **rope_options)
        self.head_dim = self.local_rope.head_dim
        self._summarise()

    def scaled_layers(self):
        return [self.global_rope]

    def layer(self, i):
        i = self._check_layer(i)
        if (i + 1) % self.pattern == 0:
            return self.global_rope, None
        return self.local_rope, self.window

