"""The engine's seams: a backend decides every expert op, the plan refuses before any weight is
read, and the scheduling policy is one object."""

from __future__ import annotations

import pytest
import torch

from counting_backend import CountingBackend
from edge0 import builtin
from edge0.engine import backends
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.plan import open_dir
from edge0.engine.sampling import SamplingParams

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel

PROMPT = "def read_config(path):"


def greedy(engine, steps: int = 8) -> tuple[list[int], torch.Tensor]:
    """A greedy generation's tokens, and its prompt's logits."""
    ids = engine.tokenizer.encode(PROMPT)
    with engine.new_request() as req:
        logits = engine.prefill(req, ids)
    gen = engine.generate(ids, steps, SamplingParams(temperature=0)).drain()
    return gen.tokens, logits


@pytest.mark.parametrize("prerouter", [False, True], ids=["gate-routed", "prediction-routed"])
def test_every_expert_op_goes_through_the_backend(prerouter):
    """A backend registered with one line and chosen by name computes every expert of every
    forward: each decode step's MoE layers call its token op once each, and a prefill calls
    its rows (or dense) op for every expert a layer routes to; what it computes is the torch
    backend's, bit for bit."""
    backends.register(CountingBackend)
    opts = dict(io_mode="buffered", prerouter_always=prerouter, no_prerouter=not prerouter)
    counted = load_engine(builtin.model_dir(), EngineOptions(backend="counting", **opts))
    reference = load_engine(builtin.model_dir(), EngineOptions(backend="torch", **opts))
    try:
        assert isinstance(counted.backend, CountingBackend)
        calls = counted.backend.calls
        ids = counted.tokenizer.encode(PROMPT)
        with counted.new_request() as req:
            counted.prefill(req, ids)
            layers = len(counted.moe_layers)
            assert calls["token"] == 0 and calls["rows"] >= layers
            # one expert per (layer, distinct expert the prompt routes to): at least K each
            assert calls["experts"] >= layers * counted.top_k
            before = calls.copy()
            for token in (5, 6, 7):
                counted.step(req, token)
            assert calls["token"] - before["token"] == 3 * layers
            assert calls["experts"] - before["experts"] == 3 * layers * counted.top_k
        got, want = greedy(counted), greedy(reference)
        assert got[0] == want[0] and torch.equal(got[1], want[1])
    finally:
        counted.close()
        reference.close()
        del backends.BACKENDS["counting"]


def test_an_unknown_backend_is_named():
    with pytest.raises(ValueError, match="backend must be one of auto, torch, native: 'cuda'"):
        load_engine(builtin.model_dir(), EngineOptions(backend="cuda"))


def test_a_budget_too_small_is_refused_before_any_weight_is_read(monkeypatch):
    """The plan is made from the directory's headers: a budget that cannot hold it is refused
    with the missing bytes named, having read no resident or adapter byte (ModelDir's count)
    and opened no experts file (no pool), and with this process's reads, the tokenizer aside,
    far below the resident file's size (/proc/self/io)."""
    import edge0.engine.load as load_module

    opened = []
    opts = EngineOptions(io_mode="buffered", memory_budget=1 << 20)
    md = open_dir(builtin.model_dir(), opts)
    _ = md.tokenizer  # (read first: the runtime the plan measures holds it; it is no weight)
    before = _read_bytes()
    with monkeypatch.context() as m:
        m.setattr(load_module, "ExpertFile", lambda *a, **kw: opened.append(a))
        with pytest.raises(ValueError, match="memory_budget 1.00 MiB is below the resident"):
            load_engine(md, opts)
    read = _read_bytes() - before
    assert md.bytes_read == 0 and opened == []
    assert read < md.resident.nbytes / 10, read
    fits = EngineOptions(io_mode="buffered", no_prerouter=True)
    md = open_dir(builtin.model_dir(), fits)
    engine = load_engine(md, fits)  # the same directory, a budget that holds it: it loads
    try:
        assert md.bytes_read >= md.resident.nbytes + md.lora.nbytes
    finally:
        engine.close()


def _read_bytes() -> int:
    """Bytes this process has read through read syscalls (rchar)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_the_torch_backend_reads_experts_during_a_step_under_a_cap():
    """Under a pool smaller than the experts, the torch backend's reads land during a step, in
    the engine's inference mode, and fix their (scale, bias) pairs in place in the pool's
    thread; it decodes what the native backend decodes."""
    opts = dict(io_mode="buffered", expert_cache=6 << 20, int4_activations="bf16")
    tokens = {}
    for name in ("torch", "native"):
        engine = load_engine(builtin.model_dir(), EngineOptions(backend=name, **opts))
        try:
            tokens[name] = greedy(engine)[0]
            assert engine.pool.stats.evictions > 0
        finally:
            engine.close()
    assert tokens["torch"] == tokens["native"]
