"""One interface for every position encoding, and the encodings built on it. Chapters 4 and 6.

Encodings act at different places of attention. Every encoding has the same hooks,
and :class:`~tutorial_pkg.attention.layer.MultiHeadAttention` calls them, so adding an
encoding never touches attention:

=========================================  ==========================  =========================
hook                                       used by                     returns
=========================================  ==========================  =========================
``embed(x, positions)``                    sinusoidal, learned         ``x`` plus positions
``rotate(q, k, q_pos, k_pos)``             RoPE, hybrid                rotated ``q, k``
``bias(q_pos, k_pos)``                     ALiBi, hybrid, T5           fp32 ``(H, s, L_k)``
``score_mod(q_offset, q_pos, k_pos)``      ALiBi, hybrid, T5 (Flex)    a Flex ``score_mod``
``key_bias(k_pos)``                        ALiBi, hybrid (fast path)   fp32 ``(H, 1, L_k)``
=========================================  ==========================  =========================

Each returns the identity (``embed``, ``rotate``) or ``None`` (the others) when the
encoding does not act there; attention then skips that step. ``score_mod`` and
``key_bias`` are other forms of ``bias``: the first for FlexAttention (the bias is never
built), the fifth hook for speed: when the bias equals a per-key row *up to a
constant per query*, softmax cannot tell them apart (``softmax(s + c) = softmax(s)``),
so attention may add the row ``(H, 1, L_k)`` instead of the ``(H, s, L_k)`` matrix.
Causal ALiBi is such a bias: ``-m (i - j) = m j - m i``.

**Parts and composites.** RoPE's options are those of
:class:`~tutorial_pkg.encodings.rope.RotaryEmbedding`, listed there only: :class:`Rotary` wraps
one (or builds it from the same arguments), and everything that rotates takes a
:class:`Rotary`, a ``RotaryEmbedding`` or those arguments. :class:`Hybrid` is composed
of a :class:`Rotary` and an :class:`ALiBi`: it rotates with the first and biases with
the second (the bias is written once, in :class:`ALiBi`).

**By name.** :data:`~tutorial_pkg.encodings.registry.ENCODINGS`,
:func:`~tutorial_pkg.encodings.registry.make_encoding` and
:func:`~tutorial_pkg.encodings.registry.register_encoding` live in
:mod:`tutorial_pkg.encodings.registry`, the
module that lists every built-in encoding and schedule: it sits above this one, T5's
:mod:`~tutorial_pkg.encodings.relative_bias` and :mod:`~tutorial_pkg.encodings.schedules`, so it can
name them all while imports point one way.

Positions are explicit integer tensors, ``(L,)`` or ``[b, L]``, so decoding with a KV
cache, left-padded batches and packed documents are correct for every encoding: a
token at position ``t`` is embedded, rotated and biased as position ``t``.
"""

from __future__ import annotations

import inspect
from typing import ClassVar

import torch
from torch import nn

from .._checks import (
    _is_fake,
    as_batched_positions,
    check_choice,
    check_device,
    check_even,
    check_float_tensor,
    check_positive_float,
    check_positive_int,
    values_readable,
)
from .alibi import ALIBI_MODES, _alibi_bias, _score_mod_signature, alibi_score_mod, alibi_slopes
from .rope import RotaryEmbedding
from .rope_config import RopeConfig
from .sinusoidal import SinusoidalPositionalEmbedding

__all__ = [
    "PositionEncoding",
    "NoPE",
    "Sinusoidal",
    "Learned",
    "Rotary",
    "PRoPE",
    "ALiBi",
    "Hybrid",
    "check_learned_device",
]



def _need_size(cls, arg: str, value):
    if value is None:
        raise ValueError(f"make_encoding({cls.name!r}) needs {arg}")
    return value


class PositionEncoding(nn.Module):
    """Base class: every hook is the identity / ``None``; subclasses override what they need.

    **Positions.** Hooks receive integer positions ``(L,)`` or ``[b, L]`` (one row per
    sequence: left padding, packed documents). Attention checks them once per forward
    pass (integer dtype, shape, not negative), so hooks need not read them back.

    **What attention may read** (class or instance attributes; ``None`` = no constraint):

    * ``n_heads``: the head count the encoding was built for (ALiBi slopes);
    * ``head_dim``: the head width it rotates (RoPE);
    * ``max_positions``: positions must be below it (learned tables);
    * ``supports_scaling``: it has ``scaling`` (the current rule, a dict or None) and
      ``set_scaling(rule)`` for RoPE context extension;
    * ``static_bias``: :meth:`bias` depends on positions only, so attention may cache it
      (``False`` for a learnable bias).

    **Devices.** Hooks build what they return on the device of the positions (or of
    ``x``, ``q``). Constants an encoding holds (ALiBi's slopes, RoPE's frequencies and
    tables) are moved there, so a table built for a GPU is built from GPU tensors;
    learned tensors are not (a copy would not be trained): on another device they raise
    ``ValueError`` naming both devices (:func:`check_learned_device`).

    **Building by name.** :func:`~tutorial_pkg.encodings.registry.make_encoding` looks the
    name up in :data:`~tutorial_pkg.encodings.registry.ENCODINGS` and calls :meth:`build`
    with the model's sizes; the default :meth:`build` passes
    each size the constructor asks for by name (``d_model``, ``n_heads``,
    ``head_dim``, ``max_positions``), so a new encoding needs no code outside its class.
    """

    name: ClassVar[str] = "base"
    static_bias: ClassVar[bool] = True
    n_heads: int | None = None
    head_dim: int | None = None
    max_positions: int | None = None
    supports_scaling: ClassVar[bool] = False

    @classmethod
    def build(
        cls,
        *,
        d_model: int | None = None,
        n_heads: int | None = None,
        head_dim: int | None = None,
        max_positions: int | None = None,
        **kwargs,
    ) -> PositionEncoding:
        """Build from a model's sizes: each size the constructor names is passed.

        A size the constructor requires but that is ``None`` raises ``ValueError``
        naming it; keyword arguments the constructor does not take raise ``TypeError``.
        """
        sizes = {"d_model": d_model, "n_heads": n_heads, "head_dim": head_dim,
                 "max_positions": max_positions}
        params = inspect.signature(cls.__init__).parameters
        for arg, value in sizes.items():
            if arg not in params or arg in kwargs:
                continue
            if value is None:
                if params[arg].default is inspect.Parameter.empty:
                    raise ValueError(f"make_encoding({cls.name!r}) needs {arg}")
                continue
            kwargs[arg] = value
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        unknown = sorted(set(kwargs) - set(params)) if not accepts_any else []
        if unknown:
            raise TypeError(f"make_encoding({cls.name!r}) got unexpected arguments {unknown}")
        return cls(**kwargs)

    # -- the hooks ------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Add absolute positions ``(s,)`` or ``[b, s]`` to embeddings ``[b, s, d]``; identity."""
        return x

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[b, H, s, d]`` and ``k`` ``[b, H_kv, L_k, d]``; identity."""
        return q, k

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Additive float32 score bias, or ``None``.

        ``(H, s, L_k)`` for positions ``(L,)``; ``(b, H, s, L_k)`` for ``[b, L]``.
        """
        return None

    def score_mod(
        self,
        q_offset: int = 0,
        q_pos: torch.Tensor | None = None,
        k_pos: torch.Tensor | None = None,
    ) -> _score_mod_signature | None:
        """FlexAttention ``score_mod`` equal to adding :meth:`bias`, or ``None``.

        Positions are ``q_offset + q_idx`` and ``kv_idx``, or, when given, read from
        ``q_pos[b, q_idx]`` and ``k_pos[b, kv_idx]`` (int64 ``[b, L]``).
        """
        return None

    def key_bias(self, k_pos: torch.Tensor) -> torch.Tensor | None:
        """The bias as one row per head, float32 ``(H, 1, L_k)`` (``(b, H, 1, L_k)``), or ``None``.

        The fifth hook, for speed. Only for a bias that depends on the query through
        a per-query constant alone, ``bias(i, j) = row(j) + c(i)``: softmax is shift
        invariant along each query's row, so adding ``row`` gives the same attention
        weights as adding :meth:`bias`. ``None`` (the default) means the bias has no
        such form (or there is no bias). Used by the ``"auto"`` attention backend.
        """
        return None

    @property
    def has_bias(self) -> bool:
        """Whether the class overrides :meth:`bias` (attention asks the hook itself)."""
        return type(self).bias is not PositionEncoding.bias

    def cache_key(self) -> tuple:
        """What a table built from this encoding depends on: backends key their caches by it.

        The default covers every plain setting (``bool``, ``int``, ``float``, ``str``
        attributes of the encoding and its submodules, such as ALiBi's mode; an encoding
        reads its own again only after an attribute is set) and every tensor, by identity
        and in-place version, so a ``.to()``, a new buffer or an in-place change of the
        slopes gives a new key and a stale table is never served.
        Override it (returning a hashable tuple) when a table depends on anything else.
        """
        settings = tuple(item for module in self.modules() for item in _settings(module))
        return settings + tuple(_tensor_token(t) for t in (*self.buffers(), *self.parameters()))

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        self.__dict__["_settings_cache"] = None  # cache_key reads the settings again


def _settings(module: nn.Module) -> tuple:
    """The plain settings of one module (``bool``, ``int``, ``float``, ``str``), for
    :meth:`PositionEncoding.cache_key`; kept by an encoding until an attribute is set."""
    cached = module.__dict__.get("_settings_cache")
    if cached is not None:
        return cached
    found = tuple((name, value) for name, value in vars(module).items()
                  if isinstance(value, (bool, int, float, str)) and name != "training")
    if isinstance(module, PositionEncoding):
        module.__dict__["_settings_cache"] = found
    return found


def _tensor_token(t: torch.Tensor) -> tuple:
    # meta and fake tensors have no data pointer (0, and a warning for fake ones)
    ptr = id(t) if t.device.type == "meta" or _is_fake(t) else t.data_ptr()
    try:
        return (ptr, t._version)
    except RuntimeError:  # inference tensors keep no version counter
        return (ptr, 0)


def check_learned_device(encoding: nn.Module, device) -> None:
    """Raise ``ValueError`` if a parameter of ``encoding`` is not on ``device``.

    A hook cannot move a learned tensor to the device of the call: the copy would get
    the gradient and the parameter would never be trained (and a copy per call is slow).
    """
    for name, p in encoding.named_parameters():
        check_device(f"{type(encoding).__name__}'s learned {name}", p, device,
                     fix="move the encoding (or the layer or model holding it) to that "
                         "device with .to(device)")


class NoPE(PositionEncoding):
    """No position information at all (causal masking alone leaks some order)."""

    name = "nope"


class Sinusoidal(PositionEncoding):
    """Absolute sinusoidal encoding added to the embeddings (Vaswani et al., 2017).

    Args:
        d_model: model width (even).
        base: wavelength base.
        scale: factor of the table (chapter 7 compares 1 with the embeddings' scale).
    """

    name = "sinusoidal"

    def __init__(self, d_model: int, base: float = 10000.0, scale: float = 1.0) -> None:
        super().__init__()
        self.pe = SinusoidalPositionalEmbedding(check_even("d_model", d_model), base, scale)

    def embed(self, x, positions):
        return self.pe(x, positions)


class Learned(PositionEncoding):
    """Learned absolute position embeddings (GPT-2 style); at most ``max_positions`` positions.

    Args:
        d_model: model width.
        max_positions: number of learned positions; later positions raise ``ValueError``.
    """

    name = "learned"

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        self.max_positions = check_positive_int("max_positions", max_positions)
        self.table = nn.Embedding(max_positions, d_model)
        nn.init.normal_(self.table.weight, std=0.02)

    def embed(self, x, positions):
        check_float_tensor("x", x, ndim=3)
        check_learned_device(self, x.device)
        positions = as_batched_positions("positions", positions, x.shape[0], x.shape[1])
        # values are read on CPU only (free there); TinyLM checks default positions against
        # max_positions on the host, so a GPU run needs no read back for them
        if positions.numel() and values_readable(positions):
            top = int(positions.max())
            if top >= self.max_positions:
                raise ValueError(
                    f"positions must be < max_positions={self.max_positions} for learned "
                    f"embeddings, got {top} (they cannot extrapolate)"
                )
        return x + self.table(positions.to(x.device)).to(x.dtype)


class Rotary(PositionEncoding):
    """RoPE on queries and keys (Su et al., 2021): one
    :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding`.

    ``Rotary(rope)`` wraps a ready ``RotaryEmbedding`` (shared, not copied; a
    :class:`Rotary` gives its own), or a :class:`~tutorial_pkg.encodings.rope_config.RopeConfig`
    read from a model config. Otherwise the arguments are ``RotaryEmbedding``'s,
    positionally or by name, and are documented there only:
    ``Rotary(head_dim, base, rotary_dim=..., layout=..., scaling=..., p_rope=...,
    max_positions=..., fused=...)``.

    Args:
        rope: a ``RotaryEmbedding``, a :class:`Rotary`, a ``RopeConfig``, or
            ``head_dim`` (an int).
        base: RoPE base ("theta"); ``None``: ``RotaryEmbedding``'s default (10 000).
        **options: the other arguments of ``RotaryEmbedding`` (with a ``RopeConfig``:
            ``max_positions``, ``fused``, or a setting that overrides the config's).

    Raises:
        TypeError: ``base`` or options given with a ready ``RotaryEmbedding``.
    """

    name = "rope"
    supports_scaling = True

    def __init__(self, rope: RotaryEmbedding | Rotary | RopeConfig | int | None = None,
                 base: float | None = None, **options) -> None:
        super().__init__()
        if base is not None:
            options["base"] = base
        if isinstance(rope, Rotary):
            rope = rope.rope
        if isinstance(rope, RotaryEmbedding):
            if options:
                raise TypeError(f"rope is a ready RotaryEmbedding, whose options are set: "
                                f"do not also pass {sorted(options)}")
            self.rope = rope
        elif isinstance(rope, RopeConfig):
            self.rope = RotaryEmbedding(**{**rope.kwargs(), **options})
        else:
            self.rope = RotaryEmbedding(*(() if rope is None else (rope,)), **options)
        self.head_dim = self.rope.head_dim
        self.max_positions = self.rope.max_positions

    @classmethod
    def of(cls, rope, base: float | None = None, **options) -> Rotary:
        """``rope`` itself if it is a :class:`Rotary` (shared) and nothing else is given,
        else ``cls(rope, base, **options)``: how composites take their RoPE part."""
        if isinstance(rope, Rotary) and base is None and not options:
            return rope
        return cls(rope, base, **options)

    @classmethod
    def build(cls, *, d_model=None, n_heads=None, head_dim=None, max_positions=None,
              **options):
        """``cls(head_dim, **options)``: RoPE needs the model's ``head_dim`` only."""
        return cls(_need_size(cls, "head_dim", head_dim), **options)

    def rotate(self, q, k, q_pos, k_pos):
        # attention checked the positions; their values are read back again only to
        # enforce an optional max_positions (a synchronisation per call on a GPU, the
        # price of that opt-in limit). q_pos is k_pos: cos/sin built once
        return self.rope(q, k, q_pos, k_pos,
                         check_positions=self.rope.max_positions is not None)

    @property
    def scaling(self) -> dict | None:
        """The current RoPE scaling rule (a copy), or None."""
        return None if self.rope.scaling is None else dict(self.rope.scaling)

    def set_scaling(self, scaling: dict | None) -> None:
        """Change the RoPE scaling rule (e.g. at evaluation).

        See :func:`~tutorial_pkg.encodings.rope_scaling.scaled_inv_freq`.
        """
        self.rope.set_scaling(scaling)


class PRoPE(Rotary):
    """p-RoPE (Barbero et al., 2025): RoPE whose slowest pairs do not rotate.

    :class:`Rotary` with ``p_rope`` (default 0.75): the fastest fraction ``p_rope``
    of the frequencies rotate, the rest are 0 (chapter 8). Registered as ``"p_rope"``
    so that ``TinyLM("p_rope")`` and the experiments build it by name.

    Args:
        head_dim: features per head.
        base: RoPE base (``None``: the default).
        p_rope: fraction of the frequencies that rotate, in ``[0, 1]``.
        **options: other arguments of :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding`.
    """

    name = "p_rope"

    def __init__(self, head_dim: int, base: float | None = None, *, p_rope: float = 0.75,
                 **options) -> None:
        super().__init__(head_dim, base, p_rope=p_rope, **options)


class ALiBi(PositionEncoding):
    """ALiBi linear biases (Press et al., 2022); no parameters, nothing added to ``x``.

    Args:
        n_heads: number of query heads (one slope each).
        mode: ``"causal"`` (``-m(i-j)``), ``"key_only"`` (``m j``) or
            ``"symmetric"`` (``-m|i-j|``, for encoders).
        bias_scale: a positive factor of the bias (default 1: the paper's, not divided
            by ``sqrt(d)``). Falcon (``alibi=True``) divides it by ``sqrt(head_dim)``:
            ``ALiBi(n_heads, bias_scale=head_dim ** -0.5)``. Every hook (:meth:`bias`,
            :meth:`score_mod`, :meth:`key_bias`) applies it, as slopes ``m_h * bias_scale``
            (:meth:`effective_slopes`; ``slopes`` stay the paper's).

    The three bias hooks take an optional keyword ``slopes`` (float ``(H,)``) that
    replaces :meth:`effective_slopes`: a composite such as :class:`Hybrid` passes its
    own scaled slopes and reuses this one implementation of the bias.

    **Falcon's bfloat16.** Falcon's ``build_alibi_tensor`` rounds the slopes and each
    ``m_h * j`` to bfloat16 whatever the model's dtype; the package keeps slopes and
    bias in float32 (DESIGN.md). With a power-of-two head count the slopes are powers
    of two, so both are exact while key positions stay below 256 and the outputs agree;
    past that, or with another head count, they differ by that rounding (relative
    ``2**-9`` of the bias). To reproduce it, override the hooks with Falcon's arithmetic
    in the key-only form (its form)::

        class FalconBF16ALiBi(ALiBi):
            def __init__(self, n_heads, head_dim):
                super().__init__(n_heads, mode="key_only", bias_scale=head_dim ** -0.5)

            def bias(self, q_pos, k_pos):  # bfloat16 slopes times key positions
                m = self.slopes.to(k_pos.device).bfloat16()[:, None, None]
                return (m * k_pos[..., None, None, :]).float() * self.bias_scale

            def key_bias(self, k_pos):  # the same row, for the "auto" backend
                return self.bias(k_pos, k_pos)

    with the ``"naive"``, ``"sdpa"`` or ``"auto"`` backend (its :meth:`score_mod`, for
    ``"flex"``, stays float32). tests/test_alibi.py holds this recipe to transformers'
    ``build_alibi_tensor``.
    """

    name = "alibi"

    def __init__(self, n_heads: int, *, mode: str = "causal", bias_scale: float = 1.0) -> None:
        super().__init__()
        self.n_heads = check_positive_int("n_heads", n_heads)
        self.mode = check_choice("mode", mode, ALIBI_MODES)
        self.bias_scale = check_positive_float("bias_scale", bias_scale)
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def effective_slopes(self) -> torch.Tensor:
        """The slopes the hooks apply: ``m_h * bias_scale``."""
        return self.slopes if self.bias_scale == 1.0 else self.slopes * self.bias_scale

    def bias(self, q_pos, k_pos, *, slopes=None):
        slopes = self.effective_slopes() if slopes is None else slopes
        return _alibi_bias(slopes, q_pos, k_pos, self.mode)

    def score_mod(self, q_offset=0, q_pos=None, k_pos=None, *, slopes=None):
        slopes = self.effective_slopes() if slopes is None else slopes
        return alibi_score_mod(slopes, mode=self.mode, q_offset=q_offset,
                               q_pos=q_pos, k_pos=k_pos)

    def key_bias(self, k_pos, *, slopes=None):
        # -m (i - j) = m j - m i: the key-only row, for the causal and key_only forms
        if self.mode == "symmetric":
            return None
        slopes = self.effective_slopes() if slopes is None else slopes
        return _alibi_bias(slopes, k_pos, k_pos, "key_only")

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        if self.slopes.dtype not in (torch.float32, torch.float64):
            # .half()/.bfloat16() must not round the slopes: the bias is float32
            self.slopes = alibi_slopes(self.n_heads, device=self.slopes.device)
        return out


class Hybrid(PositionEncoding):
    """RoPE on ``q, k`` plus the ALiBi bias on the scores: a :class:`Rotary` and an
    :class:`ALiBi`, composed. Chapter 6.

    :meth:`rotate` is the RoPE part's and the bias hooks are the ALiBi part's, called
    with the slopes of :meth:`effective_slopes` (the part's, times the scales below).

    ``mix="add"`` (default, the sound form): ``score = (R q).(R k)/sqrt(d) - s_h m_h (i-j)``
    where ``s_h`` is 1, or a learnable positive per-head scale with
    ``learnable_scale=True`` (initialised at 1, stored as its log).

    ``mix="alpha"`` reproduces the ``HybridPositionEncoding`` of article 002 ("RoPE and ALiBi
    in PyTorch: the mathematics and the engineering"; the other source article, 000, has no
    hybrid):
    ``score = alpha (R q).(R k)/sqrt(d) + (1 - alpha) bias``. Note that ``alpha``
    also scales the *content* term (it acts as a softmax temperature), which is
    why it is not the default. It is implemented exactly through the hooks:
    ``q`` is multiplied by ``alpha`` and the bias by ``1 - alpha``.

    Either from parts, ``Hybrid(Rotary(head_dim, layout="interleaved"), ALiBi(n_heads))``
    (shared, not copied), or from sizes, ``Hybrid(head_dim, n_heads, base, layout=...,
    mode=..., bias_scale=...)``: then the RoPE part is ``Rotary(head_dim, base,
    **rope_options)`` and the ALiBi part ``ALiBi(n_heads, mode=..., bias_scale=...)``.

    Args:
        rotary: the RoPE part: a :class:`Rotary`, a
            :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding`, or ``head_dim``.
        alibi: the ALiBi part: an :class:`ALiBi`, or ``n_heads``.
        base: RoPE base, for a ``rotary`` given as ``head_dim`` (``None``: the default).
        mix: ``"add"`` or ``"alpha"``.
        alpha: weight of the RoPE scores for ``mix="alpha"`` (in ``[0, 1]``).
        learnable_scale: learn a per-head multiplier of the ALiBi slopes.
        mode: ALiBi form (default ``"causal"``), for ``alibi`` given as ``n_heads``.
        bias_scale: a fixed factor of the ALiBi bias (default 1; e.g. 1/2 halves every
            slope), for ``alibi`` given as ``n_heads``.
        **rope_options: the other arguments of
            :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding` (``layout``, ``rotary_dim``,
            ``scaling``, ``max_positions``, ``fused``), for ``rotary`` given as ``head_dim``.

    Raises:
        TypeError: ``mode`` or ``bias_scale`` with a ready :class:`ALiBi`, or RoPE
            options with a ready RoPE part.
    """

    name = "hybrid"
    supports_scaling = True

    def __init__(
        self,
        rotary: Rotary | RotaryEmbedding | int,
        alibi: ALiBi | int,
        base: float | None = None,
        *,
        mix: str = "add",
        alpha: float = 0.5,
        learnable_scale: bool = False,
        mode: str | None = None,
        bias_scale: float | None = None,
        **rope_options,
    ) -> None:
        super().__init__()
        self.rotary = Rotary.of(rotary, base, **rope_options)
        if isinstance(alibi, ALiBi):
            given = [name for name, v in (("mode", mode), ("bias_scale", bias_scale))
                     if v is not None]
            if given:
                raise TypeError(f"alibi is a ready ALiBi, whose settings are set: do not "
                                f"also pass {given}")
            self.alibi = alibi
        else:
            self.alibi = ALiBi(alibi, mode="causal" if mode is None else mode,
                               bias_scale=1.0 if bias_scale is None else bias_scale)
        self.head_dim, self.n_heads = self.rotary.head_dim, self.alibi.n_heads
        self.max_positions = self.rotary.max_positions
        self.mode = self.alibi.mode
        self.mix = check_choice("mix", mix, ("add", "alpha"))
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self.learnable_scale = bool(learnable_scale)
        if self.learnable_scale:
            self.log_scale = nn.Parameter(torch.zeros(self.n_heads))
            self.static_bias = False  # the bias changes as training moves log_scale

    @classmethod
    def build(cls, *, d_model=None, n_heads=None, head_dim=None, max_positions=None,
              **options):
        """``cls(head_dim, n_heads, **options)``: the model's sizes of both parts."""
        return cls(_need_size(cls, "head_dim", head_dim), _need_size(cls, "n_heads", n_heads),
                   **options)

    @property
    def rope(self) -> RotaryEmbedding:
        """The :class:`~tutorial_pkg.encodings.rope.RotaryEmbedding` of the RoPE part."""
        return self.rotary.rope

    @property
    def slopes(self) -> torch.Tensor:
        """The ALiBi part's fixed slopes ``m_h`` (see :meth:`effective_slopes`)."""
        return self.alibi.slopes

    def effective_slopes(self) -> torch.Tensor:
        """Slopes actually applied: ``m_h * bias_scale * s_h`` (times ``1 - alpha`` for
        ``mix='alpha'``)."""
        slopes = self.alibi.effective_slopes()
        if self.learnable_scale:
            slopes = slopes * self.log_scale.exp()
        if self.mix == "alpha":
            slopes = slopes * (1.0 - self.alpha)
        return slopes

    def _slopes_on(self, device) -> torch.Tensor:
        # fixed slopes are constants, moved to the call's device (H floats); a learned
        # scale must live there (check_learned_device): a copy would not be trained
        if self.learnable_scale:
            check_learned_device(self, device)
        return self.effective_slopes().to(device)

    def rotate(self, q, k, q_pos, k_pos):
        q, k = self.rotary.rotate(q, k, q_pos, k_pos)
        if self.mix == "alpha":
            q = q * self.alpha  # article 002's alpha multiplies the content scores too
        return q, k

    def bias(self, q_pos, k_pos):
        return self.alibi.bias(q_pos, k_pos, slopes=self._slopes_on(k_pos.device))

    def score_mod(self, q_offset=0, q_pos=None, k_pos=None):
        device = self.alibi.slopes.device if q_pos is None else q_pos.device
        return self.alibi.score_mod(q_offset, q_pos, k_pos, slopes=self._slopes_on(device))

    def key_bias(self, k_pos):
        return self.alibi.key_bias(k_pos, slopes=self._slopes_on(k_pos.device))

    @property
    def scaling(self) -> dict | None:
        """The current RoPE scaling rule (a copy), or None."""
        return self.rotary.scaling

    def set_scaling(self, scaling: dict | None) -> None:
        """Change the RoPE scaling rule (e.g. at evaluation)."""
        self.rotary.set_scaling(scaling)
