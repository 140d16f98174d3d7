"""--stage-width W: the prerouter stages W >= K experts per layer a token ahead, and the layer's
own router picks its K among them. Nothing outside the staged set runs (no drops); whenever
the router's own choice fell inside the staged set, it is what runs; W = K is
prediction-as-routing, unchanged.
"""

from __future__ import annotations

import pytest
import torch

from edge0 import builtin, modeldir
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.plan import make_plan
from edge0.models.routing import sigmoid_group, softmax_topk
from test_scheduling import EXTENT, sizes


def test_softmax_routing_among_allowed_experts():
    torch.manual_seed(0)
    logits = torch.randn(64, 16)
    allowed = torch.zeros(64, 16, dtype=torch.bool)
    for row in allowed:
        row[torch.randperm(16)[:6]] = True
    for norm in (False, True):
        free_w, free_i = softmax_topk(logits, 2, norm)
        w, i = softmax_topk(logits, 2, norm, allowed)
        assert allowed.gather(1, i).all()  # nothing outside the allowed set
        inside = allowed.gather(1, free_i).all(dim=1)  # the router's own choice was allowed
        assert inside.any() and (~inside).any()
        assert torch.equal(i[inside].sort(1).values, free_i[inside].sort(1).values)
        probs = torch.softmax(logits, -1).gather(1, i)
        want = probs / probs.sum(-1, keepdim=True) if norm else probs
        assert torch.allclose(w, want)  # the family's weights for the chosen experts


def test_sigmoid_group_routing_among_allowed_experts():
    torch.manual_seed(1)
    logits, bias = torch.randn(64, 16), 0.5 * torch.randn(16)  # a bias large enough to matter
    allowed = torch.zeros(64, 16, dtype=torch.bool)
    for row in allowed:
        row[torch.randperm(16)[:6]] = True
    free_w, free_i = sigmoid_group(logits, bias, 2, 4, 2, True, 2.5)
    w, i = sigmoid_group(logits, bias, 2, 4, 2, True, 2.5, allowed)
    assert allowed.gather(1, i).all()
    inside = allowed.gather(1, free_i).all(dim=1)
    assert inside.any() and (~inside).any()
    assert torch.equal(i[inside].sort(1).values, free_i[inside].sort(1).values)
    assert torch.allclose(w.sum(-1), torch.full((64,), 2.5))  # renormalised, scaled


def test_the_plan_stages_w_experts_per_layer():
    opts = dict(max_context=64, memory_budget=1 << 20, prerouter_always=True)
    k_plan = make_plan(sizes(), EngineOptions(**opts))
    wide = make_plan(sizes(), EngineOptions(**opts, stage_width=4))
    assert k_plan.stage_width == 2 and wide.stage_width == 4
    assert wide.staging_slots == 2 * k_plan.staging_slots
    with pytest.raises(ValueError, match="stage_width 1 must be between top_k 2"):
        make_plan(sizes(), EngineOptions(max_context=64, stage_width=1))


def test_a_pool_of_every_expert_takes_any_number_of_staged_sets():
    """3 requests staging 4 in 4 layers pin 48 sets' worth, but only 32 experts exist, and
    pins of one expert share its slot: a pool of all 32 serves them; 31 slots do not."""
    opts = dict(max_context=64, max_active=3, stage_width=4, prerouter_always=True)
    plan = make_plan(sizes(), EngineOptions(expert_cache=32 * EXTENT, **opts))
    assert plan.staging_slots == 48 and plan.pool_slots == 32
    with pytest.raises(ValueError, match="holds 31 of the 32 experts"):
        make_plan(sizes(), EngineOptions(expert_cache=31 * EXTENT, **opts))


@pytest.mark.parametrize("factor", [1.5, 2])
def test_the_router_picks_among_the_staged_experts(factor):
    width = int(factor * modeldir.Manifest.load(builtin.model_dir()).served_top_k)
    opts = EngineOptions(io_mode="buffered", stage_width=width, prerouter_always=True)
    engine = load_engine(builtin.model_dir(), opts)
    k = engine.top_k
    assert engine.prerouter.wide and engine.plan.stage_width == width > k
    inside = outside = 0
    try:
        with engine.new_request() as req:
            observe = req.pre.observe

            def check(layer, h, logits, indices):
                nonlocal inside, outside
                if layer in req.pre.chosen:  # a consumer: `logits` are its router's own
                    staged = set(req.pre.chosen[layer])
                    ran = set(indices[-1].tolist())
                    assert len(staged) == width and ran <= staged
                    own = set(torch.topk(logits[-1].float(), k).indices.tolist())
                    if own <= staged:
                        assert ran == own
                        inside += 1
                    else:
                        outside += 1
                observe(layer, h, logits, indices)

            req.pre.observe = check
            ids = engine.tokenizer.encode("def read_config(path):")
            logits = engine.prefill(req, ids)
            for _ in range(24):
                logits = engine.step(req, int(logits.argmax()))
        assert engine.prerouter.stats.dropped == 0
        print(f"W={width}: router's own choice inside the staged set {inside}, outside {outside}")
        assert inside > 0
    finally:
        engine.close()
