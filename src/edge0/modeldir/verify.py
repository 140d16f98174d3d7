"""`edge0 verify`: an edge0 directory (and this machine's relayout copies of it) checked byte
for byte against what was recorded when it was written.

Quick: every header against edge0.json (the files it lists are there and are regular files,
each safetensors header parses and covers its file, the experts' extent size and each layer's
offset and count). Whole (the default), besides: every expert extent against its xxh3-64
checksum, naming the layer and expert, and every other file against the SHA-256 edge0.json
records (an experts file written before extents had checksums is hashed whole, and the report
says that is all it can check). A reader thread reads ahead while the caller's thread hashes,
so the check runs at about the disk's read rate (docs/format.md).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from edge0 import modeldir
from edge0.formats.checkpoint import read_header
from edge0.formats.extents import ALIGN
from edge0.formats.integrity import ModelDataError, checksum
from edge0.store.expert_file import FILE_NAME as EXPERTS_FILE
from edge0.store.expert_file import SOURCE_KEY, LayerExtents, read_sums, read_table
from edge0.util.paths import default_cache_dir

CHUNK = 32 << 20  # bytes a read hands the hashing thread


@dataclass
class Report:
    path: Path
    checked: list[str] = field(default_factory=list)  # what was checked, one line each
    problems: list[str] = field(default_factory=list)  # what differs, one line each
    notes: list[str] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        lines = [f"checked: {c}" for c in self.checked] + [f"note: {n}" for n in self.notes]
        lines += [f"DAMAGED: {p}" for p in self.problems]
        rate = self.bytes_read / self.seconds / 1e9 if self.seconds else 0.0
        verdict = "ok" if self.ok else f"{len(self.problems)} problem(s)"
        lines.append(
            f"{self.path}: {verdict}; read {self.bytes_read / 2**30:.2f} GiB in "
            f"{self.seconds:.1f} s ({rate:.2f} GB/s)"
        )
        return "\n".join(lines)


def verify(
    path: Path | str, quick: bool = False, cache_dir: Path | None = None, progress: bool = True
) -> Report:
    """Check the edge0 directory at `path` (see the module docstring)."""
    path = Path(path)
    report = Report(path)
    t0 = time.perf_counter()
    try:
        manifest = modeldir.Manifest.load(path)
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:
        report.problems.append(str(e))
        return report
    files = [path / name for name in manifest.files]
    for f in files:
        if not _regular(f, report):
            continue
        try:
            if f.name == EXPERTS_FILE:
                read_table(f)
            elif f.suffix == ".safetensors":
                read_header(f)
        except ValueError as e:
            report.problems.append(str(e))
    experts = path / EXPERTS_FILE
    table = None
    if experts in files and experts.is_file():
        try:
            table, extent_bytes, _ = read_table(experts)
            found = modeldir.experts_header_problems(manifest, table, extent_bytes)
            report.problems += [f"{experts}: {p}" for p in found]
        except ValueError:
            table = None  # (reported above)
    report.checked.append(f"{len(files)} files' headers against edge0.json")
    if quick:
        report.seconds = time.perf_counter() - t0
        return report
    total = sum(f.stat().st_size for f in files if f.is_file())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="verifying", disable=not progress)
    try:
        for f in files:
            if not f.is_file():
                continue
            sums = read_sums(f, table) if f == experts and table is not None else None
            if sums is not None:
                _check_extents(f, table, sums, report, bar)
            else:
                _check_sha256(f, manifest.files[f.name], report, bar)
                if f == experts:
                    report.notes.append(
                        f"{f.name} was written before extents had checksums: it could only "
                        "be checked whole (convert the model again for per-expert checks)"
                    )
        for copy in _copies(manifest, cache_dir):
            try:
                ctable, _, _ = read_table(copy)
                csums = read_sums(copy, ctable)
            except ValueError as e:
                report.problems.append(f"{copy}: {e}")
                continue
            if csums is None:
                report.notes.append(f"{copy}: a relayout copy without checksums (rewritten)")
                continue
            bar.total += copy.stat().st_size
            _check_extents(copy, ctable, csums, report, bar, what="relayout copy")
    finally:
        bar.close()
    report.seconds = time.perf_counter() - t0
    return report


def _regular(f: Path, report: Report) -> bool:
    """Whether `f` is a regular file; a missing or special one is a problem."""
    try:
        mode = f.stat().st_mode
    except FileNotFoundError:
        report.problems.append(f"{f}: missing (edge0.json lists it)")
        return False
    if not stat.S_ISREG(mode):
        report.problems.append(f"{f}: not a regular file")
        return False
    return True


def _check_extents(f, table, sums, report: Report, bar, what: str = "extents") -> None:
    """Each extent of `f` against its checksum."""
    size, bad = read_table(f)[1], 0
    for layer, first, buf in _extent_runs(f, table, size):
        for i in range(len(buf) // size):
            if checksum(buf[i * size : (i + 1) * size]) != int(sums[layer][first + i]):
                bad += 1
                report.problems.append(
                    f"{f}: layer {layer} expert {first + i} does not match its checksum"
                )
        report.bytes_read += len(buf)
        bar.update(len(buf))
    count = sum(t.count for t in table.values())
    report.checked.append(
        f"{f.name}: {count} {what} against their checksums" + (f" ({bad} bad)" if bad else "")
    )


def _extent_runs(
    f: Path, table: dict[int, LayerExtents], size: int
) -> Iterator[tuple[int, int, memoryview]]:
    """(layer, first expert, the bytes of a run of whole extents), read ahead on a thread."""
    per = max(1, CHUNK // size)
    jobs = [
        (layer, first, t.offset + first * size, min(per, t.count - first) * size)
        for layer, t in sorted(table.items())
        for first in range(0, t.count, per)
    ]
    bufs = _read_ahead(f, [(offset, n) for _, _, offset, n in jobs])
    for (layer, first, _, _), buf in zip(jobs, bufs, strict=True):
        yield layer, first, buf


def _check_sha256(f: Path, want: str, report: Report, bar) -> None:
    size = f.stat().st_size
    h = hashlib.sha256()
    for buf in _read_ahead(f, [(o, min(CHUNK, size - o)) for o in range(0, size, CHUNK)]):
        h.update(buf)
        report.bytes_read += len(buf)
        bar.update(len(buf))
    if h.hexdigest() != want:
        report.problems.append(f"{f}: its SHA-256 differs from the one edge0.json records")
    else:
        report.checked.append(f"{f.name}: SHA-256")


def _read_ahead(f: Path, ranges: list[tuple[int, int]], depth: int = 3) -> Iterator[memoryview]:
    """The byte ranges of `f`, in order, read by a thread of their own up to `depth` ahead
    into buffers allocated once (os.preadv releases the GIL, as the hashes do on large
    buffers). O_DIRECT where every range is 4 KiB-aligned (the experts file's are): the
    check then reads at the disk's rate without filling the page cache; buffered otherwise.
    A buffer is handed out until the next one is asked for."""
    if not ranges:
        return
    longest = max(n for _, n in ranges)
    direct = all(o % ALIGN == 0 and n % ALIGN == 0 for o, n in ranges)
    slots = [mmap.mmap(-1, max(ALIGN, longest)) for _ in range(depth + 1)]  # page-aligned
    free: queue.Queue = queue.Queue()
    for s in slots:
        free.put(s)
    full: queue.Queue = queue.Queue()
    stop = threading.Event()

    def reader() -> None:
        try:
            fd = _open(f, direct)
            try:
                for offset, n in ranges:
                    slot = free.get()
                    if stop.is_set():
                        return
                    got = os.preadv(fd, [memoryview(slot)[:n]], offset)
                    if got != n:
                        raise ModelDataError(f"{f}: short read at {offset} ({got} of {n} bytes)")
                    full.put((slot, n))
            finally:
                os.close(fd)
            full.put(None)
        except BaseException as e:  # handed to the consumer
            full.put(e)

    thread = threading.Thread(target=reader, name="edge0-verify-read", daemon=True)
    thread.start()
    try:
        while True:
            item = full.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            slot, n = item
            yield memoryview(slot)[:n]
            free.put(slot)
    finally:
        stop.set()
        free.put(slots[0])  # (wakes a reader waiting for a buffer)
        thread.join()


def _open(f: Path, direct: bool) -> int:
    if direct:
        try:
            return os.open(f, os.O_RDONLY | os.O_DIRECT)
        except OSError:  # a file system without O_DIRECT (tmpfs): buffered
            pass
    return os.open(f, os.O_RDONLY)


def _copies(manifest, cache_dir: Path | None) -> list[Path]:
    """This machine's relayout copies of the model's experts file."""
    sha = manifest.files.get(EXPERTS_FILE)
    root = (Path(cache_dir) if cache_dir else default_cache_dir()) / "relayout"
    if not sha or not root.is_dir():
        return []
    out = []
    for p in sorted(root.glob(f"{sha[:32]}-*.safetensors")):
        try:
            if read_table(p)[2].get(SOURCE_KEY) == sha:
                out.append(p)
        except ValueError:
            out.append(p)  # a damaged copy: reported when checked
    return out
