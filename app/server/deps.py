"""FastAPI dependencies: the shared state of the app, injected into the routes."""

from __future__ import annotations

from fastapi import Request

from app.server.state import Collections, Engine
from app.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_engine(request: Request) -> Engine:
    return request.app.state.engine


def get_collections(request: Request) -> Collections:
    return request.app.state.collections
