"""Collections: a named folder holding a manifest, a vector store and a document store.

On-disk layout of ``<data_dir>/<name>/``::

    manifest.json            spec + format version + counts/times (rewritten after each commit)
    docs.sqlite (+ -wal)     documents, counters, and the names of the current vector files
    writer.lock              flock held by the process that has uncommitted writes
    vectors-<gen>.faiss      single: the FAISS index of commit <gen>
    seg-<id>.vec.npy         multi: token codes of one append-only segment
    seg-<id>.aux.npz         multi: its doc offsets, internal ids, int8 scales
    tokens-<gen>.faiss       multi: the token ANN index (once built)

Commit protocol (crash-safe at every instruction): new vector files are written under new
names (``.tmp``, fsync, rename, fsync dir); then one SQLite transaction (WAL,
``synchronous=FULL``) writes the document rows and the names of the new files -- that COMMIT is
the durable point. Files that the database does not name are stale leftovers of an unfinished
commit and are deleted by the next writer (or by an opener when no writer is active).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._util import FileLock, RWLock, fsync_dir, now_iso, remove_quietly, write_durable_bytes
from .docstore import DB_NAME, DocStore
from .errors import (
    CollectionLockedError,
    CollectionNotFoundError,
    CorruptCollectionError,
    DocumentNotFoundError,
    InvalidInputError,
    NotACollectionError,
    SpecMismatchError,
)
from .base import CollectionBase, Hit, check_spec_matches
from .multi import MultiStore, seg_files
from .single import SingleStore
from .spec import FORMAT_VERSION, MANIFEST, CollectionSpec, check_name, new_manifest, read_manifest
from .validate import topk

log = logging.getLogger("embedpool.index")

__all__ = ["Collection", "Hit", "list_collections", "delete_collection"]

LOCK_FILE = "writer.lock"
_MANAGED = re.compile(r"^(vectors-\d+\.faiss|tokens-\d+\.faiss|seg-\d+\.(vec\.npy|aux\.npz))(\.tmp)?$")


class Collection(CollectionBase):
    """A persistent single- or multi-vector collection. Use :meth:`create` / :meth:`open`.

    Thread-safety: one writer (``add``/``delete``/``commit``/``compact``) and any number of
    searching threads; a search sees the collection either before or after a whole ``add``.
    Across processes: one writer at a time (others get :class:`CollectionLockedError`); readers in
    other processes see the state committed when they opened the collection.
    """

    backend = "faiss"

    # ---- opening ------------------------------------------------------------------------
    @classmethod
    def create(cls, data_dir: str | os.PathLike, name: str, spec: CollectionSpec) -> "Collection":
        """Create ``<data_dir>/<name>``; if it exists with an equal spec, open it; if with a
        different spec, raise :class:`SpecMismatchError` naming the differing fields."""
        check_name(name)
        if not isinstance(spec, CollectionSpec):
            raise InvalidInputError("spec must be a CollectionSpec")
        spec.validate()
        data_dir = Path(data_dir)
        folder = data_dir / name
        if not folder.exists():
            data_dir.mkdir(parents=True, exist_ok=True)
            tmp = data_dir / f".{name}.creating-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                _init_folder(tmp, name, spec)
                try:
                    os.rename(tmp, folder)  # atomic; fails if someone created it meanwhile
                except OSError:
                    if not folder.exists():
                        raise
                else:
                    fsync_dir(data_dir)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        elif not (folder / MANIFEST).exists():
            raise NotACollectionError(
                f"{folder} exists but is not an embedpool collection; choose another name or "
                "remove that folder")
        coll = cls.open(data_dir, name)
        try:
            check_spec_matches(coll.spec, spec, name)
        except SpecMismatchError:
            coll.close()
            raise
        return coll

    @classmethod
    def open(cls, data_dir: str | os.PathLike, name: str) -> "Collection":
        """Open an existing collection (:class:`CollectionNotFoundError` if absent)."""
        check_name(name)
        data_dir = Path(data_dir)
        folder = data_dir / name
        if not folder.is_dir():
            have = list_collections(data_dir)
            raise CollectionNotFoundError(
                f"no collection {name!r} in {data_dir}"
                + (f" (collections there: {', '.join(have)})" if have else " (it holds no collections)"))
        manifest = read_manifest(folder)
        if not (folder / DB_NAME).is_file():
            raise NotACollectionError(f"{folder} has a manifest but no document store ({DB_NAME})")
        return cls(data_dir, name, manifest)

    @classmethod
    def open_or_create(cls, data_dir: str | os.PathLike, name: str, spec: CollectionSpec) -> "Collection":
        return cls.create(data_dir, name, spec)

    def __init__(self, data_dir: Path, name: str, manifest: dict[str, Any]) -> None:
        super().__init__()
        self.name = name
        self.data_dir = Path(data_dir)
        self.folder = self.data_dir / name
        self.spec = CollectionSpec.from_dict(manifest)
        self._manifest = manifest
        self._db = DocStore(self.folder / DB_NAME)
        self._rw = RWLock()
        self._wmutex = threading.RLock()  # serializes writers in this process
        self._token_lock = threading.Lock()
        self._flock = FileLock(self.folder / LOCK_FILE)
        self._closed = False
        self._dirty = False
        try:
            self._load()
            self._cleanup_if_no_writer()
        except BaseException:
            self._db.close()
            raise

    def _load(self) -> None:
        """Load the committed state: the generation SQLite names and the files it lists."""
        for attempt in range(10):
            with self._db.snapshot():
                gen = self._db.get_meta("generation", 0)
                next_int = self._db.get_meta("next_int_id", 0)
                next_seg = self._db.get_meta("next_seg_id", 0)
                vec_file = self._db.get_meta("vector_file")
                token_meta = self._db.get_meta("token_index")
                live = self._db.all_int_ids()
                segs = self._db.segments()
            needed = [vec_file] if vec_file else []
            for sid, _, _ in segs:
                needed.extend(seg_files(sid))
            try:
                missing = [f for f in needed if not (self.folder / f).is_file()]
                if missing:
                    raise FileNotFoundError(", ".join(missing))
                if self.spec.kind == "single":
                    vec: SingleStore | MultiStore = SingleStore.load(
                        self.spec, self.folder / vec_file if vec_file else None, live)
                else:
                    vec = MultiStore.load(self.spec, self.folder, [s[0] for s in segs], live, token_meta)
            except (FileNotFoundError, RuntimeError) as e:
                # a writer in another process may just have replaced these files: re-read
                if attempt < 9 and any(not (self.folder / f).is_file() for f in needed):
                    time.sleep(0.05)
                    continue
                raise CorruptCollectionError(
                    f"collection {self.name!r}: cannot load committed file(s): {e}") from None
            break
        self._vec = vec
        self._gen = int(gen)
        self._next_int_id = int(next_int)
        self._next_seg_id = int(next_seg)
        self._vec_file = vec_file

    def refresh(self) -> bool:
        """Reload if another writer committed since this object loaded the collection.

        Returns True if it reloaded. Refused while this object has uncommitted changes.
        """
        with self._wmutex:
            self._check_open()
            if self._db.in_transaction:
                raise CollectionLockedError(
                    f"collection {self.name!r} has uncommitted changes; commit() before refresh()")
            if int(self._db.get_meta("generation", 0)) == self._gen:
                return False
            with self._rw.write():
                self._load()
            return True

    # ---- writer protocol ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError(f"collection {self.name!r} is closed")

    def _begin_write(self) -> None:
        """Become the writer: take the folder lock, open the SQLite write transaction, check
        nobody committed since we loaded, and clear leftovers of unfinished commits."""
        if self._db.in_transaction:
            return
        if not self._flock.try_acquire():
            raise CollectionLockedError(
                f"collection {self.name!r} has uncommitted writes from another process or Collection "
                "object; commit or close that one first (one writer at a time)")
        try:
            self._db.begin()
            if int(self._db.get_meta("generation", 0)) != self._gen:
                raise CollectionLockedError(
                    f"collection {self.name!r} was changed on disk by another writer since it was "
                    "opened; open it again before writing")
            self._remove_stale_files()
        except BaseException:
            self._db.rollback()
            self._flock.release()
            raise

    def _end_write(self) -> None:
        self._db.rollback()
        self._flock.release()

    def _referenced_files(self) -> set[str]:
        names = set()
        vec_file = self._db.get_meta("vector_file")
        if vec_file:
            names.add(vec_file)
        token_meta = self._db.get_meta("token_index")
        if token_meta:
            names.add(token_meta["file"])
        for sid, _, _ in self._db.segments():
            names.update(seg_files(sid))
        return names

    def _remove_stale_files(self) -> None:
        """Delete managed files that the (committed) database does not name. Caller holds the
        folder lock and reads inside a transaction/snapshot."""
        keep = self._referenced_files()
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
            pooler: str | None = None) -> None:
        """Insert or replace documents. Validates the whole batch first; on any error nothing
        changes. Visible to searches at once, durable after :meth:`commit`.

        Args:
            ids: external string ids, unique within the batch.
            vectors: single: ``[n, dim]`` array; multi: ``n`` arrays ``[n_i, dim]`` (``n_i >= 1``).
            texts: optional text per document.
            metadata: optional JSON-serializable dict per document.
            model, pooler: if given, must equal the manifest's (guards against mixing models).
        """
        ids, vecs, texts_, metas = self._check_add(ids, vectors, texts, metadata, model, pooler)
        n = len(ids)
        if n == 0:
            return
        with self._wmutex:
            self._check_open()
            if isinstance(self._vec, SingleStore):
                self._vec.check_trainable(n)
            self._begin_write()
            with self._rw.write():
                existing = self._db.lookup_ext(ids)
                old = np.array(list(existing.values()), dtype=np.int64)
                new_ids = np.arange(self._next_int_id, self._next_int_id + n, dtype=np.int64)
                rows = [(int(i), e, t, m) for i, e, t, m in zip(new_ids, ids, texts_, metas)]
                with self._db.savepoint():
                    if len(old):
                        self._db.delete_int(old.tolist())
                    self._db.insert(rows)
                    # vectors last: if this raises, the savepoint undoes the rows
                    if isinstance(self._vec, SingleStore):
                        self._vec.add(new_ids, vecs)
                    else:
                        seg_id = self._next_seg_id if self._vec.pending is None else self._vec.pending.seg_id
                        self._vec.add(new_ids, vecs, seg_id)
                        if seg_id == self._next_seg_id:
                            self._next_seg_id += 1
                    self._vec.remove(old)
                self._next_int_id += n
                self._dirty = True

    def delete(self, ids: Sequence[str]) -> None:
        """Delete documents by id. Any unknown id: :class:`DocumentNotFoundError`, nothing deleted."""
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

    def commit(self) -> None:
        """Make every change since the last commit durable (see module docstring)."""
        with self._wmutex:
            self._check_open()
            token_dirty = isinstance(self._vec, MultiStore) and self._vec.token_dirty \
                and self._vec.token_index is not None
            if not self._dirty and not token_dirty:
                if self._db.in_transaction:
                    self._end_write()
                return
            self._begin_write()
            gen = self._gen + 1
            meta: dict[str, Any] = {}
            seg_row = None
            with self._rw.read():  # searches go on while the files are written
                if isinstance(self._vec, SingleStore):
                    if self._vec.dirty:
                        name = f"vectors-{gen:08d}.faiss"
                        self._vec.write(self.folder / name)
                        meta["vector_file"] = name
                else:
                    seg_row = self._vec.write_pending(self.folder)
                    if self._vec.token_index is not None and self._vec.token_dirty:
                        meta["token_index"] = self._vec.write_token_index(
                            self.folder / f"tokens-{gen:08d}.faiss")
            with self._rw.write():
                if seg_row is not None:
                    self._db.add_segment(*seg_row)
                meta.update(generation=gen, next_int_id=self._next_int_id,
                            next_seg_id=self._next_seg_id, updated=now_iso())
                for k, v in meta.items():
                    self._db.set_meta(k, v)
                self._db.commit()  # <- the durable point
                self._gen = gen
                self._dirty = False
                if isinstance(self._vec, SingleStore):
                    self._vec.dirty = False
                    self._vec_file = meta.get("vector_file", self._vec_file)
                else:
                    self._vec.mark_committed()
            try:
                with self._db.snapshot():
                    self._remove_stale_files()  # replaced generations, compacted segments
            finally:
                self._flock.release()
            try:
                self._write_manifest()
            except OSError as e:  # the commit itself is durable; the manifest only has counts
                log.warning("collection %r: could not update %s: %s", self.name, MANIFEST, e)

    def compact(self) -> None:
        """Rebuild without deleted/replaced documents (HNSW tombstones, dead multi-vector
        segment rows; merges all segments into one), then commit."""
        with self._wmutex:
            self._check_open()
            self._begin_write()
            with self._rw.write():
                if isinstance(self._vec, SingleStore):
                    if self._vec.dead:
                        self._vec = self._vec.rebuilt()
                        self._dirty = True
                elif sum(s.n_docs for s in self._vec.segments) > self._vec.n_docs \
                        or len(self._vec.segments) > 1:
                    seg_id = self._next_seg_id
                    self._vec = self._vec.compacted(seg_id)
                    self._next_seg_id += 1
                    self._db.clear_segments()
                    self._dirty = True
            self.commit()

    def build_token_index(self) -> None:
        """Build the token-level ANN index now (else built by the first ``tokens`` search);
        it is saved by the next :meth:`commit`."""
        self._check_open()
        if not isinstance(self._vec, MultiStore):
            raise InvalidInputError("build_token_index applies to multi-vector collections only")
        with self._rw.read(), self._token_lock:
            if self._vec.token_index is None:
                self._vec.build_token_index()

    def close(self) -> None:
        """Release the collection. Uncommitted changes are discarded (call commit() first)."""
        with self._wmutex:
            if self._closed:
                return
            with self._rw.write():
                if self._dirty:
                    log.warning("collection %r closed with uncommitted changes; they are discarded",
                                self.name)
                self._end_write()
                self._db.close()
                self._closed = True
            self._close_companion()

    def __repr__(self) -> str:
        return f"Collection({str(self.folder)!r}, kind={self.spec.kind!r}, documents={len(self)})"

    # ---- reads --------------------------------------------------------------------------
    def _search_single(self, x: np.ndarray, k: int) -> list[list[Hit]]:
        with self._rw.read():
            self._check_open()
            D, I = self._vec.search(x, k)
            return self._hits([[(float(d), int(i)) for d, i in zip(dr, ir) if i >= 0]
                               for dr, ir in zip(D, I)])

    def _search_exhaustive(self, qs: list[np.ndarray], k: int) -> list[list[Hit]]:
        with self._rw.read():
            self._check_open()
            scores, ids = self._vec.exhaustive(qs)
            return self._hits([topk(s, ids, k) for s in scores])

    def _search_tokens(self, qs: list[np.ndarray], k: int, k_token: int) -> list[list[Hit]]:
        with self._rw.read():
            self._check_open()
            with self._token_lock:
                if self._vec.token_index is None:
                    self._vec.build_token_index()
            cands = self._vec.token_candidates(qs, k_token)
            return self._hits([topk(*self._vec.rerank(q, c), k) for q, c in zip(qs, cands)])

    def _rerank(self, qs: list[np.ndarray], ext_lists: list[list[str]], k: int) -> list[list[Hit]]:
        with self._rw.read():
            self._check_open()
            ext2int = self._db.lookup_ext(sorted({e for lst in ext_lists for e in lst}))
            out = []
            for q, lst in zip(qs, ext_lists):
                cand = np.array([ext2int[e] for e in lst if e in ext2int], dtype=np.int64)
                out.append(topk(*self._vec.rerank(q, cand), k))
            return self._hits(out)

    def _candidate_ids(self, x: np.ndarray, k: int) -> list[list[str]]:
        with self._rw.read():
            self._check_open()
            _, I = self._vec.search(x, k)
            names = self._db.ext_of(int(i) for i in np.unique(I) if i >= 0)
        return [[names[int(i)] for i in row if i >= 0 and int(i) in names] for row in I]

    def _open_sibling(self, name: str) -> "Collection":
        return Collection.open(self.data_dir, name)

    def _sync(self) -> None:
        if not self._db.in_transaction:
            self.refresh()  # pick up commits made since it was opened

    def _hits(self, results: list[list[tuple[float, int]]]) -> list[list[Hit]]:
        """Attach ids, text and metadata (caller holds the read lock)."""
        docs = self._db.fetch({i for r in results for _, i in r})
        return [[Hit(docs[i][0], s, docs[i][1], docs[i][2]) for s, i in r if i in docs]
                for r in results]

    def get(self, id: str) -> dict[str, Any]:
        """``{id, text, metadata, vector}`` (single) or ``{id, text, metadata, vectors}`` (multi,
        float32 ``[n_i, dim]``, dequantized). Unknown id: :class:`DocumentNotFoundError`."""
        self._check_open()
        with self._rw.read():
            found = self._db.lookup_ext([id]) if isinstance(id, str) else {}
            if id not in found:
                raise DocumentNotFoundError(f"no document {id!r} in collection {self.name!r}")
            int_id = found[id]
            ext, text, meta = self._db.fetch([int_id])[int_id]
            out: dict[str, Any] = {"id": ext, "text": text, "metadata": meta}
            if isinstance(self._vec, SingleStore):
                out["vector"] = self._vec.reconstruct(int_id)
            else:
                seg, row = self._vec.loc[int_id]
                out["vectors"] = seg.dequantized(np.array([row]))[0]
            return out

    def ids(self) -> list[str]:
        """All document ids, in insertion order."""
        self._check_open()
        with self._rw.read():
            return self._db.all_ext_ids()

    def __len__(self) -> int:
        if self._closed:
            return 0
        with self._rw.read():
            return self._vec.live_count if isinstance(self._vec, SingleStore) else self._vec.n_docs

    def __contains__(self, id: object) -> bool:
        self._check_open()
        with self._rw.read():
            return isinstance(id, str) and bool(self._db.lookup_ext([id]))

    def _counts(self) -> dict[str, int]:
        with self._rw.read():
            if isinstance(self._vec, SingleStore):
                return {"documents": self._vec.live_count, "vectors": self._vec.live_count}
            return {"documents": self._vec.n_docs, "vectors": self._vec.live_vectors()}

    def stats(self) -> dict[str, Any]:
        """documents, vectors (live), bytes_on_disk (whole folder), bytes_per_doc (vector storage
        per live document: token codes + scales + offsets for multi; committed index file / its
        vectors for single), plus tombstones and (multi) segments."""
        self._check_open()
        with self._rw.read():
            disk = sum(e.stat().st_size for e in os.scandir(self.folder) if e.is_file())
            if isinstance(self._vec, SingleStore):
                docs = self._vec.live_count
                per_doc = 0.0
                if self._vec_file and (self.folder / self._vec_file).is_file() and self._vec.index.ntotal:
                    per_doc = (self.folder / self._vec_file).stat().st_size / self._vec.index.ntotal
                return {"documents": docs, "vectors": docs, "bytes_on_disk": disk,
                        "bytes_per_doc": per_doc, "tombstones": len(self._vec.dead)}
            total_docs = sum(s.n_docs for s in self._vec.segments)
            return {"documents": self._vec.n_docs, "vectors": self._vec.live_vectors(),
                    "bytes_on_disk": disk, "bytes_per_doc": self._vec.bytes_per_doc(),
                    "tombstones": total_docs - self._vec.n_docs,
                    "segments": len(self._vec.segments),
                    "token_index": self._vec.token_index is not None}

    def _write_manifest(self) -> None:
        m = {**self.manifest, "updated": now_iso()}
        write_durable_bytes(self.folder / MANIFEST, (json.dumps(m, indent=2) + "\n").encode())
        self._manifest = m

# ---- module functions ---------------------------------------------------------------------
def list_collections(data_dir: str | os.PathLike) -> list[str]:
    """Names of the collections in ``data_dir`` (sorted)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        return []
    return sorted(e.name for e in os.scandir(data_dir)
                  if e.is_dir() and not e.name.startswith(".") and (Path(e.path) / MANIFEST).is_file())


def delete_collection(data_dir: str | os.PathLike, name: str) -> None:
    """Delete a collection folder (refused while another writer holds it)."""
    check_name(name)
    data_dir = Path(data_dir)
    folder = data_dir / name
    if not folder.is_dir():
        raise CollectionNotFoundError(f"no collection {name!r} in {data_dir}")
    if not (folder / MANIFEST).is_file():
        raise NotACollectionError(f"{folder} is not an embedpool collection; not deleting it")
    lock = FileLock(folder / LOCK_FILE)
    if not lock.try_acquire():
        raise CollectionLockedError(f"collection {name!r} has uncommitted writes in progress; "
                                    "close its writer first")
    try:
        trash = data_dir / f".{name}.deleting-{uuid.uuid4().hex[:8]}"
        os.rename(folder, trash)  # disappears atomically
        fsync_dir(data_dir)
    finally:
        lock.release()
    shutil.rmtree(trash, ignore_errors=True)


def _init_folder(folder: Path, name: str, spec: CollectionSpec) -> None:
    db = DocStore(folder / DB_NAME, create=True)
    try:
        db.begin()
        for k, v in (("generation", 0), ("next_int_id", 0), ("next_seg_id", 0),
                     ("vector_file", None), ("token_index", None), ("format_version", FORMAT_VERSION)):
            db.set_meta(k, v)
        db.commit()
    finally:
        db.close()
    manifest = new_manifest(name, spec, now_iso(), counts={"documents": 0, "vectors": 0})
    write_durable_bytes(folder / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    for f in (folder / DB_NAME,):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(folder)
