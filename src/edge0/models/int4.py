"""int4 resident weights: projections and embeddings held as 4-bit codes, served by the kernel.

On disk a quantized weight is the MLX affine format (the reference's): `<module>.weight` U32
[N, K/8] with the codes LSB-first (viewed as bytes: column 2j in the low nibble, 2j+1 in the
high one), `<module>.scales` and `<module>.biases` BF16 [N, K/64], w = scale * q + bias. That
layout is kernel-neutral: at load a projection is packed once into this machine's int4
arrangement (int4_layout) for `aten._weight_int4pack_mm_for_cpu`, and an embedding keeps the
row-major codes so a token's row is unpacked alone.

Which weights are stored int4 (CausalLM.int4_weights): every nn.Linear of the resident floor whose
shape fits the kernel (out % 32, in % 64), and the token embedding, except the routers (an
MoE block's gate: routing is decided on their logits) and what a family lists in NOT_INT4
(weights used as matrices, not through their forward, such as MLA's absorbed kv_b_proj).
Norms, convolutions and biases are not nn.Linear weights and stay float.
Shape legend: N out features, K in features, V vocabulary, D hidden, G = K/64 groups.
"""

from __future__ import annotations

import torch
from torch import nn

from edge0.formats import quant
from edge0.formats.int4_layout import Int4Layout
from edge0.formats.mlx import unpack

GROUP = quant.GROUP


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 stored as int16 bits: a module's .to(dtype) casts floating buffers, and the kernel
    reads its (scale, zero) pairs as bf16; viewed back with `.view(torch.bfloat16)`."""
    return t.to(torch.bfloat16).contiguous().view(torch.int16)


def pack_words(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (0..15) -> MLX's U32 words [N, K/8], LSB-first."""
    pairs = q[..., 0::2] | (q[..., 1::2] << 4)  # [N, K/2]: byte j holds columns 2j, 2j+1
    return pairs.contiguous().view(torch.int32).view(torch.uint32)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (U32 words [N, K/8], scales, biases bf16 [N, K/64])."""
    q, scales, biases = quant.quantize_affine(w)
    return pack_words(q), scales, biases


def dequantize(words: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] = scale * q + bias from the stored tensors."""
    return quant.dequantize_affine(unpack(words, 4), scales, biases)


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W as int4 codes in the host kernel's arrangement (no float copy)."""

    def __init__(self, words, scales, biases, layout: Int4Layout, has_bias: bool = False):
        super().__init__()
        q = unpack(words, 4)  # [N, K]
        self.out_features, self.in_features = q.shape
        self.register_buffer("packed", layout.pack(q), persistent=False)
        pairs = quant.pairs_from(scales, biases)  # [G, N, 2] (scale, bias)
        quant.to_kernel_pairs(pairs)  # (scale, zero): the kernel computes (q - 8) * scale + zero
        self.register_buffer("pairs", _bits(pairs), persistent=False)
        # a bias stays float and loads with the rest of the state dict
        self.bias = nn.Parameter(torch.empty(self.out_features)) if has_bias else None
        self.layout = layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if torch.is_grad_enabled() and flat.requires_grad:  # training through the frozen base
            y = _Int4Product.apply(flat, self)
        else:
            y = self.product(flat).to(x.dtype)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        """x [R, K] @ W^T by the kernel -> bf16 [R, N]."""
        return quant.int4_linear(flat, self.packed, self.pairs.view(torch.bfloat16))

    def dequantized(self) -> torch.Tensor:
        """fp32 W [N, K] exactly as the kernel sees it."""
        return self.dequantized_rows(0, self.out_features)

    def dequantized_rows(self, first: int, rows: int) -> torch.Tensor:
        """fp32 W[first : first + rows] as the kernel sees it; `first` a multiple of 64 (a
        whole block of every arrangement, whose packed rows are the block's rows)."""
        assert first % 64 == 0, first
        pairs = self.pairs.view(torch.bfloat16)[:, first : first + rows]
        return self.layout.dequantize(
            self.packed[first : first + rows], pairs, rows, self.in_features
        )


# output rows of W dequantized at once in a backward pass: 64 MiB of fp32 at 2048 inputs (a
# 248k-token lm_head whole would be 1.9 GiB)
BACKWARD_ROWS = 8192


class _Int4Product(torch.autograd.Function):
    """y = x W^T through the int4 kernel, differentiable in x (W is frozen): the backward
    multiplies by W dequantized for that call, BACKWARD_ROWS output rows at a time, into a
    scratch matrix freed after it, so training through an int4 base keeps no float copy of
    its weights. Only x is saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, linear: Int4Linear) -> torch.Tensor:
        ctx.linear = linear
        ctx.save_for_backward(x)
        return linear.product(x).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        lin, dy = ctx.linear, dy.float()
        dx = None
        for first in range(0, lin.out_features, BACKWARD_ROWS):
            rows = min(BACKWARD_ROWS, lin.out_features - first)
            part = dy[:, first : first + rows] @ lin.dequantized_rows(first, rows)  # [R, K]
            dx = part if dx is None else dx.add_(part)
        return dx.to(x.dtype), None


class Int4Embedding(nn.Module):
    """Token embeddings as row-major int4 codes; only the looked-up rows are dequantized.
    With tied embeddings `project(h)` is the output projection, through a packed copy."""

    def __init__(self, words, scales, biases, layout: Int4Layout, tied: bool, dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = words.shape[0], words.shape[1] * 8
        self.register_buffer("codes", words.view(torch.uint8), persistent=False)  # [V, D/2]
        self.register_buffer("scales", _bits(scales), persistent=False)
        self.register_buffer("biases", _bits(biases), persistent=False)
        self.head = Int4Linear(words, scales, biases, layout) if tied else None
        self.dtype = dtype  # of the rows handed to the first layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.codes[ids]  # [..., D/2]
        q = torch.stack([rows & 15, rows >> 4], dim=-1).flatten(-2).float()  # [..., D]
        g = q.unflatten(-1, (-1, GROUP))  # [..., G, 64]
        s = self.scales.view(torch.bfloat16)[ids].float()[..., None]
        b = self.biases.view(torch.bfloat16)[ids].float()[..., None]
        return (s * g + b).flatten(-2).to(self.dtype)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., D] -> logits [..., V] (tied output projection)."""
        return self.head(h)


def install(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    layout: Int4Layout,
    source: str,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Replace every module whose weight `state` holds as int4 (`.weight` U32 + `.scales` +
    `.biases`) by its Int4 counterpart, consuming those entries from `state`; `dtype` is the
    compute dtype (of the embedding rows)."""
    modules = dict(model.named_modules())
    tied = model.config.tie_word_embeddings
    for key in [k for k in state if k.endswith(".scales")]:
        path = key.removesuffix(".scales")
        words, scales = state.pop(f"{path}.weight", None), state.pop(key)
        biases = state.pop(f"{path}.biases", None)
        old = modules.get(path)
        if words is None or biases is None or words.dtype != torch.uint32:
            raise ValueError(f"{source}: {key} without its U32 .weight and .biases")
        if isinstance(old, nn.Linear):
            new = Int4Linear(words, scales, biases, layout, has_bias=old.bias is not None)
        elif isinstance(old, nn.Embedding):
            new = Int4Embedding(words, scales, biases, layout, tied, dtype)
        else:
            raise ValueError(f"{source}: {path} is stored as int4 but is not a projection here")
        if words.shape[0] != old.weight.shape[0] or 8 * words.shape[1] != old.weight.shape[1]:
            raise ValueError(
                f"{source}: {path} holds [{words.shape[0]}, {8 * words.shape[1]}] int4 weights, "
                f"the model needs {list(old.weight.shape)}"
            )
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, new)


def dequantize_state(state: dict[str, torch.Tensor]) -> None:
    """In place: every int4 weight of `state` becomes its fp32 `.weight` (the training path,
    which runs the served weights dequantized)."""
    for key in [k for k in state if k.endswith(".scales")]:
        path = key.removesuffix(".scales")
        scales, biases = state.pop(key), state.pop(f"{path}.biases")
        state[f"{path}.weight"] = dequantize(state[f"{path}.weight"], scales, biases)
