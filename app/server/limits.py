"""Request-size limits: the body limit (``max_payload_bytes``) as ASGI middleware, checked
before the body is parsed; the per-request input limits (``max_client_batch``,
``max_input_chars``) used by the routes; and the work limits (``max_request_tokens``,
``max_request_vectors``) that :func:`check_workload` checks on the tokenized request before
anything is queued or encoded. All answer 413.

The input limits alone do not bound a request's cost: 512 inputs of 100,000 characters are
~12M tokens once every window is encoded. The work limits count what the request will really
run -- the tokens of every window of every tokenization plan its poolers need -- and return,
so that one request's memory and time are bounded whatever its poolers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from embedpool.app.server.errors import render
from embedpool.app.settings import Settings
from embedpool.errors import InvalidError, TooLargeError

if TYPE_CHECKING:
    from embedpool.app.server.engine import EmbedPart
    from embedpool.poolers import Workload


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = int(max_bytes)

    def _error(self) -> TooLargeError:
        return TooLargeError(f"request body is over the limit of {self.max_bytes} bytes "
                             "(max_payload_bytes); send fewer or shorter inputs per request")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    too_big = int(v) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await render(scope["path"], self._error())(scope, receive, send)
                    return
                break
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # chunked body without a Content-Length
                    raise self._error()
            return message

        await self.app(scope, limited_receive, send)


def check_inputs(texts: Sequence[str], settings: Settings, field: str = "inputs") -> None:
    """413 for too many inputs or an input that is too long."""
    if len(texts) > settings.max_client_batch:
        raise TooLargeError(
            f"{field}: {len(texts)} inputs, over the limit of {settings.max_client_batch} per request "
            "(max_client_batch); split them over several requests", param=field)
    for i, t in enumerate(texts):
        if len(t) > settings.max_input_chars:
            raise TooLargeError(
                f"{field}[{i}]: {len(t)} characters, over the limit of {settings.max_input_chars} "
                "(max_input_chars); shorten or split it", param=field)


def check_workload(embedder: Any, parts: Sequence[EmbedPart], settings: Settings, *,
                   field: str = "inputs") -> list[Workload]:
    """Raise :class:`TooLargeError` (kind ``too_large``: 413) if one request's embeddings --
    ``parts``, as :meth:`Engine.embed_many` takes them -- would run more than
    ``max_request_tokens`` tokens through the encoder (after windowing: all windows of all
    plans) or return more than ``max_request_vectors`` vectors, all parts together. Tokenizes
    (with each part's own options), never encodes; every route that embeds calls it before
    queueing, through ``Engine.embed_many``.

    Returns each part's :class:`poolers.Workload`: its per-text token counts (the batcher
    schedules by them), usage counts, and the tokenization itself, which the worker encodes
    without tokenizing again. A text the engine would refuse (too long with
    ``truncate=false``) raises here, named by the request field it came from."""
    works = []
    for part in parts:
        try:
            works.append(embedder.measure(part.texts, part.specs, part.options))
        except InvalidError as exc:
            raise _named(embedder, part, exc, field) from None
    check_tokens(sum(sum(w.tokens) for w in works), settings, field, "through the encoder (all windows "
                 "of every pooler's tokenization plan)")
    vectors = sum(w.vectors for w in works)
    if vectors > settings.max_request_vectors:
        raise TooLargeError(
            f"{field}: this request would return {vectors} vectors, over the limit of "
            f"{settings.max_request_vectors} per request (max_request_vectors); send fewer or "
            "shorter inputs per request, or use a pooler with fewer vectors (e.g. a larger "
            "cluster pool_factor)", param=field)
    return works


def within_limits(embedder: Any, parts: Sequence[EmbedPart], settings: Settings) -> bool:
    """Whether the work limits hold for ``parts`` whatever their texts tokenize to
    (:meth:`poolers.Embedder.work_bound`: single-vector poolers on truncated inputs, each text
    at most one window): then :func:`check_workload` has nothing to find, and the request can be
    queued unmeasured (the batcher's worker tokenizes it once, with the rest of its round)."""
    tokens = vectors = 0
    for part in parts:
        bound = embedder.work_bound(len(part.texts), part.specs, part.options)
        if bound is None:
            return False
        tokens, vectors = tokens + bound[0], vectors + bound[1]
    return tokens <= settings.max_request_tokens and vectors <= settings.max_request_vectors


def _named(embedder: Any, part: EmbedPart, exc: InvalidError, field: str) -> InvalidError:
    """``exc`` of the engine about the call's text ``i`` (``param`` ``texts[i]``: an input over the
    model's window) as the request's field names it: ``field[i]`` with the engine's message, or
    the part's own name for it with its length and the window (counted again: this path only)."""
    param = exc.param or ""
    if not (param.startswith("texts[") and param.endswith("]")):
        return exc
    i = int(param[len("texts["):-1])
    if part.names is None:
        return InvalidError(f"{field}[{i}]: {exc}", param=field)
    name, opts, encoder = part.names[i], part.options, embedder.encoder
    n = encoder.lengths([part.texts[i]], role=opts.role, prompt_name=opts.prompt_name)[0]
    return InvalidError(f"{name}: {n} tokens, over the model's window of {encoder.window_for(opts.role)} tokens; "
                        "shorten it, or send truncate=true to cut it (truncation_direction picks the end)",
                        param=name.split("[")[0])


def check_tokens(tokens: int, settings: Settings, field: str = "inputs", what: str = "") -> None:
    """413 if a request needs more than ``max_request_tokens`` tokens (``what``: where they go)."""
    if tokens > settings.max_request_tokens:
        raise TooLargeError(
            f"{field}: this request needs {tokens} tokens{' ' + what if what else ''}, over the limit "
            f"of {settings.max_request_tokens} per request (max_request_tokens); send fewer or "
            "shorter inputs per request", param=field)
