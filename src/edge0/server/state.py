"""What the request handlers share: the engine's worker, the template, limits and metrics."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

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

    @property
    def tokenizer(self):
        return self.worker.engine.tokenizer

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
        'shutting_down' (its tokens were counted when its generation ended)."""
        self.metrics.finished(endpoint, outcome, pending.elapsed(), pending.first_token_s)

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
