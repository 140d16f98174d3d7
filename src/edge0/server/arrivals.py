"""Generation requests the server has received but not yet handed to the generation thread.

On a machine with few cores the generation thread's forwards and the event loop's work on new
requests (validation, the chat template, tokenization) compete for the same cores. Measured on
2 cores, in a served run of `edge0 bench --serving`'s concurrency case on the built-in model
with timestamps on the handlers and the generation thread: seven chats arriving while one
request decoded took 15-25 ms to reach the worker, against ~1 ms each on an idle server,
and the decode step they overlapped took 12-40 ms instead of 4.5. Some of them then reached
the worker after the others' batched prefill had begun, and prefilled in a second forward.

So before each forward the generation thread waits until the requests received since it last
waited have been submitted, or refused, for at most `limit_s` (Worker: ARRIVAL_WAIT_S): their
work then has the cores to itself, and they start in one batched prefill. A request that has
entered once makes the thread wait once, so a client that never finishes its request (or a
huge prompt still being tokenized) costs the running requests one wait, not one per forward.

What counts is what the event loop has read, and while the generation thread computes, the
loop may not get the cores to read what has come: traced, a burst's 7 requests were all sent
within 5 ms, 3 were submitted by 4 ms, and the other 4 only at 17 ms, after the first 3's
prefill had begun (the long chat's step ran from 0 to 8 ms); they then prefilled in a second
forward, and the burst's first tokens came ~15 ms later than in bursts prefilled in one. So
once requests have entered, the thread also hands the loop a few turns of its own (`intake`:
callbacks that reschedule themselves, INTAKE_TURNS of them) before it goes on, to take in what
is waiting on its sockets, and waits again for any request that entered meanwhile. On an idle
loop that costs ~0.1 ms once per burst (or per lone request).

Counted: POST requests to the generation routes, from the moment their whole body is in (the
middleware sits inside the body-size guard, so a slowly sent body is not waited for) until
the handler submits the job (`submitted`), the response starts, or the handler returns.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# turns of the event loop the generation thread hands it to read what is waiting (see above):
# a connection's accept, read, parse, and its handler's first steps take a few
INTAKE_TURNS = 8

# the arrival of the request the current task is handling
_CURRENT: contextvars.ContextVar[Arrival | None] = contextvars.ContextVar(
    "edge0_arrival", default=None
)


class Arrival:
    """One request between its arrival and its submission; done() once, later calls ignored."""

    def __init__(self, arrivals: Arrivals):
        self._arrivals = arrivals
        self._open = True

    def done(self) -> None:
        if self._open:
            self._open = False
            self._arrivals._leave()


class Arrivals:
    """The count of requests on their way to the generation thread (see the module docstring)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._open = 0
        self._entered = 0  # arrivals ever entered
        self._waited_for = 0  # _entered when settle() last waited
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that receives them

    @property
    def open(self) -> int:
        with self._cv:
            return self._open

    def enter(self, loop: asyncio.AbstractEventLoop | None = None) -> Arrival:
        """A request on its way, received by `loop` (if given: settle() hands it turns)."""
        with self._cv:
            self._open += 1
            self._entered += 1
            if loop is not None:
                self._loop = loop
        return Arrival(self)

    def _leave(self) -> None:
        with self._cv:
            self._open -= 1
            if not self._open:
                self._cv.notify_all()

    def settle(self, limit_s: float) -> float:
        """Unless none entered since the last wait: wait until no request is on its way, then
        let the event loop take in what is waiting (intake) and wait again while more enter,
        all within limit_s; returns the seconds waited."""
        t0 = time.perf_counter()
        deadline = t0 + limit_s
        with self._cv:
            if self._entered == self._waited_for:
                return 0.0
        while True:
            with self._cv:
                self._waited_for = self._entered
                left = deadline - time.perf_counter()
                self._cv.wait_for(lambda: not self._open, timeout=max(left, 0.0))
                loop = self._loop
            left = deadline - time.perf_counter()
            if loop is None or left <= 0 or not intake(loop, left):
                break
            with self._cv:
                if self._entered == self._waited_for:
                    break
        return time.perf_counter() - t0


def intake(loop: asyncio.AbstractEventLoop, timeout: float) -> bool:
    """Let `loop` run INTAKE_TURNS turns (a callback that reschedules itself), in which it
    reads and starts handling what is waiting on its sockets; whether it did so within
    `timeout` (False, too, if the loop is closed)."""
    done = threading.Event()

    def turn(left: int) -> None:
        if left:
            loop.call_soon(turn, left - 1)
        else:
            done.set()

    try:
        loop.call_soon_threadsafe(turn, INTAKE_TURNS)
    except RuntimeError:  # closed
        return False
    return done.wait(timeout)


def submitted() -> None:
    """The current request's job is submitted (or refused): it has arrived."""
    arrival = _CURRENT.get()
    if arrival is not None:
        arrival.done()


class CountArrivals:
    """ASGI middleware: each POST to one of `paths` is an Arrival until it is submitted, its
    response starts, or its handler returns."""

    def __init__(self, app: ASGIApp, arrivals: Arrivals, paths: frozenset[str]):
        self.app, self.arrivals, self.paths = app, arrivals, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        arrival = self.arrivals.enter(asyncio.get_running_loop())
        token = _CURRENT.set(arrival)

        async def started(message: Message) -> None:
            if message["type"] == "http.response.start":
                arrival.done()
            await send(message)

        try:
            await self.app(scope, receive, started)
        finally:
            arrival.done()
            _CURRENT.reset(token)
