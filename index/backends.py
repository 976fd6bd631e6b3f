"""Choose the storage backend in one place.

    coll = open_collection(settings.data_dir, "scifact-mean", spec,
                           backend=settings.backend,          # "faiss" | "milvus"
                           milvus_uri=settings.milvus_uri,    # ./milvus.db | http://host:19530
                           milvus_token=settings.milvus_token)

``spec=None`` opens an existing collection; with a spec it opens or creates (refusing a
different spec). Both backends return a :class:`index.base.CollectionBase` with the same methods.
"""

from __future__ import annotations

import os
from typing import Any

from .base import CollectionBase
from .collection import Collection
from .collection import delete_collection as _faiss_delete
from .collection import list_collections as _faiss_list
from .errors import InvalidInputError
from .spec import CollectionSpec

BACKENDS = ("faiss", "milvus")


def _milvus(data_dir: str | os.PathLike, milvus_uri: str | None) -> tuple[Any, str]:
    from . import milvus

    return milvus, milvus_uri or milvus.default_uri(data_dir)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise InvalidInputError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")


def open_collection(data_dir: str | os.PathLike, name: str, spec: CollectionSpec | None = None, *,
                    backend: str = "faiss", milvus_uri: str | None = None,
                    milvus_token: str | None = None) -> CollectionBase:
    """Open collection ``name`` (``spec=None``) or open-or-create it with ``spec``.

    Args:
        data_dir: folder of FAISS collections; with ``backend="milvus"`` only the default
            location of the Milvus Lite file (``<data_dir>/milvus.db``) when ``milvus_uri`` is None.
        backend: ``faiss`` (folders under ``data_dir``) or ``milvus``.
        milvus_uri: Milvus Lite file (``./milvus.db``) or server URI (``http://host:19530``).
        milvus_token: Milvus token (``user:password`` or an API key), if the server needs one.
    """
    _check_backend(backend)
    if backend == "faiss":
        return Collection.open(data_dir, name) if spec is None else Collection.open_or_create(data_dir, name, spec)
    milvus, uri = _milvus(data_dir, milvus_uri)
    if spec is None:
        return milvus.MilvusCollection.open(uri, name, token=milvus_token)
    return milvus.MilvusCollection.open_or_create(uri, name, spec, token=milvus_token)


def list_collections(data_dir: str | os.PathLike, *, backend: str = "faiss",
                     milvus_uri: str | None = None, milvus_token: str | None = None) -> list[str]:
    """Names of the collections of a backend (sorted)."""
    _check_backend(backend)
    if backend == "faiss":
        return _faiss_list(data_dir)
    milvus, uri = _milvus(data_dir, milvus_uri)
    return milvus.list_collections(uri, token=milvus_token)


def delete_collection(data_dir: str | os.PathLike, name: str, *, backend: str = "faiss",
                      milvus_uri: str | None = None, milvus_token: str | None = None) -> None:
    """Delete a collection and its data."""
    _check_backend(backend)
    if backend == "faiss":
        return _faiss_delete(data_dir, name)
    milvus, uri = _milvus(data_dir, milvus_uri)
    milvus.delete_collection(uri, name, token=milvus_token)
