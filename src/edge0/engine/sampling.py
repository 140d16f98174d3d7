"""Token sampling: penalties, temperature, top-k, top-p, min-p, seeded once per request, and
the model's defaults.

A request's seed initialises its own torch.Generator once; every later token draws from that
same stream, so a seeded request is reproducible and tokens are not re-seeded one by one. What
a request leaves out comes from the model's generation_config.json (`SamplingDefaults`), for
`edge0 generate`, `edge0 chat` and the server alike.

The order is transformers' (and vLLM's): penalties change the logits first, then temperature,
top-k, top-p and min-p filter them. The penalties apply to greedy decoding too. They follow
the semantics people already tune for:

- `presence_penalty` and `frequency_penalty` (OpenAI): a token generated c times so far loses
  `presence * (c > 0) + frequency * c` from its logit. The prompt does not count.
- `repetition_penalty` (transformers' RepetitionPenaltyLogitsProcessor, llama.cpp's
  `--repeat-penalty`): a token seen in the prompt or the output has its logit divided by the
  penalty where positive, multiplied where negative. 1 is off.
- `min_p` (transformers' MinPLogitsWarper, llama.cpp's `--min-p`): after temperature, tokens
  less probable than `min_p` times the most probable are dropped.

Reported logprobs are the model's own (before penalties and filters), as vLLM reports them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from edge0.engine.grammar import CompiledGrammar

# a smaller penalty divides a logit into float32 overflow (inf, then NaN probabilities)
MIN_REPETITION_PENALTY = 0.01


@dataclass
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # constrained decoding (engine/grammar.py): only tokens the grammar allows are drawn
    grammar: CompiledGrammar | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty >= MIN_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be >= {MIN_REPETITION_PENALTY}, "
                f"got {self.repetition_penalty}"
            )

    @property
    def greedy(self) -> bool:
        """Temperatures this small would overflow the scaled logits; they mean greedy."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


class Sampler:
    """Draws token ids from logits [V] under one request's SamplingParams.

    With a penalty set it keeps the request's token counts: `prompt` seeds the tokens the
    repetition penalty sees, and every token it draws is counted.
    """

    def __init__(self, params: SamplingParams, prompt: list[int] | None = None):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self._prompt = list(prompt or [])
        self._tokens: _TokenCounts | None = None  # made at the first penalised draw
        self.constraint = params.grammar.constraint() if params.grammar is not None else None

    def penalized_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [V] (float32) after the repetition, presence and frequency penalties.

        Only the tokens seen so far change, so the penalties index those rather than
        computing over the vocabulary: on a 152k vocabulary that is ~20 us a token instead of
        ~1 ms."""
        p, x = self.params, logits.float()
        if not p.penalized:
            return x
        if self._tokens is None:
            self._tokens = _TokenCounts(self._prompt, x.shape[-1], x.device)
        x, t = x.clone(), self._tokens
        if p.repetition_penalty != 1.0 and t.n_seen:
            idx = t.seen[: t.n_seen]
            v = x[idx]
            x[idx] = torch.where(v < 0, v * p.repetition_penalty, v / p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and t.n_generated:
            idx, c = t.generated[: t.n_generated], t.counts[: t.n_generated]
            x[idx] -= p.frequency_penalty * c + p.presence_penalty
        return x

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens left after the penalties, temperature, top-k, top-p and min-p: their
        scaled logits and ids (ids None: every token, in vocabulary order; else most likely
        first).

        top-p needs the tokens in order of probability only as far as the nucleus reaches, so
        it takes the top 256 (then 4x as many) until their mass reaches p instead of sorting
        the vocabulary: on an 8k vocabulary a sort costs ~0.35 ms, more than a decode step's
        tenth on the built-in model.
        """
        p = self.params
        x = self.penalized_logits(logits) / p.temperature
        ids = None
        if p.top_k and p.top_k < x.shape[-1]:
            x, ids = torch.topk(x, p.top_k)
        if p.top_p < 1.0:
            probs = torch.softmax(x, dim=-1)
            k = min(NUCLEUS_START, x.shape[-1])
            while True:
                top, order = torch.topk(probs, k)
                cum = top.cumsum(-1)
                if cum[-1] >= p.top_p or k == x.shape[-1]:
                    break
                k = min(4 * k, x.shape[-1])
            n = int((cum - top < p.top_p).sum())  # keep the token that crosses p
            order = order[: max(n, 1)]
            x, ids = x[order], (order if ids is None else ids[order])
        if p.min_p > 0:
            probs = torch.softmax(x, dim=-1)
            keep = probs >= p.min_p * probs.max()
            x, ids = x[keep], (keep.nonzero()[:, 0] if ids is None else ids[keep])
        return x, ids

    def filtered_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [V] after the penalties, temperature, top-k, top-p and min-p; removed tokens
        are -inf."""
        x, ids = self.candidates(logits)
        if ids is None:
            return x
        return torch.full_like(logits, float("-inf"), dtype=x.dtype).index_put_((ids,), x)

    def __call__(self, logits: torch.Tensor) -> int:
        c = self.constraint
        if c is not None:
            if c.stopped:  # the grammar is complete: the answer ends
                return c.eos
            logits = c.allowed(logits)
        if self.params.greedy:
            token = int(torch.argmax(self.penalized_logits(logits)))
        else:
            token = self._draw(*self.candidates(logits))
        if self._tokens is not None:
            self._tokens.add(token)
        if c is not None:
            c.consume(token)
        return token

    def _draw(self, x: torch.Tensor, ids: torch.Tensor | None) -> int:
        """One draw from softmax(x), among the candidates only (top-k and top-p leave tens or
        hundreds of a vocabulary's tokens, and torch.multinomial's cost grows with the
        length). torch.multinomial rather than an inverse CDF: a batched forward's logits
        differ from a solo one's by rounding, and an inverse CDF over the vocabulary turns
        that into another token far more often (26 of 60 seeded 16-token sequences on the
        built-in model differed, against 0 of 60)."""
        i = int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=self.generator))
        return i if ids is None else int(ids[i])


class _TokenCounts:
    """A request's distinct tokens for the penalties: those in the prompt or generated (the
    repetition penalty's), and the generated ones with their counts (presence, frequency), as
    index tensors grown in place."""

    def __init__(self, prompt: list[int], vocab: int, device: torch.device):
        self.vocab = vocab
        ids = list(dict.fromkeys(t for t in prompt if 0 <= t < vocab))
        self.seen = torch.empty(max(64, 2 * len(ids)), dtype=torch.long, device=device)
        self.seen[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        self.n_seen, self._seen = len(ids), set(ids)
        self.generated = torch.empty(64, dtype=torch.long, device=device)
        self.counts = torch.zeros(64, dtype=torch.float32, device=device)
        self.n_generated, self._slot = 0, {}

    def add(self, token: int) -> None:
        if not 0 <= token < self.vocab:
            return
        if token not in self._seen:
            self._seen.add(token)
            self.seen = _room(self.seen, self.n_seen)
            self.seen[self.n_seen] = token
            self.n_seen += 1
        slot = self._slot.get(token)
        if slot is None:
            slot = self._slot[token] = self.n_generated
            self.generated, self.counts = _room(self.generated, slot), _room(self.counts, slot)
            self.generated[slot] = token
            self.n_generated += 1
        self.counts[slot] += 1


def _room(t: torch.Tensor, n: int) -> torch.Tensor:
    """t, or a copy twice as long, so that index n fits."""
    if n < t.shape[0]:
        return t
    grown = torch.zeros(2 * t.shape[0], dtype=t.dtype, device=t.device)
    grown[: t.shape[0]] = t
    return grown


NUCLEUS_START = 256  # top-p first looks for its nucleus among this many tokens
GREEDY_BELOW = 1e-5  # temperatures below this are sampled greedily
# a top_p at or below the top token's probability (at least 1/vocab) keeps that token alone;
# below float32's range it would even round to 0 in the sampler and keep nothing
GREEDY_TOP_P_BELOW = 1e-6


def _number(value, lo: float, hi: float, default: float) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and lo <= value <= hi
    return float(value) if ok else default


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for the sampling fields it leaves out: the model's
    generation_config.json values, else the OpenAI defaults. The file's temperature, top_p,
    top_k, min_p and repetition_penalty are read as transformers and vLLM read them; its
    presence_penalty and frequency_penalty (OpenAI's names, which transformers keeps as
    attributes and vLLM ignores) are edge0's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @classmethod
    def from_model_dir(cls, path: Path) -> SamplingDefaults:
        f = Path(path) / "generation_config.json"
        cfg = json.loads(f.read_text()) if f.is_file() else {}
        d = cls()
        t, k = cfg.get("temperature"), cfg.get("top_k")
        if cfg.get("do_sample") is False:
            t = 0.0
        return cls(
            temperature=float(t) if isinstance(t, int | float) else d.temperature,
            top_p=_number(cfg.get("top_p"), 1e-9, 1, d.top_p),
            top_k=int(k) if isinstance(k, int) and k > 0 else d.top_k,
            min_p=_number(cfg.get("min_p"), 0, 1, d.min_p),
            repetition_penalty=_number(
                cfg.get("repetition_penalty"), MIN_REPETITION_PENALTY, 10, d.repetition_penalty
            ),
            presence_penalty=_number(cfg.get("presence_penalty"), -2, 2, d.presence_penalty),
            frequency_penalty=_number(cfg.get("frequency_penalty"), -2, 2, d.frequency_penalty),
        )

    def resolve(
        self,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        *,
        min_p: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
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
            min_p=self.min_p if min_p is None else min_p,
            presence_penalty=self.presence_penalty
            if presence_penalty is None
            else presence_penalty,
            frequency_penalty=(
                self.frequency_penalty if frequency_penalty is None else frequency_penalty
            ),
            repetition_penalty=(
                self.repetition_penalty if repetition_penalty is None else repetition_penalty
            ),
        )
