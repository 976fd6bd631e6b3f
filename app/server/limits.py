"""Request-size limits: the body limit (``max_payload_bytes``) as ASGI middleware, checked
before the body is parsed, and the per-request input limits (``max_client_batch``,
``max_input_chars``) used by the routes. All answer 413."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from embedpool.app.server.errors import PayloadTooLarge, render
from embedpool.app.settings import Settings


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = int(max_bytes)

    def _error(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body is over the limit of {self.max_bytes} bytes "
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
        raise PayloadTooLarge(
            f"{field}: {len(texts)} inputs, over the limit of {settings.max_client_batch} per request "
            "(max_client_batch); split them over several requests", param=field)
    for i, t in enumerate(texts):
        if len(t) > settings.max_input_chars:
            raise PayloadTooLarge(
                f"{field}[{i}]: {len(t)} characters, over the limit of {settings.max_input_chars} "
                "(max_input_chars); shorten or split it", param=field)
