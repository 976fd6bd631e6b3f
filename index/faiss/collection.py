"""The FAISS backend: a collection is a named folder holding a manifest, a vector store and a
document store.

On-disk layout of ``<data_dir>/<name>/``::

    manifest.json            spec + format version + counts/times (rewritten after each commit)
    docs.sqlite (+ -wal)     documents, counters, properties, and the names of the current
                             vector files
    writer.lock              flock held by the process that has uncommitted writes
    vectors-<gen>.faiss      single: the FAISS index as of commit <gen> (the base)
    sparse-<gen>.npz         sparse: the rows as of commit <gen> (+ sparse-<gen>.delta.npz; index.faiss.sparse)
    vectors-<gen>.delta.npz  single: the rows commit <gen> appended to the base (index.faiss.single)
    seg-<id>.vec.npy         multi: token codes of one append-only segment
    seg-<id>.aux.npz         multi: its doc offsets, internal ids, int8 scales
    tokens-<gen>.faiss       multi: the token ANN index (once built)
    companion-<gen>.faiss    multi: the companion rows' index (+ companion-<gen>.delta.npz)

Commit protocol (crash-safe at every instruction): new vector files are written under new
names (:func:`index.durable.write_durable`); then one SQLite transaction (WAL,
``synchronous=FULL``) writes the document rows, the staged properties and the names of the new
files -- that COMMIT is the durable point. Files that the database does not name are stale
leftovers of an unfinished commit and are deleted by the next writer (or by an opener when no
writer is active).

Properties live in the ``meta`` table as ``property:<key>``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..backends import Backend, Where
from ..base import (
    Capabilities,
    CollectionBase,
    Hit,
    check_new_spec,
    check_property,
    make_stats,
    require_spec,
)
from .docstore import DB_NAME, DocStore
from ..durable import fsync_dir, now_iso, remove_quietly, write_durable_bytes
from embedpool.allocator import release_free_memory
from embedpool.errors import ConflictError, InternalError, InvalidError, NotFoundError
from ..filters import Node
from .folders import LOCK_FILE, collection_manifest, create_folder, delete_collection, list_collections
from ..lexical import parse_analyzer
from .locks import FileLock, RWLock
from .multi import MultiStore
from .single import SingleStore
from .sparse import SparseStore
from ..spec import MANIFEST, CollectionSpec
from ..validate import topk
from .vectors import StoreCommit, StoreState, VectorStore

log = logging.getLogger("embedpool.index")

__all__ = ["FaissCollection", "Hit", "list_collections", "delete_collection", "collection_manifest"]

_MANAGED = re.compile(r"^((vectors|tokens|companion)-\d+\.faiss|(vectors|companion)-\d+\.delta\.npz|"
                      r"seg-\d+\.(vec\.npy|aux\.npz)|sparse-\d+(\.delta)?\.npz)(\.tmp)?$")
STORES: dict[str, type[VectorStore]] = {"single": SingleStore, "multi": MultiStore, "sparse": SparseStore}
PROPERTY_PREFIX = "property:"
#: bytes of matching-id arrays kept for repeated filters (:meth:`FaissCollection._matching`)
FILTER_CACHE_BYTES = 64 << 20
#: a filter whose estimated share of the documents is at least BROAD_FILTER, on a collection
#: of at least BROAD_MIN_DOCS documents, is applied to a single-vector or BM25 search's own
#: ranking (:meth:`FaissCollection._post_filtered`) instead of by reading all its matching ids
BROAD_FILTER = 0.2
BROAD_MIN_DOCS = 50_000
SHARE_SAMPLE = 512
#: how long a writer waits for the folder lock held by a reader's or deleter's brief cleanup
WRITER_LOCK_WAIT = 1.0


class FaissCollection(CollectionBase):
    """A persistent single- or multi-vector collection in a folder. Use :meth:`create` /
    :meth:`open` (or :func:`index.open_collection`).

    Thread-safety: one writer (``add``/``delete``/``commit``/``compact``) and any number of
    searching threads; a search sees the collection either before or after a whole ``add``.
    Across processes: one writer at a time (others get :class:`ConflictError`); readers in
    other processes see the state committed when they opened the collection, and later commits
    after :meth:`refresh`.
    """

    backend = "faiss"

    # ---- opening ------------------------------------------------------------------------
    @classmethod
    def create(cls, data_dir: str | os.PathLike, name: str, spec: CollectionSpec) -> "FaissCollection":
        """Create ``<data_dir>/<name>``; if it exists with an equal spec, open it; if with a
        different spec, raise :class:`ConflictError` naming the differing fields."""
        check_new_spec(name, spec)
        data_dir = Path(data_dir)
        folder = data_dir / name
        if not folder.exists():
            create_folder(data_dir, name, spec)
        elif not (folder / MANIFEST).exists():
            raise ConflictError(
                f"{name!r} exists in the data directory but is not an embedpool collection; choose another "
                "name or remove that folder")
        return require_spec(cls.open(data_dir, name), spec)

    @classmethod
    def open(cls, data_dir: str | os.PathLike, name: str) -> "FaissCollection":
        """Open an existing collection (:class:`NotFoundError` if absent)."""
        manifest = collection_manifest(data_dir, name)
        folder = Path(data_dir) / name
        if not (folder / DB_NAME).is_file():
            raise ConflictError(f"collection {name!r} has a manifest but no document store ({DB_NAME}); "
                                "restore its folder from a backup, or delete it and index its documents again")
        return cls(Path(data_dir), name, manifest)

    @classmethod
    def open_or_create(cls, data_dir: str | os.PathLike, name: str, spec: CollectionSpec) -> "FaissCollection":
        return cls.create(data_dir, name, spec)

    def __init__(self, data_dir: Path, name: str, manifest: dict[str, Any]) -> None:
        super().__init__()
        self.name = name
        self.data_dir = Path(data_dir)
        self.folder = self.data_dir / name
        self.spec = CollectionSpec.from_dict(manifest)
        self._store_cls = STORES[self.spec.kind]
        self.capabilities = Capabilities(
            supports_token_ann=self._store_cls.supports_token_ann, token_index_on_insert=False,
            transactional=True, measures_disk_usage=True, multi_process=True, concurrent_writers=False)
        self._manifest = manifest
        self._db = DocStore(self.folder / DB_NAME)
        # a second connection, only to read the committed generation: refresh() never waits
        # for this object's writers (they hold the first connection's lock)
        self._probe = DocStore(self.folder / DB_NAME)
        self._rw = RWLock()
        self._wmutex = threading.RLock()  # serializes writers in this process
        self._token_lock = threading.Lock()
        self._flock = FileLock(self.folder / LOCK_FILE)
        self._closed = False
        self._dirty = False  # documents changed since the last commit
        self._props: dict[str, str] = {}  # staged properties
        self._writes = 0  # add/delete/compact calls: a filter's matching ids are kept until the next
        self._filter_cache: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._filter_lock = threading.Lock()
        self._analyzer = parse_analyzer(self.spec.analyzer) if self._db.has_lexical else None
        try:
            self._load()
            self._cleanup_if_no_writer()
        except BaseException:
            self._db.close()
            self._probe.close()
            raise

    def _state(self) -> StoreState:
        """The vector store's committed state (inside a snapshot or the write transaction)."""
        return StoreState({k: self._db.get_meta(k) for k in self._store_cls.META_KEYS},
                          self._db.segments())

    def _load(self) -> None:
        """Load the committed state: the generation SQLite names and the files it lists."""
        for attempt in range(10):
            with self._db.snapshot():
                gen = self._db.get_meta("generation", 0)
                next_int = self._db.get_meta("next_int_id", 0)
                state = self._state()
                live = self._live_ids(state)
            needed = self._store_cls.required_files(state)
            try:
                missing = [f for f in needed if not (self.folder / f).is_file()]
                if missing:
                    raise FileNotFoundError(", ".join(missing))
                vec = self._store_cls.load(self.spec, self.folder, state, live)
            except (FileNotFoundError, RuntimeError) as e:
                # a writer in another process may just have replaced these files: re-read
                if attempt < 9 and any(not (self.folder / f).is_file() for f in needed):
                    time.sleep(0.05)
                    continue
                # the message names the files, not the server's folders; FAISS's own (its C++
                # source and the file's full path) stays in the chained exception, for the log
                what = (f"its committed file(s) {e} are missing" if isinstance(e, FileNotFoundError)
                        else f"its committed file(s) {', '.join(needed)} are damaged (FAISS cannot read them)")
                raise InternalError(
                    f"collection {self.name!r} cannot be loaded: {what}; restore the collection's folder from "
                    "a backup, or delete the collection and index its documents again") from e
            break
        self._vec = vec
        self._gen = int(gen)
        self._next_int_id = int(next_int)
        # loading read the companion's base, its deltas and the segments' arrays through buffers
        # now freed: a process that opens a million-document collection first thing kept ~70 MB
        # of them resident (473 against 403 MB over its baseline; docs/scale.md)
        release_free_memory()

    def _live_ids(self, state: StoreState) -> np.ndarray | None:
        """The live internal ids, or ``None`` when the document store's count equals the documents
        the segments hold (no tombstones: every one of them is live) -- a multi-vector
        collection then opens without reading a million ids out of SQLite one row at a time."""
        if state.segments and self._store_cls.accepts_all_live and \
                self._db.count() == sum(int(n) for _, n, _ in state.segments):
            return None
        return self._db.all_int_ids()

    def refresh(self) -> bool:
        """Reload if another writer committed since this object loaded the collection.

        Returns True if it reloaded. Refused while this object has uncommitted changes and
        another writer committed. Cheap when nothing changed: a stat and a read of the committed
        generation that waits for no writer of this object.
        """
        self._check_open()
        if not (self.folder / MANIFEST).is_file():
            raise NotFoundError(f"collection {self.name!r} was deleted")
        if int(self._probe.get_meta("generation", 0)) == self._gen:
            return False
        with self._wmutex:
            self._check_open()
            if self._db.in_transaction:
                raise ConflictError(
                    f"collection {self.name!r} has uncommitted changes; commit() before refresh()")
            if int(self._db.get_meta("generation", 0)) == self._gen:
                return False
            with self._rw.write():
                self._load()
            return True

    # ---- writer protocol ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidError(f"collection {self.name!r} is closed")

    def _begin_write(self) -> None:
        """Become the writer: take the folder lock, open the SQLite write transaction, check
        nobody committed since we loaded, and clear leftovers of unfinished commits."""
        if self._db.in_transaction:
            return
        if not self._flock.try_acquire(wait=WRITER_LOCK_WAIT):
            raise ConflictError(
                f"collection {self.name!r} has uncommitted writes from another process or FaissCollection "
                "object; commit or close that one first (one writer at a time)")
        try:
            self._db.begin()
            if int(self._db.get_meta("generation", 0)) != self._gen:
                raise ConflictError(
                    f"collection {self.name!r} was changed on disk by another writer since it was "
                    "opened; open it again before writing")
            self._remove_stale_files()
        except BaseException:
            self._end_write()
            raise

    def _end_write(self) -> None:
        self._db.rollback()
        self._flock.release()

    def _remove_stale_files(self) -> None:
        """Delete managed files that the (committed) database does not name. Caller holds the
        folder lock and reads inside a transaction/snapshot."""
        keep = set(self._store_cls.committed_files(self._state()))
        removed = False
        for entry in os.scandir(self.folder):
            if _MANAGED.match(entry.name) and entry.name not in keep:
                remove_quietly(Path(entry.path))
                removed = True
        if removed:
            fsync_dir(self.folder)

    def _cleanup_if_no_writer(self) -> None:
        try:
            if not self._flock.try_acquire():
                return
        except OSError:  # read-only folder: nothing to clean, nothing we could clean
            return
        try:
            with self._db.snapshot():
                self._remove_stale_files()
        finally:
            self._flock.release()

    # ---- writes -------------------------------------------------------------------------
    def add(self, ids: Sequence[str], vectors: Any, texts: Sequence[str | None] | None = None,
            metadata: Sequence[dict | None] | None = None, *, model: str | None = None,
            pooler: str | None = None, companion: Any = None) -> None:
        """Insert or replace documents (see :meth:`CollectionBase.add`); durable after
        :meth:`commit`."""
        ids, vecs, texts_, metas, comp = self._check_add(ids, vectors, texts, metadata, model, pooler,
                                                         companion)
        n = len(ids)
        if n == 0:
            return
        terms = None if self._analyzer is None else self._analyzer.document_terms(texts_)
        with self._wmutex:
            self._check_open()
            self._vec.check_add(n, comp)
            self._begin_write()
            with self._rw.write():
                existing = self._db.lookup_ext(ids)
                old = np.array(list(existing.values()), dtype=np.int64)
                new_ids = np.arange(self._next_int_id, self._next_int_id + n, dtype=np.int64)
                rows = [(int(i), e, t, m) for i, e, t, m in zip(new_ids, ids, texts_, metas)]
                with self._db.savepoint():
                    if len(old):
                        self._db.delete_int(old.tolist())
                    self._db.insert(rows, terms)
                    # vectors last: if this raises, the savepoint undoes the rows
                    self._vec.add(new_ids, vecs, comp)
                    self._vec.remove(old)
                self._next_int_id += n
                self._dirty = True
                self._writes += 1

    def delete(self, ids: Sequence[str]) -> None:
        """Delete documents by id. Any unknown id: :class:`NotFoundError`, nothing deleted."""
        ids = self._check_delete(ids)
        if not ids:
            return
        with self._wmutex:
            self._check_open()
            found = self._db.lookup_ext(ids)
            self._refuse_unknown(ids, found)
            self._begin_write()
            with self._rw.write():
                int_ids = [found[i] for i in ids]
                with self._db.savepoint():
                    self._db.delete_int(int_ids)
                self._vec.remove(np.array(int_ids, dtype=np.int64))
                self._dirty = True
                self._writes += 1

    def commit(self) -> None:
        """Make every change since the last commit durable (see module docstring). A commit of
        properties alone does not start a new generation (readers keep their vectors)."""
        with self._wmutex:
            self._check_open()
            data = self._dirty or self._vec.dirty
            if not data and not self._props:
                if self._db.in_transaction:
                    self._end_write()
                return
            self._begin_write()
            gen = self._gen + 1 if data else self._gen
            with self._rw.read():  # searches go on while the files are written
                delta = self._vec.write(self.folder, gen) if data else StoreCommit()
            with self._rw.write():
                self._record(delta, gen, data)
                self._db.commit()  # <- the durable point
                self._gen = gen
                self._dirty = False
                self._props = {}
                if data:
                    self._vec.mark_committed(delta)
            try:
                with self._db.snapshot():
                    self._remove_stale_files()  # replaced generations, compacted segments
            finally:
                self._flock.release()
            if data:
                try:
                    self._write_manifest()
                except OSError as e:  # the commit itself is durable; the manifest only has counts
                    log.warning("collection %r: could not update %s: %s", self.name, MANIFEST, e)

    def _record(self, delta: StoreCommit, gen: int, data: bool) -> None:
        """Write the commit's rows inside the transaction."""
        if delta.reset_segments:
            self._db.clear_segments()
        if delta.new_segment is not None:
            self._db.add_segment(*delta.new_segment)
        meta: dict[str, Any] = dict(delta.meta)
        if data:
            meta.update(generation=gen, next_int_id=self._next_int_id, updated=now_iso())
        meta.update({PROPERTY_PREFIX + k: v for k, v in self._props.items()})
        for k, v in meta.items():
            self._db.set_meta(k, v)

    def compact(self) -> None:
        """Rebuild without deleted/replaced documents (HNSW tombstones, dead multi-vector
        segment rows; merges all segments into one), then commit."""
        with self._wmutex:
            self._check_open()
            self._begin_write()
            with self._rw.write():
                new = self._vec.compacted(self.folder)
                if new is not None:
                    self._vec = new
                    self._dirty = True
            self.commit()

    def build_token_index(self) -> None:
        """Build the token-level ANN index now (else built by the first ``tokens`` search);
        it is saved by the next :meth:`commit`."""
        self._check_token_index()
        with self._rw.read():
            self._ensure_token_index()

    def _ensure_token_index(self) -> None:
        """Build the token index if there is none (caller holds the read lock)."""
        with self._token_lock:
            if self._vec.token_index is None:
                self._vec.build_token_index()

    # ---- properties -----------------------------------------------------------------------
    def get_property(self, key: str) -> str | None:
        """The staged value, else the committed one (see :meth:`CollectionBase.get_property`)."""
        self._check_open()
        check_property(key, "")
        if key in self._props:
            return self._props[key]
        return self._db.get_meta(PROPERTY_PREFIX + key)

    def set_property(self, key: str, value: str) -> None:
        """Stage a property; the next :meth:`commit` writes it in the same SQLite transaction as
        the documents added before it."""
        check_property(key, value)
        with self._wmutex:
            self._check_open()
            self._props[key] = value

    def close(self) -> None:
        """Release the collection. Uncommitted changes are discarded (call commit() first)."""
        with self._wmutex:
            if self._closed:
                return
            with self._rw.write():
                if self._dirty or self._props:
                    log.warning("collection %r closed with uncommitted changes; they are discarded",
                                self.name)
                self._end_write()
                self._db.close()
                self._probe.close()
                self._closed = True

    def __repr__(self) -> str:
        return f"Collection({str(self.folder)!r}, kind={self.spec.kind!r}, documents={len(self)})"

    # ---- reads --------------------------------------------------------------------------
    def _matching(self, flt: Node | None) -> np.ndarray | None:
        """The sorted internal ids of the live documents that match ``flt`` (None: no filter),
        as this object sees the collection (its uncommitted writes included). Caller holds the
        read lock. Kept for the next searches with the same filter until a write (LRU)."""
        if flt is None:
            return None
        if not self._db.has_fields:
            raise InvalidError(f"collection {self.name!r} was made before metadata filters existed; "
                               "index its documents into a new collection to filter them", param="filter")
        key = (flt, self._gen, self._writes)
        with self._filter_lock:
            ids = self._filter_cache.get(key)
            if ids is not None:
                self._filter_cache.move_to_end(key)
                return ids
        ids = self._db.matching(flt)
        with self._filter_lock:
            self._filter_cache[key] = ids
            while len(self._filter_cache) > 1 and sum(a.nbytes for a in self._filter_cache.values()) > FILTER_CACHE_BYTES:
                self._filter_cache.popitem(last=False)
        return ids

    def _share(self, flt: Node) -> float | None:
        """The share of the documents that ``flt`` keeps, estimated on at most
        :data:`SHARE_SAMPLE` internal ids spread over the id range; None when its matching ids
        are cached or the collection is small (then they are read whole). Caller holds the
        read lock."""
        if not self._db.has_fields or self._vec.n_docs < BROAD_MIN_DOCS:
            return None
        with self._filter_lock:
            if (flt, self._gen, self._writes) in self._filter_cache:
                return None
        probe = np.unique(np.linspace(0, max(self._next_int_id - 1, 0), SHARE_SAMPLE).astype(np.int64))
        live = self._db.live_among(probe)
        if not live:
            return None
        return len(self._db.matching_among(flt, live)) / len(live)

    def _post_filtered(self, search, nq: int, k: int, flt: Node, share: float,
                       total: int) -> list[list[tuple[float, int]]]:
        """A filter that keeps most documents, applied to the search's own ranking: the best
        ``kk`` hits of ``search(rows, kk)`` (``(score, int id)`` lists, best first) checked
        against the filter in one query over their ids, ``kk`` growing (x4) for a query left
        short until ``k`` match or all ``total`` were seen -- the same hits as the filter inside
        the search, without reading every matching id of a million documents."""
        out: list[list[tuple[float, int]] | None] = [None] * nq
        todo = list(range(nq))
        kk = min(total, int(k / max(share, 0.01) * 1.5) + 16)
        while todo:
            res = search(todo, kk)
            ok = self._db.matching_among(flt, {i for r in res for _, i in r})
            short = []
            for q, r in zip(todo, res):
                hits = [h for h in r if h[1] in ok][:k]
                if len(hits) < k and kk < total and len(r) >= kk:
                    short.append(q)
                else:
                    out[q] = hits
            todo, kk = short, min(total, kk * 4)
        return out  # type: ignore[return-value]

    def _search_single(self, x: np.ndarray, k: int, flt: Node | None = None) -> list[list[Hit]]:
        with self._rw.read():
            self._check_open()
            share = None if flt is None else self._share(flt)
            if share is not None and share >= BROAD_FILTER:
                def search(rows, kk):
                    D, I = self._vec.search(x[rows], kk)
                    return [[(float(d), int(i)) for d, i in zip(dr, ir) if i >= 0] for dr, ir in zip(D, I)]

                return self._hits(self._post_filtered(search, x.shape[0], k, flt, share, self._vec.n_docs))
            D, I = self._vec.search(x, k, self._matching(flt))
            return self._hits([[(float(d), int(i)) for d, i in zip(dr, ir) if i >= 0]
                               for dr, ir in zip(D, I)])

    def _search_exhaustive(self, qs: list[np.ndarray], k: int, flt: Node | None = None) -> list[list[Hit]]:
        with self._rw.read():
            self._check_open()
            ids = self._matching(flt)
            if ids is not None:  # MaxSim against the matching documents only
                return self._hits([topk(*self._vec.rerank_topk(q, ids, k), k) for q in qs])
            return self._hits([topk(s, i, k) for s, i in self._vec.exhaustive_topk(qs, k)])

    def _search_tokens(self, qs: list[np.ndarray], k: int, k_token: int,
                       flt: Node | None = None) -> list[list[Hit]]:
        with self._rw.read():
            self._check_open()
            self._ensure_token_index()
            ids = self._matching(flt)
            cands = self._vec.token_candidates(qs, k_token, ids)
            if ids is not None:  # the token ANN may reach fewer than k matching documents
                cands = [ids if len(c) < min(k, len(ids)) else c for c in cands]
            return self._hits([topk(*self._vec.rerank_topk(q, c, k), k) for q, c in zip(qs, cands)])

    def _search_companion(self, qs: list[np.ndarray], cq: np.ndarray, candidates: int,
                          k: int, flt: Node | None = None) -> list[list[Hit]]:
        with self._rw.read():
            self._check_open()
            cands = self._vec.companion_candidates(cq, candidates, self._matching(flt))
            return self._hits([topk(*self._vec.rerank_topk(q, c, k), k) for q, c in zip(qs, cands)])

    def _search_lexical(self, texts: list[str], k: int, flt: Node | None = None) -> list[list[Hit]]:
        analyzer = parse_analyzer(self.spec.analyzer)
        matches = [analyzer.match(t) for t in texts]  # analyzed outside the lock
        with self._rw.read():
            self._check_open()
            if not self._db.has_lexical:
                raise InvalidError(f"collection {self.name!r} has no lexical index", param="mode")
            if flt is not None and not self._db.has_fields:
                self._matching(flt)  # says why it cannot filter
            share = None if flt is None else self._share(flt)
            if share is not None and share >= BROAD_FILTER:  # the ids in the FTS5 query would be most of them
                def search(rows, kk):
                    return [self._db.lexical(matches[r], kk) if matches[r] else [] for r in rows]

                return self._hits(self._post_filtered(search, len(matches), k, flt, share, self._vec.n_docs))
            return self._hits([self._db.lexical(m, k, flt) if m else [] for m in matches])

    def _delete_where(self, flt: Node) -> int:
        with self._wmutex:
            self._check_open()
            with self._rw.read():
                ids = self._matching(flt)
            names = self._db.ext_of(ids.tolist())
            self.delete([names[int(i)] for i in ids])
            return len(ids)

    def _hits(self, results: list[list[tuple[float, int]]]) -> list[list[Hit]]:
        """Attach ids, text and metadata (caller holds the read lock)."""
        docs = self._db.fetch({i for r in results for _, i in r})
        return [[Hit(docs[i][0], s, docs[i][1], docs[i][2]) for s, i in r if i in docs]
                for r in results]

    def get(self, id: str) -> dict[str, Any]:
        """``{id, text, metadata, vector}`` (single) or ``{id, text, metadata, vectors}`` (multi,
        float32 ``[n_i, dim]``, dequantized). Unknown id: :class:`NotFoundError`."""
        self._check_open()
        with self._rw.read():
            found = self._db.lookup_ext([id]) if isinstance(id, str) else {}
            if id not in found:
                raise NotFoundError(f"no document {id!r} in collection {self.name!r}", param="id")
            int_id = found[id]
            ext, text, meta = self._db.fetch([int_id])[int_id]
            return {"id": ext, "text": text, "metadata": meta, **self._vec.vectors_of(int_id)}

    def ids(self) -> list[str]:
        """All document ids, in insertion order."""
        self._check_open()
        with self._rw.read():
            return self._db.all_ext_ids()

    def __len__(self) -> int:
        if self._closed:
            return 0
        with self._rw.read():
            return self._vec.n_docs

    def __contains__(self, id: object) -> bool:
        self._check_open()
        with self._rw.read():
            return isinstance(id, str) and bool(self._db.lookup_ext([id]))

    def _counts(self) -> dict[str, int]:
        with self._rw.read():
            return {"documents": self._vec.n_docs, "vectors": self._vec.live_vectors()}

    def stats(self) -> dict[str, Any]:
        """See :class:`index.base.Stats`: bytes_on_disk is the whole folder; bytes_per_doc the
        vector storage per live document (token codes + scales + offsets for multi; committed
        index file / its vectors for single)."""
        self._check_open()
        with self._rw.read():
            disk = sum(e.stat().st_size for e in os.scandir(self.folder) if e.is_file())
            return make_stats(documents=self._vec.n_docs, vectors=self._vec.live_vectors(),
                              bytes_on_disk=disk, backend=self.backend, location=str(self.folder),
                              **self._vec.storage_stats(self.folder))

    def _write_manifest(self) -> None:
        m = {**self.manifest, "updated": now_iso()}
        write_durable_bytes(self.folder / MANIFEST, (json.dumps(m, indent=2) + "\n").encode())
        self._manifest = m


class FaissBackend(Backend):
    """Collections as folders under ``where.data_dir``."""

    def open(self, where: Where, name: str, spec: CollectionSpec | None) -> FaissCollection:
        if spec is None:
            return FaissCollection.open(where.data_dir, name)
        return FaissCollection.open_or_create(where.data_dir, name, spec)

    def list(self, where: Where) -> list[str]:
        return list_collections(where.data_dir)

    def delete(self, where: Where, name: str) -> None:
        delete_collection(where.data_dir, name)

    def manifest(self, where: Where, name: str) -> dict[str, Any]:
        return collection_manifest(where.data_dir, name)


BACKEND = FaissBackend()
