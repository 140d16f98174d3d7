"""Memory accounting: anonymous and file-backed resident bytes, and the peak sampler."""

from __future__ import annotations

import mmap
import subprocess
import sys
import threading
import time

from edge0.util import memory

MIB = 1 << 20


def touched_anonymous(size: int) -> mmap.mmap:
    """Fresh anonymous pages, every one written (an allocator could reuse resident memory)."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(0, size, 4096):
        m[i] = 1
    return m


def test_anonymous_and_file_backed_bytes_are_told_apart(tmp_path):
    before = memory.sample()
    anon = touched_anonymous(64 * MIB)
    grown = memory.sample()
    assert grown.anon_bytes - before.anon_bytes >= 60 * MIB
    path = tmp_path / "f"
    path.write_bytes(b"\1" * (32 * MIB))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        total = sum(m[i] for i in range(0, len(m), 4096))  # fault every page in
        mapped = memory.sample()
    assert total == 32 * MIB // 4096
    assert mapped.file_bytes - grown.file_bytes >= 30 * MIB
    assert abs(mapped.anon_bytes - grown.anon_bytes) < 16 * MIB
    anon.close()


def test_peak_sampler_sees_a_short_peak():
    with memory.PeakSampler(interval_s=0.005) as peaks:
        start = memory.sample().anon_bytes
        m = touched_anonymous(32 * MIB)
        time.sleep(0.05)
        m.close()
        assert memory.sample().anon_bytes - start < 16 * MIB  # the peak is gone...
    assert peaks.peak_anon - start >= 30 * MIB  # ...and was seen


def test_peak_samplers_share_one_thread_that_outlives_them():
    """Each of the server's requests has a PeakSampler: they must not each start a thread."""
    first = memory.PeakSampler(interval_s=0.005).start()
    first.stop()
    samplers = [memory.PeakSampler(interval_s=0.005).start() for _ in range(5)]
    try:
        assert [t.name for t in threading.enumerate()].count("edge0-mem") == 1
        start = memory.sample().anon_bytes
        m = touched_anonymous(32 * MIB)
        time.sleep(0.05)
        m.close()
    finally:
        for s in samplers:
            s.stop()
    assert all(s.peak_anon - start >= 30 * MIB for s in samplers)
    assert first.peak_anon < start + 16 * MIB  # stopped before the peak: not told of it


EXITS_WITH_A_SAMPLER_RUNNING = r"""
import threading
from edge0.util import memory
from edge0.util.memory import PeakSampler

def generation():
    with PeakSampler():
        yield 1
        yield 2

started = generation()
next(started)  # left open: it is closed, and its sampler stopped, as __main__ is torn down
others = [PeakSampler().start() for _ in range(3)]
held = threading.Event()
# the sampling thread as the interpreter may freeze it at exit: holding its lock (defined
# outside __main__'s globals, which a running thread's function would keep from being torn down)
holder = {}
HOLD = "import time\ndef hold(lock, held):\n with lock:\n  held.set()\n  time.sleep(60)"
exec(HOLD, holder)
threading.Thread(target=holder["hold"], args=(memory._SAMPLING._cond, held), daemon=True).start()
held.wait()
"""


def test_a_process_exits_while_its_samplers_run():
    """A process that ends with PeakSamplers running, one of them stopped by a generator closed
    at exit while the sampling thread holds its lock: it exits, with nothing on stderr. Before,
    such a process hung (5 of 40 did with the real thread): the interpreter had frozen the
    sampling thread holding the lock that stop() then waited for."""
    done = subprocess.run(
        [sys.executable, "-c", EXITS_WITH_A_SAMPLER_RUNNING],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0 and done.stderr == ""
