"""``POST /rerank``: TEI's rerank, scored by late interaction (MaxSim) or cosine.

The query (query role) and the texts (document role) are embedded with one pooler, queued
together so that they share a batcher round; a multi-vector pooler (default ``tokens``) scores
each text by exact MaxSim (:func:`index.maxsim_scores`), a single-vector one by cosine. Texts
seen before with the same options come from the rerank cache (:mod:`app.server.cache`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from embedpool import index
from embedpool.app.server.auth import require_api_key
from embedpool.app.server.deps import get_engine
from embedpool.app.server.errors import Invalid
from embedpool.app.server.limits import check_inputs
from embedpool.app.server.responses import JSON
from embedpool.app.server.schemas import Rank, RerankRequest
from embedpool.app.server.state import Engine

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
    check_inputs([body.query], engine.settings, "query")
    check_inputs(body.texts, engine.settings, "texts")
    spec, multi = engine.pooler(body.pooler or DEFAULT_POOLER)
    if not body.truncate:
        await run_in_threadpool(_check_lengths, engine, body)
    options = {"normalize": True, "dimensions": None, "truncate": body.truncate,
               "truncation_direction": body.truncation_direction}
    query, docs = await _embed(engine, request, spec, body, options)
    scores = await run_in_threadpool(_scores, query, docs, multi, body.raw_scores)
    order = np.argsort(-scores, kind="stable")
    return JSON([{"index": int(i), "score": float(scores[i]),
                  **({"text": body.texts[i]} if body.return_text else {})} for i in order])


async def _embed(engine: Engine, request: Request, spec: str, body: RerankRequest,
                 options: dict[str, Any]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The query's vectors and each text's, the texts not in the cache embedded in the same
    batcher round as the query."""
    key = (spec, *sorted(options.items()))
    docs = engine.rerank_cache.get_many(key, body.texts)
    missing = list(dict.fromkeys(t for t, v in zip(body.texts, docs) if v is None))
    q_out, d_out = await engine.embed_many(request, [
        ([body.query], [spec], {**options, "role": "query"}),
        (missing, [spec], {**options, "role": "document"}),
    ], field="texts")
    fresh = dict(zip(missing, d_out.vectors.get(spec, [])))
    engine.rerank_cache.put_many(key, missing, [fresh[t] for t in missing])
    return q_out.vectors[spec][0], [v if v is not None else fresh[t] for t, v in zip(body.texts, docs)]


def _check_lengths(engine: Engine, body: RerankRequest) -> None:
    """422 naming the first input over the model's window (``truncate: false``)."""
    encoder = engine.embedder.encoder
    limit = encoder.max_length
    fields = [("query", body.query, "query")] + [(f"texts[{i}]", t, "document") for i, t in enumerate(body.texts)]
    lengths = encoder.lengths([body.query], role="query") + encoder.lengths(body.texts, role="document")
    for (field, _, _), n in zip(fields, lengths):
        if n > limit:
            raise Invalid(f"{field}: {n} tokens, over the model's window of {limit} tokens; shorten it, or send "
                          "truncate=true to cut it (truncation_direction picks the end)",
                          param=field.split("[")[0])


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
