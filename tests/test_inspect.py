"""`edge0 inspect`: parameter, byte and memory arithmetic from safetensors headers alone.

The 35B tier is rebuilt as header-only shards (real shapes, sparse data region) and must
reproduce the audit's counts exactly; small HF / MLX / edge0 directories of one model must
agree with each other, with transformers' parameter count, and with the engine's budget.
"""

from __future__ import annotations

import argparse
import json
import os
import struct

import pytest
import torch
import transformers

from edge0 import builtin
from edge0.cli.inspect import format_report, inspect_dir
from edge0.cli.inspect_headers import kind_of
from edge0.cli.main import add_inspect_parser
from edge0.convert import convert
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.formats.extents import ExtentLayout
from edge0.util import memory
from helpers import make_hf_model
from mlx_helpers import hf_to_mlx

# The 35B tier, from the audit and the reference inventory: 40 layers, 30 gated-DeltaNet and
# 10 gated-attention (full_attention_interval 4); hidden 2048 (the prerouter's fc1 input is
# 2048 + 2 * 256 = 2560); 256 experts of width 512 plus one shared expert of width 512; native
# K=8; untied lm_head; MLX affine 4-bit group 64 with the 80 router gates (mlp.gate,
# shared_expert_gate) at 8 bits; 1,757 tensors in four shards, all under `language_model.`.
# Widths the audit does not print are the base model's config.json (Qwen3.5/3.6-35B-A3B).
TEXT_35B = dict(
    vocab_size=248320,
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    full_attention_interval=4,
)
ITEMSIZE = {"U32": 4, "BF16": 2, "F16": 2, "F32": 4, "U8": 1}


def mlx_linear(name, out, inp, bits=4):
    return [
        (f"{name}.weight", "U32", [out, inp * bits // 32]),
        (f"{name}.scales", "BF16", [out, inp // 64]),
        (f"{name}.biases", "BF16", [out, inp // 64]),
    ]


def layer_35b(i: int, linear, vector, experts) -> list:
    """One decoder layer's tensors; `linear(name, out, in, bits)` writes a projection."""
    c = TEXT_35B
    d, e, w = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    vd = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    hv = c["linear_num_value_heads"]
    out = vector(f"{i}.input_layernorm.weight", d) + vector(
        f"{i}.post_attention_layernorm.weight", d
    )
    if (i + 1) % c["full_attention_interval"]:
        a = f"{i}.linear_attn"
        out += linear(f"{a}.in_proj_qkv", 2 * kd + vd, d) + linear(f"{a}.in_proj_z", vd, d)
        out += linear(f"{a}.in_proj_b", hv, d) + linear(f"{a}.in_proj_a", hv, d)
        out += linear(f"{a}.out_proj", d, vd)
        out += [("conv", f"{a}.conv1d.weight", 2 * kd + vd, c["linear_conv_kernel_dim"])]
        out += vector(f"{a}.A_log", hv) + vector(f"{a}.dt_bias", hv)
        out += vector(f"{a}.norm.weight", c["linear_value_head_dim"])
    else:
        a, hd = f"{i}.self_attn", c["head_dim"]
        h, g = c["num_attention_heads"], c["num_key_value_heads"]
        out += linear(f"{a}.q_proj", 2 * h * hd, d) + linear(f"{a}.k_proj", g * hd, d)
        out += linear(f"{a}.v_proj", g * hd, d) + linear(f"{a}.o_proj", d, h * hd)
        out += vector(f"{a}.q_norm.weight", hd) + vector(f"{a}.k_norm.weight", hd)
    m, s = f"{i}.mlp", c["shared_expert_intermediate_size"]
    out += linear(f"{m}.gate", e, d, 8) + linear(f"{m}.shared_expert_gate", 1, d, 8)
    out += linear(f"{m}.shared_expert.gate_proj", s, d) + linear(f"{m}.shared_expert.up_proj", s, d)
    out += linear(f"{m}.shared_expert.down_proj", d, s)
    return out + experts(m, e, w, d)


def tensors_35b_mlx() -> tuple[list[list], dict]:
    """Four shards of (name, dtype, shape) in the released MLX layout, and the quantization."""
    pre = "language_model.model.layers."
    quant = {"group_size": 64, "bits": 4, "mode": "affine"}

    def linear(name, out, inp, bits=4):
        if bits != 4:
            quant[pre + name] = {"group_size": 64, "bits": bits}
        return mlx_linear(pre + name, out, inp, bits)

    def vector(name, n):
        return [(pre + name, "BF16", [n])]

    def experts(m, e, w, d):
        out = []
        for proj, (o, i) in {"gate_proj": (w, d), "up_proj": (w, d), "down_proj": (d, w)}.items():
            for part, dtype, last in (("weight", "U32", i // 8), ("scales", "BF16", i // 64)):
                out.append((f"{pre}{m}.switch_mlp.{proj}.{part}", dtype, [e, o, last]))
            out.append((f"{pre}{m}.switch_mlp.{proj}.biases", "BF16", [e, o, i // 64]))
        return out

    shards = [[] for _ in range(4)]
    for i in range(40):
        for t in layer_35b(i, linear, vector, experts):
            if t[0] == "conv":  # MLX stores the depthwise conv [C, W, 1]
                t = (pre + t[1], "BF16", [t[2], t[3], 1])
            shards[i // 10].append(t)
    v, d = TEXT_35B["vocab_size"], TEXT_35B["hidden_size"]
    shards[0] = mlx_linear("language_model.model.embed_tokens", v, d) + shards[0]
    shards[3] += [("language_model.model.norm.weight", "BF16", [d])]
    shards[3] += mlx_linear("language_model.lm_head", v, d)
    return shards, quant


def tensors_35b_hf() -> list[list]:
    """The same model as a bf16 Hugging Face checkpoint (fused experts), plus a vision tower."""
    pre = "model.language_model.layers."

    def linear(name, out, inp, bits=4):
        return [(pre + name + ".weight", "BF16", [out, inp])]

    def vector(name, n):
        return [(pre + name, "BF16", [n])]

    def experts(m, e, w, d):
        return [
            (f"{pre}{m}.experts.gate_up_proj", "BF16", [e, 2 * w, d]),
            (f"{pre}{m}.experts.down_proj", "BF16", [e, d, w]),
        ]

    out = []
    for i in range(40):
        for t in layer_35b(i, linear, vector, experts):
            out.append((pre + t[1], "BF16", [t[2], 1, t[3]]) if t[0] == "conv" else t)
    v, d = TEXT_35B["vocab_size"], TEXT_35B["hidden_size"]
    out += [
        ("model.language_model.embed_tokens.weight", "BF16", [v, d]),
        ("model.language_model.norm.weight", "BF16", [d]),
        ("lm_head.weight", "BF16", [v, d]),
        ("model.visual.patch_embed.proj.weight", "BF16", [1152, 3, 2, 16, 16]),
        ("model.visual.merger.linear_fc2.weight", "BF16", [2048, 4608]),
    ]
    return [out]


def write_header_only(path, specs, metadata=None) -> int:
    """A safetensors file with the real header and a sparse (never written) data region."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape in specs:
        n = ITEMSIZE[dtype]
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
    os.truncate(path, 8 + len(text) + offset)
    return offset


def write_checkpoint(path, shards, config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for i, specs in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_header_only(path / name, specs, {"format": "mlx"})
        weight_map.update({s[0]: name for s in specs})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def write_adapters_35b(path):
    d, e = TEXT_35B["hidden_size"], TEXT_35B["num_experts"]
    heads = []
    for owner in range(6, 39):  # 33 heads, owners 6..38
        heads += [
            (f"layers.{owner}.fc1.weight", "F16", [512, d + 2 * e]),
            (f"layers.{owner}.fc2.weight", "F16", [e, 512]),
            (f"layers.{owner}.linear_init.weight", "F16", [e, d + 2 * e]),
        ]
    meta = {"model": "edge0-35b", "kind": "prerouter", "K": "4", "owners": "[6]"}
    write_header_only(path / "prerouter_edge0_35b.safetensors", heads, meta)

    lora = []

    def linear(name, out, inp, bits=4):
        if "mlp.gate" in name or "shared_expert_gate" in name:
            return []
        key = f"language_model.model.layers.{name}"
        return [(f"{key}.lora_A", "F16", [16, inp]), (f"{key}.lora_B", "F16", [out, 16])]

    for i in range(40):
        lora += layer_35b(i, linear, lambda *a: [], lambda *a: [])
    lora = [t for t in lora if t[0] != "conv"]
    meta = {"model": "edge0-35b", "kind": "lora", "r": "16", "alpha": "32"}
    write_header_only(path / "lora_edge0_35b.safetensors", lora, meta)
    return len(lora) // 2


@pytest.fixture(scope="module")
def mlx_35b(tmp_path_factory):
    path = tmp_path_factory.mktemp("35b") / "edge0-35b"
    shards, quant = tensors_35b_mlx()
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": dict(TEXT_35B, model_type="qwen3_5_moe_text"),
        "vision_config": {"depth": 27, "hidden_size": 1152, "patch_size": 16},
        "tie_word_embeddings": False,
        "quantization": quant,
        "quantization_config": quant,
    }
    write_checkpoint(path, shards, config)
    targets = write_adapters_35b(path)
    return path, shards, quant, targets


def test_35b_fixture_matches_the_audits_inventory(mlx_35b):
    path, shards, quant, targets = mlx_35b
    assert sum(len(s) for s in shards) == 1757  # "1,757 tensors across four shards"
    assert sum(t[0].endswith(".scales") for s in shards for t in s) == 512  # quantized tensors
    assert len(quant) - 3 == 80  # "the 80 router gates it promotes to 8-bit"
    assert targets == 310  # LoRA targets on the 35B tier (reference inventory)
    # the data region is never written: apparent size 19.5 GB, (almost) nothing on disk
    total = sum(p.stat().st_size for p in path.glob("model-*.safetensors"))
    assert total > 19e9 and sum(p.stat().st_blocks for p in path.iterdir()) * 512 < 50e6


@pytest.mark.slow
def test_35b_reproduces_the_audit(mlx_35b):
    path, *_ = mlx_35b
    r = inspect_dir(path, top_k=4, memory_budget=memory.parse_size("6G"), dtype=torch.bfloat16)
    print(format_report(r))
    assert r.format == "mlx" and r.tensors == 1757 and r.files == 4
    assert r.total.params == 34_660_610_688  # the audit and the Hub
    assert r.active["served"] == {"k": 4, "params": 2_443_115_136}
    assert r.active["native"] == {"k": 8, "params": 2_946_431_616}
    assert r.total.bytes == 19_508_787_456  # "the four weight shards total 19,508,787,456"
    assert round(100 * r.routed_experts.params / r.total.params, 1) == 92.9
    assert round(100 * r.routed_experts.bytes / r.total.bytes, 1) == 92.9
    assert r.per_expert["stored_bytes"] == 1_769_472  # "1.77 MB for each of its 256 experts"
    assert 256 * r.per_expert["stored_bytes"] == 452_984_832  # "453 MB ... per layer"
    assert r.per_expert["extent_bytes"] == ExtentLayout(2048, 512).nbytes
    assert r.adapters["prerouter"].params == 69_206_016  # 33 heads x 2,097,152
    assert r.adapters["prerouter"].bytes == 138_412_032
    gib = 2**30
    floor = r.stored_floor
    assert round(floor["resident_bytes"] / gib, 2) == 1.29
    assert round(floor["with_adapters_bytes"] / gib, 2) == 1.46
    assert round(floor["plus_one_decode_step_bytes"] / gib, 2) == 1.73
    assert round((floor["with_adapters_bytes"] + 16 * 1_769_472) / gib, 2) == 1.49  # hot window 4
    # the floor's parts add up, and the vision config claims tensors the release lacks
    assert sum(c.params for c in r.resident.values()) == r.resident_total.params
    assert r.resident["embeddings"].params == r.resident["lm_head"].params == 248320 * 2048
    assert r.resident["routers"].params == 40 * (256 + 1) * 2048
    assert r.unused.tensors == 0
    m = r.memory
    f = m["floor"]
    assert m["state_source"].startswith("qwen3_5_moe")
    assert f["total"] == f["weights"] + f["adapter"] + f["heads"] + f["state"] + f["prefix_cache"]
    assert m["fits"] and m["predicted_peak_bytes"] == m["peak_bytes"]
    assert m["peak_bytes"] == m["runtime"] + m["workspace"] + f["total"] + m["pool_bytes"]
    assert m["total_bytes"] <= memory.parse_size("6G")  # floor + pool, as the budget counts
    # the release's 4-bit weights stay int4 (codes and a pair per group of 64), the rest
    # (norms, 8-bit routers, conv kernels) is held at the compute dtype, bf16 here
    int4 = [t for t in (r.resident["attention"], r.resident["embeddings"])]
    assert f["weights"] < 0.35 * 2 * r.resident_total.params  # far below a bf16 floor
    assert all(c.params for c in int4)
    assert f["heads"] == 2 * r.adapters["prerouter"].params  # stacked at the compute dtype, bf16
    # the reference's floor: 1.29 GiB of weights + 0.17 GiB of adapters = 1.46 GiB
    weights_and_adapters = f["weights"] + f["adapter"] + f["heads"]
    assert abs(weights_and_adapters / (1.46 * gib) - 1) <= 0.10


def test_35b_as_hugging_face_bf16_counts_the_same(tmp_path):
    config = dict(TEXT_35B, model_type="qwen3_5_moe_text", tie_word_embeddings=False)
    write_checkpoint(tmp_path / "hf", tensors_35b_hf(), config)
    r = inspect_dir(tmp_path / "hf", top_k=4)
    assert r.format == "hf"
    assert r.total.params == 34_660_610_688 and r.total.bytes == 2 * 34_660_610_688
    assert r.active["served"]["params"] == 2_443_115_136
    assert r.unused.tensors == 2  # the vision tower is reported apart, not counted
    assert r.per_expert["extent_bytes"] == ExtentLayout(2048, 512).nbytes


def tensors_30b_class_hf(layers=32, d=2048, heads=16, kv=4, hd=128, e=128, inter=768, v=8192):
    """The 30B-class bench shape of docs/prerouter.md as a bf16 Hugging Face Qwen3-MoE."""
    specs = [
        ("model.embed_tokens.weight", "BF16", [v, d]),
        ("model.norm.weight", "BF16", [d]),
        ("lm_head.weight", "BF16", [v, d]),
    ]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", "BF16", [d]),
            (p + "post_attention_layernorm.weight", "BF16", [d]),
            (p + "self_attn.q_proj.weight", "BF16", [heads * hd, d]),
            (p + "self_attn.k_proj.weight", "BF16", [kv * hd, d]),
            (p + "self_attn.v_proj.weight", "BF16", [kv * hd, d]),
            (p + "self_attn.o_proj.weight", "BF16", [d, heads * hd]),
            (p + "self_attn.q_norm.weight", "BF16", [hd]),
            (p + "self_attn.k_norm.weight", "BF16", [hd]),
            (p + "mlp.gate.weight", "BF16", [e, d]),
        ]
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            specs += [
                (q + "gate_proj.weight", "BF16", [inter, d]),
                (q + "up_proj.weight", "BF16", [inter, d]),
                (q + "down_proj.weight", "BF16", [d, inter]),
            ]
    config = {
        "model_type": "qwen3_moe",
        "hidden_size": d,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "num_experts": e,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": inter,
        "intermediate_size": 6144,
        "vocab_size": v,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    return specs, config


def test_30b_class_floor_in_int4_is_over_5x_below_fp32(tmp_path):
    """The 30B-class shape's resident floor was 1.41 GiB held in fp32; `convert` now stores its
    projections and embeddings as int4, which the engine holds packed (the plan's count, which
    test_inspect_predicts_the_engines_allocation ties to the engine): 230.5 MiB, 6.3x less."""
    specs, config = tensors_30b_class_hf()
    write_checkpoint(tmp_path / "hf", [specs], config)
    r = inspect_dir(tmp_path / "hf", top_k=4, memory_budget=memory.parse_size("3.3G"))
    fp32 = 4 * r.resident_total.params
    assert round(fp32 / 2**30, 2) == 1.41  # docs/prerouter.md's floor for this shape
    weights = r.memory["floor"]["weights"]
    assert round(weights / 2**20, 1) == 230.5
    assert fp32 / weights > 5


def test_35b_fits_the_references_3gib_and_a_smaller_budget_says_so(mlx_35b):
    """With int4 resident weights the 35B tier's floor (1.62 GiB at bf16) leaves the reference's
    3 GiB room for a pool; 1.5 GiB does not hold it, and the note names the missing bytes."""
    path, *_ = mlx_35b
    r = inspect_dir(path, top_k=4, memory_budget=memory.parse_size("3G"), dtype=torch.bfloat16)
    # the budget holds the floor and the pool (the whole process adds its runtime)
    assert r.memory["fits"] and r.memory["total_bytes"] <= memory.parse_size("3G")
    assert r.memory["pool_slots"] >= r.memory["staging_slots"] == 160
    r = inspect_dir(path, top_k=4, memory_budget=memory.parse_size("1.5G"), dtype=torch.bfloat16)
    assert r.memory["fits"] is False and r.memory["predicted_peak_bytes"] is None
    assert "below the resident floor" in r.memory["note"] and "more needed" in r.memory["note"]
    assert "does not fit" in format_report(r)


# -- small HF / MLX / edge0 directories of one model ----------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect-tiny")
    hf = make_hf_model(root / "hf", scale=4.0)
    hf_to_mlx(hf, root / "mlx", root / "equiv", prefix="language_model.")
    convert(hf, root / "e0", progress=False)
    return root


def test_three_formats_agree_with_transformers(tiny):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny / "hf"))
    n_total = sum(p.numel() for p in model.parameters())
    d, i, e, layers, k = 64, 64, 8, 3, 2
    experts = layers * e * 3 * d * i
    active = n_total - experts - 384 * d + d  # one embedding row per token
    reports = {f: inspect_dir(tiny / f, top_k=1) for f in ("hf", "mlx", "e0")}
    assert {f: r.format for f, r in reports.items()} == {"hf": "hf", "mlx": "mlx", "e0": "edge0"}
    for r in reports.values():
        assert r.total.params == n_total
        assert r.routed_experts.params == experts
        assert r.active["native"] == {"k": k, "params": active + k * layers * 3 * d * i}
        assert r.active["served"] == {"k": 1, "params": active + layers * 3 * d * i}
        assert r.per_expert["extent_bytes"] == ExtentLayout(d, i).nbytes
        assert (r.moe_layers, r.experts_per_layer, r.native_top_k) == (layers, e, k)
    assert reports["e0"].routed_experts.bytes == layers * e * ExtentLayout(d, i).nbytes
    assert reports["hf"].total.bytes == 4 * n_total  # fp32 checkpoint
    assert reports["mlx"].total.bytes < reports["e0"].total.bytes < reports["hf"].total.bytes


def measured_allocation(engine) -> dict[str, int]:
    """What a loaded engine holds, counted from its tensors: weights (LoRA included), stacked
    heads, one request's state, and the pool."""
    model = engine.model
    tensors = list(model.parameters()) + list(model.buffers())
    rt = engine.prerouter
    heads = (rt.heads if rt.native is None else rt.native) if rt else None
    with engine.new_request() as req:
        state = req.cache.nbytes()
    return {
        "weights+adapter": sum(t.numel() * t.element_size() for t in tensors),
        "heads": heads.nbytes if heads else 0,
        "state": state,
        "pool": engine.pool.capacity_bytes,
    }


@pytest.mark.parametrize("active", [1, 3])
@pytest.mark.parametrize("which", ["tiny", "builtin"])
def test_inspect_predicts_the_engines_allocation(tiny, which, active):
    """inspect's plan (headers only) against the bytes a loaded engine holds, on a model
    without adapters and on the built-in model (prerouter heads and LoRA); serving one request,
    and three at once with a prefix cache ("auto": one request's state)."""
    path = tiny / "e0" if which == "tiny" else builtin.model_dir()
    budget = memory.parse_size("3M" if which == "tiny" else "64M")
    prefix = 0 if active == 1 else None
    # the built-in model's heads, although its pool holds every expert at this budget
    always = which == "builtin"
    r = inspect_dir(
        path,
        memory_budget=budget,
        max_context=256,
        max_active=active,
        prefix_cache=prefix,
        prerouter_always=always,
    )
    opts = EngineOptions(
        memory_budget=budget,
        max_context=256,
        io_mode="buffered",
        max_active=active,
        prefix_cache=prefix,
        prerouter_always=always,
    )
    engine = load_engine(path, opts)
    try:
        got = measured_allocation(engine)
        f = r.memory["floor"]
        assert r.memory["top_k"] == engine.top_k
        assert f["weights"] + f["adapter"] == got["weights+adapter"]
        assert f["heads"] == got["heads"] and f["state"] == active * got["state"]
        assert f["prefix_cache"] == (0 if prefix == 0 else got["state"])
        assert r.memory["pool_bytes"] == got["pool"]
        assert planned(r.memory) == planned(engine.plan.as_dict()) | {
            "fits": True,
            "state_source": r.memory["state_source"],
            "state_by_context": r.memory["state_by_context"],
        }
        if which == "builtin":
            assert f["adapter"] > 0 and f["heads"] > 0 and r.memory["staging_slots"] > 0
            # each active request keeps its staged sets pinned between its turns
            one = inspect_dir(
                path, memory_budget=budget, max_context=256, prerouter_always=True
            ).memory
            assert r.memory["staging_slots"] == active * one["staging_slots"]
            # the pool can hold every pin at once (at most every expert: pins share slots)
            every = r.memory["pool_slots"] == engine.config.num_experts * len(engine.moe_layers)
            assert every or r.memory["pool_slots"] >= r.memory["staging_slots"]
    finally:
        engine.close()


def planned(memory_report: dict) -> dict:
    """A plan's numbers without those measured of the process that made it (its runtime, the
    limit it ran under, and the peak that adds the runtime): equal between inspect and the
    engine, which measure at different moments."""
    skip = ("runtime", "limit", "peak_bytes", "predicted_peak_bytes")
    return {k: v for k, v in memory_report.items() if k not in skip}


def test_a_pool_of_every_expert_serves_no_prerouter_unless_asked():
    """Where the pool holds every expert nothing is read ahead: the plan leaves the heads out
    (no bytes, no staging, each layer's router routes) and the engine loads none; a pool of
    some of them, or prerouter_always, serves them. inspect predicts each case."""
    path = builtin.model_dir()
    cases = [("64M", False, False), ("64M", True, True), ("28M", False, True)]
    for budget, always, served in cases:
        size = memory.parse_size(budget)
        r = inspect_dir(path, memory_budget=size, max_context=256, prerouter_always=always)
        opts = EngineOptions(
            memory_budget=size, max_context=256, io_mode="buffered", prerouter_always=always
        )
        engine = load_engine(path, opts)
        try:
            plan = engine.plan
            assert plan.prerouter is served and (engine.prerouter is not None) is served
            assert (plan.floor.heads > 0) is served and (plan.staging_slots > 0) is served
            assert plan.holds_every_expert is (budget == "64M")
            assert planned(r.memory) == planned(plan.as_dict()) | {
                "fits": True,
                "state_source": r.memory["state_source"],
                "state_by_context": r.memory["state_by_context"],
            }
        finally:
            engine.close()


def test_cli_json(tiny, capsys):
    parser = argparse.ArgumentParser()
    add_inspect_parser(parser.add_subparsers())
    # --memory-budget is the whole process: this one's runtime and the model's floor and pool
    args = parser.parse_args(["inspect", str(tiny / "mlx"), "--json", "--memory-budget", "2G"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "mlx" and out["memory"]["fits"] is True
    m = out["memory"]
    assert m["process_budget"] == 2 << 30 and m["memory_budget"] is None
    assert m["predicted_peak_bytes"] == m["runtime"] + m["workspace"] + m["total_bytes"]
    assert m["predicted_peak_bytes"] <= 2 << 30
    assert out["total"]["params"] == out["routed_experts"]["params"] + sum(
        c["params"] for c in out["resident"].values()
    )


def test_not_a_moe_or_not_a_directory(tmp_path, tiny):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        inspect_dir(tmp_path / "nope")
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    write_header_only(
        tmp_path / "dense" / "model.safetensors", [("lm_head.weight", "F32", [8, 64])]
    )
    with pytest.raises(ValueError, match="no routed expert tensors"):
        inspect_dir(tmp_path / "dense")
    with pytest.raises(ValueError, match="top_k 99"):
        inspect_dir(tiny / "hf", top_k=99)


def test_a_family_edge0_does_not_serve_is_still_inspected(tiny, tmp_path):
    (tmp_path / "x").mkdir()
    for f in (tiny / "hf").iterdir():
        (tmp_path / "x" / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "x" / "config.json").read_text())
    (tmp_path / "x" / "config.json").write_text(json.dumps(dict(config, model_type="made_up")))
    r = inspect_dir(tmp_path / "x", max_context=100)
    assert r.total.params == inspect_dir(tiny / "hf").total.params
    assert r.memory["state_source"].startswith("config estimate")
    state = r.memory["floor"]["state"]
    assert state == 3 * 100 * 2 * 2 * 16 * 2  # layers, tokens, K+V, G, Dh, bf16 (the default)
    by_kv = r.memory["state_by_context"][100]
    assert by_kv == {"float32": 2 * state, "bfloat16": state, "int8": state // 2 * 34 // 32}
    fp32 = inspect_dir(tmp_path / "x", max_context=100, kv_dtype=torch.float32)
    assert fp32.memory["floor"]["state"] == 2 * state


@pytest.mark.parametrize(
    "name, kind",
    [
        ("model.layers.3.mlp.gate.weight", "routers"),
        ("language_model.model.layers.3.mlp.shared_expert_gate", "routers"),
        ("model.layers.3.mlp.gate.e_score_correction_bias", "routers"),
        ("model.layers.3.mlp.gate_proj.weight", "dense_mlp"),
        ("model.layers.3.mlp.shared_experts.up_proj.weight", "shared_experts"),
        ("model.layers.3.mlp.experts.7.up_proj.weight", "routed"),
        ("model.layers.3.block_sparse_moe.experts.7.w1.weight", "routed"),
        ("model.layers.3.mlp.experts.extents", "routed"),
        ("model.language_model.layers.0.linear_attn.A_log", "attention"),
        ("model.language_model.layers.0.linear_attn.norm.weight", "norms"),
        ("model.layers.0.self_attn.kv_a_layernorm.weight", "norms"),
        ("model.visual.blocks.0.attn.qkv.weight", "unused"),
        ("mtp.layers.0.mlp.experts.0.up_proj.weight", "unused"),
        ("lm_head.weight", "lm_head"),
    ],
)
def test_kinds(name, kind):
    assert kind_of(name) == kind
