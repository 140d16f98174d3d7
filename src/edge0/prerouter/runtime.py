"""Prediction-as-routing at decode: per-request head features, staging one token ahead.

During every forward the engine's Forward object calls `observe` for each MoE layer; owner
layers keep their last MoE input and the experts they executed (at this token and at the
previous one). At a decode step, as soon as owner layer o has run at token t, its head is
evaluated, the prediction is turned into its consumer's top-K with the consumer's own
routing function, and every expert of that set that is not resident goes to the I/O threads
(pinned). Reads for token t+1 thus start while layers o+1.. of token t still compute: a
read has a whole token of compute to hide behind, not just the layers before its consumer.
After the logits, `flush` makes these the current predictions and staged sets. At token t+1
each consumer routes by `predicted[consumer]`, so the experts it runs are exactly the
experts staged for it.

Heads run on a thread of their own (one intra-op thread) where a core is left beside the
intra-op threads, or where torch's heads are large (`threaded_heads`), so the compute thread
goes on with the next layers while a head evaluates; `flush` waits for them. Other heads on
a machine whose intra-op threads take every core run on the compute thread, where a thread
would only contend with them (docs/prerouter.md). Either way a head's reads go to the I/O
threads and do not block. An owner that is not itself a
consumer (it reads its experts now) stages on the compute thread, so that the room it keeps
for its own reads is decided before it takes it.

First decode token: the heads run on the last prompt position at the end of prefill (all in
one batch, since prefill keeps the pool busy with whole-layer reads), so every generated
token, the first included, is prediction-routed, as in training.

The runtime (heads, their thread, counters) is shared by every request; each request keeps its
own PrerouterState. A state of `rows` sequences decoding in lockstep, with no pool, drives
batched student generation in training: features and predictions are then kept per row.
Shape legend: H heads, R rows, D hidden, E experts, K active experts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from edge0.models.routing import SoftmaxTopK, topk_onehot
from edge0.prerouter.head import NativeHeads, Prerouter, StackedHeads, features
from edge0.store.pool import Entry, ExpertPool
from edge0.util.machine import usable_cores
from edge0.util.threads import single_threaded_pool


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

    def minus(self, other: PrerouterStats) -> PrerouterStats:
        return PrerouterStats(**{k: v - getattr(other, k) for k, v in vars(self).items()})


# A torch head at least this large is evaluated on its own thread even when the intra-op
# threads take every core: reading its weights then overlaps the compute thread's serial parts.
HEADS_THREAD_MIN_BYTES = 2 << 20


def threaded_heads(head_bytes: int, native: bool) -> bool:
    """Whether decode's heads get a thread of their own: where a core is left beside the
    intra-op threads, or where a torch head is large (small torch heads and the native op's
    cost more on a thread than inline on 2 cores; docs/prerouter.md has the measurements)."""
    spare = usable_cores() > torch.get_num_threads()
    return spare or (not native and head_bytes >= HEADS_THREAD_MIN_BYTES)


class PrerouterRuntime:
    """What every request shares: the heads (the native op's, or stacked for torch), their
    thread, the wiring, the counters. A request's own prediction state is a PrerouterState
    (`new_state`)."""

    def __init__(
        self,
        prerouter: Prerouter,
        model,
        pool: ExpertPool | None,
        dtype: torch.dtype = torch.float32,
        stage_width: int | None = None,
        threaded: bool | None = None,
        native: tuple[Callable, int] | None = None,
    ):
        self.wiring = prerouter.wiring
        self.owners = self.wiring.owners
        self.consumers = self.wiring.consumers
        self.row = {o: i for i, o in enumerate(self.owners)}
        self.blocks = {c: model.moe_block(c) for c in self.consumers}
        # experts staged per consumer (the serving plan's W, checked there): K, the prediction
        # is the routing; or W > K, the consumer's router picks its K among the W staged
        k = min(b.top_k for b in self.blocks.values())
        self.stage_width = stage_width or k
        self.wide = self.stage_width > k
        self.num_experts = prerouter.num_experts
        self.pool = pool
        self.stats = PrerouterStats()
        self.consumers_of: dict[int, list[int]] = {}
        for c in self.consumers:
            self.consumers_of.setdefault(self.wiring.owner_of[c], []).append(c)
        # The heads: the native op's fp16 form (`native` = (op, isa), at serving on the CPU),
        # else stacked at the compute dtype (training, CUDA, no native build)
        self.native = self.heads = None
        if native is not None:
            self.native = NativeHeads(prerouter, self.owners, *native)
        else:
            self.heads = StackedHeads(prerouter, self.owners, dtype=dtype)
        # a consumer whose staged set the op picks: the only one of its owner, softmax-routed
        self.op_stages = {
            o: len(cs) == 1 and type(self.blocks[cs[0]].selector) is SoftmaxTopK
            for o, cs in self.consumers_of.items()
        }
        # Heads on their own thread at decode, next to the layers that follow their owner
        # (torch ops release the GIL; one intra-op thread), where that pays (see threaded_heads)
        if threaded is None:
            held = self.native if self.native is not None else self.heads
            per_head = held.nbytes // max(1, len(self.owners))
            threaded = threaded_heads(per_head, native=self.native is not None)
        self.worker = None
        if threaded:
            self.worker = single_threaded_pool(1, "edge0-heads")

    @torch.no_grad()
    def predict(self, owner: int, rows: HeadRows) -> tuple[torch.Tensor, dict]:
        """The owner's head on decode rows -> its logits [B, E] and, for each of its
        consumers, (each row's top-W, ascending, as lists; their mask [B, E] if W > K)."""
        if self.native is not None:
            stage = self.stage_width if self.op_stages.get(owner) else 0
            out = self.native(owner, rows.h, rows.executed, rows.previous, stage)
            if stage:
                (c,) = self.consumers_of[owner]
                return out[0], {c: (out[1].tolist(), out[2] if self.wide else None)}
            logits = out[0]
        else:
            logits = self.heads.one(self.row[owner], rows.features(self.num_experts))
        picks = {}
        for c in self.consumers_of.get(owner, []):
            idx = self.blocks[c].select(logits, self.stage_width)[1]  # [B, W]
            allowed = topk_onehot(idx, self.num_experts).bool() if self.wide else None
            picks[c] = ([sorted(r) for r in idx.tolist()], allowed)
        return logits, picks

    def new_state(self, rows: int = 1) -> PrerouterState:
        return PrerouterState(self, rows)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


def observe_rows(
    states: list[PrerouterState],
    layer: int,
    h: torch.Tensor,
    logits: torch.Tensor,
    indices: torch.Tensor,
) -> None:
    """The observer of one decode forward of B requests, a row each (RowsForward): each
    state keeps its row as its own observe() would, and an owner's head runs once over the
    B rows instead of once per row (a step of 8 requests on the built-in model made 56 head
    calls). Each row's prediction is its own row of that product; over several rows a matmul
    may round differently from one row's (as every shared projection of the step does)."""
    xs = [s._keep(layer, h[i : i + 1], indices[i : i + 1]) for i, s in enumerate(states)]
    if any(x is None for x in xs):  # not an owner, or not a decode step with a pool: no head
        return
    _stage_ahead(states, layer, HeadRows.cat(xs), indices.shape[-1])


@dataclass
class HeadRows:
    """A head's input for decode rows: the owner's MoE input h [B, D], the experts each row
    executed [B, K] and at the step before [B, K] (int64; -1 where there was none)."""

    h: torch.Tensor
    executed: torch.Tensor
    previous: torch.Tensor

    @staticmethod
    def cat(parts: list[HeadRows]) -> HeadRows:
        if len(parts) == 1:
            return parts[0]
        fields = zip(*((p.h, p.executed, p.previous) for p in parts), strict=True)
        return HeadRows(*(torch.cat(f) for f in fields))

    def features(self, num_experts: int) -> torch.Tensor:
        """The head's input as StackedHeads takes it, [B, D + 2E] (features())."""
        return features(self.h, _hot(self.executed, num_experts), _hot(self.previous, num_experts))


def _hot(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Multi-hot [B, E] of indices [B, K], a row of -1 giving zeros (topk_onehot else)."""
    if bool((indices < 0).any()):
        return topk_onehot(indices.clamp(min=0), num_experts) * (indices[:, :1] >= 0)
    return topk_onehot(indices, num_experts)


def _stage_ahead(states: list[PrerouterState], owner: int, rows: HeadRows, k: int) -> None:
    """Decode: an owner's head on its rows, one per state, and its consumers' reads for the
    next token. On the heads thread (if any) when the owner is a consumer of every state,
    whose experts are staged already; otherwise here, keeping room for the K experts the
    owner reads now (decided before this thread requests them)."""
    rt = states[0].rt
    reserves = [0 if owner in s.staged else k for s in states]
    if rt.worker is not None and not any(reserves):
        ran = rt.worker.submit(_head_ahead, states, owner, rows, reserves)
        for s in states:
            s._pending.append(ran)
    else:
        _head_ahead(states, owner, rows, reserves)


def _head_ahead(
    states: list[PrerouterState], owner: int, rows: HeadRows, reserves: list[int]
) -> None:
    """The owner's head on the rows, and each consumer's top-W over the B rows at once (the
    routing's ops are row by row, so each row's set is the one it would choose alone); then
    each state's consumers' predictions and reads, in row order."""
    rt = states[0].rt
    t0 = time.perf_counter_ns()
    made = rt.predict(owner, rows)
    for i, s in enumerate(states):
        s._predicted_by(owner, *_row(made, i, len(states)), reserves[i], t0)
        t0 = time.perf_counter_ns()


def _row(made: tuple[torch.Tensor, dict], i: int, n: int) -> tuple[torch.Tensor, dict]:
    """Row i of PrerouterRuntime.predict's result over n rows, as one row's: its logits
    [1, E] and, per consumer, (its chosen experts, its mask [1, E] or None). A lone row is
    the product itself, not a slice of it."""
    logits, picks = made
    if n == 1:
        return logits, {c: (chosen[0], allowed) for c, (chosen, allowed) in picks.items()}
    return logits[i : i + 1], {
        c: (chosen[i], None if allowed is None else allowed[i : i + 1])
        for c, (chosen, allowed) in picks.items()
    }


class PrerouterState:
    """One request's prediction state (`rows` sequences decoding in lockstep): owner features,
    current and next predictions, and the pins of the experts staged for them."""

    def __init__(self, runtime: PrerouterRuntime, rows: int = 1):
        self.rt = runtime
        self.rows = rows
        self.predicted: dict[int, torch.Tensor] = {}
        self.staged: dict[int, list[Entry]] = {}
        # staged during the current decode step, for the next one
        self._next_predicted: dict[int, torch.Tensor] = {}
        self._next_staged: dict[int, list[Entry]] = {}
        # the experts chosen to stage per consumer, this step and next; with W > K also as the
        # consumer's allowed set (bool [R, E]: each row's own top-W), built where they are chosen
        self.chosen: dict[int, list[int]] = {}
        self._next_chosen: dict[int, list[int]] = {}
        self.allowed: dict[int, torch.Tensor] = {}
        self._next_allowed: dict[int, torch.Tensor] = {}
        self._pending: list[Future] = []
        self._h: dict[int, torch.Tensor] = {}
        self._executed: dict[int, torch.Tensor] = {}
        self._previous: dict[int, torch.Tensor] = {}

    def release(self) -> None:
        """End of the request: wait for its heads' work and unpin everything it staged."""
        self._join()
        for staged in (self.staged, self._next_staged):
            for entries in staged.values():
                self.rt.pool.release(entries)
            staged.clear()

    def observe(
        self, layer: int, h: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor
    ) -> None:
        """Forward observer: keep owner features of each row's last position (and at a
        decode step, the owner's head and its consumers' reads for the next token)."""
        x = self._keep(layer, h, indices)
        if x is not None:
            _stage_ahead([self], layer, x, indices.shape[-1])

    def _keep(self, layer: int, h: torch.Tensor, indices: torch.Tensor) -> HeadRows | None:
        """observe()'s bookkeeping: the owner's input of its rows' last positions kept; at a
        decode step of one row with a pool, its head's input, else None."""
        rt = self.rt
        if layer not in rt.row:
            return None
        rows = self.rows
        step = rows == 1 and indices.shape[0] == 1  # a decode step: [1, K] and [1, D] as kept
        idx = indices if step else indices.view(rows, -1, indices.shape[-1])  # [R, T, K]
        if not step and idx.shape[1] > 1:
            self._previous[layer] = idx[:, -2]
        elif layer in self._executed:
            self._previous[layer] = self._executed[layer]
        else:  # the first position of a request: nothing executed before it
            self._previous[layer] = torch.full((rows, indices.shape[-1]), -1)
        self._executed[layer] = idx if step else idx[:, -1]
        self._h[layer] = h.detach() if step else h.view(rows, -1, h.shape[-1])[:, -1].detach()
        if rt.pool is None or not step:
            return None
        # The owner's `routed` experts are about to run: staged and pinned already if it is a
        # consumer; otherwise it reads them now and needs room (_stage_ahead's reserve). Staging
        # every consumer one token ahead thus pins about (layers + 1) * K slots at most.
        return self._rows(layer)

    def _rows(self, owner: int) -> HeadRows:
        return HeadRows(self._h[owner], self._executed[owner], self._previous[owner])

    @torch.no_grad()
    def _predicted_by(
        self, owner: int, logits: torch.Tensor, picked: dict, reserve: int, t0: int
    ) -> None:
        """The owner's head's prediction [1, E] for the next token: its consumers'
        predictions and chosen sets (`picked`: consumer -> (chosen, allowed or None)), and
        their reads started (t0: when the head began)."""
        rt = self.rt
        chosen = {}
        for c in rt.consumers_of.get(owner, []):
            self._next_predicted[c] = logits
            chosen[c], allowed = picked[c]
            if allowed is not None:
                self._next_allowed[c] = allowed
            self._next_chosen[c] = chosen[c]
        rt.stats.head_ns += time.perf_counter_ns() - t0
        for c, experts in chosen.items():
            self._stage(c, experts, self._next_staged, reserve)

    def _join(self) -> None:
        """Wait for the heads thread's work of this token; its errors surface here."""
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()

    def _choose(
        self, consumer: int, logits: torch.Tensor, allowed: dict[int, torch.Tensor]
    ) -> list[int]:
        """The experts to stage for `consumer` from its predictions [R, E]: each row's top-W
        (the family's own routing at W), as a sorted list of row 0's; with W > K each row's
        set also goes into `allowed` [R, E], what the consumer's router may pick from."""
        rt = self.rt
        idx = rt.blocks[consumer].select(logits, rt.stage_width)[1]  # [R, W]
        if rt.wide:
            allowed[consumer] = topk_onehot(idx, rt.num_experts).bool()
        return sorted(idx[0].tolist())

    def take(self, consumer: int) -> list[Entry]:
        return self.staged.pop(consumer, [])

    def _stage(
        self, consumer: int, experts: list[int], into: dict[int, list[Entry]], reserve: int = 0
    ) -> None:
        """Pin and start reading `experts` for `consumer`, if `reserve` slots stay free."""
        rt = self.rt
        if rt.pool.available() < len(experts) + reserve:
            rt.stats.unstaged += 1
            return
        into[consumer] = rt.pool.request(consumer, experts)
        rt.stats.staged += len(experts)

    @torch.no_grad()
    def flush(self) -> None:
        """After a token's logits: the predictions for the next token become current.

        At decode they were made (and their reads started) layer by layer during the forward;
        after prefill, or in training, every head runs here (flush_rows: once over several
        requests' rows).
        """
        rt = self.rt
        self._join()
        if self._advance():
            return
        t0 = time.perf_counter_ns()
        if rt.native is not None:  # serving: each head in its call, its staged set with it
            self._adopt({o: _row(rt.predict(o, self._rows(o)), 0, 1) for o in rt.owners}, t0)
            return
        staging = rt.pool is not None  # training: predictions (and W > K's sets) only
        self.allowed = {}
        x = torch.stack([self._rows(o).features(rt.num_experts) for o in rt.owners])
        logits = rt.heads(x)  # [H, R, E]
        for c in rt.consumers:
            self.predicted[c] = logits[rt.row[rt.wiring.owner_of[c]]]  # [R, E]
            if staging or rt.wide:
                self.chosen[c] = self._choose(c, self.predicted[c], self.allowed)
        self._made(t0, staging)

    def _advance(self) -> bool:
        """flush() after a decode step, whose every prediction was made during it: those
        become current (True); else False, and the heads run now."""
        rt = self.rt
        if len(self._next_predicted) != len(rt.consumers):
            return False
        for entries in self.staged.values():  # consumers that did not run (none normally)
            rt.pool.release(entries)
        self.predicted, self._next_predicted = self._next_predicted, {}
        self.staged, self._next_staged = self._next_staged, {}
        self.chosen, self._next_chosen = self._next_chosen, {}
        self.allowed, self._next_allowed = self._next_allowed, {}
        rt.stats.flushes += 1
        return True

    def _adopt(self, made: dict[int, tuple[torch.Tensor, dict]], t0: int) -> None:
        """Predictions made now (owner -> this state's row of them, _row) become current,
        and their sets are staged."""
        self.allowed = {}
        for logits, picks in made.values():
            for c, (chosen, allowed) in picks.items():
                self.predicted[c], self.chosen[c] = logits, chosen
                if allowed is not None:
                    self.allowed[c] = allowed
        self._made(t0, staging=True)

    def _made(self, t0: int, staging: bool) -> None:
        """The heads' time counted (from t0), and with a pool each consumer's set staged
        (what an earlier flush staged released first: a prompt fed in parts)."""
        rt = self.rt
        rt.stats.head_ns += time.perf_counter_ns() - t0
        rt.stats.flushes += 1
        if not staging:
            return
        for entries in self.staged.values():
            rt.pool.release(entries)
        self.staged.clear()
        for c in rt.consumers:  # in layer order: the earliest consumers need bytes first
            self._stage(c, self.chosen[c], self.staged)


def flush_rows(states: list[PrerouterState]) -> None:
    """Each state's flush() after one forward of several requests' prompts
    (Engine.prefill_together): with the native heads, each owner's head runs once over
    their rows, each row the bits it gets alone (native/heads.cpp); then each state, in
    order, takes its predictions and stages its sets."""
    rt = states[0].rt
    for s in states:
        s._join()
    now = [s for s in states if not s._advance()]
    if not now:
        return
    if rt.native is None or len(now) == 1:
        for s in now:
            s.flush()
        return
    t0 = time.perf_counter_ns()
    made = {o: rt.predict(o, HeadRows.cat([s._rows(o) for s in now])) for o in rt.owners}
    for i, s in enumerate(now):
        s._adopt({o: _row(m, i, len(now)) for o, m in made.items()}, t0)
        t0 = time.perf_counter_ns()
