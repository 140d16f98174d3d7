"""Reading Hugging Face model directories: config.json and (sharded) safetensors, lazily.

Tensors are read one at a time with pread into fresh buffers (never memory-mapped), so nothing
here holds more than the tensor a caller asked for. Every error names the file and what is
wrong with it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_NAME = "model.safetensors.index.json"
# Released checkpoints ship trained adapters beside the weight shards; they are not weights.
ADAPTER_PREFIXES = ("prerouter", "lora")


def is_adapter_file(path: Path) -> bool:
    """True for prerouter*/lora* safetensors files (adapters, not model weights)."""
    return path.suffix == ".safetensors" and path.name.startswith(ADAPTER_PREFIXES)


def regular_file(path: Path, what: str = "file") -> Path:
    """`path`, checked to be a regular file: a missing one is FileNotFoundError, a folder, FIFO
    or device (which would be read as nothing, or block for ever) a ValueError naming it."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing ({what})") from None
    if not stat.S_ISREG(mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(mode)
            else "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a special file"
        )
        raise ValueError(f"{path}: is {kind}, not a regular file ({what})")
    return path


def read_json(path: Path, what: str) -> dict:
    regular_file(path, what)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def check_dir(path: Path | str, what: str = "model directory") -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{what} {path} is not a directory")
    return path


def hash_file(path: Path, h, chunk: int = 1 << 22):
    """`h` (a hashlib-style object) fed the whole file, in chunks; returns `h`."""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h


def sha256_file(path: Path) -> str:
    return hash_file(path, hashlib.sha256()).hexdigest()


DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensor table and metadata of one safetensors file, from its header alone."""
    regular_file(path, "safetensors file")
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise ValueError("implausible header length")
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a safetensors file ({e})") from e
    meta = header.pop("__metadata__", {}) or {}
    table = {}
    for key, info in header.items():
        start, end = info["data_offsets"]
        if 8 + n + end > size:
            raise ValueError(
                f"{path}: truncated: tensor {key!r} ends at byte {8 + n + end}, the file has {size}"
            )
        table[key] = TensorInfo(
            path, info["dtype"], tuple(info["shape"]), 8 + n + start, end - start
        )
    return table, meta


class Checkpoint:
    """The safetensors files of a Hugging Face directory, one tensor at a time.

    Tensors are read with pread into fresh buffers rather than through a memory map, so
    the source never accumulates in this process's resident set (a mapped 20 GB
    checkpoint would show up as 20 GB of file-backed RSS by the end of a convert).
    """

    def __init__(self, path: Path | str):
        self.path = check_dir(path)
        index = self.path / INDEX_NAME
        if index.exists():
            weight_map = read_json(index, "shard index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no weight_map")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(
                p.name for p in self.path.glob("*.safetensors") if not is_adapter_file(p)
            )
            weight_map = None
        if not files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors weights found")
        self.files = [self.path / f for f in files]
        self._info: dict[str, TensorInfo] = {}
        for f in self.files:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: listed in {INDEX_NAME} but missing")
            table, _ = read_header(f)
            self._info.update(table)
        if weight_map is not None:
            missing = [
                k
                for k, f in weight_map.items()
                if k not in self._info or self._info[k].file != self.path / f
            ]
            if missing:
                raise ValueError(
                    f"{index}: tensor {missing[0]!r} is not in {weight_map[missing[0]]}"
                )

    def keys(self) -> list[str]:
        return list(self._info)

    def __contains__(self, key: str) -> bool:
        return key in self._info

    def info(self, key: str) -> TensorInfo:
        if key not in self._info:
            raise KeyError(f"{self.path}: tensor {key!r} not found")
        return self._info[key]

    def get(self, key: str) -> torch.Tensor:
        info = self.info(key)
        if info.dtype not in DTYPES:
            raise ValueError(f"{info.file}: tensor {key!r} has unsupported dtype {info.dtype}")
        buf = bytearray(info.nbytes)
        with open(info.file, "rb") as f:
            f.seek(info.start)
            if f.readinto(buf) != info.nbytes:
                raise ValueError(f"{info.file}: short read of tensor {key!r}")
        return (
            torch.frombuffer(buf, dtype=DTYPES[info.dtype]).reshape(info.shape)
            if buf
            else torch.empty(info.shape, dtype=DTYPES[info.dtype])
        )

    def shape(self, key: str) -> list[int]:
        return list(self.info(key).shape)

    def dtype(self, key: str) -> str:
        return self.info(key).dtype

    def hashes(self) -> dict[str, str]:
        return {f.name: sha256_file(f) for f in self.files}


class ServedCheckpoint:
    """A checkpoint seen under the model's names: the family's `sanitize(cfg, key)` renames
    each tensor or drops it (None: not served, e.g. a vision tower). Offers what convert and
    the loaders read (keys, shape, get, files, hashes); tensors are still read one at a time.
    """

    def __init__(self, ckpt: Checkpoint, fam, cfg):
        self.raw, self.path, self.files = ckpt, ckpt.path, ckpt.files
        self._names: dict[str, str] = {}  # ours -> stored
        for key in ckpt.keys():
            ours = fam.sanitize(cfg, key)
            if ours is None:
                continue
            if ours in self._names:
                raise ValueError(
                    f"{ckpt.path}: tensors {self._names[ours]!r} and {key!r} both map to {ours!r}"
                )
            self._names[ours] = key

    def keys(self) -> list[str]:
        return list(self._names)

    def __contains__(self, key: str) -> bool:
        return key in self._names

    def stored(self, key: str) -> str:
        """The checkpoint's own name of one of our tensors."""
        if key not in self._names:
            raise KeyError(f"{self.path}: tensor {key!r} not found")
        return self._names[key]

    def get(self, key: str) -> torch.Tensor:
        return self.raw.get(self.stored(key))

    def shape(self, key: str) -> list[int]:
        return self.raw.shape(self.stored(key))

    def dtype(self, key: str) -> str:
        return self.raw.dtype(self.stored(key))

    def hashes(self) -> dict[str, str]:
        return self.raw.hashes()


EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")  # per-expert names after sanitize


class ExpertSource:
    """A layer's routed experts under `prefix` (the MoE block's experts, in our names): per-expert
    `{prefix}.{e}.{gate,up,down}_proj.weight`, or transformers-5 fused `{prefix}.gate_up_proj`
    and `{prefix}.down_proj`."""

    def __init__(self, ckpt: ServedCheckpoint, prefix: str, num_experts: int):
        self.ckpt, self.prefix, self.proj, self.num_experts = ckpt, prefix, EXPERT_PROJ, num_experts
        self.fused = f"{prefix}.gate_up_proj" in ckpt
        if not self.fused:
            for e in range(num_experts):
                for p in EXPERT_PROJ:
                    key = f"{prefix}.{e}.{p}.weight"
                    if key not in ckpt:
                        raise ValueError(f"{ckpt.path}: expert tensor {key!r} is missing")
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def check_shapes(self, hidden: int, inter: int) -> None:
        """From the headers alone: every expert tensor has the shape config.json implies."""
        if self.fused:
            want = {
                f"{self.prefix}.gate_up_proj": (self.num_experts, 2 * inter, hidden),
                f"{self.prefix}.down_proj": (self.num_experts, hidden, inter),
            }
        else:
            shapes = {
                self.proj[0]: (inter, hidden),
                self.proj[1]: (inter, hidden),
                self.proj[2]: (hidden, inter),
            }
            want = {
                f"{self.prefix}.{e}.{p}.weight": shapes[p]
                for e in range(self.num_experts)
                for p in self.proj
            }
        for key, shape in want.items():
            got = tuple(self.ckpt.shape(key))
            if got != shape:
                raise ValueError(
                    f"{self.ckpt.path}: expert tensor {key!r} has shape {got}, "
                    f"config.json implies {shape}"
                )

    def keys(self) -> list[str]:
        if self.fused:
            return [f"{self.prefix}.gate_up_proj", f"{self.prefix}.down_proj"]
        return [f"{self.prefix}.{e}.{p}.weight" for e in range(self.num_experts) for p in self.proj]

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, D], up [I, D], down [D, I]) of expert e."""
        if not self.fused:
            gate, up, down = (self.ckpt.get(f"{self.prefix}.{e}.{p}.weight") for p in self.proj)
            return gate, up, down
        if self._cache is None:  # one layer of fused weights at a time
            self._cache = (
                self.ckpt.get(f"{self.prefix}.gate_up_proj"),
                self.ckpt.get(f"{self.prefix}.down_proj"),
            )
        gate_up, down = self._cache[0][e], self._cache[1][e]
        gate, up = gate_up.chunk(2, dim=0)
        return gate, up, down

    def extent(self, e: int, layout) -> torch.Tensor:
        """Expert e quantized into one extent of `layout` (an ExtentLayout)."""
        return layout.pack(*self.expert(e))

    def release(self) -> None:
        self._cache = None
