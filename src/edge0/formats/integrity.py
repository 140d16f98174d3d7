"""Checking that a model's bytes are the ones written: checksums, and the error a mismatch is.

Every expert extent has an xxh3-64 checksum, written with it (convert, synth, the MLX import,
a relayout copy) as one U64 tensor per layer at the end of the experts file, and checked when
the pool reads the extent (EngineOptions.verify_reads). The resident and adapter files have a
whole-file xxh3-64 in edge0.json, checked as they are loaded. `edge0 verify` checks all of it
and the SHA-256s edge0.json records. A mismatch is a ModelDataError that names the file, and
the layer and expert where there is one: never text computed from damaged weights.
"""

from __future__ import annotations

from pathlib import Path

import xxhash

from edge0.formats.checkpoint import hash_file

CHECKSUM = "xxh3-64"
VERIFY_READS = ("first", "all", "off")  # EngineOptions.verify_reads


class ModelDataError(RuntimeError):
    """A model file does not hold what was written to it (or the model computes non-finite
    numbers from it); the message names what and says how to check the directory."""


def checksum(data) -> int:
    """xxh3-64 of a buffer (bytes, memoryview, or a contiguous numpy array)."""
    return xxhash.xxh3_64_intdigest(data)


def file_checksum(path: Path, chunk: int = 1 << 24) -> int:
    """xxh3-64 of a whole file, read in chunks."""
    return hash_file(path, xxhash.xxh3_64(), chunk).intdigest()


def hex64(value: int) -> str:
    return f"{value:016x}"


def extent_mismatch(path: Path, layer: int, expert: int) -> ModelDataError:
    return ModelDataError(
        f"{path}: layer {layer} expert {expert} does not match its recorded checksum (the "
        f"file is damaged); run `edge0 verify` on the model directory"
    )
