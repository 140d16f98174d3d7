"""The generation thread: it alone touches the engine (model, expert pool, KV state).

Requests wait in a bounded FIFO; when it is full, submit() refuses at once (the caller answers
429) instead of letting waits grow without limit. Each request runs to its end, its max_tokens,
a stop string, or a cancel (client gone, or the server stopping), which is seen at the next
token. Detokenization and stop strings are handled here, on the token, so a request stops
exactly at its stop string. A request's final event is sent after it stops counting as running.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edge0.engine import GenerationStats
from edge0.sampling import SamplingParams
from edge0.server.logprobs import HeldLogprobs, TokenLogprob, token_logprob
from edge0.stops import StopMatcher
from edge0.tokenizer import IncrementalDecoder

log = logging.getLogger(__name__)

CANCELLED = "cancelled"  # the client left
SHUTTING_DOWN = "shutting_down"  # the server is stopping


@dataclass
class Token:
    """One generated token and the text it releases (possibly empty: held back).

    `logprobs` are those of the tokens whose text starts in `text` (when asked for), so they
    travel with their text and never outrun it.
    """

    token: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Done:
    finish_reason: str  # stop | length | CANCELLED | SHUTTING_DOWN
    text: str  # the last of the text, released at the end
    completion_tokens: int
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # those of `text`


@dataclass
class Failed:
    message: str


Event = Token | Done | Failed


@dataclass(eq=False)
class Job:
    """One request as the generation thread sees it."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    sink: Callable[[Event], None]  # called on the generation thread; must not block
    stop: list[str] = field(default_factory=list)
    top_logprobs: int | None = None  # None: no logprobs; 0: the sampled token's only
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = CANCELLED  # the finish reason a cancel ends it with


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        super().__init__(f"the request queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class Worker:
    """Owns the engine on one thread; see the module docstring."""

    def __init__(
        self,
        engine,
        queue_size: int = 32,
        on_generated: Callable[[GenerationStats], None] | None = None,
        tracebacks: bool = False,
    ):
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size}")
        self.engine = engine
        self.queue_size = queue_size
        self.on_generated = on_generated  # every generation that ran, however it ended
        self.tracebacks = tracebacks  # log a failed generation's traceback, not just one line
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._running: Job | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._mean_s = 1.0  # moving average of a request's time, for Retry-After

    @property
    def depth(self) -> int:
        """Requests waiting plus the one running."""
        with self._cv:
            return len(self._waiting) + (self._running is not None)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="edge0-generate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Cancel everything and let the thread finish the token it is on."""
        with self._cv:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            if self._running is not None:
                self._running.cancel.set()
            self._cv.notify_all()
        for job in waiting:
            job.cancel.set()
            job.sink(Done(CANCELLED, "", 0))
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def refuse_new(self) -> None:
        """The server is stopping: refuse new requests, and end the waiting ones now (they get
        SHUTTING_DOWN); the running one goes on until wait_idle() or cancel_running()."""
        with self._cv:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cv.notify_all()
        for job in waiting:
            job.cancel_reason = SHUTTING_DOWN
            job.cancel.set()
            job.sink(Done(SHUTTING_DOWN, "", 0))

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether nothing runs, waiting up to timeout_s for the running request to end."""
        with self._cv:
            return self._cv.wait_for(lambda: self._running is None, timeout=timeout_s)

    def cancel_running(self, reason: str = SHUTTING_DOWN) -> None:
        """Stop the running request at its next token; it finishes with `reason`."""
        with self._cv:
            if self._running is not None:
                self._running.cancel_reason = reason
                self._running.cancel.set()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if len(self._waiting) >= self.queue_size:
                raise QueueFull(max(1, math.ceil(self._mean_s * (len(self._waiting) + 1))))
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Stop `job`: dropped at once while it waits, else at its next token."""
        job.cancel.set()
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # running or finished: the generation thread sees the flag
        job.sink(Done(job.cancel_reason, "", 0))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._running = self._waiting.popleft()
            t0 = time.perf_counter()
            if job.cancel.is_set():  # cancelled between cancel()'s flag and its removal
                final: Event = Done(job.cancel_reason, "", 0)
            else:
                try:
                    final = self._run(job)
                except Exception as e:  # the thread must outlive a failed request
                    log.error(
                        "generation failed: %s: %.200s",
                        type(e).__name__,
                        e,
                        exc_info=e if self.tracebacks else None,
                    )
                    final = Failed(f"{type(e).__name__}: {e}")
            with self._cv:
                # not running any more before anyone hears it ended: /health then reads 0
                self._running = None
                self._mean_s = 0.8 * self._mean_s + 0.2 * (time.perf_counter() - t0)
                self._cv.notify_all()
            job.sink(final)

    def _run(self, job: Job) -> Done:
        decoder = IncrementalDecoder(self.engine.tokenizer)
        stops = StopMatcher(job.stop)
        held = HeldLogprobs()
        gen = self.engine.generate(job.prompt, job.max_tokens, job.sampling)
        for token, logprobs in gen:
            lp = None
            if job.top_logprobs is not None:
                lp = token_logprob(logprobs, token, job.top_logprobs)
            decoded = decoder.push(token)
            text = stops.push(decoded)
            job.sink(Token(token, text, held.push(lp, decoded, text)))
            if stops.stopped or job.cancel.is_set():
                gen.close()
                break
        if self.on_generated is not None:
            self.on_generated(gen.stats)
        tail = stops.push(decoder.flush())
        if not stops.stopped:
            tail += stops.flush()
        if job.cancel.is_set():
            reason = job.cancel_reason
        elif stops.stopped:
            reason = "stop"
        else:
            reason = gen.finish_reason
        logprobs = held.finish(tail, stops.stopped)
        return Done(reason, tail, len(gen.tokens), gen.stats, logprobs)
