"""A decode token's attention through the native op: which layers it serves, and the call.

`torch.ops.edge0.attention_decode` (decode_ops.cpp) runs the ops of layers.py
Attention.forward for one token of one sequence, in the same order (the int4 products with
edge0's kernel, which computes torch's bit for bit), so it is bit-identical to it: its
projections (Int4Linear, or a float nn.Linear, either under an enabled or disabled
LoraLinear), q/k RMSNorm per head or none, full rotary, the token's key and value written
into the sequence's cache, SDPA over the cache, the output projection. A layer with anything
else (q/k norm over the whole projection or another norm, clipping, an output gate, a sliding
window, partial rotary, biases) is not served by it, and neither is a forward of several
tokens or rows: those take the module's own forward.

The engine hands these to decode forwards as `Forward.mixers`; nothing is installed into the
model.
Shape legend: D hidden, H query heads, G kv heads, Dh head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from edge0 import native
from edge0.lora import LoraLinear
from edge0.models.int4 import Int4Linear
from edge0.models.layers import Attention, KVCache, RMSNorm


def _projection(m: nn.Module) -> tuple[list[torch.Tensor], float] | None:
    """The op's tensors for one projection and its LoRA scale, or None if it cannot take it."""
    if isinstance(m, LoraLinear):
        base = _projection(m.base)
        if base is None or not m.enabled:
            return base
        return base[0] + [m.lora_A, m.lora_B], m.scale
    if isinstance(m, Int4Linear) and m.bias is None:
        return [m.packed, m.pairs.view(torch.bfloat16)], 0.0
    if type(m) is nn.Linear and m.bias is None:
        return [m.weight], 0.0
    return None


def servable(attn: nn.Module) -> bool:
    """Whether the op computes this mixer as its forward does (see the module docstring)."""
    if type(attn) is not Attention or attn.clip is not None or attn.output_gate:
        return False
    if attn.window is not None or attn.qk_norm not in (None, "head"):
        return False
    if attn.qk_norm == "head" and not (
        type(attn.q_norm) is RMSNorm and type(attn.k_norm) is RMSNorm
    ):
        return False
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
    return all(_projection(m) is not None for m in projections)


class NativeAttention:
    """A mixer's stand-in at decode: one token of one sequence through the op, anything else
    through the module itself."""

    def __init__(self, attn: Attention, op: Callable[..., torch.Tensor]):
        self.attn, self.op = attn, op
        self.layout, self.isa = native.kernel_args()
        self.eps = attn.q_norm.eps if attn.qk_norm == "head" else 0.0

    def __call__(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None
    ) -> torch.Tensor:
        a = self.attn
        cos, sin = rope
        if x.shape[:2] != (1, 1) or type(cache) is not KVCache or cos.shape[-1] != a.head_dim:
            return a(x, rope, cache)
        parts = [_projection(m) for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)]
        if None in parts:  # a projection swapped since (an adapter of another kind)
            return a(x, rope, cache)
        norms = (a.q_norm.weight, a.k_norm.weight) if a.qk_norm == "head" else (None, None)
        n = cache.length[a.layer]
        k_buf, v_buf = cache.slot(a.layer, 1)
        out = self.op(
            x,
            *[p[0] for p in parts],
            [p[1] for p in parts],
            *norms,
            self.eps,
            cos,
            sin,
            k_buf,
            v_buf,
            n,
            a.heads,
            a.kv_heads,
            a.head_dim,
            a.head_dim**-0.5,
            self.layout,
            self.isa,
        )
        cache.length[a.layer] = n + 1
        return out


def native_mixers(model: nn.Module, op: Callable[..., torch.Tensor]) -> dict[int, NativeAttention]:
    """The op for every decoder layer whose mixer it serves, by layer index."""
    out = {}
    for i, layer in enumerate(model.backbone.layers):
        if servable(layer.mixer):
            out[i] = NativeAttention(layer.mixer, op)
    return out
