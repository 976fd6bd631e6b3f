"""Which Milvus answers at a URI, and what it can do: read once per connection
(``get_server_version``), decided here in one table, used by the schema and the collection.

Supported: Milvus servers 2.3 through 2.6 (a newer one is used as 2.6, with a warning) and
Milvus Lite (``milvus-lite`` >= 2.5, which reports ``milvus_lite-<version>``). Below 2.3 is
refused: the layout needs ARRAY fields and upsert (both 2.3). What differs, and what embedpool
does where the server lacks it (first versions from Milvus' release notes and the versioned
docs, ``milvus.io/docs/v2.X.x``):

==========================  =========  ===================================================
feature                     servers    without it
==========================  =========  ===================================================
nullable fields             2.5        ``text``/``metadata`` are not nullable: a missing
                                       one is stored as ``""``/``{}`` and a ``nulls`` bit
                                       field says which were missing (2.3/2.4 accept
                                       ``nullable=True`` and silently drop it, so it is
                                       never asked of them)
INVERTED scalar index       2.4        ``Trie`` on the VARCHAR ``doc_id`` (2.3 refuses
                                       INVERTED: "index type not match")
grouping search             2.4        over-fetching plain searches (the collection
                                       already falls back when a server refuses one)
sparse vectors              2.4        a sparse collection (``SPARSE_FLOAT_VECTOR``,
                                       ``SPARSE_INVERTED_INDEX``) is refused on create,
                                       naming ``kind``, the version and the FAISS backend
full-text search (BM25)     2.5        (for the lexical part of a collection)
HNSW_SQ vector index        2.6        a factory ``HNSW<M>_SQ8`` is refused on create,
                                       naming the version and the factories that work
array of struct + MAX_SIM   2.6.4      not used on any version: multi-vector documents
                                       are packed rows reranked by embedpool's exact
                                       MaxSim (:mod:`.packed`), the same ranking as
                                       FAISS; the server's MAX_SIM would need a second
                                       layout that no server here (2.3, Lite) can run
==========================  =========  ===================================================

Milvus Lite 3.2 has nullable fields, INVERTED indexes and sparse vectors; it has no query iterator (the
collection scans by primary-key pages there) and groups only the best rows of a search.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from embedpool.errors import InvalidError, UnavailableError

log = logging.getLogger("embedpool.index")

OLDEST = (2, 3, 0)
NEWEST = (2, 6)  # the newest minor release this table knows
#: the first server version with sparse float vectors (Milvus 2.4 release notes)
SPARSE_SINCE = (2, 4, 0)
#: the most rows a Milvus server returns from one query (its queryNode.maxQueryResultWindow default)
SERVER_QUERY_WINDOW = 16_384


@dataclass(frozen=True)
class MilvusFeatures:
    """What the Milvus at one URI can do (:func:`features_of`)."""

    reported: str  #: the version string the server reported
    lite: bool  #: Milvus Lite (embedded), not a server
    version: tuple[int, int, int]  #: the server's (or Milvus Lite's) version
    nullable: bool  #: nullable scalar fields
    inverted_index: bool  #: INVERTED scalar indexes (else Trie for VARCHAR)
    group_by: bool  #: grouping search (``group_by_field``)
    sparse: bool  #: sparse float vectors (``SPARSE_FLOAT_VECTOR``) and their inverted index
    full_text: bool  #: BM25 full-text search (functions)
    hnsw_sq: bool  #: the HNSW_SQ vector index
    struct_max_sim: bool  #: array-of-struct fields with MAX_SIM search
    query_window: int  #: the most rows one query returns (offset + limit); 0: no limit (Milvus Lite)

    @property
    def name(self) -> str:
        """For messages: ``Milvus 2.3.5`` or ``Milvus Lite 3.2.2``."""
        v = ".".join(map(str, self.version))
        return f"Milvus Lite {v}" if self.lite else f"Milvus {v}"

    @property
    def scalar_index(self) -> str:
        """The index type for the VARCHAR ``doc_id`` of multi-vector document rows."""
        return "INVERTED" if self.inverted_index else "Trie"

    def check_index_type(self, index_type: str, field: str) -> None:
        """Refuse a vector index the server does not have, naming what works."""
        if index_type == "HNSW_SQ" and not self.hnsw_sq:
            raise InvalidError(
                f"{field}: the HNSW_SQ index (factory 'HNSW<M>_SQ8') needs Milvus 2.6 or later, and the "
                f"server is {self.name}; use 'HNSW<M>' (or 'IVF<n>,SQ8' for 8-bit codes)", param=field)

    def check_sparse(self) -> None:
        """Refuse a sparse collection where the server has no sparse vectors, naming ``kind``."""
        if not self.sparse:
            raise InvalidError(
                f"kind: sparse collections are stored as SPARSE_FLOAT_VECTOR rows, which need "
                f"{'Milvus Lite 2.5' if self.lite else 'Milvus ' + '.'.join(map(str, SPARSE_SINCE[:2]))} or later, "
                f"and the server is {self.name}; upgrade the "
                "server, or keep the collection in the FAISS backend (--backend faiss, EMBEDPOOL_BACKEND=faiss)",
                param="kind")


_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def features_of(reported: str) -> MilvusFeatures:
    """The features of the Milvus that reported version ``reported`` (``v2.3.5``,
    ``2.4.13-hotfix``, ``milvus_lite-3.2.2``, a managed service's ``... Compatible with Milvus
    2.5``). Older than :data:`OLDEST`: :class:`UnavailableError`. Unreadable or newer than
    :data:`NEWEST`: taken as the newest known, with a warning."""
    lite = reported.lower().startswith("milvus_lite") or reported.lower() == "milvus_lite"
    m = _VERSION.search(reported)
    if m is None:
        log.warning("Milvus reported version %r, which embedpool cannot read; using it as Milvus %d.%d",
                    reported, *NEWEST)
        version = (*NEWEST, 0)
    else:
        version = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
    if lite:
        return MilvusFeatures(reported, True, version, nullable=True, inverted_index=True, group_by=True,
                              sparse=version >= (2, 5, 0), full_text=version >= (2, 5, 0), hnsw_sq=False, struct_max_sim=False,
                              query_window=0)
    if version < OLDEST:
        raise UnavailableError(
            f"Milvus {'.'.join(map(str, version))} is older than embedpool supports (2.3 through 2.6: "
            "collections need ARRAY fields and upsert, Milvus 2.3); upgrade the server")
    if version[:2] > NEWEST:
        log.warning("Milvus %s is newer than the versions embedpool was tested with (2.3 through %d.%d); "
                    "using what %d.%d has", reported, *NEWEST, *NEWEST)
    return MilvusFeatures(reported, False, version, nullable=version >= (2, 5, 0),
                          inverted_index=version >= (2, 4, 0), group_by=version >= (2, 4, 0),
                          sparse=version >= SPARSE_SINCE,
                          full_text=version >= (2, 5, 0), hnsw_sq=version >= (2, 6, 0),
                          struct_max_sim=version >= (2, 6, 4), query_window=SERVER_QUERY_WINDOW)
