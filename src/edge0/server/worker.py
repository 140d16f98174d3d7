"""The generation thread: it alone touches the engine (model, expert pool, KV state).

It is the thread that loaded the engine when the caller hands it over (`edge0 serve` loads on
a ComputeThread, util/threads.py): torch's ops on any other thread pay for a second OpenMP
team, which made a decode step 2.5x slower.

Requests wait in a bounded FIFO and enter the engine's scheduler (engine/scheduler.py, which
decides every forward) as it has room for them, in arrival order; when the FIFO is full,
submit() refuses at once (the caller answers 429) instead of letting waits grow without
limit. Before each turn the thread lets the requests the server is still receiving arrive
(server/arrivals.py: at most ARRIVAL_WAIT_S, once per arrival), so that they join the batch
the scheduler starts them in. Each request runs to its end, its max_tokens, a stop string, or
a cancel (client gone, or the server stopping), which is seen before its next forward.
Detokenization and stop strings are handled here, on the token, so a request stops exactly at
its stop string. A request's final event is sent after it stops counting as running.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from edge0.engine.sampling import SamplingParams
from edge0.engine.scheduler import Sequence
from edge0.engine.stats import GenerationStats
from edge0.server.arrivals import Arrivals
from edge0.server.logprobs import HeldLogprobs, TokenLogprob, prompt_logprobs, token_logprob
from edge0.text.stops import StopMatcher
from edge0.text.tokenizer import IncrementalDecoder
from edge0.util.threads import ComputeThread

log = logging.getLogger(__name__)

# The longest the thread waits before a turn for requests the server is still receiving
# (arrivals.py): a few times what a burst of arrivals takes to reach it (docs/server.md)
ARRIVAL_WAIT_S = 0.02

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
    prompt_logprobs: list[TokenLogprob] | None = None  # a scored prompt's, on its first event


@dataclass
class Done:
    finish_reason: str  # stop | length | CANCELLED | SHUTTING_DOWN
    text: str  # the last of the text, released at the end
    completion_tokens: int
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # those of `text`
    prompt_logprobs: list[TokenLogprob] | None = None  # a scored prompt's, if no Token came


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
    # score the prompt (its tokens' logprobs and this many alternatives); max_tokens may be 0
    score_prompt: int | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = CANCELLED  # the finish reason a cancel ends it with
    admitted: float | None = None  # perf_counter() when it entered the scheduler


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        super().__init__(f"the request queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class _Active:
    """An admitted job: its sequence in the scheduler and the text it has released so far."""

    def __init__(self, job: Job, seq: Sequence, tokenizer):
        self.job, self.seq = job, seq
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopMatcher(job.stop)
        self.held = HeldLogprobs()
        self.started = time.perf_counter()
        self._prompt_sent = False

    def prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The scored prompt's entries, once: for the first event after its prefill."""
        if self._prompt_sent or self.job.score_prompt is None or not self.seq.started:
            return None
        if self.seq.fed < len(self.seq.prompt):
            return None
        self._prompt_sent = True
        return prompt_logprobs(self.seq.prompt, self.seq.prompt_scores)


def _report_end(loop: Future) -> None:
    """The generation loop ended: say so at once if it failed (the requests it held, and any
    new one, would otherwise wait without a word)."""
    error = None if loop.cancelled() else loop.exception()
    if error is not None:
        log.error("the generation thread stopped: %s", error, exc_info=error)


class Worker:
    """Owns the engine on one thread; see the module docstring."""

    def __init__(
        self,
        engine,
        queue_size: int = 32,
        on_generated: Callable[[GenerationStats], None] | None = None,
        tracebacks: bool = False,
        compute: ComputeThread | None = None,
        arrivals: Arrivals | None = None,
        policy=None,
    ):
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size}")
        self.engine = engine
        self.queue_size = queue_size
        self.scheduler = engine.scheduler(policy=policy)  # (policy: scheduler.RoundRobin)
        self.max_active = self.scheduler.max_active
        self.on_generated = on_generated  # every generation that ran, however it ended
        self.tracebacks = tracebacks  # log a failed generation's traceback, not just one line
        self.arrivals = arrivals  # requests still being received, waited for before a forward
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: dict[Sequence, _Active] = {}  # in the scheduler
        self._cv = threading.Condition()
        self._stopping = False
        # the loop's thread: the one that loaded the engine, where the caller has one
        self._compute, self._own_compute = compute, compute is None
        self._running: Future | None = None
        self._mean_s = 1.0  # moving average of a request's time, for Retry-After

    @property
    def batch_decode(self) -> bool:
        """Whether the decode steps of the active requests run in one forward."""
        return self.scheduler.batch_decode

    @batch_decode.setter
    def batch_decode(self, on: bool) -> None:
        self.scheduler.batch_decode = on

    @property
    def depth(self) -> int:
        """Requests waiting plus those running."""
        with self._cv:
            return len(self._waiting) + len(self._active)

    @property
    def running(self) -> int:
        """Requests in the scheduler (prefilling or decoding)."""
        return len(self._active)  # (one read of a dict's size: no lock needed)

    @property
    def waiting(self) -> int:
        """Requests in the queue, not yet admitted."""
        return len(self._waiting)

    def start(self) -> None:
        if self._compute is None:  # (a thread of its own, ended by stop())
            self._compute = ComputeThread("edge0-generate")
        self._running = self._compute.submit(self._loop)
        self._running.add_done_callback(_report_end)

    def stop(self) -> None:
        """Cancel everything and let the thread finish the forward it is on."""
        with self._cv:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            for a in self._active.values():
                a.job.cancel.set()
            self._cv.notify_all()
        for job in waiting:
            job.cancel.set()
            job.sink(Done(CANCELLED, "", 0))
        if self._running is not None:
            self._running.exception()  # waits; a failure was logged when it ended
            self._running = None
        if self._own_compute and self._compute is not None:
            self._compute.close()
            self._compute = None

    def refuse_new(self) -> None:
        """The server is stopping: refuse new requests, and end the waiting ones now (they get
        SHUTTING_DOWN); the running ones go on until wait_idle() or cancel_running()."""
        with self._cv:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cv.notify_all()
        for job in waiting:
            job.cancel_reason = SHUTTING_DOWN
            job.cancel.set()
            job.sink(Done(SHUTTING_DOWN, "", 0))

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether nothing runs, waiting up to timeout_s for the running requests to end."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._active, timeout=timeout_s)

    def cancel_running(self, reason: str = SHUTTING_DOWN) -> None:
        """Stop the running requests before their next forward; they finish with `reason`."""
        with self._cv:
            for a in self._active.values():
                a.job.cancel_reason = reason
                a.job.cancel.set()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if len(self._waiting) >= self.queue_size:
                ahead = len(self._waiting) + 1
                wait_s = self._mean_s * math.ceil(ahead / self.max_active)
                raise QueueFull(max(1, math.ceil(wait_s)))
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Stop `job`: dropped at once while it waits, else before its next forward."""
        job.cancel.set()
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # running or finished: the generation thread sees the flag
        job.sink(Done(job.cancel_reason, "", 0))

    def _loop(self) -> None:
        while True:
            ended: list[tuple[Job, Event]] = []  # refused at admission
            with self._cv:
                while not self._active and not (self._waiting and not self._stopping):
                    if self._stopping:
                        return
                    self._cv.wait()
            if self.arrivals is not None:  # (not under the lock: submit() takes it)
                self.arrivals.settle(ARRIVAL_WAIT_S)
            with self._cv:
                while self._waiting and self.scheduler.room:
                    self._admit(self._waiting.popleft(), ended)
                cancelled = [a for a in self._active.values() if a.job.cancel.is_set()]
            for job, event in ended:
                job.sink(event)
            for a in cancelled:  # before their next forward
                self.scheduler.cancel(a.seq)
                self._end(a, self._done(a))
            for seq in self.scheduler.step():
                a = self._active[seq]
                final = self._deliver(a)
                if final is not None:
                    self._end(a, final)

    def _admit(self, job: Job, ended: list[tuple[Job, Event]]) -> None:
        """Under the lock: hand `job` to the scheduler (it starts at its first turn)."""
        if job.cancel.is_set():  # cancelled between cancel()'s flag and its removal
            ended.append((job, Done(job.cancel_reason, "", 0)))
            return
        try:
            seq = self.scheduler.add(job.prompt, job.max_tokens, job.sampling, job.score_prompt)
        except Exception as e:  # e.g. a prompt the engine refuses
            ended.append((job, self._failed(e)))
            return
        job.admitted = time.perf_counter()
        self._active[seq] = _Active(job, seq, self.engine.tokenizer)

    def _deliver(self, a: _Active) -> Event | None:
        """The tokens a's last forward sampled, to its sink; its final event if it ended."""
        job, seq = a.job, a.seq
        if seq.error is not None:
            return self._failed(seq.error)
        try:
            while seq.out:
                token, logprobs = seq.out.popleft()
                lp = None
                if job.top_logprobs is not None:
                    lp = token_logprob(logprobs, token, job.top_logprobs)
                decoded = a.decoder.push(token)
                text = a.stops.push(decoded)
                job.sink(Token(token, text, a.held.push(lp, decoded, text), a.prompt_logprobs()))
                if a.stops.stopped:
                    break
            if not (seq.done or a.stops.stopped or job.cancel.is_set()):
                return None
            self.scheduler.cancel(seq)  # (nothing where it ended)
            return self._done(a)
        except Exception as e:  # the thread must outlive a failed request
            try:
                self.scheduler.cancel(seq)
            except Exception as again:
                log.error("ending a failed generation: %s: %.200s", type(again).__name__, again)
            return self._failed(e)

    def _done(self, a: _Active) -> Done:
        seq, job, stops = a.seq, a.job, a.stops
        if self.on_generated is not None:
            self.on_generated(seq.stats)
        tail = stops.push(a.decoder.flush())
        if not stops.stopped:
            tail += stops.flush()
        if job.cancel.is_set():
            reason = job.cancel_reason
        elif stops.stopped:
            reason = "stop"
        else:
            reason = seq.finish_reason
        logprobs = a.held.finish(tail, stops.stopped)
        if seq.ended_on is not None and job.top_logprobs is not None and not stops.stopped:
            logprobs.append(token_logprob(seq.ended_on[1], seq.ended_on[0], job.top_logprobs))
        return Done(reason, tail, len(seq.tokens), seq.stats, logprobs, a.prompt_logprobs())

    def _failed(self, e: BaseException) -> Failed:
        log.error(
            "generation failed: %s: %.200s",
            type(e).__name__,
            e,
            exc_info=e if self.tracebacks else None,
        )
        return Failed(f"{type(e).__name__}: {e}")

    def _end(self, a: _Active, final: Event) -> None:
        with self._cv:
            # not running any more before anyone hears it ended: /health then reads 0
            self._active.pop(a.seq, None)
            self._mean_s = 0.8 * self._mean_s + 0.2 * (time.perf_counter() - a.started)
            self._cv.notify_all()
        a.job.sink(final)
