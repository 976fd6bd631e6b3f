"""``POST /embed``: embeddings with any pooler, several poolers from one forward pass."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from embedpool.app.server.auth import require_api_key
from embedpool.app.server.deps import get_engines
from embedpool.app.server.limits import check_inputs
from embedpool.app.server.output import encode_vectors, output_ranges, sparse_vectors
from embedpool.app.server.responses import JSON
from embedpool.app.server.schemas import EmbedRequest, EmbedResponse, MultiEmbedResponse
from embedpool.app.server.engine import Engines
from embedpool.poolers import EmbedOptions

router = APIRouter(tags=["embeddings"], dependencies=[Depends(require_api_key)])

ERRORS = {
    413: {"description": "too many inputs, an input too long, or the body too large"},
    422: {"description": "invalid field (the message names it and says what to send)"},
    429: {"description": "queue full; see Retry-After"},
    503: {"description": "model still loading"},
}


@router.post("/embed", response_model=EmbedResponse | MultiEmbedResponse, responses=ERRORS)
async def embed(body: EmbedRequest, request: Request, engines: Engines = Depends(get_engines)) -> JSON:
    """Embed `inputs` with `pooler` (answer: `embeddings`) or with each of `poolers` (answer:
    `results`, one per pooler). Single-vector poolers give one vector per input, multi-vector
    poolers (`tokens`, `cluster`, ...) a list of vectors per input.

    `precision` quantizes the output as sentence-transformers' `quantize_embeddings` does.
    int8 / uint8 ranges are fixed, never taken from the request's own vectors (a text always
    gets the same codes, whatever it is sent with): `[-1, 1]` in every dimension (normalized
    vectors lie in it), or the request's `ranges`. `encoding_format: base64` sends each input's
    codes as one string (little-endian, row-major; multi-vector: `reshape(-1, width)`). A sparse
    pooler (`splade`, for models with an MLM head) gives each input `{indices, values}`."""
    engine = engines.pick(body.model)
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    check_inputs(texts, engine.settings, "inputs")
    if body.poolers is not None:
        resolved = [engine.pooler(p, f"poolers[{i}]") for i, p in enumerate(body.poolers)]
    else:
        resolved = [engine.pooler(body.pooler)]
    engine.check_dimensions(body.dimensions)
    engine.check_prompt(body.prompt_name)
    ranges = output_ranges(body.precision, body.ranges, normalize=body.normalize,
                           dim=body.dimensions or engine.embedder.dim)
    specs = list(dict.fromkeys(spec for spec, _ in resolved))
    options = EmbedOptions(role=body.role, normalize=body.normalize, dimensions=body.dimensions,
                           truncate=body.truncate, prompt_name=body.prompt_name,
                           truncation_direction=body.truncation_direction)
    out = await engine.embed(request, texts, specs, options)

    def codes(spec: str) -> list:
        if engine.embedder.pooler(spec).sparse:
            return sparse_vectors(out.vectors[spec], body.precision, body.encoding_format)
        return encode_vectors(out.vectors[spec], body.precision, body.encoding_format, ranges)

    head = {"model": engine.embedder.model_id, "precision": body.precision}
    usage = {"tokens": out.usage}
    if body.poolers is None:
        spec, multi = resolved[0]
        return JSON({**head, "pooler": spec, "multi_vector": multi, "embeddings": codes(spec), "usage": usage})
    return JSON({**head,
                 "results": [{"pooler": spec, "multi_vector": multi, "embeddings": codes(spec)}
                             for spec, multi in resolved],
                 "usage": usage})
