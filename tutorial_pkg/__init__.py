"""tutorial_pkg: positional encodings for Transformers, the companion of the book.

Each module is explained by one chapter. A module imports only modules above it in
this table (the README's "Layout" says why the few files beyond the design's sketch
exist: ``registry``, the measuring library's parts and the probes' parts).

==================  ==============================================================
module              chapter
==================  ==============================================================
``sinusoidal``      1. Sinusoidal encoding
``rope_scaling``    8. Modern recipes (every Hugging Face ``rope_type``, p-RoPE)
``rope_config``     8. Modern recipes (reading a model's config; the layout per family)
``rope_kernels``    2. RoPE and 5. Benchmarking (the fast paths)
``rope``            2. RoPE (the math and ``RotaryEmbedding``)
``alibi``           3. ALiBi
``encodings``       4. Attention layers (the interface) and 6. Hybrid
``relative_bias``   8. Modern recipes (T5's learned relative bias)
``schedules``       8. Modern recipes (NoPE layers, local/global layers)
``registry``        4. Attention layers (encodings by name)
``positions``       4. Attention layers (left padding, packed documents)
``masks``           4. Attention layers (the plan and its mask rules)
``backends``        4. Attention layers (the four backends) and 5. Benchmarking
``attention``       4. Attention layers
``hf``              no chapter: load a Hugging Face attention layer (README)
``timing``          5. Benchmarking (timing)
``memory``          5. Benchmarking (peak and held memory)
``records``         5. Benchmarking (records, results files, tables)
``benchmark``       5. Benchmarking (``Case``, ``compare``)
``model``           7. Length extrapolation (tiny LM)
``data``            7. Length extrapolation (corpus)
``experiments``     7. Length extrapolation (training, evaluation)
``stats``           6. Hybrid and 7. Length extrapolation (intervals, paired differences)
``context_eval``    7. Length extrapolation (the same targets at every length)
``distributed``     no chapter: training under ``torchrun`` (``benchmarks/README.md``)
``retrieval``       7. Length extrapolation (the copy test)
``tasks``           6. Hybrid (the synthetic tasks)
``diagnose``        9. Debugging (probes for your own code; with ``rope_probes``,
                    ``kv_cache_check``, ``kernel_masks`` and ``reports``)
``plotting``        figures of every chapter (the ``plot`` extra)
==================  ==============================================================
"""

from . import diagnose
from .attention import backends
from .attention.layer import BACKENDS, KVCache, MultiHeadAttention, TransformerBlock, flex_available
from .attention.positions import positions_from_documents, positions_from_padding
from .encodings.alibi import ALIBI_MODES, alibi_bias, alibi_score_mod, alibi_slopes
from .encodings.builtin import (
    ALiBi,
    Hybrid,
    Learned,
    NoPE,
    PositionEncoding,
    PRoPE,
    Rotary,
    Sinusoidal,
)
from .encodings.registry import ENCODINGS, make_encoding, register_encoding
from .encodings.relative_bias import (
    T5_MAX_DISTANCE,
    T5_NUM_BUCKETS,
    T5RelativeBias,
    t5_relative_position_bucket,
)
from .encodings.rope import (
    LAYOUTS,
    RotaryEmbedding,
    apply_rope,
    apply_rope_complex,
    half_to_interleaved,
    interleaved_to_half,
    interleaved_to_half_permutation,
    inv_freq,
    precompute_freqs_cis,
    rope_angles,
    rotate_half,
)
from .encodings.rope_config import HF_ROPE_TYPES, RopeConfig, read_rope_config
from .encodings.rope_scaling import (
    ROPE_SCALINGS,
    dynamic_ntk_scaling,
    linear_scaling,
    llama3_scaling,
    longrope_scaling,
    no_scaling,
    ntk_scaling,
    p_rope_inv_freq,
    scaled_inv_freq,
    yarn_mscale,
    yarn_scaling,
)
from .encodings.schedules import LayerSchedule, LocalGlobal, NoPEEvery, PerLayer
from .encodings.sinusoidal import (
    SinusoidalPositionalEmbedding,
    sinusoidal_frequencies,
    sinusoidal_table,
)
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
    # sinusoidal
    "sinusoidal_frequencies",
    "sinusoidal_table",
    "SinusoidalPositionalEmbedding",
    # rope
    "LAYOUTS",
    "ROPE_SCALINGS",
    "inv_freq",
    "scaled_inv_freq",
    "rope_angles",
    "rotate_half",
    "apply_rope",
    "precompute_freqs_cis",
    "apply_rope_complex",
    "interleaved_to_half_permutation",
    "interleaved_to_half",
    "half_to_interleaved",
    "RotaryEmbedding",
    # rope_scaling
    "no_scaling",
    "linear_scaling",
    "ntk_scaling",
    "dynamic_ntk_scaling",
    "yarn_scaling",
    "yarn_mscale",
    "longrope_scaling",
    "llama3_scaling",
    "p_rope_inv_freq",
    # rope_config
    "HF_ROPE_TYPES",
    "RopeConfig",
    "read_rope_config",
    # alibi
    "ALIBI_MODES",
    "alibi_slopes",
    "alibi_bias",
    "alibi_score_mod",
    # encodings
    "PositionEncoding",
    "NoPE",
    "Sinusoidal",
    "Learned",
    "Rotary",
    "PRoPE",
    "ALiBi",
    "Hybrid",
    "ENCODINGS",
    "make_encoding",
    "register_encoding",
    # attention
    "BACKENDS",
    "flex_available",
    "KVCache",
    "MultiHeadAttention",
    "TransformerBlock",
    # model
    "TinyLM",
    # positions
    "positions_from_padding",
    "positions_from_documents",
    # relative_bias
    "T5_NUM_BUCKETS",
    "T5_MAX_DISTANCE",
    "t5_relative_position_bucket",
    "T5RelativeBias",
    # schedules
    "LayerSchedule",
    "PerLayer",
    "NoPEEvery",
    "LocalGlobal",
    # the backends module (tutorial_pkg.attention.backends)
    "backends",
    # the probes of chapter 9 (tutorial_pkg.diagnose.probe_rope, ...)
    "diagnose",
    # the Hugging Face loader (tutorial_pkg.models.hf.from_hf_attention,
    # tutorial_pkg.models.hf.padding_mask)
    "hf",
]
