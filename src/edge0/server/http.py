"""uvicorn's HTTP/1.1 protocol (httptools) with read timeouts, and HTTP/1.0 streams unframed.

uvicorn times out only a keep-alive connection that has finished a response. A connection
that never sends a byte, or sends half a request head, is held for as long as the client
likes: a few hundred such sockets hold as many file descriptors and tasks. So:

- an idle connection (a new one, or one between requests) is closed after `keep_alive_s`;
- a request's head (request line and headers) must be in within `header_s` of its first
  byte, else the client gets 408 and the connection is closed;
- its body must be in within `body_s` of the head; that deadline is kept by the body guard
  (middleware.Guard), which answers 408 in the API's error shape.

HTTP/1.0 has no chunked transfer coding, and uvicorn's httptools protocol sends a body of
unknown length (an event stream) chunked to every client. For an HTTP/1.0 request such a body
is sent as it is, and the end of the connection ends it, as RFC 9112 section 6.3 says.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from edge0.util import limits

_HEAD_TIMEOUT_TEXT = b"the request head was not sent in time"
_HEAD_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s"
    % (len(_HEAD_TIMEOUT_TEXT), _HEAD_TIMEOUT_TEXT)
)


# a timeout that never fires (the flags' 0): a year
NO_TIMEOUT = 365 * 24 * 3600.0


@dataclass(frozen=True)
class Timeouts:
    header_s: float = limits.HEADER_TIMEOUT_S
    body_s: float = limits.BODY_TIMEOUT_S
    keep_alive_s: float = limits.KEEP_ALIVE_S


def protocol(timeouts: Timeouts) -> type[HttpToolsProtocol]:
    """The protocol class uvicorn.Config(http=...) takes, keeping `timeouts`."""
    return type("TimedHttpProtocol", (TimedHttpProtocol,), {"timeouts": timeouts})


class TimedHttpProtocol(HttpToolsProtocol):
    """See the module docstring; `timeouts` is set by protocol()."""

    timeouts = Timeouts()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.timeouts.keep_alive_s
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # idle until its first byte, as a kept-alive connection is between requests
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeouts.keep_alive_s, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.timeouts.header_s, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and self.scope.get("http_version") == "1.0":
            cycle.send = _unframed_if_unknown_length(cycle)  # type: ignore[method-assign]

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a response is going out on this connection: it is not idle
        self.transport.write(_HEAD_TIMEOUT)
        self.transport.close()


def _unframed_if_unknown_length(cycle: RequestResponseCycle):
    """cycle.send for an HTTP/1.0 request: a response without Content-Length is written
    without chunked coding; the connection's close (HTTP/1.0 does not keep it) ends it."""
    send = cycle.send
    unframed = False

    async def send_unframed(message) -> None:
        nonlocal unframed
        if message["type"] == "http.response.start":
            names = {name.lower() for name, _ in message.get("headers", [])}
            if b"content-length" not in names and b"transfer-encoding" not in names:
                unframed = True
                cycle.chunked_encoding = False  # uvicorn then adds no Transfer-Encoding
        elif message["type"] == "http.response.body" and unframed:
            # uvicorn checks each body against the length it expects: expect this one
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)

    return send_unframed
