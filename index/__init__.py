"""Storage side of embedpool: persistent single- and multi-vector collections.

Imports only numpy, faiss, sqlite3 and the standard library (never ``poolers`` or ``app``).

    from index import Collection, CollectionSpec
    coll = Collection.open_or_create("data", "scifact-mean", CollectionSpec(kind="single", dim=384))
    coll.add(ids, vectors, texts); coll.commit()
    hits = coll.search(queries, k=10)
"""

from .collection import Collection, Hit, delete_collection, list_collections
from .errors import (
    CollectionError,
    CollectionLockedError,
    CollectionNotFoundError,
    CorruptCollectionError,
    DocumentNotFoundError,
    FormatVersionError,
    IndexError_,
    InvalidInputError,
    NotACollectionError,
    NotFoundError,
    SpecMismatchError,
    TrainingError,
)
from .maxsim import dequantize, maxsim_scores, quantize
from .spec import FORMAT_VERSION, CollectionSpec

__all__ = [
    "Collection", "CollectionSpec", "Hit", "list_collections", "delete_collection",
    "FORMAT_VERSION", "maxsim_scores", "quantize", "dequantize",
    "CollectionError", "IndexError_", "NotFoundError", "CollectionNotFoundError",
    "DocumentNotFoundError", "NotACollectionError", "FormatVersionError", "SpecMismatchError",
    "InvalidInputError", "TrainingError", "CollectionLockedError", "CorruptCollectionError",
]
