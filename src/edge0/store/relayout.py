"""A once-per-machine copy of experts.safetensors in this host's int4 arrangement.

A model directory records the arrangement its codes were written in (`int4_layout`). On a
machine whose kernel wants another, repacking every extent on every read would cost CPU on
the cores that compute (docs/format.md prices it), so the first load writes a repacked copy
into a cache directory, keyed by the experts file's SHA-256 and the arrangement, and later
loads read that copy. The model directory itself is never written: it may be read-only, as
the built-in model inside site-packages is. If the copy cannot be written (no permission, too
little space), extents are repacked as they are read instead, and a warning says so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from edge0.formats.checkpoint import sha256_file
from edge0.formats.extents import ExtentLayout
from edge0.formats.int4_layout import UNRECORDED, Int4Layout, by_name
from edge0.store.expert_file import (
    FILE_NAME,
    LAYOUT_KEY,
    SOURCE_KEY,
    ExpertFile,
    ExtentsWriter,
    read_table,
)
from edge0.util.fs import fsync_dir
from edge0.util.paths import default_cache_dir

log = logging.getLogger(__name__)

POLICIES = ("cache", "on-read")
CHUNK_BYTES = 64 << 20  # extents repacked per read while copying


def stored_int4(path: Path) -> Int4Layout:
    """The arrangement an extents file's header records (files from before it was recorded
    hold n32-split codes)."""
    return by_name(read_table(path)[2].get(LAYOUT_KEY, UNRECORDED.name))


def experts_for_host(
    model_dir: Path,
    layout: ExtentLayout,
    sha256: str | None,
    host: Int4Layout,
    policy: str = "cache",
    cache_dir: Path | None = None,
    stored: Int4Layout | None = None,
) -> Path:
    """The extents file to serve on this host: the model's own if its arrangement is the
    host's, else (policy "cache") a repacked copy in `cache_dir`, built on first use. With
    policy "on-read", or when no copy can be written, the model's own file: the pool then
    repacks each extent as it reads it.

    `layout` is the extents' layout as edge0.json records it, `sha256` the experts file's
    recorded hash (None: hash it now), `stored` the arrangement its header records (None:
    read it now).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown relayout policy {policy!r}; choose one of {POLICIES}")
    src = Path(model_dir) / FILE_NAME
    if not layout.format.quantized:
        return src  # float weights: no arrangement to repack
    stored = stored or stored_int4(src)
    if stored != layout.int4:
        raise ValueError(
            f"{src}: its header says int4 layout {stored.name}, edge0.json says "
            f"{layout.int4.name}; re-run edge0 convert"
        )
    if stored == host or policy == "on-read":
        return src
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    sha = sha256 or sha256_file(src)
    dst = root / "relayout" / f"{sha[:32]}-{host.name}.safetensors"
    if dst.parent.is_dir():
        remove_orphans(dst.parent)
    if _is_copy_of(dst, src, sha, host):
        return dst
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        with _locked(dst):  # a second process making the same copy waits, then uses it
            if not _is_copy_of(dst, src, sha, host):
                _write_copy(src, dst, layout, sha, host)
    except OSError as e:
        log.warning(
            "cannot write a %s copy of %s under %s (%s); repacking each expert as it is read, "
            "which costs CPU time per read (docs/format.md)",
            host.name,
            src,
            root,
            e,
        )
        return src
    return dst


@contextlib.contextmanager
def _locked(dst: Path) -> Iterator[None]:
    """An exclusive lock (fcntl) on `dst`'s lock file while it is checked and written (in a
    folder beside the copies', so that theirs holds only copies)."""
    locks = dst.parent.parent / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{dst.name}.lock", "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def remove_orphans(folder: Path) -> list[Path]:
    """Remove the files a killed copy left (`NAME.PID`, `NAME.PID.partial`) whose writer is
    gone; returns them."""
    removed = []
    for p in folder.glob("*.safetensors.*"):
        pid = p.name.removesuffix(".partial").rsplit(".", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            p.unlink(missing_ok=True)
            removed.append(p)
            log.info("removed %s, left by a copy that did not finish", p)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_copy_of(dst: Path, src: Path, sha: str, host: Int4Layout) -> bool:
    if not dst.is_file():
        return False
    try:
        table, extent_bytes, meta = read_table(dst)
    except ValueError as e:
        log.warning("%s: unreadable relayout copy (%s); writing it again", dst, e)
        return False
    src_table, src_extent, _ = read_table(src)
    return (
        meta.get(LAYOUT_KEY) == host.name
        and meta.get(SOURCE_KEY) == sha
        and extent_bytes == src_extent
        and {k: v.count for k, v in table.items()} == {k: v.count for k, v in src_table.items()}
        and all(v.sums is not None for v in table.values())  # (copies before checksums: again)
    )


def _write_copy(src: Path, dst: Path, layout: ExtentLayout, sha: str, host: Int4Layout) -> None:
    """Repack every extent of `src` into `host`'s arrangement, written to `dst` atomically."""
    table, extent_bytes, meta = read_table(src)
    if extent_bytes != layout.nbytes:
        raise ValueError(f"{src}: extent size {extent_bytes} != edge0.json {layout.nbytes}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    need = src.stat().st_size
    free = shutil.disk_usage(dst.parent).free
    if free < need + CHUNK_BYTES:
        raise OSError(errno.ENOSPC, f"{need} bytes needed, {free} free")
    t0 = time.perf_counter()
    log.info("writing a %s copy of %s to %s", host.name, src, dst)
    layers = sorted(table)
    metadata = meta | {LAYOUT_KEY: host.name, SOURCE_KEY: sha}
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}")  # a concurrent builder has its own
    writer = ExtentsWriter(tmp, {i: table[i].count for i in layers}, extent_bytes, metadata)
    reader = ExpertFile(src, "buffered")
    per_read = max(1, CHUNK_BYTES // extent_bytes)
    bufs = torch.empty(per_read, extent_bytes, dtype=torch.uint8)
    views = [memoryview(bufs[i].numpy()) for i in range(per_read)]
    bar = tqdm(
        total=sum(t.count for t in table.values()),
        desc=f"repacking experts for this CPU ({host.name})",
        unit="expert",
        disable=None,  # off when stderr is not a terminal
    )
    try:
        for i in layers:
            for first in range(0, table[i].count, per_read):
                n = min(per_read, table[i].count - first)
                reader.read_run(i, first, views[:n])
                for e in range(n):
                    layout.relayout_codes(layout.views(bufs[e]), layout.int4, host)
                writer.write(i, bufs[:n])
                bar.update(n)
        writer.close()
        os.replace(tmp, dst)
        fsync_dir(dst.parent)
    except BaseException:
        writer.abort()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
        reader.close()
    log.info("wrote %s in %.1f s", dst, time.perf_counter() - t0)
