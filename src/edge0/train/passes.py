"""Which training windows each step reads, as a pure function of (seed, step).

A pass covers the training stream once: non-overlapping windows of seq_len + 1 tokens (inputs
and shifted targets) laid from a random offset, read in a random order; each pass draws its
own offset and order. Nothing about the order is stored: a resumed run recomputes the batch
of any step exactly, so an interrupted run and an uninterrupted one read the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PassOrder:
    tokens: int  # length of the training stream
    seq_len: int
    batch: int
    seed: int

    def __post_init__(self):
        if self.steps_per_pass < 1:
            raise ValueError(
                f"{self.tokens} training tokens hold {self.windows_per_pass} windows of "
                f"{self.seq_len + 1} tokens: fewer than one batch of {self.batch}; "
                "use more data, a shorter seq_len or a smaller batch"
            )

    @property
    def windows_per_pass(self) -> int:
        # the largest offset is seq_len - 1; every pass gets the same number of windows
        return (self.tokens - self.seq_len) // self.seq_len

    @property
    def steps_per_pass(self) -> int:
        return self.windows_per_pass // self.batch  # the last partial batch is left out

    def plan(self, pass_index: int) -> tuple[int, torch.Tensor]:
        """(offset, window order) of one pass, from its own generator."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + pass_index)
        offset = int(torch.randint(0, self.seq_len, (1,), generator=gen))
        return offset, torch.randperm(self.windows_per_pass, generator=gen)

    def starts(self, step: int) -> torch.Tensor:
        """Start positions [batch] of the windows that global step `step` (0-based) reads."""
        pass_index, i = divmod(step, self.steps_per_pass)
        offset, order = self.plan(pass_index)
        return offset + order[i * self.batch : (i + 1) * self.batch] * self.seq_len

    def batch_at(self, stream: torch.Tensor, step: int) -> torch.Tensor:
        """[batch, seq_len + 1] token windows (int64) for step `step`."""
        if stream.numel() != self.tokens:
            raise ValueError(
                f"stream has {stream.numel()} tokens, the order was made for {self.tokens}"
            )
        span = torch.arange(self.seq_len + 1)
        return stream[self.starts(step)[:, None] + span].long()
