"""The prefix cache: finished requests' state, reused by a later request that starts the same way.

A chat re-sends the whole conversation every turn. When a request ends, a copy of its state
(the KV cache of every token it fed, recurrent states) is kept with those tokens; a new request
restores the longest prefix of its prompt that some entry holds and prefills only the rest.

What reuse may take, so that it is exact:
- attention keys and values can be cut back to any shorter length: the longest common prefix;
- a recurrent (linear-attention) state exists only after exactly the tokens it has seen, so in
  a family with recurrent layers an entry is reused only by a prompt that extends its whole
  sequence (a multi-turn chat does; two prompts that diverge inside it do not);
- the last MIN_PREFILL tokens of a prompt are always prefilled again: the forward must give the
  last position's logits, and the prerouter's features for the first decode token are that
  position's hidden state with the experts it and the position before it ran, which a new
  request's (fresh) prerouter state only sees if both positions are prefilled.

Entries are copies: a hit copies into the new request's own cache and a request never writes
into an entry, so concurrent requests can share one and nothing of a request outlives it except
through a prompt that repeats its tokens. The bytes held never exceed `capacity_bytes` (the
serving plan's floor.prefix_cache); the least recently used entry goes first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from edge0.models.layers import CacheSnapshot, KVCache

log = logging.getLogger(__name__)

MIN_PREFILL = 2  # prompt tokens always prefilled again, see the module docstring


@dataclass
class PrefixStats:
    lookups: int = 0  # requests that looked for a prefix
    hits: int = 0  # requests that restored one
    hit_tokens: int = 0  # prompt tokens restored instead of prefilled
    saved: int = 0  # entries kept
    evicted: int = 0  # entries dropped for room (or covered by a longer one)

    def snapshot(self) -> PrefixStats:
        return PrefixStats(**vars(self))

    def minus(self, other: PrefixStats) -> PrefixStats:
        return PrefixStats(**{k: v - getattr(other, k) for k, v in vars(self).items()})


@dataclass
class _Entry:
    tokens: torch.Tensor  # [n] the sequence whose state `snap` holds
    snap: CacheSnapshot
    nbytes: int


class PrefixCache:
    """Finished requests' state under a byte bound; see the module docstring."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self.stats = PrefixStats()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: list[int]) -> int:
        """How many tokens of `prompt` restore() would restore (nothing is copied or counted)."""
        return self._best(prompt)[0]

    def restore(self, cache: KVCache, prompt: list[int]) -> int:
        """Copy the longest reusable prefix of `prompt` into the empty `cache`; returns its
        length in tokens (0: nothing reusable, the cache is untouched)."""
        self.stats.lookups += 1
        best, best_key = self._best(prompt)
        if best_key is None:
            return 0
        self._entries.move_to_end(best_key)
        cache.restore(self._entries[best_key].snap, best)
        self.stats.hits += 1
        self.stats.hit_tokens += best
        return best

    def _best(self, prompt: list[int]) -> tuple[int, int | None]:
        """The longest reusable prefix of `prompt`: (its length, the entry's key or None)."""
        limit = len(prompt) - MIN_PREFILL
        if limit < 1 or not self._entries:
            return 0, None
        ids = torch.tensor(prompt, dtype=torch.long)
        best, best_key = 0, None
        for key, entry in self._entries.items():
            n = min(_common_prefix(entry.tokens, ids), limit)
            if entry.snap.recurrent and n != entry.snap.length:
                continue  # its recurrent state is only right at its own length
            if n > best:
                best, best_key = n, key
        return best, best_key

    def save(self, cache: KVCache, tokens: list[int], held: CacheSnapshot | None = None) -> None:
        """Keep a copy of the state of `tokens`: the first len(tokens) positions of `cache`,
        or `held` (a snapshot taken earlier, of exactly those tokens). Evicts the least
        recently used entries for room; skipped if it cannot fit at all."""
        n = len(tokens)
        if held is not None:
            assert held.length == n, (held.length, n)
            need, recurrent = held.nbytes(), held.recurrent
        else:
            length = cache.uniform_length()
            if not n or length is None or n > length or (cache.recurrent and n != length):
                return  # nothing, or a state that does not hold exactly these tokens
            need, recurrent = cache.snapshot_nbytes(n), cache.recurrent
        if need > self.capacity_bytes:
            log.debug("prefix cache: %d tokens (%d bytes) exceed its bound", n, need)
            return
        ids = torch.tensor(tokens, dtype=torch.long)
        for key, entry in self._entries.items():
            if _serves(entry.tokens, ids, entry.snap.recurrent):
                self._entries.move_to_end(key)  # already held: kept longer
                return
        for key in [k for k, e in self._entries.items() if _serves(ids, e.tokens, recurrent)]:
            self._drop(key)
        while self.bytes + need > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        snap = held if held is not None else cache.snapshot(n)
        self._entries[self._next_key] = _Entry(ids, snap, need)
        self._next_key += 1
        self.bytes += need
        self.stats.saved += 1

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes
        self.stats.evicted += 1


def _serves(held: torch.Tensor, other: torch.Tensor, recurrent: bool) -> bool:
    """Whether the state of `held` serves every prompt that the state of `other` could."""
    n = other.numel()
    if n > held.numel() or (recurrent and n != held.numel()):
        return False
    return bool(torch.equal(held[:n], other))


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-d token tensors."""
    n = min(a.numel(), b.numel())
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0, 0]) if differ.numel() else n
