"""Milvus backend: the same collection API as the FAISS folders, stored in Milvus.

``uri`` is a Milvus Lite database (a local path ending in ``.db``: pymilvus runs the embedded
engine inside this process) or a Milvus server (``http://host:19530``, optional ``token``).

Layout, per embedpool collection ``NAME`` (Milvus collection ``embedpool_<NAME encoded>``):

* single: one row per document -- ``id`` (VARCHAR primary key = external id), ``seq`` (insertion
  order), ``vector``, ``text`` (nullable), ``metadata`` (nullable JSON). The vector index is
  mapped from the spec's FAISS factory string (:func:`milvus_index`: Flat -> FLAT,
  HNSW<M> -> HNSW, IVF<n>,Flat -> IVF_FLAT, IVF<n>,SQ8 -> IVF_SQ8, IVF<n>,PQ<m> -> IVF_PQ).
* multi: one row per stored vector -- ``pk`` (``<doc id>#<pos>``), ``doc_id``, ``pos``, ``n``
  (the document's vector count), ``seq``, ``vector``; ``text`` and ``metadata`` on row 0.
  Token vectors are indexed with the spec's ``token_factory``. Candidates come from Milvus
  (``tokens``: ANN over the token rows; ``two_stage``: any single-vector collection), then
  embedpool fetches the candidates' vectors by primary key and reranks them by exact MaxSim
  (:func:`index.maxsim.maxsim_scores`). ``exhaustive`` reads every row (small collections).
  ``float16``/``int8`` precisions store the dequantized values as float32 (Milvus Lite has no
  half/int8 vector fields), so rankings equal the FAISS backend's for the same spec.

The manifest is the collection property ``embedpool.manifest`` and travels with the collection;
opening with a different spec is refused exactly as for FAISS folders.

Durability: every write is applied to Milvus at once (Milvus' own WAL makes it durable);
:meth:`MilvusCollection.commit` flushes segments and updates the manifest. Milvus has no
multi-row transactions: replacing a multi-vector document upserts its rows position by position,
then deletes surplus rows of a longer old version. A crash in the middle can leave a document
with a mix of old and new rows (row 0, read first, is always the new one); a search during the
upsert may see that mix too. Add the document again to repair it.

Milvus Lite allows one process per ``.db`` (it holds a file lock); to share an index between
processes or API replicas, run a Milvus server and pass its URI.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._util import now_iso
from .base import CollectionBase, Hit, check_spec_matches
from .errors import (
    BackendError,
    CollectionLockedError,
    CollectionNotFoundError,
    DocumentNotFoundError,
    InvalidInputError,
    NotACollectionError,
)
from .maxsim import dequantize, maxsim_scores, quantize
from .single import HNSW_EF_SEARCH, default_nprobe
from .spec import CollectionSpec, check_name, new_manifest, parse_manifest
from .validate import topk

log = logging.getLogger("embedpool.index")

MANIFEST_KEY = "embedpool.manifest"
PREFIX = "embedpool_"
MAX_ID_BYTES = 512
MAX_TEXT_BYTES = 65_535
MAX_TOPK = 16_384  # Milvus' limit on limit/topk
HNSW_EF_CONSTRUCTION = 40  # FAISS' default, so both backends build the same graph quality
_BATCH_BYTES = 8 << 20  # rows per insert/upsert call: ~8 MB of vectors
_FETCH_ROWS = 4096  # rows per get() by primary key
_SCAN_BYTES = 64 << 20  # Milvus Lite: bytes per page of a full scan (its gRPC limit is 256 MB)


# ---- FAISS factory string -> Milvus index ------------------------------------------------------
def milvus_index(factory: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(index_type, build params, search params)`` of the Milvus index equivalent to a FAISS
    factory string, with the FAISS backend's defaults (HNSW efSearch 64, IVF nprobe)."""
    desc = ",".join(p for p in factory.replace(" ", "").split(",") if p not in ("", "IDMap", "IDMap2"))
    if desc in ("Flat", ""):
        return "FLAT", {}, {}
    m = re.fullmatch(r"HNSW(\d*)(?:_Flat|,Flat)?", desc)
    if m:
        return ("HNSW", {"M": int(m.group(1) or 32), "efConstruction": HNSW_EF_CONSTRUCTION},
                {"ef": HNSW_EF_SEARCH})
    m = re.fullmatch(r"HNSW(\d*)_SQ8", desc)
    if m:
        return ("HNSW_SQ", {"M": int(m.group(1) or 32), "efConstruction": HNSW_EF_CONSTRUCTION,
                            "sq_type": "SQ8"}, {"ef": HNSW_EF_SEARCH})
    m = re.fullmatch(r"IVF(\d+),(Flat|SQ8|PQ(\d+)(?:x(\d+))?(?:np)?)", desc)
    if m:
        nlist = int(m.group(1))
        search = {"nprobe": default_nprobe(nlist)}
        if m.group(2) == "Flat":
            return "IVF_FLAT", {"nlist": nlist}, search
        if m.group(2) == "SQ8":
            return "IVF_SQ8", {"nlist": nlist}, search
        return "IVF_PQ", {"nlist": nlist, "m": int(m.group(3)), "nbits": int(m.group(4) or 8)}, search
    raise InvalidInputError(
        f"factory {factory!r} has no Milvus equivalent; with backend='milvus' use 'Flat' "
        "('IDMap2,Flat'), 'HNSW<M>', 'HNSW<M>_SQ8', 'IVF<n>,Flat', 'IVF<n>,SQ8' or 'IVF<n>,PQ<m>'")


def _metric(spec: CollectionSpec) -> str:
    return "IP" if spec.metric == "ip" else "L2"


def _search_params(base: dict[str, Any], k: int) -> dict[str, Any]:
    params = dict(base)
    if "ef" in params:
        params["ef"] = max(params["ef"], k)  # Milvus requires ef >= limit (FAISS raises it too)
    return params


# ---- names ---------------------------------------------------------------------------------------
_ENC = {"_": "_0", "-": "_1", ".": "_2"}
_DEC = {v[1]: k for k, v in _ENC.items()}


def milvus_name(name: str) -> str:
    """Milvus collection name of an embedpool collection (Milvus allows only ``[A-Za-z0-9_]``)."""
    check_name(name)
    out = PREFIX + "".join(_ENC.get(c, c) for c in name)
    if len(out) > 255:
        raise InvalidInputError(f"collection name {name!r} is too long for Milvus")
    return out


def embedpool_name(mname: str) -> str | None:
    """Inverse of :func:`milvus_name`; ``None`` for collections embedpool did not create."""
    if not mname.startswith(PREFIX):
        return None
    out, s, i = [], mname[len(PREFIX):], 0
    while i < len(s):
        if s[i] == "_":
            if i + 1 >= len(s) or s[i + 1] not in _DEC:
                return None
            out.append(_DEC[s[i + 1]])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out) or None


def _quote(s: str) -> str:
    """A Milvus filter string literal."""
    for a, b in (("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t")):
        s = s.replace(a, b)
    return f'"{s}"'


def _pk(doc_id: str, pos: int) -> str:
    """Primary key of vector ``pos`` of a multi-vector document."""
    return f"{doc_id}#{pos}"


# ---- clients -------------------------------------------------------------------------------------
def _is_lite(uri: str) -> bool:
    return uri.endswith(".db") and "://" not in uri


class _Clients:
    """One ``MilvusClient`` per (uri, token) shared by the collections of this process; the last
    collection to close it also stops the embedded Milvus Lite server of a ``.db`` URI."""

    _lock = threading.Lock()
    _pool: dict[tuple[str, str], list] = {}  # key -> [client, refs]
    _write_locks: dict[tuple[str, str], threading.Lock] = {}

    @classmethod
    def acquire(cls, uri: str, token: str | None) -> tuple[tuple[str, str], Any]:
        if _is_lite(uri):
            path = Path(uri).expanduser().resolve()
            path.parent.mkdir(parents=True, exist_ok=True)
            uri = str(path)
        key = (uri, token or "")
        with cls._lock:
            entry = cls._pool.get(key)
            if entry is None:
                entry = cls._pool[key] = [_connect(uri, token), 0]
            entry[1] += 1
            return key, entry[0]

    @classmethod
    def release(cls, key: tuple[str, str]) -> None:
        with cls._lock:
            entry = cls._pool.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del cls._pool[key]
        with contextlib.suppress(Exception):
            entry[0].close()
        if _is_lite(key[0]):
            # pymilvus started Milvus Lite for this file in this process; stop it now rather than
            # at exit, so the file lock is released (we use the module pymilvus loaded).
            mgr = sys.modules.get("milvus_lite.server_manager")
            if mgr is not None:
                with contextlib.suppress(Exception):
                    mgr.server_manager_instance.release_server(key[0])

    @classmethod
    def write_lock(cls, uri_key: tuple[str, str], mname: str) -> threading.Lock:
        with cls._lock:
            return cls._write_locks.setdefault((uri_key[0], mname), threading.Lock())


def _connect(uri: str, token: str | None):
    from pymilvus import MilvusClient
    from pymilvus.exceptions import MilvusException

    try:
        return MilvusClient(uri=uri, token=token or "")
    except MilvusException as e:
        if _is_lite(uri):
            raise CollectionLockedError(
                f"cannot open Milvus Lite database {uri}: {e.message}. Milvus Lite allows one "
                "process per .db file; stop the other process, or run a Milvus server and use "
                "its http:// URI") from None
        raise BackendError(f"cannot connect to Milvus at {uri}: {e.message}") from None


@contextlib.contextmanager
def _errors(what: str) -> Iterator[None]:
    """Milvus errors as :class:`BackendError` (unavailable: the HTTP API answers 503)."""
    from pymilvus.exceptions import MilvusException

    try:
        yield
    except MilvusException as e:
        raise BackendError(f"Milvus {what} failed: {e.message or e}") from None


def _rows(result: Any) -> list[dict]:
    """A plain list of the rows of a pymilvus result. Its lists materialize rows lazily by
    position: sorting one in place would pair fields of different rows."""
    return [r for r in result]


def _batches(rows: list[dict], row_bytes: int) -> Iterator[list[dict]]:
    step = max(1, _BATCH_BYTES // max(row_bytes, 1))
    for i in range(0, len(rows), step):
        yield rows[i:i + step]


class _Seq:
    """Process-wide increasing insertion stamps (microseconds; ordered across processes too,
    as far as their clocks agree)."""

    _lock = threading.Lock()
    _last = 0

    @classmethod
    def take(cls, n: int) -> int:
        with cls._lock:
            start = max(cls._last + 1, time.time_ns() // 1000)
            cls._last = start + n - 1
            return start


# ---- the collection ------------------------------------------------------------------------------
class MilvusCollection(CollectionBase):
    """A single- or multi-vector collection stored in Milvus. Use :meth:`create` / :meth:`open`
    (or :func:`index.open_collection` with ``backend="milvus"``)."""

    backend = "milvus"

    @classmethod
    def create(cls, uri: str, name: str, spec: CollectionSpec, *,
               token: str | None = None) -> "MilvusCollection":
        """Create collection ``name``; if it exists with an equal spec, open it; if with a
        different spec, raise :class:`SpecMismatchError` naming the differing fields."""
        check_name(name)
        if not isinstance(spec, CollectionSpec):
            raise InvalidInputError("spec must be a CollectionSpec")
        spec.validate()
        milvus_index(spec.factory if spec.kind == "single" else spec.token_factory)
        key, client = _Clients.acquire(uri, token)
        try:
            mname = milvus_name(name)
            with _Clients.write_lock(key, mname), _errors(f"creating collection {name!r}"):
                if not client.has_collection(mname):
                    manifest = new_manifest(name, spec, now_iso(), backend="milvus")
                    schema, index_params = _schema(client, spec)
                    client.create_collection(
                        mname, schema=schema, consistency_level="Strong",
                        properties={MANIFEST_KEY: json.dumps(manifest)})
                    # Milvus Lite builds indexes at once and lacks the timestamp RPC that
                    # pymilvus' wait for index completion uses: do not wait there
                    client.create_index(mname, index_params, sync=not _is_lite(key[0]))
            coll = cls._open(key, client, name)
        except BaseException:
            _Clients.release(key)
            raise
        try:
            check_spec_matches(coll.spec, spec, name)
        except BaseException:
            coll.close()
            raise
        return coll

    @classmethod
    def open(cls, uri: str, name: str, *, token: str | None = None) -> "MilvusCollection":
        """Open an existing collection (:class:`CollectionNotFoundError` if absent)."""
        check_name(name)
        key, client = _Clients.acquire(uri, token)
        try:
            return cls._open(key, client, name)
        except BaseException:
            _Clients.release(key)
            raise

    @classmethod
    def open_or_create(cls, uri: str, name: str, spec: CollectionSpec, *,
                       token: str | None = None) -> "MilvusCollection":
        return cls.create(uri, name, spec, token=token)

    @classmethod
    def _open(cls, key: tuple[str, str], client: Any, name: str) -> "MilvusCollection":
        mname = milvus_name(name)
        with _errors(f"opening collection {name!r}"):
            if not client.has_collection(mname):
                have = sorted(n for n in map(embedpool_name, client.list_collections()) if n)
                raise CollectionNotFoundError(
                    f"no collection {name!r} in Milvus at {key[0]}"
                    + (f" (collections there: {', '.join(have)})" if have else " (it holds no collections)"))
            props = client.describe_collection(mname).get("properties") or {}
        if MANIFEST_KEY not in props:
            raise NotACollectionError(
                f"Milvus collection {mname!r} at {key[0]} has no embedpool manifest; it was not "
                "created by embedpool")
        manifest = parse_manifest(props[MANIFEST_KEY], f"manifest of Milvus collection {mname!r}")
        with _errors(f"loading collection {name!r}"):
            client.load_collection(mname)
        return cls(key, client, name, manifest)

    def __init__(self, key: tuple[str, str], client: Any, name: str, manifest: dict[str, Any]) -> None:
        super().__init__()
        self.name = name
        self.uri = key[0]
        self.spec = CollectionSpec.from_dict(manifest)
        self._key = key
        self._token = key[1] or None
        self._client = client
        self._mname = milvus_name(name)
        self._manifest = manifest
        self._wlock = _Clients.write_lock(key, self._mname)
        self._multi = self.spec.kind == "multi"
        factory = self.spec.token_factory if self._multi else self.spec.factory
        self._search_base = milvus_index(factory)[2]
        self._closed = False

    # ---- writes -------------------------------------------------------------------------------
    def add(self, ids: Sequence[str], vectors: Any, texts: Sequence[str | None] | None = None,
            metadata: Sequence[dict | None] | None = None, *, model: str | None = None,
            pooler: str | None = None) -> None:
        """Insert or replace documents (see :meth:`index.Collection.add`). The batch is
        validated first; on a validation error nothing changes. Applied to Milvus at once."""
        ids, vecs, texts_, metas = self._check_add(ids, vectors, texts, metadata, model, pooler)
        if not ids:
            return
        for i in ids:
            if len(i.encode()) > MAX_ID_BYTES:
                raise InvalidInputError(f"id {i[:40]!r}... is longer than {MAX_ID_BYTES} bytes")
        for i, t in zip(ids, texts_):
            if t is not None and len(t.encode()) > MAX_TEXT_BYTES:
                raise InvalidInputError(
                    f"text of id {i!r} is {len(t.encode())} bytes; Milvus stores at most "
                    f"{MAX_TEXT_BYTES} bytes of text per document")
        meta = [None if m is None else json.loads(m) for m in metas]
        seq = _Seq.take(len(ids))
        row_bytes = 4 * self.spec.dim + 64
        with self._wlock:
            self._check_open()
            if not self._multi:
                rows = [{"id": i, "seq": seq + j, "vector": vecs[j], "text": t, "metadata": m}
                        for j, (i, t, m) in enumerate(zip(ids, texts_, meta))]
                with _errors(f"upsert into {self.name!r}"):
                    for b in _batches(rows, row_bytes):
                        self._client.upsert(self._mname, b)
                return
            old_n = {d: r["n"] for d, r in self._heads(ids, ["n"]).items()}
            rows, stale = [], []
            for j, (i, d, t, m) in enumerate(zip(ids, vecs, texts_, meta)):
                stored = dequantize(*quantize(d, self.spec.precision))  # what FAISS would score
                rows.extend({"pk": _pk(i, p), "doc_id": i, "pos": p, "n": len(stored), "seq": seq + j,
                             "vector": v, "text": t if p == 0 else None,
                             "metadata": m if p == 0 else None} for p, v in enumerate(stored))
                stale.extend(_pk(i, p) for p in range(len(stored), old_n.get(i, 0)))
            with _errors(f"upsert into {self.name!r}"):
                # rows replace the rows of the same (document, position); a document with fewer
                # vectors than before then loses its surplus rows (readers take n from row 0)
                for b in _batches(rows, row_bytes):
                    self._client.upsert(self._mname, b)
                for s in range(0, len(stale), 16_384):
                    self._client.delete(self._mname, ids=stale[s:s + 16_384])

    def delete(self, ids: Sequence[str]) -> None:
        """Delete documents by id. Any unknown id: :class:`DocumentNotFoundError`, nothing deleted."""
        ids = self._check_delete(ids)
        if not ids:
            return
        with self._wlock:
            self._refuse_unknown(ids, self._existing(ids))
            pks = ids if not self._multi else \
                [_pk(d, p) for d, r in self._heads(ids, ["n"]).items() for p in range(r["n"])]
            with _errors(f"delete from {self.name!r}"):
                for s in range(0, len(pks), 16_384):
                    self._client.delete(self._mname, ids=pks[s:s + 16_384])

    def commit(self) -> None:
        """Flush Milvus segments and record the time in the manifest property (writes are
        already durable in Milvus' WAL when ``add``/``delete`` return)."""
        with self._wlock:
            self._check_open()
            m = {**self._manifest, "updated": now_iso()}  # counts are live in Milvus
            with _errors(f"flush of {self.name!r}"):
                self._client.flush(self._mname)
                self._client.alter_collection_properties(
                    self._mname, properties={MANIFEST_KEY: json.dumps(m)})
            self._manifest = m

    def get_property(self, key: str) -> str | None:
        """A string stored with the collection (a Milvus collection property), or ``None``: state
        that must live and die with the collection, such as the batch indexing job's."""
        self._check_open()
        with _errors(f"reading properties of {self.name!r}"):
            props = self._client.describe_collection(self._mname).get("properties") or {}
        return props.get(key)

    def set_property(self, key: str, value: str) -> None:
        """Store ``value`` under ``key`` with the collection (not the manifest's key)."""
        if key == MANIFEST_KEY or not isinstance(key, str) or not key:
            raise InvalidInputError(f"property key {key!r} is reserved or empty")
        if not isinstance(value, str):
            raise InvalidInputError("property values are strings")
        with self._wlock:
            self._check_open()
            with _errors(f"writing properties of {self.name!r}"):
                self._client.alter_collection_properties(self._mname, properties={key: value})

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
        self._check_open()
        if not self._multi:
            raise InvalidInputError("build_token_index applies to multi-vector collections only")

    def refresh(self) -> bool:
        """Milvus reads are always current (strong consistency): nothing to reload."""
        self._check_open()
        return False

    def close(self) -> None:
        """Release the connection (the last one to a Milvus Lite file stops its engine)."""
        if self._closed:
            return
        self._closed = True
        self._close_companion()
        _Clients.release(self._key)

    def __repr__(self) -> str:
        return f"MilvusCollection({self.uri!r}, {self.name!r}, kind={self.spec.kind!r})"

    # ---- search hooks ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError(f"collection {self.name!r} is closed")

    def _ann(self, x: np.ndarray, k: int, output_fields: list[str]) -> list[list[dict]]:
        limit = min(k, MAX_TOPK)
        with _errors(f"search of {self.name!r}"):
            return self._client.search(
                self._mname, data=list(x), limit=limit, anns_field="vector",
                search_params={"metric_type": _metric(self.spec),
                               "params": _search_params(self._search_base, limit)},
                output_fields=output_fields)

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
            rows = []
            pks = [_pk(d, p) for d, r in self._heads(doc_ids, ["n"]).items() for p in range(r["n"])]
            with _errors(f"fetching vectors of {self.name!r}"):
                for s in range(0, len(pks), _FETCH_ROWS):
                    rows.extend(self._get(pks[s:s + _FETCH_ROWS], ["doc_id", "pos", "vector"]))
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
        with _errors(f"query of {self.name!r}"):
            rows: list[dict] = []
            if _is_lite(self.uri):  # keyset pages in primary-key order
                pk = "pk" if self._multi else "id"
                page = max(256, _SCAN_BYTES // ((4 * self.spec.dim if "vector" in fields else 0) + 256))
                last = None
                while True:
                    cond = " and ".join(c for c in (flt and f"({flt})",
                                                     last is not None and f"{pk} > {_quote(last)}") if c)
                    batch = _rows(self._client.query(
                        self._mname, filter=cond or f'{pk} != ""', output_fields=[*fields, pk],
                        limit=page, iterator="True"))
                    rows.extend(batch)
                    if len(batch) < page:
                        return rows
                    last = max(r[pk] for r in batch)
            it = self._client.query_iterator(self._mname, batch_size=4096, filter=flt,
                                             output_fields=fields)
            try:
                while batch := it.next():
                    rows.extend(_rows(batch))
            finally:
                it.close()
            return rows

    def _hits(self, results: list[list[tuple[float, str]]]) -> list[list[Hit]]:
        """Attach text and metadata to (score, id) results."""
        docs = self._docs(sorted({i for r in results for _, i in r}))
        return [[Hit(i, s, *docs[i]) for s, i in r if i in docs] for r in results]

    def _docs(self, ids: list[str]) -> dict[str, tuple[str | None, dict | None]]:
        """id -> (text, metadata) of the documents that exist (primary-key lookups)."""
        if self._multi:
            return {d: (r.get("text"), r.get("metadata"))
                    for d, r in self._heads(ids, ["text", "metadata"]).items()}
        out: dict[str, tuple[str | None, dict | None]] = {}
        with _errors(f"query of {self.name!r}"):
            for s in range(0, len(ids), _FETCH_ROWS):
                for r in self._get(ids[s:s + _FETCH_ROWS], ["id", "text", "metadata"]):
                    out[r["id"]] = (r.get("text"), r.get("metadata"))
        return out

    def _existing(self, ids: list[str]) -> set[str]:
        return set(self._docs(ids))

    def _get(self, pks: list[str], fields: list[str]) -> list[dict]:
        """Rows by primary key (``pk in [...]``: Milvus' point lookup). Not ``client.get``: it
        does not escape backslashes in string keys."""
        pk = "pk" if self._multi else "id"
        flt = f"{pk} in [{', '.join(map(_quote, pks))}]"
        return _rows(self._client.query(self._mname, filter=flt, output_fields=fields))

    def _heads(self, doc_ids: list[str], fields: list[str]) -> dict[str, dict]:
        """multi: doc id -> its row 0 (``fields`` of it), for the documents that exist."""
        out: dict[str, dict] = {}
        with _errors(f"query of {self.name!r}"):
            for s in range(0, len(doc_ids), _FETCH_ROWS):
                for r in self._get([_pk(d, 0) for d in doc_ids[s:s + _FETCH_ROWS]], ["doc_id", *fields]):
                    out[r["doc_id"]] = r
        return out

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
            with _errors(f"query of {self.name!r}"):
                row = self._get([id], ["vector"])[0]
            out["vector"] = np.asarray(row["vector"], dtype=np.float32)
        return out

    def ids(self) -> list[str]:
        """All document ids, in insertion order."""
        self._check_open()
        field = "doc_id" if self._multi else "id"
        rows = self._scan("pos == 0" if self._multi else "", [field, "seq"])
        rows.sort(key=lambda r: (r["seq"], r[field]))
        return [r[field] for r in rows]

    def _count(self, flt: str) -> int:
        with _errors(f"count of {self.name!r}"):
            res = self._client.query(self._mname, filter=flt, output_fields=["count(*)"])
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
        """documents, vectors, bytes_per_doc (float32 vector storage per document in Milvus;
        index overhead not included), tombstones (always 0: Milvus compacts by itself)."""
        self._check_open()
        c = self._counts()
        per_doc = 4 * self.spec.dim * c["vectors"] / c["documents"] if c["documents"] else 0.0
        return {"documents": c["documents"], "vectors": c["vectors"], "bytes_on_disk": None,
                "bytes_per_doc": per_doc, "tombstones": 0, "backend": "milvus", "uri": self.uri,
                "milvus_collection": self._mname,
                "index_type": milvus_index(self.spec.token_factory if self._multi else self.spec.factory)[0]}


def _schema(client: Any, spec: CollectionSpec) -> tuple[Any, Any]:
    from pymilvus import DataType

    multi = spec.kind == "multi"
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    if multi:
        schema.add_field("pk", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_BYTES + 12)
        schema.add_field("doc_id", DataType.VARCHAR, max_length=MAX_ID_BYTES)
        schema.add_field("pos", DataType.INT32)
        schema.add_field("n", DataType.INT32)  # vectors of the document (same on all its rows)
    else:
        schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_BYTES)
    schema.add_field("seq", DataType.INT64)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=spec.dim)
    schema.add_field("text", DataType.VARCHAR, max_length=MAX_TEXT_BYTES, nullable=True)
    schema.add_field("metadata", DataType.JSON, nullable=True)
    index_type, params, _ = milvus_index(spec.token_factory if multi else spec.factory)
    index_params = client.prepare_index_params()
    # pymilvus 3 sends build parameters as flat key/values, Milvus Lite 3.2 reads only the legacy
    # "params" JSON key (servers read both): send both
    index_params.add_index(field_name="vector", index_type=index_type, metric_type=_metric(spec),
                           params={**params, "params": params} if params else {})
    if multi:
        index_params.add_index(field_name="doc_id", index_type="INVERTED")
    return schema, index_params


# ---- module functions ------------------------------------------------------------------------
def list_collections(uri: str, *, token: str | None = None) -> list[str]:
    """Names of the embedpool collections in Milvus at ``uri`` (sorted)."""
    key, client = _Clients.acquire(uri, token)
    try:
        with _errors("listing collections"):
            names = [n for n in map(embedpool_name, client.list_collections()) if n]
            return sorted(n for n in names
                          if MANIFEST_KEY in (client.describe_collection(milvus_name(n)).get("properties") or {}))
    finally:
        _Clients.release(key)


def delete_collection(uri: str, name: str, *, token: str | None = None) -> None:
    """Drop an embedpool collection from Milvus."""
    mname = milvus_name(name)
    key, client = _Clients.acquire(uri, token)
    try:
        with _Clients.write_lock(key, mname), _errors(f"dropping collection {name!r}"):
            if not client.has_collection(mname):
                raise CollectionNotFoundError(f"no collection {name!r} in Milvus at {key[0]}")
            if MANIFEST_KEY not in (client.describe_collection(mname).get("properties") or {}):
                raise NotACollectionError(
                    f"Milvus collection {mname!r} was not created by embedpool; not dropping it")
            client.drop_collection(mname)
    finally:
        _Clients.release(key)


def default_uri(data_dir: str | os.PathLike) -> str:
    """The Milvus Lite file used when no URI is given: ``<data_dir>/milvus.db``."""
    return str(Path(data_dir) / "milvus.db")
