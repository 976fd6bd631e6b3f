"""embedpool: frozen-encoder embeddings with configurable token poolers, served and indexed.

The installed package has three layers, each a top-level folder of the repository mapped into
this namespace (``pyproject.toml``): ``embedpool.poolers`` (the model side), ``embedpool.index``
(the storage side) and ``embedpool.app`` (everything a person runs). This folder holds only what
all three share and that imports none of them: the error taxonomy (:mod:`embedpool.errors`) and
the reading of this CPU's features (:mod:`embedpool.cpu`) and the names of the three
precisions, encoder, storage and output (:mod:`embedpool.precisions`).
"""

__version__ = "0.1.0"
