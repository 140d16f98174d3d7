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

import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions

# (category, matmul?, substrings of aten op names), first match wins
CATEGORIES = [
    # edge0's int4 ops' self time is their kernels (plus a few rounding loops); the native ops'
    # norms, rotary and residual loops and the ATen ops they call are profiled as themselves
    ("int4 matmul kernel", True, ("_weight_int4pack_mm", "edge0::int4_gemv", "edge0::swiglu")),
    ("dense matmul", True, ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "linear")),
    ("attention (sdpa)", True, ("scaled_dot_product", "_flash_attention")),
    ("norms", False, ("rms_norm", "aten::pow", "aten::mean", "aten::rsqrt", "layer_norm")),
    ("routing: softmax, top-k, one-hot", False, ("topk", "softmax", "sort", "one_hot", "scatter")),
    ("dtype casts, copies", False, ("aten::to", "_to_copy", "copy_", "contiguous", "clone")),
    ("cat, stack, index, slice", False, ("cat", "stack", "index", "slice", "select", "gather")),
    (
        "elementwise (silu, mul, add, rotary, weighted sum, ...)",
        False,
        ("silu", "mul", "add", "sigmoid", "div", "neg", "rotary", "residual", "moe_combine"),
    ),
    ("the native layer op's own work (checks, conversions)", False, ("edge0::attention_rows",)),
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


def measure(model_dir: Path, tokens: int = 16, warmup: int = 4, options=None) -> dict:
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
    return "\n".join(lines)
