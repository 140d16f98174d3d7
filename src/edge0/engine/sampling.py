"""Token sampling: temperature, top-k, top-p, seeded once per request.

A request's seed initialises its own torch.Generator once; every later token draws from that
same stream, so a seeded request is reproducible and tokens are not re-seeded one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        """Temperatures this small would overflow the scaled logits; they mean greedy."""
        return self.temperature < 1e-5


class Sampler:
    """Draws token ids from logits [V] under one request's SamplingParams."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def filtered_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits after temperature, top-k and top-p; removed tokens are -inf."""
        p = self.params
        x = logits.float() / p.temperature
        if p.top_k and p.top_k < x.shape[-1]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_x, dim=-1) >= p.top_p  # keep the token that crosses p
            x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        return x

    def __call__(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(self.filtered_logits(logits), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
