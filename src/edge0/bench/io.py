"""`edge0 bench --io`: cold reads of expert-sized extents, per read mode, on this disk.

A scratch file of random bytes is written once; before each arm its pages are dropped from
the page cache (posix_fadvise DONTNEED), then random extents are read into aligned buffers.
"""

from __future__ import annotations

import mmap
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def make_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    chunk = os.urandom(1 << 24)
    with open(path, "wb") as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def _offsets(size: int, extent: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    slots = size // extent
    return [rng.randrange(slots) * extent for _ in range(n)]


def read_arm(
    path: Path, mode: str, extent: int, n: int, threads: int, seed: int, advice: int | None = None
) -> dict:
    size = path.stat().st_size
    offsets = _offsets(size, extent, n, seed)
    _drop(path)
    flags = os.O_RDONLY | (os.O_DIRECT if mode == "direct" else 0)
    fd = os.open(path, flags)
    m = None
    if mode == "mmap":
        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        if advice is not None:
            m.madvise(advice)
        src = np.frombuffer(m, dtype=np.uint8)
    bufs = [mmap.mmap(-1, extent) for _ in range(threads)]
    lat = []

    def one(i: int) -> None:
        buf = bufs[i % threads]
        t = time.perf_counter()
        if m is not None:
            np.copyto(np.frombuffer(buf, dtype=np.uint8), src[offsets[i] : offsets[i] + extent])
        else:
            os.preadv(fd, [buf], offsets[i])
        lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    if threads == 1:
        for i in range(n):
            one(i)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    if m is not None:
        del src
        m.close()
    os.close(fd)
    lat.sort()
    return {
        "mode": mode,
        "extent_bytes": extent,
        "threads": threads,
        "advice": {
            None: "-",
            mmap.MADV_RANDOM: "MADV_RANDOM",
            mmap.MADV_SEQUENTIAL: "MADV_SEQUENTIAL",
        }.get(advice, str(advice)),
        "GB_per_s": n * extent / wall / 1e9,
        "p50_us": lat[len(lat) // 2] * 1e6,
    }


def measure(path: Path, size: int, extents=(57344, 1769472), n: int = 200) -> list[dict]:
    make_file(path, size)
    rows = []
    for extent in extents:
        count = max(50, min(n, size // extent // 2))
        for seed, (mode, threads, advice) in enumerate(
            [
                ("direct", 1, None),
                ("direct", 4, None),
                ("buffered", 1, None),
                ("buffered", 4, None),
                ("mmap", 1, None),
                ("mmap", 1, mmap.MADV_RANDOM),
                ("mmap", 4, None),
            ]
        ):
            rows.append(read_arm(path, mode, extent, count, threads, seed, advice))
    return rows


def report(rows: list[dict]) -> str:
    lines = ["| extent | mode | threads | madvise | GB/s | p50 µs |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {r['extent_bytes']} | {r['mode']} | {r['threads']} | {r['advice']} | "
        f"{r['GB_per_s']:.2f} | {r['p50_us']:.0f} |"
        for r in rows
    ]
    return "\n".join(lines)
