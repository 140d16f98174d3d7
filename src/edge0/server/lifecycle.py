"""Running uvicorn until SIGTERM or Ctrl-C, then stopping in order.

uvicorn runs on a thread of its own so that the main thread owns the signals: uvicorn's own
handling re-raises SIGTERM once it has stopped, which kills the process before the engine is
closed. On the first signal:

1. requests waiting in the queue, and any new one, get 503 `shutting_down` at once (a stream
   gets that error as an event, then `data: [DONE]`);
2. uvicorn stops accepting connections;
3. the running request gets `grace_s` to finish, then ends with the same error;
4. uvicorn sends what the handlers still have and returns; the caller closes the engine.

A signal during the drain changes nothing but a log line saying how long is left: cutting the
drain short would end streams without their final event (SIGKILL stops at once).

uvicorn's loggers propagate to the root logger, so its lines take the server's format
(requestlog.configure); its access line is off, as each request's own line replaces it.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time

import uvicorn

from edge0.server.http import Timeouts, protocol
from edge0.server.worker import Worker

log = logging.getLogger(__name__)

POLL_S = 0.1
# after the running request ends, what the handlers still have to send takes moments
FINISH_S = 5.0


def uvicorn_config(app, timeouts: Timeouts, log_level: str = "warning", **kw) -> uvicorn.Config:
    """uvicorn's settings for `app`: the timed protocol (server/http.py), its loggers as the
    module docstring says; `kw`: host, port, ..."""
    return uvicorn.Config(
        app,
        http=protocol(timeouts),
        timeout_keep_alive=timeouts.keep_alive_s,
        log_level=log_level,
        log_config=None,
        access_log=False,
        **kw,
    )


def serve(
    app,
    worker: Worker,
    host: str,
    port: int,
    log_level: str,
    grace_s: float,
    timeouts: Timeouts | None = None,
) -> bool:
    """Serve `app` until a signal, then stop as the module docstring says.

    Returns False when uvicorn stopped by itself before serving (it logged why: a port in
    use, an address it cannot bind).
    """
    config = uvicorn_config(
        app,
        timeouts or Timeouts(),
        log_level,
        host=host,
        port=port,
        timeout_graceful_shutdown=grace_s + FINISH_S,
    )
    server = uvicorn.Server(config)
    signals: queue.SimpleQueue[int] = queue.SimpleQueue()

    def on_signal(sig: int, _frame) -> None:  # only queues it: the main loop below acts
        signals.put(sig)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    # a process spawned from a thread that blocks signals inherits that mask across exec;
    # unblocked here, SIGTERM still reaches the handler instead of waiting forever
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, previous)
    thread = threading.Thread(target=server.run, name="edge0-http")
    try:
        thread.start()
        sig = _first_signal(signals, thread)
        if sig is None:
            return server.started
        log.warning(
            "%s: refusing new requests; the running one has %.0f s to finish",
            signal.Signals(sig).name,
            grace_s,
        )
        worker.refuse_new()
        server.should_exit = True
        deadline = time.monotonic() + grace_s
        while not worker.wait_idle(POLL_S):
            _note_repeats(signals, deadline)
            if time.monotonic() >= deadline:
                worker.cancel_running()
                break
        while thread.is_alive():
            thread.join(POLL_S)
            _note_repeats(signals, None)
        return True
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _note_repeats(signals: queue.SimpleQueue[int], deadline: float | None) -> None:
    """Log the signals that came during the drain (they change nothing)."""
    while not signals.empty():
        name = signal.Signals(signals.get_nowait()).name
        if deadline is None:
            log.warning("%s: already stopping; the last responses are being sent", name)
        else:
            log.warning(
                "%s: already stopping; the running requests have %.1f s left to finish "
                "(SIGKILL stops at once)",
                name,
                max(0.0, deadline - time.monotonic()),
            )


def _first_signal(signals: queue.SimpleQueue[int], thread: threading.Thread) -> int | None:
    """The first signal, or None if the server thread ends first."""
    while thread.is_alive():
        try:
            return signals.get(timeout=POLL_S)
        except queue.Empty:
            continue
    return None
