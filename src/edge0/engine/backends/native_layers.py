"""A decode token's decoder layer through the native ops: which layers they serve, and the call.

`torch.ops.edge0.attention_rows` (decode_ops.cpp) computes blocks.py DecoderLayer's
attention half for one token of one sequence (one row), `x + attention(input_norm(x))` and
its post-attention norm, with the operations of the module path in the same order (the int4
products with edge0's kernel, which computes torch's bit for bit; the norms with norms.cpp,
which adds in ATen's order), so it is bit-identical to it. An MoE block then routes and runs
its experts as its own forward does, with the call's hooks (`MoEBlock.parts`; its softmax
routing through `torch.ops.edge0.router_topk` or `softmax_topk`), and
`torch.ops.edge0.moe_combine` adds the weighted experts, the shared expert and the residual
as the module path adds them; a dense MLP runs as the module's own. Served: RMSNorm layer
norms (or ZeroCenteredRMSNorm ones, Qwen3.5's, with q/k norms of that kind), fp32 or bf16,
and layers.py Attention with projections that are Int4Linear or a float nn.Linear (either
under an enabled or disabled LoraLinear), q/k norms per head or none, full or partial rotary,
with or without Qwen3.5's output gate. A layer with anything else (q/k norm over the whole
projection or another norm, clipping, a sliding window, biases) is not served, and neither
is a forward of several tokens of one sequence: those take the module's own forward.

A batched decode step's rows (models/base.py RowsForward: a token of each of B requests, each
with its own cache and position) go through the same op, each row's attention over its own
cache; their MoE block then routes and runs its experts for all rows (RowsForward's hooks),
and its weighted sum and the residual are the module path's ATen ops. Every float product
whose result reaches a later layer (the router, an adapter's, a float projection, a dense MLP
or shared expert) is computed on each row alone, and the int4 kernels and the heads compute
each row as they compute one: so a row stepped with others gives its own step's bits up to
the LM head (a matmul over several rows adds in another order; with int8 activations a
difference of ~1e-7 there moves an activation's int8 code by a whole step).

The engine hands these to decode forwards as `Forward.layers`; nothing is installed into the
model.
Shape legend: D hidden, H query heads, G kv heads, Dh head dim.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from edge0 import native
from edge0.models.blocks import DecoderLayer, MoEBlock
from edge0.models.int4 import Int4Linear
from edge0.models.layers import Attention, KVCache, RMSNorm, RowCaches, ZeroCenteredRMSNorm
from edge0.models.lora import LoraLinear
from edge0.models.routing import SoftmaxTopK

log = logging.getLogger(__name__)


# Widths tried, most likely first: ATen's float sums run 8 lanes on x86 (its sum kernel has no
# AVX-512 build), 4 with 128-bit NEON vectors, 16 where a 512-bit build exists.
SUM_LANES = (8, 4, 16)
# Row lengths whose sums tell the widths apart (each also crosses a vector boundary)
_CALIBRATION_SIZES = (1024, 128, 100, 2067)


@functools.cache
def sum_lanes(cache_dir: Path | None = None) -> int | None:
    """The vector width ATen's float sum reduction adds with in this process, found by
    computing RMSNorm both ways on random rows: the first of SUM_LANES whose edge0.rms_norm
    equals layers.py RMSNorm bit for bit on all of them. None (with a warning) if none does:
    the native layers are then not used."""
    op = native.op("rms_norm", cache_dir)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for n in _CALIBRATION_SIZES:
        norm = RMSNorm(n, 1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(n, generator=gen))
            for scale in (1.0, 1e3):
                x = torch.randn(4, n, generator=gen) * scale
                cases.append((x, norm.weight, norm(x)))
    for lanes in SUM_LANES:
        if all(torch.equal(op(x, w, 1e-6, lanes), ref) for x, w, ref in cases):
            return lanes
    log.warning(
        "the native norms do not add in ATen's order on this CPU (%s); decode layers use the "
        "PyTorch path",
        torch.backends.cpu.get_cpu_capability(),
    )
    return None


def projection(m: nn.Module) -> tuple[list[torch.Tensor], float] | None:
    """The op's tensors for one projection and its LoRA scale, or None if it cannot take it."""
    if isinstance(m, LoraLinear):
        base = projection(m.base)
        if base is None or not m.enabled:
            return base
        return base[0] + [m.lora_A, m.lora_B], m.scale
    if isinstance(m, Int4Linear) and m.bias is None:
        return [m.packed, m.pairs.view(torch.bfloat16)], 0.0
    if type(m) is nn.Linear and m.bias is None:
        return [m.weight], 0.0
    return None


def servable(layer: nn.Module) -> bool:
    """Whether the op computes this decoder layer's attention half as its forward does (see
    the module docstring)."""
    if not isinstance(layer, DecoderLayer):
        return False
    norm = type(layer.input_layernorm)  # RMSNorm, or ZeroCenteredRMSNorm for every norm
    if (
        norm not in (RMSNorm, ZeroCenteredRMSNorm)
        or type(layer.post_attention_layernorm) is not norm
    ):
        return False
    attn = layer.mixer
    if type(attn) is not Attention or attn.clip is not None:
        return False
    if attn.window is not None or attn.qk_norm not in (None, "head"):
        return False
    if attn.qk_norm == "head" and not (type(attn.q_norm) is norm and type(attn.k_norm) is norm):
        return False
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
    return all(projection(m) is not None for m in projections)


class NativeRoute:
    """An MoE block's softmax top-k routing through the ops, which run its ATen ops in one
    call: the block's own router (under its adapter, if any) with routing.softmax_topk
    (edge0::router_topk), or softmax_topk of the call's prediction (edge0::softmax_topk);
    either among the allowed experts if the call has them (a staged set wider than K). A
    router of another kind goes through the block's own routing."""

    def __init__(self, block: MoEBlock, router_topk: Callable, softmax_topk: Callable):
        self.block, self.router_topk, self.softmax_topk = block, router_topk, softmax_topk
        self.norm = block.selector.norm_topk_prob
        self._key, self._gate = None, None

    def _router(self) -> tuple[list[torch.Tensor], float] | None:
        """The op's gate tensors and LoRA scale (`projection`'s, for a float gate under an
        adapter or none), again only when the gate or its adapter's switch changed; None
        where the op cannot take the gate."""
        gate = self.block._modules["gate"]
        key = (gate, gate.__dict__.get("enabled"))
        if key != self._key:
            self._key, parts = key, projection(gate)
            # a float gate's parts are [weight] or [weight, A, B]; an int4 one's start uint8
            dense = parts is not None and parts[0][0].dtype in (torch.float32, torch.bfloat16)
            self._gate = parts if dense else None
        return self._gate

    def __call__(self, h: torch.Tensor, fwd) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        block = self.block
        logits = fwd.predicted.get(block.layer)  # a prediction replaces the router
        allowed = fwd.allowed.get(block.layer)
        gate = self._router() if logits is None else None
        if gate is not None and gate[0][0].dtype == h.dtype:
            return tuple(self.router_topk(h, *gate, block.top_k, self.norm, allowed))
        if logits is None:
            logits = block.gate(h)
        return logits, *self.softmax_topk(logits, block.top_k, self.norm, allowed)


class MoeTail:
    """A decoder layer's second half for one row at decode, x + mlp(h) (h: x's post-attention
    norm): an MoE block routed through the ops where it routes by softmax top-k (NativeRoute),
    its experts and shared expert as the block runs them (MoEBlock.parts), the weighted sum and
    the residual in one op (moe_combine), as the module adds them; a dense MLP as the module's
    own."""

    def __init__(self, layer: DecoderLayer, ops: tuple[Callable, ...], lanes: int):
        _, self.combine, router_topk, softmax_topk = ops
        block, self.lanes = layer.mlp_block, lanes
        self.mlp, self.is_moe = block, layer.is_moe
        softmax = layer.is_moe and type(block.selector) is SoftmaxTopK
        self.route = NativeRoute(block, router_topk, softmax_topk) if softmax else None

    def __call__(self, x: torch.Tensor, h: torch.Tensor, fwd) -> torch.Tensor:
        if not self.is_moe:
            return x + self.mlp(h)
        routed, weights, shared = self.mlp.parts(h.view(1, -1), fwd, self.route)
        return self.combine(routed, weights, x, shared, self.lanes)


class NativeLayer:
    """A decoder layer's stand-in at decode: one token of one sequence, or of each of a
    batched step's rows, in fp32 or bf16 (the layer's weights in its dtype), through the ops;
    anything else through the layer itself."""

    def __init__(self, layer: DecoderLayer, ops: tuple[Callable, ...], lanes: int, int8: bool):
        self.layer, self.lanes = layer, lanes
        self.op = ops[0]
        self.tail = MoeTail(layer, ops, lanes)
        self.route, self.mlp, self.is_moe = self.tail.route, self.tail.mlp, self.tail.is_moe
        self.layout, self.isa = native.kernel_args(int8)
        # several rows: with int8 activations each row's own kernel, so that a row's step is
        # its step alone; with bf16 torch's int4 kernel's bits, the module path's
        self.rows_kernel = (self.layout, self.isa) if int8 else native.kernel_args(False)
        a = self.mixer = layer.mixer
        self.eps = a.q_norm.eps if a.qk_norm == "head" else 0.0
        self.zero_centred = type(layer.input_layernorm) is ZeroCenteredRMSNorm
        self._key, self._args = None, None

    def _static(self) -> tuple[torch.dtype, tuple, tuple, tuple] | None:
        """The ops' arguments that do not change from token to token (the dtype of the
        layer's weights; those before the rotary tables; those after the position, for one
        sequence and for rows), computed again only when a projection or its adapter's state
        changed, or None if the ops cannot take a projection (an adapter of another kind
        swapped in)."""
        layer, a = self.layer, self.mixer
        modules = a._modules  # (nn.Module's attribute lookup costs several dict lookups)
        q, k, v, o = modules["q_proj"], modules["k_proj"], modules["v_proj"], modules["o_proj"]
        projections = (q, k, v, o)
        # an adapter's switch (lora.py), read from the instance: getattr on a projection
        # without one raises inside nn.Module.__getattr__, ~4 us each
        on = "enabled"
        key = (q, k, v, o, q.__dict__.get(on), k.__dict__.get(on), v.__dict__.get(on))
        key += (o.__dict__.get(on),)
        if key != self._key:
            self._key, self._args = key, None
            parts = [projection(m) for m in projections]
            if None not in parts:
                pre, post = layer.input_layernorm, layer.post_attention_layernorm
                qk = (a.q_norm.weight, a.k_norm.weight) if a.qk_norm == "head" else (None, None)
                head = (pre.weight, pre.eps, post.weight, post.eps, *[p[0] for p in parts])
                head += ([p[1] for p in parts], *qk, self.eps)
                tail = (a.heads, a.kv_heads, a.head_dim, a.head_dim**-0.5, self.lanes)
                kind = (a.output_gate, self.zero_centred)
                one, rows = (*tail, self.layout, self.isa, *kind), (*tail, *self.rows_kernel, *kind)
                self._args = pre.weight.dtype, head, one, rows
        return self._args

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fwd):
        a, cache = self.mixer, fwd.cache
        cos, sin = rope
        args = self._static()
        if (
            args is None
            or x.dtype != args[0]
            or x.dtype not in (torch.float32, torch.bfloat16)
            or cos.shape[-1] > a.head_dim
            or cos.dtype != x.dtype
        ):
            return self.layer(x, rope, fwd)
        if type(cache) is RowCaches and x.shape[1] == 1:
            return self._rows(x, rope, fwd, args)
        if x.shape[:2] != (1, 1) or type(cache) is not KVCache or cache.quantized:
            return self.layer(x, rope, fwd)
        n = cache.length[a.layer]
        k_buf, v_buf = cache.slot(a.layer, 1)
        x, h = self.op(x, *args[1], cos, sin, [k_buf], [v_buf], [n], *args[2])
        cache.length[a.layer] = n + 1
        return self.tail(x, h, fwd)

    def _rows(self, x: torch.Tensor, rope, fwd, args) -> torch.Tensor:
        """A batched decode step's rows x [B, 1, D] (fwd: a RowsForward) through the layer."""
        layer, caches = self.mixer.layer, fwd.cache.rows
        if any(type(c) is not KVCache or c.quantized for c in caches):
            return self.layer(x, rope, fwd)
        slots = [c.slot(layer, 1) for c in caches]
        n = [c.length[layer] for c in caches]
        k, v = [s[0] for s in slots], [s[1] for s in slots]
        x, h = self.op(x, *args[1], *rope, k, v, n, *args[3])
        for c in caches:
            c.length[layer] += 1
        if not self.is_moe:
            return x + each_row(self.mlp, h)
        # MoEBlock.forward's sum and DecoderLayer's residual, as they compute them on rows
        h = h.view(x.shape[0], -1)
        routed, weights, shared = self.mlp.parts(h, fwd, self.route, each_row)
        y = (routed * weights[..., None].to(h.dtype)).sum(dim=1)
        if shared is not None:
            y = y + shared
        return x + y.view(x.shape)


def each_row(f: Callable, h: torch.Tensor) -> torch.Tensor:
    """f on each row of h [B, ...] alone, in a buffer of its own, as that row's step alone
    computes it (a matmul over several rows adds in another order: decode_ops.cpp
    linear_each_row); f(h) where h has one row."""
    if h.shape[0] == 1:
        return f(h)
    return torch.cat([f(h[i : i + 1].clone()) for i in range(h.shape[0])])


def layer_ops(cache_dir: Path | None = None) -> tuple[Callable, ...]:
    """The ops a NativeLayer calls (its attention half; MoeTail's combine and routing)."""
    names = ("attention_rows", "moe_combine", "router_topk", "softmax_topk")
    return tuple(native.op(name, cache_dir) for name in names)


def native_layers(model: nn.Module, cache_dir=None, int8: bool = False) -> dict[int, NativeLayer]:
    """The stand-in for every decoder layer the op serves, by layer index (none where the
    float sums' order could not be matched here: see sum_lanes); `int8`: its int4
    projections through the int8-activation kernel."""
    lanes = sum_lanes(cache_dir)
    if lanes is None:
        return {}
    ops = layer_ops(cache_dir)
    return {
        i: NativeLayer(layer, ops, lanes, int8)
        for i, layer in enumerate(model.backbone.layers)
        if servable(layer)
    }
