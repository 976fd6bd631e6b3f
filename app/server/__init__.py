"""The HTTP service: ``create_app(settings)`` builds the FastAPI app (``embedpool serve`` runs it)."""

from app.server.app import create_app

__all__ = ["create_app"]
