"""Process memory as the kernel sees it, split into anonymous and file-backed resident bytes.

Anonymous memory (heap, torch tensors, the expert pool) cannot be reclaimed under pressure;
file-backed pages (mapped libraries, mmap-read extents) can be. Peak values come from a
sampling thread, because the kernel only keeps a peak of the total (VmHWM). It reads
/proc/self/status (RssAnon, RssFile: ~0.02 ms a read), never /proc/self/smaps_rollup, whose
walk of every mapping costs 15-33 ms at 1-3 GiB of RSS on the cores that decode.
Note: pages that buffered reads leave in the page cache are not mapped into the process, so
they appear in neither number; a memory cgroup charges them and can reclaim them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """'512M', '2GiB', '1.5g', '4096' -> bytes (binary units). Raises ValueError naming the text."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise ValueError(f"cannot read size {text!r}; write e.g. 512M, 2G or 1.5GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


@dataclass(frozen=True)
class MemorySample:
    anon_bytes: int
    file_bytes: int


def sample() -> MemorySample:
    """Current resident anonymous and file-backed bytes of this process (RssAnon, RssFile)."""
    anon = file = 0
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith(b"RssFile:"):
                file = int(line.split()[1]) * 1024
                break  # RssFile follows RssAnon
    return MemorySample(anon_bytes=anon, file_bytes=file)


@dataclass(frozen=True)
class CgroupMemory:
    """The memory cgroup this process is in: the tightest limit on its way to the root (None:
    unlimited) and what the group uses now, page cache included."""

    limit: int | None
    usage: int


# cgroup v1 writes "unlimited" as a number near 2^63
_UNLIMITED = 1 << 62


def cgroup_memory(
    proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> CgroupMemory | None:
    """This process's memory cgroup, from `proc` (its /proc/self/cgroup) and the cgroup file
    systems under `root`: v1 (memory/PATH/memory.limit_in_bytes, memory.usage_in_bytes) and v2
    (PATH/memory.max, memory.current, at root or root/unified). Where both hold a limit, the
    smaller counts. None where neither can be read (no cgroups, another OS)."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[int | None, int]] = []
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if "memory" in controllers.split(","):
            got = _group(root / "memory", rel, "memory.limit_in_bytes", "memory.usage_in_bytes")
        elif hid == "0" and controllers == "":
            got = None
            for base in (root, root / "unified"):
                got = got or _group(base, rel, "memory.max", "memory.current")
        else:
            continue
        if got is not None:
            found.append(got)
    if not found:
        return None
    limits = [limit for limit, _ in found if limit is not None]
    return CgroupMemory(min(limits) if limits else None, max(usage for _, usage in found))


def _group(base: Path, rel: str, limit_file: str, usage_file: str):
    """(the tightest limit from the group up to `base`, the group's usage), or None."""
    group = base / rel
    try:
        usage = int((group / usage_file).read_text())
    except (OSError, ValueError):
        return None
    limit = None
    node = group
    while True:
        try:
            text = (node / limit_file).read_text().strip()
        except OSError:
            text = "max"
        if text != "max" and int(text) < _UNLIMITED:
            limit = int(text) if limit is None else min(limit, int(text))
        if node == base or base not in node.parents:
            break
        node = node.parent
    return limit, usage


@dataclass(frozen=True)
class MachineMemory:
    """What the serving plan needs of the process and the machine: the bytes the process
    holds before any weight is read (its runtime: Python, torch, the tokenizer), the memory
    limit it runs under (its cgroup's; None: none), and what it may still take (MemAvailable,
    within the limit)."""

    runtime: int
    limit: int | None
    available: int

    @classmethod
    def now(cls) -> MachineMemory:
        free = mem_available()
        group = cgroup_memory()
        limit = group.limit if group is not None else None
        if limit is not None:
            free = min(free, max(0, limit - group.usage))
        return cls(runtime=sample().anon_bytes, limit=limit, available=free)


def mem_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def release_freed() -> None:
    """Give the C heap's freed memory back to the system (glibc's malloc_trim; a no-op where
    there is none). Large tensors freed between forwards otherwise stay in the process's
    heap: routing 4,096-token windows through a 1.94 GiB pool grew anonymous memory by
    ~0.1 GiB a forward without it, and stayed flat with it at no measurable cost."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def map_large_allocations(threshold: int = 1 << 20) -> None:
    """Have the C heap serve every allocation of `threshold` bytes or more from its own
    mapping, returned to the system when freed (glibc's mallopt M_MMAP_THRESHOLD; a no-op
    where there is none). glibc raises its threshold as large blocks are freed, up to 32 MiB,
    and then keeps freed scratch of every size in its arenas: the backward pass of one
    training step of the 35B tier's int4 student (dequantized scratch of many sizes) left
    anonymous memory 1.03 GiB above where its forward ended; with this (and the prerouter
    off) 0.02 GiB below."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, threshold)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to call
        return None


class PeakSampler:
    """Keeps the peaks of /proc/self/status while it runs; a context manager. One daemon
    thread (`_Sampling`) samples for every PeakSampler of the process that is running."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.peak_anon = 0
        self.peak_file = 0

    def _note(self, s: MemorySample) -> None:
        self.peak_anon = max(self.peak_anon, s.anon_bytes)
        self.peak_file = max(self.peak_file, s.file_bytes)

    def start(self) -> PeakSampler:
        self._note(sample())
        _SAMPLING.add(self)
        return self

    def stop(self) -> None:
        _SAMPLING.remove(self)
        if not sys.is_finalizing():  # at exit, `open` may be gone already
            self._note(sample())

    def __enter__(self) -> PeakSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Sampling:
    """The thread that samples for every running PeakSampler, at the shortest interval one of
    them asks for. It starts with the first and then waits, idle, for the next: each of the
    server's requests has a PeakSampler, and starting a thread for each cost its first token
    ~0.45 ms (7 requests started together: 3 of their 4 ms)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._running: set[PeakSampler] = set()
        self._thread: threading.Thread | None = None

    def add(self, p: PeakSampler) -> None:
        with self._cond:
            self._running.add(p)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="edge0-mem", daemon=True)
                self._thread.start()
            self._cond.notify()  # its interval may be the shortest

    def remove(self, p: PeakSampler) -> None:
        if sys.is_finalizing():
            # At exit the interpreter freezes daemon threads where they stand, this one perhaps
            # holding the lock: a PeakSampler stopped then (a generator closed as its module is
            # torn down) waited on it forever. The thread no longer runs, so no lock is needed.
            self._running.discard(p)
            return
        with self._cond:
            self._running.discard(p)

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._running:
                    self._cond.wait()
                    continue
                self._cond.wait(min(p.interval_s for p in self._running))
                s = sample()  # ~0.02 ms, under the lock: a sampler that stops waits for it
                for p in self._running:
                    p._note(s)

    def _forked(self) -> None:
        """In a forked child the thread does not exist: start afresh."""
        self._cond = threading.Condition()
        self._running, self._thread = set(), None


_SAMPLING = _Sampling()
os.register_at_fork(after_in_child=_SAMPLING._forked)
