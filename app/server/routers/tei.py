"""The TEI-compatible surface under ``/tei``: text-embeddings-inference's routes, with TEI's
request, response and error shapes, so that a TEI client works with nothing but its base URL
changed (``http://host:8000/tei``).

It lives under a prefix because embedpool's own ``/embed``, ``/rerank``, ``/tokenize``, ``/info``
and ``/health`` answer richer shapes at the root, which existing clients rely on. Every route
here is a thin translation onto the same code as embedpool's own (the engine, its limits, the
rerank path, the tokenizer helper); errors answer ``{"error", "error_type"}`` with TEI's status
codes through the one error table (:func:`app.server.errors.render`).

=====================  =====================================================================
``POST /tei``          the model's default task, feature extraction: as ``/tei/embed``
``GET /tei``           health, as ``/tei/health`` (TEI's ``GET /``)
``POST /tei/embed``    ``[[float, ...], ...]``, one vector per input (extension: ``pooler``,
                       a single-vector one)
``POST /tei/embed_all``  ``[[[float, ...], ...], ...]``: each input's token vectors, embedpool's
                       ``tokens`` pooler (extension: ``pooler``, any multi-vector one)
``POST /tei/embed_sparse``  ``[[{index, value}, ...], ...]``: each input's non-zero SPLADE weights
                       (models with an MLM head; extension: ``pooler``, e.g. ``splade:top_k=64``)
``POST /tei/rerank``   ``[{index, score[, text]}]``, best first (extension: ``pooler``)
``POST /tei/tokenize`` ``[[{id, text, special, start, stop}, ...], ...]``
``GET /tei/info``      TEI's ``Info``
``GET /tei/health``    200 with an empty body; 503 ``Unhealthy`` while the model loads
``POST /tei/v1/embeddings``, ``/tei/embeddings``  OpenAI's shape, as ``/v1/embeddings``
=====================  =====================================================================

As in TEI: ``truncate`` unset means the server's ``auto_truncate`` (true, TEI's default), an
empty list of inputs is a 400 ``Empty``, too many inputs a 413 ``Validation``, an input over
the model's window with ``truncate: false`` a 422 ``Validation``. Unlike TEI, token vectors of
``/tei/embed_all`` are L2-normalized (as the ``tokens`` pooler gives them), and inputs are text
only (TEI also takes token ids).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from embedpool.app.server.auth import require_api_key
from embedpool.app.server.deps import get_engine
from embedpool.app.server.errors import TEI_PREFIX
from embedpool.app.server.responses import JSON, ranks
from embedpool.app.server.routers import health, openai, tokenize
from embedpool.app.server.schemas import (
    OpenAIEmbeddingResponse,
    Rank,
    SimpleToken,
    SparseValue,
    TEIEmbedAllRequest,
    TEIEmbedRequest,
    TEIEmbedSparseRequest,
    TEIError,
    TEIInfo,
    TEIRerankRequest,
    TEITokenizeRequest,
)
from embedpool.app.server.engine import Engine
from embedpool.poolers import EmbedOptions, sparse_entries
from embedpool.errors import InvalidError, UnavailableError

#: TEI's ``--auto-truncate`` default: an unset ``truncate`` cuts inputs at the model's window
AUTO_TRUNCATE = True
#: the pooler of ``/tei/embed_all`` (TEI: every token's hidden state)
TOKENS_POOLER = "tokens"
#: the pooler of ``/tei/embed_sparse``
SPARSE_POOLER = "splade"

router = APIRouter(prefix=TEI_PREFIX, tags=["tei"])
protected = [Depends(require_api_key)]


def _errors(*statuses: int) -> dict[int, dict]:
    described = {400: "empty list of inputs (`Empty`)", 413: "too many inputs, an input or the body too large "
                 "(`Validation`)", 422: "invalid field, or an input over the model's window with truncate=false "
                 "(`Validation`)", 424: "the model failed (`Backend`)", 429: "queue full (`Overloaded`)",
                 503: "model still loading (`Unhealthy`)"}
    return {s: {"model": TEIError, "description": described[s]} for s in statuses}


EMBED_ERRORS = _errors(400, 413, 422, 424, 429, 503)


def _texts(inputs: str | list[str], field: str = "inputs") -> list[str]:
    if isinstance(inputs, str):
        return [inputs]
    if not inputs:
        raise InvalidError(f"`{field}` cannot be empty", param=field, code="empty")
    return inputs


def _truncate(truncate: bool | None) -> bool:
    return AUTO_TRUNCATE if truncate is None else truncate


def _options(body: TEIEmbedAllRequest | TEIEmbedSparseRequest) -> EmbedOptions:
    """The options of TEI's token-level and sparse embeddings (raw vectors are not theirs to ask)."""
    return EmbedOptions(truncate=_truncate(body.truncate), prompt_name=body.prompt_name,
                        truncation_direction=body.truncation_direction)


async def _embed(body: TEIEmbedRequest, request: Request, engine: Engine) -> list:
    if body.dimensions == 0:
        raise InvalidError("`dimensions` should be positive", param="dimensions")
    options = EmbedOptions(normalize=body.normalize, dimensions=body.dimensions, truncate=_truncate(body.truncate),
                           prompt_name=body.prompt_name, truncation_direction=body.truncation_direction)
    spec, out = await engine.embed_pooled(request, _texts(body.inputs), body.pooler, options, multi=False,
                                          alternative=f"use POST {TEI_PREFIX}/embed_all for several vectors per input")
    return out.vectors[spec]


@router.post("", response_model=list[list[float]], responses=EMBED_ERRORS, dependencies=protected,
             summary="Feature extraction (the model's default task)")
@router.post("/", response_model=list[list[float]], dependencies=protected, include_in_schema=False)
async def default_task(body: TEIEmbedRequest, request: Request, engine: Engine = Depends(get_engine)) -> JSON:
    """TEI's `POST /` for an embedding model: as `POST /tei/embed` (what
    `huggingface_hub.InferenceClient(base_url=...).feature_extraction` calls)."""
    return JSON(await _embed(body, request, engine))


@router.post("/embed", response_model=list[list[float]], responses=EMBED_ERRORS, dependencies=protected)
async def embed(body: TEIEmbedRequest, request: Request, engine: Engine = Depends(get_engine)) -> JSON:
    """TEI's `/embed`: a bare list with one vector per input. Extension: `pooler` (a single-vector
    one; default the server's)."""
    return JSON(await _embed(body, request, engine))


@router.post("/embed_all", response_model=list[list[list[float]]], responses=EMBED_ERRORS, dependencies=protected)
async def embed_all(body: TEIEmbedAllRequest, request: Request, engine: Engine = Depends(get_engine)) -> JSON:
    """TEI's `/embed_all`: each input's token vectors (specials included), from embedpool's `tokens`
    pooler (L2-normalized). Extension: `pooler`, any multi-vector one (`cluster:pool_factor=2`, ...)."""
    spec, out = await engine.embed_pooled(request, _texts(body.inputs), body.pooler or TOKENS_POOLER,
                                          _options(body), multi=True,
                                          alternative=f"use POST {TEI_PREFIX}/embed for one vector per input")
    return JSON(out.vectors[spec])


@router.post("/embed_sparse", response_model=list[list[SparseValue]], responses=EMBED_ERRORS,
             dependencies=protected)
async def embed_sparse(body: TEIEmbedSparseRequest, request: Request, engine: Engine = Depends(get_engine)) -> JSON:
    """TEI's `/embed_sparse`: each input's non-zero SPLADE weights as `{index, value}`, from embedpool's
    `splade` pooler (a 422 for a model without an MLM head). Extension: `pooler`, a sparse one."""
    spec, out = await engine.embed_pooled(request, _texts(body.inputs), body.pooler or SPARSE_POOLER,
                                          _options(body), multi=False,
                                          alternative=f"use POST {TEI_PREFIX}/embed_all for several vectors per input")
    if not engine.embedder.pooler(spec).sparse:
        raise InvalidError(f"pooler: {spec!r} is not sparse; {TEI_PREFIX}/embed_sparse takes splade", param="pooler")
    return JSON([[{"index": i, "value": v} for i, v in zip(row["indices"], row["values"])]
                 for row in sparse_entries(out.vectors[spec])])


@router.post("/rerank", response_model=list[Rank], responses=EMBED_ERRORS, dependencies=protected)
async def rerank_texts(body: TEIRerankRequest, request: Request, engine: Engine = Depends(get_engine)) -> JSON:
    """TEI's `/rerank`, scored as `POST /rerank` (a reranker model: its score of each query-text
    pair; an embedding model: MaxSim with the default `tokens` pooler; extension: `pooler`). As
    TEI's current default, an unset `truncate` cuts inputs at the model's window."""
    texts = _texts(body.texts, "texts")
    options = EmbedOptions(truncate=_truncate(body.truncate), truncation_direction=body.truncation_direction)
    ranking = await engine.rank(request, body.query, texts, body.pooler, options, raw_scores=body.raw_scores)
    return JSON(ranks(ranking, texts, body.return_text))


@router.post("/tokenize", response_model=list[list[SimpleToken]], responses=_errors(400, 413, 422),
             dependencies=protected)
async def tokenize_texts(body: TEITokenizeRequest, engine: Engine = Depends(get_engine)) -> JSON:
    """TEI's `/tokenize`: each input's tokens `{id, text, special, start, stop}` (offsets in
    characters; TEI's are bytes, the same for ASCII)."""
    _, _, tokens, _ = await tokenize.token_lists(engine, _texts(body.inputs), prompt_name=body.prompt_name,
                                                 add_special_tokens=body.add_special_tokens)
    return JSON(tokens)


@router.get("/info", response_model=TEIInfo, responses=_errors(503), dependencies=protected)
async def info(engine: Engine = Depends(get_engine)) -> JSON:
    """TEI's `Info` for the served model (pooling: the server's default pooler; a cross-encoder:
    TEI's `reranker` model type with its labels)."""
    emb = engine.require_model()
    s = engine.settings
    precision = emb.encoder.precision
    dtype = "bfloat16" if "bf16" in precision else "int8" if "int8" in precision else "float32"
    if engine.reranker is not None:
        config = engine.reranker.model.config
        model_type = {"reranker": {"id2label": {str(k): v for k, v in config.id2label.items()},
                                   "label2id": dict(config.label2id)}}
    else:
        model_type = {"embedding": {"pooling": engine.default_pooler}}
    return JSON({
        "model_id": emb.model_id, "model_sha": None, "model_dtype": dtype, "served_model_name": engine.name,
        "model_type": model_type,
        "max_concurrent_requests": s.max_queue, "max_input_length": emb.encoder.max_length,
        "max_batch_tokens": s.max_batch_tokens, "max_batch_requests": None,
        "max_client_batch_size": s.max_client_batch, "auto_truncate": AUTO_TRUNCATE, "tokenization_workers": 1,
        "version": health.version(), "sha": None, "docker_label": None,
    })


@router.get("/health", responses={200: {"description": "ready (empty body)"}, **_errors(503)})
@router.get("", include_in_schema=False)
@router.get("/", include_in_schema=False)
async def health_check(engine: Engine = Depends(get_engine)) -> Response:
    """TEI's health: 200 with an empty body once the model is ready, else 503 `Unhealthy` (no API key needed)."""
    if engine.status != "ready":
        raise UnavailableError("unhealthy")
    return Response(status_code=200)


for path in ("/v1/embeddings", "/embeddings"):
    router.add_api_route(path, openai.embeddings, methods=["POST"], response_model=OpenAIEmbeddingResponse,
                         dependencies=protected, include_in_schema=path == "/v1/embeddings",
                         summary="OpenAI's embeddings (TEI's /v1/embeddings)",
                         responses={s: {"description": "TEI's OpenAI error shape {message, code, type}"}
                                    for s in (400, 413, 422, 429, 503)})
