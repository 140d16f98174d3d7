"""edge0's decode attention (attention.cpp), which the layer op takes from a context length on
instead of ATen's SDPA: the same bits on every path, within a stated tolerance of the exact
softmax attention and of SDPA, and an engine that decodes past that length stays within it
of the pure-PyTorch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from edge0 import native
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel

# The stated tolerance: the largest error against float64 attention, relative to the largest
# |value|. Measured: at most 1.5e-6 over 36 such cases of 1 to 4,096 positions, under every
# capability (SDPA's own: ~1.5e-7)
TOLERANCE = 2e-6


def paths_here() -> list[int]:
    return [isa for isa in (0, 1, 2) if torch.ops.edge0.int4_isa_supported(isa)]


def exact(q, k, v, length, scale):
    """float64 softmax attention of q [H, Dh] over positions 0..length-1 of [1, G, max, Dh]."""
    g = k.shape[1]
    q = q.double().view(g, -1, q.shape[-1])
    k, v = k[0, :, :length].double(), v[0, :, :length].double()
    return (torch.softmax(q @ k.transpose(1, 2) * scale, -1) @ v).view(-1, q.shape[-1])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads, kv_heads, dh, length",
    [(16, 4, 64, 300), (8, 8, 128, 1), (4, 2, 48, 17), (6, 1, 64, 1000), (16, 4, 64, 4096)],
)
def test_every_path_computes_the_same_within_the_tolerance(heads, kv_heads, dh, length, kv_dtype):
    native.load()
    gen = torch.Generator().manual_seed(length)
    k = (torch.randn(1, kv_heads, length + 5, dh, generator=gen) * 2).to(kv_dtype)
    v = torch.randn(1, kv_heads, length + 5, dh, generator=gen).to(kv_dtype)
    q = torch.randn(heads, dh, generator=gen) * 2
    scale = dh**-0.5
    outs = [torch.ops.edge0.decode_attention(q, k, v, length, scale, isa) for isa in paths_here()]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    ref = exact(q, k, v, length, scale)
    top = ref.abs().max().item()
    assert (outs[0].double() - ref).abs().max().item() <= TOLERANCE * top
    sdpa = F.scaled_dot_product_attention(
        q.view(1, heads, 1, dh),
        k[:, :, :length].float(),
        v[:, :, :length].float(),
        scale=scale,
        enable_gqa=heads != kv_heads,
    ).view(heads, dh)
    assert (outs[0] - sdpa).abs().max().item() <= 2 * TOLERANCE * top


def test_a_position_far_below_the_largest_weighs_nothing():
    """exp of a score more than 87 below the largest is 0, not a denormal or garbage."""
    native.load()
    k = torch.zeros(1, 1, 32, 16)
    k[0, 0, 0] = 10.0  # position 0 scores 10 * 10 * 16 = 1600 above the others
    v = torch.arange(32.0).view(1, 1, 32, 1).expand(1, 1, 32, 16).contiguous()
    q = torch.full((1, 16), 10.0)
    for isa in paths_here():
        out = torch.ops.edge0.decode_attention(q, k, v, 32, 1.0, isa)
        assert torch.equal(out, torch.zeros(1, 16))  # position 0's value alone


def test_bad_arguments_are_refused():
    native.load()
    k = torch.zeros(1, 2, 8, 64)
    with pytest.raises(RuntimeError, match="positions"):
        torch.ops.edge0.decode_attention(torch.zeros(4, 64), k, k, 9, 1.0, 0)
    with pytest.raises(RuntimeError, match="multiple of"):
        torch.ops.edge0.decode_attention(torch.zeros(3, 64), k, k, 4, 1.0, 0)
    odd = torch.zeros(1, 2, 8, 40)
    with pytest.raises(RuntimeError, match="head dim"):
        torch.ops.edge0.decode_attention(torch.zeros(4, 40), odd, odd, 4, 1.0, 0)


def long_decode(
    path, backend: str, one_call: bool = True, steps: int = 6, activations: str = "bf16"
):
    """Logits of `steps` greedy decode steps after a prompt that ends 2 positions before the
    native attention's start (so steps cross it), and how many times the steps called it.
    With the exact option's bf16 activations by default: the attention is then all that
    differs from torch's path."""
    start = torch.ops.edge0.native_attention_from()
    opts = EngineOptions(
        io_mode="buffered",
        backend=backend,
        max_context=start + 64,
        int4_activations=activations,
    )
    engine = load_engine(path, opts)
    if not one_call:
        engine.token = None
    try:
        prompt = torch.randint(5, 500, (start - 2,), generator=torch.Generator().manual_seed(3))
        with engine.new_request() as req:
            logits = engine.prefill(req, prompt.tolist())
            out = []
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    logits = engine.step(req, int(logits.argmax()))
                    out.append(logits)
        calls = sum(e.count for e in prof.key_averages() if e.key == "edge0::decode_attention")
        return torch.stack(out), calls
    finally:
        engine.close()


def test_decode_past_the_start_is_the_module_paths_within_the_tolerance(int4_model):
    """Below the start the native layers are the module path bit for bit (test_native.py);
    from it on, within the attention's tolerance: the logits' largest difference is under
    1e-5 of their largest, and greedy decoding picks the same tokens. The token op and the
    layers one by one agree bit for bit on both sides."""
    native.load()
    fused, calls = long_decode(int4_model, "native")
    # step 0 attends over start - 1 positions (SDPA), steps 1-5 over start.. (ours), 3 layers
    assert calls == 5 * 3
    layers, calls = long_decode(int4_model, "native", one_call=False)
    assert calls == 5 * 3 and torch.equal(fused, layers)
    reference, calls = long_decode(int4_model, "torch")
    assert calls == 0
    assert torch.equal(fused[:1], reference[:1])
    top = reference.abs().max().item()
    assert (fused - reference).abs().max().item() <= 1e-5 * top
    assert torch.equal(fused.argmax(-1), reference.argmax(-1))


def test_with_int8_activations_decode_attends_natively_from_the_first_position(int4_model):
    """int8 activations are not the module path's bits anyway: their decode attention is
    edge0's own at every length (no SDPA, no conversion of the cache), the token op and the
    layers one by one still bit for bit alike."""
    native.load()
    fused, calls = long_decode(int4_model, "native", activations="int8")
    assert calls == 6 * 3  # every step, every layer: below the start too
    layers, calls = long_decode(int4_model, "native", one_call=False, activations="int8")
    assert calls == 6 * 3 and torch.equal(fused, layers)
