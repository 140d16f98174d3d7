"""Writing safetensors one tensor at a time, so a converter never holds a whole model.

The header is written first from declared names, dtypes and shapes; tensors then follow in
declaration order. Files are written under a temporary name and renamed when complete, so
an interrupted convert never leaves a file that looks finished.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint32: "U32",
    torch.int8: "I8",
    torch.uint64: "U64",
}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


class StreamingSafetensors:
    """Declare every tensor, then `write(name, tensor)` in that order, then `close()`."""

    def __init__(
        self,
        path: Path,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        align: int = 8,
    ):
        self.path = Path(path)
        self._tmp = self.path.with_name(self.path.name + ".partial")
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
        offset = 0
        self._order = []
        for name, dtype, shape in specs:
            n = dtype.itemsize
            for s in shape:
                n *= s
            header[name] = {
                "dtype": DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            self._order.append((name, dtype, tuple(shape), n))
            offset += n
        text = json.dumps(header, separators=(",", ":")).encode()
        header_len = (len(text) + 8 + align - 1) // align * align - 8
        self._f = open(self._tmp, "wb")
        self._f.write(struct.pack("<Q", header_len) + text + b" " * (header_len - len(text)))
        self._data_start = 8 + header_len
        self._next = 0
        self._rows = 0  # rows of the current tensor written so far

    @property
    def data_start(self) -> int:
        return self._data_start

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write a declared tensor whole, or the next rows of it (same trailing shape)."""
        want, dtype, shape, n = self._order[self._next]
        if name != want:
            raise ValueError(f"{self.path}: expected tensor {want!r} next, got {name!r}")
        rows = tensor.shape[0] if tensor.dim() else 1
        if (
            tensor.dtype != dtype
            or tuple(tensor.shape[1:]) != shape[1:]
            or self._rows + rows > (shape[0] if shape else 1)
        ):
            raise ValueError(
                f"{self.path}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                f"declared {dtype} {shape}"
            )
        self._f.write(tensor_bytes(tensor))
        self._rows += rows
        if self._rows == (shape[0] if shape else 1):
            self._next += 1
            self._rows = 0

    def close(self) -> None:
        if self._next != len(self._order):
            raise ValueError(
                f"{self.path}: {len(self._order) - self._next} declared tensors not written"
            )
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._f.close()
        self._tmp.unlink(missing_ok=True)
