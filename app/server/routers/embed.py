"""``POST /embed``: embeddings with any pooler, several poolers from one forward pass."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from embedpool.app.server.auth import require_api_key
from embedpool.app.server.deps import get_engine
from embedpool.app.server.limits import check_inputs
from embedpool.app.server.responses import JSON
from embedpool.app.server.schemas import EmbedRequest, EmbedResponse, MultiEmbedResponse
from embedpool.app.server.state import Engine

router = APIRouter(tags=["embeddings"], dependencies=[Depends(require_api_key)])

ERRORS = {
    413: {"description": "too many inputs, an input too long, or the body too large"},
    422: {"description": "invalid field (the message names it and says what to send)"},
    429: {"description": "queue full; see Retry-After"},
    503: {"description": "model still loading"},
}


@router.post("/embed", response_model=EmbedResponse | MultiEmbedResponse, responses=ERRORS)
async def embed(body: EmbedRequest, request: Request, engine: Engine = Depends(get_engine)) -> JSON:
    """Embed `inputs` with `pooler` (answer: `embeddings`) or with each of `poolers` (answer:
    `results`, one per pooler). Single-vector poolers give one vector per input, multi-vector
    poolers (`tokens`, `cluster`, ...) a list of vectors per input."""
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    check_inputs(texts, engine.settings, "inputs")
    if body.poolers is not None:
        resolved = [engine.pooler(p, f"poolers[{i}]") for i, p in enumerate(body.poolers)]
    else:
        resolved = [engine.pooler(body.pooler)]
    engine.check_dimensions(body.dimensions)
    specs = list(dict.fromkeys(spec for spec, _ in resolved))
    out = await engine.embed(request, texts, specs, role=body.role, normalize=body.normalize,
                             dimensions=body.dimensions, truncate=body.truncate)
    model = engine.embedder.model_id
    usage = {"tokens": out.tokens}
    if body.poolers is None:
        spec, multi = resolved[0]
        return JSON({"model": model, "pooler": spec, "multi_vector": multi,
                     "embeddings": out.vectors[spec], "usage": usage})
    return JSON({"model": model,
                 "results": [{"pooler": spec, "multi_vector": multi, "embeddings": out.vectors[spec]}
                             for spec, multi in resolved],
                 "usage": usage})
