"""The Milvus collection: the :class:`index.base.CollectionBase` contract over one Milvus
collection (schema: :mod:`index.milvus.schema`; connection and recovery:
:mod:`index.milvus.connection`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..base import MANIFEST_PROPERTY, Capabilities, CollectionBase, Hit, make_stats
from ..base import check_new_spec, check_property, require_spec
from ..durable import now_iso
from ..errors import CollectionNotFoundError, DocumentNotFoundError, InvalidInputError, NotACollectionError
from ..maxsim import dequantize, maxsim_scores, quantize
from ..spec import CollectionSpec, check_name, new_manifest, parse_manifest
from ..validate import topk
from .clock import InsertionClock
from .connection import ClientPool, Connection, is_lite, not_loaded
from .mapping import metric, milvus_index, search_params, vector_factory
from .names import embedpool_name, milvus_name, pk, quote
from .schema import MAX_ID_BYTES, MAX_TEXT_BYTES, schema

log = logging.getLogger("embedpool.index")

MANIFEST_KEY = MANIFEST_PROPERTY
MAX_TOPK = 16_384  # Milvus' limit on limit/topk
_BATCH_BYTES = 8 << 20  # rows per insert/upsert call: ~8 MB of vectors
_FETCH_ROWS = 4096  # rows per get() by primary key
_DELETE_ROWS = 16_384  # primary keys per delete call
_SCAN_BYTES = 64 << 20  # Milvus Lite: bytes per page of a full scan (its gRPC limit is 256 MB)


def _rows(result: Any) -> list[dict]:
    """A plain list of the rows of a pymilvus result. Its lists materialize rows lazily by
    position: sorting one in place would pair fields of different rows."""
    return [r for r in result]


def _batches(rows: list, step: int) -> Iterator[list]:
    for i in range(0, len(rows), max(1, step)):
        yield rows[i:i + max(1, step)]


def read_manifest(conn: Connection, name: str) -> dict[str, Any]:
    """The manifest property of collection ``name`` (checked), without loading the collection."""
    mname = milvus_name(name)
    with conn.errors(f"opening collection {name!r}"):
        client = conn.client()
        if not client.has_collection(mname):
            have = sorted(n for n in map(embedpool_name, client.list_collections()) if n)
            raise CollectionNotFoundError(
                f"no collection {name!r} in Milvus at {conn.uri}"
                + (f" (collections there: {', '.join(have)})" if have else " (it holds no collections)"))
        props = client.describe_collection(mname).get("properties") or {}
    if MANIFEST_KEY not in props:
        raise NotACollectionError(
            f"Milvus collection {mname!r} at {conn.uri} has no embedpool manifest; it was not "
            "created by embedpool")
    return parse_manifest(props[MANIFEST_KEY], f"manifest of Milvus collection {mname!r}")


class MilvusCollection(CollectionBase):
    """A single- or multi-vector collection stored in Milvus. Use :meth:`create` / :meth:`open`
    (or :func:`index.open_collection` with ``backend="milvus"``)."""

    backend = "milvus"

    # ---- opening ------------------------------------------------------------------------------
    @classmethod
    def create(cls, uri: str, name: str, spec: CollectionSpec, *,
               token: str | None = None) -> "MilvusCollection":
        """Create collection ``name``; if it exists with an equal spec, open it; if with a
        different spec, raise :class:`SpecMismatchError` naming the differing fields."""
        milvus_index(vector_factory(check_new_spec(name, spec)))
        conn = ClientPool.acquire(uri, token)
        try:
            _create_if_absent(conn, name, spec)
            coll = cls._open(conn, name)
        except BaseException:
            ClientPool.release(conn)
            raise
        return require_spec(coll, spec)

    @classmethod
    def open(cls, uri: str, name: str, *, token: str | None = None) -> "MilvusCollection":
        """Open an existing collection (:class:`CollectionNotFoundError` if absent)."""
        check_name(name)
        conn = ClientPool.acquire(uri, token)
        try:
            return cls._open(conn, name)
        except BaseException:
            ClientPool.release(conn)
            raise

    @classmethod
    def open_or_create(cls, uri: str, name: str, spec: CollectionSpec, *,
                       token: str | None = None) -> "MilvusCollection":
        return cls.create(uri, name, spec, token=token)

    @classmethod
    def _open(cls, conn: Connection, name: str) -> "MilvusCollection":
        manifest = read_manifest(conn, name)
        coll = cls(conn, name, manifest)
        coll._rpc(f"loading collection {name!r}", "load_collection")
        return coll

    def __init__(self, conn: Connection, name: str, manifest: dict[str, Any]) -> None:
        super().__init__()
        self.name = name
        self.uri = conn.uri
        self.spec = CollectionSpec.from_dict(manifest)
        self._conn = conn
        self._token = conn.token
        self._mname = milvus_name(name)
        self._manifest = manifest
        self._wlock = ClientPool.write_lock(conn, self._mname)
        self._multi = self.spec.kind == "multi"
        self._search_base = milvus_index(vector_factory(self.spec))[2]
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

    def _rpc(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``client.<method>(<this collection>, ...)`` with embedpool errors. A collection that a
        restarted Milvus has released is loaded again and the call retried once."""
        from pymilvus.exceptions import MilvusException

        with self._conn.errors(what):
            call = getattr(self._client, method)
            try:
                return call(self._mname, *args, **kwargs)
            except MilvusException as e:
                if method == "load_collection" or not not_loaded(e):
                    raise
            log.warning("collection %r was released by Milvus (restarted?): loading it again", self.name)
            self._client.load_collection(self._mname)
            return getattr(self._client, method)(self._mname, *args, **kwargs)

    # ---- writes -------------------------------------------------------------------------------
    def add(self, ids: Sequence[str], vectors: Any, texts: Sequence[str | None] | None = None,
            metadata: Sequence[dict | None] | None = None, *, model: str | None = None,
            pooler: str | None = None) -> None:
        """Insert or replace documents (see :meth:`CollectionBase.add`). The batch is
        validated first; on a validation error nothing changes. Applied to Milvus at once."""
        ids, vecs, texts_, metas = self._check_add(ids, vectors, texts, metadata, model, pooler)
        if not ids:
            return
        _check_sizes(ids, texts_)
        meta = [None if m is None else json.loads(m) for m in metas]
        seq = InsertionClock.take(len(ids))
        with self._wlock:
            self._check_open()
            if self._multi:
                rows, stale = self._multi_rows(ids, vecs, texts_, meta, seq)
            else:
                rows = [{"id": i, "seq": seq + j, "vector": vecs[j], "text": t, "metadata": m}
                        for j, (i, t, m) in enumerate(zip(ids, texts_, meta))]
                stale = []
            # rows replace the rows of the same (document, position); a document with fewer
            # vectors than before then loses its surplus rows (readers take n from row 0)
            for b in _batches(rows, _BATCH_BYTES // (4 * self.spec.dim + 64)):
                self._rpc(f"upsert into {self.name!r}", "upsert", b)
            self._delete_rows(stale)

    def _multi_rows(self, ids: list[str], vecs: list[np.ndarray], texts: list[str | None],
                    meta: list[Any], seq: int) -> tuple[list[dict], list[str]]:
        """The rows of multi-vector documents, and the surplus rows of their old versions."""
        old_n = {d: r["n"] for d, r in self._heads(ids, ["n"]).items()}
        rows, stale = [], []
        for j, (i, d, t, m) in enumerate(zip(ids, vecs, texts, meta)):
            stored = dequantize(*quantize(d, self.spec.precision))  # what FAISS would score
            rows.extend({"pk": pk(i, p), "doc_id": i, "pos": p, "n": len(stored), "seq": seq + j,
                         "vector": v, "text": t if p == 0 else None,
                         "metadata": m if p == 0 else None} for p, v in enumerate(stored))
            stale.extend(pk(i, p) for p in range(len(stored), old_n.get(i, 0)))
        return rows, stale

    def _delete_rows(self, pks: list[str]) -> None:
        for b in _batches(pks, _DELETE_ROWS):
            self._rpc(f"delete from {self.name!r}", "delete", ids=b)

    def delete(self, ids: Sequence[str]) -> None:
        """Delete documents by id. Any unknown id: :class:`DocumentNotFoundError`, nothing deleted."""
        ids = self._check_delete(ids)
        if not ids:
            return
        with self._wlock:
            self._refuse_unknown(ids, self._existing(ids))
            self._delete_rows(ids if not self._multi else
                              [pk(d, p) for d, r in self._heads(ids, ["n"]).items() for p in range(r["n"])])

    def commit(self) -> None:
        """Flush Milvus segments, then store the staged properties and the manifest's time
        (writes are already durable in Milvus' WAL when ``add``/``delete`` return)."""
        with self._wlock:
            self._check_open()
            m = {**self._manifest, "updated": now_iso()}  # counts are live in Milvus
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
            self._client.compact(self._mname)
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
            raise CollectionNotFoundError(f"collection {self.name!r} was dropped from Milvus at {self.uri}")
        return False

    def close(self) -> None:
        """Release the connection (the last one to a Milvus Lite file stops its engine)."""
        if self._closed:
            return
        if self._props:
            log.warning("collection %r closed with uncommitted properties; they are discarded", self.name)
        self._closed = True
        self._close_companion()
        ClientPool.release(self._conn)

    def __repr__(self) -> str:
        return f"MilvusCollection({self.uri!r}, {self.name!r}, kind={self.spec.kind!r})"

    # ---- search hooks ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError(f"collection {self.name!r} is closed")

    def _ann(self, x: np.ndarray, k: int, output_fields: list[str]) -> list[list[dict]]:
        limit = min(k, MAX_TOPK)
        return self._rpc(f"search of {self.name!r}", "search", data=list(x), limit=limit,
                         anns_field="vector", output_fields=output_fields,
                         search_params={"metric_type": metric(self.spec),
                                        "params": search_params(self._search_base, limit)})

    def _search_single(self, x: np.ndarray, k: int) -> list[list[Hit]]:
        if not len(x):
            return []
        res = self._ann(x, k, ["text", "metadata"])
        return [[Hit(h["id"], float(h["distance"]), h["entity"].get("text"), h["entity"].get("metadata"))
                 for h in row] for row in res]

    def _candidate_ids(self, x: np.ndarray, k: int) -> list[list[str]]:
        if not len(x):
            return []
        return [[h["id"] for h in row] for row in self._ann(x, k, [])]

    def _search_exhaustive(self, qs: list[np.ndarray], k: int) -> list[list[Hit]]:
        vectors, offsets, doc_ids = self._fetch_tokens(None)
        scores = maxsim_scores(qs, vectors, offsets)
        return self._hits([topk(s, doc_ids, k) for s in scores])

    def _search_tokens(self, qs: list[np.ndarray], k: int, k_token: int) -> list[list[Hit]]:
        res = self._ann(np.concatenate(qs), k_token, ["doc_id"])
        cands, start = [], 0
        for q in qs:
            cands.append(list(dict.fromkeys(h["entity"]["doc_id"] for row in res[start:start + len(q)]
                                            for h in row)))
            start += len(q)
        return self._rerank(qs, cands, k)

    def _rerank(self, qs: list[np.ndarray], ext_lists: list[list[str]], k: int) -> list[list[Hit]]:
        union = sorted({e for lst in ext_lists for e in lst})
        vectors, offsets, doc_ids = self._fetch_tokens(union)
        where = {d: j for j, d in enumerate(doc_ids.tolist())}
        out = []
        for q, lst in zip(qs, ext_lists):
            idx = np.array([where[e] for e in dict.fromkeys(lst) if e in where], dtype=np.int64)
            s = maxsim_scores([q], vectors, offsets, doc_idx=idx)[0]
            out.append(topk(s, doc_ids[idx], k))
        return self._hits(out)

    def _open_sibling(self, name: str) -> "MilvusCollection":
        return MilvusCollection.open(self.uri, name, token=self._token)

    # ---- reads ----------------------------------------------------------------------------------
    def _fetch_tokens(self, doc_ids: list[str] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Token vectors of ``doc_ids`` (all documents if ``None``), contiguous per document:
        ``(vectors [T, dim], offsets [n + 1], doc ids [n])``. Candidates are fetched by primary
        key (``<doc id>#<pos>``, ``n`` from row 0), which costs what it returns, not a scan."""
        self._check_open()
        if doc_ids is None:
            rows = self._scan("", ["doc_id", "pos", "vector"])
        else:
            pks = [pk(d, p) for d, r in self._heads(doc_ids, ["n"]).items() for p in range(r["n"])]
            rows = self._get(pks, ["doc_id", "pos", "vector"])
        if not rows:
            return (np.zeros((0, self.spec.dim), np.float32), np.zeros(1, np.int64),
                    np.array([], dtype=object))
        rows.sort(key=lambda r: (r["doc_id"], r["pos"]))
        names = [r["doc_id"] for r in rows]
        vectors = np.asarray([r["vector"] for r in rows], dtype=np.float32)
        starts = [0] + [j for j in range(1, len(names)) if names[j] != names[j - 1]]
        offsets = np.array(starts + [len(names)], dtype=np.int64)
        return vectors, offsets, np.array([names[j] for j in starts], dtype=object)

    def _scan(self, flt: str, fields: list[str]) -> list[dict]:
        """Every row matching ``flt`` (all rows if empty), page by page: a query iterator on a
        Milvus server; on Milvus Lite (which lacks the iterator's timestamp RPC) queries with
        ``pk > last`` in primary-key order."""
        if not is_lite(self.uri):
            it = self._rpc(f"query of {self.name!r}", "query_iterator", batch_size=4096, filter=flt,
                           output_fields=fields)
            rows: list[dict] = []
            with self._conn.errors(f"query of {self.name!r}"):
                try:
                    while batch := it.next():
                        rows.extend(_rows(batch))
                finally:
                    it.close()
            return rows
        key = "pk" if self._multi else "id"
        page = max(256, _SCAN_BYTES // ((4 * self.spec.dim if "vector" in fields else 0) + 256))
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

    def _hits(self, results: list[list[tuple[float, str]]]) -> list[list[Hit]]:
        """Attach text and metadata to (score, id) results."""
        docs = self._docs(sorted({i for r in results for _, i in r}))
        return [[Hit(i, s, *docs[i]) for s, i in r if i in docs] for r in results]

    def _docs(self, ids: list[str]) -> dict[str, tuple[str | None, dict | None]]:
        """id -> (text, metadata) of the documents that exist (primary-key lookups)."""
        if self._multi:
            return {d: (r.get("text"), r.get("metadata"))
                    for d, r in self._heads(ids, ["text", "metadata"]).items()}
        return {r["id"]: (r.get("text"), r.get("metadata"))
                for r in self._get(ids, ["id", "text", "metadata"])}

    def _existing(self, ids: list[str]) -> set[str]:
        return set(self._docs(ids))

    def _get(self, pks: list[str], fields: list[str]) -> list[dict]:
        """Rows by primary key (``pk in [...]``: Milvus' point lookup), a page of keys per
        call. Not ``client.get``: it does not escape backslashes in string keys."""
        key = "pk" if self._multi else "id"
        rows: list[dict] = []
        for b in _batches(pks, _FETCH_ROWS):
            rows.extend(_rows(self._rpc(f"query of {self.name!r}", "query", output_fields=fields,
                                        filter=f"{key} in [{', '.join(map(quote, b))}]")))
        return rows

    def _heads(self, doc_ids: list[str], fields: list[str]) -> dict[str, dict]:
        """multi: doc id -> its row 0 (``fields`` of it), for the documents that exist."""
        return {r["doc_id"]: r for r in self._get([pk(d, 0) for d in doc_ids], ["doc_id", *fields])}

    def get(self, id: str) -> dict[str, Any]:
        """``{id, text, metadata, vector}`` (single) or ``{id, text, metadata, vectors}`` (multi)."""
        self._check_open()
        docs = self._docs([id]) if isinstance(id, str) and id else {}
        if id not in docs:
            raise DocumentNotFoundError(f"no document {id!r} in collection {self.name!r}")
        out: dict[str, Any] = {"id": id, "text": docs[id][0], "metadata": docs[id][1]}
        if self._multi:
            out["vectors"] = self._fetch_tokens([id])[0]
        else:
            out["vector"] = np.asarray(self._get([id], ["vector"])[0]["vector"], dtype=np.float32)
        return out

    def ids(self) -> list[str]:
        """All document ids, in insertion order."""
        self._check_open()
        field = "doc_id" if self._multi else "id"
        rows = self._scan("pos == 0" if self._multi else "", [field, "seq"])
        rows.sort(key=lambda r: (r["seq"], r[field]))
        return [r[field] for r in rows]

    def _count(self, flt: str) -> int:
        res = self._rpc(f"count of {self.name!r}", "query", filter=flt, output_fields=["count(*)"])
        return int(res[0]["count(*)"]) if res else 0

    def _counts(self) -> dict[str, int]:
        if self._multi:
            return {"documents": self._count("pos == 0"), "vectors": self._count("")}
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
        """See :class:`index.base.Stats`: bytes_per_doc is the float32 vector storage per
        document in Milvus (index overhead not included); bytes_on_disk is unknown (``None``);
        tombstones always 0 (Milvus compacts by itself)."""
        self._check_open()
        c = self._counts()
        per_doc = 4 * self.spec.dim * c["vectors"] / c["documents"] if c["documents"] else 0.0
        return make_stats(documents=c["documents"], vectors=c["vectors"], bytes_on_disk=None,
                          bytes_per_doc=per_doc, tombstones=0, segments=None, token_index=self._multi,
                          index_type=milvus_index(vector_factory(self.spec))[0], backend=self.backend,
                          location=f"Milvus at {self.uri}")


def _check_sizes(ids: list[str], texts: list[str | None]) -> None:
    """Milvus' field limits on ids and texts (checked before anything is written)."""
    for i in ids:
        if len(i.encode()) > MAX_ID_BYTES:
            raise InvalidInputError(f"id {i[:40]!r}... is longer than {MAX_ID_BYTES} bytes")
    for i, t in zip(ids, texts):
        if t is not None and len(t.encode()) > MAX_TEXT_BYTES:
            raise InvalidInputError(
                f"text of id {i!r} is {len(t.encode())} bytes; Milvus stores at most "
                f"{MAX_TEXT_BYTES} bytes of text per document")


def _create_if_absent(conn: Connection, name: str, spec: CollectionSpec) -> None:
    mname = milvus_name(name)
    with ClientPool.write_lock(conn, mname), conn.errors(f"creating collection {name!r}"):
        client = conn.client()
        if client.has_collection(mname):
            return
        manifest = new_manifest(name, spec, now_iso(), backend="milvus")
        sch, index_params = schema(client, spec)
        client.create_collection(mname, schema=sch, consistency_level="Strong",
                                 properties={MANIFEST_KEY: json.dumps(manifest)})
        # Milvus Lite builds indexes at once and lacks the timestamp RPC that pymilvus' wait
        # for index completion uses: do not wait there
        client.create_index(mname, index_params, sync=not is_lite(conn.uri))
