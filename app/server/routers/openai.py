"""``POST /v1/embeddings`` and ``GET /v1/models``: OpenAI-compatible request, response and error
shapes (``POST /v1/rerank``, Cohere's shape, is in :mod:`.rerank`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Request

from embedpool.app.server.auth import require_api_key
from embedpool.app.server.deps import get_engines
from embedpool.app.server.output import encode_vectors, output_ranges
from embedpool.app.server.responses import JSON, OPENAI_ERROR
from embedpool.app.server.schemas import ModelCard, ModelList, OpenAIEmbeddingRequest, OpenAIEmbeddingResponse
from embedpool.app.server.engine import Engines
from embedpool.poolers import EmbedOptions
from embedpool.errors import InvalidError, NotFoundError

router = APIRouter(tags=["openai"], dependencies=[Depends(require_api_key)])




@router.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse,
             responses={s: OPENAI_ERROR for s in (401, 413, 422, 429, 503)})
async def embeddings(body: OpenAIEmbeddingRequest, request: Request,
                     engines: Engines = Depends(get_engines)) -> JSON:
    """Drop-in for OpenAI's embeddings endpoint (`openai.OpenAI(base_url=".../v1")`). `model`
    picks a served model (a server of one answers any name, as OpenAI clients always send one;
    under a model's TEI base URL the path names it). Extensions: `pooler`
    picks a single-vector pooler; `input_type: query` (or `role: query`) embeds queries (the
    model's query prompt); `precision` / `ranges` as on `/embed` (with `encoding_format: float`:
    OpenAI clients decode base64 as float32)."""
    # a model's own TEI base URL (/models/NAME/tei/v1/embeddings) names it in the path
    path_model = request.path_params.get("model")
    engine = engines.pick(path_model) if path_model else engines.pick(body.model, lenient=True)
    texts = [body.input] if isinstance(body.input, str) else body.input
    if body.encoding_format == "base64" and body.precision != "float32":
        raise InvalidError(f"encoding_format: base64 on /v1/embeddings carries float32 only (OpenAI clients decode it "
                           f"as float32); for precision {body.precision!r} send encoding_format 'float' (the OpenAI SDK: "
                           "encoding_format='float'), or use POST /embed, whose base64 carries any precision",
                           param="encoding_format")
    engine.check_dimensions(body.dimensions)
    ranges = output_ranges(body.precision, body.ranges, normalize=True, dim=body.dimensions or engine.embedder.dim)
    spec, out = await engine.embed_pooled(request, texts, body.pooler,
                                          EmbedOptions(role=body.embed_role, dimensions=body.dimensions),
                                          multi=False, field="input",
                                          alternative="the OpenAI format has one vector per input: use POST /embed")
    items = encode_vectors(out.vectors[spec], body.precision, body.encoding_format, ranges)
    return JSON({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(items)],
        "model": engine.embedder.model_id,
        "usage": {"prompt_tokens": out.usage, "total_tokens": out.usage},
    })


def _models(engines: Engines) -> list[dict]:
    """Every served model as OpenAI's model objects: its id, the id's aliases and the name it is
    served under (``--model NAME=...``), each an entry whose ``root`` is the model's id."""
    cards: dict[str, dict] = {}
    for engine in engines:
        model_id = engine.require_model().model_id
        for name in [model_id, *engine.names()]:
            cards.setdefault(name, {"id": name, "object": "model", "created": engine.loaded_at or 0,
                                    "owned_by": "embedpool", "root": model_id})
    return list(cards.values())


@router.get("/v1/models", response_model=ModelList, responses={s: OPENAI_ERROR for s in (401, 503)})
async def models(engines: Engines = Depends(get_engines)) -> JSON:
    """The served models, each with its aliases and the name it is served under (each an entry
    whose `root` is the model's id); any of them may be sent as `model`."""
    return JSON({"object": "list", "data": _models(engines)})


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={s: OPENAI_ERROR for s in (401, 404, 503)})
async def model(model_id: str = Path(..., max_length=512, description="a model id or alias"),
                engines: Engines = Depends(get_engines)) -> JSON:
    """One entry of `GET /v1/models`; 404 (OpenAI's error shape) for a model this server does not serve."""
    cards = _models(engines)
    for card in cards:
        if card["id"] == model_id:
            return JSON(card)
    names = ", ".join(repr(c["id"]) for c in cards)
    raise NotFoundError(f"model {model_id!r} is not served here; this server serves {names}; "
                        "GET /v1/models lists them", param="model")
