"""From a validated request to a queued Job, and the Job's events back on the event loop.

Everything that can be refused (context length, token budget, a full queue) is decided here,
before a response starts, so a streaming client still gets a proper 4xx status.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from edge0.engine.sampling import SamplingDefaults, SamplingParams
from edge0.server.errors import APIError, bad_request
from edge0.server.protocol import CommonRequest
from edge0.server.requestlog import RequestRecord, current
from edge0.server.worker import (
    SHUTTING_DOWN,
    Done,
    Event,
    Failed,
    Job,
    QueueFull,
    Token,
    Worker,
)

log = logging.getLogger(__name__)


def request_sampling(defaults: SamplingDefaults, req: CommonRequest) -> SamplingParams:
    """A request's sampling: its own fields over the model's defaults."""
    seed = None if req.seed is None else generator_seed(req.seed)
    return defaults.resolve(
        req.temperature,
        req.top_p,
        req.top_k,
        seed,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
    )


def generator_seed(seed: int) -> int:
    """A request's seed mixed into the 32 bits torch's CPU generator keeps.

    manual_seed() keeps only the low 32 bits, so 0, 2**32 and 2**63 would draw the same
    tokens; a hash makes every bit count (two seeds collide with probability 2**-32).
    """
    raw = seed.to_bytes(9, "little", signed=True)  # the range Seed allows, negatives included
    return int.from_bytes(hashlib.blake2b(raw, digest_size=4).digest(), "little")


def token_budget(
    requested: int | None, prompt_tokens: int, context: int, default: int | None, what: str
) -> int:
    """max_tokens for a prompt of `prompt_tokens` in a `context`-token window.

    Raises a 400 when the prompt leaves no room or `requested` does not fit. A `requested`
    0 (a scored prompt, nothing generated) needs only the prompt to fit.
    """
    room = context - prompt_tokens
    if room < (0 if requested == 0 else 1):
        raise bad_request(
            f"the prompt is {prompt_tokens} tokens, which leaves no room in this model's "
            f"context window of {context} tokens; shorten the {what}",
            param=what,
            code="context_length_exceeded",
        )
    if requested is None:  # capped by the server's default, and visible as finish "length"
        return min(room, default) if default else room
    if requested > room:
        raise bad_request(
            f"max_tokens {requested} + the prompt's {prompt_tokens} tokens exceed the context "
            f"window of {context} tokens; ask for at most {room}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


class Pending:
    """A submitted Job seen from the event loop; iterate it for its events."""

    def __init__(
        self,
        worker: Worker,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop: list[str],
        top_logprobs: int | None,
        score_prompt: int | None = None,
    ):
        self.worker = worker
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.arrived = time.perf_counter()
        self.first_token_s: float | None = None
        self.intervals: list[float] = []  # between successive tokens, as the loop got them
        self._last_token = 0.0
        self.done: Done | None = None
        self.failure: str | None = None  # a Failed event's message
        self.log: RequestRecord | None = current()  # the request's log line (requestlog.py)
        self.job = Job(prompt, max_tokens, sampling, self._sink, stop, top_logprobs)
        self.job.score_prompt = score_prompt
        try:
            worker.submit(self.job)
        except QueueFull as e:
            raise APIError(
                429,
                f"{e}; the server runs {worker.max_active} generations at once with "
                f"{worker.queue_size} waiting at most",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(e.retry_after_s)},
            ) from e
        except RuntimeError as e:
            raise shutting_down() from e

    def _sink(self, event: Event) -> None:  # on the generation thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody waits for this request any more
            self.job.cancel.set()

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            event = await self.events.get()
            if isinstance(event, Token):
                t = time.perf_counter()
                if self.first_token_s is None:
                    self.first_token_s = t - self.arrived
                else:
                    self.intervals.append(t - self._last_token)
                self._last_token = t
            elif isinstance(event, Done):
                self.done = event
            else:
                self.failure = event.message
            yield event
            if isinstance(event, Done | Failed):
                return

    def elapsed(self) -> float:
        return time.perf_counter() - self.arrived

    def queue_s(self) -> float | None:
        """From arrival until the generation thread admitted it (None: it never was)."""
        admitted = self.job.admitted
        return None if admitted is None else max(0.0, admitted - self.arrived)

    def cancel(self) -> None:
        self.worker.cancel(self.job)

    async def collect(self, request: Request) -> tuple[list[Token], Done]:
        """All events of a non-streaming request; a client that leaves cancels it."""
        watcher = asyncio.create_task(_cancel_on_disconnect(request, self))
        tokens: list[Token] = []
        done: Done | None = None
        try:
            async for event in self:
                if isinstance(event, Token):
                    tokens.append(event)
                elif isinstance(event, Failed):
                    raise APIError(500, f"generation failed: {event.message}", type="server_error")
                else:
                    done = event
        finally:
            watcher.cancel()
            if done is None:  # this handler was cancelled (shutdown): stop the generation too
                self.cancel()
        assert done is not None
        return tokens, done


def shutting_down() -> APIError:
    return APIError(
        503,
        "the server is shutting down; retry shortly (or on another instance)",
        type="server_error",
        code=SHUTTING_DOWN,
    )


async def _cancel_on_disconnect(request: Request, pending: Pending) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            log.info("client left; cancelling its request")
            pending.cancel()
            return


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """A server-sent event stream that closes its generator however the response ends.

    When a client's disconnect lands in starlette's `send` (not in the generator), starlette
    leaves the generator suspended at a `yield`; its `finally` (cancelling the generation,
    counting the outcome) then waited for the garbage collector, so a cancelled stream could
    go uncounted for as long as no collection ran.
    """

    def __init__(self, events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
