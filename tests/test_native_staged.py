"""A staged (prediction-routed) decode token through every layer in one native call
(TokenDecoder.staged_step with engine/backends/native_staged.py): the native layers' logits,
staged sets and counters, bit for bit, with every expert in memory and under a cap where
reads land during the call; slow reads waited for and counted; a failed read raised as the
reader's own error."""

from __future__ import annotations

import pytest
import torch

from edge0 import builtin
from edge0.convert.synth import Shape, synth
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.sampling import SamplingParams
from edge0.modeldir.loader import load_edge0_model
from edge0.prerouter.head import Prerouter, Wiring
from helpers import EVERY_ACTIVATION, DelayedReads

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel

LAYERS, EXPERTS, TOP_K = 4, 8, 2
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def staged_model(tmp_path_factory):
    """A random qwen3_moe (int4, q/k norms per head) with warm-started heads whose fc2 is
    random too, so that every part of a head counts."""
    shape = Shape(
        layers=LAYERS,
        hidden=256,
        heads=4,
        kv_heads=2,
        experts=EXPERTS,
        top_k=TOP_K,
        expert_width=128,
        vocab=512,
    )
    out = tmp_path_factory.mktemp("staged") / "m"
    synth(out, shape, tokenizer_dir=builtin.model_dir(), progress=False)
    _, model = load_edge0_model(out, experts="dequantized")
    pre = Prerouter(Wiring.default(model.moe_layers), 256, EXPERTS, width=64)
    routers = {c: model.moe_block(c).gate.weight.detach().float() for c in pre.wiring.consumers}
    pre.warm_start(routers, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for o in pre.wiring.owners:
            pre.head(o).fc2.weight.normal_(0, 0.05, generator=gen)
    pre.save(out / "prerouter.safetensors", {"K": str(TOP_K)})
    return out


def extent_bytes(model_dir) -> int:
    engine = load_engine(model_dir, EngineOptions(io_mode="buffered", no_prerouter=True))
    try:
        return engine.pool.extent_bytes
    finally:
        engine.close()


def greedy(engine, one_call: bool, steps: int = 12):
    """Prefill and `steps` greedy steps through the call or (one_call False) the native layers
    one by one -> (logits [steps + 1, V], prerouter counters, pool counters, LM heads run by
    the modules)."""
    staged = engine.staged
    if not one_call:
        engine.staged = None
    heads, logits = [], engine.model.logits
    engine.model.logits = lambda h: heads.append(1) or logits(h)
    try:
        with engine.new_request() as req:
            out = [engine.prefill(req, engine.tokenizer.encode("def f(x):"))]
            before = engine.stats()
            for _ in range(steps):
                out.append(engine.step(req, int(out[-1].argmax())))
            after = engine.stats()
        return (
            torch.stack(out),
            after.prerouter.minus(before.prerouter),
            after.pool.minus(before.pool),
            len(heads),
        )
    finally:
        engine.staged = staged
        engine.model.logits = logits


@pytest.mark.parametrize("capped", [False, True], ids=["resident", "capped"])
@EVERY_ACTIVATION
def test_a_staged_token_in_one_call_is_the_native_layers_bit_for_bit(
    staged_model, dtype, acts, capped
):
    # capped: (layers + 1) * K slots, the fewest that stage every consumer: reads land in
    # every step, during the call
    room = dict(expert_cache=(LAYERS + 1) * TOP_K * extent_bytes(staged_model))
    opts = EngineOptions(
        io_mode="buffered",
        dtype=dtype,
        int4_activations=acts,
        **(room if capped else dict(prerouter_always=True)),
    )
    engine = load_engine(staged_model, opts)
    try:
        assert engine.staged is not None and engine.prerouter is not None
        assert engine.plan.holds_every_expert is not capped
        one, pre_one, pool_one, heads_one = greedy(engine, True)
        assert heads_one == 1  # only the prompt's logits came from the modules
        layers, pre_layers, pool_layers, heads_layers = greedy(engine, False)
        assert heads_layers == 1 + 12
        assert torch.equal(one, layers)
        # the same staged sets, each consumer's K routed experts from them, none dropped
        for s in (pre_one, pre_layers):
            assert s.staged == 12 * (LAYERS - 1) * TOP_K and s.unstaged == s.dropped == 0
            assert s.consumed == 12 * (LAYERS - 1) * TOP_K and s.flushes == 12
            assert s.head_ns > 0
        if capped:
            assert pool_one.loads > 0 and pool_layers.loads > 0
        else:
            assert pool_one.loads == pool_layers.loads == 0
            assert pool_one.hits == pool_layers.hits == 12 * LAYERS * TOP_K
    finally:
        engine.close()
    assert not engine_threads_left()


def engine_threads_left() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name == "edge0-stager"]


def test_slow_reads_are_waited_for_in_the_call_and_counted(staged_model):
    """Every read 20 ms late: the call waits on the slots' states, counts the wait as the
    per-layer path does (blocked_ns), and computes the same logits."""
    room = (LAYERS + 1) * TOP_K * extent_bytes(staged_model)
    opts = EngineOptions(io_mode="buffered", expert_cache=room, io_threads=8)
    results = {}
    for one_call in (True, False):
        engine = load_engine(staged_model, opts)
        engine.pool.file = DelayedReads(engine.pool.file, 0.02)
        try:
            results[one_call] = greedy(engine, one_call, steps=6)
        finally:
            engine.close()
    (one, _, pool_one, _), (layers, _, pool_layers, _) = results[True], results[False]
    assert torch.equal(one, layers)
    assert pool_one.loads > 0
    # at least one whole late read waited for, on either path
    assert pool_one.blocked_ns > 0.02 * 1e9 and pool_layers.blocked_ns > 0.02 * 1e9


class FailingReads:
    """A test double for an ExpertFile whose reads of one layer fail once `armed`."""

    def __init__(self, file, layer: int):
        self.file, self.layer, self.armed = file, layer, False

    def read_run(self, layer, *args):
        if self.armed and layer == self.layer:
            raise OSError(f"the disk failed reading layer {layer}")
        return self.file.read_run(layer, *args)

    def __getattr__(self, name):
        return getattr(self.file, name)


@pytest.mark.parametrize("layer", [0, 2], ids=["read-now", "staged"])
def test_a_failed_read_fails_the_step_with_the_readers_error(staged_model, layer):
    """Layer 0 routes by its router and reads now; layer 2 is a consumer whose reads were
    staged a token ahead. Either way the step raises the reader's own error (not the call's),
    nothing stays pinned once the request ends, and the pool's thread serves on."""
    room = (LAYERS + 1) * TOP_K * extent_bytes(staged_model)
    opts = EngineOptions(io_mode="buffered", expert_cache=room)
    engine = load_engine(staged_model, opts)
    failing = engine.pool.file = FailingReads(engine.pool.file, layer)
    try:
        assert engine.staged is not None
        req = engine.new_request()
        with req:
            logits = engine.prefill(req, engine.tokenizer.encode("def f(x):"))
            failing.armed = True
            with pytest.raises(OSError, match=f"the disk failed reading layer {layer}"):
                for _ in range(8):  # a miss of that layer comes within a few steps
                    logits = engine.step(req, int(logits.argmax()))
        assert engine.pool._pinned == 0
        assert engine_threads_left()
        failing.armed = False
        engine.pool.clear()
        # a new request decodes as a fresh engine does
        got = engine.generate(engine.tokenizer.encode("x = 1"), 6, GREEDY).drain().tokens
    finally:
        engine.close()
    fresh = load_engine(staged_model, opts)
    try:
        assert got == fresh.generate(fresh.tokenizer.encode("x = 1"), 6, GREEDY).drain().tokens
    finally:
        fresh.close()
