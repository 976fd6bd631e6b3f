"""The collection recipe: the one place where a model, a pooler and a caller's options become the
:class:`index.CollectionSpec` of a new collection.

Two paths create collections and both come here: the HTTP create route
(``POST /collections``, :mod:`app.server.routers.collections`) and the indexing job
(:class:`app.indexing.IndexJob`: ``embedpool index`` in process or on Ray, and the indexing
inside ``embedpool eval``). ``embedpool search`` and the other routes only open collections that
exist. The rules that decide what a collection stores live here once, so that a collection
made over HTTP and one made by the job of the same model, pooler and options are the same:

- **kind**: ``multi`` for a multi-vector pooler, ``sparse`` for a sparse one (``splade``: its
  non-zero weights stored as (token id, weight) rows, :mod:`index.sparse`; ``single`` asked for
  explicitly stores them dense, vocabulary-sized, as collections made before sparse ones), else
  ``single``; a kind that contradicts the pooler is refused.
- **factory** of a sparse collection: the sparse index (``auto``, ``exact``,
  ``seismic[:options]``); the dense default every path sends when the caller names none
  (``IDMap2,Flat``) means ``auto``, another FAISS factory is refused naming ``factory``.
- **sparse poolers** (``splade``): their vectors are vocabulary weights scored by dot product,
  so they are stored as they are (``normalized`` false) under the inner product (``metric``
  ``ip``); asking for normalized vectors or ``l2`` for one is refused naming the option.
  Otherwise ``normalize`` defaults to true.
- **the companion** of a multi-vector collection (the single vectors its ``two_stage`` search
  takes candidates from): by default ``auto`` -- a per-window ``mean`` for a pooler that windows
  long documents, else ``mean`` (:func:`resolve_companion_pooler`); ``none`` for none. A
  single-vector collection has none.

Errors name the option by its HTTP field (``normalized``, ``companion_pooler``, ...);
:func:`renamed` rewrites them for a caller whose user knows other names (the job's flags).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from embedpool.errors import InvalidError
from embedpool.index import CollectionSpec, canonical_analyzer, parse_sparse_factory

#: the companion pooler a multi-vector collection gets when none is named: one ``mean`` row per
#: window of a document for a pooler that windows long documents, else one ``mean`` per document
AUTO_COMPANION = "auto"
#: the companion pooler that asks for none
NO_COMPANION = "none"
#: the factory every path sends when the caller names none (a dense collection's)
DENSE_DEFAULT_FACTORY = "IDMap2,Flat"
#: what it means for a sparse collection: exact while small, then Seismic (:mod:`index.sparse`)
SPARSE_DEFAULT_FACTORY = "auto"


@dataclass(frozen=True)
class CollectionOptions:
    """What a caller chooses about a new collection besides its model and pooler.

    Args:
        kind: ``single``, ``multi`` or ``sparse``; ``None``: the pooler's.
        dimensions: Matryoshka: keep the first N dimensions (``None``: all; a pooler with a size
            of its own, ``fde`` or ``splade``, keeps its own).
        normalize: L2-normalize the vectors. ``None``: true, except for a sparse pooler, whose
            weights are stored as they are (true for one is refused).
        metric: ``ip`` or ``l2`` (single-vector, dense poolers only).
        factory: FAISS factory of a single-vector collection; a sparse one's index (``auto``,
            ``exact``, ``seismic[:options]``; the dense default means ``auto``).
        storage_precision: storage of a multi-vector collection's token vectors.
        token_factory: FAISS factory of a multi-vector collection's token ANN index.
        analyzer: the lexical (BM25) index's analyzer, ``none`` for none.
        companion_pooler: a multi-vector collection's companion pooler (``mean``, ``fde:...``,
            ``mean:per_window=true``, ``auto``), ``none`` for none; ``None``: ``auto`` for a
            multi-vector collection (a single-vector one has none).
        companion_factory: FAISS factory of the companion's index; ``None``: ``factory``.
    """

    kind: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    metric: str = "ip"
    factory: str = DENSE_DEFAULT_FACTORY
    storage_precision: str = "float32"
    token_factory: str = "HNSW32"
    analyzer: str = "english"
    companion_pooler: str | None = None
    companion_factory: str | None = None


def collection_spec(embedder, pooler: str | None, options: CollectionOptions = CollectionOptions()) -> CollectionSpec:
    """The spec of a new collection of ``embedder``'s vectors made by ``pooler`` (a pooler spec;
    ``None``: the embedder's default) with ``options``. Raises :class:`InvalidError` naming the
    option at fault by its HTTP field."""
    p = embedder.pooler(pooler)
    kind = _kind(p, options.kind)
    try:
        embedder.check_dimensions(options.dimensions)
        analyzer = canonical_analyzer(options.analyzer)
    except InvalidError as e:
        field = "dimensions" if e.param == "dimensions" else "analyzer"
        raise InvalidError(f"{field}: {e}", param=field) from None
    return CollectionSpec(
        kind=kind, model=embedder.model_id, pooler=p.spec, dim=embedder.output_dim(p.spec, options.dimensions),
        metric=_metric(p, options.metric), normalized=_normalized(p, options.normalize),
        factory=_sparse_factory(options.factory) if kind == "sparse" else options.factory,
        precision=options.storage_precision, token_factory=options.token_factory,
        encoder_precision=embedder.encoder.precision, analyzer=analyzer,
        **_companion(embedder, p.spec, kind, options))


def _kind(pooler, kind: str | None) -> str:
    multi = bool(pooler.multi_vector)
    if kind == "sparse" and not pooler.sparse:
        raise InvalidError(f"kind: pooler {pooler.spec!r} gives dense vectors; kind 'sparse' is for sparse poolers "
                           "(splade)", param="kind")
    if pooler.sparse and kind != "single":
        if kind == "multi":
            raise InvalidError(f"kind: pooler {pooler.spec!r} gives one sparse vector per document; use kind "
                               "'sparse' (or leave kind out)", param="kind")
        return "sparse"
    if multi and kind == "single":
        raise InvalidError(f"kind: pooler {pooler.spec!r} gives several vectors per document; use kind 'multi' "
                           "or a single-vector pooler", param="kind")
    if not multi and kind == "multi":
        raise InvalidError(f"kind: pooler {pooler.spec!r} gives one vector per document; use kind 'single' "
                           "or a multi-vector pooler (tokens, cluster)", param="kind")
    return "multi" if multi else "single"


def _sparse_factory(factory: str | None) -> str:
    """A sparse collection's index: the dense default (or none) means ``auto``."""
    if factory is None or factory == DENSE_DEFAULT_FACTORY:
        return SPARSE_DEFAULT_FACTORY
    parse_sparse_factory(factory, "factory")
    return factory


def _normalized(pooler, normalize: bool | None) -> bool:
    if not pooler.sparse:
        return True if normalize is None else normalize
    if normalize:
        raise InvalidError(f"normalized: pooler {pooler.spec!r} gives sparse vectors, whose weights are scored by "
                           "dot product as they are; leave normalized out or set it to false", param="normalized")
    return False


def _metric(pooler, metric: str) -> str:
    if pooler.sparse and metric != "ip":
        raise InvalidError(f"metric: pooler {pooler.spec!r} gives sparse vectors, whose weights are scored by "
                           f"dot product; use metric 'ip', not {metric!r}", param="metric")
    return metric


def _companion(embedder, pooler: str, kind: str, options: CollectionOptions) -> dict:
    """The companion fields of the spec (none for a single-vector collection or ``none``)."""
    asked = options.companion_pooler
    if asked is None:
        asked = AUTO_COMPANION if kind == "multi" else NO_COMPANION
    if asked.lower() in (NO_COMPANION, ""):
        return {}
    if kind != "multi":
        raise InvalidError("companion_pooler: only multi-vector collections have a companion", param="companion_pooler")
    try:
        spec, rows = resolve_companion_pooler(embedder, pooler, asked)
    except InvalidError as e:  # the companion's own pooler: an unknown name, a bad option
        if e.param == "companion_pooler":
            raise
        raise InvalidError(f"companion_pooler: {e}", param="companion_pooler") from None
    return dict(companion_pooler=spec, companion_rows=rows, companion_dim=embedder.output_dim(spec, options.dimensions),
                companion_factory=options.companion_factory or options.factory)


def resolve_companion_pooler(embedder, pooler: str, companion_pooler: str) -> tuple[str, str]:
    """``(canonical pooler spec, rows layout)`` of the companion a multi-vector collection of
    ``pooler`` keeps for ``two_stage`` candidates (``companion_pooler``: a single-vector pooler
    spec -- ``mean``, ``fde:...`` -- or its per-window form -- ``mean:per_window=true`` --, or
    ``auto``). Rows are ``window`` for a per-window pooler (one per window of a document), else
    ``document``."""
    if companion_pooler == AUTO_COMPANION:
        windows = embedder.pooler(pooler).plan.kind != "standard"
        companion_pooler = "mean:per_window=true" if windows else "mean"
    cp = embedder.pooler(companion_pooler)
    per_window = bool(getattr(cp, "per_window", False))
    if cp.multi_vector and not per_window:
        raise InvalidError(
            f"companion pooler {companion_pooler!r} gives several vectors per text; a companion is a single-vector "
            "pooler (mean, fde) or its per-window form (mean:per_window=true: one row per window of a document)",
            param="companion_pooler")
    return cp.spec, ("window" if per_window else "document")


def renamed(error: InvalidError, names: Mapping[str, str]) -> InvalidError:
    """``error`` of the recipe with its option named as ``names`` maps the HTTP field (e.g. the
    job's flags: ``{"companion_pooler": "--companion-pooler"}``); unmapped options stay."""
    name = names.get(error.param or "")
    if name is None:
        return error
    message = str(error)
    if message.startswith(f"{error.param}: "):
        message = message[len(error.param) + 2:]
    return InvalidError(f"{name}: {message}", param=name)
