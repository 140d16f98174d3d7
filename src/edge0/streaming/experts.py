"""The experts module every MoE block calls: `experts(x, indices) -> [T, K, D]`.

The model routes; this module only computes each selected expert for its tokens, and does
not weight or sum them. Two implementations share the contract:

  ResidentExperts   float weights in memory (the teacher, parity tests, training)
  StreamingExperts  int4 extents from the expert pool, through an executor the engine picks

Shape legend: T tokens, K active experts per token, D hidden, I expert width, E experts.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


def swiglu_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) with float weights w13 [2I, D] (gate rows first), w2 [D, I]."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def for_each_expert(x: torch.Tensor, indices: torch.Tensor, compute) -> torch.Tensor:
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
    xs = x[order // k]  # [T*K, D] rows in expert order
    # split (not slicing) so that the backward pass concatenates the grads once
    ys = torch.cat(
        [compute(e, rows).to(x.dtype) for e, rows in enumerate(xs.split(counts)) if rows.shape[0]]
    )

    return ys[torch.argsort(order)].view(t, k, -1)


class ResidentExperts(nn.Module):
    """All experts of a layer as float parameters, named like transformers' fused experts."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return for_each_expert(
            x, indices, lambda e, xs: swiglu_dense(xs, self.gate_up_proj[e], self.down_proj[e])
        )


class Executor(Protocol):
    """One way of producing expert outputs from the pool (exact, whole-layer, staged)."""

    def __call__(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor: ...


class StreamingExperts(nn.Module):
    """Experts whose weights live on disk; `executor` is set explicitly by the engine per phase."""

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer
        self.executor: Executor | None = None

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self.executor is None:
            raise RuntimeError(f"layer {self.layer}: no expert executor installed")
        return self.executor(x, indices)
