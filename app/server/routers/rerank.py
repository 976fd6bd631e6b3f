"""``POST /rerank``: TEI's rerank, scored by a reranker model (a cross-encoder) or, with an
embedding model, by late interaction (MaxSim) or cosine; ``POST /v1/rerank`` (and ``/v2/rerank``):
the same scores in Cohere's shape (Jina's and Infinity's too).

Both translate their request into :meth:`app.server.engine.Engine.rank` (the query in the query
role and the texts as documents, one batcher round, the rerank cache) and its
:class:`~app.server.engine.Ranking` into their answer.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request

from embedpool.app.server.auth import require_api_key
from embedpool.app.server.deps import get_engines
from embedpool.app.server.responses import JSON, OPENAI_ERROR, ranks
from embedpool.app.server.schemas import CohereRerankRequest, CohereRerankResponse, Rank, RerankRequest
from embedpool.app.server.engine import Engines
from embedpool.poolers import EmbedOptions

router = APIRouter(tags=["rerank"], dependencies=[Depends(require_api_key)])

ERRORS = {
    413: {"description": "too many texts, a text too long, the body too large, or more tokens or vectors "
                         "than max_request_tokens / max_request_vectors"},
    422: {"description": "invalid field, e.g. empty `texts`, or an input over the model's window with "
                         "`truncate: false` (the message names it)"},
    429: {"description": "queue full; see Retry-After"},
    503: {"description": "model still loading"},
}


@router.post("/rerank", response_model=list[Rank], responses=ERRORS)
async def rerank(body: RerankRequest, request: Request, engines: Engines = Depends(get_engines)) -> JSON:
    """Rank `texts` by relevance to `query`: a list of `{index, score[, text]}`, best first
    (`index`: the text's position in the request). A reranker model (a cross-encoder) scores each
    query-text pair: its activation of the logit (as sentence-transformers' `CrossEncoder.predict`),
    the logit itself with `raw_scores`. An embedding model scores with `pooler` (default `tokens`):
    a multi-vector pooler by MaxSim -- the mean over the query's vectors of their best cosine in
    the text, or their sum with `raw_scores` -- a single-vector pooler by cosine. As TEI,
    `truncate` defaults to false: an input (a reranker's: query and text together) over the
    model's window is refused, not cut."""
    options = EmbedOptions(truncate=body.truncate, truncation_direction=body.truncation_direction)
    ranking = await engines.pick(body.model).rank(request, body.query, body.texts, body.pooler, options,
                                                  raw_scores=body.raw_scores)
    return JSON(ranks(ranking, body.texts, body.return_text))


@router.post("/v1/rerank", response_model=CohereRerankResponse, tags=["openai"],
             responses={s: OPENAI_ERROR for s in (401, 413, 422, 429, 503)})
@router.post("/v2/rerank", response_model=CohereRerankResponse, tags=["openai"], include_in_schema=False)
async def cohere_rerank(body: CohereRerankRequest, request: Request,
                        engines: Engines = Depends(get_engines)) -> JSON:
    """Cohere's rerank (v1 and v2; also Jina's and Infinity's shape): `{results: [{index,
    relevance_score[, document]}], model, usage}`, best first, the best `top_n`. Scored as
    POST /rerank (`pooler`, default `tokens`: MaxSim); documents longer than the model's
    window are cut, as Cohere does. A reranker model scores each query-document pair (as POST
    /rerank; `raw_scores`, Infinity's: its logit). `model` picks a served model (a server of one
    answers any name). Errors in OpenAI's shape."""
    texts = body.texts
    engine = engines.pick(body.model, lenient=True)
    ranking = await engine.rank(request, body.query, texts, body.pooler, EmbedOptions(truncate=True),
                                raw_scores=body.raw_scores, field="documents")
    order = ranking.order[:body.top_n] if body.top_n else ranking.order
    return JSON({
        "id": uuid.uuid4().hex,
        "model": engine.require_model().model_id,
        "results": [{"index": int(i), "relevance_score": float(ranking.scores[i]),
                     **({"document": {"text": texts[i]}} if body.return_documents else {})} for i in order],
        "usage": {"prompt_tokens": ranking.tokens, "total_tokens": ranking.tokens},
    })
