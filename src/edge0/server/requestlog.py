"""One log line per HTTP request, and the X-Request-Id that ties it to the client's side.

The outermost middleware gives each request an id (the client's `X-Request-Id` when it sent a
usable one, else a new one), echoes it in the response's headers, and logs one line when the
response has ended, however it ended:

    2026-12-06 14:30:01,234 INFO edge0.request: 4f1c…e2 POST /v1/chat/completions 200 0.91s
        stop prompt=25 completion=64 ttft=0.112s 81.3 tok/s queue=0.001s

A 4xx or 5xx line ends with the error's message, read from the OpenAI-shaped body; a stream
that ends in an error event (a failed generation, a shutdown) says so in the same way. The
generation's numbers come from the request handler, through the RequestRecord that the
middleware leaves in a context variable (`current()`). With `--log-format json` the same
line is one JSON object with these fields (JsonFormatter).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid
from dataclasses import asdict, dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("edge0.request")

HEADER = "x-request-id"
# an id a client sent is kept when it is short printable ASCII (it goes into logs and headers)
_USABLE_ID = re.compile(r"[\x21-\x7e]{1,128}")
# of an error response's body, what is read for its message
_ERROR_BODY_BYTES = 8192
_REASON_CHARS = 300

_CURRENT: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "edge0_request", default=None
)


@dataclass
class RequestRecord:
    """What the request's log line says; handlers fill the generation's part."""

    id: str
    method: str
    path: str
    status: int | None = None
    seconds: float | None = None
    outcome: str | None = None  # a generation's finish reason, cancelled, error, ...
    reason: str | None = None  # why a 4xx/5xx or an error event
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    queue_s: float | None = None

    def line(self) -> str:
        status = "-" if self.status is None else str(self.status)
        parts = [self.id, self.method, self.path, status, f"{self.seconds or 0:.3f}s"]
        if self.outcome is not None:
            parts.append(self.outcome)
        if self.prompt_tokens is not None:
            parts.append(f"prompt={self.prompt_tokens}")
        if self.completion_tokens is not None:
            parts.append(f"completion={self.completion_tokens}")
        if self.ttft_s is not None:
            parts.append(f"ttft={self.ttft_s:.3f}s")
        if self.decode_tok_s:
            parts.append(f"{self.decode_tok_s:.1f} tok/s")
        if self.queue_s is not None:
            parts.append(f"queue={self.queue_s:.3f}s")
        line = " ".join(parts)
        return f"{line}: {self.reason}" if self.reason else line

    def fields(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def current() -> RequestRecord | None:
    """The record of the request the calling task serves (None outside a request)."""
    return _CURRENT.get()


def request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if _USABLE_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


class RequestLog:
    """See the module docstring. Outermost: it sees the status the client got."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(request_id(scope), scope.get("method", ""), scope["path"])
        token = _CURRENT.set(record)
        started = time.perf_counter()
        error_body: list[bytes] = []  # of a 4xx/5xx that is not a stream
        errors = False

        async def watch(message: Message) -> None:
            nonlocal errors
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((HEADER.encode(), record.id.encode()))
                message = {**message, "headers": headers}
                kind = dict(headers).get(b"content-type", b"")
                errors = record.status >= 400 and not kind.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and errors:
                if sum(map(len, error_body)) < _ERROR_BODY_BYTES:
                    error_body.append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except BaseException as exc:
            record.reason = record.reason or f"{type(exc).__name__}: {exc}"[:_REASON_CHARS]
            raise
        finally:
            _CURRENT.reset(token)
            record.seconds = time.perf_counter() - started
            if error_body and record.reason is None:
                record.reason = _error_message(b"".join(error_body))
            _emit(record)


def _error_message(body: bytes) -> str | None:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:_REASON_CHARS].decode("utf-8", "replace") or None
    return str(message)[:_REASON_CHARS]


def _emit(record: RequestRecord) -> None:
    # warnings for the server's own failures; a client's mistake is part of normal traffic
    level = logging.WARNING if (record.status or 500) >= 500 else logging.INFO
    log.log(level, "%s", record.line(), extra={"request": record.fields()})


class JsonFormatter(logging.Formatter):
    """Each record as one JSON object: time, level, logger, message, and a request's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "request", None)
        if isinstance(fields, dict):
            out["request"] = fields
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        t = time.gmtime(record.created)
        return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(log_format: str, request_lines: bool) -> None:
    """The server's logging: timestamps on every line, text or JSON, and the request lines
    shown at the default level (INFO) unless turned off."""
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig()
    for handler in root.handlers:
        handler.setFormatter(formatter)
    log.setLevel(logging.INFO if request_lines else logging.WARNING)
