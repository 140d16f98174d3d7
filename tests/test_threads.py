"""Which threads run torch's multi-threaded ops (edge0/threads.py): helper pools run theirs on
one intra-op thread without changing anyone else's count, and the server runs its engine on
the thread that loaded it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import torch

from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.server.app import ServerOptions, create_app
from edge0.server.worker import Worker
from edge0.util.threads import ComputeThread, single_threaded_pool
from test_server import USER, live_server, make_chat_model


def fresh_thread_count() -> int:
    """The intra-op thread count a thread started now gets."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(torch.get_num_threads).result()


def test_a_single_threaded_pool_leaves_other_threads_their_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pool = single_threaded_pool(3, "test-helper")
        try:
            counts = {pool.submit(torch.get_num_threads).result() for _ in range(6)}
            names = {pool.submit(lambda: threading.current_thread().name).result()}
        finally:
            pool.shutdown()
        assert counts == {1}
        assert all(n.startswith("test-helper") for n in names)
        assert torch.get_num_threads() == 2  # this thread's
        assert fresh_thread_count() == 2  # (torch.set_num_threads alone leaves it at 1)
    finally:
        torch.set_num_threads(before)


def test_a_compute_thread_runs_everything_on_one_thread():
    compute = ComputeThread("test-compute")
    try:
        idents = {compute.call(threading.get_ident) for _ in range(4)}
        assert idents == {compute.ident} and compute.ident != threading.get_ident()
        assert compute.submit(sum, [1, 2, 3]).result() == 6
        try:
            compute.call(int, "x")
        except ValueError:
            pass
        else:
            raise AssertionError("call() did not raise the function's error")
    finally:
        compute.close()


def test_the_server_generates_on_the_thread_that_loaded_its_engine(tmp_path):
    """As `edge0 serve` runs it: every forward of a request on the engine's loading thread."""
    compute = ComputeThread("test-generate")
    engine = compute.call(load_engine, make_chat_model(tmp_path), EngineOptions(max_context=256))
    seen: set[int] = set()
    for name in ("prefill", "step"):
        run = getattr(engine, name)

        def recorded(*args, _run=run, **kwargs):
            seen.add(threading.get_ident())
            return _run(*args, **kwargs)

        setattr(engine, name, recorded)
    try:
        app = create_app(engine, ServerOptions(model_name="tiny"), compute)
        with live_server(app) as url:
            body = {"messages": USER, "max_tokens": 6, "temperature": 0}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        assert seen == {compute.ident}
    finally:
        compute.call(engine.close)
        compute.close()


def test_a_generation_loop_that_fails_says_so_at_once(caplog, monkeypatch):
    """The loop runs on a ComputeThread, whose failure would otherwise wait in a future
    until stop(): it is logged when it happens, and stop() still returns."""
    engine = SimpleNamespace(scheduler=lambda **kw: SimpleNamespace(max_active=1))
    worker = Worker(engine)

    def broken():
        raise RuntimeError("the loop broke")

    monkeypatch.setattr(worker, "_loop", broken)
    with caplog.at_level(logging.ERROR, logger="edge0.server.worker"):
        worker.start()
        deadline = time.monotonic() + 10
        while "the loop broke" not in caplog.text:
            assert time.monotonic() < deadline, "the failure was not logged"
            time.sleep(0.01)
    worker.stop()
    assert "the generation thread stopped: the loop broke" in caplog.text


FIRST_CALLS = """
import sys, torch
from edge0.util.threads import resolve_vector_math
resolve_vector_math()
x = torch.arange(254).float()[:, None] * torch.ones(64)
first = x.cos()  # a rotary table: split over the threads
e = (torch.arange(254).float()[:, None] * torch.linspace(-1, 1, 64)) / 3
first_exp = e.exp()
ok = (first.double() - x.double().cos()).abs().max().item() < 1e-6
ok = ok and (first_exp.double() - e.double().exp()).abs().max().item() < 1e-6 * e.exp().max()
print("RIGHT" if ok and torch.equal(first, x.cos()) else "WRONG")
"""


def test_the_first_parallel_transcendental_call_of_a_process_is_right():
    """Without resolve_vector_math, 1 to 5 in 20 fresh processes computed their first split
    cos or exp wrongly on one thread's half (threads.py). Sixteen fresh processes, each right."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    for _ in range(16):
        out = subprocess.run(
            [sys.executable, "-c", FIRST_CALLS], env=env, capture_output=True, text=True
        )
        assert out.stdout.strip() == "RIGHT", out.stderr[-2000:]
