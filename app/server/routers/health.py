"""``/health``, ``/info`` and ``/metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from embedpool.app.server.auth import require_api_key
from embedpool.app.server.deps import get_collections, get_engines
from embedpool.app.server.engine import Engine, Engines
from embedpool.app.server.schemas import Health, Info, ModelInfo, PoolerInfo
from embedpool.app.server.state import Collections

router = APIRouter(tags=["service"])


@router.get("/health", response_model=Health,
            responses={503: {"model": Health, "description": "the model is loading (or failed to load)"}})
async def health(engines: Engines = Depends(get_engines)) -> Response:
    """200 once every model is loaded and its batcher runs; 503 while one loads (no API key
    needed). `model`: the default model; `models`: each served model's status, by name.
    ``storage`` says whether the collections' backend answers (a Milvus server that is down:
    ``unreachable`` with the reason; embedding still works, so the status stays 200)."""
    from starlette.concurrency import run_in_threadpool

    from embedpool import index
    from embedpool.app.server.responses import JSON

    engine = engines.default
    s = engine.settings
    storage = await run_in_threadpool(index.storage_status, s.data_dir, **s.store())
    errors = "; ".join(f"{e.name}: {e.error}" for e in engines if e.error) or None
    body = Health(status=engines.status, model=engine.model.model_id if engine.model else engine.settings.model,
                  error=errors if len(engines) > 1 else engine.error, storage=storage,
                  models={e.name: e.status for e in engines} if len(engines) > 1 else None)
    return JSON(body.model_dump(exclude_none=True), status_code=200 if engines.status == "ready" else 503)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
async def metrics(request: Request) -> Response:
    """Prometheus metrics (no API key needed)."""
    m = request.app.state.metrics
    return Response(m.render(), media_type=m.content_type)


@router.get("/info", response_model=Info, dependencies=[Depends(require_api_key)])
def info(engines: Engines = Depends(get_engines), collections: Collections = Depends(get_collections)) -> Info:
    """The default model (its dimension, window, precision) at the top level, every served model
    in `models`, the poolers and the collections."""
    from embedpool.poolers import REGISTRY

    engine = engines.default
    s = engine.settings
    poolers = [PoolerInfo(name=name, options={k: t.__name__ for k, t in cls.options.items()},
                          multi_vector=cls.multi_vector if isinstance(cls.multi_vector, bool) else None,
                          learned="weights" in cls.options, all_layers=cls.needs_layers)
               for name, cls in sorted(REGISTRY.items())]
    models = [_model_info(e) for e in engines]
    top = models[0]
    return Info(
        status=engines.status,
        version=version(),
        model=top.model,
        dim=top.dim,
        max_length=top.max_length,
        precision=top.precision,
        precision_requested=s.precision,
        precision_reason=top.precision_reason,
        cpu=_cpu(),
        default_pooler=top.default_pooler,
        models=models,
        poolers=poolers,
        collections=collections.names(),
        limits={"max_client_batch": s.max_client_batch, "max_input_chars": s.max_input_chars,
                "max_payload_bytes": s.max_payload_bytes, "max_queue": s.max_queue,
                "max_batch_tokens": s.max_batch_tokens, "max_request_tokens": s.max_request_tokens,
                "max_request_vectors": s.max_request_vectors, **s.stored_limits()},
    )


def _model_info(engine: Engine) -> ModelInfo:
    """One served model; a reranker (``kind``) has no vectors (``dim`` null) and no pooler."""
    model = engine.model if engine.status == "ready" else None
    s = engine.settings
    reranker = engine.kind == "reranker"
    return ModelInfo(name=engine.name, status=engine.status, kind=engine.kind, model=model.model_id if model else s.model,
                     dim=engine.embedder.dim if model and not reranker else None,
                     max_length=model.encoder.max_length if model else None,
                     precision=model.encoder.precision if model else s.precision,
                     precision_reason=model.encoder.precision_reason if model else None,
                     default_pooler=None if reranker else engine.default_pooler,
                     num_labels=model.num_labels if reranker else None, error=engine.error)


def _cpu() -> str:
    from embedpool.cpu import cpu_features

    return cpu_features().summary()


def version() -> str:
    """embedpool's installed version (``unknown`` when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("embedpool")
    except PackageNotFoundError:
        return "unknown"
