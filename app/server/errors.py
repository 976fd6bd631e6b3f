"""The one error taxonomy of the HTTP service, and the one place that maps errors to responses.

Every error response has the body ``{"error": message, "type": kind}``; routes under ``/v1/``
(the OpenAI-compatible API) answer OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}`` instead, with the same status code.

=========  ===================  ==========================================================
status     type                 when
=========  ===================  ==========================================================
401        unauthorized         an API key is set and the request lacks ``Bearer <key>``
404        not_found            unknown collection, document or route
405        method_not_allowed   known route, wrong method
409        conflict             collection exists with other settings; locked by a writer
413        payload_too_large    body over ``max_payload_bytes``; more than
                                ``max_client_batch`` inputs; an input over ``max_input_chars``
422        validation_error     a field is missing, of the wrong type or out of range
429        overloaded           the queue is full (``Retry-After`` says when to retry)
503        not_ready            the model is still loading (or failed to load)
500        internal_error       a bug: logged with its traceback
=========  ===================  ==========================================================
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from embedpool import index
from embedpool.app.batcher import Overloaded, Stopped

log = logging.getLogger("embedpool.server")


class APIError(StarletteHTTPException):
    """An error with a status, a kind and a message meant for the client.

    (A Starlette ``HTTPException`` so that FastAPI re-raises it unchanged when it is raised
    while the request body is read.)"""

    status = 500
    kind = "internal_error"

    def __init__(self, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(self.status, message, headers)
        self.message = message
        self.param = param


class Unauthorized(APIError):
    status, kind = 401, "unauthorized"


class NotFound(APIError):
    status, kind = 404, "not_found"


class MethodNotAllowed(APIError):
    status, kind = 405, "method_not_allowed"


class Conflict(APIError):
    status, kind = 409, "conflict"


class PayloadTooLarge(APIError):
    status, kind = 413, "payload_too_large"


class Invalid(APIError):
    status, kind = 422, "validation_error"


class TooManyRequests(APIError):
    status, kind = 429, "overloaded"


class NotReady(APIError):
    status, kind = 503, "not_ready"


class ClientClosed(APIError):
    """The client went away before its answer was ready (nginx's 499; nobody reads it)."""

    status, kind = 499, "client_closed"


class Internal(APIError):
    status, kind = 500, "internal_error"


# ---------------------------------------------------------------------- mapping
def from_exception(exc: BaseException) -> APIError:
    """Map any exception to an :class:`APIError` (the whole taxonomy in one function)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        message, field = _describe_validation(exc.errors())
        return Invalid(message, param=field)
    if isinstance(exc, StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            return NotFound("no such route; see /docs for the API", headers=exc.headers)
        if exc.status_code == 405:
            return MethodNotAllowed(f"method not allowed on this route; see /docs ({detail})",
                                    headers=exc.headers)
        if exc.status_code == 413:
            return PayloadTooLarge(detail)
        if exc.status_code == 400:  # FastAPI: body that is not decodable
            return Invalid("the request body could not be parsed: send UTF-8 JSON "
                           "with 'Content-Type: application/json'", param="body")
        cls = {401: Unauthorized, 409: Conflict, 422: Invalid, 429: TooManyRequests,
               503: NotReady}.get(exc.status_code, Internal)
        return cls(detail, headers=exc.headers)
    if isinstance(exc, Overloaded):
        return TooManyRequests(str(exc), headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, Stopped):
        return NotReady(str(exc), headers={"Retry-After": "5"})
    # index errors (all ValueErrors): order matters, most specific first
    if isinstance(exc, index.NotFoundError):
        return NotFound(str(exc))
    if isinstance(exc, (index.SpecMismatchError, index.CollectionLockedError,
                        index.NotACollectionError, index.FormatVersionError)):
        return Conflict(str(exc))
    if isinstance(exc, index.CorruptCollectionError):
        return Internal(str(exc))
    if isinstance(exc, ValueError):  # pooler specs, dimensions, index input ... (a TypeError is a bug)
        return Invalid(str(exc))
    return Internal("internal server error; the server log has the details")


def _loc(loc: tuple | list) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    # pydantic names union members ("str", "list[str]"); they do not help the client
    parts = [p for p in parts if not (p in ("str", "int", "bool", "float", "list", "dict")
                                      or p.startswith(("list[", "function-", "tagged-union", "json-or-python")))]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    if out.startswith("["):  # an item of a body that is a list
        out = "body" + out
    return out or "body"


def _describe_validation(errors: list[dict[str, Any]]) -> tuple[str, str]:
    """One readable sentence per failing field: where, what is wrong, what to send instead.

    The members of a union (``str | list[str]``) each report an error; they are merged into one
    sentence per field, and a field whose list items have errors reports those items only."""
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
_OPENAI_TYPES = {
    "validation_error": "invalid_request_error",
    "payload_too_large": "invalid_request_error",
    "not_found": "invalid_request_error",
    "method_not_allowed": "invalid_request_error",
    "conflict": "invalid_request_error",
    "unauthorized": "authentication_error",
    "overloaded": "rate_limit_error",
    "not_ready": "server_error",
    "internal_error": "server_error",
}


def render(path: str, err: APIError) -> JSONResponse:
    """The response for ``err`` on ``path`` (OpenAI shape under ``/v1/``)."""
    headers = dict(err.headers or {})
    if err.status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    if path.startswith("/v1/"):
        body: dict[str, Any] = {"error": {"message": err.message, "type": _OPENAI_TYPES.get(err.kind, err.kind),
                                          "param": err.param, "code": err.kind}}
    else:
        body = {"error": err.message, "type": err.kind}
    return JSONResponse(body, status_code=err.status, headers=headers)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every exception into the taxonomy above."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        err = from_exception(exc)
        if err.status >= 500 and not isinstance(exc, APIError):
            log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return render(request.url.path, err)

    # Expected errors are handled inside the app; ``Exception`` (a bug) by the outermost
    # middleware, which also logs it.
    for cls in (RequestValidationError, StarletteHTTPException, ValueError,
                Overloaded, Stopped, Exception):
        app.add_exception_handler(cls, handle)
