"""ASGI middleware run before any route: the API key check, and the request body's size limit
and read deadline.

All answer before the body is parsed, so a stranger's or an oversized request costs nothing.
The limit is enforced on the bytes received, not only on Content-Length, so a chunked upload
cannot get around it; a body not in within `body_timeout_s` of the request head gets 408
(server/http.py keeps the head's and the idle connection's timeouts).
"""

from __future__ import annotations

import asyncio
import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edge0.server.errors import APIError


class Guard:
    """Checks `Authorization: Bearer KEY` on /v1 routes and caps request bodies at max_bytes."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, max_bytes: int, body_timeout_s: float | None
    ):
        self.app = app
        self.api_key = api_key
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.api_key is not None and scope["path"].startswith("/v1"):
            if not self._authorized(headers):
                await _reject(scope, receive, send, _unauthorized())
                return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _reject(scope, receive, send, self._too_large())
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body, rest = await self._read_body(receive)
        except TimeoutError:
            await _reject(scope, receive, send, self._too_slow())
            return
        if body is None:
            await _reject(scope, receive, send, self._too_large())
            return
        replayed = False

        async def replay() -> Message:
            # the whole body once, then the real channel (a disconnect is still seen)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if rest is not None:  # the client left while sending the body
            await self.app(scope, lambda: _once(rest), send)
            return
        await self.app(scope, replay, send)

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = headers.get("x-api-key", "")
        assert self.api_key is not None
        return hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than the limit of {self.max_bytes} bytes "
            "(edge0 serve --max-body)",
            code="request_too_large",
        )

    def _too_slow(self) -> APIError:
        return APIError(
            408,
            f"the request body was not received within {self.body_timeout_s:g} s of its head",
            code="request_timeout",
            headers={"Connection": "close"},  # the rest of the body must not be read as a request
        )

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, Message | None]:
        """(body, None); (None, None) past the limit; (b"", message) on an early disconnect."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"", message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None, None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


async def _once(message: Message) -> Message:
    return message


def _unauthorized() -> APIError:
    return APIError(
        401,
        "missing or wrong API key: send it as 'Authorization: Bearer KEY'",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


async def _reject(scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
    await error.response()(scope, receive, send)
