"""Experts stored as bf16 (`edge0 convert --experts bf16`, formats/format.py BF16): a teacher
served by edge0 without int4's error. The extents hold the checkpoint's weights rounded to
bf16, every backend computes them in fp32 on those weights, and the served logits are the full
model's to bf16's rounding where the int4 store's are far from them."""

from __future__ import annotations

import json

import pytest
import torch

from edge0 import builtin
from edge0.cli.main import main
from edge0.convert import convert
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.formats.extents import ExtentLayout
from edge0.formats.format import BF16, INT4
from edge0.formats.int4_layout import LAYOUTS, host_layout
from edge0.modeldir.loader import load_hf_model
from edge0.models.base import Forward
from edge0.train.student import load_teacher

PROMPT, STEPS = 24, 16


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16")
    teacher = builtin.teacher_dir()
    convert(teacher, tmp / "bf16", progress=False, experts="bf16", resident="bf16")
    convert(teacher, tmp / "int4", progress=False)
    hf = load_hf_model(teacher)
    ids = torch.randint(
        0, hf.config.vocab_size, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        full = hf(ids, Forward()).float()[0]
    return {"tmp": tmp, "ids": ids, "full": full}


def test_an_extent_holds_the_weights_rounded_to_bf16():
    layout = ExtentLayout(256, 128, format=BF16)
    gate, up, down = torch.randn(128, 256), torch.randn(128, 256), torch.randn(256, 128)
    buf = layout.pack(gate, up, down)
    assert buf.numel() == layout.nbytes and layout.nbytes % BF16.extent_align == 0
    assert layout.payload_bytes == 2 * 3 * 256 * 128  # the weights, nothing else
    layout.finalize(buf)  # a pool's read: nothing to convert
    w13, w2 = layout.dequantize(layout.views(buf))
    assert torch.equal(w13, torch.cat([gate, up]).bfloat16().float())
    assert torch.equal(w2, down.bfloat16().float())
    assert (w13, w2)[0].shape == layout.dequantize_stored(buf)[0].shape
    assert BF16.held_bytes(256, 128) == 2 * 256 * 128 < 4 * INT4.held_bytes(256, 128)


def served(path, backend: str, ids: torch.Tensor) -> torch.Tensor:
    """The engine's logits for the positions after the prompt: prefill, then one step a token."""
    engine = load_engine(path, EngineOptions(no_prerouter=True, no_lora=True, backend=backend))
    try:
        with engine.new_request() as req:
            out = [engine.prefill(req, ids[0, :PROMPT].tolist())]
            out += [engine.step(req, t) for t in ids[0, PROMPT:-1].tolist()]
    finally:
        engine.close()
    return torch.stack([o.float().reshape(-1) for o in out])


def kl(full: torch.Tensor, got: torch.Tensor) -> float:
    p, q = torch.log_softmax(full, -1), torch.log_softmax(got, -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_a_bf16_store_serves_the_full_model_where_int4_does_not(dirs, backend):
    full = dirs["full"][PROMPT - 1 : -1]
    bf16 = served(dirs["tmp"] / "bf16", backend, dirs["ids"])
    int4 = served(dirs["tmp"] / "int4", backend, dirs["ids"])
    assert torch.equal(bf16.argmax(-1), full.argmax(-1))
    assert (bf16 - full).abs().max() < 0.01 * full.abs().max()
    # measured 2e-5 against the int4 store's 0.34 on these random tokens
    assert kl(full, bf16) < 1e-3 < kl(full, int4)


def test_the_manifest_records_the_format_and_inspect_reads_it(dirs, capsys):
    manifest = json.loads((dirs["tmp"] / "bf16" / "edge0.json").read_text())
    assert manifest["quantization"]["experts"]["scheme"] == "float"
    assert manifest["quantization"]["resident"] == "bf16"
    extent = manifest["experts"]["extent_bytes"]
    assert (
        extent
        == ExtentLayout(
            manifest["experts"]["hidden"], manifest["experts"]["inter"], format=BF16
        ).nbytes
    )
    assert main(["inspect", str(dirs["tmp"] / "bf16")]) == 0
    assert f"edge0 extent {extent:,} bytes" in capsys.readouterr().out


def test_float_experts_need_no_relayout_on_another_arrangement(dirs):
    """The header records the converting machine's int4 arrangement; weights have none, so a
    store written under another one is served as it is, with no repacked copy."""
    other = next(name for name in LAYOUTS if name != host_layout().name)
    path = dirs["tmp"] / "bf16-other"
    convert(
        builtin.teacher_dir(), path, progress=False, experts="bf16", resident="bf16", int4=other
    )
    cache = dirs["tmp"] / "cache"
    engine = load_engine(path, EngineOptions(no_prerouter=True, no_lora=True, cache_dir=cache))
    try:
        assert engine.pool.file.path == path / "experts.safetensors"
    finally:
        engine.close()
    assert torch.equal(
        served(path, "native", dirs["ids"]), served(dirs["tmp"] / "bf16", "native", dirs["ids"])
    )


def test_an_edge0_teacher_from_a_bf16_store_scores_as_the_full_model(dirs):
    teacher = load_teacher(dirs["tmp"] / "bf16", rows=1, length=PROMPT + STEPS)
    try:
        logits = teacher(dirs["ids"]).float()[0]
    finally:
        teacher.close()
    assert kl(dirs["full"], logits) < 1e-3


def test_bf16_experts_are_refused_for_an_already_quantized_source(dirs, capsys):
    out = dirs["tmp"] / "refused"
    code = main(
        ["convert", str(builtin.teacher_dir()), str(out), "--from-mlx", "--experts", "bf16"]
    )
    assert code != 0 and not out.exists()
    assert "already quantized" in capsys.readouterr().err
