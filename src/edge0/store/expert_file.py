"""experts.safetensors: every routed expert of the model as aligned extents, read by byte range.

The file is a valid safetensors file (one U8 tensor [E, extent_bytes] per MoE layer, named
`model.layers.{L}.mlp.experts.extents`) whose header is padded with spaces so that the data
section starts on a 4096-byte boundary. Every extent is then 4096-aligned and a multiple of
4096 long, which is what O_DIRECT needs.

Three read modes, all into caller-owned buffers:
  direct    O_DIRECT preadv: bypasses the page cache, so resident memory is what we hold
  buffered  plain preadv: the kernel page cache keeps recently read extents (file-backed)
  mmap      copy out of a shared read-only mapping: the extents arrive by page faults
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge0.formats.extents import ALIGN
from edge0.formats.int4_layout import UNRECORDED, by_name

log = logging.getLogger(__name__)

IO_MODES = ("direct", "buffered", "mmap")
FILE_NAME = "experts.safetensors"
LAYOUT_KEY = "int4_layout"  # header metadata: the arrangement the codes were written in


def tensor_name(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts.extents"


@dataclass(frozen=True)
class LayerExtents:
    """Where one layer's experts sit: absolute file offset of expert 0, and the count."""

    offset: int
    count: int


def read_table(path: Path) -> tuple[dict[int, LayerExtents], int, dict[str, str]]:
    """Parse the header: (layer table, extent bytes, metadata). Raises ValueError if malformed."""
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > 100_000_000:
                raise ValueError("header length is implausible")
            header = json.loads(f.read(header_len))
            size = os.fstat(f.fileno()).st_size
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a valid edge0 extents file ({e})") from e
    data_start = 8 + header_len
    if data_start % ALIGN:
        raise ValueError(f"{path}: data section is not {ALIGN}-aligned; re-run edge0 convert")
    metadata = header.pop("__metadata__", {})
    table, extent_bytes = {}, None
    for name, info in header.items():
        parts = name.split(".")
        if len(parts) != 6 or parts[-1] != "extents":
            raise ValueError(f"{path}: unexpected tensor {name!r}")
        count, nbytes = info["shape"]
        start, end = info["data_offsets"]
        if extent_bytes not in (None, nbytes):
            raise ValueError(f"{path}: layers disagree on the extent size")
        extent_bytes = nbytes
        if data_start + end > size:
            raise ValueError(
                f"{path}: truncated: layer {parts[2]} needs {data_start + end} bytes, "
                f"file has {size}"
            )
        table[int(parts[2])] = LayerExtents(offset=data_start + start, count=count)
    if extent_bytes is None:
        raise ValueError(f"{path}: holds no expert extents")
    return table, extent_bytes, metadata


class ExpertFile:
    """Reads extents of experts.safetensors into caller buffers with one I/O mode."""

    def __init__(self, path: Path, mode: str = "direct", header: tuple | None = None):
        """`header`: read_table(path) where the caller has read it already."""
        if mode not in IO_MODES:
            raise ValueError(f"unknown I/O mode {mode!r}; choose one of {', '.join(IO_MODES)}")
        self.path = Path(path)
        self.table, self.extent_bytes, self.metadata = header or read_table(self.path)
        self.int4 = by_name(self.metadata.get(LAYOUT_KEY, UNRECORDED.name))
        self.mode = mode
        self._map = None
        self._map_np = None
        flags = os.O_RDONLY
        if mode == "direct":
            flags |= os.O_DIRECT
        try:
            self._fd = os.open(self.path, flags)
        except OSError as e:
            if mode != "direct":
                raise
            # Some file systems (tmpfs, some overlays) refuse O_DIRECT; reads still work.
            log.warning("%s: O_DIRECT unavailable (%s); using buffered reads", self.path, e)
            self.mode = "buffered"
            self._fd = os.open(self.path, os.O_RDONLY)
        if self.mode == "mmap":
            self._map = mmap.mmap(self._fd, 0, prot=mmap.PROT_READ)
            self._map_np = np.frombuffer(self._map, dtype=np.uint8)

    def offset(self, layer: int, expert: int) -> int:
        ext = self.table[layer]
        if not 0 <= expert < ext.count:
            raise IndexError(f"layer {layer} has {ext.count} experts, asked for {expert}")
        return ext.offset + expert * self.extent_bytes

    def read_run(self, layer: int, first: int, buffers: list[memoryview]) -> int:
        """Read len(buffers) consecutive experts starting at `first`, one syscall; returns bytes."""
        offset = self.offset(layer, first)
        want = self.extent_bytes * len(buffers)
        if self._map_np is not None:
            for i, buf in enumerate(buffers):
                start = offset + i * self.extent_bytes
                np.copyto(
                    np.frombuffer(buf, dtype=np.uint8),
                    self._map_np[start : start + self.extent_bytes],
                )
            return want
        got = os.preadv(self._fd, buffers, offset)
        if got != want:
            raise OSError(f"{self.path}: short read at {offset} ({got} of {want} bytes)")
        return got

    def close(self) -> None:
        if self._map_np is not None:
            del self._map_np
            self._map_np = None
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def drop_page_cache(self) -> None:
        """Ask the kernel to forget this file's cached pages (for cold-read measurements)."""
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
