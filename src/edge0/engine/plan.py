"""The serving plan: one function turns (model sizes, options) into what the engine allocates.

Every budget rule lives here: the experts per token served (K), the resident floor broken down
by part, the per-request state allocated for the context (times the requests decoding at
once), the prefix cache's bound, the staging room the prerouter needs per active request, and
the expert pool in whole extents. The engine, `inspect`, `bench`, `eval` and the
training phases all take their numbers from a plan, so a prediction and an allocation cannot
disagree (tests pin `inspect`'s plan to the engine's measured allocation).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from edge0.engine.options import EngineOptions
from edge0.formats.checkpoint import TensorInfo
from edge0.formats.format import INT4
from edge0.modeldir import Header, ModelDir
from edge0.util import memory

# copies of a forward's hidden states [tokens, hidden] alive at its peak (workspace_bytes)
HIDDEN_COPIES = 10
# what a serving process allocates as it runs beyond its first forward's working memory: the
# HTTP server's and the I/O threads' own buffers and heaps (cgroup-measured; docs/format.md)
SERVING_MARGIN = 16 << 20
# What a process needs beyond the floor and the pool (torch, the tokenizer, Python, the
# allocator's retained heap): 0.36 GiB after load and 0.11 GiB more while decoding, measured on
# the 32-layer 2048-wide synthetic model. A memory cap is turned into a budget by this much.
RUNTIME_RESERVE = 600 << 20


@dataclass(frozen=True)
class ModelSizes:
    """What planning needs to know of a model, from file headers alone."""

    resident_params: int  # float parameters of the resident floor (held at the compute dtype)
    moe_layers: int
    experts_per_layer: int
    extent_bytes: int
    native_top_k: int
    served_top_k: int | None  # the default K edge0.json records (None: native)
    # per-request state at a context length: (tokens, compute dtype, KV storage dtype) -> bytes
    state_bytes: Callable[[int, torch.dtype, torch.dtype], int]
    adapter_params: int = 0  # the served LoRA
    head_params: int = 0  # the prerouter heads
    prediction_routed_layers: int = 0  # consumers of those heads
    position_limit: int | None = None  # the model's max_position_embeddings, if it has one
    int4_bytes: int = 0  # int4 resident weights as held (models/int4.py), whatever the dtype
    served_stage_width: int | None = None  # the default W edge0.json records (None: K)
    hidden_size: int = 0  # for the working memory of a forward (workspace_bytes)
    heads: int = 0  # attention heads, likewise


@dataclass(frozen=True)
class Floor:
    """Resident bytes besides the expert pool, by part."""

    weights: int  # resident float parameters at the compute dtype, plus the int4 ones
    adapter: int  # the recovery LoRA at the compute dtype
    heads: int  # the prerouter heads as served (heads_itemsize)
    state: int  # max_active requests' KV caches and recurrent states at max_context
    prefix_cache: int = 0  # finished requests' state kept for reuse (a bound, filled on use)

    @property
    def total(self) -> int:
        return self.weights + self.adapter + self.heads + self.state + self.prefix_cache


@dataclass(frozen=True)
class ServingPlan:
    top_k: int
    max_context: int
    max_active: int  # requests decoding at once; floor.state and staging_slots count them all
    dtype: str
    floor: Floor
    extent_bytes: int
    pool_slots: int
    staging_slots: int  # slots prediction-routed decode keeps pinned, all active requests
    stage_width: int  # experts staged per prediction-routed layer (K: prediction is routing)
    experts_bytes: int  # every routed expert, on disk
    memory_budget: int | None
    notes: list[str] = field(default_factory=list)
    runtime: int = 0  # what the process held before any weight was read (MachineMemory)
    workspace: int = 0  # working memory of the largest forward (workspace_bytes)
    limit: int | None = None  # the memory limit the process runs under (its cgroup's)
    kv_dtype: str = "bfloat16"  # how the state's keys and values are stored
    process_budget: int | None = None  # the whole process's budget, if one was given

    @property
    def prerouter(self) -> bool:
        """The heads are served: their consumers are prediction-routed (and stage)."""
        return self.staging_slots > 0

    @property
    def pool_bytes(self) -> int:
        return self.pool_slots * self.extent_bytes

    @property
    def holds_every_expert(self) -> bool:
        return self.pool_bytes >= self.experts_bytes

    @property
    def total_bytes(self) -> int:
        """What the engine allocates: the floor plus the pool."""
        return self.floor.total + self.pool_bytes

    @property
    def peak_bytes(self) -> int:
        """The whole process's predicted peak: runtime, working memory, floor and pool."""
        return self.runtime + self.workspace + self.total_bytes

    def as_dict(self) -> dict:
        out = asdict(self)
        out["floor"]["total"] = self.floor.total
        out["pool_bytes"] = self.pool_bytes
        out["total_bytes"] = self.total_bytes
        out["peak_bytes"] = self.peak_bytes
        return out


def resolve_top_k(requested: int | None, served: int | None, native: int) -> int:
    """The one rule for K: asked for, else the model's recorded served K, else native."""
    return requested or served or native


def heads_itemsize(options: EngineOptions) -> int:
    """Bytes per prerouter head parameter as the backend serves them (the native one reads
    the file's fp16 as stored; the torch one stacks them at the compute dtype)."""
    from edge0.engine.backends import backend_class

    return backend_class(options.backend).heads_itemsize(options.dtype)


def make_plan(
    sizes: ModelSizes, options: EngineOptions, machine: memory.MachineMemory | None = None
) -> ServingPlan:
    """The plan for serving a model of `sizes` with `options` in a process like `machine`
    (default: this one, now). Raises ValueError naming the option and the missing bytes when
    the budget cannot hold the floor and what decode pins, or when the whole process would
    not fit the memory limit it runs under (its cgroup's): refused up front, never an
    out-of-memory kill later.

    A pool that holds every expert with the heads served is planned again without them
    (unless options.prerouter_always): with nothing to read ahead the heads only cost time,
    and each layer's own router routes exactly (`prerouter` False in the plan)."""
    machine = machine or memory.MachineMemory.now()  # the same for both plans
    plan = _plan(sizes, options, machine)
    if plan.prerouter and plan.holds_every_expert and not options.prerouter_always:
        bare = replace(sizes, head_params=0, prediction_routed_layers=0)
        plan = _plan(bare, options, machine)
        plan.notes.append(
            "the pool holds every expert: no prerouter (each layer's router routes; "
            "prerouter_always serves it anyway)"
        )
    _check_limit(plan)
    return plan


def workspace_bytes(sizes: ModelSizes, options: EngineOptions, context: int, k: int) -> int:
    """The working memory of the largest forward the plan allows: max_active fresh prompts of
    prefill_chunk tokens prefilled together (with the batch's own cache, copied out after),
    or one prompt's chunk attending to a whole context: their hidden states, attention
    scores and routed outputs, and an expert dequantized for the dense path. The allocator
    keeps it once used, so it counts for the whole run. Calibrated against cgroup-measured
    peaks (docs/format.md, Memory)."""
    batch, chunk = options.max_active, min(options.prefill_chunk, context)
    tokens = batch * chunk
    d, item = sizes.hidden_size, 4  # activations are fp32 between the ops
    hidden = tokens * d * item * HIDDEN_COPIES
    scores = sizes.heads * chunk * max(batch * chunk, context) * item
    routed = tokens * k * d * item * 2
    dense = 2 * sizes.extent_bytes * 8  # an expert's int4 extent dequantized to fp32, twice
    batch_cache = (
        sizes.state_bytes(chunk, options.dtype, options.kv_dtype) * batch if batch > 1 else 0
    )
    return hidden + scores + routed + dense + batch_cache + SERVING_MARGIN


def _check_limit(plan: ServingPlan) -> None:
    if plan.limit is None or plan.peak_bytes <= plan.limit:
        return
    fmt = memory.format_bytes
    raise ValueError(
        f"the process's memory limit (its cgroup's) is {fmt(plan.limit)}, below the predicted "
        f"peak {fmt(plan.peak_bytes)}: runtime {fmt(plan.runtime)} + working memory "
        f"{fmt(plan.workspace)} + resident floor {fmt(plan.floor.total)} + expert pool "
        f"{fmt(plan.pool_bytes)}; {fmt(plan.peak_bytes - plan.limit)} more needed (lower "
        "process_budget, expert_cache, max_context or max_active, or raise the limit)"
    )


def _plan(sizes: ModelSizes, options: EngineOptions, machine: memory.MachineMemory) -> ServingPlan:
    k = resolve_top_k(options.top_k, sizes.served_top_k, sizes.native_top_k)
    if not 1 <= k <= sizes.experts_per_layer:
        raise ValueError(f"top_k {k} must be between 1 and {sizes.experts_per_layer}")
    if options.max_context < 2:
        raise ValueError(f"max_context must be at least 2, got {options.max_context}")
    active = options.max_active
    if active < 1:
        raise ValueError(f"max_active must be at least 1, got {active}")
    if options.prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be at least 1, got {options.prefill_chunk}")
    if options.prefix_cache is not None and options.prefix_cache < 0:
        raise ValueError(f"prefix_cache must be at least 0 bytes, got {options.prefix_cache}")
    # prompt plus completion, within what the model's positions were trained for
    context = min(options.max_context, sizes.position_limit or options.max_context)
    item = options.dtype.itemsize
    one_state = sizes.state_bytes(context, options.dtype, options.kv_dtype)
    floor = Floor(
        weights=sizes.resident_params * item + sizes.int4_bytes,
        adapter=sizes.adapter_params * item,
        heads=sizes.head_params * heads_itemsize(options),
        state=active * one_state,  # allocated per request, for the whole context
        prefix_cache=one_state if options.prefix_cache is None else options.prefix_cache,
    )
    extent = sizes.extent_bytes
    all_slots = sizes.moe_layers * sizes.experts_per_layer
    workspace = workspace_bytes(sizes, options, context, k)
    # what each kind of budget holds besides the pool, and how an error names it
    fmt = memory.format_bytes
    beside_pool = {
        "process_budget": (
            machine.runtime + workspace + floor.total,
            f" (the whole process) is below the runtime {fmt(machine.runtime)} + working "
            f"memory {fmt(workspace)} +",
        ),
        "memory_budget": (floor.total, " is below the"),
    }
    # A prediction-routed step pins every consumer's staged set plus the layer being read, and
    # every other active request keeps its staged sets pinned between its steps.
    # asked for, else the recorded default (if not below this K), else K
    width = options.stage_width or max(k, sizes.served_stage_width or k)
    if not k <= width <= sizes.experts_per_layer:
        raise ValueError(
            f"stage_width {width} must be between top_k {k} and the layer's "
            f"{sizes.experts_per_layer} experts"
        )
    layers = sizes.prediction_routed_layers + 1
    staging = active * layers * width if sizes.prediction_routed_layers else 0
    # slots decode must be able to pin at once; pins of the same expert share its slot, so
    # never more than every expert (3 requests staging 12 of 32 in 8 layers: 288 > 256)
    need = min(max(k, staging), all_slots)
    notes = []
    if options.expert_cache is not None:
        slots, source = options.expert_cache // extent, "expert_cache"
    elif options.process_budget is not None or options.memory_budget is not None:
        source = "process_budget" if options.process_budget is not None else "memory_budget"
        budget = getattr(options, source)
        slots = max(0, budget - beside_pool[source][0]) // extent
    else:  # everything if it fits in a quarter of what the process may still take
        slots, source = max(need, machine.available // 4 // extent), None
        notes.append("no budget: every expert if it fits in a quarter of the free memory")
    if slots < need:
        if staging > k:
            per = f"max_active {active} x " if active > 1 else ""
            pins = f"prediction-routed decode stages ({per}{layers} layers x {width})"
        else:
            pins = f"decode pins (1 layer x {k})"
        pins = f"{need} experts of {extent} bytes that {pins}"
        if source in beside_pool:
            held, below = beside_pool[source]
            raise ValueError(
                f"{source} {fmt(budget)}{below} resident floor {fmt(floor.total)}"
                f"{_floor_parts(floor, active)} plus the {pins}: "
                f"{fmt(held + need * extent - budget)} more needed"
            )
        raise ValueError(
            f"expert_cache {fmt(options.expert_cache)} holds {slots} of the "
            f"{pins}: {fmt((need - slots) * extent)} more needed"
        )
    return ServingPlan(
        top_k=k,
        max_context=context,
        max_active=active,
        dtype=str(options.dtype).removeprefix("torch."),
        floor=floor,
        extent_bytes=extent,
        pool_slots=min(slots, all_slots),
        staging_slots=staging,
        stage_width=width,
        experts_bytes=all_slots * extent,
        memory_budget=options.memory_budget,
        notes=notes,
        runtime=machine.runtime,
        workspace=workspace,
        limit=machine.limit,
        kv_dtype=str(options.kv_dtype).removeprefix("torch."),
        process_budget=options.process_budget,
    )


def _floor_parts(floor: Floor, active: int) -> str:
    """The floor's request-dependent parts, named by the options that size them."""
    parts = []
    if active > 1:
        parts.append(f"state for max_active {active} requests {memory.format_bytes(floor.state)}")
    if floor.prefix_cache:
        parts.append(f"prefix_cache {memory.format_bytes(floor.prefix_cache)}")
    return f" (with {', '.join(parts)})" if parts else ""


def int4_held_bytes(out: int, inp: int, embedding: bool = False, tied: bool = False) -> int:
    """Bytes an int4 resident weight [out, inp] takes loaded (models/int4.py): codes plus a
    (scale, zero) or (scale, bias) pair per group, and for a tied embedding the packed copy
    its output projection runs on."""
    one = INT4.held_bytes(out, inp)
    return 2 * one if embedding and tied else one


def resident_sizes(table: dict[str, TensorInfo], model) -> tuple[int, int]:
    """(float parameters, int4 bytes as held) of an edge0 directory's model.safetensors, from
    its header's tensor table."""
    from torch import nn

    from edge0.models.int4 import Int4Embedding

    modules = dict(model.named_modules())
    int4 = {k.removesuffix(".scales") for k in table if k.endswith(".scales")}
    floats, held = 0, 0
    for key, info in table.items():
        module, _, part = key.rpartition(".")
        if module in int4:
            if part == "weight":
                out, inp = info.shape[0], info.shape[1] * 8
                emb = isinstance(modules.get(module), nn.Embedding | Int4Embedding)
                held += int4_held_bytes(out, inp, emb, model.config.tie_word_embeddings)
            elif part not in ("scales", "biases"):
                floats += info.numel  # a bias
        else:
            floats += info.numel
    return floats, held


def prediction_routed_layers(heads: Header, moe_layers: list[int]) -> int:
    """Consumers of a prerouter file's heads, from its header: its recorded wiring, else each
    owner predicting the next MoE layer (prerouter/head.py reads files the same way)."""
    if "consumers" in heads.meta:
        return len(json.loads(heads.meta["consumers"]))
    owners = {int(k.split(".")[1]) for k in heads.table}
    return sum(1 for a in moe_layers[:-1] if a in owners)


def model_sizes(md: ModelDir) -> ModelSizes:
    """ModelSizes of an opened edge0 directory, with the adapters it serves, from its headers
    and its meta-device model (no weight read)."""
    model = md.skeleton
    layers = model.moe_layers
    floats, int4_bytes = resident_sizes(md.resident.table, model)
    return ModelSizes(
        resident_params=floats,
        int4_bytes=int4_bytes,
        moe_layers=len(layers),
        experts_per_layer=md.manifest.experts["num_experts"],
        extent_bytes=md.layout.nbytes,
        native_top_k=md.manifest.native_top_k,
        served_top_k=md.manifest.served_top_k,
        served_stage_width=md.manifest.served_stage_width,
        state_bytes=lambda n, dtype, kv: model.new_cache(
            n, dtype, device="meta", kv_dtype=kv
        ).nbytes(),
        adapter_params=md.lora.params if md.lora else 0,
        head_params=md.heads.params if md.heads else 0,
        prediction_routed_layers=prediction_routed_layers(md.heads, layers) if md.heads else 0,
        position_limit=position_limit(model.config),
        hidden_size=model.config.hidden_size,
        heads=getattr(model.config, "num_attention_heads", 0),
    )


def position_limit(cfg) -> int | None:
    """The positions a model serves: max_position_embeddings, times the factor of a dynamic
    RoPE, which scales its frequencies as the sequence grows past it (yarn, llama3 and
    longrope configs already say the extended length there)."""
    limit = getattr(cfg, "max_position_embeddings", None)
    scaling = getattr(cfg, "rope_scaling", None) or {}
    if limit and scaling.get("rope_type") == "dynamic":
        return int(limit * float(scaling.get("factor") or 1.0))
    return limit


def open_dir(path: Path | str, options: EngineOptions) -> ModelDir:
    """An edge0 directory opened with the adapters `options` serve."""
    return ModelDir(path, options.lora, options.prerouter, options.no_lora, options.no_prerouter)


def plan_for_dir(path: Path | str, options: EngineOptions) -> ServingPlan:
    """The plan for serving an edge0 directory with `options`, from headers and a meta-device
    model (no weights read): what load_engine would allocate."""
    return make_plan(model_sizes(open_dir(path, options)), options)
