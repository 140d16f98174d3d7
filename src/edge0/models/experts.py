"""Routed experts as the model sees them: `experts(x, indices) -> [T, K, D]`.

The model routes; an experts module only computes each selected expert for its tokens, and
does not weight or sum them. Two modules share the contract:

  ResidentExperts  every expert's float weights in memory (the teacher, training, parity):
                   one grouped GEMM per projection over all experts
  ExpertSlot       no weights: the engine passes, per call, an executor that computes the
                   layer's experts from the int4 pool (`Forward.executors`)

Shape legend: T tokens, K active experts per token, D hidden, I expert width, E experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class Executor(Protocol):
    """Computes a layer's routed experts: x [T, D], indices [T, K] -> [T, K, D]."""

    def __call__(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor: ...


def swiglu_dense(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, inputs: Callable | None = None
) -> torch.Tensor:
    """down(silu(gate x) * up x) with float weights w13 [2I, D] (gate rows first), w2 [D, I];
    `inputs`, if given, is applied to both projections' inputs first."""
    inputs = inputs or (lambda t: t)
    gate, up = F.linear(inputs(x), w13).chunk(2, dim=-1)
    return F.linear(inputs(F.silu(gate) * up), w2)


def sorted_rows(x: torch.Tensor, k: int, order: torch.Tensor) -> torch.Tensor:
    """x [T, D]'s rows for the T*K (token, slot) pairs taken in `order`: [T*K, D].

    `index_select`, not `x[order // k]`: the gradients of both add K rows into each
    token's, but indexing adds them through a parallel scatter, in whatever order two
    threads run, so a seeded training run did not repeat its own bits from one process to
    the next. `index_select`'s gradient (`index_add_`) adds them in index order on the CPU,
    and measured a little faster."""
    return torch.index_select(x, 0, order // k)


def for_each_expert(
    x: torch.Tensor, indices: torch.Tensor, compute: Callable[[int, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Run compute(expert, rows of x) for every expert present in indices [T, K]; -> [T, K, D]."""
    t, k = indices.shape
    if t == 1:  # decode: top-k indices of one token are distinct
        return torch.stack([compute(e, x).squeeze(0).to(x.dtype) for e in indices[0].tolist()])[
            None
        ]
    # Group the T*K (token, slot) pairs by expert with one sort, run each expert on its
    # contiguous slice, and undo the sort with one gather: autograd then sees one gather and
    # one scatter per layer instead of a full-size index_put per expert.
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=int(flat.max()) + 1).tolist()
    xs = sorted_rows(x, k, order)
    # split (not slicing) so that the backward pass concatenates the grads once
    ys = torch.cat(
        [compute(e, rows).to(x.dtype) for e, rows in enumerate(xs.split(counts)) if rows.shape[0]]
    )

    return ys[torch.argsort(order)].view(t, k, -1)


def _grouped_mm_aligned(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch's grouped GEMM needs every row stride to be a multiple of 16 bytes."""
    size = max(x.element_size(), w13.element_size())
    return (x.shape[-1] * size) % 16 == 0 and (w2.shape[-1] * size) % 16 == 0


# torch 2.13's fake-tensor (meta) kernel of grouped_mm accepts only bf16, so torch.compile
# cannot trace it in fp32: the layer's expert computation runs eagerly between graphs.
@torch.compiler.disable
def grouped_swiglu(
    x: torch.Tensor, indices: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """down(silu(gate x) * up x) for every (token, slot) of indices [T, K] -> [T, K, D], with
    all experts' float weights stacked: w13 [E, 2I, D] (gate rows first), w2 [E, D, I].

    One grouped GEMM per projection over the expert-sorted rows replaces E small matmuls.
    Training gains most: indexing w13[e] per expert makes autograd materialise and sum a
    zero-filled [E, 2I, D] gradient for every expert; here each weight gets one gradient.
    """
    t, k = indices.shape
    if w13.dtype != x.dtype:  # autocast leaves the stacked weights in their own dtype
        w13, w2 = w13.to(x.dtype), w2.to(x.dtype)
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # offs[e] = end row of expert e's group; a tensor, so no host sync and no data-dependent
    # Python shapes (torch.compile keeps the layer in one graph)
    offs = torch.bincount(flat, minlength=w13.shape[0]).cumsum(0).to(torch.int32)
    xs = sorted_rows(x, k, order)
    gate, up = F.grouped_mm(xs, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # [T*K, I] x2
    ys = F.grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)  # [T*K, D]
    return ys[torch.argsort(order)].view(t, k, -1)


class ResidentExperts(nn.Module):
    """All experts of a layer as float parameters, named like transformers' fused experts."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        # what both projections' inputs go through first, if anything (edge0 eval's int8
        # activations arm: quant.fake_quantize_activations)
        self.inputs: Callable | None = None

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.gate_up_proj, self.down_proj
        if self.inputs is not None:
            return for_each_expert(
                x, indices, lambda e, xs: swiglu_dense(xs, w13[e], w2[e], self.inputs)
            )
        if _grouped_mm_aligned(x, w13, w2):
            return grouped_swiglu(x, indices, w13, w2)
        return for_each_expert(x, indices, lambda e, xs: swiglu_dense(xs, w13[e], w2[e]))


class ExpertSlot(nn.Module):
    """Where a streamed layer's experts go: computed by the executor of the call's Forward."""

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            f"layer {self.layer}: its experts stream from disk and this call's Forward has no "
            "executor for it"
        )
