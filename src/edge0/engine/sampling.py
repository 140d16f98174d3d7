"""Token sampling: temperature, top-k, top-p, seeded once per request, and the model's defaults.

A request's seed initialises its own torch.Generator once; every later token draws from that
same stream, so a seeded request is reproducible and tokens are not re-seeded one by one. What
a request leaves out comes from the model's generation_config.json (`SamplingDefaults`), for
`edge0 generate`, `edge0 chat` and the server alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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


GREEDY_BELOW = 1e-5  # temperatures below this are sampled greedily
# a top_p at or below the top token's probability (at least 1/vocab) keeps that token alone;
# below float32's range it would even round to 0 in the sampler and keep nothing
GREEDY_TOP_P_BELOW = 1e-6


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for the sampling fields it leaves out: the model's
    generation_config.json values, else the OpenAI defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def from_model_dir(cls, path: Path) -> SamplingDefaults:
        f = Path(path) / "generation_config.json"
        cfg = json.loads(f.read_text()) if f.is_file() else {}
        d = cls()
        t, p, k = cfg.get("temperature"), cfg.get("top_p"), cfg.get("top_k")
        if cfg.get("do_sample") is False:
            t = 0.0
        return cls(
            temperature=float(t) if isinstance(t, int | float) else d.temperature,
            top_p=float(p) if isinstance(p, int | float) and 0 < p <= 1 else d.top_p,
            top_k=int(k) if isinstance(k, int) and k > 0 else d.top_k,
        )

    def resolve(
        self,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> SamplingParams:
        """These defaults with what a request sets (None: the default)."""
        t = self.temperature if temperature is None else temperature
        p = self.top_p if top_p is None else top_p
        # dividing logits by a near-zero temperature overflows them, and a near-zero top_p
        # keeps only the most likely token: both mean greedy
        greedy = t < GREEDY_BELOW or p < GREEDY_TOP_P_BELOW
        return SamplingParams(
            temperature=0.0 if greedy else t,
            top_p=1.0 if greedy else p,
            top_k=self.top_k if top_k is None else max(top_k, 0),
            seed=seed,
        )
