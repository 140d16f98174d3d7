"""Linear-attention layers at decode through the native ops: Qwen3.5/3.6's Gated DeltaNet
(`torch.ops.edge0.delta_rows`) and Ling's Kimi Delta Attention (`kda_rows`, decode_ops.cpp).

Each op computes its module's forward for one token of each of a step's sequences: the input
projections, the causal conv over the last W inputs, the gated delta rule on its [H, Dk, Dv]
state (a decay per head, or per key channel), the gated output norm and the output
projection, with the module's operations in the module's order, advancing the conv window and
the state in place. The module's ~60 ATen ops and the copies of the state between them become
one call; the layer's norms and residuals stay the module's, its MoE half one row's MoeTail.
With bf16 activations the result is the module's bit for bit (tests/test_native_delta.py);
with int8 activations the int4 projections take the int8 kernel, as the attention layers' do.
Served: projections that are Int4Linear or float nn.Linear (either under a LoraLinear), the
module's own output norm (SiLU-gated for Gated DeltaNet, sigmoid-gated for KDA), one token of
each row, a float cache. Anything else takes the layer's own forward.
Shape legend: D hidden, H heads (Hk / Hv key / value), Dk / Dv their dims, W conv width.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from edge0 import native
from edge0.engine.backends.native_layers import MoeTail, layer_ops, projection, sum_lanes
from edge0.models.bailing_hybrid import KimiDeltaAttention
from edge0.models.blocks import DecoderLayer
from edge0.models.layers import GatedRMSNorm, KVCache, RowCaches
from edge0.models.qwen3_5_moe import GatedDeltaNet


class NativeLinear:
    """A linear-attention decoder layer's stand-in at decode: its mixer through its op for one
    token of each row, in fp32 or bf16; anything else through the layer itself. A subclass
    names the mixer's projections and the op's other arguments."""

    kind: type  # the mixer's module class
    projections: tuple[str, ...]
    norm: str  # the mixer's GatedRMSNorm, and the activation of its gate
    gate: Callable

    def __init__(self, layer: DecoderLayer, op: Callable, tail: MoeTail, lanes: int, int8: bool):
        self.layer, self.op, self.tail, self.lanes = layer, op, tail, lanes
        self.mixer = layer.mixer
        self.layout, self.isa = native.kernel_args(int8)
        self._key, self._args = None, None

    @classmethod
    def servable(cls, layer) -> bool:
        """Whether the op computes this decoder layer's mixer as its forward does."""
        if not isinstance(layer, DecoderLayer) or type(layer.mixer) is not cls.kind:
            return False
        norm = getattr(layer.mixer, cls.norm)
        if type(norm) is not GatedRMSNorm or norm.act is not cls.gate:
            return False
        return all(projection(layer.mixer._modules[p]) is not None for p in cls.projections)

    def weights(self) -> tuple:
        """The op's arguments between the projections' LoRA scales and the state."""
        raise NotImplementedError

    def dims(self) -> tuple:
        """The op's head counts and sizes."""
        raise NotImplementedError

    def _static(self) -> tuple[tuple, tuple] | None:
        """The op's arguments that do not change from token to token, again only when a
        projection or its adapter's switch changed; None if the op cannot take one."""
        modules = [self.mixer._modules[p] for p in self.projections]
        key = tuple(modules) + tuple(p.__dict__.get("enabled") for p in modules)
        if key != self._key:
            self._key, self._args = key, None
            parts = [projection(p) for p in modules]
            if None not in parts:
                head = (*[p[0] for p in parts], [p[1] for p in parts], *self.weights())
                self._args = head, (*self.dims(), self.lanes, self.layout, self.isa)
        return self._args

    def __call__(self, x: torch.Tensor, rope, fwd) -> torch.Tensor:
        layer, cache, args = self.layer, fwd.cache, self._static()
        caches = cache.rows if type(cache) is RowCaches else [cache]
        if (
            args is None
            or x.shape[1] != 1
            or x.dtype not in (torch.float32, torch.bfloat16)
            or any(type(c) is not KVCache for c in caches)
            or len(caches) != x.shape[0]
        ):
            return layer(x, rope, fwd)
        at = self.mixer.layer
        slots = [c.state_slot(at, 1) for c in caches]
        windows, states = [s[0] for s in slots], [s[1] for s in slots]
        y = self.op(layer.input_layernorm(x), *args[0], windows, states, *args[1])
        for c in caches:
            c.length[at] += 1
        return second_half(layer, self.tail, x + y, fwd)


class NativeDelta(NativeLinear):
    """Qwen3.5's Gated DeltaNet layer through edge0::delta_rows."""

    kind, norm, gate = GatedDeltaNet, "norm", F.silu
    projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")

    def weights(self) -> tuple:
        m = self.mixer
        return m.conv1d.weight, m.dt_bias, m.A_log, m.norm.weight, m.norm.eps

    def dims(self) -> tuple:
        m = self.mixer
        return m.hk, m.hv, m.dk, m.dv


class NativeKda(NativeLinear):
    """Ling's Kimi Delta Attention layer (the reference 8B tier's) through edge0::kda_rows."""

    kind, norm, gate = KimiDeltaAttention, "o_norm", torch.sigmoid
    projections = ("q_proj", "k_proj", "v_proj", "f_proj", "b_proj", "g_proj", "dense")

    def weights(self) -> tuple:
        m = self.mixer
        # q's, k's and v's taps side by side, as the module concatenates them for its conv
        conv = torch.cat([m.q_conv1d.weight, m.k_conv1d.weight, m.v_conv1d.weight]).detach()
        norm = m.o_norm
        return conv, m.dt_bias, m.A_log, norm.weight, norm.eps, m.safe_gate, m.lower_bound

    def dims(self) -> tuple:
        return self.mixer.h, self.mixer.dh


def second_half(layer: DecoderLayer, tail: MoeTail, x: torch.Tensor, fwd) -> torch.Tensor:
    """DecoderLayer.forward after its mixer's residual: x + mlp(post_norm(x)), through the
    tail where x is one row of one token, else as the layer computes it."""
    h = layer.post_attention_layernorm(x)
    if x.shape[:2] == (1, 1) and type(fwd.cache) is not RowCaches:
        return tail(x, h, fwd)
    mlp = layer.mlp_block
    return x + (mlp(h, fwd) if layer.is_moe else mlp(h))


def delta_layers(model: nn.Module, cache_dir: Path | None = None, int8: bool = False) -> dict:
    """The stand-in for every linear-attention layer an op serves (Gated DeltaNet, Kimi Delta
    Attention), by layer index (none where the float sums' order could not be matched here:
    see sum_lanes). A hybrid's attention layers are native_layers.py's."""
    lanes = sum_lanes(cache_dir)
    if lanes is None:
        return {}
    ops, stand_ins = layer_ops(cache_dir), {}
    for i, layer in enumerate(model.backbone.layers):
        for kind, name in ((NativeDelta, "delta_rows"), (NativeKda, "kda_rows")):
            if kind.servable(layer):
                op = native.op(name, cache_dir)
                stand_ins[i] = kind(layer, op, MoeTail(layer, ops, lanes), lanes, int8)
    return stand_ins
