"""Crash-safe file writes: the one fsync-and-rename write every index file goes through.

A file is written under ``<name>.tmp``, flushed and fsynced, renamed over ``<name>`` (atomic on
POSIX) and, unless the caller batches several files, its directory is fsynced so the rename
itself is durable. A crash at any instruction leaves either the old file or the new one, never a
torn one; a leftover ``.tmp`` is garbage that the next writer deletes. (The standard library has
no such helper; ``os.replace`` alone does not make the data or the rename durable.)
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def now_iso() -> str:
    """The current UTC time, to the second, as ISO 8601 (manifest timestamps)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by name (for a directory: renames, creations and deletions
    inside it become durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: fsync a directory: renames, creations and deletions inside it become durable.
fsync_dir = fsync_path


def write_durable(path: Path, writer: Callable[[BinaryIO], object] | None = None, *,
                  write_to: Callable[[str], object] | None = None, sync_dir: bool = True) -> None:
    """Write ``path`` crash-safely (see the module docstring).

    Args:
        path: the file to (re)place.
        writer: writes the content to an open binary file.
        write_to: instead of ``writer``, writes the content to a file *name* (for libraries
            that only write by name, such as ``faiss.write_index``).
        sync_dir: fsync the directory after the rename; ``False`` when the caller writes
            several files and fsyncs the directory once after the last.
    """
    if (writer is None) == (write_to is None):
        raise TypeError("give exactly one of writer or write_to")
    tmp = path.with_name(path.name + ".tmp")
    if writer is not None:
        with open(tmp, "wb") as f:
            writer(f)
            f.flush()
            os.fsync(f.fileno())
    else:
        write_to(str(tmp))
        fsync_path(tmp)
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


def write_durable_bytes(path: Path, data: bytes) -> None:
    write_durable(path, lambda f: f.write(data))


def remove_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
