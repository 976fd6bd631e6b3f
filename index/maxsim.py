"""Exact MaxSim (late interaction) scoring and token-vector quantization.

Pure numpy, no I/O. Documents are stored as one contiguous ``[n_tokens, dim]`` array plus
``offsets`` (``int64 [n_docs + 1]``, ``offsets[0] == 0``): document ``j`` owns the rows
``offsets[j]:offsets[j + 1]``; every document has at least one row.

MaxSim of a query ``Q [m, dim]`` and a document ``D [n, dim]`` is
``sum_i max_j <Q_i, D_j>``. :func:`maxsim_scores` computes it for a batch of queries against
all documents with one matrix product per memory-bounded chunk of documents, a
``np.maximum.reduceat`` over the document offsets and a ``np.add.reduceat`` over the query
token offsets -- there is no Python loop over documents.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import CorruptCollectionError, InvalidInputError

PRECISIONS = ("float32", "float16", "int8")

#: Per-chunk working-set bound of :func:`maxsim_scores` (similarity block + dequantized tokens).
DEFAULT_CHUNK_BYTES = 1024 * 1024  # cache-sized blocks were fastest in bench measurements


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
    raise InvalidInputError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")


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
        raise CorruptCollectionError(f"{len(buf)} bytes are not {n} packed {precision} vectors of dim {dim}")
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
) -> np.ndarray:
    """Exact MaxSim of every query against every document (or the documents ``doc_idx``).

    Args:
        queries: ``q`` arrays ``[m_i, dim]`` of query token vectors (``m_i >= 1``).
        vectors: stored document token vectors ``[n_tokens, dim]`` (float32, float16 or int8 codes).
        offsets: ``int64 [n_docs + 1]`` document boundaries, strictly increasing, starting at 0.
        scales: per-token ``float32 [n_tokens]`` int8 scales, or ``None``.
        doc_idx: score only these documents (candidate reranking); their token rows are gathered
            chunk by chunk into a small buffer instead of being copied out all at once.
        chunk_bytes: bound on the per-chunk working set; documents are processed in chunks
            aligned to document boundaries (a single document larger than the bound is one chunk).

    Returns:
        ``float32 [q, n_docs]`` (``[q, len(doc_idx)]`` with ``doc_idx``).
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    if doc_idx is None:
        starts, lens = offsets[:-1], np.diff(offsets)
    else:
        doc_idx = np.asarray(doc_idx, dtype=np.int64)
        starts, lens = offsets[doc_idx], offsets[doc_idx + 1] - offsets[doc_idx]
    n_docs = len(starts)
    if not len(queries):
        return np.zeros((0, n_docs), dtype=np.float32)
    q_all, q_starts = _stack_queries(queries)
    out = np.empty((len(queries), n_docs), dtype=np.float32)
    if n_docs == 0:
        return out
    m, dim = q_all.shape
    # tokens per chunk: similarity block [m, T] float32 + dequantized tokens [T, dim] float32
    max_tokens = max(1, chunk_bytes // (4 * (m + dim)))
    local = np.zeros(n_docs + 1, dtype=np.int64)  # token offsets of the scored docs, end to end
    np.cumsum(lens, out=local[1:])
    buf = None
    a = 0
    while a < n_docs:
        # largest b with local[b] - local[a] <= max_tokens (at least one document)
        b = int(np.searchsorted(local, local[a] + max_tokens, side="right")) - 1
        b = min(max(b, a + 1), n_docs)
        if doc_idx is None:
            t0, t1 = int(offsets[a]), int(offsets[b])
            block = vectors[t0:t1]
            sc = None if scales is None else scales[t0:t1]
        else:  # gather the rows of docs a..b-1 into a reused buffer
            n_tok = int(local[b] - local[a])
            tok = np.repeat(starts[a:b] - (local[a:b] - local[a]), lens[a:b]) + np.arange(n_tok)
            if buf is None or len(buf) < n_tok:
                buf = np.empty((n_tok, dim), dtype=vectors.dtype)
            block = np.take(vectors, tok, axis=0, out=buf[:n_tok])
            sc = None if scales is None else scales[tok]
        if block.dtype != np.float32:
            block = block.astype(np.float32)
        if sc is not None and m >= dim:
            block = block * np.asarray(sc, dtype=np.float32)[:, None]
        sim = q_all @ block.T  # [m, T]; reducing along the contiguous axis is much faster
        if sc is not None and m < dim:  # cheaper to scale the [m, T] similarities
            sim *= np.asarray(sc, dtype=np.float32)[None, :]
        doc_max = np.maximum.reduceat(sim, local[a:b] - local[a], axis=1)  # [m, b - a]
        out[:, a:b] = np.add.reduceat(doc_max, q_starts, axis=0)  # [q, b - a]
        a = b
    return out


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

