"""The pooler playground: static files (``app/server/static``), no build step, no external
requests; the page calls the public API only. ``GET /`` leads to it."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parents[1] / "static"
PREFIX = "/playground"

router = APIRouter(include_in_schema=False)


@router.get("/")
@router.get(PREFIX)
async def to_playground() -> RedirectResponse:
    return RedirectResponse(PREFIX + "/", status_code=307)


def mount(app: FastAPI) -> None:
    app.include_router(router)
    app.mount(PREFIX, StaticFiles(directory=STATIC, html=True), name="playground")
