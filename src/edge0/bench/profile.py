"""`edge0 bench --profile [MODEL_DIR]`: where one decode step's time goes, per kind of op.

Every expert is read into the pool first (the pool must hold them all), so the profile is
of compute, not of reads. After warm-up steps, `--tokens` decode steps run under
torch.profiler (CPU ops, no stacks); each aten op's self time is put in one category by its
name, and whatever the step's wall time is not spent in ops is Python and dispatch. The
report also gives the step against the sum of its matmul kernels (the int4 kernel, dense
matmuls and attention), the measure of a lean step. The profiler adds about a microsecond to
every op, so the same number of steps is first timed without it.
"""

from __future__ import annotations

import mmap
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from edge0 import modeldir
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.models.experts import ResidentExperts
from edge0.models.int4 import Int4Embedding
from edge0.models.layers import RotaryEmbedding
from edge0.store.pool import advise_huge_pages
from edge0.util import memory

BANDWIDTH_ARENA = 1 << 30  # bytes summed to measure the read bandwidth (well past any cache)

# (category, matmul?, substrings of aten op names), first match wins
CATEGORIES = [
    # edge0's int4 ops' self time is their kernels (plus a few rounding loops); the native ops'
    # norms, rotary and residual loops and the ATen ops they call are profiled as themselves
    ("int4 matmul kernel", True, ("_weight_int4pack_mm", "edge0::int4_gemv", "edge0::swiglu")),
    ("dense matmul", True, ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "linear")),
    ("attention (sdpa)", True, ("scaled_dot_product", "_flash_attention", "decode_attention")),
    ("norms", False, ("rms_norm", "aten::pow", "aten::mean", "aten::rsqrt", "layer_norm")),
    ("routing: softmax, top-k, one-hot", False, ("topk", "softmax", "sort", "one_hot", "scatter")),
    ("dtype casts, copies", False, ("aten::to", "_to_copy", "copy_", "contiguous", "clone")),
    ("cat, stack, index, slice", False, ("cat", "stack", "index", "slice", "select", "gather")),
    (
        "elementwise (silu, mul, add, rotary, weighted sum, ...)",
        False,
        ("silu", "mul", "add", "sigmoid", "div", "neg", "rotary", "residual", "moe_combine"),
    ),
    (
        "the native layer op's own work (checks, conversions)",
        False,
        ("edge0::attention_rows", "edge0::decode_token"),
    ),
]
# views and allocations, by exact name (short names like aten::t would match others)
VIEWS = "views, reshapes, allocations"
VIEW_OPS = {
    f"aten::{n}"
    for n in (
        "as_strided t transpose narrow view reshape _unsafe_view split chunk squeeze unsqueeze "
        "expand permute resolve_conj resolve_neg alias detach empty empty_strided empty_like "
        "zeros zeros_like fill_ zero_ sum arange"
    ).split()
}
OTHER_OPS = "other aten ops"
PYTHON = "Python, dispatch, bookkeeping (not in an op)"


def categorize(name: str) -> tuple[str, bool]:
    if name in VIEW_OPS:
        return VIEWS, False
    for category, is_matmul, keys in CATEGORIES:
        if any(k in name for k in keys):
            return category, is_matmul
    return OTHER_OPS, False


def read_bandwidth(nbytes: int = BANDWIDTH_ARENA, passes: int = 7) -> tuple[float, float, float]:
    """Bytes a second this process reads from memory with torch's threads, over `passes` sums
    of an fp32 arena of `nbytes` -> (median, slowest, fastest pass).

    The arena is mapped as the expert pool is, on huge pages where Linux gives them
    (advise_huge_pages), and written first so every page is there: the reads it times are
    the kind the step's experts make. The median, not the best pass: on a shared 2-vCPU host
    a best-of-5 on 4 KiB pages read anywhere from 28 to 52 GB/s an hour apart while the step
    it judged did not move (docs/kernels.md)."""
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(mem)
    arena = torch.frombuffer(mem, dtype=torch.float32)
    try:
        arena.fill_(1.0)
        arena.sum()  # warm the threads
        times = []
        for _ in range(passes):
            t = time.perf_counter()
            arena.sum()
            times.append(time.perf_counter() - t)
    finally:
        del arena
        mem.close()
    return nbytes / statistics.median(times), nbytes / max(times), nbytes / min(times)


def _tensor_bytes(tensors) -> int:
    """Bytes of distinct tensors (tied weights counted once)."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def step_bytes(engine, cache) -> dict[str, int]:
    """What one decode step of one row must read, by part: the K experts of every MoE layer
    (whole extents: codes and scales), the resident weights (all but the tables a step
    indexes one row of: the embedding and the rotary cache), the heads when the step runs
    them, and the cache's keys and values at its current length (a recurrent layer: its
    state)."""
    indexed = (nn.Embedding, Int4Embedding, RotaryEmbedding)
    model = engine.model
    experts = {  # experts held in the model: counted as the K a step runs, below
        id(t)
        for m in model.modules()
        if isinstance(m, ResidentExperts)
        for t in (*m.parameters(), *m.buffers())
    }
    resident, rows = [], 0
    for module in model.modules():
        own = (*module.parameters(recurse=False), *module.buffers(recurse=False))
        own = [t for t in own if id(t) not in experts]
        if isinstance(module, indexed):
            rows += sum(t[0].numel() * t.element_size() for t in own if t.dim() > 0)
        else:
            resident += own
    heads = 0
    if engine.prerouter is not None:
        heads = engine.plan.floor.heads
    k, layers = engine.top_k, len(engine.moe_layers)
    return {
        "experts": layers * k * engine.plan.extent_bytes,
        "resident weights": _tensor_bytes(resident) + rows,
        "heads": heads,
        "keys and values": cache.touched_bytes(),
    }


def every_expert_bytes(model_dir: Path) -> int:
    """The pool that holds every routed expert of an edge0 directory: what the profile
    sizes its pool to unless told otherwise, rather than the serving plan's share of free
    memory, which for a 30B-class model holds about a third of them."""
    md = modeldir.ModelDir(model_dir, no_lora=True, no_prerouter=True)
    return md.extent_bytes * sum(ext.count for ext in md.experts.values())


def measure(
    model_dir: Path,
    tokens: int = 16,
    warmup: int = 4,
    options=None,
    bandwidth_bytes: int = BANDWIDTH_ARENA,
) -> dict:
    engine = load_engine(model_dir, options or EngineOptions(io_mode="buffered"))
    try:
        engine.preload_experts()
        ids = engine.tokenizer.encode("def read_config(path):")
        with engine.new_request() as req:
            logits = engine.prefill(req, ids)
            for _ in range(warmup):
                logits = engine.step(req, int(logits.argmax()))
            plain = []  # the same steps without the profiler, which adds ~1 µs to every op
            for _ in range(tokens):
                t = time.perf_counter()
                logits = engine.step(req, int(logits.argmax()))
                plain.append(time.perf_counter() - t)
            steps = []
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(tokens):
                    t = time.perf_counter()
                    logits = engine.step(req, int(logits.argmax()))
                    steps.append(time.perf_counter() - t)
            touched = step_bytes(engine, req.cache)
        bandwidth, slowest, fastest = read_bandwidth(bandwidth_bytes)
        wall_ms = 1e3 * sum(steps) / tokens
        per_cat: dict[str, float] = {}
        matmul_ms = 0.0
        calls = 0
        for ev in prof.key_averages():
            if not ev.key.startswith(("aten::", "edge0::")):
                continue
            ms = ev.self_cpu_time_total / 1e3 / tokens
            category, is_matmul = categorize(ev.key)
            per_cat[category] = per_cat.get(category, 0.0) + ms
            matmul_ms += ms if is_matmul else 0.0
            calls += ev.count
        in_ops = sum(per_cat.values())
        per_cat[PYTHON] = max(0.0, wall_ms - in_ops)
        return {
            "model": str(model_dir),
            "tokens": tokens,
            "threads": torch.get_num_threads(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "int4_activations": engine.options.int4_activations,
            "step_ms": wall_ms,
            "step_ms_median": 1e3 * statistics.median(steps),
            "unprofiled_step_ms_median": 1e3 * statistics.median(plain),
            "matmul_ms": matmul_ms,
            "op_calls_per_step": calls / tokens,  # aten and edge0 ops
            "categories_ms": dict(sorted(per_cat.items(), key=lambda kv: -kv[1])),
            "top_k": engine.top_k,
            "context": len(req.tokens),
            "step_bytes": touched,
            "read_bandwidth": bandwidth,  # bytes a second, the passes' median
            "read_bandwidth_passes": [slowest, fastest],
            "floor_ms": 1e3 * sum(touched.values()) / bandwidth,
        }
    finally:
        engine.close()


def report(r: dict) -> str:
    lines = [
        f"{r['model']}: {r['tokens']} profiled decode steps, torch {torch.__version__}, "
        f"capability {r['capability']}, {r['threads']} threads, int4 kernels on "
        f"{r['int4_activations']} activations; every expert in the pool",
        f"step {r['unprofiled_step_ms_median']:.1f} ms unprofiled (median), "
        f"{r['step_ms']:.1f} ms profiled; {r['op_calls_per_step']:.0f} op calls per step; "
        f"matmul kernels {r['matmul_ms']:.1f} ms; unprofiled step / matmuls = "
        f"{r['unprofiled_step_ms_median'] / max(r['matmul_ms'], 1e-9):.2f}",
        "",
        "| part | ms per step | share |",
        "|---|---|---|",
    ]
    for name, ms in r["categories_ms"].items():
        lines.append(f"| {name} | {ms:.2f} | {ms / r['step_ms']:.0%} |")
    total = sum(r["step_bytes"].values())
    lo, hi = r["read_bandwidth_passes"]
    lines += [
        "",
        f"the floor: what a step at K={r['top_k']} must read, at {r['context']} tokens of "
        f"context, over the read bandwidth measured here ({r['read_bandwidth'] / 1e9:.1f} GB/s, "
        f"the median of passes from {lo / 1e9:.1f} to {hi / 1e9:.1f})",
        "",
        "| part | bytes a step | ms at the bandwidth |",
        "|---|---|---|",
    ]
    for name, n in r["step_bytes"].items():
        ms = 1e3 * n / r["read_bandwidth"]
        lines.append(f"| {name} | {memory.format_bytes(n)} | {ms:.2f} |")
    step = r["unprofiled_step_ms_median"]
    lines += [
        f"| total | {memory.format_bytes(total)} | {r['floor_ms']:.2f} |",
        "",
        f"unprofiled step {step:.2f} ms = {step / r['floor_ms']:.2f}x the floor",
    ]
    return "\n".join(lines)
