"""Choose the storage backend in one place.

    coll = open_collection(settings.data_dir, "scifact-mean", spec,
                           backend=settings.backend,          # "faiss" | "milvus"
                           milvus_uri=settings.milvus_uri,    # ./milvus.db | http://host:19530
                           milvus_token=settings.milvus_token)

``spec=None`` opens an existing collection; with a spec it opens or creates (refusing a
different spec). Every backend returns a :class:`index.base.CollectionBase` with the same
methods, and answers the same four module-level questions (:class:`Backend`). A new backend is a
module with a ``CollectionBase`` subclass and a ``Backend``, named in :data:`_MODULES`.
"""

from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import CollectionBase
from embedpool.errors import InvalidError
from .spec import CollectionSpec

#: backend name -> the module that holds its ``BACKEND`` (imported on first use: pymilvus is
#: slow to import)
_MODULES = {"faiss": "embedpool.index.faiss", "milvus": "embedpool.index.milvus"}
BACKENDS = tuple(_MODULES)
#: the read consistencies of a server backend (Milvus' levels). embedpool creates every Milvus
#: collection ``Strong``: a read waits for the server's time tick (~200 ms on a standalone 2.3
#: server, bench/milvus_server.py) and then sees every committed write, from any process.
#: ``Session``: this client's own writes at once, other processes' within the tick; ``Bounded``:
#: at most a few seconds stale; ``Eventually``: no wait at all.
READ_CONSISTENCY = ("Strong", "Session", "Bounded", "Eventually")


@dataclass(frozen=True)
class Where:
    """Where collections live: a data directory (FAISS folders; the default place of a Milvus
    Lite file) and, for a server backend, its URI and token."""

    data_dir: Path
    uri: str | None = None
    token: str | None = None
    #: a server backend's read consistency (Milvus: ``Strong``, ``Session``, ``Bounded``,
    #: ``Eventually``); ``None``: the collection's own (embedpool creates them ``Strong``)
    consistency: str | None = None


class Backend(ABC):
    """What every backend module provides besides its collection class."""

    @abstractmethod
    def open(self, where: Where, name: str, spec: CollectionSpec | None) -> CollectionBase:
        """Open ``name`` (``spec=None``) or open-or-create it with ``spec``."""

    @abstractmethod
    def list(self, where: Where) -> list[str]:
        """Names of the collections there (sorted)."""

    @abstractmethod
    def delete(self, where: Where, name: str) -> None:
        """Delete a collection and its data."""

    @abstractmethod
    def manifest(self, where: Where, name: str) -> dict[str, Any]:
        """The committed manifest of ``name``, as cheaply as the backend can (no vectors loaded)."""

    def status(self, where: Where) -> dict[str, Any]:
        """Whether the storage answers now, for a health check: ``{"backend", "status": "ok" |
        "unreachable", "location", ...}`` (a backend of local files is always ``ok``)."""
        return {"backend": type(self).__name__.removesuffix("Backend").lower(), "status": "ok",
                "location": str(where.data_dir)}


def _backend(backend: str) -> Backend:
    if backend not in _MODULES:
        raise InvalidError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}", param="backend")
    return importlib.import_module(_MODULES[backend]).BACKEND


def _where(data_dir: str | os.PathLike, milvus_uri: str | None, milvus_token: str | None,
           milvus_consistency: str | None = None) -> Where:
    return Where(Path(data_dir), milvus_uri, milvus_token, milvus_consistency)


def open_collection(data_dir: str | os.PathLike, name: str, spec: CollectionSpec | None = None, *,
                    backend: str = "faiss", milvus_uri: str | None = None,
                    milvus_token: str | None = None, milvus_consistency: str | None = None) -> CollectionBase:
    """Open collection ``name`` (``spec=None``) or open-or-create it with ``spec``.

    Args:
        data_dir: folder of FAISS collections; with ``backend="milvus"`` only the default
            location of the Milvus Lite file (``<data_dir>/milvus.db``) when ``milvus_uri`` is None.
        backend: ``faiss`` (folders under ``data_dir``) or ``milvus``.
        milvus_uri: Milvus Lite file (``./milvus.db``) or server URI (``http://host:19530``).
        milvus_token: Milvus token (``user:password`` or an API key), if the server needs one.
        milvus_consistency: the consistency of this collection object's reads on a Milvus
            server (``Strong``: every committed write, from any process, at the cost of waiting
            for the server's time tick; ``Session``: this process's own writes at once, other
            processes' within the tick); ``None``: ``Strong``. Writes are unaffected.
    """
    return _backend(backend).open(_where(data_dir, milvus_uri, milvus_token, milvus_consistency), name, spec)


def list_collections(data_dir: str | os.PathLike, *, backend: str = "faiss",
                     milvus_uri: str | None = None, milvus_token: str | None = None,
                     milvus_consistency: str | None = None) -> list[str]:
    """Names of the collections of a backend (sorted)."""
    return _backend(backend).list(_where(data_dir, milvus_uri, milvus_token))


def delete_collection(data_dir: str | os.PathLike, name: str, *, backend: str = "faiss",
                      milvus_uri: str | None = None, milvus_token: str | None = None,
                      milvus_consistency: str | None = None) -> None:
    """Delete a collection and its data."""
    _backend(backend).delete(_where(data_dir, milvus_uri, milvus_token), name)


def storage_status(data_dir: str | os.PathLike, *, backend: str = "faiss", milvus_uri: str | None = None,
                   milvus_token: str | None = None, milvus_consistency: str | None = None) -> dict[str, Any]:
    """Whether the backend's storage answers now (:meth:`Backend.status`), without raising."""
    return _backend(backend).status(_where(data_dir, milvus_uri, milvus_token))


def read_collection_manifest(data_dir: str | os.PathLike, name: str, *, backend: str = "faiss",
                             milvus_uri: str | None = None,
                             milvus_token: str | None = None,
                             milvus_consistency: str | None = None) -> dict[str, Any]:
    """The committed manifest of collection ``name`` (spec, counts at the last commit, times),
    without opening it: listing many collections does not load their vectors."""
    return _backend(backend).manifest(_where(data_dir, milvus_uri, milvus_token, milvus_consistency), name)
