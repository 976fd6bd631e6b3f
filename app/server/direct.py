"""The embedding routes without FastAPI's per-request machinery (issue 34).

One sentence per request is the hot path of search and RAG: the model needs ~1 ms of CPU for it,
and FastAPI's route matching, dependency solving, body validation wrappers and exception
middlewares cost about as much again on the event loop, which shares the machine's cores with
the model (docs/serving.md has the profile). :class:`DirectRoutes` runs the routes of
``POST /v1/embeddings`` and ``POST /embed`` itself: the same route function FastAPI calls, with
the same arguments (the request model validated as FastAPI validates a JSON body, the request,
the served engines), and an error answered by the same :func:`errors.respond` as FastAPI's
handlers. Whatever it does not take -- another route or method, a body without a
Content-Length, another content type, a body that does not parse as JSON or does not validate --
goes to FastAPI unchanged, the body replayed, so every error shape (422 of validation, 413 of a
chunked body over the limit, 400 of an unreadable body) stays FastAPI's own.

It sits inside the app's own middleware (metrics, API key, body limit, the catch-all), so every
limit and count applies to it as before; it sets the request's route for the metrics' label.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from embedpool.app.server.deps import get_engine, get_engines
from embedpool.app.server.errors import respond

#: the third parameter a route function served directly may take (after ``body`` and
#: ``request``), and the dependency FastAPI resolves it with
STATE = {"engines": get_engines, "engine": get_engine}


@dataclass(frozen=True)
class _Route:
    route: Any  # the APIRoute (the metrics label requests by its template)
    handler: Callable[[Any, Request, Any], Awaitable[Any]]
    model: type[BaseModel]
    state: Callable[[Request], Awaitable[Any]]

    @classmethod
    def of(cls, route: Any) -> "_Route":
        f = route.endpoint
        names = list(inspect.signature(f).parameters)
        if len(names) != 3 or names[:2] != ["body", "request"] or names[2] not in STATE:
            raise TypeError(f"{route.path}: a route served directly takes (body, request, engines or engine)")
        return cls(route, f, typing.get_type_hints(f)["body"], STATE[names[2]])


def _is_json(content_type: bytes) -> bool:
    """``application/json`` (any parameters, e.g. a charset): the type FastAPI parses as JSON.
    Other JSON types (``+json``) go to FastAPI."""
    return content_type.split(b";", 1)[0].strip().lower() == b"application/json"


class DirectRoutes:
    """ASGI middleware: ``routes`` (FastAPI's routes of POST endpoints ``f(body, request,
    engines)`` or ``f(body, request, engine)``) answered directly for a POST to the route's own
    path with a JSON body that validates; anything else passes to ``app``."""

    def __init__(self, app: ASGIApp, routes: list[Any]) -> None:
        self.app = app
        self.routes = {r.path: _Route.of(r) for r in routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if route is None or scope.get("method") != "POST" or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        length = json = False
        for k, v in scope["headers"]:
            if k == b"content-length":
                length = True
            elif k == b"content-type":
                json = _is_json(v)
        if not (length and json):
            await self.app(scope, receive, send)
            return
        # the body (its Content-Length is within the limit: the body-limit middleware checked it)
        messages: list[Message] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        replay = _replay(messages, receive)
        if message["type"] != "http.request":  # the client left mid-body: as FastAPI answers it
            await self.app(scope, replay, send)
            return
        body = b"".join(m.get("body", b"") for m in messages)
        try:
            data = route.model.model_validate(orjson.loads(body))
        except (orjson.JSONDecodeError, ValidationError):  # FastAPI's 422, in its words
            await self.app(scope, replay, send)
            return
        scope["route"] = route.route
        scope.setdefault("path_params", {})
        request = Request(scope, receive)  # the body is read: receive() now waits for a disconnect
        try:
            state = await route.state(request)
            response = await route.handler(data, request, state)
        except Exception as exc:  # noqa: BLE001 - answered as FastAPI's handlers answer it
            response = respond(scope, exc)
        await response(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that answers ``messages`` first, then the client's own."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
