"""The outermost middleware: every response counted by status, and no exception left loose.

An exception that escapes a route is answered here with an OpenAI-shaped 500 and logged in one
line (with its traceback only when asked: `edge0 --debug serve`). Starlette's own last-resort
handler would re-raise it, and uvicorn then drops the keep-alive connection under the client's
next request. A stream that fails after its headers went out ends with an error event and
`data: [DONE]`.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edge0.server.errors import APIError, error_body

log = logging.getLogger(__name__)


class Failsafe:
    """See the module docstring; `count(path, status)` is called once per response."""

    def __init__(self, app: ASGIApp, count: Callable[[str, int], None], tracebacks: bool = False):
        self.app = app
        self.count = count
        self.tracebacks = tracebacks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None
        streaming = finished = False

        async def watch(message: Message) -> None:
            nonlocal status, streaming, finished
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = dict(message.get("headers", []))
                streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:  # the last resort; APIError and validation never get here
            _log_failure(scope, exc, self.tracebacks)
            if status is None:
                error = APIError(500, f"internal error ({type(exc).__name__})", type="server_error")
                await error.response()(scope, receive, watch)
            elif streaming and not finished:
                body = error_body(f"internal error ({type(exc).__name__})", "server_error")
                tail = f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            else:  # a plain body cut halfway: only closing the connection says so
                raise
        finally:
            if status is not None:
                self.count(scope["path"], status)


def _log_failure(scope: Scope, exc: BaseException, with_traceback: bool) -> None:
    """One line per failure: a RecursionError's traceback alone runs to thousands of lines."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    log.error(
        "%s %s failed: %s: %.200s%s",
        scope.get("method"),
        scope["path"],
        type(exc).__name__,
        exc,
        where,
        exc_info=exc if with_traceback else None,
    )
