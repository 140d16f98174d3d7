"""The reference's 8B release (Edge0-8B-A1B-preview), scaled down in its exact layout
(../shared/reference/edge0-reference-inventory.md §1.1, §2.5): a config.json with no
model_type (architectures BailingMoeV3ForCausalLM, auto_map to its own modeling file), one
model.safetensors, experts stacked under `mlp.experts` (not mlx-lm's `switch_mlp`), 8-bit
routers, an in-checkpoint copy of the prerouter under `mlp.pregate`, and its adapter files
(prerouter_edge0_8b.safetensors with explicit owners, lora_edge0_8b.safetensors) carrying the
release's metadata. It must convert by the same command as any MLX directory and decode as
transformers computes on the dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from edge0.cli import main as cli
from edge0.convert import convert
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.sampling import SamplingParams
from edge0.modeldir import Manifest
from edge0.models import bailing_hybrid
from mlx_helpers import hf_to_mlx
from test_families import INT4_LOGIT_TOL, make_checkpoint, served_reference, teacher_forced

HEAD_WIDTH = 32


def release_config(raw: dict) -> dict:
    """The release's config.json: no model_type, resolved by `architectures`."""
    out = {k: v for k, v in raw.items() if k != "model_type"}
    out["architectures"] = ["BailingMoeV3ForCausalLM"]
    out["auto_map"] = {
        "AutoConfig": "configuration_bailing_moe_v3.BailingMoeV3Config",
        "AutoModelForCausalLM": "modeling_bailing_moe_v3.BailingMoeV3ForCausalLM",
    }
    return out


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("edge0-8b")
    hf = make_checkpoint(root / "hf", "bailing_hybrid")
    mlx = hf_to_mlx(hf, root / "Edge0-8B-A1B-preview", root / "equiv", family="bailing_hybrid",
                    stack="experts")  # fmt: skip
    src = root / "Edge0-8B-A1B-preview"
    raw = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(release_config(raw), indent=2))
    cfg = bailing_hybrid.Config.from_dict(raw)
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    owners = moe[:-1]  # as the release: explicit owners, each predicting the next MoE layer
    f_in = cfg.hidden_size + 2 * cfg.num_experts
    g = torch.Generator().manual_seed(3)
    heads = {}
    for o in owners:
        heads[f"layers.{o}.fc1.weight"] = torch.randn(HEAD_WIDTH, f_in, generator=g).half()
        heads[f"layers.{o}.fc2.weight"] = torch.randn(
            cfg.num_experts, HEAD_WIDTH, generator=g
        ).half()
        heads[f"layers.{o}.linear_init.weight"] = torch.randn(
            cfg.num_experts, f_in, generator=g
        ).half()
    meta = {"model": "edge0-10b", "kind": "prerouter", "K": str(cfg.num_experts_per_tok),
            "owners": json.dumps(owners), "source": "/hpc/export/pregate_v7_fp16.npz",
            "format_version": "1"}  # fmt: skip
    save_file(heads, str(src / "prerouter_edge0_8b.safetensors"), metadata=meta)
    # the in-checkpoint copy of those heads, which the reference ignores
    shards = load_file(str(src / "model.safetensors"))
    for o in owners:
        for part in ("fc1", "fc2", "linear_init"):
            shards[f"model.layers.{o}.mlp.pregate.{part}.weight"] = heads[
                f"layers.{o}.{part}.weight"
            ]
    save_file(shards, str(src / "model.safetensors"), metadata={"format": "mlx"})
    lora = {}
    for layer in range(cfg.num_hidden_layers):  # the output projection of every layer
        key = f"model.layers.{layer}.attention.dense"
        n_out, words = shards[f"{key}.weight"].shape  # 4-bit: 8 inputs per u32 word
        lora[f"{key}.lora_A"] = (0.05 * torch.randn(4, words * 8, generator=g)).half()
        lora[f"{key}.lora_B"] = (0.05 * torch.randn(n_out, 4, generator=g)).half()
    meta = {"model": "edge0-10b", "kind": "lora", "r": "4", "alpha": "8", "format_version": "1"}
    save_file(lora, str(src / "lora_edge0_8b.safetensors"), metadata=meta)
    return root, src, mlx, heads, lora, cfg


def test_the_fixture_has_the_release_layout(release):
    _, src, mlx, heads, _, cfg = release
    raw = json.loads((src / "config.json").read_text())
    assert "model_type" not in raw and raw["architectures"] == ["BailingMoeV3ForCausalLM"]
    assert sorted(p.name for p in src.glob("*.safetensors")) == [
        "lora_edge0_8b.safetensors",
        "model.safetensors",
        "prerouter_edge0_8b.safetensors",
    ]
    moe = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    stack = mlx[f"model.layers.{moe}.mlp.experts.gate_proj.weight"]
    assert stack.dtype == torch.uint32 and stack.shape[0] == cfg.num_experts  # [E, out, in/8]
    assert not any("switch_mlp" in k for k in mlx)
    assert mlx[f"model.layers.{moe}.mlp.gate.weight"].shape[-1] == cfg.hidden_size // 4  # 8-bit
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        assert any(".mlp.pregate." in k for k in f.keys())


def test_it_converts_by_the_same_command_and_equals_its_dequantized_floats(release, capsys):
    root, src, *_ = release
    out = root / "edge0"
    assert cli.main(["convert", str(src), str(out), "--quiet", "--resident", "bf16"]) == 0
    convert(root / "equiv", root / "edge0-equiv", progress=False, resident="bf16")
    for name in ("experts.safetensors", "model.safetensors"):
        assert (out / name).read_bytes() == (root / "edge0-equiv" / name).read_bytes(), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BailingMoeV3ForCausalLM"]


def test_its_adapters_are_imported_and_bound(release):
    root, src, _, heads, lora, cfg = release
    out = root / "edge0"
    if not out.is_dir():
        convert_release(src, out)
    with safe_open(str(out / "prerouter.safetensors"), "pt") as f:
        meta = f.metadata()
        for key, t in heads.items():  # the reference's heads, bit for bit
            assert torch.equal(f.get_tensor(key), t), key
    assert json.loads(meta["owners"]) == sorted({int(k.split(".")[1]) for k in heads})
    assert meta["K"] == str(cfg.num_experts_per_tok) and "base_hash" in meta
    with safe_open(str(out / "lora.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(lora) and "base_hash" in f.metadata()


def convert_release(src, out):
    assert cli.main(["convert", str(src), str(out), "--quiet", "--resident", "bf16"]) == 0


def test_it_decodes_as_transformers_on_the_dequantized_weights(release, tmp_path):
    """Exact routing (heads off, LoRA off), teacher-forced: transformers in fp32 on exactly
    the weights edge0 serves (MLX's expert values, the resident weights' bf16 dequantization)
    scores edge0's greedy tokens as its own best, within the int4 kernel's bf16-activation
    tolerance that tests/test_families.py uses."""
    root, *_ = release
    out = root / "edge0"
    if not out.is_dir():
        convert_release(release[1], out)
    hf = served_reference(root / "hf", out, tmp_path / "served")
    prompt = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(7))
    engine = load_engine(out, EngineOptions(no_prerouter=True, no_lora=True))
    got, diffs, shortfall = teacher_forced(engine, hf, prompt, 16)
    assert len(got) == 16
    assert diffs.median() <= INT4_LOGIT_TOL and shortfall.max() <= INT4_LOGIT_TOL


def test_it_serves_with_its_heads_and_lora(release):
    root, *_ = release
    out = root / "edge0"
    if not out.is_dir():
        convert_release(release[1], out)
    engine = load_engine(out, EngineOptions(prerouter_always=True))
    try:
        assert engine.lora_meta["kind"] == "lora" and engine.prerouter is not None
        assert engine.plan.prerouter  # the heads route their owners
        tokens = engine.generate([5, 6, 7, 8], 8, SamplingParams(temperature=0)).drain().tokens
        assert len(tokens) == 8
        assert engine.prerouter.stats.consumed > 0 and engine.prerouter.stats.dropped == 0
    finally:
        engine.close()


def test_heads_metadata_is_checked_against_the_served_model(release, tmp_path):
    import shutil

    root, *_ = release
    out = root / "edge0"
    if not out.is_dir():
        convert_release(release[1], out)
    k = Manifest.load(out).native_top_k
    with pytest.raises(ValueError, match=f"trained to predict K={k} experts, and K={k - 1}"):
        load_engine(out, EngineOptions(top_k=k - 1, prerouter_always=True))
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    path = bad / "prerouter.safetensors"
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {key: f.get_tensor(key) for key in f.keys()}
    save_file(tensors, str(path), metadata=meta | {"owners": "[1]"})
    manifest = Manifest.load(bad)  # (a file rewritten on purpose: record its new checksum)
    manifest.hash_files(bad, [path.name])
    manifest.save(bad)
    with pytest.raises(ValueError, match=r"metadata names owners \[1\]"):
        load_engine(bad, EngineOptions(prerouter_always=True, prerouter_any_base=True))
