"""The Milvus backend: the same collection API as the FAISS folders, stored in Milvus.

``uri`` is a Milvus Lite database (a local path ending in ``.db``: pymilvus runs the embedded
engine inside this process) or a Milvus server (``http://host:19530``, optional ``token``).

Layout, per embedpool collection ``NAME`` (Milvus collection ``embedpool_<NAME encoded>``,
:mod:`.names`; fields: :mod:`.schema`): single-vector collections store one row per document;
sparse ones too, their rows a ``SPARSE_FLOAT_VECTOR`` under Milvus' ``SPARSE_INVERTED_INDEX``
(inner product: the exact top k among the documents that share a token with the query).
Multi-vector collections (layout 2, recorded in the manifest as ``milvus_layout``) store one row
per document with its token vectors packed in the storage precision (float32/float16/int8 codes
and int8 scales, exactly the FAISS segments' bytes: :mod:`.packed`), split into further rows only
when one row's ARRAY field cannot hold them; and, in a second Milvus collection
``<that name>__tokens``, one row per token vector for the token-level ANN index (the spec's
``token_factory``). One that keeps its companion (``spec.companion_pooler``) has a third,
``<that name>__companion``: one row per companion vector (``companion_factory``), written by
every ``add`` and ``delete`` with the documents. Hidden collections are never listed. The vector
index is mapped from the spec's FAISS factory string (:mod:`.mapping`: Flat -> FLAT, HNSW<M> ->
HNSW, IVF<n>,Flat -> IVF_FLAT, IVF<n>,SQ8 -> IVF_SQ8, IVF<n>,PQ<m> -> IVF_PQ). Candidates come
from Milvus (``tokens``: ANN over the token rows; ``two_stage``: the collection's own companion
rows -- a search grouped by document, over-fetched where that finds too few documents -- or any
single-vector collection); embedpool then fetches the candidates' packed rows in one query (by
primary key ``<doc id>#0``, up to 128 documents a query) and reranks them by exact MaxSim
(:func:`index.maxsim.maxsim_scores`) on the stored codes, as FAISS does, so rankings equal the
FAISS backend's for the same spec. ``exhaustive`` reads every document row (small collections).
A multi-vector collection of layout 1 (one row per token vector, embedpool before issue 13) is
refused on open with a message that says how to rebuild it.

Versions: the server's version is read at every connect (:mod:`.versions`: Milvus 2.3 through
2.6 and Milvus Lite; older is refused). What differs -- nullable fields (2.5), INVERTED scalar
indexes (2.4; Trie before), grouping search (2.4), sparse vectors (2.4), HNSW_SQ (2.6) -- is used where the server has
it and replaced or refused with a message where it does not. Milvus' own array-of-struct
``MAX_SIM`` (servers >= 2.6.4) is not used on any version (the packed layout and embedpool's
exact MaxSim rank as FAISS does; neither a 2.6 server nor Milvus Lite 3.2 runs here to test a
second layout). Creation is all-or-nothing (:mod:`.creation`).

The manifest is the collection property ``embedpool.manifest`` and travels with the collection;
opening with a different spec is refused exactly as for FAISS folders. Other properties
(:meth:`MilvusCollection.set_property`) are collection properties too.

Durability: every write is applied to Milvus at once (Milvus' own WAL makes it durable);
:meth:`MilvusCollection.commit` flushes segments, then stores the staged properties and the
manifest. Milvus has no multi-row transactions: replacing a multi-vector document upserts its
companion rows (if it has them), its later parts, then its part 0, then its token rows, then
deletes surplus rows of a longer old version. Every part carries the write's stamp: a crash in
the middle that leaves parts of two versions is detected on read (:class:`InternalError`
naming the document); a document within one row (the usual case) is replaced atomically. Add the
document again to repair it.

Milvus Lite allows one process per ``.db`` (it holds a file lock); to share an index between
processes or API replicas, run a Milvus server and pass its URI. When Milvus cannot be reached,
calls fail with :class:`~embedpool.errors.UnavailableError` and the next call reconnects (:mod:`.connection`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from embedpool.errors import ConflictError, NotFoundError, UnavailableError, import_extra

# pymilvus and pybase64 come with the `milvus` extra: say so before the imports below fail
import_extra("pymilvus", "milvus", "The Milvus backend")
import_extra("pybase64", "milvus", "The Milvus backend")

from ..backends import Backend, Where
from ..spec import CollectionSpec
from .collection import MilvusCollection
from .connection import ClientPool, Connection, is_lite
from .creation import MANIFEST_KEY, OWNER_KEY, drop_all
from .mapping import milvus_index
from .names import embedpool_name, milvus_name

__all__ = ["MilvusCollection", "ClientPool", "MANIFEST_KEY", "milvus_index", "milvus_name",
           "embedpool_name", "list_collections", "delete_collection", "default_uri", "BACKEND"]


def _with_connection(uri: str, token: str | None, fn: Any) -> Any:
    conn = ClientPool.acquire(uri, token)
    try:
        return fn(conn)
    finally:
        ClientPool.release(conn)


def _list(conn: Connection) -> list[str]:
    with conn.errors("listing collections"):
        client = conn.client()
        names = [n for n in map(embedpool_name, client.list_collections()) if n]
        return sorted(n for n in names
                      if MANIFEST_KEY in (client.describe_collection(milvus_name(n)).get("properties") or {}))


def _drop(conn: Connection, name: str) -> None:
    mname = milvus_name(name)
    with ClientPool.write_lock(conn, mname), conn.errors(f"dropping collection {name!r}"):
        client = conn.client()
        if not client.has_collection(mname):
            raise NotFoundError(f"no collection {name!r} in Milvus", param="name")
        props = client.describe_collection(mname).get("properties") or {}
        if MANIFEST_KEY not in props and OWNER_KEY not in props:  # a half-made one may go
            raise ConflictError(
                f"Milvus collection {mname!r} was not created by embedpool; not dropping it")
        drop_all(client, mname)  # with a multi-vector collection's token and companion rows


def list_collections(uri: str, *, token: str | None = None) -> list[str]:
    """Names of the embedpool collections in Milvus at ``uri`` (sorted)."""
    return _with_connection(uri, token, _list)


def delete_collection(uri: str, name: str, *, token: str | None = None) -> None:
    """Drop an embedpool collection from Milvus."""
    milvus_name(name)
    _with_connection(uri, token, lambda conn: _drop(conn, name))


def default_uri(data_dir: str | os.PathLike) -> str:
    """The Milvus Lite file used when no URI is given: ``<data_dir>/milvus.db``."""
    return str(Path(data_dir) / "milvus.db")


class MilvusBackend(Backend):
    """Collections in Milvus at ``where.uri`` (default: the Lite file ``<data_dir>/milvus.db``)."""

    @staticmethod
    def _uri(where: Where) -> str:
        return where.uri or default_uri(where.data_dir)

    def open(self, where: Where, name: str, spec: CollectionSpec | None) -> MilvusCollection:
        if spec is None:
            return MilvusCollection.open(self._uri(where), name, token=where.token, consistency=where.consistency)
        return MilvusCollection.open_or_create(self._uri(where), name, spec, token=where.token,
                                               consistency=where.consistency)

    def list(self, where: Where) -> list[str]:
        return list_collections(self._uri(where), token=where.token)

    def delete(self, where: Where, name: str) -> None:
        delete_collection(self._uri(where), name, token=where.token)

    def status(self, where: Where) -> dict[str, Any]:
        """One version RPC on the shared connection (reconnecting if it was broken), at most
        :data:`STATUS_TIMEOUT` seconds. A Milvus Lite file that no collection holds open is not
        started for it."""
        uri = self._uri(where)
        out: dict[str, Any] = {"backend": "milvus", "status": "ok", "location": uri}
        if is_lite(uri) and not ClientPool.held(uri, where.token):
            return out
        try:
            conn = ClientPool.acquire(uri, where.token)
        except UnavailableError as e:
            return {**out, "status": "unreachable", "error": str(e)}
        try:
            with conn.errors("health check"):
                conn.client().get_server_version(timeout=STATUS_TIMEOUT)
            return {**out, "version": conn.features.name}
        except UnavailableError as e:
            return {**out, "status": "unreachable", "error": str(e)}
        finally:
            ClientPool.release(conn)

    def manifest(self, where: Where, name: str) -> dict[str, Any]:
        """The manifest with live counts (Milvus counts rows cheaply; the property has none)."""
        with MilvusCollection.open(self._uri(where), name, token=where.token) as coll:
            return coll.manifest


STATUS_TIMEOUT = 3.0  # seconds a health check waits for Milvus

BACKEND = MilvusBackend()
