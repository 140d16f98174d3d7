"""The OpenAI-compatible HTTP app: routes, error handlers, and the generation thread's lifetime.

GET  /v1/models            the one model served
POST /v1/chat/completions  chat, streamed (SSE) or whole
POST /v1/completions       raw prompt continuation, streamed or whole
GET  /health               liveness and queue depth
GET  /metrics              Prometheus text format
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from edge0.engine.sampling import SamplingDefaults
from edge0.server import chat_api, completions_api, errors, responses_api, tokenize_api
from edge0.server.arrivals import Arrivals, CountArrivals
from edge0.server.failsafe import Failsafe
from edge0.server.logprobs import TokenStrings
from edge0.server.metrics import Metrics
from edge0.server.middleware import Guard
from edge0.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from edge0.server.requestlog import RequestLog
from edge0.server.state import ServerState
from edge0.server.worker import Worker
from edge0.text.prompt import ChatTemplate
from edge0.util import limits
from edge0.util.threads import ComputeThread


@dataclass
class ServerOptions:
    model_name: str | None = None  # default: the model directory's name
    api_key: str | None = None  # required on /v1 routes when set
    queue_size: int = 32  # requests that may wait behind the running one
    max_body_bytes: int = 1 << 20
    # chat requests without max_tokens; None: to the end of the context
    default_max_tokens: int | None = limits.CHAT_MAX_TOKENS
    tracebacks: bool = False  # log each 5xx with its traceback, not in one line
    body_timeout_s: float | None = limits.BODY_TIMEOUT_S  # after the head; None: no limit


# the label of each route in /metrics; any other path counts as "other"
ENDPOINTS = {
    "/v1/chat/completions": chat_api.ENDPOINT,
    "/v1/completions": completions_api.ENDPOINT,
    "/v1/responses": responses_api.ENDPOINT,
    "/v1/models": "models",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/health": "health",
    "/metrics": "metrics",
}


# the routes whose requests the generation thread waits for (server/arrivals.py)
GENERATION_PATHS = frozenset(("/v1/chat/completions", "/v1/completions", "/v1/responses"))


def endpoint_label(path: str) -> str:
    if path.startswith("/v1/models/"):
        return "models"
    return ENDPOINTS.get(path, "other")


def context_window(engine) -> int:
    """Tokens a prompt plus its completion may take (the serving plan's context)."""
    return engine.max_context


def create_app(
    engine, options: ServerOptions | None = None, compute: ComputeThread | None = None
) -> FastAPI:
    """An app serving `engine`; the generation thread runs while the app's lifespan does,
    on `compute` if given (the thread that loaded the engine), else on a thread of its own.

    The caller keeps ownership of the engine (and closes it after the server stops).
    """
    opts = options or ServerOptions()
    model_name = opts.model_name or engine.path.name
    arrivals = Arrivals()
    worker = Worker(
        engine, opts.queue_size, tracebacks=opts.tracebacks, compute=compute, arrivals=arrivals
    )
    metrics = Metrics(engine, worker, model_name, endpoint_label)
    worker.on_generated = metrics.generation_ended
    state = ServerState(
        model_name=model_name,
        worker=worker,
        metrics=metrics,
        template=ChatTemplate(engine.tokenizer),
        strings=TokenStrings(engine.tokenizer),
        sampling=SamplingDefaults.from_model_dir(engine.path),
        context=context_window(engine),
        vocab_size=engine.config.vocab_size,
        default_max_tokens=opts.default_max_tokens,
        started=int(time.time()),
        aliases=frozenset((engine.path.name,)),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    # a body sent without any Content-Type is read as JSON; a form or text type is refused
    app = FastAPI(title="edge0", version="1", lifespan=lifespan, strict_content_type=False)
    app.state.edge0 = state
    errors.install(app)
    # inside the guard: a request counts as arriving once its whole body is in
    app.add_middleware(CountArrivals, arrivals=arrivals, paths=GENERATION_PATHS)
    app.add_middleware(
        Guard,
        api_key=opts.api_key,
        max_bytes=opts.max_body_bytes,
        body_timeout_s=opts.body_timeout_s,
    )
    app.add_middleware(Failsafe, count=metrics.response, tracebacks=opts.tracebacks)
    # added last: the outermost, so it logs the status the client got
    app.add_middleware(RequestLog)

    def model_card() -> dict:
        return {
            "id": state.model_name,
            "object": "model",
            "created": state.started,
            "owned_by": "edge0",
            "max_model_len": state.context,
        }

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")  # ids like Qwen/Qwen3-30B-A3B hold a slash
    async def get_model(model_id: str) -> dict:
        state.check_model(model_id)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat_api.chat_completions(state, body, request)

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest, request: Request) -> Response:
        return await completions_api.completions(state, body, request)

    @app.post("/v1/responses")
    async def respond(body: ResponsesRequest, request: Request) -> Response:
        return await responses_api.responses(state, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        return await tokenize_api.tokenize(state, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return await tokenize_api.detokenize(state, body)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(
            {"status": "ok", "model": state.model_name, "queue_depth": worker.depth}
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
