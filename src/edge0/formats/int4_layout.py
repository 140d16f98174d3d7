"""Where torch's CPU int4 kernel expects each 4-bit code, and which arrangement this host uses.

`aten._weight_int4pack_mm_for_cpu` reads its weight as uint8 [N, K/2], but the position of
each code depends on the kernel torch dispatched to on the machine at hand. Measured with
`_convert_weight_to_int4pack_for_cpu` in torch 2.13 (ATEN_CPU_CAPABILITY selects the kernel):

  n32-split        blocks of 32 output rows; per input column 16 bytes: row r < 16 sits in the
                   low nibble of byte r, row r >= 16 in the high nibble of byte r - 16  (AVX2)
  n64-split        blocks of 64 rows, 32 bytes per column: rows < 32 low, rows >= 32 high;
                   a trailing block of 32 rows is laid out as n32-interleaved          (AVX512)
  n32-interleaved  blocks of 32 rows, 16 bytes per column: row 2j low, row 2j+1 high   (DEFAULT)

The host's arrangement is found by packing a small matrix with torch's own packer and
matching it against these, never from a table of ISAs; an arrangement edge0 does not know
is an error, not a guess. `self_check` then runs one small matmul against its dequantized
reference, so a kernel that computes differently is caught before serving.
Shape legend: N output rows, K input columns, B rows per block, G = K/64 groups.

Any of them also comes in its *int8 order* (`Int4Layout.in_int8_order`), which only edge0's
int8-activation kernels read: within a block, each run of 4 columns (4 * B/2 bytes) holds
byte j of 16-byte chunk c of column i at 64c + 4j + i, so that one load gives the kernel what
4 loads and 6 unpacks gave it (native/int4_gemv.cpp). Files are never written in it; the
pool puts an expert in it as it reads it, where decode runs the int8 AVX2 kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from edge0.formats import quant


class KernelLayoutError(RuntimeError):
    """torch's int4 kernel wants an arrangement edge0 does not know, or computes wrongly."""


@dataclass(frozen=True)
class Int4Layout:
    """One arrangement of int4 codes: full blocks of `block` rows, within a block either
    split halves or interleaved row pairs per byte; the remainder N % block is laid out by
    the `tail` arrangement (None: N must be a multiple of block)."""

    name: str
    block: int
    interleaved: bool = False
    tail: Int4Layout | None = None
    int8_order: bool = False  # every segment's runs of 4 columns in the int8 kernels' order

    def in_int8_order(self) -> Int4Layout:
        """This arrangement with its bytes in the int8 order (see the module docstring)."""
        return replace(self, name=f"{self.name}+int8-order", int8_order=True)

    def in_own_order(self) -> Int4Layout:
        """The arrangement whose bytes this one reorders (itself if not in the int8 order)."""
        return replace(self, name=self.name.removesuffix("+int8-order"), int8_order=False)

    def segments(self, n: int) -> list[tuple[int, int, int, bool]]:
        """(first row, rows, block, interleaved) of each run of like blocks covering n rows."""
        full = n // self.block * self.block
        out = [(0, full, self.block, self.interleaved)] if full else []
        if n > full:
            if self.tail is None:
                raise ValueError(f"{self.name}: {n} rows do not fill blocks of {self.block}")
            out += [(full + f, r, b, i) for f, r, b, i in self.tail.segments(n - full)]
        return out

    def pack(self, q: torch.Tensor) -> torch.Tensor:
        """q uint8 [N, K] with values 0..15 -> packed uint8 [N, K/2] in this arrangement."""
        n, k = q.shape
        parts = []
        for first, rows, b, interleaved in self.segments(n):
            blk = q[first : first + rows].reshape(rows // b, b, k).transpose(1, 2)  # [N/B, K, B]
            if interleaved:
                lo, hi = blk[..., 0::2], blk[..., 1::2]
            else:
                lo, hi = blk[..., : b // 2], blk[..., b // 2 :]
            part = (lo | (hi << 4)).reshape(rows, k // 2)
            parts.append(_int8_order(part, b, k) if self.int8_order else part)
        return torch.cat(parts).contiguous() if len(parts) > 1 else parts[0].contiguous()

    def _bytes(self, packed: torch.Tensor, first: int, rows: int, b: int, k: int) -> torch.Tensor:
        """A segment's bytes [rows, K/2] in their own order (the int8 order undone)."""
        part = packed[first : first + rows]
        return _own_order(part, b, k) if self.int8_order else part

    def unpack(self, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """Inverse of pack: uint8 [N, K/2] -> q uint8 [N, K]."""
        parts = []
        for first, rows, b, interleaved in self.segments(n):
            p = self._bytes(packed, first, rows, b, k).reshape(rows // b, k, b // 2)
            parts.append(_nibbles(p, interleaved).transpose(1, 2).reshape(rows, k))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def dequantize(self, packed: torch.Tensor, pairs: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """fp32 W [N, K] exactly as the kernel sees it, (q - 8) * scale + zero, from kernel
        pairs [G, N, 2].

        Works in the packed orientation ([N/B, K, B] tiles, contiguous operands) and builds
        W^T [K, N]; the result is its transposed view, which F.linear takes without a copy.
        ~10x faster than unpacking row-major first on the CPUs measured.
        """
        g = k // quant.GROUP
        parts = []
        for first, rows, b, interleaved in self.segments(n):
            nb = rows // b
            p = self._bytes(packed, first, rows, b, k).reshape(nb, g, quant.GROUP, b // 2)
            q = _nibbles(p, interleaved).float()  # [N/B, G, 64, B]
            pr = pairs[:, first : first + rows].float().view(g, nb, b, 2).permute(1, 0, 2, 3)
            scale = pr[..., 0].unsqueeze(2).contiguous()  # [N/B, G, 1, B]
            offset = (pr[..., 1] - 8.0 * pr[..., 0]).unsqueeze(2).contiguous()
            w = torch.addcmul(offset, q, scale)  # q * scale + (zero - 8 * scale)
            parts.append(w.permute(1, 2, 0, 3).reshape(k, rows))
        wt = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        return wt.t()


def _int8_order(part: torch.Tensor, b: int, k: int) -> torch.Tensor:
    """A segment's bytes [rows, K/2] (blocks of b rows) -> the int8 order: in each run of 4
    columns, byte j of chunk c of column i from i * b/2 + 16c + j to 64c + 4j + i."""
    rows = part.shape[0]
    runs = part.reshape(rows // b, k // 4, 4, b // 32, 16)  # [blocks, runs, i, c, j]
    return runs.permute(0, 1, 3, 4, 2).reshape(rows, k // 2)


def _own_order(part: torch.Tensor, b: int, k: int) -> torch.Tensor:
    """Inverse of _int8_order."""
    rows = part.shape[0]
    runs = part.reshape(rows // b, k // 4, b // 32, 16, 4)  # [blocks, runs, c, j, i]
    return runs.permute(0, 1, 4, 2, 3).reshape(rows, k // 2)


def _nibbles(p: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Bytes [..., B/2] -> codes [..., B] in row order within the block."""
    lo, hi = p & 15, p >> 4
    if interleaved:
        return torch.stack([lo, hi], dim=-1).flatten(-2)
    return torch.cat([lo, hi], dim=-1)


N32_SPLIT = Int4Layout("n32-split", 32)
N32_INTERLEAVED = Int4Layout("n32-interleaved", 32, interleaved=True)
N64_SPLIT = Int4Layout("n64-split", 64, tail=N32_INTERLEAVED)
LAYOUTS = {lay.name: lay for lay in (N32_SPLIT, N64_SPLIT, N32_INTERLEAVED)}
# What edge0 wrote before the arrangement was recorded (the AVX2 kernel's).
UNRECORDED = N32_SPLIT


def by_name(name: str) -> Int4Layout:
    """The known arrangement called `name`; ValueError naming the known ones otherwise."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(
            f"unknown int4 layout {name!r}; this edge0 knows {', '.join(LAYOUTS)}"
        ) from None


def relayout(packed: torch.Tensor, n: int, k: int, src: Int4Layout, dst: Int4Layout):
    """Codes packed as `src` -> the same codes packed as `dst` (a new tensor)."""
    return dst.pack(src.unpack(packed, n, k))


def _torch_packer(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)


def _describe_kernel() -> str:
    return f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}"


def _probe(n: int = 96, k: int = 128) -> torch.Tensor:
    # 96 rows: one 64-row block and a 32-row tail, so every known arrangement differs.
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)


def host_layout(packer=_torch_packer) -> Int4Layout:
    """The arrangement torch's int4 kernel uses on this machine, found by packing a probe
    matrix with torch's own packer. Raises KernelLayoutError for an arrangement edge0 does
    not know (a torch upgrade, another architecture)."""
    q = _probe()
    got = packer(q)
    for layout in LAYOUTS.values():
        if got.shape == (q.shape[0], q.shape[1] // 2) and torch.equal(got, layout.pack(q)):
            return layout
    raise KernelLayoutError(
        f"{_describe_kernel()}: its int4 kernel packs weights as {got.dtype} "
        f"{tuple(got.shape)} in an arrangement this edge0 does not know (known: "
        f"{', '.join(LAYOUTS)}). Install torch==2.13.0, the version edge0 is tested with."
    )


def self_check(layout: Int4Layout, tolerance: float = 2e-2) -> float:
    """One small int4 matmul against its dequantized fp32 reference; returns the relative
    L2 error. Raises KernelLayoutError if it exceeds `tolerance` (a wrong arrangement or
    kernel gives errors near 1, bf16 activations about 3e-3)."""
    gen = torch.Generator().manual_seed(1)
    q = _probe()
    n, k = q.shape
    scale = (torch.rand(n, k // quant.GROUP, generator=gen) * 0.02 + 0.01).bfloat16()
    bias = (-7.5 * scale.float()).bfloat16()
    x = torch.randn(2, k, generator=gen).bfloat16()
    ref = x.float() @ quant.dequantize_affine(q, scale, bias).t()
    pairs = quant.pairs_from(scale, bias)
    quant.to_kernel_pairs(pairs)
    got = quant.int4_linear(x, layout.pack(q), pairs).float()
    err = ((got - ref).norm() / ref.norm()).item()
    if not err <= tolerance:
        raise KernelLayoutError(
            f"int4 kernel self-check failed ({_describe_kernel()}, layout {layout.name}): "
            f"expected y[0, :4] = {[round(v, 4) for v in ref[0, :4].tolist()]}, found "
            f"{[round(v, 4) for v in got[0, :4].tolist()]}; relative error {err:.3g} "
            f"exceeds {tolerance:g}"
        )
    return err
