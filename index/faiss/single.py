"""Single-vector store: one FAISS index (built by ``index_factory``) keyed by internal int64 ids.

Committed as a base file, ``vectors-<gen>.faiss`` (the ``vector_file`` meta key), plus one
append-only delta per later commit that added vectors, ``vectors-<gen>.delta.npz`` (the
``vector_deltas`` list): the ids and rows that commit added -- for an IVF index its codes as
FAISS encodes them (``sa_encode``: list number + code), so loading appends them without
assigning them again (``add_sa_codes``); else the vectors. A commit therefore writes what it
added, never the whole index again. Removed rows are tombstones in the files (the document store
no longer has their ids; loading removes them) until :meth:`SingleStore.compacted` writes one
new base. Indexes that cannot remove rows (HNSW) are written whole at every commit, as before.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from ..durable import write_durable
from embedpool.errors import InternalError, InvalidError
from ..spec import CollectionSpec, _faiss_metric, _first_line
from .vectors import BaseAndDeltas, StoreCommit, StoreState, npz_memmap

HNSW_EF_SEARCH = 64
_MAP_LOCK = threading.Lock()
#: a filter that keeps at most this many vectors of an approximate index is answered exactly
#: over them (reconstructed), instead of by the index with a selector
EXACT_AMONG = 4096
EXACT_BLOCK = 16_384


def id_selector(ids: np.ndarray) -> faiss.IDSelector:
    """FAISS' selector of these ids: a bitmap where they are dense enough (document ids), else a
    hash set (companion row ids). The bitmap's buffer is kept on the selector."""
    top = int(ids[-1]) + 1 if len(ids) else 0
    if top <= 64 * len(ids) + (1 << 16):
        mask = np.zeros(top, bool)
        mask[ids] = True
        bits = np.packbits(mask, bitorder="little")
        sel = faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits))  # n: bytes of the bitmap
        sel.bits_ref = bits  # FAISS keeps a pointer, not a copy
        return sel
    return faiss.IDSelectorBatch(len(ids), faiss.swig_ptr(np.ascontiguousarray(ids, np.int64)))


def min_training_vectors(factory: str) -> int:
    """Fewest vectors FAISS accepts to train ``factory`` (0 if it needs no training).

    IVF<n> needs n points (one per centroid); PQ/RQ with b bits needs 2**b per sub-quantizer.
    """
    need = 0
    for m in re.finditer(r"IVF(\d+)", factory):
        need = max(need, int(m.group(1)))
    for m in re.finditer(r"(?:PQ|RQ|LSQ)\d+(?:x(\d+))?", factory):
        need = max(need, 2 ** int(m.group(1) or 8))
    if re.search(r"SQ\d|SQfp16|SQbf16", factory):
        need = max(need, 1)
    return need


def default_nprobe(nlist: int) -> int:
    """Inverted lists probed per query: 1/4 of them, at least 8 (all of them if fewer).

    Measured (bench/million.py, MiniLM ``mean`` vectors, 100k documents, IVF1024): recall@100
    against exact search 0.92 at 1/16 of the lists, 0.96 at 1/8, 0.98 at 1/4 (1.5 ms a query
    with SQ8 codes); two_stage search takes its 100 candidates from it."""
    return min(nlist, max(8, nlist // 4))


def recommended_training_vectors(factory: str) -> int:
    """What FAISS recommends (39 points per centroid); more than :func:`min_training_vectors`."""
    rec = min_training_vectors(factory)
    for m in re.finditer(r"IVF(\d+)", factory):
        rec = max(rec, 39 * int(m.group(1)))
    return rec


class SingleStore(BaseAndDeltas):
    """A FAISS index with ids. Indexes that cannot remove (HNSW) keep removed ids as ``dead``:
    they are filtered out of search results (over-fetching) until :meth:`rebuilt`."""

    META_KEYS = ("vector_file", "vector_deltas")
    #: the ``meta`` key naming the committed index file, and that file's name before ``-<gen>``
    META_KEY = "vector_file"
    #: the ``meta`` key listing the committed deltas appended to it
    DELTAS_KEY = "vector_deltas"
    FILE_PREFIX = "vectors"
    dirty = False  # index changed since last write

    def __init__(self, spec: CollectionSpec, index: faiss.Index, file: str | None = None) -> None:
        self.spec = spec
        self.index = index
        self.file = file  # the committed index file
        self.dead: set[int] = set()
        self._dead_arr: np.ndarray | None = None
        self.dirty = False
        self.removable = _probe_removable(index)
        self.hnsw = _is_hnsw(index)
        self.deltas: list[str] = []  # committed delta files, in order
        self.ivf_codes = isinstance(faiss.downcast_index(index), faiss.IndexIVF)  # deltas hold sa codes
        self.appendable = self.removable  # else (HNSW) every commit writes the whole index
        # a flat index compares the query with every stored vector: a filtered search is exact
        self.exact = isinstance(_inner(index), faiss.IndexFlat)
        self.full_write = file is None  # the next commit writes a new base (first, or compacted)
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []  # (ids, rows) for the next delta
        self.file_tombstones = 0  # rows removed since the base was written (still in the files)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def empty(cls, spec: CollectionSpec) -> "SingleStore":
        idx = faiss.index_factory(spec.dim, spec.factory, _faiss_metric(spec.metric))
        if not isinstance(idx, faiss.IndexIDMap2) and not _has_ivf(idx):
            idx = faiss.IndexIDMap2(idx)
        _no_polysemous(idx)
        if _has_ivf(idx):
            ivf = faiss.extract_index_ivf(idx)
            ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # reconstruct + remove by id
            ivf.nprobe = default_nprobe(ivf.nlist)
        inner = _inner(idx)
        if isinstance(inner, faiss.IndexHNSW):
            inner.hnsw.efSearch = HNSW_EF_SEARCH
        return cls(spec, idx)

    @classmethod
    def load(cls, spec: CollectionSpec, folder: Path, state: StoreState,
             live_ids: np.ndarray) -> "SingleStore":
        """Load the committed index file and check it holds exactly the live documents."""
        name = state.meta.get(cls.META_KEY)
        store = cls.empty(spec) if not name else cls(spec, faiss.read_index(str(folder / name)), name)
        if name and store.ivf_codes:
            # no id -> (list, offset) hashtable until reconstruct or remove needs it: ~50 bytes a
            # row in memory (50 MB at a million) and its upkeep while the deltas are appended
            faiss.extract_index_ivf(store.index).set_direct_map_type(faiss.DirectMap.NoMap)
        deltas = list(state.meta.get(cls.DELTAS_KEY) or [])
        if not (deltas and store._append_ivf_deltas([folder / d for d in deltas])):
            for delta in deltas:
                with np.load(folder / delta) as z:
                    store._append(z["ids"], z["rows"])
        store.deltas.extend(deltas)
        live = np.asarray(live_ids, dtype=np.int64)
        idx = store.index
        stored = _stored_ids(idx)
        if stored is not None:
            stored, live = np.sort(stored), np.sort(live)
            if np.array_equal(stored, live):  # the usual case, 5x faster than two setdiffs
                return store
            missing = np.setdiff1d(live, stored, assume_unique=True)
            if len(missing):
                raise InternalError(
                    f"vector index lacks {len(missing)} documents of the document store "
                    f"(e.g. internal id {int(missing[0])})")
            dead = np.setdiff1d(stored, live, assume_unique=True)
            if len(dead) and store.removable:  # tombstones in the files: removed documents
                store.direct_map()
                idx.remove_ids(dead)
                store.file_tombstones = len(dead)
            else:
                store.dead = set(dead.tolist())
        elif idx.ntotal != len(live):
            raise InternalError(
                f"vector index holds {idx.ntotal} vectors but the document store {len(live)} documents")
        return store

    def direct_map(self) -> faiss.Index:
        """The index, with its id -> (list, offset) map built if a load left it out (IVF): what
        ``reconstruct`` and a targeted ``remove_ids`` need."""
        if self.ivf_codes:
            with _MAP_LOCK:  # readers share the index: one of them builds the map
                ivf = faiss.extract_index_ivf(self.index)
                if ivf.direct_map.type == faiss.DirectMap.NoMap:
                    ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
        return self.index

    # ---- writes -------------------------------------------------------------------------
    def check_add(self, n: int, companion: None = None) -> None:
        """The first batch trains the index: refuse one too small to train on."""
        if self.index.is_trained:
            return
        need = min_training_vectors(self.spec.factory)
        if n < max(need, 1):
            rec = recommended_training_vectors(self.spec.factory)
            raise InvalidError(
                f"index {self.spec.factory!r} is trained on the first batch added, which must hold "
                f"at least {need} vectors (FAISS recommends {rec}); this batch has {n}. Add a larger "
                "first batch, or use a factory that needs no training ('IDMap2,Flat', 'HNSW32')", param="factory")

    def add(self, int_ids: np.ndarray, x: np.ndarray, companion: None = None) -> None:
        if not self.index.is_trained:
            self.check_add(len(x))
            try:
                self.index.train(x)
            except RuntimeError as e:
                raise InvalidError(f"training {self.spec.factory!r} failed: {_first_line(e)}",
                                   param="factory") from None
        ids = np.asarray(int_ids, dtype=np.int64)
        if self.appendable and not self.full_write:  # kept for the next commit's delta
            rows = self.index.sa_encode(x) if self.ivf_codes else np.array(x, np.float32)
            self._append(ids, rows)
            self.pending.append((ids, rows))
        else:
            self.index.add_with_ids(x, ids)
        self.dirty = True

    def _append_ivf_deltas(self, paths: list[Path]) -> bool:
        """Add the rows of the delta files ``paths`` to an IVF index's lists, each list allocated
        once at its final size; False (nothing done) where that does not apply.

        ``add_sa_codes`` delta after delta grows every list by reallocation, and the grown
        vectors keep up to their size again as spare capacity, resident where the heap reuses
        pages: ~80 MB at a million companion rows (docs/scale.md). So the rows per list are
        counted first from each row's list number (the first ``coarse_code_size`` bytes of an
        IVF ``sa_encode`` code, little-endian, which ``add_sa_codes`` reads the same way), new
        lists are allocated at exactly that size, and the base's entries and the deltas' are
        copied in, in the order ``add_sa_codes`` would have appended them."""
        ivf = faiss.downcast_index(self.index)
        if not isinstance(ivf, faiss.IndexIVF):
            return False
        old = faiss.downcast_InvertedLists(ivf.invlists)
        if not isinstance(old, faiss.ArrayInvertedLists):
            return False
        nlist, nb, cs = ivf.nlist, ivf.coarse_code_size(), old.code_size
        files = []
        for path in paths:
            m = npz_memmap(path, ("ids", "rows"))
            if len(m) < 2 or m["rows"].ndim != 2 or m["rows"].shape[1] != nb + cs:
                return False
            listno = np.zeros(len(m["ids"]), np.int64)
            for b in range(nb):  # the coarse code: the list number, little-endian
                listno |= m["rows"][:, b].astype(np.int64) << (8 * b)
            if len(listno) and int(listno.max()) >= nlist:
                return False  # not this index's codes: add_sa_codes says so
            files.append((m, listno))
        counts = np.array([old.list_size(lst) for lst in range(nlist)], np.int64)
        fill = counts.copy()
        final = counts + sum(np.bincount(ln, minlength=nlist) for _, ln in files)
        new = faiss.ArrayInvertedLists(nlist, cs)
        for lst in np.flatnonzero(final).tolist():
            new.resize(lst, int(final[lst]))  # from empty: one allocation of exactly this size
            if counts[lst]:
                new.update_entries(lst, 0, int(counts[lst]), old.get_ids(lst), old.get_codes(lst))
        for m, listno in files:
            order = np.argsort(listno, kind="stable")  # rows of a list keep their order
            ids = np.ascontiguousarray(m["ids"][order], dtype=np.int64)
            codes = np.ascontiguousarray(m["rows"][order, nb:])
            bounds = np.searchsorted(listno[order], np.arange(nlist + 1))
            for lst in np.flatnonzero(np.diff(bounds)).tolist():
                a, b = int(bounds[lst]), int(bounds[lst + 1])
                new.update_entries(lst, int(fill[lst]), b - a, faiss.swig_ptr(ids[a:b]), faiss.swig_ptr(codes[a:b]))
                fill[lst] += b - a
        ivf.replace_invlists(new, True)
        new.this.disown()  # the index owns and frees it (and freed the old lists)
        ivf.ntotal += int(final.sum() - counts.sum())  # as add_sa_codes counts them
        return True

    def _append(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Add rows as a delta holds them (IVF codes, else vectors)."""
        if self.ivf_codes:
            self.index.add_sa_codes(np.ascontiguousarray(rows, np.uint8), np.asarray(ids, np.int64))
        else:
            self.index.add_with_ids(np.ascontiguousarray(rows, np.float32), np.asarray(ids, np.int64))

    def remove(self, int_ids: np.ndarray) -> None:
        ids = np.asarray(int_ids, dtype=np.int64)
        if not len(ids):
            return
        if self.removable:
            self.direct_map()
            self.index.remove_ids(ids)
            self.file_tombstones += len(ids)
            self.dirty = True
        else:
            self.dead.update(ids.tolist())
            self._dead_arr = None

    def compacted(self, folder: Path | None = None) -> "SingleStore | None":
        """HNSW tombstones: rebuilt; deltas or removed rows in the files: this store, to be
        written as one new base by the next commit; else ``None``."""
        if self.dead:
            return self.rebuilt()
        if self.deltas or self.file_tombstones:
            self.full_write = self.dirty = True
            return self
        return None

    # ---- reads --------------------------------------------------------------------------
    def vectors_of(self, int_id: int) -> dict[str, np.ndarray]:
        return {"vector": self.direct_map().reconstruct(int(int_id))}

    @property
    def n_docs(self) -> int:
        return int(self.index.ntotal) - len(self.dead)

    def live_vectors(self) -> int:
        return self.n_docs

    def storage_stats(self, folder: Path) -> dict[str, Any]:
        """bytes_per_doc: the committed index file over the vectors it holds."""
        per_doc = 0.0
        files = [folder / f for f in ([self.file] if self.file else []) + self.deltas]
        if files and all(f.is_file() for f in files) and self.index.ntotal:
            per_doc = sum(f.stat().st_size for f in files) / self.index.ntotal
        return {"bytes_per_doc": per_doc, "tombstones": len(self.dead), "segments": None,
                "token_index": False, "index_type": self.spec.factory, "companion_rows": None}

    def search(self, x: np.ndarray, k: int, ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, int ids) per query; rows padded with -1 ids when fewer exist.

        ``ids``: only these (live, sorted) ids may be returned -- a metadata filter, applied
        inside the search (:meth:`_search_among`), so that ``min(k, len(ids))`` come back."""
        nq = len(x)
        ntotal = int(self.index.ntotal)
        out_d = np.full((nq, k), np.nan, dtype=np.float32)
        out_i = np.full((nq, k), -1, dtype=np.int64)
        if ntotal == 0 or nq == 0:
            return out_d, out_i
        if ids is not None:
            return self._search_among(x, k, ids, out_d, out_i)
        kk = min(ntotal, k if not self.dead else 2 * k + 16)
        while True:
            D, I = self._raw_search(x, kk)
            if self.dead:
                if self._dead_arr is None:
                    self._dead_arr = np.fromiter(self.dead, dtype=np.int64, count=len(self.dead))
                keep = (I >= 0) & ~np.isin(I, self._dead_arr)
            else:
                keep = I >= 0
            if kk >= ntotal or bool((keep.sum(axis=1) >= min(k, self.n_docs)).all()):
                break
            kk = min(ntotal, kk * 4)
        for r in range(nq):  # loop over queries (at most k results each)
            sel = np.flatnonzero(keep[r])[:k]
            out_d[r, :len(sel)] = D[r, sel]
            out_i[r, :len(sel)] = I[r, sel]
        return out_d, out_i

    def _search_among(self, x: np.ndarray, k: int, ids: np.ndarray, out_d: np.ndarray,
                      out_i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Filtered search. A flat index scans every vector with FAISS' ID selector: exact. An
        approximate one (HNSW, IVF) searches with the selector too -- HNSW's graph and IVF's
        probed lists may hold fewer than ``k`` selected vectors -- and a query left short (or
        a filter that keeps at most :data:`EXACT_AMONG` vectors) is answered exactly over the
        selected vectors themselves (reconstructed), so ``k`` results come back whenever ``k``
        documents match."""
        ids = np.asarray(ids, np.int64)
        want = min(k, len(ids))
        if want == 0:
            return out_d, out_i
        if not self.exact and len(ids) <= EXACT_AMONG:
            return self._exact_among(x, k, ids, out_d, out_i, np.arange(len(x)))
        sel = id_selector(ids)  # referenced until the search returns: FAISS holds a bare pointer
        D, I = self._raw_search(x, want, sel=sel)
        out_d[:, :want], out_i[:, :want] = D, I
        short = np.flatnonzero((I >= 0).sum(axis=1) < want)
        if len(short):
            self._exact_among(x, k, ids, out_d, out_i, short)
        return out_d, out_i

    def _exact_among(self, x: np.ndarray, k: int, ids: np.ndarray, out_d: np.ndarray, out_i: np.ndarray,
                     rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k of queries ``rows`` over the stored vectors of ``ids`` (their codes, as
        the index compares them), in blocks of :data:`EXACT_BLOCK` vectors."""
        ip = self.index.metric_type == faiss.METRIC_INNER_PRODUCT
        q = x[rows]
        best_d = np.full((len(rows), 0), np.nan, np.float32)
        best_i = np.zeros((len(rows), 0), np.int64)
        for a in range(0, len(ids), EXACT_BLOCK):
            part = ids[a:a + EXACT_BLOCK]
            v = self.direct_map().reconstruct_batch(part)
            d = q @ v.T if ip else (q * q).sum(1)[:, None] - 2 * q @ v.T + (v * v).sum(1)[None, :]
            best_d = np.concatenate([best_d, d.astype(np.float32)], axis=1)
            best_i = np.concatenate([best_i, np.broadcast_to(part, (len(rows), len(part)))], axis=1)
            order = np.argsort(-best_d if ip else best_d, axis=1, kind="stable")[:, :k]
            best_d = np.take_along_axis(best_d, order, 1)
            best_i = np.take_along_axis(best_i, order, 1)
        n = best_d.shape[1]
        out_d[rows, :n], out_i[rows, :n] = best_d, best_i
        out_d[rows, n:], out_i[rows, n:] = np.nan, -1
        return out_d, out_i

    def _raw_search(self, x: np.ndarray, kk: int, sel: faiss.IDSelector | None = None) -> tuple[np.ndarray, np.ndarray]:
        if self.hnsw:
            return self.index.search(x, kk, params=faiss.SearchParametersHNSW(efSearch=max(kk, HNSW_EF_SEARCH), sel=sel))
        if sel is not None and self.ivf_codes:
            ivf = faiss.extract_index_ivf(self.index)
            return self.index.search(x, kk, params=faiss.SearchParametersIVF(sel=sel, nprobe=ivf.nprobe))
        return self.index.search(x, kk, params=None if sel is None else faiss.SearchParameters(sel=sel))

    # ---- persistence --------------------------------------------------------------------
    def write(self, folder: Path, gen: int) -> StoreCommit:
        """What changed: the rows added since the last commit as a delta,
        ``<FILE_PREFIX>-<gen>.delta.npz``; the whole index, ``<FILE_PREFIX>-<gen>.faiss``, the
        first time, after compaction, and for an index that cannot remove rows (HNSW); nothing
        for removals alone (the document store records them)."""
        if not self.dirty:
            return StoreCommit()
        if self.full_write or not self.appendable or self.file is None:
            name = f"{self.FILE_PREFIX}-{gen:08d}.faiss"
            write_durable(folder / name, write_to=lambda tmp: faiss.write_index(self.index, tmp))
            return StoreCommit(meta={self.META_KEY: name, self.DELTAS_KEY: []})
        if not self.pending:
            return StoreCommit()
        name = f"{self.FILE_PREFIX}-{gen:08d}.delta.npz"
        ids = np.concatenate([i for i, _ in self.pending])
        rows = np.concatenate([r for _, r in self.pending])
        write_durable(folder / name, lambda f: np.savez(f, ids=ids, rows=rows))
        return StoreCommit(meta={self.DELTAS_KEY: [*self.deltas, name]})

    def mark_committed(self, commit: StoreCommit) -> None:
        self.dirty = False
        if self.META_KEY in commit.meta:
            self.file_tombstones = 0
        self.file = commit.meta.get(self.META_KEY, self.file)
        self.deltas = list(commit.meta.get(self.DELTAS_KEY, self.deltas))
        self.pending = []
        self.full_write = False

    def rebuilt(self) -> "SingleStore":
        """A new store with only the live vectors (same ids): drops HNSW tombstones."""
        new = type(self).empty(self.spec)
        new.file, new.full_write = self.file, True
        idx = self.index
        if isinstance(idx, faiss.IndexIDMap2) and idx.ntotal:
            ids = faiss.vector_to_array(idx.id_map).astype(np.int64)
            vecs = _inner(idx).reconstruct_n(0, idx.ntotal)
            if self.dead:
                keep = ~np.isin(ids, np.fromiter(self.dead, dtype=np.int64))
                ids, vecs = ids[keep], vecs[keep]
            if len(ids):
                new.add(ids, np.ascontiguousarray(vecs, dtype=np.float32))
            new.dirty = True
            return new
        self.dirty = True  # index with ids inside (IVF): removal is exact, nothing to drop
        return self


def _no_polysemous(idx: faiss.Index) -> None:
    """The factory turns on polysemous training for PQ codes (``PQ<m>`` without ``np``): a
    code-reordering step that only serves Hamming-filtered search, which we never enable, and that
    takes ~15 s even on a few hundred vectors. Switch it off; ADC search results are unaffected."""
    for sub in (_inner(idx), ):
        sub = faiss.downcast_index(sub)
        if hasattr(sub, "do_polysemous_training"):
            sub.do_polysemous_training = False
    if _has_ivf(idx):
        ivf = faiss.extract_index_ivf(idx)
        if hasattr(ivf, "do_polysemous_training"):
            ivf.do_polysemous_training = False


def _stored_ids(idx: faiss.Index) -> np.ndarray | None:
    """The ids an index holds (IDMap2, IVF), else ``None``."""
    if isinstance(idx, faiss.IndexIDMap2):
        return faiss.vector_to_array(idx.id_map).astype(np.int64)
    ivf = faiss.downcast_index(idx)
    if not isinstance(ivf, faiss.IndexIVF):
        return None
    inv = ivf.invlists
    parts = [faiss.rev_swig_ptr(inv.get_ids(i), inv.list_size(i)).copy()
             for i in range(ivf.nlist) if inv.list_size(i)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _inner(idx: faiss.Index) -> faiss.Index:
    if isinstance(idx, (faiss.IndexIDMap, faiss.IndexIDMap2)):
        return faiss.downcast_index(idx.index)
    return faiss.downcast_index(idx)


def _has_ivf(idx: faiss.Index) -> bool:
    try:
        faiss.extract_index_ivf(idx)
        return True
    except Exception:
        return False


def _is_hnsw(idx: faiss.Index) -> bool:
    return isinstance(_inner(idx), faiss.IndexHNSW)


def _probe_removable(idx: faiss.Index) -> bool:
    """Whether ``remove_ids`` works (it raises for HNSW); removes nothing."""
    try:
        idx.remove_ids(np.array([-1], dtype=np.int64))
        return True
    except RuntimeError:
        return False
