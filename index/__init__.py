"""Storage side of embedpool: persistent single-vector, multi-vector and sparse collections.

Imports only numpy, faiss, sqlite3, pymilvus and the standard library (never ``poolers`` or
``app``); pymilvus only when the Milvus backend is used.

    from embedpool.index import CollectionSpec, open_collection
    coll = open_collection("data", "scifact-mean", CollectionSpec(kind="single", dim=384),
                           backend="faiss")  # or backend="milvus", milvus_uri="./milvus.db"
    coll.add(ids, vectors, texts); coll.commit()
    hits = coll.search(queries, k=10)

``FaissCollection`` (FAISS folders, :mod:`index.faiss`) and ``MilvusCollection``
(:mod:`index.milvus`) implement the whole contract of ``CollectionBase`` (:mod:`index.base`).
"""

from .backends import (
    BACKENDS,
    READ_CONSISTENCY,
    delete_collection,
    list_collections,
    open_collection,
    read_collection_manifest,
    storage_status,
)
from .base import (ALL_MODES, LEXICAL_MODES, SEARCH_MODES, STATS_KEYS, Capabilities, CollectionBase, Hit,
                   companion_refusal)
from .faiss import FaissCollection
from .filters import parse_filter
from .fusion import FUSIONS, TUNED_PROPERTY, fuse, tuned_entry
from .lexical import LANGUAGES, canonical_analyzer
from .maxsim import bytes_per_vector, dequantize, maxsim_scores, quantize
from .sparse import check_sparse_rows, parse_sparse_factory
from .spec import FORMAT_VERSION, CollectionSpec
from .validate import (INT_MAX, INT_MIN, MAX_ID_BYTES, MAX_METADATA_BYTES, MAX_METADATA_DEPTH, check_document,
                       check_unicode)

__all__ = [
    "FaissCollection", "CollectionBase", "MilvusCollection", "CollectionSpec", "Hit",
    "open_collection", "list_collections", "delete_collection", "read_collection_manifest", "storage_status",
    "BACKENDS", "READ_CONSISTENCY", "Capabilities", "SEARCH_MODES", "LEXICAL_MODES", "ALL_MODES", "FUSIONS",
    "TUNED_PROPERTY", "fuse", "tuned_entry",
    "STATS_KEYS", "companion_refusal", "parse_filter", "canonical_analyzer", "LANGUAGES",
    "FORMAT_VERSION", "maxsim_scores", "quantize", "dequantize", "bytes_per_vector",
    "check_document", "check_unicode", "INT_MIN", "INT_MAX", "MAX_ID_BYTES", "MAX_METADATA_BYTES",
    "MAX_METADATA_DEPTH", "check_sparse_rows", "parse_sparse_factory",
]


def __getattr__(name: str):
    if name == "MilvusCollection":  # imported on first use: pymilvus is slow to import
        from .milvus import MilvusCollection

        return MilvusCollection
    raise AttributeError(f"module 'index' has no attribute {name!r}")
