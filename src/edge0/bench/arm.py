"""One arm of `edge0 bench`, run in its own process: replay a token sequence and time decode.

Invoked as `python -m edge0.bench.arm SPEC.json OUT.json` by the orchestrator (edge0.bench.ab).
The spec names the model, the arm (prerouter | ondemand | resident, optionally +nolora, +torch
for the pure-PyTorch expert path instead of the fused op, +int8 or +bf16 for the native int4
kernels' activations (EngineOptions.int4_activations), prerouter+wN for a stage width of
N experts, prerouter+thread or +inline for the heads on a thread of their own or not), K, the
pool size, the token sequence and the number of warm-up steps. The arm prefills the first
token, runs the warm-up steps, then times each replayed decode step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from edge0.engine.load import load_engine
from edge0.engine.options import INT4_ACTIVATIONS, EngineOptions
from edge0.util import malloc, memory


def run(spec: dict) -> dict:
    arm, _, variant = spec["arm"].partition("+")  # +nolora, +torch, +int8, +thread, +inline, +wN
    width = int(variant[1:]) if variant[:1] == "w" and variant[1:].isdigit() else None
    opts = EngineOptions(
        top_k=spec["top_k"],
        expert_cache=spec.get("expert_cache"),
        io_mode=spec["io_mode"],
        io_threads=spec["io_threads"],
        no_prerouter=arm != "prerouter",
        prerouter=Path(spec["prerouter"]) if arm == "prerouter" else None,
        prerouter_always=arm == "prerouter",  # the arm's point, whatever the pool holds
        # heads given for speed alone (warm-start ones predict the next router at any K)
        prerouter_any_base=arm == "prerouter",
        no_lora=variant == "nolora",
        backend="torch" if variant == "torch" else EngineOptions.backend,
        int4_activations=variant if variant in INT4_ACTIVATIONS else EngineOptions.int4_activations,
        stage_width=width,
        heads_thread={"thread": True, "inline": False}.get(variant),
        preload=False,  # ondemand and prerouter read experts as routed; resident, all below
    )
    engine = load_engine(spec["model_dir"], opts)
    tokens = spec["tokens"]
    warmup = spec["warmup"]
    if arm == "resident":  # every expert in memory before timing: the compute-only step
        engine.preload_experts()
    req = engine.new_request()
    engine.prefill(req, tokens[:1])
    for tok in tokens[1 : 1 + warmup]:
        engine.step(req, tok)
    before = engine.stats()
    times = []
    with memory.PeakSampler() as peaks:
        for tok in tokens[1 + warmup :]:
            t = time.perf_counter()
            engine.step(req, tok)
            times.append(time.perf_counter() - t)
    delta = engine.stats().minus(before)
    d, pre = delta.pool, delta.prerouter
    n = len(times)
    out = {
        "arm": spec["arm"],
        "steps": n,
        "step_s": times,
        "decode_tok_s": n / sum(times),
        "step_ms": 1e3 * sum(times) / n,
        # time inside read calls summed over the I/O threads (can exceed the step); the
        # disk time D of a step is bytes_per_step at the measured bandwidth (ab.summarize)
        "io_thread_ms_per_step": d.disk_ns / 1e6 / n,
        "blocked_ms_per_step": d.blocked_ns / 1e6 / n,
        "bytes_per_step": d.bytes_read / n,
        "reads_per_step": d.reads / n,
        "mib_per_read": d.bytes_read / max(1, d.reads) / 2**20,
        "cache_hits_per_step": d.hits / n,
        "loads_per_step": d.loads / n,
        "dropped": pre.dropped,
        "head_ms_per_step": pre.head_ns / 1e6 / n,
        "peak_anon_bytes": peaks.peak_anon,
        "peak_file_bytes": peaks.peak_file,
        "pool_bytes": engine.plan.pool_bytes,
        "floor_bytes": engine.plan.floor.total,
        "heads_thread": engine.prerouter is not None and engine.prerouter.worker is not None,
    }
    engine.close()
    return out


def main() -> int:
    malloc.tune_malloc()
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    Path(sys.argv[2]).write_text(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
