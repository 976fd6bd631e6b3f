"""Collections, their documents, and search.

Documents are embedded with the collection's pooler (role ``document``) through the batcher and
upserted; searches go through the one retrieval path (:mod:`app.retrieval`), with the queries
embedded through the batcher. Every write is committed before the answer.
Blocking index calls run in the thread pool, so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool
from starlette.convertors import PathConvertor, register_url_convertor

from embedpool import index
from embedpool.app import recipe, retrieval
from embedpool.app.server.auth import require_api_key
from embedpool.app.server.deps import get_collections, get_engines
from embedpool.app.server.limits import check_inputs
from embedpool.app.server.responses import JSON
from embedpool.app.server.schemas import (
    CollectionCreate,
    CollectionInfo,
    CollectionList,
    Deleted,
    DocumentIn,
    DocumentOut,
    DocumentsDelete,
    DocumentsDeleted,
    DocumentsIn,
    DocumentsUpserted,
    SearchRequest,
    SearchResponse,
)
from embedpool.app.server.engine import Engine, Engines
from embedpool.app.server.state import Collections
from embedpool.errors import ConflictError, InvalidError
from embedpool.poolers import EmbedOptions

log = logging.getLogger("embedpool.server")

router = APIRouter(prefix="/collections", tags=["collections"], dependencies=[Depends(require_api_key)])

NAME = Path(..., description="collection name", max_length=128)
E404 = {404: {"description": "unknown collection or document"}}
E409 = {409: {"description": "collection exists with other settings, or was made by another model"}}
E422 = {422: {"description": "invalid field"}}

# OpenAPI links from a write or a search to the document it names, so a client generator or a
# state machine (schemathesis' stateful phase, tests/app/test_server_schemathesis_stateful.py)
# reads back what was stored: the first document of an upsert (either body shape), the first hit.
_GET_DOCUMENT = "#/paths/~1collections~1{name}~1documents~1{doc_id}/get"


def _document_link(doc_id: str, description: str) -> dict[str, Any]:
    return {"operationRef": _GET_DOCUMENT, "description": description,
            "parameters": {"path.name": "$request.path.name", "path.doc_id": doc_id}}


UPSERT_LINKS = {"GetUpsertedDocument": _document_link("$request.body#/documents/0/id", "the first document sent"),
                "GetUpsertedListDocument": _document_link("$request.body#/0/id", "the first document sent as a list")}
HIT_LINKS = {"GetHitDocument": _document_link("$response.body#/hits/0/id", "the first hit's document")}


class _DocumentId(PathConvertor):
    """A document id in a path: anything, line breaks too (Starlette's ``path`` is ``.*``, whose
    ``.`` stops at a line break: ``a%0A`` was read as ``a``, another document)."""

    regex = "(?s:.*)"


register_url_convertor("doc_id", _DocumentId())


def _info(name: str, manifest: dict[str, Any], stats: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = index.CollectionSpec.from_dict(manifest)
    return {"name": name, **spec.to_dict(), "documents": int(manifest.get("counts", {}).get("documents", 0)),
            "created": manifest.get("created"), "updated": manifest.get("updated"), "stats": stats}


async def _open(collections: Collections, engines: Engines, name: str,
                model: str | None = None) -> tuple[index.CollectionBase, Engine]:
    """The collection and the engine of the model its manifest records (409 if it is not served,
    or if the request names another one in ``model``)."""
    engines.default.require_model()
    coll = await run_in_threadpool(collections.get, name)
    engine = engines.for_collection(coll.name, coll.spec.model)
    if model is not None and engines.pick(model) is not engine:
        raise ConflictError(f"model: collection {coll.name!r} holds vectors of model {engine.embedder.model_id!r} "
                            f"(served as {engine.name!r}) and is searched with that model only, not {model!r}",
                            param="model")
    return coll, engine


def _companion_pooler(engine: Engine, collections: Collections, asked: str | None) -> None:
    """Check a request's ``companion_pooler`` as every pooler a request names is checked (the
    recipe resolves it); a collection's name there is the older API's companion."""
    if asked is None or asked.lower() in (recipe.AUTO_COMPANION, recipe.NO_COMPANION):
        return
    try:
        engine.pooler(asked, field="companion_pooler")
    except InvalidError:
        if asked in collections.names():  # the older API named a separate companion collection
            raise InvalidError(f"companion_pooler: {asked!r} is a collection; a collection keeps its companion "
                               "vectors itself and writes them with every upsert: send the companion's pooler instead "
                               "(e.g. \"companion_pooler\": \"mean\", \"fde\" or \"mean:per_window=true\")",
                               param="companion_pooler") from None
        raise


# ---------------------------------------------------------------------- collections
@router.post("", status_code=201, response_model=CollectionInfo,
             responses={200: {"model": CollectionInfo, "description": "it already existed with these settings"},
                        **E409, **E422})
async def create_collection(body: CollectionCreate, response: Response, engines: Engines = Depends(get_engines),
                            collections: Collections = Depends(get_collections),
                            dimensions: int | None = Query(None, ge=1, description="Matryoshka: store the first N dimensions")) -> Any:
    """Create a collection for a served model (`model`, default the server's first) and a pooler
    (201), or return the existing one if its settings are the same (200); other settings: 409.
    The collection records its model: every upsert and search of it is embedded with that model.

    The spec is the collection recipe's (:func:`app.recipe.collection_spec`), as the indexing
    job's, so a collection made here equals one ``embedpool index`` makes of the same model,
    pooler and options. ``normalized`` left out (or null) is resolved there: true, but false for a
    sparse pooler (``splade``: weights scored by dot product as they are); an explicit true for a
    sparse pooler is a 422 naming ``normalized`` (and ``metric`` ``l2`` one naming ``metric``).
    ``companion_pooler`` left out (or null) gives a multi-vector collection the job's default
    companion, ``auto``; ``none`` gives it none."""
    engine = engines.pick(body.model)
    engine.require()
    pooler, _ = engine.pooler(body.pooler)
    _companion_pooler(engine, collections, body.companion_pooler)
    companion = body.companion_pooler
    if companion is None and body.name in collections.names() \
            and not collections.manifest(body.name).get("companion_pooler"):
        # made before multi-vector collections got a default companion: asked again with the
        # field left out, it is the same collection (200), not other settings (409)
        companion = recipe.NO_COMPANION
    options = recipe.CollectionOptions(
        kind=body.kind, dimensions=dimensions, normalize=body.normalized, metric=body.metric, factory=body.factory,
        storage_precision=body.precision, token_factory=body.token_factory, analyzer=body.analyzer,
        companion_pooler=companion, companion_factory=body.companion_factory)
    spec = recipe.collection_spec(engine.embedder, pooler, options)
    coll, created = await run_in_threadpool(collections.create, body.name, spec)
    response.status_code = 201 if created else 200
    return _info(coll.name, coll.manifest)


@router.get("", response_model=CollectionList)
def list_collections(collections: Collections = Depends(get_collections)) -> Any:
    """Every collection of the data directory, with its settings and document count."""
    out = []
    for name in collections.names():
        try:
            out.append(_info(name, collections.manifest(name)))
        except InvalidError as exc:
            log.warning("skipping collection %s: %s", name, exc)
    return {"collections": out}


@router.get("/{name}", response_model=CollectionInfo, responses=E404)
def get_collection(name: str = NAME, collections: Collections = Depends(get_collections)) -> Any:
    """One collection's settings, counts and storage statistics."""
    coll = collections.get(name)
    return _info(coll.name, coll.manifest, coll.stats())


@router.delete("/{name}", response_model=Deleted, responses=E404)
def delete_collection(name: str = NAME, collections: Collections = Depends(get_collections)) -> Any:
    """Delete a collection and all its documents."""
    collections.delete(name)
    return {"deleted": name}


# ---------------------------------------------------------------------- documents
@router.post("/{name}/documents", response_model=DocumentsUpserted,
             responses={200: {"links": UPSERT_LINKS}, **E404, **E409, **E422})
async def upsert_documents(request: Request, body: list[DocumentIn] | DocumentsIn, name: str = NAME,
                           engines: Engines = Depends(get_engines),
                           collections: Collections = Depends(get_collections)) -> Any:
    """Embed and insert (or replace, by id) documents: a list of `{id, text, metadata}` or
    `{"documents": [...]}`. Committed before the answer. Ids and metadata must be what every
    backend stores (docs/api.md, "What can be stored"); one that is not is a 422 naming it
    (`documents[3].metadata.v`) and the limit, and nothing of the request is written."""
    docs = body.documents if isinstance(body, DocumentsIn) else body
    if not docs:
        raise InvalidError("documents: empty list; give at least one {id, text, metadata}", param="documents")
    field, limits = "documents" if isinstance(body, DocumentsIn) else "", engines.default.settings.stored_limits()
    for j, d in enumerate(docs):  # before anything is embedded or written
        index.check_document(d.id, d.metadata, f"{field}[{j}]", **limits)
    texts = [d.text for d in docs]
    check_inputs(texts, engines.default.settings, "documents")
    coll, engine = await _open(collections, engines, name)
    own, comp = retrieval.document_embeddings(coll.spec, engine.embedder.natural_dim)
    wanted = [own] + ([comp] if comp else [])
    for e in wanted:
        engine.pooler(e.pooler, trusted=True)  # a manifest pooler this server cannot build: 422
    vectors, tokens = await retrieval.aembed_texts(partial(engine.embed, request, field="documents"), texts, wanted)
    vecs = vectors[own]
    await run_in_threadpool(collections.add, coll, [d.id for d in docs], retrieval.stored_rows(coll.spec, vecs), texts,
                            [d.metadata for d in docs], model=engine.embedder.model_id, pooler=coll.spec.pooler,
                            companion=vectors[comp] if comp else None)
    return JSON({"upserted": len(docs), "documents": len(coll), "usage": {"tokens": tokens}})


@router.post("/{name}/documents/delete", response_model=DocumentsDeleted, responses={**E404, **E422})
def delete_documents(body: DocumentsDelete, name: str = NAME,
                     collections: Collections = Depends(get_collections)) -> Any:
    """Delete documents by `ids` or by a metadata `filter` (committed before the answer), as
    Qdrant's, Pinecone's and Chroma's delete routes take either."""
    coll = collections.get(name)
    if body.ids is not None:
        ids = list(dict.fromkeys(body.ids))
        collections.delete_documents(coll, ids)
        n = len(ids)
    else:
        n = collections.delete_where(coll, body.filter)
    return {"deleted": n, "documents": len(coll)}


@router.get("/{name}/documents/{doc_id:doc_id}", response_model=DocumentOut, responses=E404)
def get_document(name: str = NAME, doc_id: str = Path(..., description="document id"),
                 include_vector: bool = Query(False, description="also return the stored vector(s)"),
                 collections: Collections = Depends(get_collections)) -> Any:
    """A stored document: id, text, metadata (and its vector or token vectors)."""
    doc = collections.get(name).get(doc_id)
    out = {"id": doc["id"], "text": doc["text"], "metadata": doc["metadata"]}
    if include_vector:
        out["vector"] = doc.get("vector", doc.get("vectors"))
    return JSON(out)


@router.delete("/{name}/documents/{doc_id:doc_id}", response_model=Deleted, responses=E404)
def delete_document(name: str = NAME, doc_id: str = Path(..., description="document id"),
                    collections: Collections = Depends(get_collections)) -> Any:
    """Delete one document (committed before the answer)."""
    coll = collections.get(name)
    collections.delete_documents(coll, [doc_id])
    return {"deleted": doc_id}


# ---------------------------------------------------------------------- search
#: the candidates a search's rerank stage scores unless `rerank_candidates` says otherwise
RERANK_CANDIDATES = 100


def _reranker(engines: Engines, name: str | None) -> Engine | None:
    """The engine of a search's `rerank_model` (``None``: no rerank stage); 422 unless a reranker."""
    if name is None:
        return None
    engine = engines.pick(name)
    engine.require_model()
    if engine.kind != "reranker":
        raise InvalidError(f"rerank_model: {name!r} is an embedding model; name a reranker (a cross-encoder: "
                           "`kind: reranker` in GET /info)", param="rerank_model")
    return engine


async def _rerank(request: Request, reranker: Engine, queries: list[str], hits: list[list[dict]],
                  k: int) -> tuple[list[list[dict]], int]:
    """Each query's hits scored by the reranker (:meth:`Engine.rank`, the documents cut at the
    window), the best ``k`` in its order with its scores; and the tokens it ran."""
    cap = reranker.settings.max_input_chars  # a stored text may be longer than a request's; the window is far shorter
    rankings = await asyncio.gather(*(
        reranker.rank(request, query, [(h["text"] or "")[:cap] for h in r], None, EmbedOptions(truncate=True),
                      raw_scores=False, field="rerank_candidates") for query, r in zip(queries, hits) if r))
    out, done = [], iter(rankings)
    for r in hits:
        if not r:
            out.append(r)
            continue
        ranking = next(done)
        out.append([{**r[i], "score": float(ranking.scores[i])} for i in ranking.order[:k]])
    return out, sum(r.tokens for r in rankings)
@router.post("/{name}/search", response_model=SearchResponse,
             responses={200: {"links": HIT_LINKS}, **E404, **E409, **E422})
async def search(request: Request, body: SearchRequest, name: str = NAME, engines: Engines = Depends(get_engines),
                 collections: Collections = Depends(get_collections)) -> Any:
    """Top-`k` documents for `query` (answer: `hits`) or each of `queries` (answer: `results`),
    among those that match `filter`. Scores: inner product (cosine when normalized), squared L2 for
    `l2`, MaxSim for multi-vector, BM25 for `bm25`, the fused score for `hybrid`; with
    `rerank_model`, the reranker's score of the best `rerank_candidates` (default 100) of any mode."""
    texts = [body.query] if body.query is not None else list(body.queries or [])
    field = "queries" if body.queries is not None else "query"
    check_inputs(texts, engines.default.settings, field)
    reranker = _reranker(engines, body.rerank_model)
    coll, engine = await _open(collections, engines, name, body.model)
    k = max(body.k, body.rerank_candidates or RERANK_CANDIDATES) if reranker is not None else body.k
    search = retrieval.Search(coll, engine.embedder.natural_dim, k=k, mode=body.mode, candidates=body.candidates,
                              k_token=body.k_token, filter=body.filter, vector_mode=body.vector_mode,
                              fusion=body.fusion, weight=body.weight)
    for e in search.embeddings():
        engine.pooler(e.pooler, trusted=True)  # a manifest pooler this server cannot build: 422
    vectors, tokens = await retrieval.aembed_texts(partial(engine.embed, request, field=field), texts,
                                                     search.embeddings())
    results = await run_in_threadpool(partial(search.run, vectors, texts=texts))
    hits = [[{"id": h.id, "score": h.score, "metadata": h.metadata, "text": h.text} for h in r] for r in results]
    if reranker is not None:
        hits, rerank_tokens = await _rerank(request, reranker, texts, hits, body.k)
        tokens += rerank_tokens
    if not body.include_text:
        hits = [[{key: v for key, v in h.items() if key != "text"} for h in r] for r in hits]
    usage = {"tokens": tokens}
    if body.query is not None:
        return JSON({"hits": hits[0], "usage": usage})
    return JSON({"results": hits, "usage": usage})
