"""load_engine: open a model directory, plan its memory, then load what the plan allows.

The order is the contract: the directory is opened from its headers alone (ModelDir), the plan
is made from them, and a budget that cannot hold it is refused before any weight is read; only
then do the backend, the resident weights, the adapters and the expert pool come in.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from edge0.engine import backends
from edge0.engine.core import Engine
from edge0.engine.options import INT4_ACTIVATIONS, EngineOptions
from edge0.engine.plan import make_plan, model_sizes, open_dir
from edge0.engine.scheduler import Scheduler
from edge0.modeldir import EXPERTS_FILE, ModelDir
from edge0.prerouter.runtime import PrerouterRuntime
from edge0.store.expert_file import ExpertFile
from edge0.store.pool import ExpertPool
from edge0.store.relayout import experts_for_host
from edge0.util import memory, threads

log = logging.getLogger(__name__)


def load_engine(path: Path | str | ModelDir, options: EngineOptions | None = None) -> Engine:
    """Load an edge0 directory for serving: plan, backend, model, adapters, expert pool, heads.
    `path` may be a ModelDir already opened with the adapters `options` serve."""
    opts = options or EngineOptions()
    threads.resolve_vector_math()
    if opts.int4_activations not in INT4_ACTIVATIONS:
        raise ValueError(
            f"int4_activations must be one of {', '.join(INT4_ACTIVATIONS)}: "
            f"{opts.int4_activations!r}"
        )
    md = path if isinstance(path, ModelDir) else open_dir(path, opts)
    sizes = model_sizes(md)
    _ = md.tokenizer  # (part of the runtime: loaded before the process is measured)
    machine = memory.MachineMemory.now()
    make_plan(sizes, opts, machine)  # refuses a budget before any weight is read or built
    backend = backends.choose(opts)
    opts = replace(opts, backend=backend.name)  # "auto" settled: its heads' bytes are known
    if backend.name == "torch":  # torch's int4 kernel takes bf16 activations
        opts = replace(opts, int4_activations="bf16")
    plan = make_plan(sizes, opts, machine)
    log.info(
        "plan: runtime %s + working memory %s + floor %s + pool %s = peak %s (limit %s)",
        *(memory.format_bytes(n) for n in (plan.runtime, plan.workspace, plan.floor.total)),
        memory.format_bytes(plan.pool_bytes),
        memory.format_bytes(plan.peak_bytes),
        memory.format_bytes(plan.limit) if plan.limit else "none",
    )

    model = md.load_model(opts.dtype, backend.arrangement)
    if plan.top_k != model.config.num_experts_per_tok:
        model.set_top_k(plan.top_k)
    lora_meta = md.load_lora(model, opts.lora_any_base)
    if lora_meta:
        model.to(opts.dtype)
    heads, heads_meta = (None, {})
    if plan.prerouter:  # (not where the pool holds every expert: make_plan)
        # fp16 as stored: stacked at the compute dtype by a backend that needs it
        heads, heads_meta = md.load_heads(
            model.moe_layers, torch.float16, plan.top_k, opts.prerouter_any_base
        )

    experts_path = experts_for_host(
        md.path,
        md.layout,
        md.manifest.files.get(EXPERTS_FILE),
        backend.arrangement,
        opts.relayout,
        opts.cache_dir,
        stored=md.stored_int4,
    )
    own = experts_path == md.experts_path  # (else a relayout copy, with a header of its own)
    header = (md.experts, md.extent_bytes, md.experts_meta) if own else None
    pool = ExpertPool(
        ExpertFile(experts_path, opts.io_mode, header),
        backend.pool_layout(md.layout, plan.holds_every_expert),
        plan.pool_bytes,
        io_threads=opts.io_threads,
        reorder=backend.reorder(),
        kernel_pairs=backend.kernel_pairs(),
        verify=opts.verify_reads,
    )
    prerouter = None
    if heads is not None:
        prerouter = PrerouterRuntime(
            heads,
            model,
            pool,
            opts.dtype,
            plan.stage_width,
            threaded=opts.heads_thread,
            native=backend.heads(),
        )
    engine = Engine(
        md, opts, backend, model, plan, pool, prerouter, lora_meta, heads_meta, Scheduler
    )
    try:
        if opts.preload and plan.holds_every_expert:
            engine.preload_experts(progress=True)
        else:  # its memory now, not on the decode step's cores at each slot's first read
            pool.fault_in()
    except BaseException:
        engine.close()
        raise
    return engine
