"""What a stored weight is: the quantized format's one definition and its constants.

edge0 stores routed experts, and optionally the resident projections and embeddings, in one
format: int4 affine with a group of inputs sharing a bf16 (scale, bias) pair, w = scale * q +
bias (MLX's convention), codes in an arrangement the CPU kernel reads (int4_layout.py), each
expert's tensors in one aligned extent (extents.py). Every module that writes, reads, plans or
computes such a weight takes its numbers from a `Format`; another format is another instance.

The second one is BF16: experts kept as the checkpoint's bf16 weights, in the same extents,
for a model served as a teacher (`edge0 convert --experts bf16`: a distillation target
without int4's error, at four times the bytes a read).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    name: str
    bits: int
    group_size: int  # inputs sharing one (scale, bias) pair
    scheme: str  # "affine": w = scale * q + bias per group; "float": the weights themselves
    block_rows: int  # every kernel arrangement tiles output rows in blocks of this many
    extent_align: int  # an extent's bytes are padded to this (O_DIRECT needs no bounce buffer)

    @property
    def quantized(self) -> bool:
        """Codes with (scale, bias) pairs, not the weights themselves."""
        return self.scheme != "float"

    @property
    def levels(self) -> int:
        """The largest code: 2^bits - 1."""
        return (1 << self.bits) - 1

    def groups(self, inputs: int) -> int:
        return inputs // self.group_size

    def accepts(self, bits: int, group_size: int) -> bool:
        """Whether weights quantized with (bits, group_size) are this format as they are."""
        return (bits, group_size) == (self.bits, self.group_size)

    def check_quantizable(self, name: str, n: int, k: int) -> None:
        """Raise ValueError unless an [n, k] matrix fits the format and the kernel's tiling."""
        if k % self.group_size:
            raise ValueError(f"{name}: input dimension {k} is not a multiple of {self.group_size}")
        if n % self.block_rows:
            raise ValueError(f"{name}: output dimension {n} is not a multiple of {self.block_rows}")

    def held_bytes(self, out: int, inp: int) -> int:
        """Bytes a weight [out, inp] takes in memory: codes plus a bf16 pair per group."""
        pairs = 4 * out * self.groups(inp) if self.quantized else 0
        return out * inp * self.bits // 8 + pairs

    def describe(self, arrangement: str) -> dict:
        """The format as edge0.json records it for the experts."""
        if not self.quantized:
            return {
                "bits": self.bits,
                "scheme": self.scheme,
                "stored": "the checkpoint's weights as bf16",
                "kernel": "torch's fp32 matmul on the weights widened per call",
            }
        return {
            "bits": self.bits,
            "group_size": self.group_size,
            "scheme": self.scheme,
            "stored": "w = scale * q + bias (MLX convention)",
            "kernel": "aten._weight_int4pack_mm_for_cpu",
            "layout": arrangement,  # arrangement of the codes (int4_layout.py)
        }


INT4 = Format(
    name="int4-affine-g64",
    bits=4,
    group_size=64,
    scheme="affine",
    block_rows=32,
    extent_align=4096,
)

BF16 = Format(
    name="bf16",
    bits=16,
    group_size=1,
    scheme="float",
    block_rows=1,
    extent_align=4096,
)

EXPERT_FORMATS = {"int4": INT4, "bf16": BF16}  # `edge0 convert --experts`


def recorded(quantization: dict) -> Format:
    """The experts' format as edge0.json's quantization["experts"] records it (describe())."""
    return BF16 if quantization.get("scheme") == "float" else INT4
