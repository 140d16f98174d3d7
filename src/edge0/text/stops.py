"""Stop strings over a stream of text deltas.

A stop string can arrive split over several tokens, so text that could be the start of one is
held back until the next delta settles it; the stop string itself is never emitted.
"""

from __future__ import annotations

from collections.abc import Iterable


def partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class StopMatcher:
    """Passes text through until the first stop string; see the module docstring."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The part of `text` (plus what was held back) that is safe to emit now."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = self.pending[: min(hits)]
            self.pending, self.stopped = "", True
            return out
        keep = partial_suffix(self.pending, self.stops)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        """What was held back, once no more text will come."""
        out, self.pending = self.pending, ""
        return out
