"""The storage contract: every collection backend implements :class:`CollectionBase`.

As in PyLate's ``indexes/base.py``, the base class declares the whole public API as abstract
methods, so a caller (``app/``) never needs to know which backend it holds; backends differ only
behind it. What a backend can do differently is data, not a name to test: :class:`Capabilities`.
``stats()`` returns the same keys on every backend (:data:`STATS_KEYS`), built with
:func:`make_stats`.

The base also holds what the backends share: argument checks and the search dispatch (a backend
implements the ``_search_*`` hooks). Candidate generation and ranking are separate pieces, as in
PyLate: ``tokens`` takes candidates from the token ANN, ``two_stage`` from the companion -- the
single vectors (a mean, a MUVERA FDE, one per window of a long document) a multi-vector collection
keeps for every document (``spec.companion_pooler``), written and deleted with the documents --
then exact MaxSim ranks them. A collection made when ``two_stage`` read a separate companion
collection (its manifest names it as ``companion``; retired) opens and searches in every other
mode; ``two_stage`` on it is refused with what to do (:func:`companion_refusal`).

Properties (:meth:`CollectionBase.set_property`) are small strings stored with the collection:
they survive a reopen and are deleted with it. A property set is *staged*: it becomes durable
with the next :meth:`CollectionBase.commit`, together with (FAISS: in the same transaction) or
right after (Milvus: after the flush) the data written before that commit. So a property that
describes the data (the indexing job's resume state: "the first N records are in") can never
claim more than is committed: stage it, then commit.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from embedpool.errors import ConflictError, InvalidError, NotFoundError
from .filters import Node, parse_filter
from .fusion import DEFAULT_FUSION, DEFAULT_WEIGHT, DEPTH, TUNED_PROPERTY, check_fusion, fuse, stored_fusion
from .sparse import check_sparse_rows
from .spec import CollectionSpec, check_name
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
    refuse_sparse_rows,
)

#: The search modes of a multi-vector collection (:meth:`CollectionBase.search`): every layer
#: that names them (HTTP schema, CLI, evaluation) takes them from here.
SEARCH_MODES = ("exhaustive", "tokens", "two_stage")
#: The modes that read the lexical (BM25) index: alone, or fused with a vector mode.
LEXICAL_MODES = ("bm25", "hybrid")
ALL_MODES = (*SEARCH_MODES, *LEXICAL_MODES)

#: The property under which a backend without files (Milvus) keeps the manifest; reserved.
MANIFEST_PROPERTY = "embedpool.manifest"


@dataclass
class Hit:
    """One search result."""

    id: str
    score: float
    text: str | None
    metadata: dict | None


@dataclass(frozen=True)
class Capabilities:
    """What a collection can do, as data (ask these instead of the backend's name).

    Attributes:
        supports_token_ann: ``search(mode="tokens")`` is available (multi-vector collections).
        token_index_on_insert: the token-level ANN index is kept up to date by ``add`` (Milvus);
            otherwise ``build_token_index()`` or the first ``tokens`` search builds it (FAISS).
        transactional: ``add``/``delete`` are invisible to other openers until ``commit()`` and
            discarded by ``close()`` without it (FAISS); otherwise applied at once (Milvus:
            ``commit()`` flushes).
        measures_disk_usage: ``stats()["bytes_on_disk"]`` is measured (else ``None``).
        multi_process: other processes may open the collection at the same time (FAISS folders,
            Milvus servers; not a Milvus Lite file, which one process holds).
        concurrent_writers: several processes (on several machines) may ``add`` to it at the
            same time, each its own documents, and one ``commit()`` makes all of them durable
            (a Milvus server); otherwise one writer at a time (a FAISS folder is locked by its
            writer, a Milvus Lite file is held by one process).
    """

    supports_token_ann: bool
    token_index_on_insert: bool
    transactional: bool
    measures_disk_usage: bool
    multi_process: bool
    concurrent_writers: bool = False


@dataclass(frozen=True)
class Stats:
    """The storage statistics of a collection; the same fields on every backend.

    Attributes:
        documents: live documents.
        vectors: live vectors (single-vector: equal to ``documents``).
        bytes_on_disk: bytes of the collection's files, ``None`` where the backend cannot tell.
        bytes_per_doc: vector storage per live document.
        tombstones: deleted or replaced documents whose vectors still take space (``compact()``
            removes them; 0 where the backend compacts by itself).
        segments: append-only vector segments (FAISS multi-vector), ``None`` where not applicable.
        token_index: a token-level ANN index exists (multi-vector; ``False`` for single).
        index_type: the vector index, as the backend names it (FAISS factory, Milvus index type).
        backend: the backend's name, for people (``faiss``, ``milvus``).
        location: where the collection lives, for people (a folder, a Milvus URI).
        companion_rows: live companion rows of a collection that keeps its companion
            (``spec.companion_pooler``), else ``None``.
    """

    documents: int
    vectors: int
    bytes_on_disk: int | None
    bytes_per_doc: float
    tombstones: int
    segments: int | None
    token_index: bool
    index_type: str
    backend: str
    location: str
    companion_rows: int | None = None


STATS_KEYS = tuple(f.name for f in dataclasses.fields(Stats))


def make_stats(**values: Any) -> dict[str, Any]:
    """The ``stats()`` dict: every key of :class:`Stats`, no other (a missing one is a bug)."""
    return dataclasses.asdict(Stats(**values))


def check_spec_matches(existing: CollectionSpec, requested: CollectionSpec, name: str) -> None:
    """Refuse to open ``name`` with a spec that differs from the one it was created with."""
    diffs = existing.differences(requested)
    if diffs:
        raise ConflictError(
            f"collection {name!r} already exists with a different spec ({'; '.join(diffs)}); "
            "use another collection name, or delete the collection first", param="spec")


def check_new_spec(name: str, spec: Any) -> CollectionSpec:
    """The name and spec of a collection to create, checked (:class:`InvalidError`)."""
    check_name(name)
    if not isinstance(spec, CollectionSpec):
        raise InvalidError("spec must be a CollectionSpec", param="spec")
    return spec.validate()


def require_spec(coll: "CollectionBase", spec: CollectionSpec) -> "CollectionBase":
    """``coll`` if it was created with ``spec``; else close it and raise
    :class:`ConflictError` naming the differing fields (open-or-create)."""
    try:
        check_spec_matches(coll.spec, spec, coll.name)
    except BaseException:
        coll.close()
        raise
    return coll


def companion_refusal(name: str, manifest: dict[str, Any]) -> InvalidError:
    """The error of ``two_stage`` on a multi-vector collection without a companion: what to do,
    naming the separate companion collection of an older manifest (``companion``) if it has one."""
    how = ("re-index it with a companion (embedpool index --companion-pooler mean, or \"companion_pooler\" in "
           "POST /collections: the collection then keeps the companion vectors itself and writes them with every "
           "upsert), or search it with mode 'exhaustive' or 'tokens'")
    older = manifest.get("companion")
    if older:
        return InvalidError(
            f"mode: collection {name!r} takes its two_stage candidates from a separate companion collection "
            f"{older!r}, which embedpool no longer reads (a collection keeps its companion vectors itself); "
            + how, param="mode")
    return InvalidError(f"mode: collection {name!r} keeps no companion vectors for two_stage; " + how, param="mode")


def check_property(key: Any, value: Any) -> None:
    """A property key is a non-empty string other than the manifest's; values are strings."""
    if not isinstance(key, str) or not key or key == MANIFEST_PROPERTY:
        raise InvalidError(f"property key {key!r} is reserved or empty", param="key")
    if not isinstance(value, str):
        raise InvalidError("property values are strings", param="value")


class CollectionBase(ABC):
    """The public API of a collection, whatever stores it. Subclasses set ``name``, ``spec``,
    ``capabilities`` and ``backend`` and implement every abstract method with the semantics
    documented here (a contract test runs the same checks over every backend)."""

    name: str
    spec: CollectionSpec
    capabilities: Capabilities
    backend: ClassVar[str] = ""
    _manifest: dict[str, Any]

    # ---- the contract: writes -------------------------------------------------------------
    @abstractmethod
    def add(self, ids: Sequence[str], vectors: Any, texts: Sequence[str | None] | None = None,
            metadata: Sequence[dict | None] | None = None, *, model: str | None = None,
            pooler: str | None = None, companion: Any = None) -> None:
        """Insert or replace documents. Validates the whole batch first; on any error nothing
        changes. Visible to this object's searches at once, durable after :meth:`commit`.

        Args:
            ids: external string ids, unique within the batch.
            vectors: single: ``[n, dim]`` array; multi: ``n`` arrays ``[n_i, dim]`` (``n_i >= 1``);
                sparse: ``n`` rows ``(indices, values)`` or ``{indices, values}``, or a
                ``scipy.sparse`` ``[n, dim]`` matrix (:func:`index.sparse.check_sparse_rows`).
            texts: optional text per document.
            metadata: optional JSON-serializable dict per document.
            model, pooler: if given, must equal the manifest's (guards against mixing models).
            companion: the companion vectors of a collection that keeps them
                (``spec.companion_pooler``): per document its ``[companion_dim]`` vector or
                ``[r_i, companion_dim]`` rows (``r_i >= 1``; exactly one with
                ``companion_rows="document"``), written with the documents; required there, refused
                elsewhere. Replacing a document replaces its rows, deleting it deletes them.
        """

    @abstractmethod
    def delete(self, ids: Sequence[str]) -> None:
        """Delete documents by id. Any unknown id: :class:`NotFoundError`, nothing deleted."""

    @abstractmethod
    def commit(self) -> None:
        """Make every change since the last commit durable -- documents and staged properties."""

    @abstractmethod
    def compact(self) -> None:
        """Reclaim the space of deleted and replaced documents (``tombstones``), then commit."""

    @abstractmethod
    def build_token_index(self) -> None:
        """Multi-vector: make the token-level ANN index ready now (:class:`InvalidError`
        for single-vector collections)."""

    # ---- the contract: properties ----------------------------------------------------------
    @abstractmethod
    def get_property(self, key: str) -> str | None:
        """The property ``key`` (``None`` if never set): this object's staged value if any,
        else the committed one."""

    @abstractmethod
    def set_property(self, key: str, value: str) -> None:
        """Stage ``value`` under ``key``; durable with the next :meth:`commit` (module docstring)."""

    # ---- the contract: reads ---------------------------------------------------------------
    @abstractmethod
    def get(self, id: str) -> dict[str, Any]:
        """``{id, text, metadata, vector}`` (single; sparse: ``vector`` is ``{indices, values}``)
        or ``{id, text, metadata, vectors}`` (multi, float32 ``[n_i, dim]``). Unknown id:
        :class:`NotFoundError`."""

    @abstractmethod
    def ids(self) -> list[str]:
        """All document ids, in insertion order (a replaced document moves to the end)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Storage statistics: exactly the keys of :class:`Stats` (use :func:`make_stats`)."""

    @abstractmethod
    def __len__(self) -> int:
        """Live documents (0 once closed)."""

    @abstractmethod
    def __contains__(self, id: object) -> bool:
        """Whether a document with this id exists."""

    # ---- the contract: lifecycle -----------------------------------------------------------
    @abstractmethod
    def refresh(self) -> bool:
        """Pick up commits made by other writers since this object loaded; True if it reloaded.
        :class:`NotFoundError` if the collection was deleted meanwhile. Cheap when
        nothing changed (call it before serving a request)."""

    @abstractmethod
    def close(self) -> None:
        """Release the collection (idempotent). Uncommitted changes of a transactional backend
        are discarded."""

    # ---- hooks of the shared search ------------------------------------------------------
    @abstractmethod
    def _check_open(self) -> None:
        """Raise :class:`InvalidError` if closed."""

    # Every search hook takes ``flt``, the parsed metadata filter (None: every document), and
    # applies it inside the search: k hits whenever k matching documents exist.
    @abstractmethod
    def _search_single(self, x: np.ndarray, k: int, flt: Node | None = None) -> list[list[Hit]]:
        """Top-k of single-vector queries ``[q, dim]`` (a sparse collection's: a ``scipy.sparse``
        CSR matrix ``[q, dim]``, :mod:`index.sparse`)."""

    @abstractmethod
    def _search_exhaustive(self, qs: list[np.ndarray], k: int, flt: Node | None = None) -> list[list[Hit]]:
        """Exact MaxSim of each query against every document."""

    @abstractmethod
    def _search_tokens(self, qs: list[np.ndarray], k: int, k_token: int,
                       flt: Node | None = None) -> list[list[Hit]]:
        """Candidates from the token ANN (``k_token`` per query token), then exact MaxSim."""

    @abstractmethod
    def _search_companion(self, qs: list[np.ndarray], cq: np.ndarray, candidates: int,
                          k: int, flt: Node | None = None) -> list[list[Hit]]:
        """Candidates from the collection's own companion rows (the ``candidates`` documents of
        the best rows for each companion query ``cq[i]``), then exact MaxSim."""

    @abstractmethod
    def _search_lexical(self, texts: list[str], k: int, flt: Node | None = None) -> list[list[Hit]]:
        """Top-k documents by BM25 for each query text (the collection's analyzer)."""

    @abstractmethod
    def _delete_where(self, flt: Node) -> int:
        """Delete the documents that match ``flt``; how many."""

    @abstractmethod
    def _counts(self) -> dict[str, int]:
        """``{"documents": ..., "vectors": ...}`` of the current state."""

    # ---- shared ----------------------------------------------------------------------------
    @property
    def manifest(self) -> dict[str, Any]:
        """The manifest, with the counts of the current (in-process) state."""
        return {**self._manifest, "counts": self._counts()}

    def _check_add(self, ids: Sequence[str], vectors: Any, texts: Any, metadata: Any,
                   model: str | None, pooler: str | None, companion: Any = None):
        """Validate a whole ``add`` batch: ``(ids, vectors, texts, metadata JSON strings,
        companion rows or None)``."""
        self._check_open()
        check_model_pooler(self.spec, self.name, model, pooler)
        ids = check_ids(ids)
        if self.spec.kind == "single":
            vecs: Any = check_single_vectors(self.spec, self.name, vectors, ids, "vectors")
        elif self.spec.kind == "sparse":
            vecs = check_sparse_rows(self.spec.dim, self.name, vectors, ids, "vectors")
        else:
            vecs = check_multi_vectors(self.spec, self.name, vectors, ids, "vectors")
        return (ids, vecs, check_texts(texts, len(ids)), check_metadata(metadata, ids),
                self._check_companion(companion, ids))

    def _check_companion(self, companion: Any, ids: list[str]) -> list[np.ndarray] | None:
        spec = self.spec
        if spec.companion_pooler is None:
            if companion is not None:
                raise InvalidError(f"collection {self.name!r} keeps no companion vectors; leave "
                                   "companion out (create it with a companion pooler to keep them)", param="companion")
            return None
        if companion is None:
            raise InvalidError(
                f"collection {self.name!r} keeps companion vectors of pooler {spec.companion_pooler!r} for "
                f"two_stage search: pass companion=, per document its [{spec.companion_dim}] vector"
                + (f" or [r, {spec.companion_dim}] rows" if spec.companion_rows == "window" else ""), param="companion")
        if isinstance(companion, np.ndarray) and companion.ndim == 2:
            companion = list(companion)  # one vector per document
        if not isinstance(companion, (list, tuple)):
            raise InvalidError(f"companion must be a list with one entry per document", param="companion")
        rows = [np.asarray(c)[None, :] if np.ndim(c) == 1 else c for c in companion]
        out = check_multi_vectors(spec.companion_spec(), self.name, rows, ids, "companion")
        if spec.companion_rows == "document":
            many = [ids[j] for j, r in enumerate(out) if len(r) != 1]
            if many:
                raise InvalidError(
                    f"collection {self.name!r} keeps one companion vector per document (companion_rows "
                    f"'document'), but document {many[0]!r} has {len(out[ids.index(many[0])])}", param="companion")
        return out

    def _check_delete(self, ids: Sequence[str]) -> list[str]:
        """The distinct ids of a ``delete`` call, validated."""
        self._check_open()
        return list(dict.fromkeys(check_ids(ids, allow_duplicates=True)))

    def _refuse_unknown(self, ids: list[str], found: Container[str]) -> None:
        unknown = [i for i in ids if i not in found]
        if unknown:
            raise NotFoundError(
                f"{len(unknown)} id(s) not in collection {self.name!r}: {preview(unknown)}; "
                "nothing was deleted", param="ids")

    def _check_token_index(self) -> None:
        """``build_token_index`` applies to collections with a token ANN only."""
        self._check_open()
        if not self.capabilities.supports_token_ann:
            raise InvalidError("build_token_index applies to multi-vector collections only")

    def search(self, queries: Any = None, k: int = 10, *, mode: str = "exhaustive", candidates: int = 100,
               k_token: int = 32, companion_queries: Any = None, companion_pooler: str | None = None,
               filter: Any = None, texts: Sequence[str] | None = None,
               vector_mode: str = "exhaustive", fusion: str | None = None, weight: float | None = None,
               depth: int = DEPTH) -> list[list[Hit]]:
        """Top-k documents per query.

        Args:
            queries: single: ``[q, dim]`` array. multi: ``q`` arrays ``[m_i, dim]`` of query tokens.
                sparse: ``q`` rows ``(indices, values)`` (as ``add`` takes them); the
                collection's ``factory`` decides exact or approximate (:mod:`index.sparse`).
                Not needed by ``mode="bm25"``.
            k: results per query.
            mode: ``bm25`` (the lexical index alone, on ``texts``), ``hybrid`` (BM25 fused with
                the vector search of ``vector_mode``), or a vector mode. Single-vector
                collections have one vector mode (any other name means it); multi-vector ones
                ``exhaustive`` (exact MaxSim against every document), ``tokens`` (token ANN:
                ``k_token`` neighbours per query token give the candidates, then exact MaxSim)
                or ``two_stage`` (the ``candidates`` documents of the best companion rows for
                ``companion_queries``, then exact MaxSim; collections that keep a companion,
                ``spec.companion_pooler``).
            companion_queries: ``two_stage``: one ``[companion_dim]`` vector per query, embedded
                with the companion pooler (role query).
            companion_pooler: the pooler spec ``companion_queries`` were made with; refused
                unless it is the companion's (an FDE made with other parameters approximates
                nothing, though it may have the same dimension).
            filter: a metadata filter (:mod:`index.filters`), applied inside every search: ``k``
                hits come back whenever ``k`` matching documents exist (BM25: that contain a
                query term), whatever the index.
            texts: the query texts, one per query (``bm25`` and ``hybrid``).
            vector_mode: ``hybrid`` on a multi-vector collection: its vector mode.
            fusion, weight: ``hybrid``: ``rrf``, ``score`` or ``zscore`` fusion and the vector
                side's weight (:mod:`index.fusion`); either left ``None`` is the one tuned for this
                collection and ``vector_mode`` (:meth:`tuned_fusion`), else ``rrf`` / 0.5;
                ``depth``: how many hits of each side are fused.

        Returns:
            ``q`` lists of :class:`Hit`, best first. Scores: inner product (single ``ip``),
            squared L2 distance (single ``l2``, smaller is better), MaxSim (multi), BM25
            (``bm25``) or the fused score (``hybrid``).
        """
        self._check_open()
        k = check_positive_int("k", k)
        flt = parse_filter(filter)
        if mode not in ALL_MODES and self.spec.kind == "multi":
            raise InvalidError(f"unknown search mode {mode!r}; use one of {', '.join(ALL_MODES)}", param="mode")
        if mode in LEXICAL_MODES:
            texts = self._check_texts(texts)
            if mode == "bm25":
                return self._search_lexical(texts, k, flt) if texts else []
            if fusion is None or weight is None:
                tuned = self.tuned_fusion(vector_mode) or (DEFAULT_FUSION, DEFAULT_WEIGHT)
                fusion, weight = (tuned[0] if fusion is None else fusion), (tuned[1] if weight is None else weight)
            fusion, weight = check_fusion(fusion, weight)
            if vector_mode not in SEARCH_MODES:
                raise InvalidError(f"vector_mode={vector_mode!r}: hybrid fuses BM25 with one of "
                                   f"{', '.join(SEARCH_MODES)}", param="vector_mode")
            d = max(k, check_positive_int("depth", depth))
            vec = (self._search_vectors(queries, d, vector_mode, candidates, k_token, companion_queries,
                                        companion_pooler, flt) if weight > 0 else [[] for _ in texts])
            if len(vec) != len(texts):
                raise InvalidError(f"{len(texts)} query texts but {len(vec)} query vectors", param="texts")
            lex = self._search_lexical(texts, d, flt) if weight < 1 and texts else [[] for _ in texts]
            lower = self.spec.kind == "single" and self.spec.metric == "l2"
            return [fuse(v, x, k, fusion, weight, lower_is_better=lower) for v, x in zip(vec, lex)]
        return self._search_vectors(queries, k, mode, candidates, k_token, companion_queries,
                                    companion_pooler, flt)

    def tuned_fusion(self, vector_mode: str = "exhaustive") -> tuple[str, float] | None:
        """The ``(fusion, weight)`` tuned for hybrid search with ``vector_mode`` and stored in the
        collection's :data:`index.fusion.TUNED_PROPERTY` (``embedpool eval`` with a tuned
        fusion), or ``None``."""
        return stored_fusion(self.get_property(TUNED_PROPERTY), vector_mode)

    def _check_texts(self, texts: Any) -> list[str]:
        if not self.spec.lexical:
            raise InvalidError(
                f"collection {self.name!r} has no lexical index (analyzer 'none', or made before BM25 "
                "existed); create it with an analyzer (the default, 'english') for bm25 and hybrid search",
                param="mode")
        if texts is None or isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise InvalidError("bm25 and hybrid search need texts: the query texts, a list of strings", param="texts")
        return list(texts)

    def _search_vectors(self, queries: Any, k: int, mode: str, candidates: int, k_token: int,
                        companion_queries: Any, companion_pooler: str | None,
                        flt: Node | None) -> list[list[Hit]]:
        if self.spec.kind == "single":
            refuse_sparse_rows(self.spec, self.name, queries, "queries")
            return self._search_single(as_matrix(queries, self.spec.dim, "queries", self.name), k, flt)
        if self.spec.kind == "sparse":  # one hook for both: a sparse [q, dim] matrix of queries
            return self._search_single(check_sparse_rows(self.spec.dim, self.name, queries, None, "queries"), k, flt)
        qs = check_multi_vectors(self.spec, self.name, queries, None, "queries")
        if not qs:
            return []
        if mode == "exhaustive":
            return self._search_exhaustive(qs, k, flt)
        if mode == "tokens":
            return self._search_tokens(qs, k, check_positive_int("k_token", k_token), flt)
        return self._two_stage(qs, companion_queries, companion_pooler, check_positive_int("candidates", candidates),
                               k, flt)

    def delete_where(self, filter: Any) -> int:
        """Delete every document that matches a metadata filter (:mod:`index.filters`); returns
        how many. Durable after :meth:`commit`, like :meth:`delete`."""
        self._check_open()
        flt = parse_filter(filter)
        if flt is None:
            raise InvalidError("delete_where needs a filter (delete the collection to delete everything)",
                               param="filter")
        return self._delete_where(flt)

    def _two_stage(self, qs: list[np.ndarray], companion_queries: Any, companion_pooler: str | None,
                   candidates: int, k: int, flt: Node | None) -> list[list[Hit]]:
        """``two_stage``: candidates from the companion rows the collection keeps, then MaxSim."""
        spec = self.spec
        if spec.companion_pooler is None:
            raise companion_refusal(self.name, self._manifest)
        if companion_queries is None:
            raise InvalidError(
                f"mode='two_stage' needs companion_queries: one [{spec.companion_dim}] vector per query, "
                f"embedded with pooler {spec.companion_pooler!r} (role query)", param="companion_queries")
        if companion_pooler is not None and companion_pooler != spec.companion_pooler:
            raise ConflictError(
                f"companion_queries were made with pooler {companion_pooler!r}, but collection {self.name!r} "
                f"keeps companion vectors of pooler {spec.companion_pooler!r}; embed the queries with "
                f"{spec.companion_pooler!r} (role query)", param="companion_pooler")
        cq = as_matrix(companion_queries, spec.companion_dim, "companion_queries", self.name)
        if len(cq) != len(qs):
            raise InvalidError(f"companion_queries has {len(cq)} rows but there are {len(qs)} queries",
                               param="companion_queries")
        return self._search_companion(qs, cq, candidates, k, flt)

    def __enter__(self) -> "CollectionBase":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
