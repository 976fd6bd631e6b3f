"""``POST /v1/embeddings``: OpenAI-compatible request, response and error shapes."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Depends, Request

from embedpool.app.server.auth import require_api_key
from embedpool.app.server.deps import get_engine
from embedpool.app.server.errors import Invalid
from embedpool.app.server.limits import check_inputs
from embedpool.app.server.responses import JSON
from embedpool.app.server.schemas import OpenAIEmbeddingRequest, OpenAIEmbeddingResponse
from embedpool.app.server.state import Engine

router = APIRouter(tags=["openai"], dependencies=[Depends(require_api_key)])

ERROR = {"description": "OpenAI error shape: {\"error\": {\"message\", \"type\", \"param\", \"code\"}}"}


@router.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse,
             responses={s: ERROR for s in (401, 413, 422, 429, 503)})
async def embeddings(body: OpenAIEmbeddingRequest, request: Request,
                     engine: Engine = Depends(get_engine)) -> JSON:
    """Drop-in for OpenAI's embeddings endpoint (`openai.OpenAI(base_url=".../v1")`). The
    `model` field is accepted and ignored: the server's model answers. `pooler` (an extension)
    picks a single-vector pooler."""
    texts = [body.input] if isinstance(body.input, str) else body.input
    check_inputs(texts, engine.settings, "input")
    spec, multi = engine.pooler(body.pooler)
    if multi:
        raise Invalid(f"pooler: {spec!r} gives several vectors per input, which the OpenAI format "
                      "cannot carry; use POST /embed", param="pooler")
    engine.check_dimensions(body.dimensions)
    out = await engine.embed(request, texts, [spec], role="document", normalize=True,
                             dimensions=body.dimensions, truncate=True)
    vectors = out.vectors[spec]
    if body.encoding_format == "base64":
        items = [base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")
                 for v in vectors]
    else:
        items = vectors
    return JSON({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(items)],
        "model": engine.embedder.model_id,
        "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens},
    })
