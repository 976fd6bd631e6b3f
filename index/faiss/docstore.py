"""SQLite document store: external string id <-> internal int64 id, text, metadata JSON.

It is also the commit point of a collection: the ``meta`` table names the current vector
file / segments, and one SQLite transaction switches documents and vectors together -- and with
them what searches read besides vectors: the ``fields`` table (one row per metadata value, what
metadata filters select with, :mod:`index.filters`) and the FTS5 table of the lexical index
(:mod:`index.lexical`). A document's rows in all three are written and deleted together.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..filters import Node, field_rows, to_sql
from ..lexical import FTS_SCHEMA, FTS_TABLE

DB_NAME = "docs.sqlite"
_CHUNK = 900  # bound on SQL parameters per statement

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE docs (
    int_id   INTEGER PRIMARY KEY,
    ext_id   TEXT NOT NULL UNIQUE,
    text     TEXT,
    metadata TEXT
);
CREATE TABLE segments (
    seg_id    INTEGER PRIMARY KEY,
    n_docs    INTEGER NOT NULL,
    n_vectors INTEGER NOT NULL
);
"""

#: metadata values, one row each (index.filters.field_rows); ``num`` has no type affinity so
#: integers stay exact
_FIELDS_SCHEMA = """
CREATE TABLE fields (int_id INTEGER NOT NULL, key TEXT NOT NULL, type TEXT NOT NULL, num, str TEXT,
                     elem INTEGER NOT NULL);
CREATE INDEX fields_num ON fields(key, type, elem, num, int_id);
CREATE INDEX fields_str ON fields(key, type, str, int_id);
CREATE INDEX fields_doc ON fields(int_id);
"""


class DocStore:
    """One SQLite connection shared by the threads of a collection (guarded by a lock).

    Autocommit mode; writes happen inside one explicit ``BEGIN IMMEDIATE`` transaction opened by
    the first write and ended by :meth:`commit` or :meth:`rollback`. Reads on this connection see
    the uncommitted writes (the in-process view); other connections see the last commit.
    """

    def __init__(self, path: Path, *, create: bool = False) -> None:
        if not create and not path.is_file():
            raise FileNotFoundError(path)
        self.path = path
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False,
                                     timeout=30.0)
        self._in_tx = False
        if create:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.executescript("BEGIN;" + _SCHEMA + _FIELDS_SCHEMA + "COMMIT;")
        self._conn.execute("PRAGMA synchronous=FULL")
        tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        #: the store has the metadata fields table / the lexical index (collections made before
        #: filters and BM25 have neither)
        self.has_fields = "fields" in tables
        self.has_lexical = FTS_TABLE in tables

    def create_lexical(self) -> None:
        """Add the lexical index's FTS5 table (a new collection whose analyzer is not ``none``)."""
        with self._lock:
            self._conn.executescript("BEGIN;" + FTS_SCHEMA + ";COMMIT;")
            self.has_lexical = True

    # ---- transactions -------------------------------------------------------------------
    @property
    def in_transaction(self) -> bool:
        return self._in_tx

    def begin(self) -> None:
        with self._lock:
            if not self._in_tx:
                self._conn.execute("BEGIN IMMEDIATE")
                self._in_tx = True

    def commit(self) -> None:
        with self._lock:
            if self._in_tx:
                self._conn.execute("COMMIT")
                self._in_tx = False

    def rollback(self) -> None:
        with self._lock:
            if self._in_tx:
                self._conn.execute("ROLLBACK")
                self._in_tx = False

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """All-or-nothing group of writes inside the open transaction."""
        with self._lock:
            self._conn.execute("SAVEPOINT sp")
            try:
                yield
            except BaseException:
                self._conn.execute("ROLLBACK TO sp")
                self._conn.execute("RELEASE sp")
                raise
            self._conn.execute("RELEASE sp")

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """A consistent read of several statements (outside a write transaction)."""
        with self._lock:
            if self._in_tx:
                yield
                return
            self._conn.execute("BEGIN")
            try:
                yield
            finally:
                self._conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self.rollback()
            self._conn.close()

    # ---- meta ---------------------------------------------------------------------------
    def get_meta(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self._conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def set_meta(self, key: str, value: Any) -> None:
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                               (key, json.dumps(value)))

    # ---- documents ----------------------------------------------------------------------
    def count(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM docs").fetchone()[0])

    def all_int_ids(self) -> np.ndarray:
        with self._lock:
            cur = self._conn.execute("SELECT int_id FROM docs ORDER BY int_id")
            return np.fromiter((r[0] for r in cur), dtype=np.int64)

    def all_ext_ids(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._conn.execute("SELECT ext_id FROM docs ORDER BY int_id")]

    def lookup_ext(self, ext_ids: Sequence[str]) -> dict[str, int]:
        """ext id -> int id for the ids that exist."""
        out: dict[str, int] = {}
        with self._lock:
            for i in range(0, len(ext_ids), _CHUNK):
                chunk = list(ext_ids[i:i + _CHUNK])
                q = f"SELECT ext_id, int_id FROM docs WHERE ext_id IN ({','.join('?' * len(chunk))})"
                out.update(self._conn.execute(q, chunk).fetchall())
        return out

    def fetch(self, int_ids: Iterable[int]) -> dict[int, tuple[str, str | None, dict | None]]:
        """int id -> (ext id, text, metadata) for the ids that exist."""
        ids = [int(i) for i in int_ids]
        out: dict[int, tuple[str, str | None, dict | None]] = {}
        with self._lock:
            for i in range(0, len(ids), _CHUNK):
                chunk = ids[i:i + _CHUNK]
                q = ("SELECT int_id, ext_id, text, metadata FROM docs "
                     f"WHERE int_id IN ({','.join('?' * len(chunk))})")
                for int_id, ext, text, meta in self._conn.execute(q, chunk):
                    out[int_id] = (ext, text, None if meta is None else json.loads(meta))
        return out

    def live_among(self, int_ids: Iterable[int]) -> list[int]:
        """The live ones among ``int_ids``."""
        return list(self.ext_of(int_ids))

    def ext_of(self, int_ids: Iterable[int]) -> dict[int, str]:
        """int id -> ext id for the ids that exist."""
        ids = [int(i) for i in int_ids]
        out: dict[int, str] = {}
        with self._lock:
            for i in range(0, len(ids), _CHUNK):
                chunk = ids[i:i + _CHUNK]
                q = f"SELECT int_id, ext_id FROM docs WHERE int_id IN ({','.join('?' * len(chunk))})"
                out.update(self._conn.execute(q, chunk).fetchall())
        return out

    def insert(self, rows: Sequence[tuple[int, str, str | None, str | None]],
               terms: Sequence[str] | None = None) -> None:
        """rows: (int_id, ext_id, text, metadata JSON); ``terms``: each document's analyzed text
        for the lexical index (:meth:`index.lexical.Analyzer.document_terms`)."""
        with self._lock:
            self._conn.executemany(
                "INSERT INTO docs(int_id, ext_id, text, metadata) VALUES (?, ?, ?, ?)", rows)
            if self.has_fields:
                self._conn.executemany(
                    "INSERT INTO fields(int_id, key, type, num, str, elem) VALUES (?, ?, ?, ?, ?, ?)",
                    [(r[0], *f) for r in rows if r[3] is not None for f in field_rows(json.loads(r[3]))])
            if self.has_lexical and terms is not None:
                self._conn.executemany(f"INSERT INTO {FTS_TABLE}(rowid, terms) VALUES (?, ?)",
                                       [(r[0], t) for r, t in zip(rows, terms)])  # "" too: N counts it

    def delete_int(self, int_ids: Sequence[int]) -> None:
        ids = [(int(i),) for i in int_ids]
        with self._lock:
            self._conn.executemany("DELETE FROM docs WHERE int_id=?", ids)
            if self.has_fields:
                self._conn.executemany("DELETE FROM fields WHERE int_id=?", ids)
            if self.has_lexical:
                self._conn.executemany(f"DELETE FROM {FTS_TABLE} WHERE rowid=?", ids)

    # ---- filters and the lexical index ----------------------------------------------------
    def matching(self, node: Node) -> np.ndarray:
        """The sorted internal ids of the documents that match filter ``node``."""
        sql, params = to_sql(node)
        with self._lock:
            (ids,) = self._conn.execute(f"SELECT group_concat(int_id) FROM ({sql})", params).fetchone()
        if not ids:
            return np.zeros(0, np.int64)
        # one string from SQLite, parsed in C: 7x faster than a Python list at a million ids
        return np.unique(np.fromstring(ids, dtype=np.int64, sep=","))

    def matching_among(self, node: Node, int_ids: Iterable[int]) -> set[int]:
        """The internal ids among ``int_ids`` that exist and match filter ``node``; the query's
        cost follows their number (:func:`index.filters.to_sql` ``among``)."""
        among = json.dumps([int(i) for i in int_ids])
        sql, params = to_sql(node, among)
        with self._lock:
            return {r[0] for r in self._conn.execute(sql, params)}

    def lexical(self, match: str, k: int, node: Node | None = None) -> list[tuple[float, int]]:
        """The best ``k`` (BM25 score, internal id) for an FTS5 MATCH expression, best first,
        among the documents that match filter ``node`` (the filter is part of the query)."""
        q = f"SELECT rowid, bm25({FTS_TABLE}) FROM {FTS_TABLE} WHERE {FTS_TABLE} MATCH ?"
        params: list[Any] = [match]
        if node is not None:
            sql, fp = to_sql(node)
            q += f" AND rowid IN ({sql})"
            params += fp
        with self._lock:
            rows = self._conn.execute(q + f" ORDER BY bm25({FTS_TABLE}) LIMIT ?", [*params, int(k)]).fetchall()
        return [(-float(s), int(i)) for i, s in rows]

    # ---- segments (multi-vector) --------------------------------------------------------
    def segments(self) -> list[tuple[int, int, int]]:
        with self._lock:
            return [tuple(r) for r in self._conn.execute(
                "SELECT seg_id, n_docs, n_vectors FROM segments ORDER BY seg_id")]

    def add_segment(self, seg_id: int, n_docs: int, n_vectors: int) -> None:
        with self._lock:
            self._conn.execute("INSERT INTO segments(seg_id, n_docs, n_vectors) VALUES (?, ?, ?)",
                               (seg_id, n_docs, n_vectors))

    def clear_segments(self) -> None:
        with self._lock:
            self._conn.execute("DELETE FROM segments")
