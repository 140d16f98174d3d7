"""The native prerouter head (native/heads.cpp): the torch heads' logits up to the order of
float sums, the same bits on each of its paths and for a row alone or among others, the
staged set the consumer's routing picks, and the served heads counted as the plan counts
them."""

from __future__ import annotations

import pytest
import torch

from edge0 import builtin, native
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.models.routing import softmax_topk, topk_onehot
from edge0.prerouter.head import NativeHeads, Prerouter, StackedHeads, Wiring
from edge0.prerouter.runtime import HeadRows

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel

PATHS = range(len(native.ISA_PATHS))


def random_heads(hidden: int, experts: int, width: int, seed: int = 0) -> Prerouter:
    """Heads of two owners with every weight random (fp16 values, as a file holds them)."""
    pre = Prerouter(Wiring.default([0, 1, 2]), hidden, experts, width)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in pre.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5).half())
    return pre


def head_rows(hidden: int, experts: int, rows: int, k: int, gen, first: bool = False):
    """Random decode rows: h [B, D] and each row's K distinct experts now and before (none
    before at a request's first position)."""
    h = torch.randn(rows, hidden, generator=gen) * 3
    pick = [torch.randperm(experts, generator=gen)[: 2 * k] for _ in range(rows)]
    executed = torch.stack([p[:k] for p in pick])
    previous = torch.stack([p[k:] for p in pick])
    if first:
        previous = torch.full_like(previous, -1)
    return HeadRows(h, executed, previous)


# widths with and without a remainder after the op's 16 lanes
@pytest.mark.parametrize("hidden, experts, width", [(256, 32, 512), (200, 24, 44)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_head_is_the_torch_heads_to_rounding_on_every_path(
    hidden, experts, width, dtype
):
    """Against StackedHeads.one on the one-hot features: within float rounding (the order of
    the sums differs); across the op's portable, AVX2 and AVX-512 paths: the same bits; a
    row among eleven (the op takes 8 rows at a time): the bits it gets alone."""
    pre = random_heads(hidden, experts, width)
    owners = pre.wiring.owners
    ref = StackedHeads(pre, owners)
    heads = NativeHeads(pre, owners, native.op("prerouter_head"), native.BEST_ISA)
    gen = torch.Generator().manual_seed(1)
    for i, o in enumerate(owners):
        for first in (False, True):
            rows = head_rows(hidden, experts, 11, 4, gen, first)
            rows.h = rows.h.to(dtype)
            want = ref.one(i, rows.features(experts))
            got = [
                NativeHeads(pre, owners, heads.op, isa)(o, rows.h, rows.executed, rows.previous)[0]
                for isa in PATHS
            ]
            assert got[0].dtype == torch.float32 and got[0].shape == (11, experts)
            for other in got[1:]:
                assert torch.equal(other, got[0])
            torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5 * want.abs().max())
            assert not torch.equal(got[0], torch.zeros_like(got[0]))
            for b in range(11):
                one = [t[b : b + 1] for t in (rows.h, rows.executed, rows.previous)]
                assert torch.equal(heads(o, *one)[0], got[0][b : b + 1])


def test_the_native_head_stages_what_the_consumers_routing_picks():
    """With stage W, the op's set is routing.softmax_topk's top-W of its own logits, each
    row's ascending, and the mask of exactly those experts; the order of a row's experts
    does not change the logits (a set, as the one-hot features are)."""
    experts = 32
    pre = random_heads(128, experts, 64, seed=2)
    heads = NativeHeads(pre, pre.wiring.owners, native.op("prerouter_head"), native.BEST_ISA)
    gen = torch.Generator().manual_seed(3)
    rows = head_rows(128, experts, 4, 6, gen)
    for w in (6, 9, 12):
        logits, chosen, allowed = heads(0, rows.h, rows.executed, rows.previous, w)
        want = softmax_topk(logits, w, True)[1]
        assert torch.equal(chosen, want.sort(dim=-1).values)
        assert torch.equal(allowed, topk_onehot(want, experts).bool())
    shuffled = heads(0, rows.h, rows.executed.flip(-1), rows.previous.flip(-1))[0]
    assert torch.equal(shuffled, heads(0, rows.h, rows.executed, rows.previous)[0])


def test_the_native_head_refuses_what_it_cannot_read():
    """An expert index past E, weights not in fp16, or a staged set wider than E: an error
    naming it, not a read out of bounds."""
    pre = random_heads(64, 8, 32)
    heads = NativeHeads(pre, pre.wiring.owners, native.op("prerouter_head"), native.BEST_ISA)
    h = torch.randn(1, 64)
    ok = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="executed expert 8 of 8"):
        heads(0, h, torch.tensor([[0, 8]]), ok)
    with pytest.raises(RuntimeError, match="previous expert 9 of 8"):
        heads(0, h, ok, torch.tensor([[9, 1]]))
    with pytest.raises(RuntimeError, match="stage 9 of 8"):
        heads(0, h, ok, ok, 9)
    w1, *rest = heads.parts[0]
    with pytest.raises(RuntimeError, match="w1 must be contiguous fp16"):
        heads.op(h, ok, ok, w1.float(), *rest, 0, native.BEST_ISA)


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_served_heads_take_the_bytes_the_plan_counts(kernel):
    """The built-in model: with the native ops its heads are held as the file's fp16 (half
    of fp32), with the torch path stacked at the compute dtype; the plan counts either."""
    opts = EngineOptions(backend=kernel, prerouter_always=True)
    engine = load_engine(builtin.model_dir(), opts)
    try:
        rt = engine.prerouter
        held = rt.native if kernel == "native" else rt.heads
        assert (rt.native is None, rt.heads is None) == (kernel == "torch", kernel == "native")
        assert engine.plan.floor.heads == held.nbytes > 0
    finally:
        engine.close()
