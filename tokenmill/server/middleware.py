"""Pure ASGI middleware (it does not get in the way of streaming or disconnect detection):
draining, API key and request-size checks, before any route runs."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any, Callable

from tokenmill.server.errors import APIError

_OPEN_PATHS = ("/health", "/metrics", "/version")   # monitoring stays reachable without a key


@dataclass
class GateOptions:
    api_key: str | None
    max_request_bytes: int
    is_draining: Callable[[], bool]


class GateMiddleware:
    def __init__(self, app: Any, options: GateOptions) -> None:
        self.app, self.options = app, options

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._check(scope)
            receive = await self._buffer_body(scope, receive)
        except APIError as exc:
            return await exc.response()(scope, receive, send)
        await self.app(scope, receive, send)

    def _check(self, scope: dict) -> None:
        if self.options.is_draining():
            raise APIError(503, "the server is shutting down")
        if self.options.api_key is None or scope["path"] in _OPEN_PATHS:
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        expected = f"Bearer {self.options.api_key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer ...')",
                           code="invalid_api_key")

    async def _buffer_body(self, scope: dict, receive: Callable) -> Callable:
        """Read the whole body up to the limit (Content-Length may be absent or lie), then
        replay it; later receive() calls go to the client (disconnect detection)."""
        limit = self.options.max_request_bytes
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return _replay([message], receive)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise _too_large(limit)
            more = message.get("more_body", False)
        return _replay([{"type": "http.request", "body": b"".join(chunks),
                         "more_body": False}], receive)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit} bytes")


def _replay(messages: list[dict], receive: Callable) -> Callable:
    async def replay() -> dict:
        return messages.pop(0) if messages else await receive()
    return replay
