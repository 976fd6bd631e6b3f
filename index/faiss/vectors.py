"""The one interface of a FAISS collection's vector storage, whatever the kind.

:class:`index.faiss.FaissCollection` holds a :class:`VectorStore` -- a
:class:`~index.faiss.single.SingleStore` (one FAISS index) or a :class:`~index.faiss.multi.MultiStore`
(token segments + an optional token ANN index) -- and drives it through these methods only:
load what a commit names, add and remove by internal id, write the files of the next commit,
compact, report statistics. Searching is kind-specific (``search`` for single, ``exhaustive``/
``rerank``/``token_candidates`` for multi) and dispatched on the spec's kind by the base class.

What a store keeps in the document store's ``meta`` table (:attr:`VectorStore.META_KEYS`) and
the ``segments`` table is its *state*: :class:`StoreState` on load, :class:`StoreCommit` on write.
"""

from __future__ import annotations

import zipfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..spec import CollectionSpec


@dataclass
class StoreState:
    """What the committed database says about the vector files: the store's ``meta`` keys and
    the ``segments`` rows ``(seg_id, n_docs, n_vectors)``."""

    meta: dict[str, Any] = field(default_factory=dict)
    segments: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class StoreCommit:
    """What one commit records for the store: ``meta`` keys to set, a new ``segments`` row, and
    whether the old rows go first (after compaction)."""

    meta: dict[str, Any] = field(default_factory=dict)
    new_segment: tuple[int, int, int] | None = None
    reset_segments: bool = False


class VectorStore(ABC):
    """Vectors keyed by internal int64 ids, written to a folder commit by commit."""

    #: the ``meta`` keys this kind of store owns (read into :attr:`StoreState.meta`)
    META_KEYS: ClassVar[tuple[str, ...]] = ()
    #: whether it can build a token-level ANN index (``search(mode="tokens")``)
    supports_token_ann: ClassVar[bool] = False
    #: whether :meth:`load` takes ``live_ids=None`` for "every document of the files is live"
    #: (the caller checked the document store's count against them)
    accepts_all_live: ClassVar[bool] = False
    spec: CollectionSpec

    # ---- committed state ------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def load(cls, spec: CollectionSpec, folder: Path, state: StoreState,
             live_ids: np.ndarray | None) -> "VectorStore":
        """The committed store: the files ``state`` names, checked against the live ids
        (``None``: all of the files' documents, with :attr:`accepts_all_live`)."""

    @classmethod
    @abstractmethod
    def committed_files(cls, state: StoreState) -> list[str]:
        """Every file ``state`` names (the rest of the managed files are stale)."""

    @classmethod
    def required_files(cls, state: StoreState) -> list[str]:
        """The files :meth:`load` cannot do without."""
        return cls.committed_files(state)

    # ---- writes ---------------------------------------------------------------------------
    def check_add(self, n: int, companion: Any = None) -> None:
        """Refuse, before anything changes, a batch of ``n`` documents (with these companion
        rows) this store cannot take."""

    @abstractmethod
    def add(self, int_ids: np.ndarray, vectors: Any, companion: Any = None) -> None:
        """Add documents (single: ``[n, dim]``; multi: ``n`` arrays ``[n_i, dim]``, and their
        companion rows when the store keeps them)."""

    @abstractmethod
    def remove(self, int_ids: np.ndarray) -> None:
        """Remove documents (known internal ids)."""

    @property
    @abstractmethod
    def dirty(self) -> bool:
        """There is something the next commit must write."""

    @abstractmethod
    def write(self, folder: Path, gen: int) -> StoreCommit:
        """Write the files of commit ``gen`` durably (new names only) and say what to record."""

    @abstractmethod
    def mark_committed(self, commit: StoreCommit) -> None:
        """``commit`` is durable: what it wrote is now the committed state."""

    @abstractmethod
    def compacted(self, folder: Path) -> "VectorStore | None":
        """A store without tombstones (and, multi, in one segment), or ``None`` if this one
        has nothing to reclaim; ``folder`` is the collection's, where it may write files of the
        next commit under their ``.tmp`` names. The caller commits it."""

    def build_token_index(self) -> None:
        """Build the token-level ANN index (stores with :attr:`supports_token_ann`)."""
        raise NotImplementedError(type(self).__name__)

    # ---- reads ----------------------------------------------------------------------------
    @property
    @abstractmethod
    def n_docs(self) -> int:
        """Live documents."""

    @abstractmethod
    def live_vectors(self) -> int:
        """Live vectors."""

    @abstractmethod
    def vectors_of(self, int_id: int) -> dict[str, np.ndarray]:
        """``{"vector": [dim]}`` (single) or ``{"vectors": [n_i, dim]}`` (multi, float32)."""

    @abstractmethod
    def storage_stats(self, folder: Path) -> dict[str, Any]:
        """``bytes_per_doc``, ``tombstones``, ``segments``, ``token_index``, ``index_type`` (the
        store's part of :class:`index.base.Stats`)."""


class BaseAndDeltas(VectorStore):
    """A store committed as a base file (named by the ``meta`` key :attr:`META_KEY`) plus the
    append-only deltas of later commits (the list under :attr:`DELTAS_KEY`): single-vector and
    sparse stores."""

    META_KEY: ClassVar[str] = ""
    DELTAS_KEY: ClassVar[str] = ""

    @classmethod
    def committed_files(cls, state: StoreState) -> list[str]:
        if not state.meta.get(cls.META_KEY):
            return []
        return [state.meta[cls.META_KEY], *(state.meta.get(cls.DELTAS_KEY) or [])]


def npz_memmap(path: Path, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Read-only memory maps of the arrays ``names`` of an ``.npz`` file (``np.savez`` stores
    them uncompressed, each a whole ``.npy`` inside the zip); the ones stored compressed, or
    missing, are left out."""
    out: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for name in names:
            try:
                info = zf.getinfo(name + ".npy")
            except KeyError:
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                continue
            f.seek(info.header_offset + 26)  # the local header: name and extra field lengths
            n_name, n_extra = np.frombuffer(f.read(4), "<u2")
            f.seek(info.header_offset + 30 + int(n_name) + int(n_extra))
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read_header is None:
                continue
            shape, fortran, dtype = read_header(f)
            if fortran or dtype.hasobject:
                continue
            if int(np.prod(shape)) == 0:
                out[name] = np.zeros(shape, dtype)
                continue
            out[name] = np.memmap(path, dtype=dtype, mode="r", offset=f.tell(), shape=shape)
    return out
