"""``POST /v1/embeddings``: OpenAI-compatible request, response and error shapes."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from embedpool.app.server.auth import require_api_key
from embedpool.app.server.deps import get_engine
from embedpool.app.server.errors import Invalid
from embedpool.app.server.limits import check_inputs
from embedpool.app.server.output import encode_vectors, output_ranges
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
    `model` field is accepted and ignored: the server's model answers. Extensions: `pooler`
    picks a single-vector pooler; `input_type: query` (or `role: query`) embeds queries (the
    model's query prompt); `precision` / `ranges` as on `/embed` (with `encoding_format: float`:
    OpenAI clients decode base64 as float32)."""
    texts = [body.input] if isinstance(body.input, str) else body.input
    check_inputs(texts, engine.settings, "input")
    spec, multi = engine.pooler(body.pooler)
    if multi:
        raise Invalid(f"pooler: {spec!r} gives several vectors per input, which the OpenAI format "
                      "cannot carry; use POST /embed", param="pooler")
    engine.check_dimensions(body.dimensions)
    if body.encoding_format == "base64" and body.precision != "float32":
        raise Invalid(f"encoding_format: base64 on /v1/embeddings carries float32 only (OpenAI clients decode it "
                      f"as float32); for precision {body.precision!r} send encoding_format 'float' (the OpenAI SDK: "
                      "encoding_format='float'), or use POST /embed, whose base64 carries any precision",
                      param="encoding_format")
    ranges = output_ranges(body.precision, body.ranges, normalize=True, dim=body.dimensions or engine.embedder.dim)
    out = await engine.embed(request, texts, [spec], role=body.embed_role, normalize=True,
                             dimensions=body.dimensions, truncate=True, field="input")
    items = encode_vectors(out.vectors[spec], body.precision, body.encoding_format, ranges)
    return JSON({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(items)],
        "model": engine.embedder.model_id,
        "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens},
    })
