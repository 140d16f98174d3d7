"""int4 affine group-64 quantization (the MLX convention) and the CPU kernel's weight layout.

A quantized matrix W [N, K] (N outputs, K inputs) is stored as
  q      uint4 in [0, 15], grouped by 64 along K
  scale  bf16 [K/64, N]     w = scale * q + bias        (MLX affine convention)
  bias   bf16 [K/64, N]

The CPU kernel `aten._weight_int4pack_mm_for_cpu` computes (q - 8) * scale + zero, so the
kernel's zero is bias + 8 * scale; `to_kernel_pairs` derives it in place after a read.
Where the kernel expects each code depends on the machine: see `int4_layout`.
"""

from __future__ import annotations

import torch

from edge0.formats.format import INT4

GROUP = INT4.group_size
BITS = INT4.bits
check_quantizable = INT4.check_quantizable


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
    n_bins = float(INT4.levels)
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


def pairs_from(scale: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Interleave [N, K/64] scale and bias (or zero) into the kernel's [K/64, N, 2] bf16."""
    return torch.stack([scale.t(), second.t()], dim=-1).to(torch.bfloat16).contiguous()


def to_kernel_pairs(pairs: torch.Tensor) -> None:
    """In place: (scale, bias) pairs -> (scale, zero) with zero = bias + 8 * scale."""
    zero = pairs[..., 1].float() + 8.0 * pairs[..., 0].float()
    pairs[..., 1].copy_(zero)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """y = x @ W.T with W in kernel form; x is cast to bf16 (the kernel is ~10x slower in fp32)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, GROUP, pairs)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [R, K] as the int8 kernels take them: per group of 64 inputs, codes
    round(x * (127 / a)) within [-127, 127] (ties to even) for the group's largest magnitude
    a, and the scale d = a / 127 (0 for a group of zeros). Returns codes [R, K/64, 64] (as
    floats) and d [R, K/64]."""
    r, k = x.shape
    g = x.float().reshape(r, k // GROUP, GROUP)
    a = g.abs().amax(-1)
    # a division, as the kernels divide (`127.0 / a` would multiply by a's reciprocal)
    inv = torch.where(a > 0, torch.full_like(a, 127.0) / torch.where(a > 0, a, 1.0), 0.0)
    return torch.round(g * inv[..., None]).clamp_(-127, 127), a / 127.0


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the int8 kernels see it, back in x's dtype: each group's codes times its
    scale (quantize_activations). A float matmul with it prices the int8 activations (edge0
    eval) up to the order of float sums, not the kernels' bits (int4_linear_int8)."""
    xq, d = quantize_activations(x.reshape(-1, x.shape[-1]))
    return (xq * d[..., None]).reshape(x.shape).to(x.dtype)


def int4_linear_int8(x: torch.Tensor, codes: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The reference of the native int8-activation kernels (native/int4_gemv.cpp): y = x @ W.T
    for W [N, K] = (codes - 8) * scale + zero (codes uint8 [N, K] unpacked, pairs the kernel's
    [K/64, N, 2]), x quantized per group by quantize_activations. Per group, the exact integer
    sum I of codes times activation codes, then in fp32, group after group:
    c = c + d * (scale * (I - 8 X) + zero * X), X the group's sum of activation codes. bf16 out.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    n = codes.shape[0]
    xq, d = quantize_activations(x.reshape(-1, k))
    # exact: every partial sum is an integer below 2^53
    dots = torch.einsum("ngk,rgk->rgn", codes.double().reshape(n, k // GROUP, GROUP), xq.double())
    sums = xq.sum(-1)  # exact in fp32 (|X| <= 64 * 127)
    scale, zero = pairs[..., 0].float(), pairs[..., 1].float()
    c = torch.zeros(xq.shape[0], n)
    for g in range(k // GROUP):
        t = (dots[:, g] - 8 * sums[:, g, None].double()).float()
        c = c + d[:, g, None] * (scale[g] * t + zero[g] * sums[:, g, None])
    return c.to(torch.bfloat16).reshape(*lead, n)
