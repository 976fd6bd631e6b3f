"""How the HTTP service reports errors: every exception becomes one response, in one place.

The status and the ``type`` string come from the kind of the error, through the one table of
:mod:`embedpool.errors` (``TABLE``); this module adds nothing to it but what only HTTP has: an
unknown route (404), a known route with the wrong method (405), a client that closed the
connection before its answer was ready (499), and FastAPI's own request validation (422).

Every error response has the body ``{"error": message, "type": type}``, with ``"param"``: the
request field at fault, where the error names one (the ``param`` it was raised with); routes under ``/v1/``
(the OpenAI-compatible API) answer OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}`` instead, with the same status code. Routes under ``/tei`` (the TEI-compatible surface,
:mod:`app.server.routers.tei`) answer TEI's ``{"error": message, "error_type": type}`` (and, on
its OpenAI route ``/tei/v1/embeddings``, TEI's ``{"message", "code", "type"}``) with TEI's type
names and status codes (:data:`TEI_TYPES`, :func:`render`).

=========  ===================  ==========================================================
status     type                 when
=========  ===================  ==========================================================
401        unauthorized         an API key is set and the request lacks ``Bearer <key>``
404        not_found            unknown collection, document or route
405        method_not_allowed   known route, wrong method
409        conflict             collection exists with other settings; locked by a writer
413        payload_too_large    body over ``max_payload_bytes``; more than
                                ``max_client_batch`` inputs; an input over ``max_input_chars``;
                                more than ``max_request_tokens`` tokens after windowing or
                                ``max_request_vectors`` vectors in one request
422        validation_error     a field is missing, of the wrong type or out of range
429        overloaded           the queue is full (``Retry-After`` says when to retry)
503        not_ready            the model is still loading (or failed to load); the storage
                                backend is down; the server stopped before the request finished
500        internal_error       a bug: logged with its traceback
=========  ===================  ==========================================================

An unexpected exception is answered here too (:class:`CatchAll`), not left to the server: an
exception that escapes the app makes uvicorn close the connection after the 500, and the
client's next request on that keep-alive connection fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from embedpool.app.server import schemas
from embedpool.errors import TABLE, EmbedpoolError, Kind, UnavailableError, kind_of

log = logging.getLogger("embedpool.server")


@dataclass(frozen=True)
class Reply:
    """One error as the HTTP layer answers it: the kind's status and type from ``TABLE``, or, for
    the few answers only HTTP has, the status and type of its :attr:`code` in :data:`HTTP_ONLY`."""

    kind: Kind
    message: str
    param: str | None = None
    retry_after: int | None = None
    code: str | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def status(self) -> int:
        return HTTP_ONLY[self.code][0] if self.code in HTTP_ONLY else TABLE[self.kind].status

    @property
    def type(self) -> str:
        return self.code if self.code in HTTP_ONLY else TABLE[self.kind].type


#: The answers whose status is not their kind's, by the error's ``code``: (status, TEI's type).
#: Everything else follows ``TABLE``.
HTTP_ONLY: dict[str, tuple[int, str]] = {
    # a known route asked with the wrong method
    "method_not_allowed": (405, "MethodNotAllowed"),
    # the client went away before its answer was ready (nginx's 499; nobody reads it)
    "client_closed": (499, "ClientClosed"),
    # the TEI surface: an empty list of inputs (TEI's 400 ``Empty``; embedpool's own routes
    # refuse it in validation, a 422)
    "empty": (400, "Empty"),
}

_KIND_OF_STATUS = {o.status: k for k, o in TABLE.items()}

INTERNAL_MESSAGE = "internal server error (a bug); the server log has the details"


# ---------------------------------------------------------------------- mapping
def from_exception(exc: BaseException) -> Reply:
    """The answer to any exception (the whole mapping in one function)."""
    if isinstance(exc, Reply):
        return exc
    if isinstance(exc, RequestValidationError):
        message, param = _describe_validation(exc.errors())
        return Reply(Kind.INVALID, message, param)
    if isinstance(exc, StarletteHTTPException):  # raised by Starlette/FastAPI themselves
        return _from_http(exc)
    if isinstance(exc, EmbedpoolError):
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else {}
        return Reply(exc.kind, exc.message, exc.param, exc.retry_after, exc.code, headers)
    kind = kind_of(exc)
    return Reply(kind, INTERNAL_MESSAGE if kind is Kind.INTERNAL else f"{exc}")


def _from_http(exc: StarletteHTTPException) -> Reply:
    if isinstance(exc.__cause__, EmbedpoolError):  # ours, raised while FastAPI read the body
        return from_exception(exc.__cause__)
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        return Reply(Kind.NOT_FOUND, "no such route; see /docs for the API", headers=headers)
    if exc.status_code == 405:
        return Reply(Kind.INVALID, f"method not allowed on this route; see /docs ({detail})",
                     code="method_not_allowed", headers=headers)
    if exc.status_code == 400:  # FastAPI: body that is not decodable
        return Reply(Kind.INVALID, "the request body could not be parsed: send UTF-8 JSON "
                     "with 'Content-Type: application/json'", "body")
    return Reply(_KIND_OF_STATUS.get(exc.status_code, Kind.INTERNAL), detail, headers=headers)


_LOCATIONS = ("body", "query", "path", "header", "cookie")  # FastAPI's first element of a loc
# pydantic names union members ("str", "list[str]", a model's class name); they do not help the client
_UNION_TAGS = ("str", "int", "bool", "float", "list", "dict")
_UNION_PREFIXES = ("list[", "function-", "tagged-union", "json-or-python")
_MODELS = frozenset(name for name, obj in vars(schemas).items()
                    if isinstance(obj, type) and issubclass(obj, BaseModel))


def _loc(loc: tuple | list) -> str:
    """``inputs[1]``, ``documents[0].text``, ``body[0].id`` (a body that is a list)."""
    items = list(loc)[1:] if loc and loc[0] in _LOCATIONS else list(loc)
    out = ""
    for p in items:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not (p in _UNION_TAGS or p in _MODELS or str(p).startswith(_UNION_PREFIXES)):
            out += f".{p}" if out else str(p)
    if out.startswith("["):  # an item of a body that is a list
        out = "body" + out
    return out or "body"


def _describe_validation(errors: list[dict[str, Any]]) -> tuple[str, str]:
    """One readable sentence per failing field: where, what is wrong, what to send instead.

    The members of a union (``str | list[str]``) each report an error; they are merged into one
    sentence per field, and a field whose list items have errors reports those items only. When
    a value had the right shape but was refused (our validators, a string that is not valid
    Unicode), the other union members' type mismatches ("Input should be a valid list") do not
    apply and are left out."""
    if any(e.get("type") in ("value_error", "string_unicode") for e in errors):
        errors = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    by_field: dict[str, list[str]] = {}
    for e in errors:
        kind = e.get("type", "")
        field = _loc(e.get("loc", ()))
        if kind == "json_invalid":
            err = (e.get("ctx") or {}).get("error", "invalid JSON")
            pos = e.get("loc", ("body", "?"))[-1]
            field, msg = "body", f"not valid JSON ({err} at position {pos}); send a JSON object"
        elif kind == "missing":
            msg = "field required"
        elif kind == "extra_forbidden":
            msg = "unknown field; remove it (see /docs for the fields of this route)"
        elif kind == "value_error":  # our own validators: the message says it all
            msg = str(e.get("msg", "")).removeprefix("Value error, ")
        elif kind == "string_unicode":  # pydantic's own check, for strings with constraints
            msg = "not valid Unicode (a lone surrogate such as \\ud800); send UTF-8 text"
        else:
            msg = str(e.get("msg", "invalid value"))
            got = e.get("input")
            if not isinstance(got, (dict, list)):
                shown = repr(got)
                msg += f" (got {shown[:57] + '...' if len(shown) > 60 else shown})"
        msgs = by_field.setdefault(field, [])
        if msg not in msgs:
            msgs.append(msg)
    fields = [f for f in by_field
              if not any(o != f and (o.startswith(f + "[") or o.startswith(f + ".")) for o in by_field)]
    parts = []
    for f in fields:
        msgs = by_field[f]
        if len(msgs) > 1 and all(m.startswith("Input should be") for m in msgs):
            msgs = [msgs[0].split(" (got")[0] + " or " + " or ".join(
                m.removeprefix("Input should be ").split(" (got")[0] for m in msgs[1:])
                + (" (got" + msgs[0].split(" (got", 1)[1] if " (got" in msgs[0] else "")]
        parts.append(f"{f}: {'; '.join(msgs)}")
    if len(parts) > 5:
        parts = parts[:5] + [f"and {len(parts) - 5} more"]
    return "; ".join(parts) or "invalid request", (fields[0] if fields else "body")


# ---------------------------------------------------------------------- rendering
#: OpenAI's error ``type`` of each kind (its ``code`` is our type string).
OPENAI_TYPES: dict[Kind, str] = {
    Kind.INVALID: "invalid_request_error",
    Kind.TOO_LARGE: "invalid_request_error",
    Kind.NOT_FOUND: "invalid_request_error",
    Kind.CONFLICT: "invalid_request_error",
    Kind.UNAUTHORIZED: "authentication_error",
    Kind.OVERLOADED: "rate_limit_error",
    Kind.UNAVAILABLE: "server_error",
    Kind.INTERNAL: "server_error",
}


#: Where the TEI-compatible surface is mounted (:mod:`app.server.routers.tei`).
TEI_PREFIX = "/tei"
#: Each served model's own TEI surface: ``/models/NAME/tei/...`` (a TEI client's base URL per model)
MODELS_PREFIX = "/models"

#: TEI's status and ``error_type`` of each kind on the TEI surface. TEI's own six types
#: (``router/src/lib.rs``: Unhealthy 503, Backend 424, Overloaded 429, Validation 422,
#: Tokenizer 422, Empty 400; TEI documents 413 ``Validation`` for a batch over its size) cover
#: invalid, too large, overloaded and unavailable; an internal error is TEI's ``Backend``, 424,
#: as TEI answers a failed inference. TEI has no type for the rest (it answers a wrong key with
#: a bare 401, an unknown route with a bare 404): they keep their status and get a type in
#: TEI's spelling.
TEI_TYPES: dict[Kind, tuple[int, str]] = {
    Kind.INVALID: (422, "Validation"),
    Kind.TOO_LARGE: (413, "Validation"),
    Kind.UNAUTHORIZED: (401, "Unauthorized"),
    Kind.NOT_FOUND: (404, "NotFound"),
    Kind.CONFLICT: (409, "Conflict"),
    Kind.OVERLOADED: (429, "Overloaded"),
    Kind.UNAVAILABLE: (503, "Unhealthy"),
    Kind.INTERNAL: (424, "Backend"),
}


def tei(err: Reply) -> tuple[int, str]:
    """TEI's status and ``error_type`` for ``err``."""
    return HTTP_ONLY[err.code] if err.code in HTTP_ONLY else TEI_TYPES[err.kind]


def _surface(path: str) -> str:
    if path.startswith(MODELS_PREFIX + "/"):  # /models/NAME/tei/...: that model's TEI surface
        rest = path.split("/", 3)
        path = "/" + rest[3] if len(rest) > 3 else path
    if path == TEI_PREFIX or path.startswith(TEI_PREFIX + "/"):
        rest = path[len(TEI_PREFIX):]
        return "tei-openai" if rest.startswith("/v1/") or rest == "/embeddings" else "tei"
    return "openai" if path.startswith("/v1/") else "embedpool"


def render(path: str, exc: BaseException | Reply) -> JSONResponse:
    """The response for ``exc`` on ``path``: OpenAI's shape under ``/v1/``, TEI's under ``/tei``."""
    err = from_exception(exc)
    headers = dict(err.headers)
    status = err.status
    if status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    surface = _surface(path)
    if surface == "openai":
        body: dict[str, Any] = {"error": {"message": err.message, "type": OPENAI_TYPES[err.kind],
                                          "param": err.param, "code": err.type}}
    elif surface == "tei":
        status, kind = tei(err)
        body = {"error": err.message, "error_type": kind}
    elif surface == "tei-openai":
        status, kind = tei(err)
        body = {"message": err.message, "code": status, "type": kind}
    else:
        body = {"error": err.message, "type": err.type, **({"param": err.param} if err.param else {})}
    return JSONResponse(body, status_code=status, headers=headers)


def _log(method: str, path: str, exc: BaseException, err: Reply) -> None:
    if err.status < 500:
        return
    if isinstance(exc, EmbedpoolError) and exc.kind is not Kind.INTERNAL:
        log.warning("%s %s: %s", method, path, exc)  # e.g. the storage backend is down
    else:
        log.error("unhandled error on %s %s", method, path, exc_info=exc)


def respond(scope: Scope, exc: BaseException) -> JSONResponse:
    """The answer to ``exc`` raised while serving ``scope`` (logged when it is a 5xx): what every
    handler below answers, and :class:`app.server.direct.DirectRoutes`."""
    err = from_exception(exc)
    _log(scope.get("method", ""), scope.get("path", ""), exc, err)
    return render(scope.get("path", ""), err)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    return respond(request.scope, exc)


STOPPED = ("the server stopped before this request finished: it was shutting down and lets requests in flight "
           "finish for EMBEDPOOL_SHUTDOWN_TIMEOUT seconds (serve --shutdown-timeout); send it again")


class CatchAll:
    """Answers an exception that no handler took (a bug) with the 500 of :func:`render`.

    Starlette's own last-resort handler re-raises the exception after answering, and uvicorn
    then closes the connection; answering here keeps the client's keep-alive connection usable.
    An exception after the response has started cannot be answered and is re-raised.

    A request still running when a stopping server's ``shutdown_timeout`` ends is cancelled by
    uvicorn, which would answer a bare text 500; it gets the JSON 503 of :data:`STOPPED` instead
    (a client or load balancer sends a 503 again, elsewhere)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            if started:
                raise
            await respond(scope, exc)(scope, receive, send)
        except asyncio.CancelledError:
            if not started:
                await respond(scope, UnavailableError(STOPPED))(scope, receive, send)
            raise


def install(app: FastAPI) -> None:
    """Register the handlers that turn every exception into a response of the table above.

    Call it before adding other middleware: :class:`CatchAll` then sits inside them, so the
    metrics middleware counts the 500 it answers."""
    for cls in (RequestValidationError, StarletteHTTPException, EmbedpoolError):
        app.add_exception_handler(cls, _handle)
    app.add_middleware(CatchAll)
    # A bug in a middleware outside CatchAll still gets a JSON 500 (from Starlette's last resort).
    app.add_exception_handler(Exception, _handle)
