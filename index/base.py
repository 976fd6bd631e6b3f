"""What every collection backend shares: the public API, argument checks and search dispatch.

A backend (:class:`index.collection.Collection` on FAISS, :class:`index.milvus.MilvusCollection`
on Milvus) subclasses :class:`CollectionBase` and implements the storage hooks (``_search_*``,
``_rerank``, ``_candidate_ids``, ``_open_sibling``). Candidate generation and ranking are
separate pieces, as in PyLate: ``two_stage`` asks any single-vector collection -- of either
backend -- for candidate ids, then the multi-vector collection reranks them by exact MaxSim.
"""

from __future__ import annotations

import threading
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import DocumentNotFoundError, InvalidInputError, SpecMismatchError
from .spec import CollectionSpec
from .validate import (
    as_matrix,
    check_ids,
    check_metadata,
    check_model_pooler,
    check_multi_vectors,
    check_positive_int,
    check_single_vectors,
    check_texts,
    preview,
)

MODES = ("exhaustive", "tokens", "two_stage")


@dataclass
class Hit:
    """One search result."""

    id: str
    score: float
    text: str | None
    metadata: dict | None


def check_spec_matches(existing: CollectionSpec, requested: CollectionSpec, name: str) -> None:
    """Refuse to open ``name`` with a spec that differs from the one it was created with."""
    diffs = existing.differences(requested)
    if diffs:
        raise SpecMismatchError(
            f"collection {name!r} already exists with a different spec ({'; '.join(diffs)}); "
            "use another collection name, or delete the collection first")


class CollectionBase:
    """Public API shared by the backends. Subclasses set ``name``, ``spec`` and ``backend``."""

    name: str
    spec: CollectionSpec
    backend: str = ""
    _manifest: dict[str, Any]

    def __init__(self) -> None:
        self._companion_lock = threading.Lock()
        self._companion: CollectionBase | None = None

    # ---- hooks ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        raise NotImplementedError

    def _search_single(self, x: np.ndarray, k: int) -> list[list[Hit]]:
        raise NotImplementedError

    def _search_exhaustive(self, qs: list[np.ndarray], k: int) -> list[list[Hit]]:
        raise NotImplementedError

    def _search_tokens(self, qs: list[np.ndarray], k: int, k_token: int) -> list[list[Hit]]:
        raise NotImplementedError

    def _rerank(self, qs: list[np.ndarray], ext_lists: list[list[str]], k: int) -> list[list[Hit]]:
        """Exact MaxSim of each query against its candidate documents (external ids)."""
        raise NotImplementedError

    def _candidate_ids(self, x: np.ndarray, k: int) -> list[list[str]]:
        raise NotImplementedError

    def _open_sibling(self, name: str) -> "CollectionBase":
        """Open collection ``name`` of the same backend and location (the companion)."""
        raise NotImplementedError

    def _sync(self) -> None:
        """Pick up commits made elsewhere since opening, if that is safe now (companions)."""

    def close(self) -> None:
        raise NotImplementedError

    def _counts(self) -> dict[str, int]:
        """``{"documents": ..., "vectors": ...}`` of the current state."""
        raise NotImplementedError

    @property
    def manifest(self) -> dict[str, Any]:
        """The manifest, with the counts of the current (in-process) state."""
        return {**self._manifest, "counts": self._counts()}

    # ---- writes -----------------------------------------------------------------------------
    def _check_add(self, ids: Sequence[str], vectors: Any, texts: Any, metadata: Any,
                   model: str | None, pooler: str | None):
        """Validate a whole ``add`` batch: ``(ids, vectors, texts, metadata JSON strings)``."""
        self._check_open()
        check_model_pooler(self.spec, self.name, model, pooler)
        ids = check_ids(ids)
        if self.spec.kind == "single":
            vecs: Any = check_single_vectors(self.spec, self.name, vectors, ids, "vectors")
        else:
            vecs = check_multi_vectors(self.spec, self.name, vectors, ids, "vectors")
        return ids, vecs, check_texts(texts, len(ids)), check_metadata(metadata, ids)

    def _check_delete(self, ids: Sequence[str]) -> list[str]:
        """The distinct ids of a ``delete`` call, validated."""
        self._check_open()
        return list(dict.fromkeys(check_ids(ids, allow_duplicates=True)))

    def _refuse_unknown(self, ids: list[str], found: Container[str]) -> None:
        unknown = [i for i in ids if i not in found]
        if unknown:
            raise DocumentNotFoundError(
                f"{len(unknown)} id(s) not in collection {self.name!r}: {preview(unknown)}; "
                "nothing was deleted")

    # ---- reads ------------------------------------------------------------------------------
    def search(self, queries: Any, k: int = 10, *, mode: str = "exhaustive", candidates: int = 100,
               k_token: int = 32, companion_queries: Any = None,
               companion: "CollectionBase | None" = None) -> list[list[Hit]]:
        """Top-k documents per query.

        Args:
            queries: single: ``[q, dim]`` array. multi: ``q`` arrays ``[m_i, dim]`` of query tokens.
            k: results per query.
            mode: multi only. ``exhaustive`` (exact MaxSim against every document), ``tokens``
                (token ANN: ``k_token`` neighbours per query token give the candidates, then exact
                MaxSim) or ``two_stage`` (the ``candidates`` best documents of the companion
                single-vector collection for ``companion_queries``, then exact MaxSim).
            companion: the companion collection (any backend); defaults to ``spec.companion``
                opened from the same backend and location.

        Returns:
            ``q`` lists of :class:`Hit`, best first. Scores: inner product (single ``ip``),
            squared L2 distance (single ``l2``, smaller is better) or MaxSim (multi).
        """
        self._check_open()
        k = check_positive_int("k", k)
        if self.spec.kind == "single":
            return self._search_single(as_matrix(queries, self.spec.dim, "queries", self.name), k)
        qs = check_multi_vectors(self.spec, self.name, queries, None, "queries")
        if mode not in MODES:
            raise InvalidInputError(f"unknown search mode {mode!r}; use one of {', '.join(MODES)}")
        if not qs:
            return []
        if mode == "exhaustive":
            return self._search_exhaustive(qs, k)
        if mode == "tokens":
            return self._search_tokens(qs, k, check_positive_int("k_token", k_token))
        candidates = check_positive_int("candidates", candidates)
        comp = self._resolve_companion(companion)
        if companion_queries is None:
            raise InvalidInputError(
                f"mode='two_stage' needs companion_queries: one pooled query vector per query "
                f"for companion collection {comp.name!r} (dim {comp.spec.dim})")
        cq = as_matrix(companion_queries, comp.spec.dim, "companion_queries", comp.name)
        if len(cq) != len(qs):
            raise InvalidInputError(
                f"companion_queries has {len(cq)} rows but there are {len(qs)} queries")
        return self._rerank(qs, comp.candidate_ids(cq, candidates), k)

    def candidate_ids(self, x: np.ndarray, k: int) -> list[list[str]]:
        """Ids only of the top-k documents per query (two-stage candidate generation)."""
        self._check_open()
        if self.spec.kind != "single":
            raise InvalidInputError(f"companion collection {self.name!r} must be single-vector")
        return self._candidate_ids(as_matrix(x, self.spec.dim, "queries", self.name),
                                   check_positive_int("k", k))

    def _resolve_companion(self, companion: "CollectionBase | None") -> "CollectionBase":
        if companion is not None:
            if not isinstance(companion, CollectionBase) or companion.spec.kind != "single":
                raise InvalidInputError("companion must be an open single-vector collection")
            return companion
        if self.spec.companion is None:
            raise InvalidInputError(
                f"mode='two_stage' needs a companion single-vector collection: pass companion=..., "
                f"or create {self.name!r} with spec.companion set")
        with self._companion_lock:
            if self._companion is None:
                comp = self._open_sibling(self.spec.companion)
                if comp.spec.kind != "single":
                    comp.close()
                    raise InvalidInputError(
                        f"companion collection {self.spec.companion!r} is not single-vector")
                self._companion = comp
            else:
                self._companion._sync()
            return self._companion

    def _close_companion(self) -> None:
        if self._companion is not None:
            self._companion.close()
            self._companion = None

    def __enter__(self) -> "CollectionBase":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
