"""Linear-attention layers' decode token through the native ops (edge0::delta_rows for
Gated DeltaNet, edge0::kda_rows for Kimi Delta Attention, engine/backends/native_delta.py):
the module's bits in fp32 and bf16, at real head sizes, with int4 and float projections under
LoRA adapters; a batched step's rows each their own step's bits; the engine's Qwen3.5 and Ling
decode through them equal to the pure-PyTorch path."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from edge0 import native
from edge0.convert import convert
from edge0.engine.backends.native_delta import NativeDelta, NativeKda
from edge0.engine.backends.native_layers import MoeTail, layer_ops, sum_lanes
from edge0.formats.int4_layout import host_layout
from edge0.models import bailing_hybrid
from edge0.models.base import Forward
from edge0.models.blocks import DecoderLayer
from edge0.models.int4 import Int4Linear, quantize
from edge0.models.layers import MLP, KVCache, RMSNorm, RowCaches, ZeroCenteredRMSNorm
from edge0.models.lora import LoraLinear
from edge0.models.qwen3_5_moe import Config, GatedDeltaNet
from helpers import decode_logits

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel

# Qwen3.5-35B-A3B's linear-attention head sizes (2 of its 16 key heads, 4 of its 32 value
# heads; KDA: 2 heads of 128): the delta rule's sums run down 128 rows, through every level
# of ATen's cascade
HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_DIM = 256, 2, 4, 128


class Weights:
    """Random weights for a test layer, from one seed: int4 projections, LoRA adapters with
    both matrices non-zero."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, shape, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen) * scale

    def fill(self, module: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(self.randn(p.shape, 0.3))

    def int4(self, linear: torch.nn.Linear) -> Int4Linear:
        w = self.randn(linear.weight.shape, linear.in_features**-0.5)
        return Int4Linear(*quantize(w), host_layout())

    def adapted(self, base: torch.nn.Module) -> LoraLinear:
        lora = LoraLinear(base, r=8, alpha=16)
        with torch.no_grad():
            lora.lora_A.copy_(self.randn(lora.lora_A.shape, 0.1))
            lora.lora_B.copy_(self.randn(lora.lora_B.shape, 0.1))
        return lora

    def layer(self, mixer: torch.nn.Module, norm, dtype: torch.dtype) -> DecoderLayer:
        """`mixer` in a decoder layer with a dense MLP and random norms."""
        layer = DecoderLayer(("linear_attn", mixer), ("mlp", MLP(HIDDEN, 128)), norm)
        with torch.no_grad():
            for name in ("input_layernorm", "post_attention_layernorm"):
                getattr(layer, name).weight.copy_(self.randn(HIDDEN, 0.1))
        return layer.to(dtype)


def delta_layer(dtype: torch.dtype, seed: int = 0) -> DecoderLayer:
    """A Gated DeltaNet decoder layer with random weights: q|k|v, z and the output projection
    int4 (q|k|v and the output under enabled adapters), b and a float, b under an adapter."""
    w = Weights(seed)
    cfg = Config(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        linear_num_key_heads=KEY_HEADS,
        linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=HEAD_DIM,
        linear_value_head_dim=HEAD_DIM,
    )
    mixer = GatedDeltaNet(cfg, 0)
    w.fill(mixer)
    with torch.no_grad():
        mixer.A_log.copy_(torch.rand(VALUE_HEADS, generator=w.gen).log())
        mixer.norm.weight.copy_(1 + w.randn(HEAD_DIM, 0.1))
    mixer.in_proj_qkv = w.adapted(w.int4(mixer.in_proj_qkv))
    mixer.in_proj_z = w.int4(mixer.in_proj_z)
    mixer.out_proj = w.adapted(w.int4(mixer.out_proj))
    mixer.in_proj_b = w.adapted(mixer.in_proj_b)
    return w.layer(mixer, partial(ZeroCenteredRMSNorm, HIDDEN, 1e-6), dtype)


def kda_layer(dtype: torch.dtype, seed: int = 0, safe_gate: bool = True) -> DecoderLayer:
    """A Kimi Delta Attention decoder layer (Ling's) with random weights: q, k, v, f, g and
    the output projection int4 (q and the output under adapters), b float under an adapter."""
    w = Weights(seed)
    cfg = bailing_hybrid.Config(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=KEY_HEADS,
        num_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        linear_head_dim=HEAD_DIM,
        kda_safe_gate=safe_gate,
    )
    mixer = bailing_hybrid.KimiDeltaAttention(cfg, 0)
    w.fill(mixer)
    with torch.no_grad():
        mixer.A_log.copy_(torch.rand(KEY_HEADS, generator=w.gen).log())
        mixer.o_norm.weight.copy_(1 + w.randn(HEAD_DIM, 0.1))
    for name in ("k_proj", "v_proj", "f_proj", "g_proj"):
        setattr(mixer, name, w.int4(getattr(mixer, name)))
    mixer.q_proj = w.adapted(w.int4(mixer.q_proj))
    mixer.dense = w.adapted(w.int4(mixer.dense))
    mixer.b_proj = w.adapted(mixer.b_proj)
    return w.layer(mixer, partial(RMSNorm, HIDDEN, 1e-6), dtype)


LAYERS = {
    "gated-deltanet": (delta_layer, NativeDelta, "delta_rows"),
    "kda": (kda_layer, NativeKda, "kda_rows"),
    "kda-unsafe-gate": (partial(kda_layer, safe_gate=False), NativeKda, "kda_rows"),
}


def stand_in(layer: DecoderLayer, int8: bool = False, kind: str = "gated-deltanet"):
    _, cls, op = LAYERS[kind]
    lanes = sum_lanes()
    tail = MoeTail(layer, layer_ops(), lanes)
    return cls(layer, native.op(op), tail, lanes, int8=int8)


def new_cache(layer: DecoderLayer, dtype: torch.dtype) -> KVCache:
    return KVCache([layer.mixer.cache_spec()], 64, dtype)


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_is_the_modules_step_bit_for_bit(dtype, kind):
    """Twelve tokens from a fresh state, each through the module and through the op on their
    own caches: every output, conv window and delta-rule state equal, bit for bit (Gated
    DeltaNet; KDA with either decay)."""
    make, cls, _ = LAYERS[kind]
    layer = make(dtype)
    assert cls.servable(layer)
    native_layer = stand_in(layer, kind=kind)
    ours, theirs = new_cache(layer, dtype), new_cache(layer, dtype)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(12):
            x = torch.randn(1, 1, HIDDEN, generator=gen).to(dtype)
            expected = layer(x, None, Forward(theirs))
            got = native_layer(x, None, Forward(ours))
            assert torch.equal(got, expected)
            for a, b in zip(ours.state(0), theirs.state(0), strict=True):
                assert torch.equal(a, b)
    assert ours.length == theirs.length == [12]
    assert ours.state(0)[1].abs().max() > 0.01  # the state carries something to get wrong


def test_int8_activations_stay_within_their_stated_error():
    """With int8 activations the op's int4 projections take the int8 kernel: over twelve
    tokens the layer's contribution (its output less its input) stays within 6% of the
    module's (relative norm; measured 1.2-3.0%) and the state within 3% (measured ~1%),
    without drifting, and differs from the exact option's (the int8 kernel ran)."""
    dtype = torch.bfloat16
    layer = delta_layer(dtype)
    int8, exact = stand_in(layer, int8=True), stand_in(layer)
    ours, theirs, same = (new_cache(layer, dtype) for _ in range(3))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(12):
            x = torch.randn(1, 1, HIDDEN, generator=gen).to(dtype)
            expected = layer(x, None, Forward(theirs)).float() - x.float()
            got = int8(x, None, Forward(ours)).float() - x.float()
            assert not torch.equal(got, exact(x, None, Forward(same)).float() - x.float())
            assert (got - expected).norm() < 0.06 * expected.norm()
            state, reference = ours.state(0)[1], theirs.state(0)[1]
            assert (state - reference).norm() < 0.03 * reference.norm()


def test_a_batched_steps_rows_are_each_their_own_step():
    """Three rows at different points of their sequences in one call: each row's output and
    state are those of its own step alone."""
    dtype = torch.bfloat16
    layer = delta_layer(dtype, seed=2)
    native_layer = stand_in(layer)
    gen = torch.Generator().manual_seed(3)
    rows, alone = [], []
    with torch.no_grad():
        for n in (0, 1, 4):  # tokens seen before the batched step
            a, b = new_cache(layer, dtype), new_cache(layer, dtype)
            for _ in range(n):
                x = torch.randn(1, 1, HIDDEN, generator=gen).to(dtype)
                native_layer(x, None, Forward(a))
                native_layer(x, None, Forward(b))
            rows.append(a)
            alone.append(b)
        x = torch.randn(3, 1, HIDDEN, generator=gen).to(dtype)
        together = native_layer(x, None, Forward(RowCaches(rows)))
        for i, cache in enumerate(alone):
            own = native_layer(x[i : i + 1], None, Forward(cache))
            assert torch.equal(together[i : i + 1], own)
            for a, b in zip(rows[i].state(0), cache.state(0), strict=True):
                assert torch.equal(a, b)


def test_a_prompt_of_several_tokens_takes_the_modules_forward():
    """Prefill (several tokens of one sequence) is the module's chunked form, not the op's."""
    dtype = torch.float32
    layer = delta_layer(dtype)
    x = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(4))
    ours, theirs = new_cache(layer, dtype), new_cache(layer, dtype)
    with torch.no_grad():
        assert torch.equal(stand_in(layer)(x, None, Forward(ours)), layer(x, None, Forward(theirs)))
    assert ours.length == [5]


HYBRIDS = {
    # family, checkpoint options, the stand-in each of its 4 layers gets
    "qwen3.5": ("qwen3_5_moe", {}, ["NativeDelta", "NativeLayer", "NativeDelta", "NativeLayer"]),
    # Ling: KDA layers 0 and 2, MLA (the module's own) at 1 and 3
    "ling": ("bailing_hybrid", {}, ["NativeKda", None, "NativeKda", None]),
    "ling-unsafe-gate": ("bailing_hybrid", dict(kda_safe_gate=False), ["NativeKda", None] * 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hybrid", list(HYBRIDS))
def test_the_engine_decodes_a_hybrid_through_the_ops_as_the_torch_path_does(
    tmp_path_factory, hybrid, dtype
):
    """Qwen3.5's Gated DeltaNet layers decode through delta_rows and its gated attention
    through the attention op (output gate, partial rotary, zero-centred norms); Ling's KDA
    layers through kda_rows. The logits of ten greedy steps are the pure-PyTorch backend's,
    bit for bit."""
    from test_families import make_checkpoint

    family, kw, kinds = HYBRIDS[hybrid]
    root = tmp_path_factory.getbasetemp() / f"hybrid-{hybrid}"
    if not (root / "e0").exists():
        make_checkpoint(root / "hf", family, **kw)
        convert(root / "hf", root / "e0", progress=False)
    fused, served = decode_logits(root / "e0", "native", dtype)
    reference, none = decode_logits(root / "e0", "torch", dtype)
    assert served == {i: k for i, k in enumerate(kinds) if k is not None}
    assert none == {}
    assert torch.equal(fused, reference)
