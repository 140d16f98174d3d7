"""The byte layout of one expert extent: everything a routed expert needs, in one aligned range.

An extent holds, for one expert of one layer, in this order:
  w13  uint8 [2I, D/2]       gate rows then up rows, int4 codes in the layout's arrangement
  w2   uint8 [D, I/2]        down, same arrangement
  p13  bf16  [D/64, 2I, 2]   (scale, bias) pairs for w13
  p2   bf16  [I/64, D, 2]    (scale, bias) pairs for w2
padded to a multiple of 4096 bytes, so O_DIRECT reads need no bounce buffer.
Fusing gate and up makes a decode step two kernel calls per expert instead of three.
The arrangement of the codes (`int4_layout`) is part of the layout: a file records the one
it was written in, and a read into a pool converts to the host kernel's if they differ.

In the BF16 format (format.py: a teacher's experts) an extent holds the weights themselves,
  w13  bf16 [2I, D]   gate rows then up rows
  w2   bf16 [D, I]    down
and p13, p2 are empty; nothing is converted on a read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from edge0.formats import quant
from edge0.formats.format import INT4, Format
from edge0.formats.int4_layout import UNRECORDED, Int4Layout, relayout

ALIGN = INT4.extent_align
_FIELD_ALIGN = 64


@dataclass(frozen=True)
class ExpertTensors:
    """Views of one extent in kernel form. After a pool load, pairs hold (scale, zero)."""

    w13: torch.Tensor
    p13: torch.Tensor
    w2: torch.Tensor
    p2: torch.Tensor


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True)
class ExtentLayout:
    """Offsets of the four fields inside an extent of an expert with hidden D and width I,
    and the arrangement of its int4 codes (sizes and offsets do not depend on it)."""

    hidden: int
    inter: int
    int4: Int4Layout = UNRECORDED
    format: Format = INT4

    def __post_init__(self) -> None:
        self.format.check_quantizable("expert gate/up projection", 2 * self.inter, self.hidden)
        self.format.check_quantizable("expert down projection", self.hidden, self.inter)

    @property
    def fields(self) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
        d, i, g = self.hidden, self.inter, self.format.group_size
        if self.format.quantized:
            shapes = {
                "w13": (torch.uint8, (2 * i, d // 2)),
                "w2": (torch.uint8, (d, i // 2)),
                "p13": (torch.bfloat16, (d // g, 2 * i, 2)),
                "p2": (torch.bfloat16, (i // g, d, 2)),
            }
        else:
            shapes = {
                "w13": (torch.bfloat16, (2 * i, d)),
                "w2": (torch.bfloat16, (d, i)),
                "p13": (torch.bfloat16, (0, 2 * i, 2)),
                "p2": (torch.bfloat16, (0, d, 2)),
            }
        out, offset = {}, 0
        for name, (dtype, shape) in shapes.items():
            out[name] = (dtype, shape, offset)
            nbytes = dtype.itemsize
            for s in shape:
                nbytes *= s
            offset = _round_up(offset + nbytes, _FIELD_ALIGN)
        return out

    @property
    def payload_bytes(self) -> int:
        dtype, shape, offset = self.fields["p2"]
        return offset + dtype.itemsize * shape[0] * shape[1] * shape[2]

    @property
    def nbytes(self) -> int:
        return _round_up(self.payload_bytes, self.format.extent_align)

    def with_int4(self, int4: Int4Layout) -> ExtentLayout:
        return replace(self, int4=int4)

    def views(self, buf: torch.Tensor) -> ExpertTensors:
        """Tensor views into a uint8 buffer of nbytes; no copy."""
        parts = {}
        for name, (dtype, shape, offset) in self.fields.items():
            n = dtype.itemsize
            for s in shape:
                n *= s
            parts[name] = buf[offset : offset + n].view(dtype).view(shape)
        return ExpertTensors(**parts)

    def finalize(
        self,
        buf: torch.Tensor,
        stored: Int4Layout | None = None,
        reorder: Callable[[torch.Tensor, Int4Layout], None] | None = None,
        kernel_pairs: Callable[[torch.Tensor], None] = quant.to_kernel_pairs,
    ) -> None:
        """Turn stored bytes into kernel form in place: finalize_views on `buf`'s views."""
        self.finalize_views(self.views(buf), stored, reorder, kernel_pairs)

    def finalize_views(
        self,
        t: ExpertTensors,
        stored: Int4Layout | None = None,
        reorder: Callable[[torch.Tensor, Int4Layout], None] | None = None,
        kernel_pairs: Callable[[torch.Tensor], None] = quant.to_kernel_pairs,
    ) -> None:
        """Turn the stored bytes under an extent's views into kernel form in place: (scale,
        bias) pairs into the kernel's (scale, zero) with `kernel_pairs` (quant.to_kernel_pairs,
        or native.to_kernel_pairs: the same bits in one loop), and codes written in the
        `stored` arrangement into this layout's. A layout in the int8 order needs `reorder`
        (codes, their own arrangement), which puts codes in it in place
        (native.put_in_int8_order). Float weights are in kernel form as stored."""
        if not self.format.quantized:
            return
        kernel_pairs(t.p13)
        kernel_pairs(t.p2)
        # (in_own_order makes a new layout: ~5 us, for every read of a pool)
        own = self.int4.in_own_order() if self.int4.int8_order else self.int4
        if stored is not None and stored != own:
            self.relayout_codes(t, stored, own)
        if self.int4.int8_order:
            if reorder is None:
                raise ValueError(f"{self.int4.name}: codes in the int8 order need a reorder")
            reorder(t.w13, own)
            reorder(t.w2, own)

    def relayout_codes(self, t: ExpertTensors, src: Int4Layout, dst: Int4Layout) -> None:
        """In place: the codes of w13 and w2 from the `src` arrangement to `dst`."""
        d, i = self.hidden, self.inter
        t.w13.copy_(relayout(t.w13, 2 * i, d, src, dst))
        t.w2.copy_(relayout(t.w2, d, i, src, dst))

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """Quantize one expert's float weights (gate/up [I, D], down [D, I]) into an extent
        (in the BF16 format: round them to bf16)."""
        if not self.format.quantized:
            buf = torch.zeros(self.nbytes, dtype=torch.uint8)
            t = self.views(buf)
            t.w13.copy_(torch.cat([gate, up], dim=0))
            t.w2.copy_(down)
            return buf
        q13, s13, b13 = quant.quantize_affine(torch.cat([gate, up], dim=0))
        q2, s2, b2 = quant.quantize_affine(down)
        return self.pack_quantized(q13, s13, b13, q2, s2, b2)

    def pack_quantized(self, q13, s13, b13, q2, s2, b2) -> torch.Tensor:
        """Lay out already-quantized weights (q uint8 [N, K], scale/bias [N, K/64])."""
        if not self.format.quantized:
            raise ValueError(f"{self.format.name} extents hold weights, not int4 codes")
        buf = torch.zeros(self.nbytes, dtype=torch.uint8)
        t = self.views(buf)
        t.w13.copy_(self.int4.pack(q13))
        t.w2.copy_(self.int4.pack(q2))
        t.p13.copy_(quant.pairs_from(s13, b13))
        t.p2.copy_(quant.pairs_from(s2, b2))
        return buf

    def dequantize(self, t: ExpertTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (w13 [2I, D], w2 [D, I]) from finalized views, as the kernel computes them."""
        if not self.format.quantized:
            return t.w13.float(), t.w2.float()
        d, i = self.hidden, self.inter
        w13 = self.int4.dequantize(t.w13, t.p13, 2 * i, d)
        w2 = self.int4.dequantize(t.w2, t.p2, d, i)
        return w13, w2

    def dequantize_stored(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 weights from raw stored bytes with the MLX formula scale * q + bias."""
        d, i = self.hidden, self.inter
        t = self.views(buf)
        if not self.format.quantized:
            return t.w13.float(), t.w2.float()
        w13 = quant.dequantize_affine(
            self.int4.unpack(t.w13, 2 * i, d), t.p13[..., 0].t(), t.p13[..., 1].t()
        )
        w2 = quant.dequantize_affine(
            self.int4.unpack(t.w2, d, i), t.p2[..., 0].t(), t.p2[..., 1].t()
        )
        return w13, w2
