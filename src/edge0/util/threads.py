"""Which threads run torch's multi-threaded ops: in each process, one.

torch's CPU build runs its intra-op parallelism on libgomp (GNU OpenMP). Every thread that has
run a multi-threaded op keeps a team of OpenMP threads for as long as it lives, and libgomp
lets idle team threads spin-wait for the next parallel region only while the process has no
more OpenMP threads than CPUs. Past that it puts them to sleep at the end of every region,
and each region then pays a futex wake-up. On 2 vCPUs (Intel Xeon family 6 model 167, torch
2.13.0+cpu), one more thread that has run a parallel op once and then idles makes a
[1, 1024] x [1024, 1024] fp32 matmul on the main thread 137 us instead of 45 us. The server
loaded its engine on the main thread and ran it on its generation thread, and a built-in
model decode step took 10.8 ms there instead of 4.2 ms on the thread that loaded it
(docs/server.md).

So:
- `ComputeThread`: a process whose main thread must stay free (the server's owns the
  signals) loads, runs and closes its model on this one thread;
- `single_threaded_pool`: helper threads that run torch ops beside the model (the expert
  pool's readers, the prerouter's heads) run them on one intra-op thread each, so they never
  start a team.

`torch.set_num_threads` sets the calling thread's count and also the default that every
thread takes at its first use of torch's threads; `single_threaded_pool`'s threads take the
default first, then set one, and the pool puts the default back, so that a thread started
later is not left with one.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class ComputeThread:
    """One thread that runs what is handed to it, in order: a model's load, its forwards
    and its close (see the module docstring)."""

    def __init__(self, name: str = "edge0-compute"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.ident = self._pool.submit(threading.get_ident).result()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run fn on the thread after what was handed to it before."""
        return self._pool.submit(fn, *args, **kwargs)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the thread; waits for it and returns (or raises) its result."""
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """Let what was handed to the thread finish, then end it."""
        self._pool.shutdown(wait=True)


def single_threaded_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of `workers` threads whose torch ops run on one intra-op thread each, started
    now, with torch's default count for other threads left as it was."""
    n = torch.get_num_threads()
    ready = threading.Barrier(workers + 1)
    pool = ThreadPoolExecutor(
        max_workers=workers,
        thread_name_prefix=name,
        initializer=_one_thread,
        initargs=(ready,),
    )
    for _ in range(workers):  # every thread is started while the barrier holds the others
        pool.submit(lambda: None)
    ready.wait()
    torch.set_num_threads(n)  # the default for threads started later, and this thread's
    return pool


def _one_thread(ready: threading.Barrier) -> None:
    torch.get_num_threads()  # torch takes this thread's count from the default on first use
    torch.set_num_threads(1)  # (then it would take the default back once it is restored)
    ready.wait()


@functools.cache  # once a process: the CLI and load_engine both call it
def resolve_vector_math() -> None:
    """Call torch's vectorized transcendental functions once each, on a few values, on this
    thread alone, before any parallel op uses them.

    In a fresh process, the first call of one of them that torch splits over its threads
    could compute the second thread's half wrongly (torch 2.13.0+cpu, 2 threads, Intel Xeon
    family 6 model 167): the cos of [254, 64] rotary angles was off by up to 1.5e-4 from row
    127 on in 1 of 20 processes, exp wrong in 5 of 20, sin in 3 of 30, the fp64 cos in 4 of
    30; every later call was right. After this function, none of 30 (cos and exp). Without
    it the first engine of a process sometimes decoded to other logits than the next one:
    the rotary table of its first prompt is such a call.
    """
    functions = (
        torch.exp,
        torch.log,
        torch.cos,
        torch.sin,
        torch.tan,
        torch.tanh,
        torch.erf,
        torch.expm1,
        torch.log1p,
        torch.sigmoid,
        torch.atan,
    )
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        x = torch.linspace(0.1, 0.9, 64, dtype=dtype)
        for fn in functions:
            fn(x)
        torch.softmax(x, 0)
        torch.pow(x, x)
