"""Routing math: the one place that turns router (or prerouter) logits into experts and weights.

The router, prerouter training and prerouter inference all call these functions, so a
prediction routes exactly as the layer's own router would have.
Shape legend: T tokens, E experts, K active experts.
"""

from __future__ import annotations

import torch


def softmax_topk(
    logits: torch.Tensor, k: int, norm_topk_prob: bool, allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over E in fp32, top-k, optionally renormalised: logits [T, E] -> [T, K] x 2.

    Weights come back in the logits' dtype, as in Qwen-MoE, OLMoE and Mixtral. With `allowed`
    (bool [T, E], at least k per row) the top-k are chosen among the allowed experts only; the
    softmax is still over all E, so the weights are what the family gives those experts.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    if allowed is None:
        weights, indices = torch.topk(probs, k, dim=-1)
    else:
        indices = torch.topk(probs.masked_fill(~allowed, -1.0), k, dim=-1).indices
        weights = probs.gather(-1, indices)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), indices


def sigmoid_group(
    logits: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Ling routing, logits [T, E] -> fp32 weights, indices [T, K].

    Scores are sigmoid(logits) in fp32. The expert bias steers selection only: the best
    `topk_group` of `n_group` groups (ranked by the sum of each group's two best biased
    scores) stay eligible, and the top-k biased scores among them are chosen. The weights
    are the unbiased scores, optionally renormalised, times `scaling`. With `allowed` (bool
    [T, E], at least k per row) only allowed experts are chosen: those of the eligible groups
    when at least k of them are allowed (so the router's own choice is kept whenever it was
    allowed), else any allowed one.
    """
    scores = torch.sigmoid(logits.float())
    choice = scores + bias.float()
    t, e = choice.shape
    groups = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    kept = torch.topk(groups, topk_group, dim=-1).indices
    eligible = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, kept, True)
    eligible = eligible.repeat_interleave(e // n_group, dim=1)
    if allowed is not None:  # the allowed experts of the eligible groups, if k of them are
        both = eligible & allowed
        eligible = torch.where((both.sum(-1, keepdim=True) >= k), both, allowed)
    choice = choice.masked_fill(~eligible, float("-inf"))
    indices = torch.topk(choice, k, dim=-1).indices
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, indices


def topk_onehot(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """indices [T, K] -> multi-hot [T, E] float (1 where an expert was selected)."""
    out = torch.zeros(*indices.shape[:-1], num_experts, device=indices.device)
    return out.scatter_(-1, indices, 1.0)


class SoftmaxTopK:
    """Qwen-MoE, OLMoE, Mixtral: `softmax_topk`, renormalised or not as the family says."""

    def __init__(self, norm_topk_prob: bool):
        self.norm_topk_prob = norm_topk_prob

    def __call__(
        self, logits: torch.Tensor, k: int, gate: torch.nn.Module, allowed=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(logits, k, self.norm_topk_prob, allowed)


class SigmoidGroup:
    """DeepSeek-V3 / Ling: `sigmoid_group` with the gate's selection bias (`gate.bias`)."""

    def __init__(self, n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float):
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling

    def __call__(
        self, logits: torch.Tensor, k: int, gate: torch.nn.Module, allowed=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return sigmoid_group(
            logits,
            gate.bias,
            k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.scaling,
            allowed,
        )
