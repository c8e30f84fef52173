"""How scores become outputs: positions, masks, backends, the layer. Chapters 4 and 5.

==================  ==============================================================
module              holds
==================  ==============================================================
``positions``       positions from padding and packed documents
``masks``           the attention plan, one mask rule per concern, and the one place
                    that turns rules and a bias into a kernel's mask
``backends``        the ``BACKENDS`` registry: naive, sdpa, flex, auto
``layer``           ``MultiHeadAttention``, ``TransformerBlock``, ``KVCache``
==================  ==============================================================

Builds on :mod:`tutorial_pkg.encodings`, whose hooks the backends call.
"""
