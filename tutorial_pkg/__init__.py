"""tutorial_pkg: positional encodings for Transformers, the companion of the book.

The folders are the parts, bottom to top; each imports only the ones above it (the
README's "Layout" is the whole tree):

===================  =============================================================
subpackage           what it holds (chapters)
===================  =============================================================
``encodings``        what positions do to q, k or the scores: sinusoidal, RoPE and its
                     scaling rules, ALiBi, T5's bias, per-layer schedules, the
                     registry (1-4, 6, 8)
``attention``        how scores become outputs: positions, masks, backends, the layer
                     and its KV cache (4, 5)
``models``           ``TinyLM`` (7) and the Hugging Face loader, ``tp.hf`` (README)
``measure``          timing, memory, records, side-by-side comparison (5)
``experiments``      data, training, evaluation by length, the copy test, statistics (6, 7)
``diagnose``         probes you point at your own code (9)
===================  =============================================================

This namespace holds what a model needs; the rest is one import away, e.g.
``from tutorial_pkg.encodings.rope_scaling import yarn_scaling``.

**Shapes**, everywhere in the package: ``b`` batch, ``s`` queries (new tokens), ``L_k``
keys (cached and new), ``H`` query heads, ``H_kv`` key/value heads, ``d`` head width
(``head_dim``), ``d_model`` model width. Queries are ``[b, H, s, d]``, keys and values
``[b, H_kv, L_k, d]``, positions ``(s,)`` or ``[b, s]``, a bias ``(H, s, L_k)`` or
``[1 or b, H, s, L_k]``, model inputs ``[b, s]`` token ids or ``[b, s, d_model]``.
"""

from . import diagnose
from .attention import backends
from .attention.layer import BACKENDS, KVCache, MultiHeadAttention, TransformerBlock
from .attention.positions import positions_from_documents, positions_from_padding
from .encodings.alibi import alibi_bias, alibi_slopes
from .encodings.builtin import ALiBi, Hybrid, Learned, NoPE, PositionEncoding, Rotary, Sinusoidal
from .encodings.registry import ENCODINGS, make_encoding, register_encoding
from .encodings.relative_bias import T5RelativeBias
from .encodings.rope import (
    RotaryEmbedding,
    apply_rope,
    half_to_interleaved,
    interleaved_to_half,
    inv_freq,
    rotate_half,
)
from .encodings.rope_config import read_rope_config
from .encodings.schedules import LayerSchedule, LocalGlobal, NoPEEvery, PerLayer
from .encodings.sinusoidal import sinusoidal_table
from .models import hf
from .models.tiny_lm import TinyLM


def _version() -> str:
    """The version has one source, pyproject.toml; read it from the installed metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tutorial_pkg")
    except PackageNotFoundError:  # a checkout on sys.path that was never pip-installed
        return "0+unknown"


__version__ = _version()
del _version

__all__ = [
    # encodings: the interface, the built-ins, by name (chapters 1-4, 6, 8)
    "PositionEncoding",
    "NoPE",
    "Sinusoidal",
    "Learned",
    "Rotary",
    "ALiBi",
    "Hybrid",
    "T5RelativeBias",
    "ENCODINGS",
    "make_encoding",
    "register_encoding",
    # per-layer schedules (chapter 8)
    "LayerSchedule",
    "PerLayer",
    "NoPEEvery",
    "LocalGlobal",
    # the math a reader calls on their own tensors (chapters 1-3, 8)
    "sinusoidal_table",
    "inv_freq",
    "rotate_half",
    "apply_rope",
    "RotaryEmbedding",
    "interleaved_to_half",
    "half_to_interleaved",
    "read_rope_config",
    "alibi_slopes",
    "alibi_bias",
    # attention (chapter 4)
    "MultiHeadAttention",
    "TransformerBlock",
    "KVCache",
    "BACKENDS",
    "positions_from_padding",
    "positions_from_documents",
    # models (chapter 7)
    "TinyLM",
    # modules: the backends registry, the probes of chapter 9, the Hugging Face loader
    "backends",
    "diagnose",
    "hf",
]
