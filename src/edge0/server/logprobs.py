"""Log-probabilities of sampled tokens, and the text and bytes of single tokens.

Logprobs are taken from the model's raw distribution (log-softmax of the logits before
temperature and top-k/top-p), as vLLM reports them, so a greedy token is always the top entry.
"""

from __future__ import annotations

import collections
import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache

import torch
from transformers import PreTrainedTokenizerBase

from edge0.engine.scoring import ScoredToken

# JSON has no -Infinity; the OpenAI API reports a token with no mass like this
FLOOR = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte fallback


@dataclass
class TokenLogprob:
    token: int
    logprob: float | None  # None: a prompt's first token, which nothing scores
    top: list[tuple[int, float]] | None  # most likely tokens at this step, best first


def prompt_logprobs(prompt: list[int], scores: list[ScoredToken]) -> list[TokenLogprob]:
    """A scored prompt's entries: its first token unscored, then each with its logprob."""
    first = TokenLogprob(prompt[0], None, None)
    rest = [
        TokenLogprob(s.token, _finite(s.logprob), [(t, _finite(v)) for t, v in s.top])
        for s in scores
    ]
    return [first, *rest]


def token_logprob(logits: torch.Tensor, token: int, n_top: int) -> TokenLogprob:
    """The sampled token's logprob and the `n_top` most likely alternatives; logits [V]."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if n_top:
        values, ids = torch.topk(lp, min(n_top, lp.shape[-1]))
        top = [(int(i), _finite(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return TokenLogprob(token, _finite(float(lp[token])), top)


class HeldLogprobs:
    """Releases a token's logprob once text from that token is emitted, so logprobs and text
    agree: the tokens that completed a stop string (or were held back as its possible start)
    and never reached the text are dropped with it."""

    def __init__(self):
        self._held: collections.deque[tuple[int, TokenLogprob]] = collections.deque()
        self._decoded = 0  # characters decoded so far
        self._emitted = 0  # characters released (a prefix of the decoded text)

    def push(self, lp: TokenLogprob | None, decoded: str, emitted: str) -> list[TokenLogprob]:
        """Add a token whose text decoded to `decoded` while `emitted` was released."""
        if lp is not None:
            self._held.append((self._decoded, lp))  # where this token's text starts
        self._decoded += len(decoded)
        return self._release(emitted)

    def finish(self, emitted: str, stopped: bool) -> list[TokenLogprob]:
        """The last release; without a stop string every held entry goes with it."""
        out = self._release(emitted)
        if not stopped:
            out += [lp for _, lp in self._held]
        self._held.clear()
        return out

    def _release(self, emitted: str) -> list[TokenLogprob]:
        self._emitted += len(emitted)
        out = []
        while self._held and self._held[0][0] < self._emitted:
            out.append(self._held.popleft()[1])
        return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


class TokenStrings:
    """Decoded text and raw UTF-8 bytes of one token id (a token may hold part of a character)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tok = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        if self._byte_level:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._decoder = {c: b for b, c in bytes_to_unicode().items()}
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token: int) -> str:
        return self.tok.decode([token], skip_special_tokens=False)

    def _bytes(self, token: int) -> bytes:
        piece = self.tok.convert_ids_to_tokens(token)
        if isinstance(piece, str):
            m = _BYTE_TOKEN.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            if self._byte_level and all(c in self._decoder for c in piece):
                return bytes(self._decoder[c] for c in piece)
        return self._text(token).encode("utf-8")

    def chat_entry(self, lp: TokenLogprob) -> dict:
        """One element of `choices[].logprobs.content` (chat completions)."""
        return {
            **self._one(lp.token, lp.logprob),
            "top_logprobs": [self._one(t, v) for t, v in lp.top],
        }

    def _one(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": list(self.bytes(token))}


def legacy_logprobs(strings: TokenStrings, entries: list[TokenLogprob], offset: int) -> dict:
    """The `logprobs` object of /v1/completions; text offsets start at `offset`."""
    tokens, offsets = [], []
    for e in entries:
        text = strings.text(e.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.top is None else _by_text(strings, e.top) for e in entries],
        "text_offset": offsets,
    }


def _by_text(strings: TokenStrings, top: list[tuple[int, float]]) -> dict[str, float]:
    """The legacy {text: logprob} map. Tokens that decode to the same text (bytes of one
    character each shown as U+FFFD) share a key: it keeps the most likely one's logprob."""
    out: dict[str, float] = {}
    for t, v in top:  # best first
        out.setdefault(strings.text(t), v)
    return out


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(p.get("type") == "ByteLevel" for p in parts)
