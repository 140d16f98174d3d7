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

Counted: POST requests to the generation routes, from the moment their whole body is in (the
middleware sits inside the body-size guard, so a slowly sent body is not waited for) until
the handler submits the job (`submitted`), the response starts, or the handler returns.
"""

from __future__ import annotations

import contextvars
import threading
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

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

    @property
    def open(self) -> int:
        with self._cv:
            return self._open

    def enter(self) -> Arrival:
        with self._cv:
            self._open += 1
            self._entered += 1
        return Arrival(self)

    def _leave(self) -> None:
        with self._cv:
            self._open -= 1
            if not self._open:
                self._cv.notify_all()

    def settle(self, limit_s: float) -> float:
        """Wait until no request is on its way, at most limit_s, unless none entered since the
        last wait; returns the seconds waited."""
        with self._cv:
            if not self._open or self._entered == self._waited_for:
                return 0.0
            self._waited_for = self._entered
            t0 = time.perf_counter()
            self._cv.wait_for(lambda: not self._open, timeout=limit_s)
            return time.perf_counter() - t0


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
        arrival = self.arrivals.enter()
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
