"""A decode token through every layer in one native call (edge0.TokenDecoder): the same
logits and routing as the native layers one by one, bit for bit; built again when the pool's
slots or an adapter change; not used where a step is not one it computes."""

from __future__ import annotations

import pytest
import torch

from edge0 import builtin
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.models import lora
from helpers import EVERY_ACTIVATION, rows_logits

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel


def greedy(engine, one_call: bool, steps: int = 10, prompt: str = "def f(x):"):
    """Prefill and `steps` greedy decode steps, through the token op or (one_call False) the
    native layers one by one -> (logits [steps + 1, V], pool hits during decode)."""
    token = engine.token
    if not one_call:
        engine.token = None
    try:
        with engine.new_request() as req:
            logits = [engine.prefill(req, engine.tokenizer.encode(prompt))]
            hits = engine.pool.stats.hits
            for _ in range(steps):
                logits.append(engine.step(req, int(logits[-1].argmax())))
            return torch.stack(logits), engine.pool.stats.hits - hits
    finally:
        engine.token = token


@EVERY_ACTIVATION
def test_one_call_a_token_is_the_native_layers_bit_for_bit(int4_model, dtype, acts):
    """The final norm and the (untied, int4) LM head run in the call too: the same logits."""
    opts = EngineOptions(io_mode="buffered", backend="native", dtype=dtype, int4_activations=acts)
    engine = load_engine(int4_model, opts)
    heads, logits = [], engine.model.logits
    engine.model.logits = lambda h: heads.append(1) or logits(h)
    embedding = engine.model.backbone.embedding()
    rows, forward = [], embedding.forward
    embedding.forward = lambda ids: rows.append(1) or forward(ids)
    try:
        assert engine.token is not None and engine.token._head() is not None
        one, hits_one = greedy(engine, True)
        assert engine.token._decoder is not None  # it served the steps
        assert len(heads) == 1  # the prompt's: no step's logits came from Python
        assert len(rows) == 1  # nor a step's embedding row
        layers, hits_layers = greedy(engine, False)
        assert len(heads) == len(rows) == 1 + 11
        assert torch.equal(one, layers)
        assert hits_one == hits_layers == 10 * 3 * 2  # steps x layers x K
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_decoder_looks_up_every_token_as_the_int4_embedding_does(int4_model, dtype):
    engine = load_engine(int4_model, EngineOptions(io_mode="buffered", dtype=dtype))
    try:
        embedding = engine.model.backbone.embedding()
        assert type(embedding).__name__ == "Int4Embedding" and embedding.dtype == dtype
        greedy(engine, True, steps=1)
        decoder = engine.token._decoder
        every = embedding(torch.arange(embedding.num_embeddings)[:, None])  # [V, 1, D]
        assert every.dtype == dtype and every.abs().amax() > 0
        for token in range(embedding.num_embeddings):
            assert torch.equal(decoder.embed(token), every[token : token + 1]), token
        with pytest.raises(RuntimeError, match="not in the vocabulary"):
            decoder.embed(embedding.num_embeddings)
    finally:
        engine.close()


def test_the_built_in_model_decodes_the_same_in_one_call():
    """Float projections under the recovery LoRA; then with the adapters switched off the
    decoder is built again and still computes what the layers do."""
    engine = load_engine(builtin.model_dir(), EngineOptions(io_mode="buffered", backend="native"))
    try:
        assert engine.prerouter is None and engine.token is not None  # every expert fits
        one, _ = greedy(engine, True)
        first = engine.token._decoder
        assert torch.equal(one, greedy(engine, False)[0])
        lora.set_enabled(engine.model, False)
        off, _ = greedy(engine, True)
        assert engine.token._decoder is not first
        assert torch.equal(off, greedy(engine, False)[0])
        assert not torch.equal(off, one)  # the adapters did change the logits
    finally:
        engine.close()


def batched(engine, requests: int, alone: bool = False) -> list[torch.Tensor]:
    """rows_logits of `requests` requests at different positions (prompts of 1 to `requests`
    tokens), 5 steps."""
    vocab = engine.model.config.vocab_size
    ids = [t % vocab for t in engine.tokenizer.encode("def read_config(path): return path")]
    return rows_logits(engine, 5, alone, [ids[: i + 1] for i in range(requests)])


@pytest.mark.parametrize("requests", [3, 5], ids=["row-by-row", "experts-over-rows"])
@EVERY_ACTIVATION
def test_a_batched_step_in_one_call_is_each_rows_own_step_bit_for_bit(
    int4_model, requests, dtype, acts
):
    """TokenDecoder.step_rows: every row's logits are its own step's, bit for bit, with each
    row's experts on their own (3 rows) and each expert once over its rows (5 rows, from the
    backend's rows_from); the layers one by one agree up to their LM head's rounding over
    rows, and pick the same tokens."""
    opts = EngineOptions(io_mode="buffered", backend="native", dtype=dtype, int4_activations=acts)
    engine = load_engine(int4_model, opts)
    served, rows = [], engine.token.rows
    engine.token.rows = lambda caches, tokens: served.append(len(caches)) or rows(caches, tokens)
    try:
        assert engine.token.rows_from == 4
        hits = [engine.pool.stats.hits]
        together = batched(engine, requests)
        assert served == [requests] * 5
        assert engine.token._decoder is not None
        hits.append(engine.pool.stats.hits)
        alone = batched(engine, requests, alone=True)
        hits.append(engine.pool.stats.hits)
        assert hits[1] - hits[0] == hits[2] - hits[1] > 5 * requests * 3 * 2  # and prefills'
        assert len(together) == len(alone) == 5 * requests
        assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
        engine.token, token = None, engine.token
        layers = batched(engine, requests)
        engine.token = token
        assert [int(x.argmax()) for x in layers] == [int(x.argmax()) for x in together]
        for a, b in zip(together, layers, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * float(b.abs().max()))
    finally:
        engine.close()


def test_a_pool_that_lost_entries_is_taken_again(int4_model):
    """Clearing the pool frees every slot; the next reads may land anywhere, so the decoder's
    table of expert tensors is made again, and the logits do not change."""
    engine = load_engine(int4_model, EngineOptions(io_mode="buffered", backend="native"))
    try:
        before, _ = greedy(engine, True)
        first = engine.token._decoder
        engine.pool.clear()
        # until every expert is back, steps take the layers (and read what they route to)
        partial, _ = greedy(engine, True, steps=2)
        assert torch.equal(partial, before[:3])
        engine.preload_experts()
        again, _ = greedy(engine, True)
        assert engine.token._decoder is not first
        assert torch.equal(again, before)
    finally:
        engine.close()


def test_steps_it_does_not_compute_take_the_layers(int4_model):
    """A staged prerouter, or a pool that cannot hold every expert, never builds it."""
    # four of this shape's 57,344-byte extents: one layer's top-2 fits, not every expert
    capped = EngineOptions(io_mode="buffered", backend="native", expert_cache=4 * 57344)
    engine = load_engine(int4_model, capped)
    try:
        assert not engine.plan.holds_every_expert and engine.token is None
    finally:
        engine.close()
    staged = EngineOptions(io_mode="buffered", backend="native", prerouter_always=True)
    engine = load_engine(builtin.model_dir(), staged)
    try:
        assert engine.prerouter is not None and engine.token is None
    finally:
        engine.close()
    engine = load_engine(int4_model, EngineOptions(io_mode="buffered", backend="torch"))
    try:
        assert engine.token is None
    finally:
        engine.close()


def test_closing_the_engine_lets_the_pools_memory_go(int4_model):
    """The decoder's table holds views of every slot; a closed engine drops it, so nothing
    keeps the pool's mapping alive."""
    import gc
    import weakref

    engine = load_engine(int4_model, EngineOptions(io_mode="buffered", backend="native"))
    greedy(engine, True, steps=2)
    assert engine.token._decoder is not None
    mem = weakref.ref(engine.pool._slots)  # the tensor over the pool's mapping
    engine.close()
    gc.collect()
    assert engine.token is None and mem() is None
