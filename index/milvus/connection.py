"""Connections to Milvus: one client per (uri, token), shared by the collections of a process,
that recovers when Milvus goes away and comes back.

``uri`` is a Milvus Lite database (a local path ending in ``.db``: pymilvus runs the embedded
engine -- with milvus-lite 3, a gRPC server on a thread of this process -- for it) or a Milvus
server (``http://host:19530``, optional ``token``).

Recovery: a call that cannot reach Milvus fails with :class:`UnavailableError` (an *unavailable*
error: the HTTP API answers 503) and marks the connection broken; the next call makes a new
client -- for a Milvus Lite file, after stopping the dead engine, a new engine for the same file
-- so requests succeed again as soon as Milvus is back, without restarting embedpool. A
collection that a restarted Milvus has released is loaded again by :class:`MilvusCollection`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from embedpool.errors import ConflictError, NotFoundError, UnavailableError
from .versions import MilvusFeatures, features_of

log = logging.getLogger("embedpool.index")

CONNECT_FAILED = 2  # pymilvus' Status.CONNECT_FAILED
COLLECTION_NOT_FOUND = 100  # Milvus' ErrCollectionNotFound
COLLECTION_NOT_LOADED = 101  # Milvus' ErrCollectionNotLoaded


def is_lite(uri: str) -> bool:
    return uri.endswith(".db") and "://" not in uri


def _code(e: Exception) -> Any:
    return getattr(e, "code", None)


def unreachable(e: Exception) -> bool:
    """The error says Milvus could not be reached (not that it refused the request)."""
    import grpc

    code = _code(e)
    return isinstance(e, grpc.RpcError) or code == CONNECT_FAILED or isinstance(code, grpc.StatusCode)


def not_loaded(e: Exception) -> bool:
    """The error says the collection is not loaded (a restarted Milvus released it)."""
    msg = str(getattr(e, "message", "") or e).lower()
    return _code(e) == COLLECTION_NOT_LOADED or "not loaded" in msg or "state 'released'" in msg


def _unreachable(uri: str, what: str, msg: str) -> str:
    return (f"{what}: Milvus at {uri} is unreachable ({msg}); the request can be retried once "
            "Milvus is back (embedpool reconnects by itself)")


def _stop_lite_engine(uri: str) -> None:
    """Stop the Milvus Lite engine pymilvus started for this file in this process (dead or
    alive), so its file lock is released and the next client starts a fresh one."""
    mgr = sys.modules.get("milvus_lite.server_manager")
    if mgr is not None:
        with contextlib.suppress(Exception):
            mgr.server_manager_instance.release_server(uri)


class Connection:
    """The shared client of one (uri, token); replaced after Milvus was unreachable."""

    def __init__(self, uri: str, token: str | None) -> None:
        self.uri = uri
        self.token = token or None
        self.refs = 0
        self._lock = threading.Lock()
        self._client: Any = None
        self._broken = False
        self._features: MilvusFeatures | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.uri, self.token or ""

    @property
    def broken(self) -> bool:
        """The last call found Milvus unreachable (the next one reconnects)."""
        return self._broken

    @property
    def features(self) -> MilvusFeatures:
        """What the Milvus at this URI can do (its version is read at every (re)connect)."""
        self.client()
        return self._features

    def client(self) -> Any:
        """The current client, a new one first if the last call found Milvus unreachable."""
        with self._lock:
            if self._client is None or self._broken:
                self._replace()
            return self._client

    def _replace(self) -> None:
        from pymilvus import MilvusClient
        from pymilvus.exceptions import MilvusException

        if self._client is not None:
            log.warning("reconnecting to Milvus at %s", self.uri)
            self._drop()
        try:
            # dedicated: our own gRPC channel, not pymilvus' process-wide shared one (which stays
            # closed after a failed reconnect); this pool shares the client within embedpool
            self._client = MilvusClient(uri=self.uri, token=self.token or "", dedicated=True)
        except MilvusException as e:
            if is_lite(self.uri):
                raise ConflictError(
                    f"cannot open Milvus Lite database {self.uri}: {e.message}. Milvus Lite allows one "
                    "process per .db file; stop the other process, or run a Milvus server and use "
                    "its http:// URI") from None
            raise UnavailableError(_unreachable(self.uri, "cannot connect to Milvus", e.message)) from None
        try:
            reported = self._client.get_server_version()
        except Exception as e:  # noqa: BLE001 -- pymilvus or gRPC: Milvus did not answer
            self._drop()
            raise UnavailableError(_unreachable(self.uri, "cannot connect to Milvus",
                                            f"reading its version: {getattr(e, 'message', None) or e}")) from None
        try:
            features = features_of(str(reported))  # refuses a Milvus older than 2.3
        except UnavailableError:
            self._drop()
            raise
        if self._features is None or features != self._features:
            log.info("Milvus at %s: %s", self.uri, features.name)
        self._features = features
        self._broken = False

    def _drop(self) -> None:
        client, self._client = self._client, None
        with contextlib.suppress(Exception):
            client.close()
        if is_lite(self.uri):
            _stop_lite_engine(self.uri)

    def close(self) -> None:
        """Close the client (and stop the Milvus Lite engine of a ``.db`` URI)."""
        with self._lock:
            if self._client is not None:
                self._drop()

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """Milvus errors as embedpool errors; an unreachable Milvus marks this connection broken."""
        import grpc
        from pymilvus.exceptions import MilvusException

        try:
            yield
        except (MilvusException, grpc.RpcError) as e:
            msg = getattr(e, "message", None) or str(e) or type(e).__name__
            if unreachable(e):
                self._broken = True
                raise UnavailableError(_unreachable(self.uri, f"Milvus {what} failed", msg)) from None
            if _code(e) == COLLECTION_NOT_FOUND:
                raise NotFoundError(f"{what} failed: {msg}") from None
            raise UnavailableError(f"Milvus {what} failed: {msg}") from None


class ClientPool:
    """The process's connections, shared by collections (counted); the last collection to
    release a connection closes it (stopping the embedded engine of a Milvus Lite file, so the
    file lock is free at once rather than at exit)."""

    _lock = threading.Lock()
    _pool: dict[tuple[str, str], Connection] = {}
    _write_locks: dict[tuple[str, str], threading.Lock] = {}

    @classmethod
    def acquire(cls, uri: str, token: str | None) -> Connection:
        """A connected :class:`Connection` (release it with :meth:`release`)."""
        if is_lite(uri):
            path = Path(uri).expanduser().resolve()
            path.parent.mkdir(parents=True, exist_ok=True)
            uri = str(path)
        key = (uri, token or "")
        with cls._lock:
            conn = cls._pool.get(key)
            if conn is None:
                conn = Connection(uri, token)
                conn.client()  # connect now: a bad URI or a locked file fails here
                cls._pool[key] = conn
            conn.refs += 1
            return conn

    @classmethod
    def held(cls, uri: str, token: str | None) -> bool:
        """A connection to ``uri`` is open in this process."""
        if is_lite(uri):
            uri = str(Path(uri).expanduser().resolve())
        with cls._lock:
            return (uri, token or "") in cls._pool

    @classmethod
    def release(cls, conn: Connection) -> None:
        with cls._lock:
            if cls._pool.get(conn.key) is not conn:
                return
            conn.refs -= 1
            if conn.refs > 0:
                return
            del cls._pool[conn.key]
        conn.close()

    @classmethod
    def write_lock(cls, conn: Connection, mname: str) -> threading.Lock:
        """One lock per Milvus collection, serializing this process's writers."""
        with cls._lock:
            return cls._write_locks.setdefault((conn.uri, mname), threading.Lock())
