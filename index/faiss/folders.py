"""The folders of FAISS collections under a data directory: created atomically (built under a
temporary name, then renamed), listed, deleted atomically (renamed away, then removed), and
their manifests read without loading any vectors."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from .docstore import DB_NAME, DocStore
from ..durable import fsync_dir, fsync_path, now_iso, write_durable_bytes
from embedpool.errors import ConflictError, NotFoundError
from .locks import FileLock
from ..spec import MANIFEST, CollectionSpec, check_name, new_manifest, read_manifest

LOCK_FILE = "writer.lock"  # flock held by the process that has uncommitted writes


def list_collections(data_dir: str | os.PathLike) -> list[str]:
    """Names of the collections in ``data_dir`` (sorted)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        return []
    return sorted(e.name for e in os.scandir(data_dir)
                  if e.is_dir() and not e.name.startswith(".") and (Path(e.path) / MANIFEST).is_file())


def collection_manifest(data_dir: str | os.PathLike, name: str) -> dict[str, Any]:
    """The committed manifest of collection ``name``, without loading its vectors."""
    check_name(name)
    data_dir = Path(data_dir)
    folder = data_dir / name
    if not folder.is_dir():
        have = list_collections(data_dir)
        raise NotFoundError(
            f"no collection {name!r}"
            + (f" (the collections: {', '.join(have)})" if have else " (there are no collections yet)"),
            param="name")
    return read_manifest(folder)


def delete_collection(data_dir: str | os.PathLike, name: str) -> None:
    """Delete a collection folder (refused while another writer holds it)."""
    check_name(name)
    data_dir = Path(data_dir)
    folder = data_dir / name
    if not folder.is_dir():
        raise NotFoundError(f"no collection {name!r}", param="name")
    if not (folder / MANIFEST).is_file():
        raise ConflictError(f"{name!r} in the data directory is not an embedpool collection (no {MANIFEST}); "
                            "not deleting it")
    lock = FileLock(folder / LOCK_FILE)
    if not lock.try_acquire():
        raise ConflictError(f"collection {name!r} has uncommitted writes in progress; "
                            "close its writer first")
    try:
        trash = data_dir / f".{name}.deleting-{uuid.uuid4().hex[:8]}"
        os.rename(folder, trash)  # disappears atomically
        fsync_dir(data_dir)
    finally:
        lock.release()
    shutil.rmtree(trash, ignore_errors=True)


def create_folder(data_dir: Path, name: str, spec: CollectionSpec) -> None:
    """Make ``<data_dir>/<name>`` appear atomically (built under a temporary name, renamed);
    if someone else created it meanwhile, theirs stays."""
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = data_dir / f".{name}.creating-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _init_folder(tmp, name, spec)
        try:
            os.rename(tmp, data_dir / name)  # atomic; fails if someone created it meanwhile
        except OSError:
            if not (data_dir / name).exists():
                raise
        else:
            fsync_dir(data_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _init_folder(folder: Path, name: str, spec: CollectionSpec) -> None:
    db = DocStore(folder / DB_NAME, create=True)
    try:
        db.begin()
        for k, v in (("generation", 0), ("next_int_id", 0), ("next_seg_id", 0),
                     ("vector_file", None), ("token_index", None), ("format_version", spec.format_version)):
            db.set_meta(k, v)
        db.commit()
        if spec.lexical:
            db.create_lexical()
    finally:
        db.close()
    manifest = new_manifest(name, spec, now_iso(), counts={"documents": 0, "vectors": 0})
    write_durable_bytes(folder / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    fsync_path(folder / DB_NAME)
    fsync_dir(folder)
