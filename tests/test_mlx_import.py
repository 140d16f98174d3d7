"""`edge0 convert --from-mlx`: MLX int4 checkpoints imported without re-quantizing experts.

Contracts: every imported expert weight equals MLX's scale * q + bias exactly; the import is
byte-identical to converting the equivalent full-precision checkpoint (resident weights =
MLX-dequantized values, experts = the floats MLX quantized), so greedy output is the same;
adapter files are carried over under our names; bad input gives an error naming it.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from edge0.convert import convert
from edge0.convert.mlx import candidates, import_mlx
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.sampling import SamplingParams
from edge0.formats.mlx import unpack
from edge0.modeldir import Manifest
from edge0.modeldir.loader import load_edge0_model
from edge0.models import lora as lora_runtime
from edge0.prerouter.head import Prerouter
from edge0.store.expert_file import read_table
from helpers import make_hf_model, tiny_tokenizer
from mlx_helpers import hf_to_mlx, mlx_dequantize, mlx_quantize, read_tensors

QWEN35_TEXT = dict(
    vocab_size=384,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    head_dim=16,
    full_attention_interval=2,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """An MLX qwen3_moe with `language_model.` prefixes in two shards, its equivalent HF
    directory, and both converted."""
    root = tmp_path_factory.mktemp("mlx-qwen3")
    hf = make_hf_model(root / "hf", scale=4.0)
    mlx = hf_to_mlx(hf, root / "mlx", root / "equiv", prefix="language_model.", shards=2)
    import_mlx(root / "mlx", root / "e0_mlx", progress=False)
    # bf16 resident weights: the MLX values dequantized, comparable with the equivalent floats
    import_mlx(root / "mlx", root / "e0_mlx_bf16", progress=False, resident="bf16")
    convert(root / "equiv", root / "e0_equiv", progress=False, resident="bf16")
    return root, mlx


def expert_bytes(path, layer, e):
    table, nbytes, _ = read_table(path / "experts.safetensors")
    with open(path / "experts.safetensors", "rb") as f:
        f.seek(table[layer].offset + e * nbytes)
        return torch.frombuffer(bytearray(f.read(nbytes)), dtype=torch.uint8)


def test_mlx_word_layout_is_lsb_first():
    # one row of 8 nibbles 0..7 and 4 bytes: element j sits at bits 4*(j%8) / 8*(j%4)
    q4 = torch.tensor([[0x76543210]], dtype=torch.int64).to(torch.uint32)
    assert unpack(q4, 4).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    q8 = torch.tensor([[0xFF800102]], dtype=torch.int64).to(torch.uint32)
    assert unpack(q8, 8).tolist() == [[2, 1, 128, 255]]
    w = torch.randn(4, 128, generator=torch.Generator().manual_seed(0))
    for bits in (4, 8):
        packed, s, b = mlx_quantize(w, bits)
        assert packed.shape == (4, 128 * bits // 32) and s.shape == (4, 2)
        err = (mlx_dequantize(packed, s, b, bits) - w).abs().max()
        # half a step of rounding plus bf16 rounding of scale and bias: under two steps
        assert err <= 2 * (w.max() - w.min()) / (2**bits - 1)


def test_unpacking_in_steps_equals_unpacking_at_once(monkeypatch):
    """Large tensors are unpacked a bounded number of words at a time; the steps' boundaries
    (here every 7 words, mid-row and across a leading axis) change nothing."""
    from edge0.formats import mlx as formats_mlx

    words = torch.randint(0, 2**32, (3, 37, 5), generator=torch.Generator().manual_seed(1))
    packed = words.to(torch.uint32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    want = ((words[..., None] >> shifts) & 15).reshape(3, 37, 40).to(torch.uint8)
    assert torch.equal(unpack(packed, 4), want)
    monkeypatch.setattr(formats_mlx, "_UNPACK_WORDS", 7)
    assert torch.equal(unpack(packed, 4), want)


def test_imported_experts_equal_the_mlx_formula_exactly(qwen3):
    root, mlx = qwen3
    manifest = Manifest.load(root / "e0_mlx")
    layout = manifest.layout()
    assert manifest.source["format"] == "mlx"
    for layer in range(3):
        base = f"language_model.model.layers.{layer}.mlp.switch_mlp"
        want = {
            p: mlx_dequantize(
                mlx[f"{base}.{p}.weight"], mlx[f"{base}.{p}.scales"], mlx[f"{base}.{p}.biases"], 4
            )
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        for e in range(8):
            w13, w2 = layout.dequantize_stored(expert_bytes(root / "e0_mlx", layer, e))
            assert torch.equal(w13, torch.cat([want["gate_proj"][e], want["up_proj"][e]]))
            assert torch.equal(w2, want["down_proj"][e])


def test_resident_weights_are_the_dequantized_mlx_values(qwen3):
    root, mlx = qwen3
    got = read_tensors(root / "e0_mlx" / "model.safetensors")
    assert "lm_head.weight" in got and "model.embed_tokens.weight" in got  # prefix stripped
    m = "language_model.model.layers.1.mlp.gate"  # an 8-bit router
    assert mlx[f"{m}.weight"].shape == (8, 64 // 4)
    want = mlx_dequantize(mlx[f"{m}.weight"], mlx[f"{m}.scales"], mlx[f"{m}.biases"], 8)
    assert torch.equal(got["model.layers.1.mlp.gate.weight"], want.to(torch.bfloat16))
    config = json.loads((root / "e0_mlx" / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config


def test_import_is_byte_identical_to_converting_the_equivalent_floats(qwen3):
    root, _ = qwen3
    for name in ("experts.safetensors", "model.safetensors"):
        a = (root / "e0_mlx_bf16" / name).read_bytes()
        b = (root / "e0_equiv" / name).read_bytes()
        assert a == b, name


def test_int4_resident_weights_keep_the_mlx_values_bit_for_bit(qwen3):
    root, mlx = qwen3
    ours = read_tensors(root / "e0_mlx" / "model.safetensors")
    kept = [k for k in ours if k.endswith(".scales")]
    assert kept  # attention and embeddings are int4 (the 8-bit routers are dequantized)
    for key in kept:
        module = key.removesuffix(".scales")
        for part in ("weight", "scales", "biases"):
            theirs = mlx[f"language_model.{module}.{part}"]
            assert torch.equal(ours[f"{module}.{part}"], theirs), f"{module}.{part}"
    assert not any(k.endswith("mlp.gate.scales") for k in ours)


def greedy(path, prompt):
    """(KV in fp32: the two conversions' arithmetic is compared, not the cache's rounding.)"""
    engine = load_engine(path, EngineOptions(io_mode="buffered", kv_dtype=torch.float32))
    try:
        return engine.generate(prompt, 16, SamplingParams(temperature=0)).drain().tokens
    finally:
        engine.close()


@pytest.mark.slow
def test_greedy_output_matches_the_full_precision_conversion(qwen3):
    root, _ = qwen3
    prompt = torch.randint(0, 384, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    got = greedy(root / "e0_mlx", prompt)
    assert len(got) == 16
    assert got == greedy(root / "e0_equiv", prompt)


@pytest.mark.slow
def test_qwen3_5_moe_hybrid_round_trip(tmp_path):
    """The 35B tier's family: `language_model.model.` nesting, shared expert, linear attention
    (conv1d stored [C, W, 1]) and zero-centred norms stored as 1 + w."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5MoeTextConfig(**QWEN35_TEXT)
    model = transformers.Qwen3_5MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(4.0)
            elif name.endswith("norm.weight"):  # make the 1 + w shift visible
                p.uniform_(-0.3, 0.3)
    model.save_pretrained(str(tmp_path / "hf"))
    tiny_tokenizer(tmp_path / "hf")
    mlx = hf_to_mlx(tmp_path / "hf", tmp_path / "mlx", tmp_path / "equiv", family="qwen3_5_moe")
    assert mlx["language_model.model.layers.0.linear_attn.conv1d.weight"].shape[-1] == 1
    assert mlx["language_model.model.layers.1.mlp.shared_expert_gate.weight"].dtype == (
        torch.uint32
    )
    # bf16 resident weights: the MLX values dequantized, comparable with the equivalent floats
    import_mlx(tmp_path / "mlx", tmp_path / "e0_mlx", progress=False, resident="bf16")
    convert(tmp_path / "equiv", tmp_path / "e0_equiv", progress=False, resident="bf16")
    for name in ("experts.safetensors", "model.safetensors"):
        assert (tmp_path / "e0_mlx" / name).read_bytes() == (
            tmp_path / "e0_equiv" / name
        ).read_bytes(), name
    got = read_tensors(tmp_path / "e0_mlx" / "model.safetensors")
    norm = got["model.language_model.layers.0.input_layernorm.weight"]
    assert norm.abs().max() < 0.5  # stored w, not 1 + w
    prompt = torch.randint(0, 384, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    assert greedy(tmp_path / "e0_mlx", prompt) == greedy(tmp_path / "e0_equiv", prompt)


# -- adapters ----------------------------------------------------------------------------------


def write_adapters(mlx_dir, hidden=64, experts=8, width=32):
    f_in = hidden + 2 * experts
    g = torch.Generator().manual_seed(5)
    heads = {}
    for owner in (0, 1):
        heads[f"layers.{owner}.fc1.weight"] = torch.randn(width, f_in, generator=g).half()
        heads[f"layers.{owner}.fc2.weight"] = torch.randn(experts, width, generator=g).half()
        heads[f"layers.{owner}.linear_init.weight"] = torch.randn(experts, f_in, generator=g).half()
    meta = {"model": "tiny", "kind": "prerouter", "K": "2", "owners": "[0, 1]", "source": "x"}
    save_file(heads, str(mlx_dir / "prerouter_tiny.safetensors"), metadata=meta)
    lora = {}
    for layer in range(3):
        for proj, (n_out, n_in) in {"q_proj": (64, 64), "k_proj": (32, 64)}.items():
            key = f"language_model.model.layers.{layer}.self_attn.{proj}"
            lora[f"{key}.lora_A"] = torch.randn(4, n_in, generator=g).half()
            lora[f"{key}.lora_B"] = torch.randn(n_out, 4, generator=g).half()
    meta = {"model": "tiny", "kind": "lora", "r": "4", "alpha": "8"}
    save_file(lora, str(mlx_dir / "lora_tiny.safetensors"), metadata=meta)
    return heads, lora


def test_adapters_are_imported_under_our_names(qwen3, tmp_path):
    root, _ = qwen3
    mlx_dir = tmp_path / "mlx"
    mlx_dir.mkdir()
    for f in (root / "mlx").iterdir():
        (mlx_dir / f.name).write_bytes(f.read_bytes())
    heads, lora = write_adapters(mlx_dir)
    import_mlx(mlx_dir, tmp_path / "e0", progress=False)
    got = read_tensors(tmp_path / "e0" / "prerouter.safetensors")
    assert got.keys() == heads.keys()
    assert all(torch.equal(got[k], heads[k]) for k in heads)
    with safe_open(str(tmp_path / "e0" / "prerouter.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["model"] == "tiny" and meta["K"] == "2" and meta["kind"] == "prerouter"
    assert meta["imported_from"] == "prerouter_tiny.safetensors" and len(meta["imported_sha256"])
    got = read_tensors(tmp_path / "e0" / "lora.safetensors")
    for key, value in lora.items():
        assert torch.equal(got[key.removeprefix("language_model.")], value)
    # the runtime loaders accept the imported files
    _, model = load_edge0_model(tmp_path / "e0")
    assert len(lora_runtime.load(model, tmp_path / "e0" / "lora.safetensors")) > 0
    assert len(lora_runtime.adapters(model)) == 6
    pre, _ = Prerouter.load(tmp_path / "e0" / "prerouter.safetensors", 64, 8, [0, 1, 2])
    assert sorted(pre.heads) == ["0", "1"]
    manifest = Manifest.load(tmp_path / "e0")
    assert {"prerouter.safetensors", "lora.safetensors"} <= manifest.files.keys()
    # imported beside the checkpoint they were trained on, they are bound to it, as edge0's
    # own adapters are: another base refuses them
    for name in ("prerouter.safetensors", "lora.safetensors"):
        with safe_open(str(tmp_path / "e0" / name), "pt") as f:
            assert f.metadata()["base_hash"] == manifest.base_hash(), name
    # the shards are still the only weights: adapters are not mistaken for model tensors
    assert (tmp_path / "e0" / "model.safetensors").read_bytes() == (
        root / "e0_mlx" / "model.safetensors"
    ).read_bytes()


# -- errors ------------------------------------------------------------------------------------


@pytest.fixture()
def mlx_copy(qwen3, tmp_path):
    root, _ = qwen3
    dst = tmp_path / "mlx"
    dst.mkdir()
    for f in (root / "mlx").iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def edit_shards(path, fn):
    """Apply fn(dict) to every shard's tensors and rewrite shards + index."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = fn(read_tensors(path / shard))
        save_file(tensors, str(path / shard))
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
        index["weight_map"].update(dict.fromkeys(tensors, shard))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_expert_stack_is_named(mlx_copy, tmp_path):
    gone = "language_model.model.layers.2.mlp.switch_mlp.up_proj"
    edit_shards(mlx_copy, lambda t: {k: v for k, v in t.items() if not k.startswith(gone)})
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.switch_mlp\.up_proj\.weight"):
        import_mlx(mlx_copy, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_resident_tensor_is_named(mlx_copy, tmp_path):
    gone = "language_model.model.layers.0.self_attn.k_norm.weight"
    edit_shards(mlx_copy, lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_norm\.weight"):
        import_mlx(mlx_copy, tmp_path / "out", progress=False)


def test_vision_and_mtp_tensors_are_skipped(mlx_copy, tmp_path):
    extra = {
        "vision_tower.blocks.0.attn.qkv.weight": torch.zeros(96, 3, dtype=torch.uint32),
        "vision_tower.blocks.0.attn.qkv.scales": torch.zeros(96, 1, dtype=torch.bfloat16),
        "vision_tower.blocks.0.attn.qkv.biases": torch.zeros(96, 1, dtype=torch.bfloat16),
        "mtp.fc.weight": torch.zeros(64, 128),
    }
    edit_shards(mlx_copy, lambda t: {**t, **extra} if "lm_head" in str(t.keys()) else t)
    import_mlx(mlx_copy, tmp_path / "out", progress=False)
    assert Manifest.load(tmp_path / "out").source["skipped_tensors"] == 4


def test_quantization_that_does_not_describe_the_file(mlx_copy, tmp_path):
    config = json.loads((mlx_copy / "config.json").read_text())
    del config["quantization"]["language_model.model.layers.1.mlp.gate"]  # says 4-bit now
    del config["quantization_config"]
    (mlx_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate\.weight packs 16 words"):
        import_mlx(mlx_copy, tmp_path / "out", progress=False)


def test_not_an_mlx_checkpoint(qwen3, tmp_path):
    root, _ = qwen3
    with pytest.raises(ValueError, match="no MLX `quantization` block"):
        import_mlx(root / "equiv", tmp_path / "out", progress=False)


def test_unsupported_family_is_named(mlx_copy, tmp_path):
    config = json.loads((mlx_copy / "config.json").read_text())
    (mlx_copy / "config.json").write_text(json.dumps(dict(config, model_type="gpt_oss")))
    with pytest.raises(ValueError, match="model_type 'gpt_oss' is not supported"):
        import_mlx(mlx_copy, tmp_path / "out", progress=False)


def test_bad_adapters_are_named(mlx_copy, tmp_path):
    heads, lora = write_adapters(mlx_copy)
    heads["layers.1.fc2.weight"] = heads["layers.1.fc2.weight"][:, :8].contiguous()
    save_file(heads, str(mlx_copy / "prerouter_tiny.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.fc2\.weight has shape \(8, 8\)"):
        import_mlx(mlx_copy, tmp_path / "out", progress=False)
    write_adapters(mlx_copy)
    lora["language_model.model.layers.0.mlp.gate.lora_A"] = torch.zeros(4, 64).half()
    lora["language_model.model.layers.0.mlp.gate.lora_B"] = torch.zeros(8, 4).half()
    save_file(lora, str(mlx_copy / "lora_tiny.safetensors"))
    with pytest.raises(ValueError, match=r"mlp\.gate.* is not one this family serves"):
        import_mlx(mlx_copy, tmp_path / "out", progress=False)
    del lora["language_model.model.layers.0.mlp.gate.lora_A"]
    del lora["language_model.model.layers.0.mlp.gate.lora_B"]
    save_file(lora, str(mlx_copy / "lora_tiny.safetensors"), metadata={"r": "4"})
    with pytest.raises(ValueError, match="lacks 'alpha'"):
        import_mlx(mlx_copy, tmp_path / "out", progress=False)
    save_file(lora, str(mlx_copy / "lora_other.safetensors"))
    with pytest.raises(ValueError, match="2 lora files"):
        import_mlx(mlx_copy, tmp_path / "out", progress=False)


def test_name_candidates():
    assert candidates("language_model.model.layers.0.mlp.gate.weight") == [
        "language_model.model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.gate.weight",
        "model.language_model.layers.0.mlp.gate.weight",
    ]
    assert candidates("language_model.lm_head.weight")[1] == "lm_head.weight"
    assert candidates("model.language_model.norm.weight")[1] == "model.norm.weight"


def test_convert_detects_mlx_from_the_files(qwen3, tmp_path):
    """`edge0 convert MLX_DIR OUT` without --from-mlx imports it as --from-mlx does (the flag
    is an override only): the same expert bytes."""
    from edge0.cli import main as cli

    root, _ = qwen3
    out = tmp_path / "auto"
    argv = ["convert", str(root / "mlx"), str(out), "--quiet", "--resident", "bf16"]
    assert cli.main(argv) == 0
    for name in ("experts.safetensors", "model.safetensors"):
        assert (out / name).read_bytes() == (root / "e0_mlx_bf16" / name).read_bytes(), name
