"""The math contract: every executor path against the fp32 dequantized reference."""

from __future__ import annotations

import pytest
import torch

from edge0.convert import convert
from edge0.engine.backends.native import NativeBackend
from edge0.engine.backends.torch import TorchExperts
from edge0.engine.executors import ExactExecutor, PrefillPlan, WholeLayerExecutor
from edge0.engine.options import EngineOptions
from edge0.formats.int4_layout import host_layout
from edge0.modeldir import Manifest
from edge0.modeldir.loader import load_edge0_model
from edge0.store.expert_file import ExpertFile
from edge0.store.pool import ExpertPool
from helpers import make_hf_model

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exec")
    make_hf_model(
        tmp / "hf",
        hidden_size=128,
        moe_intermediate_size=128,
        num_experts=16,
        num_experts_per_tok=4,
        head_dim=32,
    )
    convert(tmp / "hf", tmp / "e0", progress=False)
    return tmp / "e0"


def rel_l2(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def native_ops(pool: ExpertPool):
    """The native backend's expert ops for the arrangement `pool` holds, with the exact
    option's bf16 activations (the int8 kernels are held to their own reference bit for bit
    in test_native.py)."""
    return NativeBackend(EngineOptions(int4_activations="bf16")).expert_ops(pool.layout.int4)


def make_pool(model_dir, slots: int) -> ExpertPool:
    manifest = Manifest.load(model_dir)
    layout = manifest.layout().with_int4(host_layout())  # what the kernel here wants
    return ExpertPool(ExpertFile(model_dir / "experts.safetensors"), layout, slots * layout.nbytes)


@pytest.mark.parametrize("tokens", [1, 7, 400])  # 400: ~100 tokens per expert, dense kernel
@pytest.mark.parametrize("path", ["exact", "exact_fused", "whole_layer", "whole_layer_tight"])
def test_executor_matches_dequantized_reference(model_dir, path, tokens):
    _, ref_model = load_edge0_model(model_dir, experts="dequantized")
    reference = ref_model.moe_block(1).experts
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 128, generator=gen)
    indices = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(tokens)])
    slots = 5 if path == "whole_layer_tight" else 64
    pool = make_pool(model_dir, slots)
    if path == "exact":
        ex = ExactExecutor(pool, 1, TorchExperts())
    elif path == "exact_fused":
        ex = ExactExecutor(pool, 1, native_ops(pool))
    else:
        plan = PrefillPlan(pool, [0, 1, 2], 16, tokens * 4)
        ex = WholeLayerExecutor(pool, 1, plan, TorchExperts())
    with torch.no_grad():
        want = reference(x, indices)
        got = ex(x, indices)
    residual = rel_l2(got, want)
    print(f"{path} T={tokens}: relative L2 = {residual:.2e}")
    assert got.shape == (tokens, 4, 128)
    assert residual < 1e-2
    assert pool.stats.loads >= len(torch.unique(indices))
    pool.close()


def test_whole_layer_reads_the_next_layer_ahead(model_dir):
    pool = make_pool(model_dir, 64)
    plan = PrefillPlan(pool, [0, 1, 2], 16, routed_slots=200 * 4)
    x = torch.randn(200, 128)
    indices = torch.randint(0, 16, (200, 4))
    with torch.no_grad():
        WholeLayerExecutor(pool, 0, plan, TorchExperts())(x, indices)
        staged = plan.take(1)  # layer 1 was requested while layer 0 computed
    assert sorted(en.key for en in staged) == [(1, e) for e in range(16)]
    pool.wait(staged)
    pool.release(staged)
    plan.release_all()
    pool.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_experts_are_bit_identical_to_the_torch_path(model_dir, dtype):
    """The native op runs swiglu_int4's ops in the same order: equal, not merely close; so
    is its path for a pool with one requesting thread (`sole`: loaded experts unpinned, the
    rest requested), which leaves nothing pinned."""
    pool = make_pool(model_dir, 64)
    fused, reference = native_ops(pool), TorchExperts()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in range(3):
            for _ in range(4):
                x = torch.randn(1, 128, generator=gen).to(dtype)
                indices = torch.randperm(16, generator=gen)[:4][None]
                sole = ExactExecutor(pool, layer, fused, sole=True)(x, indices)  # reads some
                want = ExactExecutor(pool, layer, reference)(x, indices)
                got = ExactExecutor(pool, layer, fused)(x, indices)
                assert got.dtype == want.dtype == dtype
                assert torch.equal(got, want) and torch.equal(sole, want)
                assert torch.equal(ExactExecutor(pool, layer, fused, sole=True)(x, indices), want)
                assert pool.available() == pool.num_slots
    pool.close()


def test_only_a_pool_without_a_heads_thread_is_read_unpinned():
    """The engine's exact executors use loaded experts unpinned only where the decoding
    thread is the pool's one requester: not with the prerouter's heads on their thread."""
    from edge0 import builtin
    from edge0.engine.load import load_engine
    from edge0.engine.options import EngineOptions

    for opts, sole in [
        (EngineOptions(no_prerouter=True), True),
        (EngineOptions(heads_thread=False, prerouter_always=True), True),
        (EngineOptions(heads_thread=True, prerouter_always=True), False),
    ]:
        engine = load_engine(builtin.model_dir(), opts)
        try:
            assert {ex.sole for ex in engine._exact.values()} == {sole}
        finally:
            engine.close()
