"""The generation thread: it alone touches the engine (model, expert pool, KV state).

It is the thread that loaded the engine when the caller hands it over (`edge0 serve` loads on
a ComputeThread, edge0/threads.py): torch's ops on any other thread pay for a second OpenMP
team, which made a decode step 2.5x slower.

Scheduling: up to `engine.plan.max_active` requests are active at once, each with its own
state (KV cache, prerouter features, staged experts), which the serving plan has counted.
The thread takes the active requests in turn, round robin, and runs one forward of each: a
decode step, or one chunk of at most prefill_chunk prompt tokens. So no request holds the
engine while another waits, and a long prompt shares the thread chunk by chunk. A newly
admitted request goes first: its first forward is the next one (a decoding request then
waits one forward per request admitted since its last step, at most max_active - 1). Every
other active request that has not started yet starts with it: their prompts (each within one
chunk) prefill in one forward (Engine.start_together), so the last of seven chat requests
arriving together waits for one batched prefill, not for six others in turn; each of them then
samples its first token at once, so their first decode steps are one forward too. Before each
forward the thread lets the requests the server is still receiving arrive (server/arrivals.py:
at most ARRIVAL_WAIT_S, once per arrival), so that they join that batch. Likewise, when a
request's decode step comes, every active request waiting for a decode step joins it in one
forward (Engine.step_together) and they all go to the back of the line, so a turn of the line
is one decode forward for all the decoding requests plus one prompt chunk of each prefilling
one (EngineOptions.batch_decode; off, each decode step is a turn of its own).

Requests beyond max_active wait in a bounded FIFO and are admitted in arrival order as active
ones end; when the FIFO is full, submit() refuses at once (the caller answers 429) instead of
letting waits grow without limit. Each request runs to its end, its max_tokens, a stop string,
or a cancel (client gone, or the server stopping), which is seen before its next forward.
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

from edge0.engine.core import GenerationStats
from edge0.engine.sampling import SamplingParams
from edge0.server.arrivals import Arrivals
from edge0.server.logprobs import HeldLogprobs, TokenLogprob, token_logprob
from edge0.text.stops import StopMatcher
from edge0.text.tokenizer import IncrementalDecoder
from edge0.util.threads import ComputeThread

log = logging.getLogger(__name__)

# The longest the thread waits before a forward for requests the server is still receiving
# (arrivals.py). One arrival takes ~1 ms to reach the worker on an idle server (the built-in
# model's chat, 2 cores); seven at once, 8-15 ms.
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


class _Active:
    """An admitted job: its generation and the text it has released so far."""

    def __init__(self, job: Job, gen, tokenizer):
        self.job, self.gen = job, gen
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopMatcher(job.stop)
        self.held = HeldLogprobs()
        self.started = time.perf_counter()


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
    ):
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size}")
        self.engine = engine
        self.queue_size = queue_size
        self.max_active = engine.plan.max_active
        self.batch_decode = engine.options.batch_decode
        self.on_generated = on_generated  # every generation that ran, however it ended
        self.tracebacks = tracebacks  # log a failed generation's traceback, not just one line
        self.arrivals = arrivals  # requests still being received, waited for before a forward
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: collections.deque[_Active] = collections.deque()  # next to run first
        self._cv = threading.Condition()
        self._stopping = False
        # the loop's thread: the one that loaded the engine, where the caller has one
        self._compute, self._own_compute = compute, compute is None
        self._running: Future | None = None
        self._mean_s = 1.0  # moving average of a request's time, for Retry-After

    @property
    def depth(self) -> int:
        """Requests waiting plus those running."""
        with self._cv:
            return len(self._waiting) + len(self._active)

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
            for a in self._active:
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
            for a in self._active:
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
                while self._waiting and len(self._active) < self.max_active:
                    self._admit(self._waiting.popleft(), ended)
                # the first request not started has its first turn (the others not started
                # join it), else the front of the line has its turn; it goes to the back
                unstarted = [b for b in self._active if not b.gen.started]
                a = unstarted[0] if unstarted else (self._active[0] if self._active else None)
                if a is not None:
                    self._active.remove(a)
                    self._active.append(a)
                decoding = []
                if not unstarted and a is not None and self.batch_decode and self._decodes(a):
                    # its decode step: every other active request's next decode step joins
                    # it, and all of them go to the back of the line
                    decoding = [b for b in self._active if self._decodes(b)]
                    if len(decoding) > 1:
                        for b in decoding:
                            self._active.remove(b)
                        self._active.extend(decoding)
            for job, event in ended:
                job.sink(event)
            if len(unstarted) > 1:
                if not self._start_together(unstarted):
                    continue
                # the others whose prompts ran in the batch sample their first tokens now (no
                # forward), so that their first decode steps join the next one
                for b in unstarted:
                    if b is not a and b.gen.prefilled:
                        final = self._advance(b)
                        if final is not None:
                            self._end(b, final)
            if len(decoding) > 1:
                if self._step_together(decoding):
                    for b in decoding:
                        final = self._advance(b)
                        if final is not None:
                            self._end(b, final)
                continue
            if a is not None:
                final = self._advance(a)
                if final is not None:
                    self._end(a, final)

    def _admit(self, job: Job, ended: list[tuple[Job, Event]]) -> None:
        """Under the lock: make `job` active (its generation starts at its first turn)."""
        if job.cancel.is_set():  # cancelled between cancel()'s flag and its removal
            ended.append((job, Done(job.cancel_reason, "", 0)))
            return
        try:
            gen = self.engine.generate(job.prompt, job.max_tokens, job.sampling)
        except Exception as e:  # e.g. a prompt the engine refuses
            ended.append((job, self._failed(e)))
            return
        self._active.append(_Active(job, gen, self.engine.tokenizer))

    def _start_together(self, admitted: list[_Active]) -> bool:
        """Requests not started yet prefill their prompts in one forward when the first of
        them has its turn (see Engine.start_together). Whether the loop goes on as usual."""
        return self._together(self.engine.start_together, admitted)

    @staticmethod
    def _decodes(a: _Active) -> bool:
        """Whether a's next forward is a decode step (not a prompt chunk, not its end)."""
        return a.gen.pending_step is not None and not a.job.cancel.is_set()

    def _step_together(self, decoding: list[_Active]) -> bool:
        """The decode steps of `decoding` in one forward (Engine.step_together); each then
        samples its token at its advance. Whether it ran."""
        return self._together(self.engine.step_together, decoding)

    def _together(self, run: Callable[[list], object], actives: list[_Active]) -> bool:
        """run(their generations) for one forward of several requests; if it fails, they all
        fail. Whether it ran."""
        try:
            run([a.gen for a in actives])
            return True
        except Exception as e:
            failed = self._failed(e)
            for a in actives:
                a.gen.close()
                self._end(a, failed)
            return False

    def _advance(self, a: _Active) -> Event | None:
        """One forward of `a`; its final event if it ended."""
        job, gen = a.job, a.gen
        try:
            if not job.cancel.is_set():
                item = gen.advance()
                if item is not None:
                    token, logprobs = item
                    lp = None
                    if job.top_logprobs is not None:
                        lp = token_logprob(logprobs, token, job.top_logprobs)
                    decoded = a.decoder.push(token)
                    text = a.stops.push(decoded)
                    job.sink(Token(token, text, a.held.push(lp, decoded, text)))
                if not (gen.done or a.stops.stopped or job.cancel.is_set()):
                    return None
            gen.close()
            return self._done(a)
        except Exception as e:  # the thread must outlive a failed request
            try:
                gen.close()
            except Exception as again:
                log.error("ending a failed generation: %s: %.200s", type(again).__name__, again)
            return self._failed(e)

    def _done(self, a: _Active) -> Done:
        gen, job, stops = a.gen, a.job, a.stops
        if self.on_generated is not None:
            self.on_generated(gen.stats)
        tail = stops.push(a.decoder.flush())
        if not stops.stopped:
            tail += stops.flush()
        if job.cancel.is_set():
            reason = job.cancel_reason
        elif stops.stopped:
            reason = "stop"
        else:
            reason = gen.finish_reason
        logprobs = a.held.finish(tail, stops.stopped)
        return Done(reason, tail, len(gen.tokens), gen.stats, logprobs)

    def _failed(self, e: Exception) -> Failed:
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
            self._active.remove(a)
            self._mean_s = 0.8 * self._mean_s + 0.2 * (time.perf_counter() - a.started)
            self._cv.notify_all()
        a.job.sink(final)
