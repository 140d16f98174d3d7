"""Prompt scoring: each prompt token's log-probability under the logits of the position
before it, from the prefill forward itself (`Engine.prefill(every_position=True)`).

This is what `/v1/completions` returns with `echo` and `logprobs` (and what
lm-evaluation-harness's loglikelihood tasks read), and what `edge0 eval --served` sums.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch


@dataclass
class ScoredToken:
    token: int
    logprob: float  # -inf where the model gives it no mass
    top: list[tuple[int, float]]  # the most likely tokens at this position, best first


def score(logits: torch.Tensor, targets: list[int], n_top: int = 0) -> list[ScoredToken]:
    """Row i of `logits` [T, V] scores `targets[i]` (the token that followed that position)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(targets, dtype=torch.long)
    chosen = lp.gather(-1, ids[:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in targets]
    if n_top:
        values, idx = torch.topk(lp, min(n_top, lp.shape[-1]), dim=-1)
        tops = [
            list(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), values.tolist(), strict=True)
        ]
    return [ScoredToken(t, c, top) for t, c, top in zip(targets, chosen, tops, strict=True)]


def windows(tokens: list[int], prefix: int, max_len: int) -> list[tuple[list[int], int]]:
    """A document's tokens as prompts of at most max_len + 1 ids that score each token once:
    the first conditioned on `prefix` (an end-of-text token: the first token needs something
    before it), each later one on the max_len tokens before its own. Each is (ids, n): the
    last n ids are the ones it scores. lm-evaluation-harness splits rolling loglikelihood
    the same way (context length 1), so both score the same forwards."""
    done = min(max_len, len(tokens))
    out = [([prefix, *tokens[:done]], done)]
    while done < len(tokens):
        end = min(len(tokens), done + max_len)
        out.append((tokens[max(0, end - max_len - 1) : end - 1] + [tokens[end - 1]], end - done))
        done = end
    return out


@dataclass
class DocumentScores:
    """Summed log-likelihoods of documents and the counts their perplexities divide by."""

    loglikelihood: float = 0.0
    tokens: int = 0
    words: int = 0  # whitespace-separated words, as lm-evaluation-harness counts them
    bytes: int = 0  # UTF-8 bytes

    def metrics(self) -> dict[str, float]:
        nll = -self.loglikelihood
        return {
            "token_perplexity": math.exp(nll / self.tokens),
            "word_perplexity": math.exp(nll / self.words),
            "byte_perplexity": math.exp(nll / self.bytes),
            "bits_per_byte": nll / self.bytes / math.log(2),
        }


def score_documents(engine, texts: list[str], progress: bool = False) -> DocumentScores:
    """Score whole documents as the server scores a prompt (`/v1/completions` with echo and
    logprobs): each window is one request's prefill, in the engine's prompt chunks, with the
    routing a request gets; nothing restored from the prefix cache."""
    from tqdm import tqdm

    from edge0.engine.sampling import SamplingParams

    tok = engine.tokenizer
    prefix = tok.eos_token_id
    if prefix is None:
        raise ValueError("the tokenizer has no end-of-text token to start a document from")
    sched = engine.scheduler(max_active=1)
    out = DocumentScores()
    for text in tqdm(texts, desc="score", unit="doc", disable=not progress):
        ids = tok.encode(text)
        for window, n in windows(ids, prefix, engine.max_context - 1):
            seq = sched.add(window, 0, SamplingParams(temperature=0), score_top=0)
            while not seq.done:
                sched.step()
            if seq.error is not None:
                raise seq.error
            out.loglikelihood += sum(s.logprob for s in seq.prompt_scores[-n:])
        out.tokens += len(ids)
        out.words += len(re.split(r"\s+", text))
        out.bytes += len(text.encode("utf-8"))
    return out
