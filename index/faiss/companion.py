"""The companion rows of a multi-vector collection: single vectors (a mean, a MUVERA FDE, ...)
that give ``two_stage`` search its candidates, kept by the collection itself and written in the
same commit as the documents they stand for (``CollectionSpec.companion_pooler``).

A document has one row (``companion_rows="document"``) or one or more (``"window"``: e.g. one
per window of a long document, so that a passage deep inside a 30,000-token transcript still
has a row of its own to be found by). The rows live in one FAISS index, a
:class:`~index.faiss.single.SingleStore` (``companion_factory``), under the ids
``doc_int_id << ROW_BITS | row``; the multi-vector segments record how many rows each document
has, so removing a document removes exactly its rows (or, in an index that cannot remove rows --
HNSW -- leaves them dead until compaction: they are never returned). Candidates are the distinct
live documents of the best rows, as many as asked for: ``candidates`` still counts documents.
"""

from __future__ import annotations

import numpy as np

from embedpool.errors import InvalidError
from .single import SingleStore

#: bits of a row id that number a document's rows (2**20 rows: a document of ~266M tokens at
#: one row per 254-token window)
ROW_BITS = 20
MAX_ROWS = 1 << ROW_BITS


def row_ids(int_ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The row ids of documents ``int_ids`` with ``counts`` rows each, in order."""
    int_ids = np.asarray(int_ids, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return (np.repeat(int_ids, counts) << ROW_BITS) | (np.arange(int(counts.sum()), dtype=np.int64) - starts)


def check_rows(counts: np.ndarray) -> None:
    if len(counts) and int(np.max(counts)) >= MAX_ROWS:
        raise InvalidError(f"a document has {int(np.max(counts))} companion rows; at most {MAX_ROWS - 1} "
                           "are supported", param="companion")


class CompanionRows(SingleStore):
    """The companion index: rows keyed by :func:`row_ids`, committed as ``companion-<gen>.faiss``
    (the ``companion_file`` meta key) and its deltas (``companion_deltas``, :mod:`index.faiss.single`)."""

    META_KEYS = ("companion_file", "companion_deltas")
    META_KEY = "companion_file"
    DELTAS_KEY = "companion_deltas"
    FILE_PREFIX = "companion"

    def add_docs(self, int_ids: np.ndarray, rows: list[np.ndarray]) -> np.ndarray:
        """Add the rows of documents ``int_ids``; returns each document's row count."""
        counts = np.array([len(r) for r in rows], dtype=np.int64)
        check_rows(counts)
        self.check_add(int(counts.sum()))
        self.add(row_ids(int_ids, counts), rows[0] if len(rows) == 1 else np.concatenate(rows))
        return counts

    def remove_docs(self, int_ids: np.ndarray, counts: np.ndarray) -> None:
        self.remove(row_ids(int_ids, counts))

    def candidates(self, x: np.ndarray, k: int, allowed: np.ndarray | None = None,
                   doc_ok: np.ndarray | None = None) -> list[np.ndarray]:
        """Per query, the int ids of the ``k`` documents of the best rows (fewer if the
        collection has fewer), best first. Rows are over-fetched until ``k`` distinct documents
        are found or every row was seen. A metadata filter either gives ``allowed``, the row ids
        (sorted) of the documents it keeps -- a selector inside the search --, or ``doc_ok``, a
        bool per internal document id: rows of other documents are skipped while over-fetching
        (cheaper when the filter keeps most documents)."""
        n_rows = self.n_docs if allowed is None else len(allowed)
        out: list[np.ndarray | None] = [None] * len(x)
        if not n_rows or not len(x):
            return [np.zeros(0, np.int64) for _ in range(len(x))]
        todo = np.arange(len(x))
        kk = min(n_rows, 2 * k + 16)
        while len(todo):
            _, I = self.search(x[todo], kk, allowed)
            short = []
            for r, q in enumerate(todo.tolist()):
                rows = I[r][I[r] >= 0]
                docs = rows >> ROW_BITS
                if doc_ok is not None:
                    docs = docs[doc_ok[docs]]
                _, first = np.unique(docs, return_index=True)
                best = docs[np.sort(first)][:k]  # distinct documents, in the order of their best row
                if len(best) < k and kk < n_rows:
                    short.append(q)
                else:
                    out[q] = best
            todo = np.array(short, dtype=np.int64)
            kk = min(n_rows, 4 * kk)
        return out  # type: ignore[return-value]
