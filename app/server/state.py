"""What the routes share besides the engines (:mod:`app.server.engine`): the open collections.
Routes get them through the dependencies in :mod:`app.server.deps`."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

from embedpool import index
from embedpool.app.settings import Settings
from embedpool.errors import ConflictError, NotFoundError
from embedpool.index import CollectionBase


class Collections:
    """Open collections, shared by all requests, on the configured backend (``faiss`` folders
    under ``data_dir``, or Milvus).

    One collection object per name stays open (searches run concurrently on it; its writes are
    serialized by the collection). Each request first asks it to ``refresh()`` (cheap when
    nothing changed): if another process committed to it (e.g. ``embedpool index``), the request
    sees the new state; if another process deleted it, it is closed here too.
    """

    def __init__(self, settings: Settings) -> None:
        self.data_dir = Path(settings.data_dir)
        self._where = settings.store(reads=True)
        self._open: dict[str, CollectionBase] = {}
        self._lock = threading.RLock()

    def get(self, name: str) -> CollectionBase:
        with self._lock:
            coll = self._open.get(name)
        if coll is not None:  # refreshed outside the lock: requests for others do not wait
            try:
                coll.refresh()  # committed by another process
                return coll
            except ConflictError:
                return coll  # our own write is in progress; it refreshes after
            except NotFoundError:  # deleted by another process
                with self._lock:
                    if self._open.get(name) is coll:
                        del self._open[name]
                coll.close()
        with self._lock:
            coll = self._open.get(name)
            if coll is None:
                coll = self._open[name] = index.open_collection(self.data_dir, name, **self._where)
            return coll

    def create(self, name: str, spec: index.CollectionSpec) -> tuple[CollectionBase, bool]:
        """(collection, created): an existing one with the same spec is returned as is."""
        with self._lock:
            existed = name in self.names()
            coll = index.open_collection(self.data_dir, name, spec, **self._where)
            old = self._open.get(name)
            if old is not None and old is not coll:
                coll.close()
                coll = old
            self._open[name] = coll
            return coll, not existed

    def add(self, coll: CollectionBase, ids: list[str], vectors: Any, texts: list[str] | None = None,
            metadata: list[dict | None] | None = None, *, model: str | None = None, pooler: str | None = None,
            companion: Any = None) -> None:
        """:meth:`index.CollectionBase.add` (an upsert), committed."""
        self._committed(coll, lambda: coll.add(ids, vectors, texts, metadata, model=model, pooler=pooler,
                                               companion=companion))

    def delete_documents(self, coll: CollectionBase, ids: list[str]) -> None:
        """``coll.delete(ids)``, committed."""
        self._committed(coll, lambda: coll.delete(ids))

    def delete_where(self, coll: CollectionBase, filter: Any) -> int:
        """``coll.delete_where(filter)``, committed: how many documents it deleted."""
        n = [0]
        self._committed(coll, lambda: n.__setitem__(0, coll.delete_where(filter)))
        return n[0]

    @staticmethod
    def _committed(coll: CollectionBase, write: Callable[[], None]) -> None:
        """``write()`` then commit; if another process committed meanwhile, refresh and retry once."""
        for attempt in (0, 1):
            try:
                write()
                coll.commit()
                break
            except ConflictError:
                if attempt or not coll.refresh():
                    raise

    def delete(self, name: str) -> None:
        with self._lock:
            coll = self._open.pop(name, None)
            if coll is not None:
                coll.close()
            index.delete_collection(self.data_dir, name, **self._where)

    def names(self) -> list[str]:
        return index.list_collections(self.data_dir, **self._where)

    def manifest(self, name: str) -> dict[str, Any]:
        """The manifest: with the current counts of a collection this server has open, else the
        committed one, read without opening the collection (loading its vectors)."""
        with self._lock:
            if name in self._open:
                return self.get(name).manifest
        return index.read_collection_manifest(self.data_dir, name, **self._where)

    def close(self) -> None:
        with self._lock:
            for coll in self._open.values():
                coll.close()
            self._open.clear()
