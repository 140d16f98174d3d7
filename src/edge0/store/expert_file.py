"""experts.safetensors: every routed expert of the model as aligned extents, read by byte range.

The file is a valid safetensors file (one U8 tensor [E, extent_bytes] per MoE layer, named
`model.layers.{L}.mlp.experts.extents`) whose header is padded with spaces so that the data
section starts on a 4096-byte boundary. Every extent is then 4096-aligned and a multiple of
4096 long, which is what O_DIRECT needs. After the extents, one U64 tensor [E] per layer
(`...experts.xxh3`) holds each extent's checksum (formats/integrity.py); files written
before it have none.

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
import torch

from edge0.formats.checkpoint import regular_file
from edge0.formats.extents import ALIGN
from edge0.formats.int4_layout import UNRECORDED, by_name
from edge0.formats.integrity import CHECKSUM, ModelDataError, checksum, extent_mismatch
from edge0.formats.writer import StreamingSafetensors

log = logging.getLogger(__name__)

IO_MODES = ("direct", "buffered", "mmap")
FILE_NAME = "experts.safetensors"
LAYOUT_KEY = "int4_layout"  # header metadata: the arrangement the codes were written in
CHECKSUM_KEY = "checksum"  # header metadata: the extents' checksum (formats/integrity.py)
SOURCE_KEY = "source_sha256"  # header metadata of a relayout copy: the file it was made from


def tensor_name(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts.extents"


def sums_name(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts.xxh3"


@dataclass(frozen=True)
class LayerExtents:
    """Where one layer's experts sit: absolute file offset of expert 0, and the count; and
    of its extents' checksums (U64 [count]), where the file has them."""

    offset: int
    count: int
    sums: int | None = None


def read_table(path: Path) -> tuple[dict[int, LayerExtents], int, dict[str, str]]:
    """Parse the header: (layer table, extent bytes, metadata). Raises ValueError if malformed."""
    regular_file(path, "experts file")
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
    table, extent_bytes, sums = {}, None, {}
    for name, info in header.items():
        parts = name.split(".")
        if len(parts) != 6 or parts[-1] not in ("extents", "xxh3") or not parts[2].isdigit():
            raise ValueError(f"{path}: unexpected tensor {name!r}")
        start, end = info["data_offsets"]
        if parts[-1] == "xxh3":
            if info["dtype"] != "U64" or len(info["shape"]) != 1 or data_start + end > size:
                raise ValueError(f"{path}: {name} is not a whole U64 vector")
            sums[int(parts[2])] = (data_start + start, info["shape"][0])
            continue
        count, nbytes = info["shape"]
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
    for layer, (at, count) in sums.items():
        if layer not in table or table[layer].count != count:
            raise ValueError(f"{path}: layer {layer}'s checksums do not match its extents")
        table[layer] = LayerExtents(table[layer].offset, count, at)
    if sums and len(sums) != len(table):
        raise ValueError(f"{path}: some layers have extent checksums and some do not")
    return table, extent_bytes, metadata


def read_sums(path: Path, table: dict[int, LayerExtents]) -> dict[int, np.ndarray] | None:
    """Each layer's extent checksums (U64 [count]), or None for a file written without."""
    if not table or any(t.sums is None for t in table.values()):
        return None
    out = {}
    with open(path, "rb") as f:
        for layer, t in table.items():
            f.seek(t.sums)
            out[layer] = np.frombuffer(f.read(8 * t.count), dtype="<u8")
    return out


class ExtentsWriter:
    """Writes an experts file: each layer's extents, then every extent's checksum, computed
    as it is written. `counts`: experts per layer, in the order the layers are written."""

    def __init__(
        self, path: Path, counts: dict[int, int], extent_bytes: int, metadata: dict[str, str]
    ):
        specs = [(tensor_name(i), torch.uint8, (n, extent_bytes)) for i, n in counts.items()]
        specs += [(sums_name(i), torch.uint64, (n,)) for i, n in counts.items()]
        meta = metadata | {CHECKSUM_KEY: CHECKSUM}
        self._w = StreamingSafetensors(path, specs, metadata=meta, align=ALIGN)
        self._sums: dict[int, list[int]] = {i: [] for i in counts}

    @property
    def data_start(self) -> int:
        return self._w.data_start

    def write(self, layer: int, extents: torch.Tensor) -> None:
        """The layer's next extents, uint8 [n, extent_bytes]."""
        sums = self._sums[layer]
        for row in extents:
            sums.append(checksum(row.numpy()))
        self._w.write(tensor_name(layer), extents)

    def close(self) -> None:
        for layer, sums in self._sums.items():
            self._w.write(sums_name(layer), torch.from_numpy(np.array(sums, dtype=np.uint64)))
        self._w.close()

    def abort(self) -> None:
        self._w.abort()


class ExpertFile:
    """Reads extents of experts.safetensors into caller buffers with one I/O mode."""

    def __init__(self, path: Path, mode: str = "direct", header: tuple | None = None):
        """`header`: read_table(path) where the caller has read it already."""
        if mode not in IO_MODES:
            raise ValueError(f"unknown I/O mode {mode!r}; choose one of {', '.join(IO_MODES)}")
        self.path = Path(path)
        self.table, self.extent_bytes, self.metadata = header or read_table(self.path)
        self.sums = read_sums(self.path, self.table)  # each extent's checksum, or None
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

    def damaged(self, layer: int, expert: int) -> ModelDataError:
        """The error for an extent whose bytes do not match its checksum. A relayout copy (a
        cache of the model's own file) is removed now, so that the next start writes it
        again; the process that has it open goes on failing on that expert."""
        if SOURCE_KEY not in self.metadata:
            return extent_mismatch(self.path, layer, expert)
        self.path.unlink(missing_ok=True)
        return ModelDataError(
            f"{self.path}: layer {layer} expert {expert} of this relayout copy does not match "
            "its recorded checksum; the copy is removed and the next start writes it again"
        )

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
