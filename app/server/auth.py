"""API-key authentication (``Authorization: Bearer <key>``) when ``api_key`` is set.

The key is checked by :class:`AuthMiddleware` before the body is read, on every route but
``/health``, ``/metrics`` (and TEI's ``/tei/health``, ``GET /tei``), the API docs (``/docs``, ``/redoc``, ``/openapi.json``: they hold no
data, and Swagger UI's *Authorize* button needs the page to load) and the playground's static
page (``/``, ``/playground/...``, which asks for the key). :func:`require_api_key` is the
same check as a FastAPI dependency, so that the protected routes declare the Bearer scheme in
the OpenAPI document.
"""

from __future__ import annotations

import secrets

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import ASGIApp, Receive, Scope, Send

from embedpool.app.server.errors import render
from embedpool.errors import UnauthorizedError

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json", "/",
                          "/tei/health"})
#: public for GET only: TEI's ``GET /`` is its health check, its ``POST /`` embeds (key needed)
PUBLIC_GET_PATHS = frozenset({"/tei", "/tei/"})
#: the playground's static files hold no data either (the page asks for the key to call the API)
PUBLIC_PREFIXES = ("/playground",)

bearer_scheme = HTTPBearer(auto_error=False, description="the server's API key (EMBEDPOOL_API_KEY)")


def check(authorization: str | None, api_key: str | None) -> None:
    """Raise :class:`Unauthorized` unless ``authorization`` is ``Bearer <api_key>``."""
    if not api_key:
        return
    if not authorization:
        raise UnauthorizedError("missing API key: send the header 'Authorization: Bearer <key>'")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise UnauthorizedError("invalid API key: send the header 'Authorization: Bearer <key>' with the server's key")


async def require_api_key(request: Request,
                          _: HTTPAuthorizationCredentials | None = Depends(bearer_scheme)) -> None:
    check(request.headers.get("authorization"), request.app.state.settings.api_key)


class AuthMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (scope["type"] == "http" and self.api_key and path not in PUBLIC_PATHS
                and not path.startswith(PUBLIC_PREFIXES)
                and not (scope.get("method") in ("GET", "HEAD") and path in PUBLIC_GET_PATHS)):
            header = None
            for k, v in scope.get("headers", ()):
                if k == b"authorization":
                    header = v.decode("latin-1")
                    break
            try:
                check(header, self.api_key)
            except UnauthorizedError as err:
                await render(scope["path"], err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
