"""GGUF files (llama.cpp's format), read with llama.cpp's own `gguf` package.

A GGUF file is a metadata table (`general.architecture`, `<arch>.block_count`, the tokenizer
under `tokenizer.ggml.*`, ...) and a tensor table; each tensor is stored in one ggml type
(F32, F16, BF16, Q8_0, Q4_0, the K-quants, ...) and memory-mapped by the reader. Shapes here
are in torch order (the file lists ggml's innermost dimension first). `get` returns a tensor's
values as the file defines them, dequantized by the package's own numpy code to fp32: for
F32, F16, BF16 and Q8_0 (an fp16 scale times an int8) that is exact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

MAGIC = b"GGUF"
EXACT_TYPES = ("F32", "F16", "BF16", "Q8_0")  # dequantized to fp32 without rounding


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except (IsADirectoryError, FileNotFoundError, PermissionError):
        return False


class GGUFFile:
    def __init__(self, path: Path | str):
        import gguf

        self.path = Path(path)
        if not is_gguf(self.path):
            raise ValueError(f"{self.path}: not a GGUF file (no GGUF magic at its start)")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError, IndexError) as e:
            raise ValueError(f"{self.path}: unreadable GGUF file ({e})") from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.value("general.architecture")
        if not isinstance(self.arch, str):
            raise ValueError(f"{self.path}: no general.architecture in its metadata")

    def value(self, key: str, default=None):
        """A metadata value (a number, a string, or a list of them); `default` when absent."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_value(self, key: str, default=None):
        """`<arch>.<key>`, the architecture's own metadata."""
        return self.value(f"{self.arch}.{key}", default)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """fp32 values of a tensor, or of its slice `index` along the leading axis (one expert
        of a stacked [E, out, in] tensor), dequantized from the mapped bytes."""
        import gguf

        t = self.tensors[name]
        shape = self.shape(name)
        data = t.data if index is None else t.data[index]
        if index is not None:
            shape = shape[1:]
        values = gguf.quants.dequantize(np.ascontiguousarray(data), t.tensor_type)
        return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape).copy())
