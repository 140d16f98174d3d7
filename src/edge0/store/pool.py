"""The bounded expert pool: fixed slots in one anonymous mapping, LRU over (layer, expert).

The pool's memory is allocated once, at construction, for `capacity_bytes // extent_bytes`
slots, and never grows: the budget is an input, not an outcome. Every layer shares it.
Reads run on a pool of I/O threads (`os.preadv` releases the GIL) straight into the slot
buffers; the caller only waits for a read it needs now, and that wait is measured.

An entry is pinned while someone holds it (a layer computing with it, or a prefetch that
staged it for the next token); only unpinned, finished entries are evicted.

`layout` is what the pool hands out: its int4 arrangement must be the host kernel's, or
that arrangement's int8 order (with the `reorder` that puts codes in it). The I/O thread
finalizes each read into it (`kernel_pairs` turns its stored scale pairs into the kernel's),
repacking the codes if the file was written in another arrangement (the engine normally
avoids that with a once-per-machine copy). Under a memory cap these threads share the cores
that decode, so what they compute per read is kept small.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from edge0.formats import quant
from edge0.formats.extents import ExpertTensors, ExtentLayout
from edge0.formats.int4_layout import Int4Layout
from edge0.formats.integrity import VERIFY_READS, checksum
from edge0.store.expert_file import ExpertFile
from edge0.util.threads import single_threaded_pool

log = logging.getLogger(__name__)

IOV_MAX = 1024  # Linux limit on buffers per preadv


def advise_huge_pages(mem: mmap.mmap) -> None:
    """Ask Linux to back `mem` with transparent huge pages where it allows them.

    The kernels read a token's experts from slots spread over gigabytes; with 4 KiB pages a
    kernel block's codes and its scale rows (a page per group) cost TLB misses. Huge pages
    took 4-5% off an uncapped int8 decode step on the peer bench shape (docs/kernels.md).
    With THP set to `madvise` (most distributions) nothing else gives them; with `never`
    this does nothing. A slot is still only memory once it is read into.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:  # not Linux
        return
    try:
        mem.madvise(advice)
    except OSError:  # a kernel built without THP: 4 KiB pages, as before
        log.debug("no transparent huge pages for the expert pool")


class PoolExhausted(RuntimeError):
    """More experts were pinned at once than the pool has slots."""


@dataclass
class PoolStats:
    """Counters since the last reset. Times are nanoseconds."""

    hits: int = 0  # requested experts already resident or in flight
    loads: int = 0  # experts read from disk
    reads: int = 0  # read syscalls (a run of consecutive experts is one)
    bytes_read: int = 0
    disk_ns: int = 0  # summed time inside read calls on the I/O threads
    blocked_ns: int = 0  # time the compute thread waited for reads it needed
    evictions: int = 0

    def snapshot(self) -> PoolStats:
        return PoolStats(**vars(self))

    def minus(self, other: PoolStats) -> PoolStats:
        return PoolStats(**{k: v - getattr(other, k) for k, v in vars(self).items()})


@dataclass
class Entry:
    """One resident (or arriving) expert: a slot, its tensor views, and its read."""

    key: tuple[int, int]
    slot: int
    tensors: ExpertTensors
    future: Future
    pins: int = 0
    failed: bool = field(default=False)
    loaded: bool = False  # the read finished and its bytes are in the slot (future.done()
    # says the same, at a lock's cost per call)


class ExpertPool:
    """Slots for expert extents, shared by all layers; see the module docstring."""

    def __init__(
        self,
        file: ExpertFile,
        layout: ExtentLayout,
        capacity_bytes: int,
        io_threads: int = 4,
        reorder: Callable[[torch.Tensor, Int4Layout], None] | None = None,
        kernel_pairs: Callable[[torch.Tensor], None] = quant.to_kernel_pairs,
        verify: str = "first",
    ):
        if layout.nbytes != file.extent_bytes:
            raise ValueError(
                f"{file.path}: extents are {file.extent_bytes} bytes, "
                f"layout expects {layout.nbytes}"
            )
        if verify not in VERIFY_READS:
            raise ValueError(f"verify_reads must be one of {', '.join(VERIFY_READS)}: {verify!r}")
        self.file = file
        self.layout = layout
        # each read's bytes against the extent's checksum: every read, or only an extent's first
        # in this process (a damaged file is found the first time an expert is used), or never
        self._verify = verify if file.sums is not None else "off"
        self._verified: set[tuple[int, int]] = set()
        self._reorder = reorder  # a layout in the int8 order: ExtentLayout.finalize
        self._kernel_pairs = kernel_pairs
        self.extent_bytes = layout.nbytes
        self.num_slots = capacity_bytes // self.extent_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"expert pool of {capacity_bytes} bytes holds no {self.extent_bytes}-byte extent"
            )
        self.capacity_bytes = self.num_slots * self.extent_bytes
        # Anonymous, page-aligned: valid O_DIRECT targets; untouched pages cost nothing.
        self._mem = mmap.mmap(-1, self.capacity_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advise_huge_pages(self._mem)
        self._slots = torch.frombuffer(self._mem, dtype=torch.uint8).view(self.num_slots, -1)
        self._views = [
            memoryview(self._mem)[i * self.extent_bytes : (i + 1) * self.extent_bytes]
            for i in range(self.num_slots)
        ]
        # each slot's tensor views, made at its first use: making them costs ~20 us (8 ATen
        # view ops), once per read on the compute thread and once more on the reader before
        self._tensors: list[ExpertTensors | None] = [None] * self.num_slots
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._entries: OrderedDict[tuple[int, int], Entry] = OrderedDict()  # LRU first
        self._pinned = 0  # entries with pins > 0, so available() is O(1)
        # entries that left the pool (evicted, failed, cleared): whoever keeps slot views
        # beyond a request (engine/backends/native_token.py) takes them again when it moves
        self.changes = 0
        self._lock = threading.Lock()
        # told each slot's state as it changes, under the lock: 0 its read is on its way, 1
        # loaded, -1 the read failed (watch(): a staged decode in one native call waits on them)
        self._on_slot: Callable[[int, int], None] | None = None
        # readers convert what they read with torch ops: one intra-op thread each (threads.py)
        self._io = single_threaded_pool(io_threads, "edge0-io")
        self.stats = PoolStats()

    def fault_in(self) -> None:
        """Back every slot with memory now, not at its first read.

        A slot's first read faults its pages in on the I/O thread; with the huge pages the
        pool asks for, the kernel may first have to reclaim and compact memory for each one
        (~1.1 s per GiB measured here with the page cache full, 0.06 s with free huge pages).
        During decode that cost lands on the two cores that compute, and page faults hold the
        process's mmap lock, which the compute thread's allocations wait on: the first ~20
        capped prerouter steps of the peer bench shape at K=2 took 25-83 ms against 12-24 ms
        after the pool had filled. Paid here, at load, the budget is also resident from the
        start, as the plan says it is. (A pool that preloads every expert faults in as it
        reads; it needs no call.)
        """
        assert not self._entries, "fault_in zeroes the slots: call it before any read"
        slots = self._slots
        if slots is not None and slots.numel():
            t0 = time.perf_counter()
            slots.view(-1)[:: mmap.PAGESIZE].fill_(0)  # a write per page; the rest is zero
            log.info(
                "expert pool of %.0f MiB in memory in %.2f s",
                self.capacity_bytes / 2**20,
                time.perf_counter() - t0,
            )

    # -- occupancy ------------------------------------------------------------------------

    @property
    def resident_bytes(self) -> int:
        """Bytes of slots in use (resident or arriving)."""
        with self._lock:
            return (self.num_slots - len(self._free)) * self.extent_bytes

    def available(self) -> int:
        """Slots that a request could take (free, or held by unpinned entries)."""
        with self._lock:
            return len(self._free) + len(self._entries) - self._pinned

    def is_resident(self, layer: int, expert: int) -> bool:
        with self._lock:
            entry = self._entries.get((layer, expert))
            return entry is not None and entry.future.done() and not entry.failed

    def watch(self, on_slot: Callable[[int, int], None]) -> None:
        """Call on_slot(slot, state) whenever a slot's state changes from now on (0: an expert's
        read into it is on its way, 1: loaded, -1: its read failed), after one call for each
        slot in use now. It runs under the pool's lock, on any thread: it must not call back."""
        with self._lock:
            self._on_slot = on_slot
            for en in self._entries.values():
                on_slot(en.slot, -1 if en.failed else 1 if en.loaded else 0)

    def slot_tensors(self) -> list[ExpertTensors]:
        """Every slot's tensor views, by slot (the same objects for the pool's life)."""
        with self._lock:
            return [self._slot_tensors(slot) for slot in range(self.num_slots)]

    def count_blocked(self, ns: int) -> None:
        """Time a caller waited for reads without wait() (a native call's wait)."""
        with self._lock:
            self.stats.blocked_ns += ns

    # -- requests ---------------------------------------------------------------------------

    def request(self, layer: int, experts: Sequence[int]) -> list[Entry]:
        """Pin each expert of `layer`, starting reads for the missing ones; does not wait.

        Consecutive missing experts are read with one preadv. Raises PoolExhausted if the
        pool cannot hold them all at once (nothing is pinned then).
        """
        keys = [(layer, int(e)) for e in experts]
        with self._lock:  # the common case at decode: every one of them resident or arriving
            get = self._entries.get
            present = [get(k) for k in keys]
            if None not in present:
                move = self._entries.move_to_end
                for entry in present:  # _pin_present, inlined: this runs K times a layer
                    move(entry.key)
                    self._pinned += entry.pins == 0
                    entry.pins += 1
                self.stats.hits += len(present)
                return present
        wanted = set(keys)
        while True:
            with self._lock:
                short = sum(1 for k in wanted if k not in self._entries) - len(self._free)
                # Evictable entries, oldest first, only as many as needed: a request must cost
                # O(K), not O(pool), or a pool holding every expert slows every step.
                inflight = []
                for en in self._entries.values():
                    if short <= 0:
                        break
                    if en.pins == 0 and en.key not in wanted:
                        if en.future.done():
                            short -= 1
                        else:
                            inflight.append(en.future)
                if short <= 0:
                    out, missing = self._pin(keys)
                    break
                if short > len(inflight):
                    raise PoolExhausted(
                        f"layer {layer} needs {short - len(inflight)} more expert slots; the "
                        f"pool has {self.num_slots} ({self.capacity_bytes} bytes) and the rest "
                        "are pinned. Raise memory_budget or expert_cache."
                    )
                # only unpinned reads still in flight can make room: wait for them, unlocked
                inflight = inflight[:short]
            for fut in inflight:
                fut.exception()
        missing.sort(key=lambda en: en.key[1])
        for run in _runs(missing):
            self._io.submit(self._load_run, layer, run)
        return out

    def peek(
        self, layer: int, experts: Sequence[int], uses: int | None = None
    ) -> list[ExpertTensors] | None:
        """The tensors of `layer`'s experts if every one is loaded, each made the most
        recently used, without pinning them; else None (request them). Only for a caller on
        the one thread that requests from this pool, which uses them before it requests
        again: evicting happens in request(), so nothing can take their slots meanwhile.
        `uses`: the hits to count (default one an expert; several requests' rows count each
        row's own)."""
        with self._lock:
            get = self._entries.get
            present = [get((layer, e)) for e in experts]
            if None in present or not all(en.loaded for en in present):
                return None
            move = self._entries.move_to_end
            for entry in present:
                move(entry.key)
            self.stats.hits += len(present) if uses is None else uses
        return [en.tensors for en in present]

    def every_expert(self, layers: int, n: int) -> list[list[ExpertTensors]] | None:
        """The tensors of every expert of layers 0..layers-1 (n each), by layer and expert, if
        every one is loaded; else None. Nothing is pinned: the caller keeps them while
        `changes` stays as it was (no entry left the pool, so no slot was reused)."""
        with self._lock:
            if len(self._entries) < layers * n:
                return None
            get = self._entries.get
            out = []
            for layer in range(layers):
                present = [get((layer, e)) for e in range(n)]
                if None in present or not all(en.loaded for en in present):
                    return None
                out.append([en.tensors for en in present])
        return out

    def count_hits(self, n: int) -> None:
        """n lookups that found their expert loaded, made without the pool (every_expert)."""
        with self._lock:
            self.stats.hits += n

    def _pin(self, keys: list[tuple[int, int]]) -> tuple[list[Entry], list[Entry]]:
        """Under the lock: pin keys, creating entries (and taking slots) for missing ones.

        Present entries are pinned first, so making room can never evict one of them.
        """
        found = {}
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                self._pin_present(entry)
                found[key] = entry
        missing = []
        for key in keys:
            if key not in found:
                slot = self._take_slot()
                entry = Entry(
                    key=key,
                    slot=slot,
                    tensors=self._slot_tensors(slot),
                    future=Future(),
                    pins=1,
                )
                self._entries[key] = found[key] = entry
                self._pinned += 1
                missing.append(entry)
                if self._on_slot is not None:
                    self._on_slot(slot, 0)
        return [found[k] for k in keys], missing

    def _pin_present(self, entry: Entry) -> None:
        """Under the lock: one more pin on an entry present in the pool (most recently used)."""
        self._entries.move_to_end(entry.key)
        self.stats.hits += 1
        self._pinned += entry.pins == 0
        entry.pins += 1

    def _slot_tensors(self, slot: int) -> ExpertTensors:
        """Under the lock: the views of a slot's extent (the same objects every time)."""
        t = self._tensors[slot]
        if t is None:
            t = self._tensors[slot] = self.layout.views(self._slots[slot])
        return t

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        for key, entry in self._entries.items():  # oldest first
            if entry.pins == 0 and entry.future.done():
                del self._entries[key]
                self.stats.evictions += 1
                self.changes += 1
                return entry.slot
        raise AssertionError("request() checked capacity before taking slots")

    def _load_run(self, layer: int, run: list[Entry]) -> None:
        try:
            t0 = time.perf_counter_ns()
            got = self.file.read_run(layer, run[0].key[1], [self._views[en.slot] for en in run])
            dt = time.perf_counter_ns() - t0
            if self._verify != "off":
                self._check(run)
            # the views may have been made under the engine's inference mode (a step's first
            # touch of a slot): torch refuses an in-place update of those outside it
            with torch.inference_mode():
                for en in run:
                    self.layout.finalize_views(
                        en.tensors, self.file.int4, self._reorder, self._kernel_pairs
                    )
            with self._lock:
                self.stats.reads += 1
                self.stats.loads += len(run)
                self.stats.bytes_read += got
                self.stats.disk_ns += dt
                for en in run:
                    en.loaded = True
                    if self._on_slot is not None:
                        self._on_slot(en.slot, 1)
            for en in run:
                en.future.set_result(None)
        except BaseException as exc:  # handed to whoever waits on these entries
            log.error("reading layer %d experts %s failed: %s", layer, [e.key[1] for e in run], exc)
            with self._lock:
                for en in run:
                    en.failed = True
                    if self._on_slot is not None:
                        self._on_slot(en.slot, -1)
            for en in run:
                en.future.set_exception(exc)

    def _check(self, run: list[Entry]) -> None:
        """The run's extents as read against their checksums (ModelDataError naming the first
        that differs); with verify "first", only those not checked before in this process."""
        sums = self.file.sums
        for en in run:
            if self._verify == "first" and en.key in self._verified:
                continue
            layer, expert = en.key
            if checksum(self._views[en.slot]) != int(sums[layer][expert]):
                raise self.file.damaged(layer, expert)
            self._verified.add(en.key)

    def wait(self, entries: Sequence[Entry]) -> list[ExpertTensors]:
        """Block until every entry is loaded; the time spent blocked is counted."""
        pending = [en for en in entries if not en.loaded]
        if pending:
            t0 = time.perf_counter_ns()
            for en in pending:
                en.future.exception()  # waits without raising
            with self._lock:
                self.stats.blocked_ns += time.perf_counter_ns() - t0
        for en in entries:
            if en.failed:
                self._forget_failed(en)
                en.future.result()  # raises the read error
        return [en.tensors for en in entries]

    def _forget_failed(self, entry: Entry) -> None:
        with self._lock:
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
                self.changes += 1
                self._pinned -= entry.pins > 0
                entry.pins = 0
                self._free.append(entry.slot)

    def release(self, entries: Sequence[Entry]) -> None:
        """Unpin entries; they stay cached until evicted."""
        with self._lock:
            for en in entries:
                if en.pins > 0:
                    en.pins -= 1
                    self._pinned -= en.pins == 0

    def clear(self) -> None:
        """Drop every unpinned entry (waits for reads in flight first)."""
        with self._lock:
            entries = list(self._entries.values())
        for en in entries:
            en.future.exception()
        with self._lock:
            for key, en in list(self._entries.items()):
                if en.pins == 0:
                    del self._entries[key]
                    self._free.append(en.slot)
                    self.changes += 1

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._views, self._tensors = [], []
        self._slots = None
        self.file.close()


def _runs(entries: list[Entry]) -> list[list[Entry]]:
    """Split entries sorted by expert id into runs of consecutive ids (at most IOV_MAX long)."""
    runs: list[list[Entry]] = []
    for en in entries:
        if runs and en.key[1] == runs[-1][-1].key[1] + 1 and len(runs[-1]) < IOV_MAX:
            runs[-1].append(en)
        else:
            runs.append([en])
    return runs
