"""One request's generation: an iterator over a scheduler of its own.

Iterating yields (token, logprobs [V]) per sampled token; it ends at an end-of-text token
("stop") or max_tokens ("length"). Breaking out early is allowed: `close()` (or reading
`stats`) then ends it with finish_reason "stop". Iterating prefills the whole prompt in one
forward (alone, there is nothing to interleave); `advance()` runs one forward per call, a
prompt chunk of at most prefill_chunk tokens or a decode step, so several generations can be
taken in turns. Each keeps its own state, so the order does not change what they produce.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from edge0.engine.stats import GenerationStats


class Generation:
    """One sequence of a scheduler (Scheduler.generation), run by that scheduler's turns."""

    def __init__(self, scheduler, seq):
        self.scheduler, self.seq = scheduler, seq
        self.engine, self.prompt, self.max_tokens = scheduler.engine, seq.prompt, seq.max_tokens

    @property
    def tokens(self) -> list[int]:
        return self.seq.tokens

    @property
    def finish_reason(self) -> str:
        return self.seq.finish_reason

    @property
    def done(self) -> bool:
        """Nothing more to run: it ended, and its last token was handed out."""
        return self.seq.done and not self.seq.out

    def advance(self) -> tuple[int, torch.Tensor] | None:
        """Run one forward: a prompt chunk, or a decode step. Returns the token it sampled, or
        None (a prompt chunk before the last, or the end: then `done` is set)."""
        seq = self.seq
        if not seq.out and not seq.done:
            self.scheduler.step()
            if seq.error is not None:
                raise seq.error
        return seq.out.popleft() if seq.out else None

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        if not self.seq.started:
            self.scheduler.prefill_chunk = len(self.prompt)
        try:
            while not self.done:
                item = self.advance()
                if item is not None:
                    yield item
        except GeneratorExit:  # the caller broke out: end it now, releasing its pins
            self.close()

    def close(self) -> None:
        self.scheduler.cancel(self.seq)

    def drain(self) -> Generation:
        """Run to the end without looking at the tokens as they come; returns self."""
        for _ in self:
            pass
        return self

    @property
    def stats(self) -> GenerationStats:
        self.close()  # (nothing if it has ended)
        return self.seq.stats
