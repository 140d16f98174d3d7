"""`edge0 inspect DIR`: what a checkpoint costs, from safetensors headers alone.

For a Hugging Face, MLX or edge0 directory it counts parameters and bytes (total, routed
experts, and the resident floor by kind), active parameters per token at the native and the
served K, the size of one expert as stored and as an edge0 extent, and the peak memory edge0
would use under a memory budget. No tensor data is read: a header-only file with a sparse
data region is inspected like the real checkpoint.

Counting rules (the ones a header audit uses):
  * an MLX-quantized weight counts its logical [out, in] (in = scale groups * group_size);
    its packed words, scales and biases count as bytes, not parameters;
  * an edge0 extent counts its expert's 3 * D * I parameters;
  * active per token = every served non-expert parameter, with the embedding table counted
    as the one row a token reads (all of it when tied to the output), plus K experts per
    MoE layer. Adapters and unserved tensors (vision tower, MTP layers) are reported apart.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from edge0 import modeldir
from edge0.cli.inspect_headers import (
    Count,
    Tally,
    Tensor,
    config_value,
    flat_config,
    read_tensors,
    weight_files,
)
from edge0.engine.options import EngineOptions
from edge0.engine.plan import ModelSizes, make_plan, prediction_routed_layers, resolve_top_k
from edge0.formats.checkpoint import check_dir, is_adapter_file, read_json
from edge0.formats.extents import ExtentLayout
from edge0.formats.format import INT4
from edge0.formats.format import recorded as recorded_format
from edge0.formats.mlx import QuantConfig, QuantParams, detect_format
from edge0.modeldir import Header
from edge0.models import model_type_of
from edge0.models.layers import KV_BLOCK, KV_DTYPES
from edge0.util import memory

log = logging.getLogger(__name__)

# -- the report -----------------------------------------------------------------------------


@dataclass
class Report:
    path: str
    format: str
    family: str | None
    files: int
    tensors: int
    hidden: int
    moe_layers: int
    experts_per_layer: int
    native_top_k: int
    served_top_k: int
    total: Count
    routed_experts: Count
    resident: dict[str, Count]
    resident_total: Count
    adapters: dict[str, Count]
    unused: Count
    active: dict[str, dict[str, int]]
    per_expert: dict[str, int | None]
    stored_floor: dict[str, int]
    memory: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def inspect_dir(
    path: Path | str,
    *,
    top_k: int | None = None,
    memory_budget: int | None = None,
    process_budget: int | None = None,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype = EngineOptions.kv_dtype,
    max_context: int = 4096,
    max_active: int = 1,
    prefix_cache: int | None = 0,
    prerouter_always: bool = False,
    train: tuple[int, int, int] | None = None,
) -> Report:
    """Inspect a Hugging Face, MLX or edge0 directory without reading tensor data; the memory
    prediction is the serving plan for these options (EngineOptions' fields of the same name)."""
    path = check_dir(path)
    raw = read_json(path / "config.json", "model configuration")
    cfg = flat_config(raw)
    fmt = detect_format(path, raw)
    qcfg = QuantConfig.from_config(raw, str(path / "config.json"))
    manifest = read_json(path / "edge0.json", "edge0 manifest") if fmt == "edge0" else None
    if manifest and manifest.get("quantization", {}).get("resident") == "int4":
        qcfg = QuantConfig(QuantParams(INT4.group_size, INT4.bits), {})  # MLX's affine int4 format
    files = weight_files(path, fmt)
    tensors = read_tensors(files, qcfg)

    tally = Tally()
    for t in tensors:
        tally.add(t, manifest)
    total, routed, unused, resident = tally.total, tally.routed, tally.unused, tally.resident
    resident_total = Count(
        sum(c.params for c in resident.values()),
        sum(c.bytes for c in resident.values()),
        sum(c.tensors for c in resident.values()),
    )
    experts = tally.experts()
    if not experts:
        raise ValueError(f"{path}: no routed expert tensors found; is this an MoE checkpoint?")
    n_experts = max(experts.values())
    layer_params = tally.layer_params
    per_expert_params = {k: layer_params[k] // experts[k] for k in experts}
    embed = next((t for t in tensors if t.kind == "embeddings"), None)
    hidden = int(
        config_value(cfg, "hidden_size", "d_model", default=embed.shape[-1] if embed else 0)
    )
    native_k = int(config_value(cfg, "num_experts_per_tok", "moe_topk", "top_k", default=0))
    if not native_k and top_k is None:
        raise ValueError(f"{path / 'config.json'}: no num_experts_per_tok; pass top_k")
    recorded_k = (manifest or {}).get("served_top_k")
    served_k = resolve_top_k(top_k, recorded_k, native_k)
    if not 1 <= served_k <= n_experts:
        raise ValueError(f"top_k {served_k} must be between 1 and {n_experts}")

    # a token reads one embedding row, unless the table is also the output projection
    tied = resident["lm_head"].params == 0
    embed_active = resident["embeddings"].params if tied or embed is None else embed.shape[-1]
    base_active = resident_total.params - resident["embeddings"].params + embed_active

    def active(k: int) -> dict[str, int]:
        return {"k": k, "params": base_active + k * sum(per_expert_params.values())}

    adapters = read_adapters(path)
    one = max(per_expert_params.values())
    width = one // (3 * hidden) if hidden else 0
    try:  # an edge0 directory's experts in the format it records, others as edge0 writes them
        stored = recorded_format(manifest["quantization"]["experts"]) if manifest else INT4
        extent = ExtentLayout(hidden, width, format=stored).nbytes
    except ValueError:  # not int4-kernel shaped: edge0 cannot hold this model's experts
        extent = None
    stored_one = routed.bytes // sum(experts.values())
    adapter_bytes = sum(c.bytes for c in adapters.values())
    moe = len(experts)
    report = Report(
        path=str(path),
        format=fmt,
        family=model_type_of(raw),
        files=len(files),
        tensors=sum(t.stored for t in tensors),
        hidden=hidden,
        moe_layers=moe,
        experts_per_layer=n_experts,
        native_top_k=native_k,
        served_top_k=served_k,
        total=total,
        routed_experts=routed,
        resident=resident,
        resident_total=resident_total,
        adapters=adapters,
        unused=unused,
        active={"native": active(native_k), "served": active(served_k)},
        per_expert={
            "params": one,
            "width": width,
            "stored_bytes": stored_one,
            "extent_bytes": extent,
        },
        # what a runtime holding weights as stored (MLX) keeps: the audit's arithmetic
        stored_floor={
            "resident_bytes": resident_total.bytes,
            "with_adapters_bytes": resident_total.bytes + adapter_bytes,
            "plus_one_decode_step_bytes": resident_total.bytes
            + adapter_bytes
            + served_k * moe * stored_one,
        },
    )
    if extent is not None:
        options = EngineOptions(
            top_k=top_k,
            memory_budget=memory_budget,
            process_budget=process_budget,
            dtype=dtype,
            kv_dtype=kv_dtype,
            max_context=max_context,
            max_active=max_active,
            prefix_cache=prefix_cache,
            prerouter_always=prerouter_always,
        )
        int4_bytes, int4_params = int4_resident(path, raw, fmt, tensors)
        report.memory = predict_memory(
            path,
            raw,
            report,
            fmt,
            extent,
            options,
            recorded_k,
            int4_bytes,
            int4_params,
            (manifest or {}).get("served_stage_width"),
            train if fmt == "edge0" else None,
        )
    return report


def read_adapters(path: Path) -> dict[str, Count]:
    """Prerouter and LoRA files in the directory, counted per kind. The phase-2 LoRA an edge0
    directory keeps for its eval is not served, so it is not counted."""
    out: dict[str, Count] = {}
    for f in sorted(path.glob("*.safetensors")):
        if not is_adapter_file(f) or f.name == modeldir.LORA_SFT_FILE:
            continue
        kind = "prerouter" if f.name.startswith("prerouter") else "lora"
        c = out.setdefault(kind, Count())
        for t in read_tensors([f], None):
            c.add(t.params, t.bytes)
    return out


# -- memory -----------------------------------------------------------------------------------


def state_bytes(
    path: Path, raw: dict, tokens: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> tuple[int, str]:
    """Per-request state (KV cache, recurrent states) after `tokens` tokens, keys and values
    stored in `kv_dtype` (default: `dtype`), and its source: the model's own cache, allocated
    on the meta device, when edge0 serves this family, else a config estimate."""
    from edge0.modeldir.loader import build
    from edge0.models import load_config
    from edge0.models.experts import ExpertSlot

    try:
        fam, cfg = load_config(path)
        model = build(fam, cfg, ExpertSlot)
        cache = model.new_cache(tokens, dtype, device="meta", kv_dtype=kv_dtype)
        return cache.nbytes(), f"{cfg.model_type} cache"
    except ValueError as e:  # a family edge0 does not serve can still be inspected
        log.info("%s: state estimated from config.json (%s)", path, e)
    cfg = flat_config(raw)
    layers = int(config_value(cfg, "num_hidden_layers", default=0))
    types = cfg.get("layer_types")
    full = types.count("full_attention") if isinstance(types, list) else layers
    if cfg.get("kv_lora_rank"):  # MLA keeps a compressed latent + the rope key per token
        per_token = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 0))
    else:
        heads = int(config_value(cfg, "num_attention_heads", default=1))
        kv = int(config_value(cfg, "num_key_value_heads", default=heads))
        head_dim = int(
            config_value(cfg, "head_dim", default=int(cfg.get("hidden_size", 0)) // heads)
        )
        per_token = 2 * kv * head_dim
    kv = kv_dtype or dtype
    # int8: a code a channel and an fp16 scale per KV_BLOCK of them
    item = 1 + 2 / KV_BLOCK if kv == torch.int8 else kv.itemsize
    return int(full * tokens * per_token * item), "config estimate (full attention only)"


def predict_memory(
    path: Path,
    raw: dict,
    r: Report,
    fmt: str,
    extent: int,
    options: EngineOptions,
    served_top_k: int | None,
    int4_bytes: int = 0,
    int4_params: int = 0,
    served_stage_width: int | None = None,
    train: tuple[int, int, int] | None = None,
) -> dict[str, object]:
    """The engine's serving plan for this model (plan.py), from headers: the floor by part, the
    pool in whole extents, the staging room, and the whole process's peak: runtime (this
    process's, once it holds what a server imports and the tokenizer) + working memory +
    floor + pool. A budget that cannot hold it is reported, not raised."""
    state_source = state_bytes(path, raw, 1, options.dtype, options.kv_dtype)[1]
    pre = r.adapters.get("prerouter")
    sizes = ModelSizes(
        resident_params=r.resident_total.params - int4_params,
        int4_bytes=int4_bytes,
        moe_layers=r.moe_layers,
        experts_per_layer=r.experts_per_layer,
        extent_bytes=extent,
        native_top_k=r.native_top_k,
        served_top_k=served_top_k,
        served_stage_width=served_stage_width if pre else None,
        state_bytes=lambda n, dtype, kv: state_bytes(path, raw, n, dtype, kv)[0],
        adapter_params=r.adapters["lora"].params if "lora" in r.adapters else 0,
        head_params=pre.params if pre else 0,
        prediction_routed_layers=_consumers(path, fmt, r.moe_layers) if pre else 0,
        position_limit=config_value(flat_config(raw), "max_position_embeddings", default=None),
        hidden_size=int(config_value(flat_config(raw), "hidden_size", default=0)),
        heads=int(config_value(flat_config(raw), "num_attention_heads", default=0)),
    )
    machine = memory.MachineMemory.now()
    machine = memory.MachineMemory(serving_runtime(path), None, machine.available)
    training = {}
    if train is not None:
        k = resolve_top_k(options.top_k, served_top_k, r.native_top_k)
        training = {"training": training_memory(path, sizes, r, k, machine.runtime, *train)}
    try:
        plan = make_plan(sizes, options, machine)
    except ValueError as e:
        return {
            **training,
            "fits": False,
            "predicted_peak_bytes": None,
            "memory_budget": options.memory_budget,
            "process_budget": options.process_budget,
            "state_source": state_source,
            "note": str(e),
        }
    out = plan.as_dict()
    out.update(fits=True, predicted_peak_bytes=plan.peak_bytes, state_source=state_source)
    out.update(training)
    out["state_by_context"] = {
        n: {name: sizes.state_bytes(n, options.dtype, kv) for name, kv in KV_DTYPES.items()}
        for n in sorted({plan.max_context, 4096, 32768})
    }
    return out


def training_memory(
    path: Path,
    sizes: ModelSizes,
    r: Report,
    k: int,
    runtime: int,
    rows: int,
    length: int,
    rank: int,
) -> dict:
    """train/budget.py's estimate for phases 2 and 3 on this edge0 directory: rows sequences
    of length tokens a forward, a new LoRA of `rank` on the family's targets."""
    from edge0 import models
    from edge0.models import lora
    from edge0.train import budget

    md = modeldir.ModelDir(path, no_lora=True, no_prerouter=True)
    model = md.skeleton
    fam = models.family(model.config.model_type)
    names = dict(model.named_modules())
    targets = lora.target_paths(model, fam.LORA_TARGETS)
    lora_params = sum(rank * (names[t].in_features + names[t].out_features) for t in targets)
    shapes = budget.Shapes(
        layers=len(model.backbone.layers),
        vocab=int(model.config.vocab_size),
        params=r.total.params - r.unused.params,  # adapters are not counted in total
        lora_params=lora_params,
    )
    return budget.estimate(sizes, shapes, rows, length, k, runtime).as_dict()


def serving_runtime(path: Path) -> int:
    """What a serving process holds before it reads a weight, measured in this one once it
    has imported what `edge0 serve` imports and loaded the directory's tokenizer (where it
    has one): Python, torch, the tokenizer and the HTTP server."""
    import edge0.engine.load  # noqa: F401
    import edge0.server.app  # noqa: F401
    from edge0.text.tokenizer import load_tokenizer

    try:
        load_tokenizer(path)
    except (FileNotFoundError, ValueError) as e:
        log.info("%s: runtime measured without the tokenizer (%s)", path, e)
    return memory.sample().anon_bytes


def int4_resident(path: Path, raw: dict, fmt: str, tensors: list[Tensor]) -> tuple[int, int]:
    """(bytes as held, parameters) of the resident weights edge0 serves as int4: those an
    edge0 directory stores so, an MLX checkpoint's 4-bit ones (kept bit for bit), or for a
    Hugging Face checkpoint of a family edge0 serves, those `convert` would quantize."""
    from edge0.engine.plan import int4_held_bytes

    tied = bool(config_value(flat_config(raw), "tie_word_embeddings", default=False))
    resident = [t for t in tensors if t.kind not in ("routed", "unused")]
    if fmt in ("edge0", "mlx"):
        chosen = [t for t in resident if t.bits == 4]
    else:
        try:
            from edge0.modeldir.loader import build
            from edge0.models import load_config
            from edge0.models.experts import ExpertSlot

            fam, cfg = load_config(path)
            names = build(fam, cfg, ExpertSlot).int4_weights(getattr(fam, "NOT_INT4", ()))
            chosen = [t for t in resident if fam.sanitize(cfg, t.name) in names]
        except ValueError as e:  # a family edge0 does not serve: counted as float
            log.info("%s: int4 resident weights not predicted (%s)", path, e)
            chosen = []
    held = sum(
        int4_held_bytes(t.shape[0], t.shape[1], t.kind == "embeddings", tied) for t in chosen
    )
    return held, sum(t.params for t in chosen)


def _consumers(path: Path, fmt: str, moe_layers: int) -> int:
    """Prediction-routed layers of the directory's prerouter heads."""
    if fmt == "edge0":
        from edge0.modeldir.loader import build
        from edge0.models import load_config
        from edge0.models.experts import ExpertSlot

        fam, cfg = load_config(path)
        layers = build(fam, cfg, ExpertSlot).moe_layers
        return prediction_routed_layers(Header.read(path / modeldir.PREROUTER_FILE), layers)
    return max(0, moe_layers - 1)  # released heads: each MoE layer but the last predicts the next


# -- text output and CLI ----------------------------------------------------------------------


def _gib(n: int | None) -> str:
    return "-" if n is None else memory.format_bytes(n)


def _row(label: str, c: Count, total: Count | None = None) -> str:
    share = f" ({100 * c.params / total.params:4.1f}%)" if total and total.params else ""
    return f"  {label:<22}{c.params:>17,}{share:<9}{c.bytes:>17,}  {_gib(c.bytes)}"


def format_report(r: Report) -> str:
    lines = [
        f"{r.path}: {r.format} checkpoint, model_type {r.family}, {r.tensors} tensors in "
        f"{r.files} files (headers only)",
        f"  hidden {r.hidden}, {r.moe_layers} MoE layers x {r.experts_per_layer} experts, "
        f"native K={r.native_top_k}, served K={r.served_top_k}",
        "",
        f"  {'':<22}{'parameters':>17}{'':<9}{'bytes as stored':>17}",
        _row("total", r.total),
        _row("routed experts", r.routed_experts, r.total),
        _row("resident floor", r.resident_total, r.total),
    ]
    lines += [_row("  " + k.replace("_", " "), c) for k, c in r.resident.items() if c.tensors]
    for kind, c in r.adapters.items():
        lines.append(_row(f"adapters: {kind}", c))
    if r.unused.tensors:
        lines.append(_row("not served (vision/MTP)", r.unused))
    pe = r.per_expert
    lines += [
        "",
        f"  active per token: {r.active['native']['params']:,} at native K={r.native_top_k}, "
        f"{r.active['served']['params']:,} at served K={r.served_top_k}",
        f"  one expert: {pe['params']:,} params (width {pe['width']}), "
        f"{pe['stored_bytes']:,} bytes as stored, edge0 extent "
        + (f"{pe['extent_bytes']:,} bytes" if pe["extent_bytes"] else "n/a (not int4-shaped)"),
        f"  as stored: floor {_gib(r.stored_floor['resident_bytes'])}, with adapters "
        f"{_gib(r.stored_floor['with_adapters_bytes'])}, + one decode step at K="
        f"{r.served_top_k} ({r.served_top_k * r.moe_layers} experts) "
        f"{_gib(r.stored_floor['plus_one_decode_step_bytes'])}",
    ]
    m = r.memory
    if m.get("fits"):
        f = m["floor"]
        lines += [
            "",
            f"  edge0 at {m['dtype']} (KV {m['kv_dtype']}), K={m['top_k']}, "
            f"{m['max_context']} tokens of context:",
            f"    floor {_gib(f['total'])} = resident weights {_gib(f['weights'])} + LoRA "
            f"{_gib(f['adapter'])} + prerouter heads {_gib(f['heads'])} + state "
            f"{_gib(f['state'])} ({m['state_source']}, {m['max_active']} active) + prefix cache "
            f"{_gib(f['prefix_cache'])}",
            f"    experts on disk {_gib(m['experts_bytes'])}; pool {m['pool_slots']} extents "
            f"{_gib(m['pool_bytes'])} (staging needs {m['staging_slots']})",
            "    state per request by context, KV as "
            + ", ".join(
                f"{n:,} tokens: " + " / ".join(f"{name} {_gib(b)}" for name, b in by_kv.items())
                for n, by_kv in m["state_by_context"].items()
            ),
            f"    predicted peak {_gib(m['predicted_peak_bytes'])} = runtime "
            f"{_gib(m['runtime'])} + working memory {_gib(m['workspace'])} + floor "
            f"{_gib(f['total'])} + pool {_gib(m['pool_bytes'])}",
        ]
        lines += [f"    ({note})" for note in m["notes"]]
    elif m:
        lines += ["", f"  does not fit: {m['note']}"]
    if m and "training" in m:
        lines += format_training(m["training"])
    return "\n".join(lines)


def format_training(t: dict) -> list[str]:
    """The training estimate's lines (train/budget.py)."""
    return [
        "",
        f"  training (phases 2 and 3), {t['rows']} x {t['length']} tokens a forward, estimated:",
        f"    int4 student (CPU): {_gib(t['int4_student'])} = runtime {_gib(t['runtime'])} + "
        f"floor {_gib(t['int4_floor'])} + "
        f"pool of one layer {_gib(t['int4_pool_min'])} + LoRA, gradient and AdamW "
        f"{_gib(t['trainable'])} + layer inputs {_gib(t['checkpoints'])} + one layer's "
        f"recompute and backward {_gib(t['layer_work'])} + logits {_gib(t['logits'])}",
        f"    dequantized student (GPU): {_gib(t['dequantized_student'])} = runtime + fp32 weights "
        f"{_gib(t['dequantized_weights'])} + every layer's activations "
        f"{_gib(t['dequantized_activations'])} + LoRA {_gib(t['trainable'])}",
        f"    teacher: cached (none in memory; {t['cache_bytes_per_position']} bytes a position "
        f"on disk at top-32), edge0's {_gib(t['edge0_teacher'])}, Hugging Face bf16 "
        f"{_gib(t['hf_teacher_bf16'])}",
    ]
