"""One request's state in the engine: its cache, prerouter state and decode executors."""

from __future__ import annotations

from edge0.models.layers import CacheSnapshot, KVCache
from edge0.prerouter.runtime import PrerouterState


class Request:
    """One request's state. Its decode executors read this request's staged experts.

    `tokens` are those its cache holds (restored or fed); the first `exact` of them hold the
    state a fresh prompt of those tokens would get (gate-routed). A prediction-routed decode
    step runs other experts than a prefill of its token would, so it ends the exact part.
    """

    def __init__(self, cache: KVCache, pre: PrerouterState | None, decode: dict):
        self.cache, self.pre, self.decode = cache, pre, decode
        self.tokens: list[int] = []
        self.restored = 0  # of `tokens`, taken from the prefix cache
        self.exact = 0
        # recurrent state cannot be cut back: a copy at `exact` tokens, taken before the first
        # prediction-routed step when there is a prefix cache to offer it to
        self.held: CacheSnapshot | None = None

    @property
    def position(self) -> int:
        return self.cache.length[0]

    def release(self) -> None:
        """Unpin what this request staged (it keeps its cache until dropped)."""
        if self.pre is not None:
            self.pre.release()

    def __enter__(self) -> Request:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
