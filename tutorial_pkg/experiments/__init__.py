"""Training and evaluating small models by length. Chapters 6 and 7.

==================  ==============================================================
module              holds (chapter)
==================  ==============================================================
``data``            the offline corpus (``corpus/``), byte tokenizer, batching (7)
``evaluation``      perplexity by length; the loop every evaluation shares (7)
``training``        train at one length, evaluate at many (7)
``context_eval``    fixed-target evaluation: the same targets, only the context grows (7)
``retrieval``       the copy test past the training length (7)
``tasks``           chapter 6's synthetic tasks (6)
``stats``           bootstrap and t intervals, paired differences, Bonferroni (6, 7)
``distributed``     training under ``torchrun`` (``benchmarks/README.md``)
==================  ==============================================================

Builds on :mod:`tutorial_pkg.models` and :mod:`tutorial_pkg.measure`.
"""
