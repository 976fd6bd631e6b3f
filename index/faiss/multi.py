"""Multi-vector store: append-only segments of contiguous token vectors, exact MaxSim,
and an optional token-level FAISS index for candidate generation.

A segment is written once, by the commit that creates it (``seg-<id>.vec.npy`` holds the token
codes, ``seg-<id>.aux.npz`` the document offsets, internal ids, int8 scales and, for a
collection that keeps companion rows, each document's row count). A document
removed or replaced later is a tombstone: its internal id is no longer in the document store,
so it is masked out of every search; :meth:`MultiStore.compacted` merges the live documents
into one new segment.

Its state in the document store: the ``segments`` rows, ``next_seg_id``, ``token_index``
(``{"file": "tokens-<gen>.faiss", "segments": [...]}``: the segments whose tokens it holds) and
``companion_file`` (the companion rows' index, :mod:`index.faiss.companion`).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from ..durable import fsync_dir, fsync_path, write_durable
from embedpool.errors import InternalError, InvalidError
from .companion import CompanionRows, row_ids
from ..int8scan import doc_norms, maxsim_topk
from ..maxsim import bytes_per_vector, dequantize, gather_docs, quantize
from .single import id_selector, min_training_vectors
from ..spec import CollectionSpec, _first_line
from .vectors import StoreCommit, StoreState, VectorStore, npz_memmap

TOKEN_TRAIN_SAMPLE = 100_000
#: a filter that keeps at least this share of the documents draws two_stage candidates by
#: skipping the other documents' companion rows; a narrower one by a selector of its rows
BROAD_FILTER = 0.2
_ADD_CHUNK = 65_536
#: token rows quantized at a time by ``add``: the float32 temporaries of quantization stay a few
#: MB however many documents one call adds
_QUANTIZE_ROWS = 8_192


def seg_files(seg_id: int) -> tuple[str, str]:
    return f"seg-{seg_id:08d}.vec.npy", f"seg-{seg_id:08d}.aux.npz"


#: address space a pending segment reserves for its token codes: pages are resident only once
#: written (a large ``np.empty`` is an anonymous ``mmap``), so growing up to it never copies the
#: codes into a buffer twice their size -- which made a job's peak memory follow its pending
#: segment at twice its size
PENDING_RESERVE_BYTES = 512 << 20


class _Grow:
    """Append-only array with amortized O(1) appends along axis 0; ``reserve_bytes`` of address
    space are taken up front (resident only as rows are written)."""

    def __init__(self, shape_tail: tuple[int, ...], dtype: np.dtype, reserve_bytes: int = 0) -> None:
        row = max(1, int(np.prod(shape_tail, dtype=np.int64)) * np.dtype(dtype).itemsize)
        self._buf = np.empty((max(16, reserve_bytes // row), *shape_tail), dtype=dtype)
        self.n = 0

    def extend(self, rows: np.ndarray) -> None:
        need = self.n + len(rows)
        if need > len(self._buf):
            new = np.empty((max(need, 2 * len(self._buf)), *self._buf.shape[1:]), self._buf.dtype)
            new[:self.n] = self._buf[:self.n]
            self._buf = new
        self._buf[self.n:need] = rows
        self.n = need

    @property
    def view(self) -> np.ndarray:
        return self._buf[:self.n]


class Locations:
    """Where each live document is: internal id -> (position of its segment in
    ``MultiStore.segments``, row in it), as two int32 arrays indexed by the internal id (ids are
    dense, ``0 .. next_int_id``): 8 bytes per id, where a dict of tuples took ~150 bytes per
    document (150 MB at a million) and a Python loop per document to build when opening."""

    def __init__(self) -> None:
        self.seg = np.full(0, -1, np.int32)
        self.row = np.zeros(0, np.int32)
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def set(self, int_ids: np.ndarray, seg_pos: int, rows: np.ndarray) -> None:
        int_ids = np.asarray(int_ids, np.int64)
        if not len(int_ids):
            return
        top = int(int_ids.max()) + 1
        if top > len(self.seg):
            size = max(top, 2 * len(self.seg), 1024)
            seg, row = np.full(size, -1, np.int32), np.zeros(size, np.int32)
            seg[:len(self.seg)], row[:len(self.row)] = self.seg, self.row
            self.seg, self.row = seg, row
        self.n += int((self.seg[int_ids] < 0).sum())
        self.seg[int_ids] = seg_pos
        self.row[int_ids] = rows

    def find(self, int_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(ids, segment positions, rows)`` of the live documents among ``int_ids``."""
        ids = np.asarray(int_ids, np.int64)
        ids = ids[(ids >= 0) & (ids < len(self.seg))]
        ids = ids[self.seg[ids] >= 0]
        return ids, self.seg[ids], self.row[ids]

    def pop(self, int_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Forget live documents (``KeyError`` if one is not live): their positions and rows."""
        ids = np.asarray(int_ids, np.int64)
        found, seg, row = self.find(ids)
        if len(found) != len(np.unique(ids)):
            raise KeyError(f"{len(ids) - len(found)} internal id(s) not live")
        self.seg[found] = -1
        self.n -= len(found)
        return seg, row


@dataclass
class Segment:
    seg_id: int
    codes: np.ndarray  # [T, dim] stored precision
    scales: np.ndarray | None  # [T] float32 (int8 only)
    offsets: np.ndarray  # [n + 1] int64
    doc_ids: np.ndarray  # [n] int64
    live: np.ndarray  # [n] bool
    comp_rows: np.ndarray | None = None  # [n] int64: companion rows per document (None: no companion)
    committed: bool = True
    spill: Path | None = field(default=None, repr=False)  # codes already written here (compaction)
    written_to: Path | None = field(default=None, repr=False)  # folder of the files write() made
    # pending (uncommitted) segments grow in place
    _g_codes: _Grow | None = field(default=None, repr=False)
    _g_scales: _Grow | None = field(default=None, repr=False)
    _g_offsets: _Grow | None = field(default=None, repr=False)
    _g_ids: _Grow | None = field(default=None, repr=False)
    _g_live: _Grow | None = field(default=None, repr=False)
    _g_comp: _Grow | None = field(default=None, repr=False)
    _norms: np.ndarray | None = field(default=None, repr=False)  # doc_norms(), once computed

    @property
    def n_docs(self) -> int:
        return len(self.doc_ids)

    @property
    def n_vectors(self) -> int:
        return int(self.offsets[-1])

    @classmethod
    def pending(cls, seg_id: int, dim: int, precision: str, companion: bool = False) -> "Segment":
        dtype = np.dtype(precision)
        s = cls(seg_id, np.empty((0, dim), dtype), None, np.zeros(1, np.int64),
                np.empty(0, np.int64), np.empty(0, bool), committed=False)
        s._g_comp = _Grow((), np.dtype(np.int64)) if companion else None
        s._g_codes = _Grow((dim,), dtype, PENDING_RESERVE_BYTES)
        s._g_scales = _Grow((), np.dtype(np.float32)) if precision == "int8" else None
        s._g_offsets = _Grow((), np.dtype(np.int64))
        s._g_offsets.extend(np.zeros(1, np.int64))
        s._g_ids = _Grow((), np.dtype(np.int64))
        s._g_live = _Grow((), np.dtype(bool))
        return s

    def append(self, int_ids: np.ndarray, codes: np.ndarray, scales: np.ndarray | None,
               lens: np.ndarray, comp_rows: np.ndarray | None = None) -> np.ndarray:
        """Append documents (their codes in order, ``lens`` rows each); returns their row numbers
        in this segment."""
        self.append_rows(codes, scales)
        return self.append_docs(int_ids, lens, comp_rows)

    def append_rows(self, codes: np.ndarray, scales: np.ndarray | None) -> None:
        """Append token rows of documents that :meth:`append_docs` then records."""
        assert not self.committed
        self._g_codes.extend(codes)
        if self._g_scales is not None:
            self._g_scales.extend(scales)

    @property
    def pending_rows(self) -> int:
        return self._g_codes.n

    def drop_rows(self, n: int) -> None:
        """Forget the rows appended after the first ``n`` (not yet in a document)."""
        self._g_codes.n = n
        if self._g_scales is not None:
            self._g_scales.n = n
        self._refresh()

    def append_docs(self, int_ids: np.ndarray, lens: np.ndarray,
                    comp_rows: np.ndarray | None = None) -> np.ndarray:
        """Record documents over the last ``sum(lens)`` rows not yet in a document (and, with a
        companion, their companion row counts); returns their row numbers in this segment."""
        first = self.n_docs
        base = int(self._g_offsets.view[-1])
        if base + int(np.sum(lens)) != self._g_codes.n:
            raise InternalError("segment rows and documents disagree")
        self._g_offsets.extend(base + np.cumsum(lens))
        self._g_ids.extend(int_ids)
        self._g_live.extend(np.ones(len(int_ids), bool))
        if self._g_comp is not None:
            self._g_comp.extend(comp_rows)
        self._refresh()
        return np.arange(first, first + len(int_ids))

    def _refresh(self) -> None:
        self.codes = self._g_codes.view
        self.scales = None if self._g_scales is None else self._g_scales.view
        self.offsets = self._g_offsets.view
        self.doc_ids = self._g_ids.view
        self.live = self._g_live.view
        self.comp_rows = None if self._g_comp is None else self._g_comp.view

    def freeze(self) -> None:
        """Turn a pending segment into a committed one. Its token codes are then read from the
        file its commit wrote, memory-mapped as a loaded collection's are, instead of staying
        in memory: a collection being built (the indexing job) holds in memory only the
        segment it is filling, however large the collection grows. The other arrays (a few
        bytes per document or token) become compact copies."""
        if self.written_to is not None:
            self.codes = _advise(np.load(self.written_to / seg_files(self.seg_id)[0], mmap_mode="r"),
                                 mmap.MADV_RANDOM)
        else:
            self.codes = self.codes.copy()
        self.scales = None if self.scales is None else self.scales.copy()
        self.offsets, self.doc_ids, self.live = self.offsets.copy(), self.doc_ids.copy(), self.live.copy()
        self.comp_rows = None if self.comp_rows is None else self.comp_rows.copy()
        self._g_codes = self._g_scales = self._g_offsets = self._g_ids = self._g_live = self._g_comp = None
        self.committed = True

    def write(self, folder: Path) -> None:
        """Write the segment files durably (fsync each file; the caller fsyncs the folder)."""
        vec_name, aux_name = seg_files(self.seg_id)
        if self.spill is not None:  # written by the compaction, under the .tmp name: make it durable
            fsync_path(self.spill)
            os.replace(self.spill, folder / vec_name)
            self.spill = None
        else:
            write_durable(folder / vec_name, lambda f: np.save(f, np.ascontiguousarray(self.codes)),
                          sync_dir=False)
        aux = {"offsets": self.offsets, "doc_ids": self.doc_ids}
        if self.scales is not None:
            aux["scales"] = self.scales
        if self.comp_rows is not None:
            aux["companion_rows"] = self.comp_rows
        write_durable(folder / aux_name, lambda f: np.savez(f, **aux), sync_dir=False)
        self.written_to = folder

    @classmethod
    def read(cls, folder: Path, seg_id: int, alive: np.ndarray | None) -> "Segment":
        """The committed segment ``seg_id``; ``alive``: a bool per internal id (the live ones), or
        ``None``: all of its documents are."""
        vec_name, aux_name = seg_files(seg_id)
        codes = _advise(np.load(folder / vec_name, mmap_mode="r"), mmap.MADV_RANDOM)
        # the per-token scales and the offsets are mapped, not read: a search reads its
        # candidates' entries only; the ids and companion row counts are read (opening needs them)
        mapped = npz_memmap(folder / aux_name, ("offsets", "scales"))
        with np.load(folder / aux_name) as z:
            offsets = mapped["offsets"] if mapped.get("offsets", _F32).dtype == np.int64 else \
                z["offsets"].astype(np.int64)
            doc_ids = z["doc_ids"].astype(np.int64)
            scales = mapped["scales"] if mapped.get("scales", _I64).dtype == np.float32 else \
                (z["scales"].astype(np.float32) if "scales" in z.files else None)
            comp = z["companion_rows"].astype(np.int64) if "companion_rows" in z.files else None
        if int(offsets[-1]) != len(codes) or len(offsets) != len(doc_ids) + 1 or \
                (comp is not None and len(comp) != len(doc_ids)):
            raise InternalError(f"segment {seg_id} files disagree on their size")
        if alive is None:  # every document is live
            live = np.ones(len(doc_ids), bool)
        else:
            live = np.zeros(len(doc_ids), bool)
            known = doc_ids < len(alive)
            live[known] = alive[doc_ids[known]]
        return cls(seg_id, codes, scales, offsets, doc_ids, live, comp)

    def doc_norms(self) -> np.ndarray | None:
        """Each document's largest token norm (:func:`index.int8scan.doc_norms`; int8 codes only),
        computed on first use (one pass over the codes, whose pages are then dropped from this
        process) and kept: 8 bytes per document."""
        if self.scales is None:
            return None
        if self._norms is None or len(self._norms) != self.n_docs:
            self._norms = doc_norms(self.codes, self.offsets, self.scales)
            self.drop_pages()
        return self._norms

    def drop_pages(self) -> None:
        """Drop the mapped pages of the codes, scales and offsets from this process (the page
        cache keeps them)."""
        for a in (self.codes, self.scales, self.offsets):
            if a is not None:
                _drop_pages(a)

    def dequantized(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 tokens of the documents ``rows`` and their per-token document ids."""
        codes, offs, scales = gather_docs(self.codes, self.offsets, self.scales, rows)
        return dequantize(codes, scales), np.repeat(self.doc_ids[rows], np.diff(offs))


_F32, _I64 = np.zeros(0, np.float32), np.zeros(0, np.int64)

#: candidate documents reranked between two drops of the segments' mapped pages from this
#: process: a page fault maps up to 64 KB of page-cached file around it (the kernel's
#: fault-around; access advice does not stop it) -- of the codes, the scales and the offsets
#: -- so without drops a long run of two_stage searches leaves every segment page in the
#: process's RSS (6 GB at a million documents). 500 documents map at most ~100 MB.
DROP_EVERY_DOCS = 500

#: bytes of token codes one compaction step copies (and then drops from the mapping)
_COPY_BYTES = 32 << 20


def _advise(codes: np.ndarray, advice: int) -> np.ndarray:
    """``madvise`` the mapping of memory-mapped codes (nothing for an in-memory array)."""
    m = getattr(codes, "_mmap", None)  # np.memmap's mapping (None for an in-memory segment)
    if m is not None:
        m.madvise(advice)
    return codes


def _drop_pages(codes: np.ndarray) -> None:
    """Drop the resident pages of a memory-mapped segment from this process (the page cache
    keeps them): reading a whole segment through its mapping would otherwise leave all of it in
    the process's RSS."""
    _advise(codes, mmap.MADV_DONTNEED)


def _row_blocks(docs: Sequence[np.ndarray], rows: int):
    """The documents' rows, in order, in blocks of at most ``rows`` (short documents joined, a
    long one cut)."""
    buf: list[np.ndarray] = []
    n = 0
    for d in docs:
        for a in range(0, len(d), rows):
            piece = d[a:a + rows]
            if buf and n + len(piece) > rows:
                yield buf[0] if len(buf) == 1 else np.concatenate(buf)
                buf, n = [], 0
            buf.append(piece)
            n += len(piece)
    if buf:
        yield buf[0] if len(buf) == 1 else np.concatenate(buf)


def _merge_topk(parts: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` of concatenated ``(scores, ids)`` parts, ties by position in the
    concatenation (as :func:`index.validate.topk`)."""
    if not parts:
        return np.zeros(0, np.float32), np.zeros(0, np.int64)
    sc = np.concatenate([p[0] for p in parts])
    ids = np.concatenate([p[1] for p in parts])
    o = np.argsort(-sc, kind="stable")[:k]
    return sc[o], ids[o]


class MultiStore(VectorStore):
    """All segments of a multi-vector collection plus the uncommitted (pending) one."""

    META_KEYS = ("next_seg_id", "token_index", *CompanionRows.META_KEYS)
    supports_token_ann = True
    accepts_all_live = True

    def __init__(self, spec: CollectionSpec, next_seg_id: int = 0,
                 companion: CompanionRows | None = None) -> None:
        self.spec = spec
        # the companion rows the collection keeps (spec.companion_pooler), else None
        if companion is None and spec.companion_pooler is not None:
            companion = CompanionRows.empty(spec.companion_spec())
        self.companion = companion
        self.next_seg_id = next_seg_id  # id of the next new segment
        self.reset_segments = False  # compacted: the next commit replaces every segment row
        self.segments: list[Segment] = []  # committed, then the pending one last (if any)
        self.loc = Locations()  # live int id -> (position in segments, row)
        self.token_index: faiss.Index | None = None
        self.token_segments: set[int] = set()  # segments whose tokens are in token_index
        self.token_dirty = False
        self._reranked = 0  # candidate documents reranked since the mapped pages were dropped
        self._touched: set[int] = set()  # positions of the segments they were in
        self._drop_lock = threading.Lock()

    # ---- loading ------------------------------------------------------------------------
    @classmethod
    def required_files(cls, state: StoreState) -> list[str]:
        return [f for sid, _, _ in state.segments for f in seg_files(sid)] + CompanionRows.committed_files(state)

    @classmethod
    def committed_files(cls, state: StoreState) -> list[str]:
        token_meta = state.meta.get("token_index")
        return cls.required_files(state) + ([token_meta["file"]] if token_meta else [])

    @classmethod
    def load(cls, spec: CollectionSpec, folder: Path, state: StoreState,
             live_ids: np.ndarray | None) -> "MultiStore":
        store = cls(spec, int(state.meta.get("next_seg_id") or 0))
        seg_ids = [s[0] for s in state.segments]
        token_meta = state.meta.get("token_index")
        if live_ids is None:  # every document of the segments is live (the caller counted them)
            alive, n_live = None, sum(int(s[1]) for s in state.segments)
        else:
            live_ids = np.asarray(live_ids, dtype=np.int64)
            alive = np.zeros(int(live_ids.max()) + 1 if len(live_ids) else 0, bool)
            alive[live_ids] = True
            n_live = len(live_ids)
        for sid in seg_ids:
            seg = Segment.read(folder, sid, alive)
            rows = np.flatnonzero(seg.live)
            store.loc.set(seg.doc_ids[rows], len(store.segments), rows)
            store.segments.append(seg)
        if len(store.loc) != n_live:
            raise InternalError(
                f"segments hold {len(store.loc)} of the {n_live} documents of the document store")
        if spec.companion_pooler is not None:
            store.companion = store._load_companion(folder, state)
        if token_meta and set(token_meta["segments"]) <= set(seg_ids):
            path = folder / token_meta["file"]
            if path.is_file():
                store.token_index = faiss.read_index(str(path))
                store.token_segments = set(token_meta["segments"])
                for seg in store.segments:
                    if seg.seg_id not in store.token_segments:
                        store._index_segment_tokens(seg, np.flatnonzero(seg.live))
        return store

    def _load_companion(self, folder: Path, state: StoreState) -> CompanionRows:
        """The committed companion index, checked against the rows the segments record for the
        live documents."""
        ids, counts = [], []
        for seg in self.segments:
            if seg.comp_rows is None:
                raise InternalError(f"segment {seg.seg_id} has no companion row counts")
            ids.append(seg.doc_ids[seg.live])
            counts.append(seg.comp_rows[seg.live])
        live_rows = row_ids(np.concatenate(ids), np.concatenate(counts)) if ids else np.zeros(0, np.int64)
        try:
            return CompanionRows.load(self.spec.companion_spec(), folder, state, live_rows)
        except InternalError as e:
            raise InternalError(f"companion index: {e}") from None

    # ---- writes -------------------------------------------------------------------------
    @property
    def pending(self) -> Segment | None:
        return self.segments[-1] if self.segments and not self.segments[-1].committed else None

    def check_add(self, n: int, companion: Sequence[np.ndarray] | None = None) -> None:
        if self.companion is not None and companion is not None:
            self.companion.check_add(sum(len(r) for r in companion))

    def add(self, int_ids: np.ndarray, docs: Sequence[np.ndarray],
            companion: Sequence[np.ndarray] | None = None) -> None:
        """Add documents (``[n_i, dim]`` token vectors each) and, for a collection that keeps
        companion rows, their rows (``[r_i, companion_dim]`` each)."""
        int_ids = np.asarray(int_ids, np.int64)
        pend = self.pending
        if pend is None:
            pend = Segment.pending(self.next_seg_id, self.spec.dim, self.spec.precision,
                                   companion=self.companion is not None)
            self.next_seg_id += 1
            self.segments.append(pend)
        lens = np.array([len(d) for d in docs], dtype=np.int64)
        n_rows = pend.pending_rows
        try:
            for block in _row_blocks(docs, _QUANTIZE_ROWS):  # never a float32 copy of the whole batch
                pend.append_rows(*quantize(block, self.spec.precision))
            counts = None if self.companion is None else self.companion.add_docs(int_ids, list(companion))
            rows = pend.append_docs(int_ids, lens, counts)
        except BaseException:
            pend.drop_rows(n_rows)  # rows of documents that were not recorded
            raise
        self.loc.set(int_ids, len(self.segments) - 1, rows)
        if self.token_index is not None:
            self._index_segment_tokens(pend, rows)

    def remove(self, int_ids: Sequence[int]) -> None:
        ids = np.asarray(int_ids, np.int64)
        if not len(ids):
            return
        pos, rows = self.loc.pop(ids)
        counts = np.zeros(len(ids), np.int64)
        for p in np.unique(pos).tolist():
            sel = pos == p
            seg = self.segments[p]
            seg.live[rows[sel]] = False
            if self.companion is not None:
                counts[sel] = seg.comp_rows[rows[sel]]
        if self.companion is not None:
            self.companion.remove_docs(ids, counts)

    @property
    def dirty(self) -> bool:
        pend = self.pending
        return bool(pend is not None and pend.n_docs) or self.reset_segments or \
            (self.token_index is not None and self.token_dirty) or \
            (self.companion is not None and self.companion.dirty)

    def write(self, folder: Path, gen: int) -> StoreCommit:
        """The pending segment's files, and the token index (``tokens-<gen>.faiss``) if it
        changed."""
        out = StoreCommit(meta={"next_seg_id": self.next_seg_id}, reset_segments=self.reset_segments)
        pend = self.pending
        if pend is not None and pend.n_docs:
            pend.write(folder)
            fsync_dir(folder)
            out.new_segment = (pend.seg_id, pend.n_docs, pend.n_vectors)
        if self.token_index is not None and self.token_dirty:
            name = f"tokens-{gen:08d}.faiss"
            write_durable(folder / name, write_to=lambda tmp: faiss.write_index(self.token_index, tmp))
            out.meta["token_index"] = {"file": name, "segments": sorted(self.token_segments)}
        if self.companion is not None:
            out.meta.update(self.companion.write(folder, gen).meta)
        return out

    def mark_committed(self, commit: StoreCommit) -> None:
        self.reset_segments = False
        if self.companion is not None:
            self.companion.mark_committed(commit)
        pend = self.pending
        if pend is not None:
            if pend.n_docs == 0:
                self.segments.pop()
            else:
                pend.freeze()
                # rows keep their numbers; re-point loc entries at the (same) segment object
        self.token_dirty = False

    def compacted(self, folder: Path) -> "MultiStore | None":
        """A new store holding the live documents in one new segment (None if there is one
        segment without tombstones). The token codes are copied a bounded block at a time
        (:data:`_COPY_BYTES`) straight into the new segment's file in ``folder`` (its ``.tmp``
        name until the commit makes it durable), and the pages of the old segments read for
        each block are dropped from this process's mapping: the compaction holds a few bytes
        per document and token in memory (offsets, ids, int8 scales), never the codes -- which
        it held twice before (gathered, then appended to a pending segment)."""
        if sum(s.n_docs for s in self.segments) == self.n_docs and len(self.segments) <= 1:
            return None
        seg_id = self.next_seg_id
        comp = None if self.companion is None else (self.companion.compacted(folder) or self.companion)
        new = MultiStore(self.spec, seg_id + 1, comp)
        new.reset_segments = True
        dtype = np.dtype(self.spec.precision)
        live = [(seg, np.flatnonzero(seg.live)) for seg in self.segments]
        lens = [np.diff(seg.offsets)[rows] for seg, rows in live]
        total = int(sum(int(n.sum()) for n in lens))
        block = max(1, _COPY_BYTES // (self.spec.dim * dtype.itemsize))
        path = folder / (seg_files(seg_id)[0] + ".tmp")
        scales: list[np.ndarray] = []
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                     "fortran_order": False, "shape": (total, self.spec.dim)})
            for (seg, rows), n in zip(live, lens):
                cum = np.cumsum(n)
                start = 0
                while start < len(rows):
                    base = int(cum[start - 1]) if start else 0
                    end = max(start + 1, int(np.searchsorted(cum, base + block, side="right")))
                    c, _, sc = gather_docs(seg.codes, seg.offsets, seg.scales, rows[start:end])
                    f.write(np.ascontiguousarray(c).data)
                    if sc is not None:
                        scales.append(sc)
                    _drop_pages(seg.codes)
                    start = end
        all_ids = np.concatenate([seg.doc_ids[rows] for seg, rows in live])
        offsets = np.zeros(len(all_ids) + 1, np.int64)
        np.cumsum(np.concatenate(lens), out=offsets[1:])
        codes = np.load(path, mmap_mode="r") if total else np.empty((0, self.spec.dim), dtype)
        new.segments.append(Segment(
            seg_id, codes, np.concatenate(scales) if scales else (None if dtype != np.int8 else np.zeros(0, np.float32)),
            offsets, all_ids, np.ones(len(all_ids), bool),
            np.concatenate([seg.comp_rows[rows] for seg, rows in live]) if comp is not None else None,
            committed=False, spill=path))
        new.loc.set(all_ids, 0, np.arange(len(all_ids)))
        if self.token_index is not None:
            new.build_token_index()
        return new

    # ---- token index ----------------------------------------------------------------------
    def _new_token_index(self) -> faiss.Index:
        idx = faiss.index_factory(self.spec.dim, self.spec.token_factory, faiss.METRIC_INNER_PRODUCT)
        try:
            faiss.extract_index_ivf(idx)
            return idx  # IVF carries ids
        except Exception:
            return faiss.IndexIDMap(idx)  # many tokens share one document id: IDMap, not IDMap2

    def build_token_index(self) -> None:
        idx = self._new_token_index()
        if not idx.is_trained:
            sample = self._token_sample(TOKEN_TRAIN_SAMPLE)
            need = min_training_vectors(self.spec.token_factory)
            if len(sample) < need:
                raise InvalidError(
                    f"token index {self.spec.token_factory!r} needs at least {need} token vectors to "
                    f"train; the collection has {len(sample)}. Use mode='exhaustive' or a token_factory "
                    "without training ('HNSW32')", param="token_factory")
            try:
                idx.train(sample)
            except RuntimeError as e:
                raise InvalidError(f"training token index failed: {_first_line(e)}", param="token_factory") from None
        self.token_index = idx
        self.token_segments = set()
        for seg in self.segments:
            self._index_segment_tokens(seg, np.flatnonzero(seg.live))

    def _index_segment_tokens(self, seg: Segment, rows: np.ndarray) -> None:
        # add in chunks of documents to bound the float32 copy
        cum = np.cumsum(np.diff(seg.offsets)[rows])
        start = 0
        while start < len(rows):
            base = int(cum[start - 1]) if start else 0
            end = max(start + 1, int(np.searchsorted(cum, base + _ADD_CHUNK, side="right")))
            x, ids = seg.dequantized(rows[start:end])
            self.token_index.add_with_ids(x, ids)
            start = end
        self.token_segments.add(seg.seg_id)
        self.token_dirty = True

    def _token_sample(self, n: int) -> np.ndarray:
        parts = []
        for seg in self.segments:
            rows = np.flatnonzero(seg.live)
            if len(rows):
                parts.append(seg.dequantized(rows)[0])
        if not parts:
            return np.empty((0, self.spec.dim), np.float32)
        x = np.concatenate(parts)
        if len(x) > n:
            x = x[np.random.default_rng(0).choice(len(x), n, replace=False)]
        return np.ascontiguousarray(x)

    # ---- reads --------------------------------------------------------------------------
    @property
    def n_docs(self) -> int:
        return len(self.loc)

    def vectors_of(self, int_id: int) -> dict[str, np.ndarray]:
        _, pos, rows = self.loc.find(np.array([int_id]))
        seg, row = self.segments[int(pos[0])], int(rows[0])
        out = {"vectors": seg.dequantized(np.array([row]))[0]}
        if self.companion is not None:
            out["companion"] = np.stack([self.companion.direct_map().reconstruct(int(r)) for r in
                                         row_ids(np.array([int_id]), seg.comp_rows[row:row + 1])])
        return out

    def storage_stats(self, folder: Path) -> dict[str, Any]:
        return {"bytes_per_doc": self.bytes_per_doc(),
                "tombstones": sum(s.n_docs for s in self.segments) - self.n_docs,
                "segments": len(self.segments), "token_index": self.token_index is not None,
                "index_type": self.spec.token_factory,
                "companion_rows": None if self.companion is None else self.companion.n_docs}

    def companion_candidates(self, x: np.ndarray, k: int, ids: np.ndarray | None = None) -> list[np.ndarray]:
        """Per companion query vector, the int ids of the ``k`` best live documents (among
        ``ids``, sorted, when a metadata filter gives them: all of them when they are at most
        ``k``, else the best by the companion rows of those documents only)."""
        if ids is None:
            return self.companion.candidates(x, k)
        if len(ids) <= k:
            return [ids for _ in range(len(x))]
        if len(ids) >= BROAD_FILTER * self.n_docs:  # most documents match: skip the others' rows
            ok = np.zeros(max(len(self.loc.seg), int(ids[-1]) + 1), bool)  # indexed by any live id
            ok[ids] = True
            return self.companion.candidates(x, k, doc_ok=ok)
        found, pos, rows = self.loc.find(ids)
        counts = np.zeros(len(found), np.int64)
        for p in np.unique(pos).tolist():
            sel = pos == p
            counts[sel] = self.segments[p].comp_rows[rows[sel]]
        return self.companion.candidates(x, k, np.sort(row_ids(found, counts)))

    def live_vectors(self) -> int:
        return int(sum(int(np.diff(s.offsets)[s.live].sum()) for s in self.segments))

    def total_vectors(self) -> int:
        return int(sum(s.n_vectors for s in self.segments))

    def bytes_per_doc(self) -> float:
        if not len(self.loc):
            return 0.0
        per_tok = bytes_per_vector(self.spec.dim, self.spec.precision)
        comp = 0 if self.companion is None else self.companion.n_docs * 4 * self.spec.companion_dim
        return (self.live_vectors() * per_tok + 16 * len(self.loc) + comp) / len(self.loc)

    def exhaustive_topk(self, queries: Sequence[np.ndarray], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per query the exact MaxSim top ``k`` of the live documents: ``(scores, int ids)``, ties
        by segment, then row; by
        :func:`index.int8scan.maxsim_topk` per segment (the int8 scan where the CPU has int8
        units), merged."""
        parts: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in queries]
        for seg in self.segments:
            if not seg.n_docs or not seg.live.any():
                continue
            _advise(seg.codes, mmap.MADV_SEQUENTIAL)  # a whole scan: read ahead
            try:
                res = maxsim_topk(queries, seg.codes, seg.offsets, seg.scales, k, live=seg.live,
                                  norms=seg.doc_norms() if seg.committed else None)
            finally:  # its pages stay in the page cache, not in this process
                _advise(seg.codes, mmap.MADV_RANDOM)
                seg.drop_pages()
            for qi, (sc, pos) in enumerate(res):
                o = np.argsort(pos, kind="stable")  # by row: ties merge as in the full list
                parts[qi].append((sc[o], seg.doc_ids[pos[o]]))
        return [_merge_topk(p, k) for p in parts]

    def rerank_topk(self, query: np.ndarray, cand: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The exact MaxSim top ``k`` of candidate int ids (unknown/dead ones dropped), ties by
        segment, then id; large candidate sets take the int8 scan."""
        ids, pos, rows = self.loc.find(np.unique(np.asarray(cand, dtype=np.int64)))
        parts = []
        for p in np.unique(pos).tolist():
            sel = pos == p
            seg = self.segments[p]
            idx = rows[sel].astype(np.int64)
            (sc, at), = maxsim_topk([query], seg.codes, seg.offsets, seg.scales, k, doc_idx=idx,
                                    norms=seg._norms if seg.committed else None)
            o = np.argsort(at, kind="stable")
            parts.append((sc[o], ids[sel][at[o]]))
        with self._drop_lock:  # searches run on several threads
            self._reranked += len(ids)
            self._touched.update(np.unique(pos).tolist())
            touched: set[int] = set()
            if self._reranked >= DROP_EVERY_DOCS:  # keep the mapped pages this process holds bounded
                touched, self._touched, self._reranked = self._touched, set(), 0
        for p in touched:
            if p < len(self.segments):
                self.segments[p].drop_pages()
        return _merge_topk(parts, k)

    def token_candidates(self, queries: Sequence[np.ndarray], k_token: int,
                         ids: np.ndarray | None = None) -> list[np.ndarray]:
        """Per query, the distinct live documents among the k_token nearest tokens of each
        query token (``ids``: among the tokens of these documents only -- a metadata filter,
        FAISS' ID selector on the token index's document labels)."""
        if self.token_index is None:
            self.build_token_index()
        q_all = np.ascontiguousarray(np.concatenate(queries).astype(np.float32))
        kk = max(1, min(k_token, int(self.token_index.ntotal)))
        sel = None if ids is None else id_selector(ids)
        inner = self.token_index.index if isinstance(self.token_index, faiss.IndexIDMap) else None
        if inner is not None and isinstance(faiss.downcast_index(inner), faiss.IndexHNSW):
            params = faiss.SearchParametersHNSW(efSearch=max(kk, 64), sel=sel)
            _, labels = self.token_index.search(q_all, kk, params=params)
        elif sel is not None:
            ivf = faiss.downcast_index(self.token_index)
            params = (faiss.SearchParametersIVF(sel=sel, nprobe=ivf.nprobe) if isinstance(ivf, faiss.IndexIVF)
                      else faiss.SearchParameters(sel=sel))
            _, labels = self.token_index.search(q_all, kk, params=params)
        else:
            _, labels = self.token_index.search(q_all, kk)
        out, start = [], 0
        for q in queries:
            lab = np.unique(labels[start:start + len(q)])
            start += len(q)
            out.append(lab[lab >= 0])
        return out
