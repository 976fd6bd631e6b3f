"""``POST /rerank``: TEI's rerank, scored by late interaction (MaxSim) or cosine; ``POST /v1/rerank``
(and ``/v2/rerank``): the same scores in Cohere's shape (Jina's and Infinity's too).

The query (query role) and the texts (document role) are embedded with one pooler, queued
together so that they share a batcher round; a multi-vector pooler (default ``tokens``) scores
each text by exact MaxSim (:func:`index.maxsim_scores`), a single-vector one by cosine. Texts
seen before with the same options come from the rerank cache (:mod:`app.server.cache`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from embedpool import index
from embedpool.app.server.auth import require_api_key
from embedpool.app.server.deps import get_engine
from embedpool.app.server.limits import check_inputs
from embedpool.app.server.responses import JSON
from embedpool.app.server.routers.openai import ERROR as OPENAI_ERROR
from embedpool.app.server.schemas import CohereRerankRequest, CohereRerankResponse, Rank, RerankRequest
from embedpool.app.server.state import Engine
from embedpool.errors import InvalidError

router = APIRouter(tags=["rerank"], dependencies=[Depends(require_api_key)])

DEFAULT_POOLER = "tokens"
#: document token rows scored per :func:`index.maxsim_scores` call (bounds the copy into one block)
BLOCK_ROWS = 16384

ERRORS = {
    413: {"description": "too many texts, a text too long, the body too large, or more tokens or vectors "
                         "than max_request_tokens / max_request_vectors"},
    422: {"description": "invalid field, e.g. empty `texts`, or an input over the model's window with "
                         "`truncate: false` (the message names it)"},
    429: {"description": "queue full; see Retry-After"},
    503: {"description": "model still loading"},
}


@router.post("/rerank", response_model=list[Rank], responses=ERRORS)
async def rerank(body: RerankRequest, request: Request, engine: Engine = Depends(get_engine)) -> JSON:
    """Rank `texts` by relevance to `query`: a list of `{index, score[, text]}`, best first
    (`index`: the text's position in the request). `pooler` (default `tokens`): a multi-vector
    pooler scores by MaxSim -- the mean over the query's vectors of their best cosine in the
    text, or their sum with `raw_scores` -- a single-vector pooler by cosine. As TEI,
    `truncate` defaults to false: an input over the model's window is refused, not cut."""
    ranking = await rank(engine, request, body.query, body.texts, body.pooler, truncate=body.truncate,
                         truncation_direction=body.truncation_direction, raw_scores=body.raw_scores)
    return JSON(ranks(ranking, body.texts, body.return_text))


@router.post("/v1/rerank", response_model=CohereRerankResponse, tags=["openai"],
             responses={s: OPENAI_ERROR for s in (401, 413, 422, 429, 503)})
@router.post("/v2/rerank", response_model=CohereRerankResponse, tags=["openai"], include_in_schema=False)
async def cohere_rerank(body: CohereRerankRequest, request: Request, engine: Engine = Depends(get_engine)) -> JSON:
    """Cohere's rerank (v1 and v2; also Jina's and Infinity's shape): `{results: [{index,
    relevance_score[, document]}], model, usage}`, best first, the best `top_n`. Scored as
    POST /rerank (`pooler`, default `tokens`: MaxSim); documents longer than the model's
    window are cut, as Cohere does. `model` is accepted and ignored: the server's model answers.
    Errors in OpenAI's shape."""
    texts = body.texts
    ranking = await rank(engine, request, body.query, texts, body.pooler, truncate=True,
                         truncation_direction="right", raw_scores=False, field="documents")
    order = ranking.order[:body.top_n] if body.top_n else ranking.order
    return JSON({
        "id": uuid.uuid4().hex,
        "model": engine.embedder.model_id,
        "results": [{"index": int(i), "relevance_score": float(ranking.scores[i]),
                     **({"document": {"text": texts[i]}} if body.return_documents else {})} for i in order],
        "usage": {"prompt_tokens": ranking.tokens, "total_tokens": ranking.tokens},
    })


@dataclass(frozen=True)
class Ranking:
    """Scores of the texts in request order, their order best first, and the tokens embedded."""

    scores: np.ndarray
    order: np.ndarray
    tokens: int


async def rank(engine: Engine, request: Request, query: str, texts: list[str], pooler: str | None, *,
               truncate: bool, truncation_direction: str, raw_scores: bool, field: str = "texts") -> Ranking:
    """Score ``texts`` against ``query``: the one path of POST /rerank, /v1/rerank and TEI's
    /tei/rerank (limits, pooler, the cache, one batcher round). ``field`` names the texts in
    errors."""
    check_inputs([query], engine.settings, "query")
    check_inputs(texts, engine.settings, field)
    spec, multi = engine.pooler(pooler or DEFAULT_POOLER)
    if not truncate:
        await run_in_threadpool(_check_lengths, engine, query, texts, field)
    options = {"normalize": True, "dimensions": None, "truncate": truncate,
               "truncation_direction": truncation_direction}
    q, docs, tokens = await _embed(engine, request, spec, query, texts, options, field)
    scores = await run_in_threadpool(_scores, q, docs, multi, raw_scores)
    return Ranking(scores, np.argsort(-scores, kind="stable"), tokens)


def ranks(ranking: Ranking, texts: list[str], return_text: bool) -> list[dict[str, Any]]:
    """TEI's answer: ``[{index, score[, text]}]``, best first."""
    return [{"index": int(i), "score": float(ranking.scores[i]), **({"text": texts[i]} if return_text else {})}
            for i in ranking.order]


async def _embed(engine: Engine, request: Request, spec: str, query: str, texts: list[str],
                 options: dict[str, Any], field: str) -> tuple[np.ndarray, list[np.ndarray], int]:
    """The query's vectors and each text's, the texts not in the cache embedded in the same
    batcher round as the query, and the tokens embedded."""
    key = (spec, *sorted(options.items()))
    docs = engine.rerank_cache.get_many(key, texts)
    missing = list(dict.fromkeys(t for t, v in zip(texts, docs) if v is None))
    q_out, d_out = await engine.embed_many(request, [
        ([query], [spec], {**options, "role": "query"}),
        (missing, [spec], {**options, "role": "document"}),
    ], field=field)
    fresh = dict(zip(missing, d_out.vectors.get(spec, [])))
    engine.rerank_cache.put_many(key, missing, [fresh[t] for t in missing])
    return (q_out.vectors[spec][0], [v if v is not None else fresh[t] for t, v in zip(texts, docs)],
            q_out.tokens + d_out.tokens)


def _check_lengths(engine: Engine, query: str, texts: list[str], field: str) -> None:
    """422 naming the first input over the model's window (``truncate: false``)."""
    encoder = engine.embedder.encoder
    limit = encoder.max_length
    fields = ["query"] + [f"{field}[{i}]" for i in range(len(texts))]
    lengths = encoder.lengths([query], role="query") + encoder.lengths(texts, role="document")
    for name, n in zip(fields, lengths):
        if n > limit:
            raise InvalidError(f"{name}: {n} tokens, over the model's window of {limit} tokens; shorten it, or send "
                               "truncate=true to cut it (truncation_direction picks the end)",
                               param=name.split("[")[0])


def _scores(query: np.ndarray, docs: list[np.ndarray], multi: bool, raw: bool) -> np.ndarray:
    if not multi:
        return np.stack(docs) @ query
    out = np.empty(len(docs), dtype=np.float32)
    start = 0
    while start < len(docs):  # blocks of documents, so the token rows are copied a block at a time
        end, rows = start, 0
        while end < len(docs) and (end == start or rows + len(docs[end]) <= BLOCK_ROWS):
            rows += len(docs[end])
            end += 1
        block = docs[start:end]
        offsets = np.zeros(len(block) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in block], out=offsets[1:])
        out[start:end] = index.maxsim_scores([query], np.concatenate(block), offsets)[0]
        start = end
    return out if raw else out / len(query)
