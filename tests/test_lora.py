"""The recovery LoRA: unmerged delta, strict loading, switching off, base mismatch."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from edge0 import modeldir
from edge0.convert import convert
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.sampling import SamplingParams
from edge0.models import lora
from edge0.models.base import Forward
from edge0.train.student import load_student
from helpers import make_hf_model

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    make_hf_model(tmp / "hf", family="qwen2_moe", scale=4.0)
    convert(tmp / "hf", tmp / "e0", progress=False)
    student = load_student(tmp / "e0", heads=False, new_lora=(4, 8.0), seed=1)
    with torch.no_grad():  # a visible adapter: random B instead of the no-op zero init
        for m in lora.adapters(student.model).values():
            m.lora_B.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    lora.save(
        student.model,
        tmp / "adapter.safetensors",
        {"model": "tiny", "base_hash": student.base_hash, "phase": "test"},
    )
    return tmp


def test_targets_are_attention_and_shared_expert_never_routed_experts(model_dir):
    f = lora.read(model_dir / "adapter.safetensors")
    names = {k.rsplit(".", 1)[0] for k in f.tensors}
    assert any(n.endswith("self_attn.q_proj") for n in names)
    assert any(n.endswith("mlp.shared_expert.down_proj") for n in names)
    assert not any(".experts." in n for n in names)
    for key in (
        "model",
        "r",
        "alpha",
        "targets",
        "phase",
        "base_hash",
        "created",
        "format_version",
    ):
        assert key in f.metadata


def test_delta_is_parallel_and_base_untouched(model_dir):
    s = load_student(model_dir / "e0", heads=False, lora_file=model_dir / "adapter.safetensors")
    m = next(iter(lora.adapters(s.model).values()))
    w_before = m.base.weight.clone()
    x = torch.randn(3, m.base.in_features)
    want = m.base(x) + (m.alpha / m.r) * (x @ m.lora_A.t() @ m.lora_B.t())
    assert torch.allclose(m(x), want, atol=1e-5)
    assert torch.equal(m.base.weight, w_before)


def test_engine_serves_it_and_no_lora_switches_it_off(model_dir, tmp_path):
    shutil.copytree(model_dir / "e0", tmp_path / "m")
    shutil.copy(model_dir / "adapter.safetensors", tmp_path / "m" / modeldir.LORA_FILE)
    ids = list(range(5, 25))
    plain = load_engine(model_dir / "e0")
    on = load_engine(tmp_path / "m")
    off = load_engine(tmp_path / "m", EngineOptions(no_lora=True))
    try:
        assert lora.adapters(on.model) and not lora.adapters(off.model)
        a, b, c = (e.prefill(e.new_request(), ids) for e in (plain, off, on))
        assert torch.equal(a, b)
        assert (c - a).abs().max() > 1e-3  # the adapter changes the output
    finally:
        for e in (plain, on, off):
            e.close()


def test_strict_loading_names_the_bad_target(model_dir, tmp_path):
    tensors = load_file(str(model_dir / "adapter.safetensors"))
    f = lora.read(model_dir / "adapter.safetensors")
    key = next(k for k in tensors if k.endswith("q_proj.lora_A"))
    unknown = dict(tensors)
    unknown["model.layers.0.self_attn.nope_proj.lora_A"] = tensors[key].clone()
    b_key = key.replace("lora_A", "lora_B")
    unknown["model.layers.0.self_attn.nope_proj.lora_B"] = tensors[b_key].clone()

    save_file(unknown, str(tmp_path / "unknown.safetensors"), metadata=f.metadata)
    with pytest.raises(
        ValueError, match="unknown LoRA target 'model.layers.0.self_attn.nope_proj'"
    ):
        load_student(model_dir / "e0", heads=False, lora_file=tmp_path / "unknown.safetensors")
    missing = {k: v for k, v in tensors.items() if k != key}
    save_file(missing, str(tmp_path / "missing.safetensors"), metadata=f.metadata)
    with pytest.raises(ValueError, match=r"q_proj lacks lora_A"):
        load_student(model_dir / "e0", heads=False, lora_file=tmp_path / "missing.safetensors")
    gone = {k: v for k, v in tensors.items() if "q_proj" not in k}
    save_file(gone, str(tmp_path / "gone.safetensors"), metadata=f.metadata)
    with pytest.raises(ValueError, match=r"q_proj is declared in the metadata but has no tensors"):
        load_student(model_dir / "e0", heads=False, lora_file=tmp_path / "gone.safetensors")


def test_adapter_for_another_base_is_refused_unless_asked(model_dir, tmp_path):
    f = lora.read(model_dir / "adapter.safetensors")
    meta = dict(f.metadata, base_hash="0" * 64)
    save_file(f.tensors, str(tmp_path / "other.safetensors"), metadata=meta)
    shutil.copytree(model_dir / "e0", tmp_path / "m")
    with pytest.raises(ValueError, match="trained for another base.*lora_any_base"):
        load_engine(tmp_path / "m", EngineOptions(lora=tmp_path / "other.safetensors"))
    e = load_engine(
        tmp_path / "m", EngineOptions(lora=tmp_path / "other.safetensors", lora_any_base=True)
    )
    assert lora.adapters(e.model)
    e.close()


def test_router_adapters_are_trained_and_served(model_dir, tmp_path):
    """`lora_routers`: every MoE router gets an adapter beside the family's targets; it
    changes which experts run, and the engine serves it as the student computes it."""
    s = load_student(model_dir / "e0", heads=False, new_lora=(4, 8.0), seed=1, lora_routers=True)
    gates = {f"{s.model.moe_block_path(i)}.gate" for i in s.model.moe_layers}
    assert gates and gates <= set(lora.adapters(s.model))
    assert set(lora.target_paths(s.model, lora.router_targets(s.model))) == gates
    with torch.no_grad():
        for name, m in lora.adapters(s.model).items():
            if name in gates:
                m.lora_B.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    ids = torch.arange(5, 25)[None]
    picked: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    for on in (True, False):
        lora.set_enabled(s.model, on)
        fwd = Forward(observer=lambda layer, h, logits, idx, on=on: picked[on].append(idx))
        with torch.no_grad():
            s.model(ids, fwd)
    assert any(not torch.equal(a, b) for a, b in zip(picked[True], picked[False], strict=True))

    lora.set_enabled(s.model, True)
    lora.save(s.model, tmp_path / "r.safetensors", {"model": "tiny", "base_hash": s.base_hash})
    shutil.copytree(model_dir / "e0", tmp_path / "m")
    shutil.copy(tmp_path / "r.safetensors", tmp_path / "m" / modeldir.LORA_FILE)
    engine = load_engine(tmp_path / "m")
    try:
        assert gates <= set(lora.adapters(engine.model))
        served = engine.prefill(engine.new_request(), ids[0].tolist())
    finally:
        engine.close()
    with torch.no_grad():
        want = s.forward(ids, ids.shape[1])[0, -1].float()
    assert served.argmax() == want.argmax()
    assert (served - want).abs().max() < 2e-2 * want.abs().max()
