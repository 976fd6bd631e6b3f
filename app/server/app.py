"""The app factory: settings, engine, collections, middleware, routers and error handlers."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI

from embedpool.app.server import errors
from embedpool.app.server.auth import AuthMiddleware
from embedpool.app.server.direct import DirectRoutes
from embedpool.app.server.limits import BodyLimitMiddleware
from embedpool.app.server.metrics import Metrics, MetricsMiddleware
from embedpool.app.server.routers import collections, embed, health, openai, playground, rerank, tei, tokenize
from embedpool.app.server.engine import Engine, Engines
from embedpool.app.server.errors import MODELS_PREFIX, TEI_PREFIX
from embedpool.app.server.state import Collections
from embedpool.app.settings import Settings, model_entries

log = logging.getLogger("embedpool.server")

DESCRIPTION = """Embeddings from a frozen encoder with configurable token poolers, and vector
collections to search them.

Errors answer `{"error": message, "type": kind}` (OpenAI's shape under `/v1/`, TEI's
`{"error", "error_type"}` under `/tei`): 401
unauthorized, 404 not found, 409 conflict, 413 too large, 422 validation, 429 overloaded
(`Retry-After`), 503 not ready. When the server has an API key, send `Authorization: Bearer <key>`
(every route but `/health` and `/metrics`).

A drop-in for text-embeddings-inference (TEI) clients lives under [`/tei`](#/tei): TEI's routes,
shapes and status codes (base URL `http://host:port/tei`); Cohere-style rerank at `/v1/rerank`,
OpenAI's model list at `/v1/models`.

The pooler playground, a page that compares poolers on your texts or collections through this
API, is at [`/playground/`](/playground/)."""


def create_app(settings: Settings | None = None, *, embedder: Any = None,
               embedders: Mapping[str, Any] | None = None) -> FastAPI:
    """Build the app for the models of ``settings.model`` (one, or several ``NAME=PATH_OR_ID``
    entries; the first is the default). Each loads in a background thread when the app starts
    (``/health`` answers 503 meanwhile) unless loaded ones are given: ``embedder`` (one model) or
    ``embedders`` (by name, in order)."""
    settings = settings or Settings()
    metrics = Metrics()
    if embedders is None:
        entries = model_entries(settings.model)
        if embedder is not None:
            embedders = {entries[0][0]: embedder}
    if embedders is not None:
        engines = Engines([Engine(settings, metrics, emb, name) for name, emb in embedders.items()])
    else:
        engines = Engines([Engine(settings.model_copy(update={"model": path}), metrics, name=name)
                           for name, path in entries])
    colls = Collections(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engines.start()
        try:
            yield
        finally:
            engines.stop()
            colls.close()

    app = FastAPI(title="embedpool", version=health.version(), description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.engines = engines
    app.state.collections = colls
    for router in (health.router, embed.router, openai.router, collections.router, rerank.router,
                   tokenize.router, tei.router):
        app.include_router(router)
    # each model's TEI surface at a base URL of its own (TEI serves one model per base URL)
    app.include_router(tei.router, prefix=MODELS_PREFIX + "/{model}", include_in_schema=False)
    playground.mount(app)
    # innermost: the embedding routes answered without FastAPI's per-request machinery (direct.py)
    direct = [(openai.router, "/v1/embeddings"), (embed.router, "/embed"), (tei.router, f"{TEI_PREFIX}/embed"),
              (tei.router, f"{TEI_PREFIX}/v1/embeddings")]
    app.add_middleware(DirectRoutes, routes=[r for router, path in direct for r in router.routes if r.path == path])
    errors.install(app)
    # Outermost last: metrics see every answer, auth runs before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_payload_bytes)
    app.add_middleware(AuthMiddleware, api_key=settings.api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app

