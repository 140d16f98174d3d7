"""The int4 code arrangements: packing, detection of the host's, the kernel self-check."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from edge0.formats import int4_layout, quant
from edge0.formats.int4_layout import LAYOUTS, KernelLayoutError, host_layout, relayout, self_check
from helpers import capability_env, cpu_capabilities

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel

SHAPES = [(32, 64), (96, 128), (160, 256), (1536, 128)]


def codes(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_pack_unpack_roundtrip(name, shape):
    layout, q = LAYOUTS[name], codes(*shape)
    packed = layout.pack(q)
    assert packed.shape == (shape[0], shape[1] // 2) and packed.dtype == torch.uint8
    assert torch.equal(layout.unpack(packed, *shape), q)


def test_arrangements_differ():
    q = codes(96, 128)
    packed = {name: lay.pack(q) for name, lay in LAYOUTS.items()}
    names = list(packed)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not torch.equal(packed[a], packed[b]), (a, b)


@pytest.mark.parametrize("src", LAYOUTS)
@pytest.mark.parametrize("dst", LAYOUTS)
def test_relayout_moves_codes_between_arrangements(src, dst):
    q = codes(160, 128)
    got = int4_layout.relayout(LAYOUTS[src].pack(q), 160, 128, LAYOUTS[src], LAYOUTS[dst])
    assert torch.equal(got, LAYOUTS[dst].pack(q))


@pytest.mark.parametrize("name", LAYOUTS)
def test_kernel_form_dequantize_matches_the_formula(name):
    n, k = 160, 128
    q = codes(n, k)
    gen = torch.Generator().manual_seed(3)
    scale = torch.randn(n, k // 64, generator=gen).bfloat16()
    bias = torch.randn(n, k // 64, generator=gen).bfloat16()
    pairs = quant.pairs_from(scale, bias)
    quant.to_kernel_pairs(pairs)  # (scale, zero): the kernel computes (q - 8) * scale + zero
    zero = pairs[..., 1].t().float()
    want = (q.float() - 8) * scale.float().repeat_interleave(64, 1) + zero.repeat_interleave(64, 1)
    got = LAYOUTS[name].dequantize(LAYOUTS[name].pack(q), pairs, n, k)
    assert torch.allclose(got, want, atol=1e-5)


def test_host_layout_is_torchs_own_packing():
    host = host_layout()
    for n, k in SHAPES:
        q = codes(n, k, seed=n)
        torch_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
        assert torch.equal(host.pack(q), torch_packed), (host.name, n, k)


def test_an_unknown_arrangement_is_an_error_naming_torch():
    def reversed_packer(q):  # what a future torch might do: some other order
        return LAYOUTS["n32-split"].pack(q).flip(0)

    with pytest.raises(KernelLayoutError) as err:
        host_layout(reversed_packer)
    msg = str(err.value)
    assert torch.__version__ in msg and "does not know" in msg
    assert torch.backends.cpu.get_cpu_capability() in msg


def test_self_check_passes_on_the_host_and_catches_every_other_arrangement():
    host = host_layout()
    assert self_check(host) < 1e-2
    for layout in LAYOUTS.values():
        if layout == host:
            continue
        with pytest.raises(KernelLayoutError) as err:
            self_check(layout)
        msg = str(err.value)
        assert layout.name in msg and "expected" in msg and "found" in msg


PROBE = """
import json, torch
from edge0.formats import int4_layout
host = int4_layout.host_layout()
ok = []
pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
for n, k in [(32, 64), (96, 128), (160, 256), (1536, 128)]:
    gen = torch.Generator().manual_seed(n)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    ok.append(torch.equal(host.pack(q), pack(q.int(), 1)))
print(json.dumps({"cap": torch.backends.cpu.get_cpu_capability(), "layout": host.name,
                  "packs_like_torch": all(ok), "self_check": int4_layout.self_check(host)}))
"""


@pytest.mark.slow
def test_every_capability_is_detected_and_self_checks():
    seen = {}
    for cap in cpu_capabilities():
        out = subprocess.run(
            [sys.executable, "-c", PROBE],
            env=capability_env(cap),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        r = json.loads(out)
        assert r["cap"].lower() == cap
        assert r["packs_like_torch"], r
        assert r["self_check"] < 1e-2
        seen[cap] = r["layout"]
    print(seen)
    # the kernels this CPU runs do not share one arrangement (x86: default vs avx2 at least)
    if len(seen) > 1:
        assert len(set(seen.values())) > 1


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=lambda lay: lay.name)
def test_the_int8_order_keeps_the_codes_and_the_weights(layout):
    """An arrangement in its int8 order packs the same codes in other places: they unpack,
    dequantize and relayout to what the arrangement itself gives, and back."""
    gen = torch.Generator().manual_seed(5)
    n, k = 96, 192  # blocks of 64 and a tail of 32 for n64-split
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    pairs = torch.randn(k // 64, n, 2, generator=gen).bfloat16()
    ordered = layout.in_int8_order()
    assert ordered.int8_order and ordered.in_own_order() == layout
    packed = ordered.pack(q)
    assert not torch.equal(packed, layout.pack(q))
    assert torch.equal(ordered.unpack(packed, n, k), q)
    assert torch.equal(
        ordered.dequantize(packed, pairs, n, k), layout.dequantize(layout.pack(q), pairs, n, k)
    )
    assert torch.equal(relayout(packed, n, k, ordered, layout), layout.pack(q))
    assert torch.equal(relayout(layout.pack(q), n, k, layout, ordered), packed)
