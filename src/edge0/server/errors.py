"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Handlers turn every failure, including FastAPI's own validation and routing errors, into that
shape, so a client library always finds a message it can show.
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

INVALID = "invalid_request_error"


class APIError(Exception):
    """An error a request handler answers with; see the module docstring."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message = status, message
        self.type, self.param, self.code = type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _path(loc) -> list[str]:
    """A pydantic error location without "body" and without union-member tags like list[str]."""
    out = []
    for x in loc:
        if isinstance(x, int):
            out.append(str(x))
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", x) and x not in _TYPE_TAGS and x != "body":
            out.append(x)
    return out


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, named by its path in the request body."""
    errors = exc.errors()
    first = errors[0]
    kind, ctx = first.get("type"), first.get("ctx") or {}
    if kind == "json_invalid":
        detail = ctx.get("error", "invalid JSON")
        return bad_request(f"the request body is not valid JSON: {detail}", code="invalid_json")
    loc = _path(first.get("loc", ()))
    if kind == "missing" and not loc:
        return bad_request(
            "the request body is empty: send a JSON object (Content-Type: application/json)",
            code="invalid_json",
        )
    if kind == "cross_field":  # fields that do not go together: name the one to change
        return bad_request(first.get("msg", "invalid request"), param=ctx.get("param"))
    if first.get("type") == "model_attributes_type" and not loc:
        return bad_request(
            "the request body must be a JSON object (Content-Type: application/json)"
        )
    # a value that fits no member of a union fails once per member: say each way it failed
    messages = []
    for e in errors:
        if _path(e.get("loc", ())) == loc:
            msg = e.get("msg", "invalid value").removeprefix("Value error, ")
            if msg not in messages:
                messages.append(msg)
    where = ".".join(loc)
    text = "; or ".join(messages[:3])
    if where and not text.startswith(loc[0]):  # a message may name its own place
        text = f"{where}: {text}"
    return bad_request(text, param=loc[0] if loc else None)


def _body_error(exc: StarletteHTTPException) -> APIError:
    """FastAPI's 400 for a body it could not read as JSON, saying why (its cause)."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        detail = f"the request body is not valid UTF-8 ({cause.reason} at byte {cause.start})"
    elif isinstance(cause, RecursionError):
        detail = "the request body nests too deeply"
    else:
        detail = f"the request body could not be read as JSON ({type(cause).__name__})"
    return bad_request(f"{detail}; send UTF-8 JSON", code="invalid_json")


def install(app: FastAPI) -> None:
    """Register the handlers that give every error the OpenAI shape."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.__cause__ is not None:
            return _body_error(exc).response()
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return APIError(
            exc.status_code, message, code=code.get(exc.status_code), headers=exc.headers
        ).response()
