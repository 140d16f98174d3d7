"""int4 affine group-64 quantization (the MLX convention) and the CPU kernel's weight layout.

A quantized matrix W [N, K] (N outputs, K inputs) is stored as
  q      uint4 in [0, 15], grouped by 64 along K
  scale  bf16 [K/64, N]     w = scale * q + bias        (MLX affine convention)
  bias   bf16 [K/64, N]

The CPU kernel `aten._weight_int4pack_mm_for_cpu` computes (q - 8) * scale + zero, so the
kernel's zero is bias + 8 * scale; `to_kernel_pairs` derives it in place after a read.
Its packed weight layout is, per block of 32 output rows, one 16-byte row per input column:
row i of the block sits in the low nibble of byte i (i < 16) or the high nibble of byte i-16.
"""

from __future__ import annotations

import torch

GROUP = 64
BITS = 4
BLOCK_N = 32  # output rows per block of the CPU int4pack layout


def check_quantizable(name: str, n: int, k: int) -> None:
    """Raise ValueError unless an [n, k] matrix fits the int4 group-64 kernel layout."""
    if k % GROUP:
        raise ValueError(f"{name}: input dimension {k} is not a multiple of {GROUP}")
    if n % BLOCK_N:
        raise ValueError(f"{name}: output dimension {n} is not a multiple of {BLOCK_N}")


def quantize_affine(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize W [N, K] with MLX's affine 4-bit math; returns q uint8 [N, K], scale, bias.

    Per group of 64: the edge of larger magnitude (min or max) is represented exactly, the
    step is (max - min) / 15 snapped so that the edge lands on an integer level.
    scale and bias come back as bf16 [N, K/64], as MLX stores them for bf16 weights.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    w_max = g.amax(-1)
    w_min = g.amin(-1)
    n_bins = float(2**BITS - 1)
    mask = w_min.abs() > w_max.abs()
    scale = torch.clamp((w_max - w_min) / n_bins, min=1e-7)
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    q0 = torch.round(edge / scale)
    nonzero = q0 != 0
    scale = torch.where(nonzero, edge / torch.where(nonzero, q0, 1.0), scale)
    bias = torch.where(nonzero, edge, torch.zeros_like(edge))
    q = torch.round((g - bias[..., None]) / scale[..., None]).clamp_(0, n_bins)
    return q.reshape(n, k).to(torch.uint8), scale.to(torch.bfloat16), bias.to(torch.bfloat16)


def dequantize_affine(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """w = scale * q + bias in fp32, from q [N, K] and scale/bias [N, K/64] (MLX formula)."""
    n, k = q.shape
    g = q.float().reshape(n, k // GROUP, GROUP)
    return (scale.float()[..., None] * g + bias.float()[..., None]).reshape(n, k)


def pack_cpu(q: torch.Tensor) -> torch.Tensor:
    """Pack q uint8 [N, K] (values 0..15) into the CPU int4pack layout, uint8 [N, K/2]."""
    n, k = q.shape
    blocks = q.reshape(n // BLOCK_N, BLOCK_N, k).permute(0, 2, 1)  # [N/32, K, 32]
    packed = blocks[..., :16] | (blocks[..., 16:] << 4)  # [N/32, K, 16]
    return packed.reshape(n, k // 2).contiguous()


def unpack_cpu(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of pack_cpu: uint8 [N, K/2] -> q uint8 [N, K]."""
    p = packed.reshape(n // BLOCK_N, k, 16)
    both = torch.cat([p & 15, p >> 4], dim=-1)  # [N/32, K, 32]
    return both.permute(0, 2, 1).reshape(n, k)


def pairs_from(scale: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Interleave [N, K/64] scale and bias (or zero) into the kernel's [K/64, N, 2] bf16."""
    return torch.stack([scale.t(), second.t()], dim=-1).to(torch.bfloat16).contiguous()


def to_kernel_pairs(pairs: torch.Tensor) -> None:
    """In place: (scale, bias) pairs -> (scale, zero) with zero = bias + 8 * scale."""
    zero = pairs[..., 1].float() + 8.0 * pairs[..., 0].float()
    pairs[..., 1].copy_(zero)


def dequantize_kernel(packed: torch.Tensor, pairs: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """fp32 [N, K] exactly as the kernel sees it: (q - 8) * scale + zero.

    Works in the packed orientation ([N/32, K, 32] tiles) with contiguous operands and
    materialises W^T [K, N]; the result is its transposed view, which F.linear consumes
    without a copy. ~10x faster than unpacking row-major first on the CPUs measured.
    """
    nb = n // BLOCK_N
    p = packed.view(nb, k // GROUP, GROUP, 16)
    q = torch.cat([p & 15, p >> 4], dim=-1).float()  # [N/32, K/64, 64, 32]
    pr = pairs.float().view(k // GROUP, nb, BLOCK_N, 2).permute(1, 0, 2, 3)  # [N/32, K/64, 32, 2]
    scale = pr[..., 0].unsqueeze(2).contiguous()
    offset = (pr[..., 1] - 8.0 * pr[..., 0]).unsqueeze(2).contiguous()
    w = torch.addcmul(offset, q, scale)  # q * scale + (zero - 8 * scale)
    return w.permute(1, 2, 0, 3).reshape(k, n).t()


def int4_linear(x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """y = x @ W.T with W in kernel form; x is cast to bf16 (the kernel is ~10x slower in fp32)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, GROUP, pairs)
