"""FastAPI dependencies: the shared state of the app, injected into the routes.

They are ``async def`` on purpose: FastAPI runs a plain ``def`` dependency in its thread pool,
which would cost every request a thread hop (milliseconds on a busy machine) for an attribute
lookup."""

from __future__ import annotations

from fastapi import Request

from embedpool.app.server.engine import Engine, Engines
from embedpool.app.server.state import Collections
from embedpool.app.settings import Settings


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_engines(request: Request) -> Engines:
    return request.app.state.engines


async def get_engine(request: Request) -> Engine:
    """The model of a route whose path names it (``/models/NAME/tei/...``), else the default."""
    return request.app.state.engines.pick(request.path_params.get("model"))


async def get_collections(request: Request) -> Collections:
    return request.app.state.collections
