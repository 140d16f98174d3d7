"""The frozen int4 base that phases 2 and 3 train through, as the engine serves it.

The student's resident weights are the engine's int4 projections (models/int4.py
`Int4Linear`, differentiable in its input) and its routed experts come from the engine's
pool, within the plan's budget, computed by the backend's expert ops: the forward of a
training step is the served arithmetic, not a float copy of it. Only the LoRA trains, so
the base needs gradients for its inputs alone:

  forward    a layer's experts read from the pool in waves and computed by the int4 kernels
             (executors.WholeLayerExecutor, as a prefill computes them); only x and the
             routing indices are kept
  backward   each expert routed to is read again and dequantized into a scratch buffer
             for that call, and dx = J^T dy of down(silu(gate x) * up x) is added into
             the tokens' rows in ascending expert order (so a seeded run repeats its bits)

With `checkpoint` every decoder layer keeps only its input and recomputes itself in the
backward pass (torch.utils.checkpoint), so activations are one layer's, not every layer's.
Shape legend: T tokens, K active, D hidden, I expert width, n tokens routed to one expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from edge0.engine.executors import PrefillPlan, Slots, WholeLayerExecutor


def swiglu_input_grad(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, dy: torch.Tensor
) -> torch.Tensor:
    """d/dx of down(silu(gate x) * up x) applied to dy: x [n, D], w13 [2I, D] (gate rows
    first), w2 [D, I], dy [n, D] -> fp32 [n, D]."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)  # [n, I] each
    sig = torch.sigmoid(gate)
    da = dy @ w2  # [n, I]
    dgate = da * up * sig * (1 + gate * (1 - sig))  # silu'(g) = s (1 + g (1 - s))
    dup = da * gate * sig
    return torch.cat([dgate, dup], dim=-1) @ w13


class GradExperts:
    """A layer's routed experts from an engine's pool: x [T, D], indices [T, K] -> [T, K, D],
    differentiable in x when autograd asks for it."""

    def __init__(self, engine, layer: int):
        self.pool, self.layer, self.ops = engine.pool, layer, engine.experts
        self.num_experts = engine.config.num_experts

    def __call__(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _RoutedExperts.apply(x, indices, self)
        return self.values(x, indices)

    def values(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The experts' outputs as the engine's prefill computes them (no read-ahead: a
        training forward may be a checkpoint's recomputation, one layer at a time)."""
        plan = PrefillPlan(self.pool, [self.layer], self.num_experts, routed_slots=0)
        return WholeLayerExecutor(self.pool, self.layer, plan, self.ops)(x, indices)

    def input_grad(self, x: torch.Tensor, indices: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        """dx [T, D] for the gradient dy [T, K, D] of values(x, indices)."""
        slots = Slots(indices)  # each expert's places t * K + k and tokens t
        rows = dy.reshape(-1, dy.shape[-1]).float()
        dx = torch.zeros(x.shape, dtype=torch.float32)
        todo = torch.unique(indices).tolist()  # ascending
        layout = self.pool.layout
        while todo:
            room = max(1, self.pool.available())
            wave, todo = todo[:room], todo[room:]
            entries = self.pool.request(self.layer, wave)
            try:
                for e, tensors in zip(wave, self.pool.wait(entries), strict=True):
                    at, tokens = slots.places(e), slots.tokens(e)
                    w13, w2 = layout.dequantize(tensors)  # fp32 scratch, this expert's only
                    g = swiglu_input_grad(x[tokens].float(), w13, w2, rows[at])
                    dx.index_add_(0, tokens, g)
            finally:
                self.pool.release(entries)
        return dx.to(x.dtype)


class _RoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, indices: torch.Tensor, experts: GradExperts):
        ctx.experts = experts
        ctx.save_for_backward(x, indices)
        return experts.values(x, indices)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, indices = ctx.saved_tensors
        return ctx.experts.input_grad(x, indices, dy), None, None


def executors(engine) -> dict[int, GradExperts]:
    """Every MoE layer's experts from the engine's pool, differentiable in their input."""
    return {i: GradExperts(engine, i) for i in engine.moe_layers}


def checkpointed_layers(model: torch.nn.Module) -> dict[int, Callable]:
    """Stand-ins (Forward.layers) that run each decoder layer under activation
    checkpointing: its input is kept, its inside recomputed in the backward pass."""

    def wrap(layer: torch.nn.Module) -> Callable:
        def run(x, rope, fwd):
            if not torch.is_grad_enabled():
                return layer(x, rope, fwd)
            return checkpoint(layer, x, rope, fwd, use_reentrant=False)

        return run

    return {i: wrap(layer) for i, layer in enumerate(model.backbone.layers)}
