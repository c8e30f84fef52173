"""What positions do to q, k or the scores: the encodings and their math. Chapters 1-4, 6, 8.

==================  ==============================================================
module              holds (chapter)
==================  ==============================================================
``builtin``         the :class:`~tutorial_pkg.encodings.builtin.PositionEncoding` hooks
                    (``embed``, ``rotate``, ``bias`` / ``score_mod``, ``key_bias``) and
                    the built-in encodings composed from the modules below (4, 6)
``sinusoidal``      the sinusoidal table and absolute module (1)
``rope``            RoPE's math: frequencies, float32 angles, both layouts, converters,
                    ``RotaryEmbedding`` (2)
``rope_kernels``    ``rotate_pairs``, the rotation every caller runs; the compiled kernel (2, 5)
``rope_scaling``    every Hugging Face ``rope_type`` behind one signature; p-RoPE (8)
``rope_config``     reading a Hugging Face config (8)
``alibi``           slopes, bias, score_mod (3)
``relative_bias``   T5's bucketed bias (8)
``mrope``           multimodal RoPE: a position per axis, ``mrope_positions`` (8)
``schedules``       per-layer choices: NoPE layers, local/global (8)
``registry``        ``ENCODINGS``, ``register_encoding``, ``make_encoding`` (4)
==================  ==============================================================

Imports point down only: nothing here imports :mod:`tutorial_pkg.attention` or above.
"""
