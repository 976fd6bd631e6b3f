"""Sparse store: a sparse collection's rows (token ids and weights, :mod:`index.sparse`) in a
FAISS-backend folder, searched exactly or through a Seismic inverted index.

Committed like a single-vector store: a base file ``sparse-<gen>.npz`` (the ``sparse_file`` meta
key) plus one append-only delta per later commit that added rows, ``sparse-<gen>.delta.npz``
(the ``sparse_deltas`` list). Each holds CSR arrays -- ``ids`` (internal int64, ascending),
``indptr``, ``indices`` (uint16 for a vocabulary of up to 65,536 entries, else int32) and
``values`` (float32) -- so a document costs 6 or 8 bytes per non-zero weight plus 16 (its id
and row offset). Removed rows are tombstones (the document store no longer has their ids;
loading drops them) until :meth:`SparseStore.compacted` writes one new base of the live rows.

In memory the rows are CSR chunks (the committed rows, then the rows added since, merged into
chunks of up to :data:`CHUNK_BYTES`), each with its ids and a live mask. Internal ids only grow,
so the chunks' ids are ascending end to end: a row is found by binary search.

**Exact search** scores each query against every live row by a sparse matrix product
(:func:`index.sparse.exact_topk`). **Seismic** (``pyseismic-lsr``) builds a static index: it
has no insert or delete. So it is used as a rebuildable approximate index over the stored rows,
never as their storage: built from the live rows by the first approximate search (and again
when the rows added or deleted since reach :data:`REBUILD_FRACTION` of the rows it holds, and
after compaction); rows added after the build are scored exactly beside it, deleted ones and a
metadata filter's non-matches dropped from its candidates (fetching more until ``k`` remain, or
exactly among the filter's rows when the filter keeps few). Its candidates are scored again
exactly, so the scores are the exact path's. The index is kept in memory only: a reopened
collection builds it again on its first approximate search.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from ..durable import write_durable
from embedpool.errors import InternalError
from ..sparse import empty_rows, exact_topk, index_dtype, parse_sparse_factory, row_bytes, stored_bytes
from ..spec import CollectionSpec
from .vectors import BaseAndDeltas, StoreCommit, StoreState

#: rows added since the last commit are merged into the last chunk while it is smaller than this
CHUNK_BYTES = 16 << 20
#: Seismic is rebuilt when the rows added or deleted since its build reach this share of its rows' bytes
REBUILD_FRACTION = 0.125
#: a filter that keeps at most this many rows is answered exactly among them
EXACT_AMONG = 4096
_STDOUT_LOCK = threading.Lock()


@dataclass
class Chunk:
    ids: np.ndarray  # int64, ascending
    rows: sp.csr_matrix
    alive: np.ndarray  # bool


@dataclass
class Approx:
    """A built Seismic index: the rows it holds end at ``top_id``; ``nbytes`` their size."""

    index: Any
    top_id: int
    nbytes: int
    changed: int = 0  # bytes of the rows added after it or deleted from it since


class SparseStore(BaseAndDeltas):
    """A sparse collection's rows (module docstring)."""

    META_KEYS = ("sparse_file", "sparse_deltas")
    META_KEY = "sparse_file"
    DELTAS_KEY = "sparse_deltas"
    FILE_PREFIX = "sparse"
    dirty = False

    def __init__(self, spec: CollectionSpec, file: str | None = None) -> None:
        self.spec = spec
        self.factory = parse_sparse_factory(spec.factory)
        self.file = file
        self.deltas: list[str] = []
        self.chunks: list[Chunk] = []
        self.pending: list[tuple[np.ndarray, sp.csr_matrix]] = []
        self.full_write = file is None
        self.dirty = False
        self._approx: Approx | None = None
        self._approx_lock = threading.Lock()

    # ---- committed state ------------------------------------------------------------------
    @classmethod
    def load(cls, spec: CollectionSpec, folder: Path, state: StoreState,
             live_ids: np.ndarray | None) -> "SparseStore":
        """The committed rows, checked against the live ids (rows not among them are tombstones)."""
        name = state.meta.get(cls.META_KEY)
        store = cls(spec, name)
        store.deltas = list(state.meta.get(cls.DELTAS_KEY) or [])
        parts = [_read(folder / f, spec.dim) for f in store.committed_files(state)]
        live = np.sort(np.asarray(live_ids if live_ids is not None else [], np.int64))
        if parts:
            ids = np.concatenate([p[0] for p in parts])
            rows = sp.vstack([p[1] for p in parts], format="csr") if len(parts) > 1 else parts[0][1]
            alive = np.isin(ids, live)
            store.chunks = [Chunk(ids, rows, alive)]
            missing = np.setdiff1d(live, ids)
        else:
            missing = live
        if len(missing):
            raise InternalError(f"sparse rows lack {len(missing)} documents of the document store "
                                f"(e.g. internal id {int(missing[0])})")
        return store

    # ---- writes ---------------------------------------------------------------------------
    def add(self, int_ids: np.ndarray, rows: sp.csr_matrix, companion: None = None) -> None:
        ids = np.asarray(int_ids, np.int64)
        rows = sp.csr_matrix(rows, dtype=np.float32)
        last = self.chunks[-1] if self.chunks else None
        if last is not None and row_bytes(last.rows) < CHUNK_BYTES:
            self.chunks[-1] = Chunk(np.concatenate([last.ids, ids]), sp.vstack([last.rows, rows], format="csr"),
                                    np.concatenate([last.alive, np.ones(len(ids), bool)]))
        else:
            self.chunks.append(Chunk(ids, rows, np.ones(len(ids), bool)))
        self.pending.append((ids, rows))
        if self._approx is not None:
            self._approx.changed += row_bytes(rows)
        self.dirty = True

    def remove(self, int_ids: np.ndarray) -> None:
        for c, pos in self._locate(np.asarray(int_ids, np.int64)):
            c.alive[pos] = False
            if self._approx is not None:
                self._approx.changed += row_bytes(c.rows[pos])

    def _locate(self, ids: np.ndarray) -> list[tuple[Chunk, np.ndarray]]:
        """Per chunk, the rows of those of ``ids`` it holds."""
        out = []
        for c in self.chunks:
            if not len(c.ids) or not len(ids):
                continue
            pos = np.searchsorted(c.ids, ids)
            pos = pos[pos < len(c.ids)]
            pos = pos[np.isin(c.ids[pos], ids)]
            if len(pos):
                out.append((c, pos))
        return out

    def write(self, folder: Path, gen: int) -> StoreCommit:
        """The rows added since the last commit as a delta; all live rows as a new base the
        first time and after compaction; nothing for removals alone."""
        if not self.dirty:
            return StoreCommit()
        if self.full_write or self.file is None:
            name = f"{self.FILE_PREFIX}-{gen:08d}.npz"
            ids, rows = self._live()
            _write(folder / name, ids, rows)
            return StoreCommit(meta={self.META_KEY: name, self.DELTAS_KEY: []})
        if not self.pending:
            return StoreCommit()
        name = f"{self.FILE_PREFIX}-{gen:08d}.delta.npz"
        _write(folder / name, np.concatenate([i for i, _ in self.pending]),
               sp.vstack([r for _, r in self.pending], format="csr"))
        return StoreCommit(meta={self.DELTAS_KEY: [*self.deltas, name]})

    def mark_committed(self, commit: StoreCommit) -> None:
        self.dirty = False
        self.file = commit.meta.get(self.META_KEY, self.file)
        self.deltas = list(commit.meta.get(self.DELTAS_KEY, self.deltas))
        self.pending = []
        self.full_write = False

    def compacted(self, folder: Path) -> "SparseStore | None":
        """A store of the live rows in one chunk, written as one new base by the next commit;
        ``None`` if there are no tombstones and no deltas."""
        if not self.deltas and not self._tombstones() and len(self.chunks) <= 1:
            return None
        new = type(self)(self.spec, self.file)
        ids, rows = self._live()
        if len(ids):
            new.chunks = [Chunk(ids, rows, np.ones(len(ids), bool))]
        new.full_write = new.dirty = True
        return new

    # ---- reads ----------------------------------------------------------------------------
    def _live(self) -> tuple[np.ndarray, sp.csr_matrix]:
        parts = [(c.ids[c.alive], c.rows[np.flatnonzero(c.alive)]) for c in self.chunks]
        if not parts:
            return np.zeros(0, np.int64), empty_rows(self.spec.dim)
        return np.concatenate([i for i, _ in parts]), sp.vstack([r for _, r in parts], format="csr")

    def _tombstones(self) -> int:
        return sum(int((~c.alive).sum()) for c in self.chunks)

    @property
    def n_docs(self) -> int:
        return sum(int(c.alive.sum()) for c in self.chunks)

    def live_vectors(self) -> int:
        return self.n_docs

    def vectors_of(self, int_id: int) -> dict[str, Any]:
        for c, pos in self._locate(np.array([int_id], np.int64)):
            r = c.rows[int(pos[0])]
            return {"vector": {"indices": r.indices.astype(np.int64), "values": r.data.astype(np.float32)}}
        raise InternalError(f"no sparse row for internal id {int_id}")

    def _stored_bytes(self) -> int:
        return sum(row_bytes(c.rows) for c in self.chunks)

    def storage_stats(self, folder: Path) -> dict[str, Any]:
        """bytes_per_doc: the live rows as the files store them (token ids, weights, id and row
        offset), per live document."""
        n = self.n_docs
        nnz = sum(int(np.diff(c.rows.indptr)[c.alive].sum()) for c in self.chunks)
        per_doc = stored_bytes(nnz, n, self.spec.dim) / n if n else 0.0
        kind = self.factory.resolved(self._stored_bytes())
        return {"bytes_per_doc": per_doc, "tombstones": self._tombstones(), "segments": None, "token_index": False,
                "index_type": kind if self.factory.kind == kind else f"{self.factory.kind} ({kind})",
                "companion_rows": None}

    def search(self, x: sp.csr_matrix, k: int, ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k ``(scores, int ids)`` per query (padded with ``nan``/``-1``), among ``ids``
        (sorted live internal ids of a metadata filter) if given."""
        if self.factory.resolved(self._stored_bytes()) == "exact" or x.shape[0] == 0:
            return self.exact(x, k, ids)
        if ids is not None and len(ids) <= EXACT_AMONG:
            return self._exact_among(x, k, ids)
        return self._approximate(x, k, ids)

    def exact(self, x: sp.csr_matrix, k: int, ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The exact top-k over every live row (among ``ids``): the reference."""
        parts = [exact_topk(c.rows, c.ids, x, k, c.alive if ids is None else c.alive & np.isin(c.ids, ids))
                 for c in self.chunks]
        return _merge(parts, x.shape[0], k)

    def _approximate(self, x: sp.csr_matrix, k: int, ids: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        approx = self._built()
        if approx is None:
            return self.exact(x, k, ids)
        import seismic

        st = seismic.get_seismic_string()
        opts = self.factory.search
        nq = x.shape[0]
        out_d = np.full((nq, k), np.nan, np.float32)
        out_i = np.full((nq, k), -1, np.int64)
        for q in range(nq):
            row = x[q]
            comps = np.array([str(int(t)) for t in row.indices], dtype=st)
            vals = np.ascontiguousarray(row.data, np.float32)
            kk, cands = k, np.zeros(0, np.int64)
            while len(comps):
                res = approx.index.search("q", comps, vals, kk, int(opts["query_cut"]), float(opts["heap_factor"]))
                found = np.array([int(r[2]) for r in res], np.int64)
                cands = self._usable(found, ids)
                if len(cands) >= k or len(found) < kk:
                    break
                kk *= 4
            # candidates, and the rows added after the build, scored exactly over the stored rows
            tail = [c.ids[np.searchsorted(c.ids, approx.top_id, side="right"):] for c in self.chunks]
            among = np.union1d(cands, self._usable(np.concatenate(tail), ids) if tail else cands)
            d, i = self._exact_among(row, k, among)
            out_d[q], out_i[q] = d[0], i[0]
        return out_d, out_i

    def _exact_among(self, x: sp.csr_matrix, k: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The exact top-k among the rows of ``ids`` (sorted), reading only those rows."""
        return _merge([exact_topk(c.rows[pos], c.ids[pos], x, k, c.alive[pos]) for c, pos in self._locate(ids)],
                      x.shape[0], k)

    def _usable(self, found: np.ndarray, ids: np.ndarray | None) -> np.ndarray:
        """Those of ``found`` that are live (and among ``ids``)."""
        keep = np.zeros(len(found), bool)
        for c, pos in self._locate(np.sort(found)):
            keep |= np.isin(found, c.ids[pos[c.alive[pos]]])
        if ids is not None:
            keep &= np.isin(found, ids)
        return found[keep]

    def _built(self) -> Approx | None:
        """The Seismic index, built (again) if there is none or it is stale."""
        with self._approx_lock:
            a = self._approx
            if a is None or a.changed > REBUILD_FRACTION * a.nbytes:
                self._approx = a = self._build()
            return a

    def _build(self) -> Approx | None:
        import seismic

        ids, rows = self._live()
        if rows.nnz == 0:
            return None
        rows.sort_indices()
        ds = seismic.SeismicDataset()
        ds.add_documents_by_id([str(int(i)) for i in ids], rows.indices.astype(np.int64),
                               rows.data.astype(np.float32), rows.indptr.astype(np.int64))
        b = self.factory.build
        with _stdout_to_stderr():  # Seismic prints its progress on stdout, where `embedpool search` writes JSON
            index = seismic.SeismicIndex.build_from_dataset(
                ds, n_postings=int(b["n_postings"]), centroid_fraction=float(b["centroid_fraction"]),
                summary_energy=float(b["summary_energy"]))
        return Approx(index, int(ids[-1]), row_bytes(rows))

    # ---- the store's empty state ------------------------------------------------------------
    @classmethod
    def empty(cls, spec: CollectionSpec) -> "SparseStore":
        return cls(spec)


def _merge(parts: list[tuple[np.ndarray, np.ndarray]], nq: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best k of several chunks' top-k lists (earlier chunks first on ties)."""
    if not parts:
        return np.full((nq, k), np.nan, np.float32), np.full((nq, k), -1, np.int64)
    if len(parts) == 1:
        return parts[0]
    d = np.concatenate([p[0] for p in parts], axis=1)
    i = np.concatenate([p[1] for p in parts], axis=1)
    order = np.argsort(-np.where(i >= 0, d, -np.inf), axis=1, kind="stable")[:, :k]
    return np.take_along_axis(d, order, 1), np.take_along_axis(i, order, 1)


def _write(path: Path, ids: np.ndarray, rows: sp.csr_matrix) -> None:
    rows = sp.csr_matrix(rows)
    rows.sort_indices()
    write_durable(path, lambda f: np.savez(
        f, ids=np.asarray(ids, np.int64), indptr=rows.indptr.astype(np.int64),
        indices=rows.indices.astype(index_dtype(rows.shape[1])), values=rows.data.astype(np.float32)))


def _read(path: Path, dim: int) -> tuple[np.ndarray, sp.csr_matrix]:
    with np.load(path) as z:
        ids, indptr, indices, values = z["ids"], z["indptr"], z["indices"], z["values"]
    return ids.astype(np.int64), sp.csr_matrix((values, indices.astype(np.int32), indptr), shape=(len(ids), dim))


@contextlib.contextmanager
def _stdout_to_stderr():
    """File descriptor 1 pointed at 2 while a library writes its progress there (process-wide,
    so one build at a time)."""
    with _STDOUT_LOCK:
        try:
            sys.stdout.flush()
            saved = os.dup(1)
        except (OSError, ValueError):
            yield
            return
        try:
            os.dup2(2, 1)
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)
