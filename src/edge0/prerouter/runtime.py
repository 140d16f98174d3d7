"""Prediction-as-routing at decode: per-request head features and the one flush per token.

During every forward the engine's Forward object calls `observe` for each MoE layer; owner
layers keep their last MoE input and the experts they executed (at this token and at the
previous one). After the logits of token t, `flush` evaluates every head in one batch, turns
each prediction into the consumer's top-K with the consumer's own routing function, and hands
every expert that is not resident to the I/O threads at once (pinning the staged set). At
token t+1 each consumer routes by `predicted[consumer]`, so the experts it runs are exactly
the experts staged for it.

First decode token: the heads run on the last prompt position at the end of prefill, so every
generated token, the first included, is prediction-routed, as in training.

The same object drives batched student generation in training (`rows` sequences decoding in
lockstep, no pool): features and predictions are then kept per row.
Shape legend: H heads, R rows, D hidden, E experts, K active experts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from edge0.prerouter.head import Prerouter, StackedHeads, features
from edge0.routing import topk_onehot
from edge0.store.pool import Entry, ExpertPool


@dataclass
class PrerouterStats:
    flushes: int = 0
    head_ns: int = 0  # time evaluating heads and selecting experts
    staged: int = 0  # experts staged (requested ahead) by flushes
    unstaged: int = 0  # consumer layers that could not be staged for lack of free slots
    dropped: int = 0  # routed experts missing from their layer's staged set: 0 by construction
    consumed: int = 0  # routed experts executed on prediction-routed layers

    def snapshot(self) -> PrerouterStats:
        return PrerouterStats(**vars(self))


class PrerouterRuntime:
    """Owns the prediction state of the current request; see the module docstring."""

    def __init__(self, prerouter: Prerouter, model, pool: ExpertPool | None):
        self.wiring = prerouter.wiring
        self.owners = self.wiring.owners
        self.consumers = self.wiring.consumers
        self._row = {o: i for i, o in enumerate(self.owners)}
        self.heads = StackedHeads(prerouter, self.owners)
        self.blocks = {c: model.moe_block(c) for c in self.consumers}
        self.num_experts = prerouter.num_experts
        self.pool = pool
        self.stats = PrerouterStats()
        self.predicted: dict[int, torch.Tensor] = {}
        self.staged: dict[int, list[Entry]] = {}
        self._h: dict[int, torch.Tensor] = {}
        self._executed: dict[int, torch.Tensor] = {}
        self._previous: dict[int, torch.Tensor] = {}
        self.rows = 1

    def reset(self, rows: int = 1) -> None:
        """Forget the request: features, predictions, and the pins of staged experts."""
        self.rows = rows
        for entries in self.staged.values():
            self.pool.release(entries)
        self.staged.clear()
        self.predicted.clear()
        self._h.clear()
        self._executed.clear()
        self._previous.clear()

    def observe(
        self, layer: int, h: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor
    ) -> None:
        """Forward observer: keep owner features of each row's last position."""
        if layer not in self._row:
            return
        e, rows = self.num_experts, self.rows
        idx = indices.view(rows, -1, indices.shape[-1])  # [R, T, K]
        if idx.shape[1] > 1:
            self._previous[layer] = topk_onehot(idx[:, -2], e)
        else:
            self._previous[layer] = self._executed.get(layer, torch.zeros(rows, e))
        self._executed[layer] = topk_onehot(idx[:, -1], e)
        self._h[layer] = h.view(rows, -1, h.shape[-1])[:, -1].detach()

    def take(self, consumer: int) -> list[Entry]:
        return self.staged.pop(consumer, [])

    @torch.no_grad()
    def flush(self) -> None:
        """After a token's logits: predict every consumer's experts and start their reads."""
        t0 = time.perf_counter_ns()
        x = torch.stack(
            [features(self._h[o], self._executed[o], self._previous[o]) for o in self.owners]
        )  # [H, R, D + 2E]
        logits = self.heads(x)  # [H, R, E]
        for c in self.consumers:
            self.predicted[c] = logits[self._row[self.wiring.owner_of[c]]]  # [R, E]
        if self.pool is None:  # training: predictions only, no staging
            self.stats.head_ns += time.perf_counter_ns() - t0
            self.stats.flushes += 1
            return
        chosen = {
            c: sorted(self.blocks[c].select(self.predicted[c])[1][0].tolist())
            for c in self.consumers
        }
        self.stats.head_ns += time.perf_counter_ns() - t0
        self.stats.flushes += 1
        for c in self.consumers:
            # in layer order: the earliest consumers need their bytes first
            if self.pool.available() < len(chosen[c]):
                self.stats.unstaged += 1
                continue
            self.staged[c] = self.pool.request(c, chosen[c])
            self.stats.staged += len(chosen[c])
