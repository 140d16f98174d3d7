"""What the request handlers share: the engine's worker, the template, limits and metrics."""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass

from edge0.engine.grammar import Grammars
from edge0.engine.sampling import SamplingDefaults
from edge0.server import arrivals
from edge0.server.errors import APIError
from edge0.server.jobs import Pending, shutting_down
from edge0.server.logprobs import TokenStrings
from edge0.server.metrics import Metrics
from edge0.server.worker import CANCELLED, SHUTTING_DOWN, Done, Token, Worker
from edge0.text.prompt import ChatTemplate


@dataclass
class ServerState:
    model_name: str
    worker: Worker
    metrics: Metrics
    template: ChatTemplate
    strings: TokenStrings
    sampling: SamplingDefaults
    context: int  # tokens a prompt plus its completion may take
    vocab_size: int
    default_max_tokens: int | None  # when a chat request leaves max_tokens out
    started: int  # unix time, for /v1/models
    # the ids a request's `model` may name: model_name, and the model directory's name
    aliases: frozenset[str] = frozenset()

    @property
    def tokenizer(self):
        return self.worker.engine.tokenizer

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Grammars compiled against the model's tokenizer (made at the first use)."""
        return Grammars(self.tokenizer, self.vocab_size)

    def check_model(self, requested: str | None) -> None:
        """A 404 for a model this server does not serve, as OpenAI answers; a request that
        names none gets the one served."""
        if requested is None or requested == self.model_name or requested in self.aliases:
            return
        raise APIError(
            404,
            f"the model {requested!r} does not exist here; this server serves "
            f"{self.model_name!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )

    def submit(self, endpoint: str, **job) -> Pending:
        """Queue a generation (see Pending); a refusal is counted in the metrics."""
        arrivals.submitted()  # before the worker hears of it: it need not wait for this one
        try:
            return Pending(self.worker, **job)
        except APIError as e:  # 429 queue full, or 503 while shutting down
            self.metrics.finished(endpoint, "rejected" if e.status == 429 else SHUTTING_DOWN)
            raise

    def record(self, endpoint: str, outcome: str, pending: Pending):
        """Count a finished request: outcome is its finish reason, 'cancelled', 'error' or
        'shutting_down' (its tokens were counted when its generation ended); and fill its
        log line (requestlog.py)."""
        self.metrics.finished(endpoint, outcome, pending)
        line = pending.log
        if line is None:
            return
        line.outcome = outcome
        line.prompt_tokens = len(pending.job.prompt)
        line.ttft_s = pending.first_token_s
        line.queue_s = pending.queue_s()
        done = pending.done
        if done is not None:
            line.completion_tokens = done.completion_tokens
            if done.stats is not None:
                line.decode_tok_s = done.stats.decode_tok_s
        if pending.failure is not None:
            line.reason = f"generation failed: {pending.failure}"
        elif outcome == SHUTTING_DOWN:
            line.reason = "the server is shutting down"

    async def collect(self, endpoint: str, pending: Pending, request) -> tuple[list[Token], Done]:
        """A whole (non-streamed) generation; cancelled or failed ones raise an APIError."""
        try:
            tokens, done = await pending.collect(request)
        except APIError:
            self.record(endpoint, "error", pending)
            raise
        self.record(endpoint, done.finish_reason, pending)
        if done.finish_reason == SHUTTING_DOWN:
            raise shutting_down()
        if done.finish_reason == CANCELLED:  # the client left, or the app is stopping
            raise APIError(503, "the request was cancelled", type="server_error", code=CANCELLED)
        return tokens, done


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
