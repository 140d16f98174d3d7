"""Executor strategies: how a layer gets its experts' bytes from the pool for one forward.

  ExactExecutor       decode, gate-routed layers: read what the router chose (misses only)
  StagedExecutor      decode, prediction-routed layers: take what the request staged for
                      this layer one token ahead
  WholeLayerExecutor  prefill: read the layer's experts in runs, compute every prompt token,
                      and read the next layer while this one computes

They compute with the backend's ExpertOps (backends/base.py). The engine picks one executor
per layer and phase and passes them in the call's Forward. Every path computes
down(silu(gate x) * up x) from the same int4 bytes (the math contract).
Shape legend: T tokens, K active, D hidden, I expert width.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

import torch

from edge0.engine.backends.base import ExpertOps
from edge0.formats.extents import ExpertTensors
from edge0.models.experts import for_each_expert
from edge0.store.pool import Entry, ExpertPool


def distinct(indices: torch.Tensor) -> list[int]:
    """A decode step's experts, ascending, as torch.unique gives them: for a token's K
    indices one list conversion replaces the unique op (5 dispatches) and its conversion."""
    return sorted(set(indices.flatten().tolist()))


class DecodeExecutor:
    """A decode path: `pin` the routed experts (rows_together pins each row's through it),
    compute them, unpin."""

    pool: ExpertPool
    ops: ExpertOps

    def pin(self, x: torch.Tensor, indices: torch.Tensor) -> tuple[dict, list[Entry]]:
        raise NotImplementedError

    def token(self, x: torch.Tensor, experts: list[int]) -> torch.Tensor:
        """One token x [1, D] through its routed experts, in routing order -> [K, D]."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self.token(x, indices.tolist()[0])[None]
        tensors, entries = self.pin(x, indices)
        try:
            return for_each_expert(x, indices, lambda e, xs: self._rows(xs, tensors[e]))
        finally:
            self.pool.release(entries)

    def _rows(self, x: torch.Tensor, t: ExpertTensors) -> torch.Tensor:
        return self.ops.rows(x, [(torch.arange(x.shape[0]), t)])

    def _computed(self, x: torch.Tensor, routed: list[Entry], held: list[Entry]) -> torch.Tensor:
        """x through the routed experts' entries (in routing order), once they have landed;
        then the entries held for it unpinned."""
        try:
            return self.ops.token(x, self.pool.wait(routed))
        finally:
            self.pool.release(held)


class ExactExecutor(DecodeExecutor):
    """Decode path: pin the routed experts (reading the missing ones), compute, unpin.
    `sole`: this thread is the only one that requests from the pool (no heads thread), so a
    token whose experts are all loaded uses them unpinned (ExpertPool.peek)."""

    def __init__(self, pool: ExpertPool, layer: int, ops: ExpertOps, sole: bool = False):
        self.pool, self.layer, self.ops, self.sole = pool, layer, ops, sole

    def token(self, x: torch.Tensor, experts: list[int]) -> torch.Tensor:
        if self.sole:
            tensors = self.pool.peek(self.layer, experts)
            if tensors is not None:
                return self.ops.token(x, tensors)
        entries = self.pool.request(self.layer, experts)
        return self._computed(x, entries, entries)

    def pin(self, x: torch.Tensor, indices: torch.Tensor) -> tuple[dict, list[Entry]]:
        """The routed experts pinned, read if missing: (their tensors, the entries to
        release)."""
        experts = distinct(indices)
        entries = self.pool.request(self.layer, experts)
        return dict(zip(experts, self.pool.wait(entries), strict=True)), entries


class StagedExecutor(DecodeExecutor):
    """Decode path of a prediction-routed layer: its experts were requested one token ahead.

    The routing indices come from the same prediction that chose the staged set, so every
    routed expert is staged (a mismatch is counted as `dropped`, and still computed). If the
    pool had no room to stage this layer, its experts are read now, like the exact path.
    """

    def __init__(self, pool: ExpertPool, layer: int, state, ops: ExpertOps):
        self.pool, self.layer, self.state = pool, layer, state  # the request's PrerouterState
        self.ops = ops

    def token(self, x: torch.Tensor, experts: list[int]) -> torch.Tensor:
        by_expert, entries = self._take(experts)
        return self._computed(x, [by_expert[e] for e in experts], entries)

    def _take(self, experts: list[int]) -> tuple[dict[int, Entry], list[Entry]]:
        """The staged entries taken over and any routed expert that was not staged requested
        now (counted as dropped): (entry by expert, the entries to release)."""
        entries = self.state.take(self.layer)
        by_expert = {en.key[1]: en for en in entries}
        late = [e for e in experts if e not in by_expert]
        stats = self.state.rt.stats
        if entries:
            stats.dropped += len(late)
        stats.consumed += len(experts)
        if late:
            extra = self.pool.request(self.layer, late)
            entries = entries + extra
            by_expert.update((en.key[1], en) for en in extra)
        return by_expert, entries

    def pin(self, x: torch.Tensor, indices: torch.Tensor) -> tuple[dict, list[Entry]]:
        """The staged experts taken over, any routed one that was not staged read now:
        (the routed experts' tensors, the entries to release)."""
        experts = distinct(indices)
        by_expert, entries = self._take(experts)
        try:
            tensors = self.pool.wait([by_expert[e] for e in experts])
        except BaseException:
            self.pool.release(entries)
            raise
        return dict(zip(experts, tensors, strict=True)), entries


def rows_together(
    ops: ExpertOps, executors: list, x: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """A decode forward of B requests' rows at one MoE layer: each row's executor pins (and
    reads) what it would alone, then every row's experts run in one ops.rows call (an
    expert two rows share, once for both) -> [B, K, D]. Each row's result is what its
    executor computes alone, bit for bit (a backend's rows compute what its token does).
    Where every row is gate-routed on the pool's one requesting thread and every expert is
    loaded, they are used unpinned (ExpertPool.peek), as one such row's own step uses them.
    The places are grouped in Python: B * K of them cost less so than a prefill's Slots."""
    routed = indices.tolist()
    k = len(routed[0])
    places: dict[int, list[int]] = {}
    for p, e in enumerate(e for row in routed for e in row):
        places.setdefault(e, []).append(p)
    pinned = []
    try:
        tensors = _peek_rows(executors, routed, places)
        if tensors is None:
            tensors = {}
            for i, ex in enumerate(executors):
                got, entries = ex.pin(x[i : i + 1], indices[i : i + 1])
                pinned.append((ex.pool, entries))
                tensors.update(got)  # an expert's tensors are its pool slot's, whoever pinned it
        groups, order = [], []
        for e, t in tensors.items():
            groups.append((torch.tensor([p // k for p in places[e]]), t))
            order += places[e]
        out = x.new_empty(*indices.shape, x.shape[-1])
        computed = ops.rows(x, groups).to(x.dtype)
        out.view(-1, x.shape[-1]).index_copy_(0, torch.tensor(order), computed)
        return out
    finally:
        for pool, entries in pinned:
            pool.release(entries)


def _peek_rows(
    executors: list, routed: list[list[int]], places: dict[int, list[int]]
) -> dict[int, ExpertTensors] | None:
    """Every routed expert's tensors, unpinned, where each row's executor may use them so
    (gate-routed, `sole`, one pool and layer) and every one is loaded; else None. Each row's
    experts count as its hits, as its own request would count them."""
    first = executors[0]
    if not all(
        type(ex) is ExactExecutor and ex.sole and ex.pool is first.pool and ex.layer == first.layer
        for ex in executors
    ):
        return None
    experts = sorted(places)
    uses = sum(len(set(row)) for row in routed)
    got = first.pool.peek(first.layer, experts, uses)
    return None if got is None else dict(zip(experts, got, strict=True))


class PrefillPlan:
    """Hands whole-layer reads from one layer to the next during one prefill."""

    def __init__(
        self, pool: ExpertPool, moe_layers: list[int], num_experts: int, routed_slots: int
    ):
        self.pool = pool
        self.next_layer = {a: b for a, b in zip(moe_layers, moe_layers[1:], strict=False)}
        self.num_experts = num_experts
        # Read a whole layer ahead only when the prompt is long enough to touch most of it.
        self.prefetch = routed_slots >= num_experts
        self._staged: dict[int, list[Entry]] = {}

    def take(self, layer: int) -> list[Entry]:
        return self._staged.pop(layer, [])

    def read_ahead(self, layer: int, reserve: int) -> None:
        """Start reading the layer after `layer` if that leaves `reserve` slots for this one."""
        nxt = self.next_layer.get(layer)
        if not self.prefetch or nxt is None or nxt in self._staged:
            return
        if self.pool.available() >= self.num_experts + reserve:
            self._staged[nxt] = self.pool.request(nxt, list(range(self.num_experts)))

    def release_all(self) -> None:
        for entries in self._staged.values():
            self.pool.wait(entries)
            self.pool.release(entries)
        self._staged.clear()


class WholeLayerExecutor:
    """Prefill path: all of the layer's needed experts, computed as their reads land: every
    expert that has landed in one ops.rows call, those with ops.dense_from tokens or more on
    their dequantized weights."""

    def __init__(self, pool: ExpertPool, layer: int, plan: PrefillPlan, ops: ExpertOps):
        self.pool, self.layer, self.plan, self.ops = pool, layer, plan, ops

    def __call__(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(*indices.shape, x.shape[-1])  # [T, K, D]
        staged = self.plan.take(self.layer)
        needed = torch.unique(indices).tolist()
        try:
            self._compute(x, indices, needed, staged, out)
        finally:
            self.pool.release(staged)
        return out

    def _compute(self, x, indices, needed, staged, out) -> None:
        by_expert = {en.key[1]: en for en in staged}
        todo = [e for e in needed if e not in by_expert]
        held = [by_expert[e] for e in needed if e in by_expert]
        self.plan.read_ahead(self.layer, reserve=len(todo))
        slots = Slots(indices)
        while held or todo:
            room = max(1, self.pool.available())
            wave, todo = todo[:room], todo[room:]
            entries = self.pool.request(self.layer, wave) if wave else []
            batch = held + entries
            held = []
            try:
                self._compute_batch(x, indices, batch, out, slots)
            finally:
                self.pool.release(entries)

    def _compute_batch(self, x, indices, entries: list[Entry], out, slots) -> None:
        pending = {en.future: en for en in entries}
        while pending:
            if not any(f.done() for f in pending):
                self.pool.wait([next(iter(pending.values()))])  # counts the blocked time
            done, _ = wait_futures(list(pending), timeout=0, return_when=FIRST_COMPLETED)
            self._compute_rows(x, [pending.pop(fut) for fut in done], out, slots)

    def _compute_rows(self, x, entries: list[Entry], out, slots: Slots) -> None:
        """The landed experts' tokens through ops.rows, written to their (token, slot) places
        in out; an expert with many tokens through ops.dense."""
        flat = out.view(-1, out.shape[-1])  # [T * K, D]: place t * K + k
        groups, places = [], []
        for en, t in zip(entries, self.pool.wait(entries), strict=True):
            at, tokens = slots.places(en.key[1]), slots.tokens(en.key[1])
            if at.numel() >= self.ops.dense_from:
                flat[at] = self.ops.dense(self.pool.layout, x[tokens], t).to(out.dtype)
            elif at.numel():
                groups.append((tokens, t))
                places.append(at)
        if groups:
            flat[torch.cat(places)] = self.ops.rows(x, groups).to(out.dtype)


class Slots:
    """Where each expert sits in a forward's routing indices [T, K]: its places t * K + k,
    ascending, from one stable sort, and their tokens t."""

    def __init__(self, indices: torch.Tensor):
        k = indices.shape[-1]
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat).tolist()
        # every expert's views at once (one split each, not two slices an expert)
        self._places = order.split(counts)
        self._tokens = (order // k).split(counts)
        self._none = order[:0]

    def places(self, expert: int) -> torch.Tensor:
        return self._places[expert] if expert < len(self._places) else self._none

    def tokens(self, expert: int) -> torch.Tensor:
        return self._tokens[expert] if expert < len(self._tokens) else self._none
