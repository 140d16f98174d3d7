"""Routing math: the one place that turns router (or prerouter) logits into experts and weights.

The router, prerouter training and prerouter inference all call these functions, so a
prediction routes exactly as the layer's own router would have.
Shape legend: T tokens, E experts, K active experts.
"""

from __future__ import annotations

import torch


def softmax_topk(
    logits: torch.Tensor, k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over E in fp32, top-k, optionally renormalised: logits [T, E] -> [T, K] x 2.

    Weights come back in the logits' dtype, as in Qwen-MoE, OLMoE and Mixtral.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, indices = torch.topk(probs, k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), indices


def topk_onehot(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """indices [T, K] -> multi-hot [T, E] float (1 where an expert was selected)."""
    out = torch.zeros(*indices.shape[:-1], num_experts, device=indices.device)
    return out.scatter_(-1, indices, 1.0)
