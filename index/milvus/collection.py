"""The Milvus collection: the :class:`index.base.CollectionBase` contract over one Milvus
collection (schema: :mod:`index.milvus.schema`; connection and recovery:
:mod:`index.milvus.connection`). Single-vector and sparse collections are one row per document
(a sparse one's ``vector`` a ``SPARSE_FLOAT_VECTOR``); multi-vector ones are packed rows."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..base import Capabilities, CollectionBase, Hit, make_stats
from ..backends import READ_CONSISTENCY
from ..base import check_new_spec, check_property, require_spec
from ..durable import now_iso
from embedpool.errors import ConflictError, InternalError, InvalidError, NotFoundError, UnavailableError
from ..filters import DATES_KEY, Node, milvus_metadata, quote, to_milvus
from ..int8scan import maxsim_topk
from ..maxsim import bytes_per_vector, dequantize, maxsim_scores
from ..spec import CollectionSpec, check_name
from ..validate import MAX_METADATA_BYTES, topk
from .clock import InsertionClock
from .connection import ClientPool, Connection, is_lite, not_loaded
from .creation import MANIFEST_KEY, create_if_absent, damage, describe, repair
from .mapping import check_factories, index_of, metric, milvus_index, search_params
from .names import milvus_name, pk
from .packed import Packing
from .schema import (FETCH_DOCS, LAYOUT, MAX_ID_BYTES, MAX_TEXT_BYTES, NNZ, NULLS, SPARSE_FIELD,
                     companion_rows_name, doc_counts, sparse_row, stored_sparse, text_and_metadata, tokens_name,
                     vector_rows, with_stand_ins)
from ..sparse import row_dicts, stored_bytes

log = logging.getLogger("embedpool.index")

MAX_TOPK = 16_384  # Milvus' limit on limit/topk
_BATCH_BYTES = 8 << 20  # rows per insert/upsert call: ~8 MB of vectors
_FETCH_ROWS = 4096  # rows per get() by primary key
_DELETE_ROWS = 16_384  # primary keys per delete call
_SCAN_BYTES = 64 << 20  # Milvus Lite: bytes per page of a full scan (its gRPC limit is 256 MB)
#: a filtered token or companion search names the matching documents in its expression
#: (``doc_id in [...]``) when there are at most this many; more are over-fetched and checked
MAX_IN_IDS = 16_384


def _rows(result: Any) -> list[dict]:
    """A plain list of the rows of a pymilvus result. Its lists materialize rows lazily by
    position: sorting one in place would pair fields of different rows."""
    return [r for r in result]


def _batches(rows: list, step: int) -> Iterator[list]:
    for i in range(0, len(rows), max(1, step)):
        yield rows[i:i + max(1, step)]


def _codes_bytes(row: dict) -> int:
    """About the bytes of a packed document row (its codes)."""
    return 256 + sum(map(len, row["codes"]))


def _sparse_bytes(row: dict) -> int:
    """About the bytes of a sparse document row (a token id and a weight per non-zero, its text):
    rows of a few hundred non-zeros are small, so their texts may be most of a batch."""
    return 256 + 8 * len(row["vector"]) + len(row["text"] or "")


def _byte_batches(rows: list[dict], size_of=_codes_bytes) -> Iterator[list[dict]]:
    """Rows in batches of about :data:`_BATCH_BYTES` (``size_of`` a row; one row at least)."""
    batch: list[dict] = []
    size = 0
    for r in rows:
        b = size_of(r)
        if batch and size + b > _BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(r)
        size += b
    if batch:
        yield batch


def check_layout(manifest: dict[str, Any], name: str, uri: str) -> dict[str, int] | None:
    """The packed layout of a multi-vector collection (``None`` for single-vector ones); a
    collection written by an embedpool with another layout is refused, saying how to rebuild it."""
    if manifest.get("kind") != "multi":
        return None
    layout = manifest.get("milvus_layout") or {"version": 1}
    if layout.get("version") != LAYOUT:
        raise ConflictError(
            f"multi-vector collection {name!r} in Milvus at {uri} has storage layout "
            f"{layout.get('version')}{' (one row per token vector)' if layout.get('version') == 1 else ''}, "
            f"but this embedpool reads layout {LAYOUT} (one row per document, vectors packed); rebuild "
            f"it: index the corpus again into a new collection (embedpool index CORPUS --backend milvus "
            f"--milvus-uri {uri} --collection NEW ...), or delete {name!r} (DELETE /collections/{name} "
            "on the API) and index it again under its name")
    return layout


_READS = frozenset({"search", "query", "get", "hybrid_search"})


def check_consistency(level: str | None) -> None:
    if level is not None and level not in READ_CONSISTENCY:
        raise InvalidError(f"unknown Milvus read consistency {level!r}; use one of {', '.join(READ_CONSISTENCY)}",
                           param="milvus_consistency")


class MilvusCollection(CollectionBase):
    """A single-vector, multi-vector or sparse collection stored in Milvus. Use :meth:`create` / :meth:`open`
    (or :func:`index.open_collection` with ``backend="milvus"``)."""

    backend = "milvus"
    _read_level: str | None = None  #: this object's read consistency (None: the collection's)

    # ---- opening ------------------------------------------------------------------------------
    @classmethod
    def create(cls, uri: str, name: str, spec: CollectionSpec, *,
               token: str | None = None, consistency: str | None = None) -> "MilvusCollection":
        """Create collection ``name``; if it exists with an equal spec, open it; if with a
        different spec, raise :class:`ConflictError` naming the differing fields."""
        check_factories(check_new_spec(name, spec))
        check_consistency(consistency)
        conn = ClientPool.acquire(uri, token)
        try:
            create_if_absent(conn, name, spec)
            coll = cls._open(conn, name, consistency)
        except BaseException:
            ClientPool.release(conn)
            raise
        return require_spec(coll, spec)

    @classmethod
    def open(cls, uri: str, name: str, *, token: str | None = None,
             consistency: str | None = None) -> "MilvusCollection":
        """Open an existing collection (:class:`NotFoundError` if absent); ``consistency``: that of
        this object's reads (:data:`READ_CONSISTENCY`; ``None``: the collection's, ``Strong``)."""
        check_name(name)
        check_consistency(consistency)
        conn = ClientPool.acquire(uri, token)
        try:
            return cls._open(conn, name, consistency)
        except BaseException:
            ClientPool.release(conn)
            raise

    @classmethod
    def open_or_create(cls, uri: str, name: str, spec: CollectionSpec, *,
                       token: str | None = None, consistency: str | None = None) -> "MilvusCollection":
        return cls.create(uri, name, spec, token=token, consistency=consistency)

    @classmethod
    def _open(cls, conn: Connection, name: str, consistency: str | None = None) -> "MilvusCollection":
        manifest, desc = describe(conn, name)
        check_layout(manifest, name, conn.uri)
        spec = CollectionSpec.from_dict(manifest)
        with conn.errors(f"opening collection {name!r}"):
            gaps = damage(conn, milvus_name(name), spec, desc)
        if gaps:  # left by a creation that failed before creation was all-or-nothing
            repair(conn, name, spec, desc, lambda: _count_rows(conn, name))
            manifest, desc = describe(conn, name)
        coll = cls(conn, name, manifest, desc)
        coll._read_level = consistency
        coll._rpc(f"loading collection {name!r}", "load_collection")
        for rows in coll._row_colls:  # token rows, companion rows
            coll._rpc(f"loading collection {name!r}", "load_collection", coll=rows)
        return coll

    def __init__(self, conn: Connection, name: str, manifest: dict[str, Any], desc: dict[str, Any]) -> None:
        super().__init__()
        self.name = name
        self.uri = conn.uri
        self.spec = CollectionSpec.from_dict(manifest)
        self._conn = conn
        self._mname = milvus_name(name)
        self._manifest = manifest
        self._wlock = ClientPool.write_lock(conn, self._mname)
        self._multi = self.spec.kind == "multi"
        self._sparse = self.spec.kind == "sparse"
        self._tname = tokens_name(self._mname)  # multi: the token rows
        self._row_colls = [n for n, _ in vector_rows(self._mname, self.spec)]  # token and companion rows
        has_companion = self.spec.companion_pooler is not None
        self._cname = companion_rows_name(self._mname) if has_companion else None  # the companion rows
        self._companion_base = milvus_index(self.spec.companion_factory)[2] if has_companion else {}
        # companion candidates by a grouping search where Milvus has one (2.4+), until it refuses one
        self._group_by = conn.features.group_by
        # multi: the per-document row counts a document's row 0 keeps -> the Milvus collection
        # of those rows (None: the document rows themselves)
        self._row_counts = dict(zip(doc_counts(self.spec), [None, *self._row_colls])) if self._multi else {}
        layout = check_layout(manifest, name, conn.uri)
        self._packing = None if layout is None else Packing(
            self.spec.dim, self.spec.precision, layout["element_chars"], layout["row_elements"])
        self._index_type, _, self._search_base = index_of(self.spec)
        # without nullable fields (a Milvus before 2.5 made it): stand-ins and the nulls field
        self._nulls = NULLS in {f["name"] for f in desc.get("fields", [])}
        self._doc_fields = ["text", "metadata", *([NULLS] if self._nulls else [])]
        self._props: dict[str, str] = {}  # staged properties
        self._closed = False
        self.capabilities = Capabilities(
            supports_token_ann=self._multi, token_index_on_insert=True, transactional=False,
            measures_disk_usage=False, multi_process=not is_lite(self.uri),
            concurrent_writers=not is_lite(self.uri))

    @property
    def _client(self) -> Any:
        """The connection's current client (a new one after Milvus was unreachable)."""
        return self._conn.client()

    def _rpc(self, what: str, method: str, *args: Any, coll: str | None = None, **kwargs: Any) -> Any:
        """``client.<method>(<this collection>, ...)`` with embedpool errors (``coll``: another
        Milvus collection of it, the token rows). A collection that a restarted Milvus has
        released is loaded again and the call retried once."""
        from pymilvus.exceptions import MilvusException

        mname = coll or self._mname
        if self._read_level is not None and method in _READS:
            kwargs["consistency_level"] = self._read_level
        with self._conn.errors(what):
            call = getattr(self._client, method)
            try:
                return call(mname, *args, **kwargs)
            except MilvusException as e:
                if method == "load_collection" or not not_loaded(e):
                    raise
            log.warning("collection %r was released by Milvus (restarted?): loading it again", self.name)
            self._client.load_collection(mname)
            return getattr(self._client, method)(mname, *args, **kwargs)

    # ---- writes -------------------------------------------------------------------------------
    def add(self, ids: Sequence[str], vectors: Any, texts: Sequence[str | None] | None = None,
            metadata: Sequence[dict | None] | None = None, *, model: str | None = None,
            pooler: str | None = None, companion: Any = None) -> None:
        """Insert or replace documents (see :meth:`CollectionBase.add`). The batch is
        validated first; on a validation error nothing changes. Applied to Milvus at once."""
        ids, vecs, texts_, metas, comp = self._check_add(ids, vectors, texts, metadata, model, pooler, companion)
        if not ids:
            return
        _check_sizes(ids, texts_)
        meta = [None if m is None else milvus_metadata(json.loads(m)) for m in metas]
        _check_metadata_sizes(ids, metas, meta)
        seq = InsertionClock.take(len(ids))
        with self._wlock:
            self._check_open()
            if self._multi:
                return self._add_multi(ids, vecs, texts_, meta, seq, comp)
            if self._sparse:  # checked rows (index.sparse.check_sparse_rows): {token id: weight} each
                rows = [self._stored({"id": i, "seq": seq + j, "vector": stored_sparse(v, self.spec.dim),
                                      NNZ: len(v), "text": t, "metadata": m})
                        for j, (i, v, t, m) in enumerate(zip(ids, row_dicts(vecs), texts_, meta))]
                for b in _byte_batches(rows, _sparse_bytes):
                    self._rpc(f"upsert into {self.name!r}", "upsert", b)
                return
            rows = [self._stored({"id": i, "seq": seq + j, "vector": vecs[j], "text": t, "metadata": m})
                    for j, (i, t, m) in enumerate(zip(ids, texts_, meta))]
            self._upsert_vectors(rows, None, self.spec.dim)

    def _stored(self, row: dict) -> dict:
        """A document row as this collection stores it (stand-ins for missing text and metadata
        where the Milvus that made it has no nullable fields: :mod:`.schema`)."""
        return with_stand_ins(row) if self._nulls else row

    def _upsert_vectors(self, rows: list[dict], coll: str | None, dim: int) -> None:
        """Upsert rows of one ``dim`` vector each (single-vector documents, token rows,
        companion rows)."""
        for b in _batches(rows, _BATCH_BYTES // (4 * dim + 64)):
            self._rpc(f"upsert into {self.name!r}", "upsert", b, coll=coll)

    def _add_multi(self, ids: list[str], vecs: list[np.ndarray], texts: list[str | None],
                   meta: list[Any], seq: int, comp: list[np.ndarray] | None) -> None:
        """Upsert the documents' companion rows (a collection that keeps them; first, so a
        reader that finds a document finds its rows), then their packed rows -- later parts
        first, part 0 last, so a reader that finds the new part 0 finds its other parts --
        then their token rows; then delete the surplus parts, token rows and companion rows of
        longer old versions."""
        old = self._heads(ids, list(self._row_counts))
        heads, tails, tokens, companion = [], [], [], []
        stale: dict[str, list[str]] = {f: [] for f in self._row_counts}
        for j, (i, d, t, m) in enumerate(zip(ids, vecs, texts, meta)):
            rows, stored = self._packing.rows(i, d, seq + j, t, m,
                                              None if comp is None else {"companion_rows": len(comp[j])})
            heads.append(self._stored(rows[0]))
            tails.extend(map(self._stored, rows[1:]))
            tokens.extend(_vector_rows(i, stored))
            new = {"parts": len(rows), "n": len(stored)}
            if comp is not None:
                companion.extend(_vector_rows(i, comp[j]))
                new["companion_rows"] = len(comp[j])
            o = old.get(i, {})
            for f, keys in stale.items():
                keys.extend(pk(i, p) for p in range(new[f], o.get(f, 0)))
        if comp is not None:
            self._upsert_vectors(companion, self._cname, self.spec.companion_dim)
        for rows in (tails, heads):
            for b in _byte_batches(rows):
                self._rpc(f"upsert into {self.name!r}", "upsert", b)
        self._upsert_vectors(tokens, self._tname, self.spec.dim)
        for f, coll in self._row_counts.items():
            self._delete_rows(stale[f], coll)

    def _delete_rows(self, pks: list[str], coll: str | None = None) -> None:
        """Delete rows by primary key (``coll``: of the token or companion rows). Not
        ``client.delete(ids=...)``: it quotes string keys without escaping, so a key with a quote
        or a backslash made the expression invalid (such a document could not be deleted)."""
        key = "pk" if self._multi or coll is not None else "id"
        for b in _batches(pks, _DELETE_ROWS):
            self._rpc(f"delete from {self.name!r}", "delete", filter=f"{key} in [{', '.join(map(quote, b))}]",
                      coll=coll)

    def delete(self, ids: Sequence[str]) -> None:
        """Delete documents by id. Any unknown id: :class:`NotFoundError`, nothing deleted."""
        ids = self._check_delete(ids)
        if not ids:
            return
        with self._wlock:
            self._refuse_unknown(ids, self._existing(ids))
            if not self._multi:
                return self._delete_rows(ids)
            heads = self._heads(ids, list(self._row_counts))
            for f, coll in self._row_counts.items():  # document rows first: then the document is gone
                self._delete_rows([pk(d, p) for d, r in heads.items() for p in range(r[f])], coll)

    def commit(self) -> None:
        """Flush Milvus segments, then store the staged properties and the manifest's time
        (writes are already durable in Milvus' WAL when ``add``/``delete`` return)."""
        with self._wlock:
            self._check_open()
            m = {**self._manifest, "updated": now_iso()}  # counts are live in Milvus
            for rows in self._row_colls:  # token rows, companion rows
                self._rpc(f"flush of {self.name!r}", "flush", coll=rows)
            self._rpc(f"flush of {self.name!r}", "flush")
            self._rpc(f"flush of {self.name!r}", "alter_collection_properties",
                      properties={**self._props, MANIFEST_KEY: json.dumps(m)})
            self._manifest = m
            self._props = {}

    def get_property(self, key: str) -> str | None:
        """The staged value, else the committed one (a Milvus collection property)."""
        self._check_open()
        check_property(key, "")
        if key in self._props:
            return self._props[key]
        props = self._rpc(f"reading properties of {self.name!r}", "describe_collection").get("properties") or {}
        return props.get(key)

    def set_property(self, key: str, value: str) -> None:
        """Stage a property; :meth:`commit` stores it after flushing the data."""
        check_property(key, value)
        with self._wlock:
            self._check_open()
            self._props[key] = value

    def compact(self) -> None:
        """Ask Milvus to compact (drop deleted rows, merge segments), then commit."""
        self._check_open()
        try:
            for mname in (self._mname, *self._row_colls):
                self._client.compact(mname)
        except Exception as e:  # Milvus Lite does not implement it; servers compact by themselves
            log.info("collection %r: compaction not available: %s", self.name, e)
        self.commit()

    def build_token_index(self) -> None:
        """No-op: Milvus indexes token vectors as they are inserted."""
        self._check_token_index()

    def refresh(self) -> bool:
        """Milvus reads are always current (strong consistency): nothing to reload. Checks the
        collection still exists (one cheap call)."""
        self._check_open()
        with self._conn.errors(f"checking collection {self.name!r}"):
            exists = self._client.has_collection(self._mname)
        if not exists:
            raise NotFoundError(f"collection {self.name!r} was dropped from Milvus at {self.uri}")
        return False

    def close(self) -> None:
        """Release the connection (the last one to a Milvus Lite file stops its engine)."""
        if self._closed:
            return
        if self._props:
            log.warning("collection %r closed with uncommitted properties; they are discarded", self.name)
        self._closed = True
        ClientPool.release(self._conn)

    def __repr__(self) -> str:
        return f"MilvusCollection({self.uri!r}, {self.name!r}, kind={self.spec.kind!r})"

    # ---- search hooks ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidError(f"collection {self.name!r} is closed")

    def _ann(self, x: Any, k: int, output_fields: list[str], coll: str | None = None,
             **kwargs: Any) -> list[list[dict]]:
        """Top-``k`` rows per query (``x``: a ``[q, dim]`` array, or a sparse collection's
        ``{token id: weight}`` dicts): documents (single, sparse), token rows (``coll``), or
        companion rows (``coll=self._cname``, inner product; ``kwargs``: e.g. ``group_by_field``)."""
        limit = min(k, MAX_TOPK)
        companion = coll is not None and coll == self._cname
        metric_type = "IP" if companion else metric(self.spec)
        base = self._companion_base if companion else self._search_base
        return self._rpc(f"search of {self.name!r}", "search", data=list(x), limit=limit, coll=coll,
                         anns_field="vector", output_fields=output_fields,
                         search_params={"metric_type": metric_type, "params": search_params(base, limit)},
                         **kwargs)

    def _expr(self, flt: Node | None, heads: bool = True) -> str:
        """The Milvus filter expression of ``flt`` over the document rows (multi: their part 0,
        which carries the metadata); empty for no filter."""
        if flt is None:
            return "part == 0" if self._multi and heads else ""
        e = to_milvus(flt)
        return f"part == 0 and {e}" if self._multi else e

    def _matching(self, flt: Node) -> list[str]:
        """The ids of the documents that match ``flt``."""
        field = "doc_id" if self._multi else "id"
        return sorted(r[field] for r in self._scan(self._expr(flt), [field]))

    def _search_single(self, x: np.ndarray, k: int, flt: Node | None = None) -> list[list[Hit]]:
        if not x.shape[0]:
            return []
        if self._sparse:  # a CSR matrix of checked queries
            return self._search_sparse(row_dicts(x), k, flt)
        return [_doc_hits(row) for row in self._filtered_ann(x, k, self._doc_fields, flt)]

    def _search_sparse(self, queries: list[dict[int, float]], k: int, flt: Node | None) -> list[list[Hit]]:
        """Top-k of sparse queries by the sparse inverted index (:data:`.mapping.SPARSE_INDEX`,
        inner product), the filter inside the search: every document that shares a token with a
        query is scored, so the hits are the exact top k among them (a document that shares
        none scores 0 and is not answered, as with Seismic on the FAISS backend). A query
        without a non-zero weight shares no token: no hits, and Milvus is not asked."""
        out: list[list[Hit]] = [[] for _ in queries]
        asked = [j for j, q in enumerate(queries) if q]
        if asked:
            res = self._ann([queries[j] for j in asked], k, self._doc_fields, filter=self._expr(flt))
            for j, row in zip(asked, res):
                out[j] = _doc_hits(row)
        return out

    def _filtered_ann(self, x: np.ndarray, k: int, fields: list[str], flt: Node | None) -> list[list[dict]]:
        """Single-vector top-k with the filter in Milvus' search. An approximate index (HNSW,
        IVF) can return fewer than ``k`` matching rows where ``k`` exist (Milvus Lite does
        with few matches): such queries are answered exactly over the matching rows, read
        with their vectors, when they are at most :data:`MAX_IN_IDS`."""
        expr = self._expr(flt)
        res = [list(r) for r in self._ann(x, k, fields, filter=expr)]
        if flt is None or self._index_type == "FLAT":
            return res
        short = [j for j, r in enumerate(res) if len(r) < min(k, MAX_TOPK)]
        if not short:
            return res
        n = self._count(expr)
        short = [j for j in short if len(res[j]) < min(k, n)]
        if not short or n > MAX_IN_IDS:
            return res
        rows = self._scan(expr, ["id", "vector", *fields])
        v = np.asarray([r["vector"] for r in rows], np.float32)
        for j in short:
            d = v @ x[j] if self.spec.metric == "ip" else ((v - x[j]) ** 2).sum(axis=1)
            order = np.argsort(-d if self.spec.metric == "ip" else d, kind="stable")[:k]
            res[j] = [{"id": rows[i]["id"], "distance": float(d[i]), "entity": rows[i]} for i in order]
        return res

    def _search_exhaustive(self, qs: list[np.ndarray], k: int, flt: Node | None = None) -> list[list[Hit]]:
        heads: list[dict] = []
        codes, scales, offsets, doc_ids = self._fetch_codes(None if flt is None else self._matching(flt), heads)
        best = maxsim_topk(qs, codes, offsets, scales, k)  # the int8 scan where the CPU has int8 units
        return self._hits([topk(s, doc_ids[p], k) for s, p in best], self._head_docs(heads) if flt is not None else None)

    def _search_tokens(self, qs: list[np.ndarray], k: int, k_token: int,
                       flt: Node | None = None) -> list[list[Hit]]:
        ids = None if flt is None else self._matching(flt)
        expr = "" if ids is None or len(ids) > MAX_IN_IDS else f"doc_id in [{', '.join(map(quote, ids))}]"
        if ids is not None and not ids:
            return [[] for _ in qs]
        res = self._ann(np.concatenate(qs), k_token, ["doc_id"], coll=self._tname, filter=expr)
        keep = None if ids is None else set(ids)
        cands, start = [], 0
        for q in qs:
            c = list(dict.fromkeys(h["entity"]["doc_id"] for row in res[start:start + len(q)] for h in row
                                   if keep is None or h["entity"]["doc_id"] in keep))
            # the token ANN may reach fewer than k matching documents: then all of them
            cands.append(ids if ids is not None and len(c) < min(k, len(ids)) else c)
            start += len(q)
        return self._rerank(qs, cands, k)

    def _search_companion(self, qs: list[np.ndarray], cq: np.ndarray, candidates: int,
                          k: int, flt: Node | None = None) -> list[list[Hit]]:
        if flt is None:
            return self._rerank(qs, self._companion_candidates(cq, min(candidates, MAX_TOPK)), k)
        ids = self._matching(flt)
        if len(ids) <= candidates:  # every matching document is a candidate
            return self._rerank(qs, [ids] * len(qs), k)
        return self._rerank(qs, self._companion_candidates(cq, min(candidates, MAX_TOPK), ids), k)

    def _companion_candidates(self, cq: np.ndarray, k: int, ids: list[str] | None = None) -> list[list[str]]:
        """Per companion query, the ``k`` distinct documents of the best companion rows (fewer
        if the collection has fewer), best first. One grouping search (``group_by_field``: a
        Milvus server keeps searching until it has ``k`` groups; Milvus Lite groups the best
        ``10 k`` rows, which hold fewer documents when documents have many rows); a query left
        short of ``k`` (or every query, where Milvus cannot group) is over-fetched: plain
        searches of ever more rows (x4) until ``k`` documents are found or every row was seen
        (a search returned fewer rows than asked for, or Milvus' limit of :data:`MAX_TOPK`).
        ``ids``: only these documents (a metadata filter's): named in the expression when they
        are at most :data:`MAX_IN_IDS`, else the rows of others are skipped."""
        out: list[list[str]] = [[] for _ in range(len(cq))]
        expr = "" if ids is None or len(ids) > MAX_IN_IDS else f"doc_id in [{', '.join(map(quote, ids))}]"
        keep = None if ids is None else set(ids)
        if self._group_by:
            try:
                res = self._ann(cq, k, ["doc_id"], coll=self._cname, group_by_field="doc_id", filter=expr)
                out = [_distinct_docs(row, k, keep) for row in res]
            except UnavailableError as e:
                if self._conn.broken:  # unreachable: not a refusal to group
                    raise
                log.info("collection %r: grouping search refused (%s); over-fetching rows instead", self.name, e)
                self._group_by = False
        todo = [j for j, docs in enumerate(out) if len(docs) < k]
        kk = min(MAX_TOPK, 4 * k + 16)
        while todo:
            res = self._ann(cq[todo], kk, ["doc_id"], coll=self._cname, filter=expr)
            short = []
            for j, row in zip(todo, res):
                out[j] = _distinct_docs(row, k, keep)
                if len(out[j]) < k and len(row) == kk < MAX_TOPK:
                    short.append(j)  # more rows to see
            todo, kk = short, min(MAX_TOPK, 4 * kk)
        return out

    def _rerank(self, qs: list[np.ndarray], ext_lists: list[list[str]], k: int,
                flt: Node | None = None) -> list[list[Hit]]:
        """Exact MaxSim of each query against its candidate documents (ids), on their stored codes."""
        if flt is not None:
            keep = set(self._matching(flt))
            ext_lists = [[e for e in lst if e in keep] for lst in ext_lists]
        union = sorted({e for lst in ext_lists for e in lst})
        heads: list[dict] = []  # part 0 rows carry text and metadata: no second query for the hits
        codes, scales, offsets, doc_ids = self._fetch_codes(union, heads)
        where = {d: j for j, d in enumerate(doc_ids.tolist())}
        out = []
        for q, lst in zip(qs, ext_lists):
            idx = np.array([where[e] for e in dict.fromkeys(lst) if e in where], dtype=np.int64)
            s = maxsim_scores([q], codes, offsets, scales, doc_idx=idx)[0]
            out.append(topk(s, doc_ids[idx], k))
        return self._hits(out, self._head_docs(heads))

    @staticmethod
    def _head_docs(heads: list[dict]) -> dict[str, tuple[str | None, dict | None]]:
        """doc id -> (text, metadata) of document rows (part 0) read with their codes."""
        return {h["doc_id"]: text_and_metadata(h) for h in heads}

    def _search_lexical(self, texts: list[str], k: int, flt: Node | None = None) -> list[list[Hit]]:
        """BM25 by Milvus' own full-text search (the BM25 function of the ``text`` field)."""
        if not self._manifest.get("milvus_full_text"):
            raise InvalidError(
                f"collection {self.name!r} in Milvus at {self.uri} has no full-text (BM25) index: "
                + ("the Milvus server it was created on had no full-text search (Milvus 2.5 and later have it)"
                   if self.spec.lexical else "it was created without one (analyzer 'none')"), param="mode")
        field = "doc_id" if self._multi else "id"
        res = self._rpc(f"search of {self.name!r}", "search", data=list(texts), limit=min(k, MAX_TOPK),
                        anns_field=SPARSE_FIELD, output_fields=[field, *self._doc_fields], filter=self._expr(flt),
                        search_params={"metric_type": "BM25"})
        # Milvus Lite reports BM25 negated (best first, most negative); servers positive
        return [[Hit(h["entity"].get(field, h.get("id")), abs(float(h["distance"])), *text_and_metadata(h["entity"]))
                 for h in row] for row in res]

    def _delete_where(self, flt: Node) -> int:
        with self._wlock:
            ids = self._matching(flt)
        self.delete(ids)
        return len(ids)

    # ---- reads ----------------------------------------------------------------------------------
    def _fetch_codes(self, doc_ids: list[str] | None, heads_out: list[dict] | None = None) -> tuple[Any, ...]:
        """The stored codes of ``doc_ids`` (all documents if ``None``), contiguous per document:
        ``(codes [T, dim], int8 scales [T] | None, offsets [n + 1], doc ids [n])`` (unknown ids
        are left out). Candidates cost one query per :data:`FETCH_DOCS` documents (part 0 by
        primary key), plus one for the further parts of documents too large for one row.
        ``heads_out`` receives the part 0 rows, with their row counts, text and metadata."""
        self._check_open()
        fields = ["doc_id", "part", "parts", "n", "seq", "codes"]
        if doc_ids is None:
            rows = self._scan("", fields)
            heads = [r for r in rows if r["part"] == 0]
            tails = [r for r in rows if r["part"] != 0]
        else:
            head_fields = fields if heads_out is None else list(dict.fromkeys([*fields, *self._row_counts,
                                                                                *self._doc_fields]))
            heads = [r for b in _batches(doc_ids, FETCH_DOCS) for r in self._get([pk(d, 0) for d in b], head_fields)]
            if heads_out is not None:
                heads_out.extend(heads)
            more = [pk(h["doc_id"], p) for h in heads for p in range(1, h["parts"])]
            tails = [r for b in _batches(more, FETCH_DOCS) for r in self._get(b, fields)]
        return self._packing.assemble(heads, tails)

    def _scan(self, flt: str, fields: list[str]) -> list[dict]:
        """Every row matching ``flt`` (all rows if empty), page by page: queries with
        ``pk > last`` in primary-key order, ``last`` quoted as every literal of ours is
        (:func:`index.filters.quote`). Not pymilvus' query iterator, which a server has: it pages
        with ``pk > "last"`` unescaped, so an id with a quote or a backslash breaks its next page's
        expression (a Milvus 2.3.5 server: "invalid expression"); Milvus Lite lacks its timestamp
        RPC anyway. A server's pages hold at most its query window (16,384 rows)."""
        key = "pk" if self._multi else "id"
        row = (self._packing.row_bytes() if "codes" in fields else
               4 * self.spec.dim if "vector" in fields else 0) + 256
        page = max(16, _SCAN_BYTES // row)
        if self._conn.features.query_window:
            page = min(page, self._conn.features.query_window)
        rows, last = [], None
        while True:  # keyset pages in primary-key order
            cond = " and ".join(c for c in (flt and f"({flt})",
                                             last is not None and f"{key} > {quote(last)}") if c)
            batch = _rows(self._rpc(f"query of {self.name!r}", "query", filter=cond or f'{key} != ""',
                                    output_fields=[*fields, key], limit=page, iterator="True"))
            rows.extend(batch)
            if len(batch) < page:
                return rows
            last = max(r[key] for r in batch)

    def _hits(self, results: list[list[tuple[float, str]]],
              docs: dict[str, tuple[str | None, dict | None]] | None = None) -> list[list[Hit]]:
        """Attach text and metadata (``docs``, else read now) to (score, id) results."""
        if docs is None:
            docs = self._docs(sorted({i for r in results for _, i in r}))
        return [[Hit(i, s, *docs[i]) for s, i in r if i in docs] for r in results]

    def _docs(self, ids: list[str]) -> dict[str, tuple[str | None, dict | None]]:
        """id -> (text, metadata) of the documents that exist (primary-key lookups)."""
        if self._multi:
            return {d: text_and_metadata(r) for d, r in self._heads(ids, self._doc_fields).items()}
        return {r["id"]: text_and_metadata(r) for r in self._get(ids, ["id", *self._doc_fields])}

    def _existing(self, ids: list[str]) -> set[str]:
        return set(self._docs(ids))

    def _get(self, pks: list[str], fields: list[str], coll: str | None = None) -> list[dict]:
        """Rows by primary key (``pk in [...]``: Milvus' point lookup), a page of keys per
        call (``coll``: of the token or companion rows). Not ``client.get``: it does not
        escape backslashes in string keys."""
        key = "pk" if self._multi else "id"
        rows: list[dict] = []
        for b in _batches(pks, _FETCH_ROWS):
            rows.extend(_rows(self._rpc(f"query of {self.name!r}", "query", output_fields=fields, coll=coll,
                                        filter=f"{key} in [{', '.join(map(quote, b))}]")))
        return rows

    def _heads(self, doc_ids: list[str], fields: list[str]) -> dict[str, dict]:
        """multi: doc id -> its row 0 (``fields`` of it), for the documents that exist."""
        return {r["doc_id"]: r for r in self._get([pk(d, 0) for d in doc_ids], ["doc_id", *fields])}

    def get(self, id: str) -> dict[str, Any]:
        """``{id, text, metadata, vector}`` (single; sparse: ``vector`` is ``{indices, values}``)
        or ``{id, text, metadata, vectors}`` (multi; with ``companion``, its ``[r, companion_dim]``
        rows, where the collection keeps them)."""
        self._check_open()
        heads: list[dict] = []
        if isinstance(id, str) and id:
            if self._multi:  # row 0 has text, metadata, the row counts: one query (+ one for more parts)
                codes, scales, _, _ = self._fetch_codes([id], heads)
            else:
                heads = self._get([id], ["id", *self._doc_fields, "vector"])
        if not heads:
            raise NotFoundError(f"no document {id!r} in collection {self.name!r}", param="id")
        h = heads[0]
        text, meta = text_and_metadata(h)
        out: dict[str, Any] = {"id": id, "text": text, "metadata": meta}
        if self._sparse:
            out["vector"] = dict(zip(("indices", "values"), sparse_row(h["vector"], self.spec.dim)))
            return out
        if not self._multi:
            out["vector"] = np.asarray(h["vector"], dtype=np.float32)
            return out
        out["vectors"] = dequantize(codes, scales)
        if self._cname is not None:
            out["companion"] = self._companion_of(id, h["companion_rows"])
        return out

    def _companion_of(self, doc_id: str, n_rows: int) -> np.ndarray:
        """The companion rows of a document, ``[n_rows, companion_dim]`` float32, in row order."""
        rows = {r["pk"]: r["vector"] for r in self._get([pk(doc_id, p) for p in range(n_rows)], ["pk", "vector"],
                                                       self._cname)}
        vecs = [rows.get(pk(doc_id, p)) for p in range(n_rows)]
        if any(v is None for v in vecs):
            raise InternalError(f"document {doc_id!r} lacks companion rows (an interrupted write); "
                                "add the document again to repair it")
        return np.asarray(vecs, dtype=np.float32).reshape(n_rows, self.spec.companion_dim)

    def ids(self) -> list[str]:
        """All document ids, in insertion order."""
        self._check_open()
        field = "doc_id" if self._multi else "id"
        rows = self._scan("part == 0" if self._multi else "", [field, "seq"])
        rows.sort(key=lambda r: (r["seq"], r[field]))
        return [r[field] for r in rows]

    def _count(self, flt: str, coll: str | None = None) -> int:
        res = self._rpc(f"count of {self.name!r}", "query", filter=flt, output_fields=["count(*)"], coll=coll)
        return int(res[0]["count(*)"]) if res else 0

    def _counts(self) -> dict[str, int]:
        if self._multi:
            return {"documents": self._count("part == 0"), "vectors": self._count("", self._tname)}
        n = self._count("")
        return {"documents": n, "vectors": n}

    def __len__(self) -> int:
        if self._closed:
            return 0
        return self._counts()["documents"]

    def __contains__(self, id: object) -> bool:
        self._check_open()
        return isinstance(id, str) and bool(id) and id in self._existing([id])

    def stats(self) -> dict[str, Any]:
        """See :class:`index.base.Stats`: bytes_per_doc is the vector storage per document in
        Milvus, index overhead not included (multi: the packed codes in the storage precision
        plus the float32 token rows of the token ANN; sparse: as the FAISS backend counts its
        rows, :func:`index.sparse.stored_bytes` of the documents' non-zeros, which it reads from
        every row's ``nnz``); bytes_on_disk is unknown (``None``); tombstones always 0 (Milvus
        compacts by itself)."""
        self._check_open()
        c = self._counts()
        comp_rows = None if self._cname is None else self._count("", self._cname)
        if self._sparse:
            nnz = sum(r[NNZ] for r in self._scan("", [NNZ])) if c["documents"] else 0
            size = stored_bytes(nnz, c["documents"], self.spec.dim)
        else:
            per_vec = 4 * self.spec.dim + (bytes_per_vector(self.spec.dim, self.spec.precision) if self._multi else 0)
            size = per_vec * c["vectors"] + 4 * self.spec.companion_dim * (comp_rows or 0)
        return make_stats(documents=c["documents"], vectors=c["vectors"], bytes_on_disk=None,
                          bytes_per_doc=size / c["documents"] if c["documents"] else 0.0, tombstones=0,
                          segments=None, token_index=self._multi,
                          index_type=self._index_type, backend=self.backend,
                          location=f"Milvus at {self.uri}", companion_rows=comp_rows)


def _doc_hits(row: list[dict]) -> list[Hit]:
    """The hits of one query's search of document rows (single-vector, sparse)."""
    return [Hit(h["id"], float(h["distance"]), *text_and_metadata(h["entity"])) for h in row]


def _distinct_docs(hits: list[dict], k: int, keep: set[str] | None = None) -> list[str]:
    """The first ``k`` distinct documents of search hits (rows with a ``doc_id``), in order
    (``keep``: only these)."""
    docs = (h["entity"]["doc_id"] for h in hits)
    return list(dict.fromkeys(d for d in docs if keep is None or d in keep))[:k]


def _vector_rows(doc_id: str, vectors: np.ndarray) -> Iterator[dict]:
    """The rows of one vector each (token rows, companion rows) of a multi-vector document."""
    return ({"pk": pk(doc_id, p), "doc_id": doc_id, "vector": v} for p, v in enumerate(vectors))


def _check_sizes(ids: list[str], texts: list[str | None]) -> None:
    """Milvus' field limits on ids and texts (checked before anything is written)."""
    for i in ids:
        if len(i.encode()) > MAX_ID_BYTES:
            raise InvalidError(f"id {i[:40]!r}... is longer than {MAX_ID_BYTES} bytes", param="ids")
    for i, t in zip(ids, texts):
        if t is not None and len(t.encode()) > MAX_TEXT_BYTES:
            raise InvalidError(
                f"text of id {i!r} is {len(t.encode())} bytes; Milvus stores at most "
                f"{MAX_TEXT_BYTES} bytes of text per document", param="texts")


def _check_metadata_sizes(ids: list[str], texts: list[str | None], stored: list[Any]) -> None:
    """Milvus' limit on a JSON field, on the metadata as stored (with the instants of its dates,
    :func:`index.filters.milvus_metadata`); checked before anything is written."""
    for i, text, m in zip(ids, texts, stored):
        if m is None:
            continue
        if DATES_KEY in m:
            text = json.dumps(m, ensure_ascii=False, separators=(",", ":"))
        n = len(text.encode("utf-8"))
        if n > MAX_METADATA_BYTES:
            raise InvalidError(f"metadata of id {i!r} is {n:,} bytes as JSON; a Milvus JSON field holds at most "
                               f"{MAX_METADATA_BYTES:,} bytes (the limit every backend stores: max_metadata_bytes)",
                               param="metadata")


def _count_rows(conn: Connection, name: str) -> int:
    """The document rows of collection ``name`` (loading it)."""
    mname = milvus_name(name)
    client = conn.client()
    client.load_collection(mname)
    res = client.query(mname, filter="", output_fields=["count(*)"])
    return int(res[0]["count(*)"]) if res else 0
