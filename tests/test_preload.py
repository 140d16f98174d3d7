"""EngineOptions.preload: a pool that holds every expert is read in full at load, so decoding
reads nothing; a smaller pool, or preload off, reads experts as they are routed."""

from __future__ import annotations

import pytest

from edge0 import builtin
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from helpers import mapping_field


def decode_reads(engine, steps: int = 8) -> int:
    """Bytes the pool reads while prefilling a prompt and decoding `steps` greedy tokens."""
    before = engine.pool.stats.bytes_read
    with engine.new_request() as req:
        logits = engine.prefill(req, engine.tokenizer.encode("def read_config(path):"))
        for _ in range(steps):
            logits = engine.step(req, int(logits.argmax()))
    return engine.pool.stats.bytes_read - before


def pool_rss(pool) -> int:
    """Resident bytes of the mapping that holds the pool's slots."""
    return int(mapping_field(pool._slots.data_ptr(), "Rss")[0]) << 10


def test_an_uncapped_engine_holds_every_expert_before_its_first_token():
    engine = load_engine(builtin.model_dir(), EngineOptions(io_mode="buffered"))
    try:
        plan = engine.plan
        assert plan.holds_every_expert
        assert engine.pool.stats.bytes_read == plan.experts_bytes
        assert engine.pool.resident_bytes == plan.experts_bytes
        assert engine.pool.available() == engine.pool.num_slots  # nothing left pinned
        assert decode_reads(engine) == 0
    finally:
        engine.close()


def test_without_preload_experts_are_read_as_routed():
    engine = load_engine(builtin.model_dir(), EngineOptions(io_mode="buffered", preload=False))
    try:
        assert engine.plan.holds_every_expert and engine.pool.stats.bytes_read == 0
        read = decode_reads(engine)
        assert 0 < read <= engine.plan.experts_bytes
    finally:
        engine.close()


def test_a_pool_too_small_for_every_expert_is_not_preloaded():
    probe = load_engine(builtin.model_dir(), EngineOptions(io_mode="buffered", preload=False))
    experts_bytes, extent = probe.plan.experts_bytes, probe.plan.extent_bytes
    probe.close()
    small = EngineOptions(io_mode="buffered", expert_cache=experts_bytes // 2)
    engine = load_engine(builtin.model_dir(), small)
    try:
        assert not engine.plan.holds_every_expert
        assert engine.pool.stats.bytes_read == 0  # load read nothing; decoding reads
        assert pool_rss(engine.pool) >= engine.pool.capacity_bytes  # but its memory is in
        assert engine.plan.pool_bytes < experts_bytes and engine.plan.pool_bytes >= extent
        with pytest.raises(ValueError, match="cannot hold every expert"):
            engine.preload_experts()
        assert decode_reads(engine) > 0
    finally:
        engine.close()
