"""int4 resident weights: the modules that serve them, which weights are stored so, loading."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edge0.formats.int4_layout import host_layout
from edge0.modeldir.loader import build
from edge0.models import FAMILIES, lora
from edge0.models.experts import ExpertSlot
from edge0.models.int4 import Int4Embedding, Int4Linear, dequantize, quantize
from edge0.models.qwen3_moe import Config
from helpers import QWEN3

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_int4_linear_is_its_dequantized_weight():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=gen)
    words, scales, biases = quantize(w)
    layer = Int4Linear(words, scales, biases, host_layout())
    x = torch.randn(3, 5, 128, generator=gen)
    want = x @ dequantize(words, scales, biases).t()
    assert rel(layer(x), want) < 1e-2  # bf16 activations in the kernel
    assert torch.equal(layer.dequantized(), dequantize(words, scales, biases))
    assert layer.to(torch.bfloat16).pairs.dtype == torch.int16  # casts never touch the kernel's


def test_int4_embedding_rows_and_tied_projection():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=gen)
    words, scales, biases = quantize(w)
    full = dequantize(words, scales, biases)
    emb = Int4Embedding(words, scales, biases, host_layout(), tied=True, dtype=torch.float32)
    ids = torch.tensor([[3, 0, 63, 3]])
    assert torch.equal(emb(ids), full[ids])
    h = torch.randn(2, 128, generator=gen)
    assert rel(emb.project(h), h @ full.t()) < 1e-2


def test_which_weights_are_int4():
    cfg = Config.from_dict(dict(QWEN3, tie_word_embeddings=False))
    model = build(FAMILIES["qwen3_moe"], cfg, ExpertSlot)
    names = model.int4_weights()
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert not any(n.endswith("mlp.gate.weight") for n in names)  # routers stay float
    assert not any("norm" in n for n in names)


def test_lora_sits_on_an_int4_projection():
    gen = torch.Generator().manual_seed(2)
    words, scales, biases = quantize(torch.randn(64, 64, generator=gen))
    model = nn.Module()
    model.proj = Int4Linear(words, scales, biases, host_layout())
    (adapter,) = lora.attach(model, ["proj"], r=4, alpha=8.0, gen=gen).values()
    with torch.no_grad():
        adapter.lora_B.normal_(generator=gen)
    x = torch.randn(2, 64, generator=gen)
    delta = adapter.scale * (x @ adapter.lora_A.t()) @ adapter.lora_B.t()
    assert torch.allclose(model.proj(x), model.proj.base(x) + delta, atol=1e-5)
