"""Exact MaxSim (late interaction) scoring and token-vector quantization.

No I/O (numpy; ONNX Runtime where installed: :mod:`index.kernels`). Documents are stored as
one contiguous ``[n_tokens, dim]`` array plus ``offsets`` (``int64 [n_docs + 1]``,
``offsets[0] == 0``): document ``j`` owns the rows ``offsets[j]:offsets[j + 1]``; every document
has at least one row.

MaxSim of a query ``Q [m, dim]`` and a document ``D [n, dim]`` is
``sum_i max_j <Q_i, D_j>``. :func:`maxsim_scores` computes it for a batch of queries against
all documents with one matrix product per cache-sized chunk of documents (a kernel of
:mod:`index.kernels`, chosen for the CPU and the codes' precision; chunks run on worker threads
where the kernel allows), a ``np.maximum.reduceat`` over the document offsets and a
``np.add.reduceat`` over the query token offsets -- there is no Python loop over documents.
The kernels score the stored codes (int8 with per-vector scales, float16, float32) as they are:
int8 codes are multiplied as int8 on AMX int8 tiles (the fused scan of :mod:`index.amxscan`
where it is built, else ONNX Runtime's MLAS), float16 and int8 codes are otherwise cast chunk
by chunk in cache; every kernel keeps
float32 query math within float32 rounding (only the opt-in ``mlas-int8`` rounds the query to
int8). ONNX Runtime is an optional, lazily imported accelerator of index/ (see
:mod:`index.kernels`); without it the portable numpy/BLAS path runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from . import kernels
from embedpool.errors import InternalError, InvalidError
from embedpool.precisions import STORAGE_PRECISIONS  # how multi-vector token vectors are stored

#: Per-chunk working-set bound of :func:`maxsim_scores` (per worker thread: the chunk's codes, their
#: converted form, the similarity block). 4 MB per worker (two fill the 8 MB L3 of the bench CPU) was
#: 5-20% faster than 1 MB for the MLAS kernels and level with 16 MB (bench/maxsim.py sweeps).
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


def quantize(x: np.ndarray, precision: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Encode float32 token vectors for storage.

    Args:
        x: ``float32 [n, dim]``.
        precision: ``float32`` | ``float16`` | ``int8``. ``int8`` is symmetric scalar
            quantization with one float32 scale per vector (``max |x| / 127``), which kept
            MaxSim rankings closer to float32 than a per-dimension scale on MiniLM token
            states (see bench/index.py).

    Returns:
        ``(codes, scales)``; ``scales`` is ``float32 [n]`` for ``int8`` and ``None`` otherwise.
    """
    x = np.asarray(x, dtype=np.float32)
    if precision == "float32":
        return np.ascontiguousarray(x), None
    if precision == "float16":
        return x.astype(np.float16), None
    if precision == "int8":
        amax = np.abs(x).max(axis=1) if x.size else np.zeros(len(x), np.float32)
        scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        codes = np.clip(np.rint(x / scales[:, None]), -127, 127).astype(np.int8)
        return codes, scales
    raise InvalidError(f"unknown precision {precision!r}; use one of {', '.join(STORAGE_PRECISIONS)}",
                       param="precision")


def dequantize(codes: np.ndarray, scales: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`quantize`: ``float32 [n, dim]``."""
    out = np.asarray(codes, dtype=np.float32)
    if scales is not None:
        out = out * np.asarray(scales, dtype=np.float32)[:, None]
    return out


def pack(x: np.ndarray, precision: str) -> bytes:
    """The stored bytes of token vectors ``[n, dim]``: :func:`quantize`'s codes, then (``int8``)
    its scales -- the FAISS segments' codes in one buffer, for stores that keep bytes per
    document (Milvus). :func:`unpack` inverts it."""
    codes, scales = quantize(x, precision)
    return codes.tobytes() + (b"" if scales is None else scales.tobytes())


def unpack(buf: bytes, n: int, dim: int, precision: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(codes [n, dim], scales [n] | None)`` of :func:`pack`'s bytes of ``n`` vectors."""
    dtype = np.dtype(precision)
    size = n * dim * dtype.itemsize
    if len(buf) != n * bytes_per_vector(dim, precision):
        raise InternalError(f"{len(buf)} bytes are not {n} packed {precision} vectors of dim {dim}")
    codes = np.frombuffer(buf, dtype=dtype, count=n * dim).reshape(n, dim)
    scales = np.frombuffer(buf, dtype=np.float32, offset=size) if precision == "int8" else None
    return codes, scales


def bytes_per_vector(dim: int, precision: str) -> int:
    """Stored bytes of one token vector (codes plus its scale)."""
    return {"float32": 4 * dim, "float16": 2 * dim, "int8": dim + 4}[precision]


def _stack_queries(queries: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lens = np.array([len(q) for q in queries], dtype=np.int64)
    starts = np.zeros(len(queries), dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    stacked = np.concatenate([np.asarray(q, dtype=np.float32) for q in queries], axis=0)
    return np.ascontiguousarray(stacked), starts


def maxsim_scores(
    queries: Sequence[np.ndarray],
    vectors: np.ndarray,
    offsets: np.ndarray,
    scales: np.ndarray | None = None,
    *,
    doc_idx: np.ndarray | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    kernel: str | Callable[[np.ndarray, np.dtype], kernels.Prepared] = "auto",
) -> np.ndarray:
    """Exact MaxSim of every query against every document (or the documents ``doc_idx``).

    Args:
        queries: ``q`` arrays ``[m_i, dim]`` of query token vectors (``m_i >= 1``).
        vectors: stored document token vectors ``[n_tokens, dim]`` (float32, float16 or int8 codes).
        offsets: ``int64 [n_docs + 1]`` document boundaries, strictly increasing, starting at 0.
        scales: per-token ``float32 [n_tokens]`` int8 scales, or ``None``.
        doc_idx: score only these documents (candidate reranking); their token rows are gathered
            chunk by chunk into a small buffer instead of being copied out all at once.
        chunk_bytes: bound on the per-chunk working set (per worker thread); documents are
            processed in chunks aligned to document boundaries (a single document larger than
            the bound is one chunk).
        kernel: ``auto`` (the kernel chosen for this CPU and precision: :func:`kernels.choose`),
            a name of :data:`kernels.KERNELS`, or a callable ``(stacked query tokens [m, dim],
            codes dtype) -> kernels.Prepared`` (another kernel through the same chunk loop).

    Returns:
        ``float32 [q, n_docs]`` (``[q, len(doc_idx)]`` with ``doc_idx``).
    """
    rows = DocRows(offsets, doc_idx)
    n_docs = len(rows)
    name = kernel if callable(kernel) else kernels.resolve(kernel, np.dtype(vectors.dtype).name)
    if not len(queries):
        return np.zeros((0, n_docs), dtype=np.float32)
    q_all, q_starts = _stack_queries(queries)
    out = np.empty((len(queries), n_docs), dtype=np.float32)
    if n_docs == 0:
        return out
    if name in kernels.FUSED_KERNELS:  # fused: no chunk loop (index/amxscan.py)
        from .int8scan import fused_maxsim

        return fused_maxsim(queries, vectors, offsets, scales, doc_idx=doc_idx, unit=kernels.FUSED_KERNELS[name])
    prep = name(q_all, vectors.dtype) if callable(name) else kernels.prepare(name, q_all, vectors.dtype)
    local = rows.local  # token offsets of the scored docs, end to end
    # chunks within the working-set bound, and at least one per worker where there are enough tokens
    per_worker = -(-int(local[-1]) // prep.n_workers)
    spans = _chunks(local, max(1, min(chunk_bytes // prep.bytes_per_token, per_worker)))

    def score_span(span: tuple[int, int]) -> None:
        a, b = span
        block, sc = rows.block(vectors, scales, a, b, "gather")
        if sc is not None:
            sc = np.asarray(sc, dtype=np.float32)
        sim = prep.score(block, sc)
        bounds = local[a:b] - local[a]
        if prep.tokens_axis == 1:  # [m, T] -> per-document maxima [m, b - a]
            doc_max = np.maximum.reduceat(sim, bounds, axis=1)
        else:  # [T, m] -> [b - a, m], seen as [m, b - a]
            doc_max = np.maximum.reduceat(sim, bounds, axis=0).T
        if prep.col_scale is not None:
            doc_max *= prep.col_scale[:, None]
        out[:, a:b] = np.add.reduceat(doc_max, q_starts, axis=0)  # [q, b - a]

    kernels.run_parallel(score_span, spans, prep.n_workers)
    return out


class DocRows:
    """The token rows of the documents a scan reads: all of them, or the documents ``doc_idx``
    (in that order), with their token offsets end to end (``local``)."""

    def __init__(self, offsets: np.ndarray, doc_idx: np.ndarray | None = None) -> None:
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.doc_idx = None if doc_idx is None else np.asarray(doc_idx, dtype=np.int64)
        if self.doc_idx is None:
            self.starts, self.lens = self.offsets[:-1], np.diff(self.offsets)
        else:
            self.starts = self.offsets[self.doc_idx]
            self.lens = self.offsets[self.doc_idx + 1] - self.starts
        self.local = np.zeros(len(self.starts) + 1, dtype=np.int64)
        np.cumsum(self.lens, out=self.local[1:])

    def __len__(self) -> int:
        return len(self.starts)

    def block(self, vectors: np.ndarray, scales: np.ndarray | None, a: int, b: int,
              buffer: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """``(codes, scales)`` of documents ``a..b-1``: a view of a full scan's rows, or the
        candidates' rows gathered (into the reused per-thread buffer ``buffer`` if given)."""
        if self.doc_idx is None:
            t0, t1 = int(self.offsets[a]), int(self.offsets[b])
            return vectors[t0:t1], None if scales is None else scales[t0:t1]
        n_tok = int(self.local[b] - self.local[a])
        tok = np.repeat(self.starts[a:b] - (self.local[a:b] - self.local[a]), self.lens[a:b]) + np.arange(n_tok)
        out = None if buffer is None else kernels.scratch(buffer, (n_tok, vectors.shape[1]), vectors.dtype)
        return np.take(vectors, tok, axis=0, out=out), None if scales is None else scales[tok]


def _chunks(local: np.ndarray, max_tokens: int) -> list[tuple[int, int]]:
    """Document ranges ``(a, b)`` of at most ``max_tokens`` tokens each (at least one document),
    covering all ``len(local) - 1`` documents whose token offsets are ``local``."""
    spans, a, n_docs = [], 0, len(local) - 1
    while a < n_docs:
        # largest b with local[b] - local[a] <= max_tokens (at least one document)
        b = int(np.searchsorted(local, local[a] + max_tokens, side="right")) - 1
        b = min(max(b, a + 1), n_docs)
        spans.append((a, b))
        a = b
    return spans


def gather_docs(
    vectors: np.ndarray, offsets: np.ndarray, scales: np.ndarray | None, doc_idx: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Copy the token rows of the documents ``doc_idx`` into a new contiguous block.

    Returns ``(vectors, offsets, scales)`` of the sub-collection, documents in ``doc_idx`` order.
    """
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    starts = offsets[doc_idx]
    lens = offsets[doc_idx + 1] - starts
    new_off = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(lens, out=new_off[1:])
    tok = np.repeat(starts - new_off[:-1], lens) + np.arange(new_off[-1], dtype=np.int64)
    return vectors[tok], new_off, (None if scales is None else scales[tok])

