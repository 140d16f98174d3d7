"""Executor strategies: how a layer gets its experts' bytes from the pool and computes them.

  ExactExecutor       decode, gate-routed layers: read what the router chose (misses only),
                      then compute
  StagedExecutor      decode, prediction-routed layers: compute what the request staged for
                      this layer one token ahead
  (both compute with a DecodeExperts: the pure-PyTorch `torch_experts`, or `FusedExperts`
  over the native op that runs a token's K experts in one call)
  WholeLayerExecutor  prefill: read the layer's experts in runs, compute every prompt token,
                      and read the next layer while this one computes

The engine picks one per layer and phase and passes them in the call's Forward.

All paths compute down(silu(gate x) * up x) from the same int4 bytes (the math contract).
Shape legend: T tokens, K active, D hidden, I expert width.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from edge0 import native
from edge0.engine.options import EXPERT_KERNELS
from edge0.formats import quant
from edge0.formats.extents import ExpertTensors, ExtentLayout
from edge0.formats.int4_layout import Int4Layout
from edge0.models.experts import for_each_expert, swiglu_dense
from edge0.store.pool import Entry, ExpertPool

log = logging.getLogger(__name__)

# Below this many tokens per expert torch's int4 kernel beats dequantize + fp32 matmul on the
# CPUs we measured (docs/kernels.md); above it the dense matmul amortises the dequantization.
DENSE_MIN_TOKENS = 96
# The same for edge0's (RowExperts), which decodes a block's weights once per 4 tokens: on an
# Intel Xeon model 167 the dense path won from ~200 tokens at D 256, I 128, ~300 at D 1024, I
# 512 and ~700 at D 2048, I 768 (192 tokens: 3.4 against 5.4 ms, 10.1 against 18.7 ms).
ROWS_DENSE_MIN_TOKENS = 256


def swiglu_int4(x: torch.Tensor, t: ExpertTensors) -> torch.Tensor:
    """One expert on its tokens with the int4 kernel: x [n, D] -> fp32 [n, D]."""
    gate, up = quant.int4_linear(x, t.w13, t.p13).float().chunk(2, dim=-1)
    return quant.int4_linear(F.silu(gate) * up, t.w2, t.p2).float()


def swiglu_dequantized(layout: ExtentLayout, x: torch.Tensor, t: ExpertTensors) -> torch.Tensor:
    """One expert on many tokens: its weights dequantized to fp32, then dense matmuls."""
    w13, w2 = layout.dequantize(t)
    return swiglu_dense(x.float(), w13, w2)


def swiglu_extent(layout: ExtentLayout, x: torch.Tensor, t: ExpertTensors) -> torch.Tensor:
    """The kernel chosen by token count: int4 for few tokens, dequantized fp32 for many."""
    if x.shape[0] < DENSE_MIN_TOKENS:
        return swiglu_int4(x, t)
    return swiglu_dequantized(layout, x, t)


class DecodeExperts(Protocol):
    """x [T, D] through each token's experts, whose int4 tensors are in `tensors` -> [T, K, D]."""

    def __call__(
        self, x: torch.Tensor, indices: torch.Tensor, tensors: dict[int, ExpertTensors]
    ) -> torch.Tensor: ...


def torch_experts(
    x: torch.Tensor, indices: torch.Tensor, tensors: dict[int, ExpertTensors]
) -> torch.Tensor:
    """The reference: one expert at a time in PyTorch ops."""
    return for_each_expert(x, indices, lambda e, xs: swiglu_int4(xs, tensors[e]))


class FusedExperts:
    """Each token's K experts in one call of the native op (native/int4_gemv.cpp), which
    computes what swiglu_int4 computes, bit for bit: bit-identical to torch_experts, in one
    parallel region instead of ~16 ops per expert."""

    def __init__(self, op: Callable[..., torch.Tensor], layout: list[int], isa: int):
        self.op, self.layout, self.isa = op, layout, isa

    def __call__(
        self, x: torch.Tensor, indices: torch.Tensor, tensors: dict[int, ExpertTensors]
    ) -> torch.Tensor:
        rows = [
            self.row(x[t : t + 1], [tensors[e] for e in experts])
            for t, experts in enumerate(indices.tolist())
        ]
        return rows[0][None] if len(rows) == 1 else torch.stack(rows)  # [T, K, D]

    def row(self, x: torch.Tensor, ts: list[ExpertTensors]) -> torch.Tensor:
        """One token x [1, D] through the experts ts, in order -> [K, D]."""
        fields = ([a.w13 for a in ts], [a.p13 for a in ts], [a.w2 for a in ts], [a.p2 for a in ts])
        return self.op(x, *fields, self.layout, self.isa)


class RowExperts:
    """Prefill's experts in one call of the native op (native/int4_gemv.cpp,
    swiglu_int4_rows): several experts, each on the tokens routed to it, every row what
    swiglu_int4 computes for it, bit for bit, in two parallel regions instead of ~12 ATen
    ops per expert."""

    def __init__(self, op: Callable[..., torch.Tensor], layout: list[int], isa: int):
        self.op, self.layout, self.isa = op, layout, isa

    def __call__(self, x: torch.Tensor, groups: list[tuple[torch.Tensor, ExpertTensors]]):
        """x [T, D]; groups: (token rows int64 [n], the expert's tensors) -> fp32 [sum n, D]."""
        fields = [[g[0] for g in groups]]
        fields += [[getattr(g[1], f) for g in groups] for f in ("w13", "p13", "w2", "p2")]
        return self.op(x, *fields, self.layout, self.isa)


def row_experts(decode: DecodeExperts, cache_dir: Path | None = None) -> RowExperts | None:
    """Prefill's native expert op where decode runs the native one (FusedExperts), else None
    (prefill then computes one expert at a time)."""
    if not isinstance(decode, FusedExperts):
        return None
    return RowExperts(native.swiglu_int4_rows(cache_dir), decode.layout, decode.isa)


def decode_experts(
    kernel: str,
    cache_dir: Path | None = None,
    int8: bool = False,
    int4: Int4Layout | None = None,
) -> DecodeExperts:
    """The decode compute that EngineOptions.expert_kernel names ("auto": fused where the
    native op builds, else torch, with a warning saying why); `int8`: the native op's
    int8-activation kernel (EngineOptions.int4_activations); `int4`: the experts'
    arrangement where it is not the host's (its int8 order: int8 only)."""
    if kernel not in EXPERT_KERNELS:
        raise ValueError(f"expert_kernel must be one of {', '.join(EXPERT_KERNELS)}: {kernel!r}")
    if kernel == "torch":
        return torch_experts
    try:
        layout, isa = native.kernel_args(int8)
        if int4 is not None:
            layout = native.layout_code(int4)
        return FusedExperts(native.swiglu_int4_gemv(cache_dir), layout, isa)
    except native.NativeUnavailable as e:
        if kernel == "fused":
            raise
        log.warning("%s; decode uses the pure-PyTorch expert path", e)
        return torch_experts


def distinct(indices: torch.Tensor) -> list[int]:
    """A decode step's experts, ascending, as torch.unique gives them: for a token's K
    indices one list conversion replaces the unique op (5 dispatches) and its conversion."""
    return sorted(set(indices.flatten().tolist()))


class DecodeExecutor:
    """A decode path: `pin` the routed experts (rows_together pins each row's through it),
    compute them, unpin."""

    pool: ExpertPool
    compute: DecodeExperts
    fused: bool  # compute is FusedExperts: a decode token goes to its op in routing order

    def pin(self, x: torch.Tensor, indices: torch.Tensor) -> tuple[dict, list[Entry]]:
        raise NotImplementedError

    def token(self, x: torch.Tensor, experts: list[int]) -> torch.Tensor:
        """One token x [1, D] through its routed experts, in routing order, with the native
        op -> [K, D] (what pin and FusedExperts do, without the sorted set and the dicts)."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self.fused and x.shape[0] == 1:
            return self.token(x, indices.tolist()[0])[None]
        tensors, entries = self.pin(x, indices)
        try:
            return self.compute(x, indices, tensors)
        finally:
            self.pool.release(entries)

    def _computed(self, x: torch.Tensor, routed: list[Entry], held: list[Entry]) -> torch.Tensor:
        """x through the routed experts' entries (in routing order) with the op, once they
        have landed; then the entries held for it unpinned."""
        try:
            return self.compute.row(x, self.pool.wait(routed))
        finally:
            self.pool.release(held)


class ExactExecutor(DecodeExecutor):
    """Decode path: pin the routed experts (reading the missing ones), compute, unpin.
    `sole`: this thread is the only one that requests from the pool (no heads thread), so a
    token whose experts are all loaded uses them unpinned (ExpertPool.peek)."""

    def __init__(
        self,
        pool: ExpertPool,
        layer: int,
        compute: DecodeExperts = torch_experts,
        sole: bool = False,
    ):
        self.pool, self.layer, self.compute = pool, layer, compute
        self.fused, self.sole = isinstance(compute, FusedExperts), sole

    def token(self, x: torch.Tensor, experts: list[int]) -> torch.Tensor:
        if self.sole:
            tensors = self.pool.peek(self.layer, experts)
            if tensors is not None:
                return self.compute.row(x, tensors)
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

    def __init__(self, pool: ExpertPool, layer: int, state, compute: DecodeExperts = torch_experts):
        self.pool, self.layer, self.state = pool, layer, state  # the request's PrerouterState
        self.compute = compute
        self.fused = isinstance(compute, FusedExperts)

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
    rows: RowExperts, executors: list, x: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """A decode forward of B requests' rows at one MoE layer: each row's executor pins (and
    reads) what it would alone, then every row's experts run in one call of the native op
    (an expert two rows share, once for both) -> [B, K, D]. Each row's result is what its
    executor computes alone, bit for bit (the op's rows are swiglu_int4's, which
    FusedExperts computes too). Where every row is gate-routed on the pool's one requesting
    thread and every expert is loaded, they are used unpinned (ExpertPool.peek), as one such
    row's own step uses them. The routing's places are grouped in Python: a decode forward
    has B * K of them, and the sort, count and splits of a prefill's _Slots cost more."""
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
        computed = rows(x, groups).to(x.dtype)
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
    """Prefill path: all of the layer's needed experts, computed as their reads land (with
    `rows`, every expert that has landed in one native call, those with ROWS_DENSE_MIN_TOKENS
    tokens or more on the dense path)."""

    def __init__(
        self, pool: ExpertPool, layer: int, plan: PrefillPlan, rows: RowExperts | None = None
    ):
        self.pool, self.layer, self.plan, self.rows = pool, layer, plan, rows

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
        slots = _Slots(indices) if self.rows is not None else None
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
            landed = [pending.pop(fut) for fut in done]
            if slots is not None:
                self._compute_rows(x, landed, out, slots)
                continue
            for en in landed:
                (t,) = self.pool.wait([en])
                e = en.key[1]
                tok, slot = torch.nonzero(indices == e, as_tuple=True)
                if tok.numel():
                    out[tok, slot] = swiglu_extent(self.pool.layout, x[tok], t).to(out.dtype)

    def _compute_rows(self, x, entries: list[Entry], out, slots: _Slots) -> None:
        """The landed experts' tokens through the native op, written to their (token, slot)
        places in out; an expert with many tokens through swiglu_extent."""
        flat = out.view(-1, out.shape[-1])  # [T * K, D]: place t * K + k
        groups, places = [], []
        for en, t in zip(entries, self.pool.wait(entries), strict=True):
            at, tokens = slots.places(en.key[1]), slots.tokens(en.key[1])
            if at.numel() >= ROWS_DENSE_MIN_TOKENS:
                flat[at] = swiglu_dequantized(self.pool.layout, x[tokens], t).to(out.dtype)
            elif at.numel():
                groups.append((tokens, t))
                places.append(at)
        if groups:
            flat[torch.cat(places)] = self.rows(x, groups).to(out.dtype)


class _Slots:
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
