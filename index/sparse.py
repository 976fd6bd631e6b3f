"""Sparse rows -- learned sparse vectors such as SPLADE's, one weight per vocabulary entry, nearly
all zero -- as every backend takes them: the input check, the index settings, and the exact
scoring.

**Rows.** A sparse collection (``kind="sparse"``, ``dim`` = the vocabulary's size) stores per
document its non-zero weights as ``(token id, weight)`` pairs. ``add`` and ``search`` take one
row per document or query, each ``(indices, values)`` or ``{"indices": [...], "values": [...]}``
(what ``poolers.splade.sparse_entries`` gives; ``app/`` converts the pooler's output with it), or
one ``scipy.sparse`` matrix ``[n, dim]``. :func:`check_sparse_rows` turns them into one CSR
matrix (float32 weights, ascending token ids, no stored zeros) or refuses the whole batch naming
the field: a dense array (:class:`ConflictError`: the collection is sparse), a token id outside
``0 .. dim-1``, a negative, NaN or infinite weight, a token id twice in one row
(:class:`InvalidError`). Weights are scored by dot product as they are (SPLADE's weights are
``log(1 + ReLU(.))``, never negative), so the spec's ``metric`` is ``ip`` and ``normalized`` false.

**The index** (the spec's ``factory`` of a sparse collection, :func:`parse_sparse_factory`):

- ``exact``: every query is scored against every stored row by a sparse matrix product
  (``scipy.sparse`` CSR): the exact top k, the reference an approximate index is checked against.
- ``seismic[:option=value,...]``: Seismic (Bruch et al., SIGIR 2024; the ``pyseismic-lsr``
  library), an inverted index whose posting lists are pruned to the ``n_postings`` best entries
  per token and grouped into blocks with summary vectors, so a query reads few blocks. Build
  options ``n_postings``, ``centroid_fraction``, ``summary_energy``; search options
  ``query_cut`` (the query's heaviest tokens read) and ``heap_factor`` (how readily a block is
  skipped: higher reads more and misses fewer) -- the accuracy/speed knobs. Its candidates are
  scored again exactly over the stored rows, so its scores are the exact path's.
- ``auto`` (the default): ``exact`` while the stored rows take at most :data:`EXACT_BYTES`,
  then ``seismic`` with its defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp

from embedpool.errors import ConflictError, InvalidError

#: ``auto`` scores exactly while the stored rows (token ids + weights) take at most this many
#: bytes: a scan of 64 MiB of CSR rows is tens of milliseconds a query on one core
EXACT_BYTES = 64 << 20
#: bytes of the dense ``[rows, queries]`` score block of one exact product (queries are scored
#: in groups that fit)
SCORE_BLOCK_BYTES = 32 << 20
#: Seismic's options: name -> (type, default, lowest allowed)
SEISMIC_BUILD = {"n_postings": (int, 3500, 1), "centroid_fraction": (float, 0.1, 1e-6),
                 "summary_energy": (float, 0.4, 1e-6)}
SEISMIC_SEARCH = {"query_cut": (int, 20, 1), "heap_factor": (float, 0.9, 1e-6)}
FACTORIES = ("auto", "exact", "seismic")


@dataclass(frozen=True)
class SparseFactory:
    """A sparse collection's index: ``kind`` (``auto``, ``exact``, ``seismic``) and Seismic's
    build and search options (defaults filled in)."""

    kind: str
    build: dict[str, Any] = field(default_factory=dict)
    search: dict[str, Any] = field(default_factory=dict)

    def resolved(self, stored_bytes: int) -> str:
        """``exact`` or ``seismic`` for rows of ``stored_bytes`` bytes."""
        if self.kind != "auto":
            return self.kind
        return "exact" if stored_bytes <= EXACT_BYTES else "seismic"


def parse_sparse_factory(factory: Any, param: str = "factory") -> SparseFactory:
    """The index of a sparse collection's ``factory`` string (module docstring), or
    :class:`InvalidError` naming ``param``."""
    if not isinstance(factory, str):
        raise InvalidError(f"{param}: a sparse collection's factory is a string ('auto', 'exact' or "
                           "'seismic[:option=value,...]')", param=param)
    kind, _, rest = factory.partition(":")
    if kind not in FACTORIES:
        raise InvalidError(f"{param}={factory!r}: a sparse collection's index is 'auto' (exact while small, then "
                           "seismic), 'exact' or 'seismic[:n_postings=3500,query_cut=20,heap_factor=0.9,...]'; "
                           "FAISS factories apply to dense collections", param=param)
    if rest and kind != "seismic":
        raise InvalidError(f"{param}={factory!r}: only 'seismic' takes options", param=param)
    build = {k: d for k, (_, d, _) in SEISMIC_BUILD.items()}
    search = {k: d for k, (_, d, _) in SEISMIC_SEARCH.items()}
    for item in filter(None, rest.split(",")):
        name, eq, value = item.partition("=")
        table = SEISMIC_BUILD if name in SEISMIC_BUILD else SEISMIC_SEARCH if name in SEISMIC_SEARCH else None
        if table is None or not eq:
            raise InvalidError(f"{param}={factory!r}: unknown seismic option {item!r}; use "
                               f"{', '.join([*SEISMIC_BUILD, *SEISMIC_SEARCH])} as name=value", param=param)
        typ, _, low = table[name]
        try:
            v = typ(value)
        except ValueError:
            raise InvalidError(f"{param}={factory!r}: {name} must be {'an integer' if typ is int else 'a number'}, "
                               f"got {value!r}", param=param) from None
        if not np.isfinite(v) or v < low:
            raise InvalidError(f"{param}={factory!r}: {name} must be positive, got {value!r}", param=param)
        (build if table is SEISMIC_BUILD else search)[name] = v
    return SparseFactory(kind, build, search)


def index_dtype(dim: int) -> np.dtype:
    """The token id type of a vocabulary of ``dim`` entries: 2 bytes up to 65,536 (BERT's 30,522),
    else 4 -- with float32 weights, 6 or 8 bytes per non-zero."""
    return np.dtype(np.uint16) if dim <= 1 << 16 else np.dtype(np.int32)


def empty_rows(dim: int) -> sp.csr_matrix:
    return sp.csr_matrix((0, dim), dtype=np.float32)


def stored_bytes(nnz: int, rows: int, dim: int) -> int:
    """Bytes ``rows`` rows of ``nnz`` non-zero weights in all take stored: a token id and a weight
    per non-zero (6 or 8 bytes, :func:`index_dtype`), one row offset and one id per row (16) --
    a sparse collection's ``stats()["bytes_per_doc"]`` on every backend."""
    return int(nnz) * (index_dtype(dim).itemsize + 4) + 16 * int(rows)


def row_bytes(m: sp.csr_matrix) -> int:
    """Bytes the rows of ``m`` take stored (:func:`stored_bytes`)."""
    return stored_bytes(m.nnz, m.shape[0], m.shape[1])


def row_dicts(m: sp.csr_matrix) -> list[dict[int, float]]:
    """The rows of a checked CSR matrix (:func:`check_sparse_rows`) as ``{token id: weight}``
    dicts, as pymilvus takes sparse vectors."""
    out = []
    for j in range(m.shape[0]):
        a, b = m.indptr[j], m.indptr[j + 1]
        out.append(dict(zip(m.indices[a:b].tolist(), m.data[a:b].tolist())))
    return out


def looks_sparse(vectors: Any) -> bool:
    """Whether ``vectors`` are sparse rows (a scipy matrix, ``(indices, values)`` pairs or
    ``{indices, values}`` dicts) rather than dense vectors."""
    if sp.issparse(vectors):
        return True
    if isinstance(vectors, (list, tuple)) and vectors:
        return isinstance(vectors[0], dict) or (isinstance(vectors[0], tuple) and len(vectors[0]) == 2)
    return False


def check_sparse_rows(dim: int, coll: str, vectors: Any, ids: Sequence[str] | None, what: str) -> sp.csr_matrix:
    """One row per document (``ids``) or query (``ids=None``) as a float32 CSR matrix
    ``[n, dim]`` with ascending token ids and no stored zeros, or the whole batch refused naming
    ``what`` (module docstring)."""
    def label(j: int) -> str:
        return f"document {ids[j]!r}" if ids is not None and j < len(ids) else f"query {j}"

    if sp.issparse(vectors):
        m = sp.csr_matrix(vectors)
        if m.shape[1] != dim:
            raise ConflictError(f"{what}: a [{m.shape[0]}, {m.shape[1]}] sparse matrix, but collection {coll!r} "
                                f"stores {dim}-entry vocabularies", param=what)
        rows = [(m.indices[m.indptr[j]:m.indptr[j + 1]], m.data[m.indptr[j]:m.indptr[j + 1]])
                for j in range(m.shape[0])]
    elif isinstance(vectors, np.ndarray) or (isinstance(vectors, (list, tuple)) and vectors
                                             and not isinstance(vectors[0], (dict, tuple))):
        shape = np.shape(vectors) if isinstance(vectors, np.ndarray) else (len(vectors), np.size(vectors[0]))
        raise ConflictError(
            f"{what}: collection {coll!r} is sparse: give one {{indices, values}} row (token ids and their weights) "
            f"per {'document' if ids is not None else 'query'}, not dense vectors (shape {shape})", param=what)
    elif isinstance(vectors, (list, tuple)):
        rows = [_pair(r, j, label, what, coll, ids is not None) for j, r in enumerate(vectors)]
    else:
        raise InvalidError(f"{what}: give a list of {{indices, values}} rows", param=what)
    if ids is not None and len(rows) != len(ids):
        raise InvalidError(f"{what}: {len(ids)} ids but {len(rows)} sparse rows; give one per id", param=what)
    indptr = np.zeros(len(rows) + 1, np.int64)
    parts_i, parts_v = [], []
    for j, (ind, val) in enumerate(rows):
        ind, val = _checked_row(ind, val, dim, label(j), what)
        parts_i.append(ind)
        parts_v.append(val)
        indptr[j + 1] = indptr[j] + len(ind)
    indices = np.concatenate(parts_i) if parts_i else np.zeros(0, np.int64)
    values = np.concatenate(parts_v) if parts_v else np.zeros(0, np.float32)
    return sp.csr_matrix((values, indices.astype(np.int32), indptr), shape=(len(rows), dim))


def _pair(row: Any, j: int, label, what: str, coll: str, documents: bool) -> tuple[Any, Any]:
    if isinstance(row, dict):
        if "indices" not in row or "values" not in row:
            raise InvalidError(f"{what}: the row of {label(j)} needs 'indices' and 'values'", param=what)
        return row["indices"], row["values"]
    if isinstance(row, tuple) and len(row) == 2:
        return row
    if isinstance(row, (list, np.ndarray)):
        raise ConflictError(
            f"{what}: collection {coll!r} is sparse: give one {{indices, values}} row (token ids and their weights) "
            f"per {'document' if documents else 'query'}, not dense vectors (the row of {label(j)} is "
            f"{np.size(row)} numbers)", param=what)
    raise InvalidError(f"{what}: the row of {label(j)} is not (indices, values) nor {{indices, values}}", param=what)


def _checked_row(ind: Any, val: Any, dim: int, label: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        i = np.asarray(ind)
        v = np.asarray(val)
    except ValueError:
        raise InvalidError(f"{what}: the row of {label}: indices and values must be lists of numbers",
                           param=what) from None
    if i.size == 0 and v.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    if i.ndim != 1 or v.ndim != 1 or len(i) != len(v):
        raise InvalidError(f"{what}: the row of {label} has {i.size} indices and {v.size} values; give one weight "
                           "per token id", param=what)
    if not np.issubdtype(i.dtype, np.integer):
        if not (np.issubdtype(i.dtype, np.floating) and np.isfinite(i).all() and (i == np.round(i)).all()):
            raise InvalidError(f"{what}: the row of {label}: indices must be integer token ids", param=what)
    if not (np.issubdtype(v.dtype, np.floating) or np.issubdtype(v.dtype, np.integer)):
        raise InvalidError(f"{what}: the row of {label}: values must be numbers", param=what)
    i = i.astype(np.int64)
    v = v.astype(np.float64)
    if not np.isfinite(v).all():
        bad = v[~np.isfinite(v)][0]
        raise InvalidError(f"{what}: the row of {label} has a weight of {bad} (token id {int(i[~np.isfinite(v)][0])}); "
                           "weights must be finite numbers", param=what)
    if (v < 0).any():
        k = int(np.flatnonzero(v < 0)[0])
        raise InvalidError(f"{what}: the row of {label} has a negative weight {v[k]:g} (token id {int(i[k])}); "
                           "sparse weights are >= 0 (SPLADE's are log(1 + ReLU(.)))", param=what)
    if (i < 0).any() or (i >= dim).any():
        bad = int(i[(i < 0) | (i >= dim)][0])
        raise InvalidError(f"{what}: the row of {label} has token id {bad}, outside the collection's vocabulary "
                           f"of {dim} entries (0 .. {dim - 1}); use the model that made the collection", param=what)
    if np.abs(v).max() > np.finfo(np.float32).max:
        raise InvalidError(f"{what}: the row of {label} has a weight beyond float32", param=what)
    order = np.argsort(i, kind="stable")
    i, v = i[order], v[order].astype(np.float32)
    if len(i) > 1 and (np.diff(i) == 0).any():
        dup = int(i[1:][np.diff(i) == 0][0])
        raise InvalidError(f"{what}: the row of {label} has token id {dup} twice; give each token one weight",
                           param=what)
    keep = v != 0
    return i[keep], v[keep]


def exact_scores(rows: sp.csr_matrix, queries: sp.csr_matrix) -> np.ndarray:
    """Dot products ``[n_rows, n_queries]`` (float32) of every stored row with every query."""
    if rows.shape[0] == 0 or queries.shape[0] == 0:
        return np.zeros((rows.shape[0], queries.shape[0]), np.float32)
    return np.asarray((rows @ queries.T).toarray(), dtype=np.float32)


def exact_topk(rows: sp.csr_matrix, row_ids: np.ndarray, queries: sp.csr_matrix, k: int,
               keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k ``(scores [q, k], ids [q, k])`` of ``queries`` over ``rows`` (whose ids are
    ``row_ids``), among the rows where ``keep`` is true (``None``: all); rows padded with
    ``nan``/``-1``. Ties go to the earlier row. Queries are scored in groups whose score block
    stays within :data:`SCORE_BLOCK_BYTES`."""
    nq = queries.shape[0]
    out_d = np.full((nq, k), np.nan, np.float32)
    out_i = np.full((nq, k), -1, np.int64)
    if keep is not None:
        sel = np.flatnonzero(keep)
        rows, row_ids = rows[sel], row_ids[sel]
    n = rows.shape[0]
    if n == 0 or nq == 0:
        return out_d, out_i
    group = max(1, SCORE_BLOCK_BYTES // (4 * n))
    kk = min(k, n)
    for a in range(0, nq, group):
        s = exact_scores(rows, queries[a:a + group]).T  # [g, n]
        for r, row in enumerate(s):
            if n > 4 * kk:
                part = np.argpartition(-row, kk - 1)[:kk]
                order = part[np.lexsort((part, -row[part]))]
            else:
                order = np.argsort(-row, kind="stable")[:kk]
            out_d[a + r, :kk] = row[order]
            out_i[a + r, :kk] = row_ids[order]
    return out_d, out_i
