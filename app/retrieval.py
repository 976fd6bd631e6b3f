"""The one retrieval path of the HTTP route, ``embedpool search`` and ``embedpool eval``.

Three small pieces, as PyLate's ``retrieve/`` and ``rank/``:

1. **What to embed** (:func:`collection_embedding`): a query for a collection is embedded with the
   pooler, normalization and Matryoshka dimensions the collection's manifest records, as a
   ``query``. A two_stage search also embeds the query for the companion -- the single vectors a
   multi-vector collection keeps for its candidates -- with the companion pooler the collection
   records (:func:`companion_embedding`). Documents written to a collection
   are embedded the same way in role ``document`` (:func:`document_embeddings`). Embeddings that share options
   come from one ``embed`` call, so one forward pass per tokenization plan
   (:func:`embedding_calls`, :func:`embed_texts`, :func:`aembed_texts` for the server's
   batcher).
2. **Candidates and ranking** (:meth:`Search.run`): the collection's own search --
   ``exhaustive``, ``tokens`` (token ANN candidates) or ``two_stage`` (companion candidates),
   each ranked by exact MaxSim in ``index``; ``bm25`` (the collection's lexical index, on the
   query texts) or ``hybrid`` (BM25 fused with any of those vector modes, :mod:`index.fusion`);
   each restricted by a metadata filter inside the search (:mod:`index.filters`).
3. **Similarity** (:func:`maxsim`, :func:`similarity`): pure functions on vectors that know
   nothing about storage (STS scoring uses them).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from embedpool.app.recipe import resolve_companion_pooler  # noqa: F401  (its older home: bench/two_stage_long.py)
from embedpool.errors import InvalidError
from embedpool.index import (ALL_MODES, LEXICAL_MODES, SEARCH_MODES, CollectionBase, CollectionSpec, Hit,
                             companion_refusal, maxsim_scores, parse_filter)
from embedpool.poolers import EmbedOptions, build_pooler, sparse_entries


@dataclass(frozen=True)
class Embedding:
    """How texts are embedded for one collection: a pooler and the :class:`poolers.EmbedOptions`
    of its ``embed`` call (hashable: a key of embedded vectors)."""

    pooler: str
    options: EmbedOptions = EmbedOptions(role="query")


@functools.lru_cache(maxsize=256)
def own_dim(pooler: str, model_dim: int) -> int | None:
    """The size of pooler ``pooler``'s vectors if it has one of its own (``fde``), else ``None``."""
    return build_pooler(pooler).output_dim(model_dim)


def collection_embedding(spec: CollectionSpec, model_dim: int | Callable[[str], int],
                         role: str = "query") -> Embedding:
    """How texts of ``role`` (queries; documents when upserting) are embedded for a collection
    of ``spec`` on a model of ``model_dim`` dimensions (a smaller ``spec.dim`` is a Matryoshka
    truncation; a pooler with a size of its own, ``fde``, is never truncated). ``model_dim`` may
    be a function of the pooler spec (``Embedder.natural_dim``: a model's head changes the size
    of single-vector poolers' vectors, not of token vectors)."""
    if callable(model_dim):
        model_dim = model_dim(spec.pooler)
    own = own_dim(spec.pooler, model_dim) if spec.pooler else None
    if own is None and spec.pooler and build_pooler(spec.pooler).sparse:  # splade: the vocabulary's size
        own = spec.dim
    if own is not None:
        if own != spec.dim:
            raise InvalidError(f"the collection stores {spec.dim}-d vectors but pooler {spec.pooler!r} gives "
                               f"{own}; it was made by another embedpool version or by hand", param="collection")
        return Embedding(spec.pooler, EmbedOptions(role=role, normalize=bool(spec.normalized)))
    if spec.dim > model_dim:
        raise InvalidError(f"the collection stores {spec.dim}-d vectors but the model gives {model_dim}; "
                           "search it with the model that made it", param="collection")
    return Embedding(spec.pooler, EmbedOptions(role=role, normalize=bool(spec.normalized),
                                               dimensions=None if spec.dim == model_dim else spec.dim))


def companion_embedding(spec: CollectionSpec, model_dim: int | Callable[[str], int],
                        role: str = "query") -> Embedding | None:
    """How texts of ``role`` are embedded for the companion rows a collection keeps itself
    (``spec.companion_pooler``), or ``None`` if it keeps none."""
    if spec.companion_pooler is None:
        return None
    return collection_embedding(spec.companion_spec(), model_dim, role)


def document_embeddings(spec: CollectionSpec,
                        model_dim: int | Callable[[str], int]) -> tuple[Embedding, Embedding | None]:
    """How documents written to a collection are embedded: its own vectors, and its companion
    rows if it keeps them (``add(companion=...)``)."""
    return (collection_embedding(spec, model_dim, role="document"),
            companion_embedding(spec, model_dim, role="document"))


def stored_rows(spec: CollectionSpec, vectors: Sequence[np.ndarray]) -> Any:
    """A pooler's vectors for texts (one entry per text) as a collection of ``spec`` takes them
    in ``add`` and ``search``: one ``[n, dim]`` array (single), the list (multi), or the sparse
    pooler's non-zeros as ``{indices, values}`` rows (sparse, :func:`poolers.sparse_entries`)."""
    if spec.kind == "sparse":
        return sparse_entries([np.asarray(v) for v in vectors])
    if spec.kind == "multi":
        return list(vectors)
    return np.stack(vectors) if len(vectors) else np.zeros((0, spec.dim), np.float32)


def vector_mode(mode: str, hybrid_mode: str = "exhaustive") -> str | None:
    """The vector mode a search in ``mode`` runs (``hybrid``: ``hybrid_mode``; ``bm25``: none)."""
    if mode not in ALL_MODES:
        raise InvalidError(f"unknown search mode {mode!r}; use one of {', '.join(ALL_MODES)}", param="mode")
    if mode == "bm25":
        return None
    if mode == "hybrid":
        if hybrid_mode not in SEARCH_MODES:
            raise InvalidError(f"vector_mode {hybrid_mode!r}: hybrid fuses BM25 with one of "
                               f"{', '.join(SEARCH_MODES)}", param="vector_mode")
        return hybrid_mode
    return mode


def embedding_calls(embeddings: Iterable[Embedding]) -> list[tuple[EmbedOptions, list[str]]]:
    """``(options, poolers)`` per ``embed`` call: the embeddings that share options in one."""
    calls: dict[EmbedOptions, list[str]] = {}
    for e in dict.fromkeys(embeddings):
        calls.setdefault(e.options, []).append(e.pooler)
    return list(calls.items())


Vectors = dict[Embedding, list[np.ndarray]]


def embed_texts(embed: Callable[..., Any], texts: Sequence[str],
                embeddings: Iterable[Embedding]) -> tuple[Vectors, int]:
    """Embed ``texts`` for every embedding with ``embed(texts, poolers, options)`` (an
    ``Embedder.embed``); returns the vectors per embedding and the usage (the texts' tokens,
    once per call)."""
    out: Vectors = {}
    tokens = 0
    for opts, poolers in embedding_calls(embeddings):
        res = embed(list(texts), poolers, opts)
        out.update({Embedding(p, opts): res.vectors[p] for p in poolers})
        tokens += res.usage
    return out, tokens


async def aembed_texts(embed: Callable[..., Awaitable[Any]], texts: Sequence[str],
                       embeddings: Iterable[Embedding]) -> tuple[Vectors, int]:
    """:func:`embed_texts` with an async ``embed`` (the server's batcher)."""
    out: Vectors = {}
    tokens = 0
    for opts, poolers in embedding_calls(embeddings):
        res = await embed(list(texts), poolers, opts)
        out.update({Embedding(p, opts): res.vectors[p] for p in poolers})
        tokens += res.usage
    return out, tokens


@dataclass
class Search:
    """One search of a collection: what its queries need and how to run it.

    Args:
        collection: the open collection.
        model_dim: the model's dimension (for the Matryoshka ``dimensions`` of the queries), or
            ``Embedder.natural_dim``: the size of a pooler's vectors before any truncation.
        mode / candidates / k_token: multi-vector candidate generation (see
            :meth:`index.CollectionBase.search`); ignored for single-vector collections.
        k: results per query.
        filter: a metadata filter (:mod:`index.filters`), applied inside the search.
        vector_mode / fusion / weight: ``hybrid``: the vector mode fused with BM25 (multi-vector
            collections; a single-vector collection has one), ``rrf``, ``score`` or ``zscore``
            fusion, and the vector side's weight (1: vectors only, 0: BM25 only); ``None``: the
            collection's tuned fusion or weight, else ``rrf`` / 0.5 (:meth:`index.CollectionBase.search`).
    """

    collection: CollectionBase
    model_dim: int | Callable[[str], int]
    k: int = 10
    mode: str = "exhaustive"
    candidates: int = 100
    k_token: int = 32
    filter: Any = None
    vector_mode: str = "exhaustive"
    fusion: str | None = None
    weight: float | None = None

    def __post_init__(self) -> None:
        self.filter = parse_filter(self.filter)  # a bad filter fails before anything is embedded
        vmode = vector_mode(self.mode, self.vector_mode)
        if self.mode in LEXICAL_MODES and not self.collection.spec.lexical:
            raise InvalidError(f"mode {self.mode}: collection {self.collection.name!r} has no lexical index (its "
                               "analyzer is 'none', or it was made before BM25 existed)", param="mode")
        if self.mode == "hybrid" and self.weight == 0:
            vmode = None  # BM25 alone: nothing to embed
        self._vmode = vmode
        spec = self.collection.spec
        if vmode == "two_stage" and self.multi and spec.companion_pooler is None:
            raise companion_refusal(self.collection.name, self.collection.manifest)  # before anything is embedded
        self.query = None if vmode is None else collection_embedding(spec, self.model_dim)
        self.companion_query = companion_embedding(spec, self.model_dim) if vmode == "two_stage" and self.multi \
            else None

    @property
    def multi(self) -> bool:
        return self.collection.spec.kind == "multi"

    @property
    def lexical(self) -> bool:
        """The search reads the lexical index (it needs the query texts)."""
        return self.mode in LEXICAL_MODES

    def embeddings(self) -> list[Embedding]:
        """What the queries are embedded as (nothing for BM25 alone)."""
        return ([self.query] if self.query else []) + ([self.companion_query] if self.companion_query else [])

    def run(self, vectors: Mapping[Embedding, Sequence[np.ndarray]], rows: Sequence[int] | None = None,
            texts: Sequence[str] | None = None) -> list[list[Hit]]:
        """Hits per query from the embedded ``vectors`` and, for ``bm25``/``hybrid``, the query
        ``texts`` (all queries, or those at ``rows``)."""
        def take(v: Sequence) -> list:
            return list(v) if rows is None else [v[i] for i in rows]

        kw: dict[str, Any] = {"k": self.k, "filter": self.filter}
        if self.lexical:
            if texts is None:
                raise InvalidError(f"mode {self.mode} needs the query texts", param="mode")
            kw.update(mode=self.mode, texts=take(texts), fusion=self.fusion, weight=self.weight,
                      vector_mode=self._vmode or "exhaustive")
            if self.query is None:
                return self.collection.search(**kw)
        else:
            kw["mode"] = self._vmode
        q = take(vectors[self.query])
        if not self.multi:
            return self.collection.search(stored_rows(self.collection.spec, q), **kw)
        if self.companion_query is not None:
            # a per-window companion pooler gives a query one row ([1, D]): its vector
            cq = np.stack([np.asarray(v).reshape(-1, np.shape(v)[-1])[0] for v in take(vectors[self.companion_query])])
            kw.update(candidates=self.candidates, companion_pooler=self.companion_query.pooler, companion_queries=cq)
            if not self.lexical:
                kw["mode"] = "two_stage"
        return self.collection.search(q, k_token=self.k_token, **kw)


def retrieve(embedder, texts: Sequence[str], search: Search) -> list[list[Hit]]:
    """Embed ``texts`` for ``search`` with ``embedder`` (a :class:`poolers.Embedder`; ``None``
    for a search that embeds nothing, BM25 alone) and run it."""
    vectors, _ = embed_texts(embedder.embed, texts, search.embeddings()) if search.embeddings() else ({}, 0)
    return search.run(vectors, texts=texts)


# ---------------------------------------------------------------------------------- ranking
def maxsim(query: np.ndarray, document: np.ndarray) -> float:
    """MaxSim (ColBERT's late interaction) of ``[m, D]`` query vectors against ``[n, D]``
    document vectors: the sum over query vectors of their best inner product."""
    doc = np.asarray(document, dtype=np.float32)
    return float(maxsim_scores([np.asarray(query, dtype=np.float32)], doc,
                               np.array([0, len(doc)], dtype=np.int64))[0, 0])


def similarity(a: np.ndarray, b: np.ndarray, multi: bool) -> float:
    """Similarity of two texts' embeddings: the inner product (cosine when normalized), or for
    multi-vector ones the symmetric MaxSim normalized by the number of vectors on each side."""
    if not multi:
        return float(np.dot(a, b))
    return (maxsim(a, b) / len(a) + maxsim(b, a) / len(b)) / 2
