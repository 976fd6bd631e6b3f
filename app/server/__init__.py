"""The HTTP service: ``create_app(settings)`` builds the FastAPI app (``embedpool serve`` runs it)."""

import os

# Before torch or faiss load OpenMP (also when the app is run as ``uvicorn --factory
# app.server:create_app``): idle OpenMP threads sleep instead of spinning, which on a busy
# machine fight the event loop and make each forward pass many times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from embedpool.app.server.app import create_app  # noqa: E402

__all__ = ["create_app"]
