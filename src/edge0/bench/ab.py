"""`edge0 bench MODEL_DIR --arms prerouter,ondemand,resident ...`: the decode A/B.

Every arm runs in its own process; `prerouter` and `ondemand` run under a cgroup memory cap,
`resident` (every expert in memory: the compute-only step C) without one. Arm order rotates
each round, each arm warms up first, and all arms replay the same token sequence. The disk's
cold O_DIRECT bandwidth is measured once, to price each arm's bytes as disk time D. Overlap
can at best turn C + D into max(C, D); the table reports how close each arm comes.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from edge0 import cgroup, corpus, memory, modeldir
from edge0.store.expert_file import FILE_NAME as EXPERTS_FILE
from edge0.store.expert_file import read_table

ARMS = ("prerouter", "ondemand", "resident")
# Anonymous memory beyond the floor and the pool, on the 32-layer 2048-wide synthetic model:
# 0.36 GiB after load (torch, tokenizer, Python, malloc's retained heap), 0.11 GiB more
# while decoding, plus the prerouter's heads (0.18 GiB stacked in fp32 at that shape; the
# floor estimate here counts only the resident file). With 600 MiB the prerouter arm was
# OOM-killed under a 3.3 GiB cap once routing touched the whole pool.
RUNTIME_RESERVE = 1 << 30


@dataclass
class BenchConfig:
    arms: tuple[str, ...] = ARMS
    top_k: int | None = None
    memory_cap: int = 1 << 30
    tokens: int = 64
    rounds: int = 3
    warmup: int = 8
    io_mode: str = "direct"
    io_threads: int = 8
    expert_cache: int | None = None
    prerouter: Path | None = None
    threads: int | None = None


def base(arm: str) -> str:
    """'resident+nolora' -> 'resident': an arm, optionally served without the LoRA."""
    return arm.partition("+")[0]


def disk_bandwidth(path: Path, extent: int, reads: int = 48) -> float:
    """Cold O_DIRECT bytes/s for random extent-sized reads of this file."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        buf = mmap.mmap(-1, extent)
        rng = random.Random(0)
        slots = size // extent
        t0 = time.perf_counter()
        for _ in range(reads):
            os.preadv(fd, [buf], rng.randrange(0, slots - 1) * extent)

        return reads * extent / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def replay_tokens(model_dir: Path, n: int) -> list[int]:
    """n token ids of held-out stdlib text, tokenized with the model's own tokenizer."""
    from edge0.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    ids: list[int] = []
    for doc in corpus.documents("heldout"):
        ids += tok.encode(doc.text)
        if len(ids) >= n:
            return ids[:n]
    raise ValueError("the held-out corpus is shorter than the requested replay")


def warm_start_heads(model_dir: Path, out: Path, k: int) -> Path:
    """Untrained heads (the next router applied to the current state) for a model without any:
    for speed, what matters is that the prediction is the routing, not its accuracy."""
    from edge0.loader import load_edge0_model
    from edge0.prerouter.head import Prerouter, Wiring

    _, model = load_edge0_model(model_dir)
    cfg = model.config
    pre = Prerouter(Wiring.default(model.moe_layers), cfg.hidden_size, cfg.num_experts)
    pre.warm_start({c: model.moe_block(c).gate.weight for c in pre.wiring.consumers})
    pre.save(out, {"model": model_dir.name, "K": str(k), "phase": "warm-start"})
    return out


def run_arm(spec: dict, cap: int | None, workdir: Path) -> dict:
    spec_path = workdir / f"{spec['arm']}.spec.json"
    out_path = workdir / f"{spec['arm']}.out.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "edge0.bench.arm", str(spec_path), str(out_path)]
    if cap is None:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        usage, code, err = None, proc.returncode, proc.stderr
    else:
        res = cgroup.run_capped(cmd, cap)
        usage, code, err = res.max_usage_bytes, res.returncode, res.stderr
    if code != 0:
        why = f"exit {code}"
        if code == -9 and cap is not None:
            why += f": killed, most likely by the {memory.format_bytes(cap)} memory cap"
        raise RuntimeError(f"bench arm {spec['arm']} failed ({why}):\n{err[-2000:]}")

    result = json.loads(out_path.read_text())
    result["cgroup_max_usage_bytes"] = usage
    return result


def run_bench(model_dir: Path, cfg: BenchConfig) -> dict:
    model_dir = Path(model_dir)
    manifest = modeldir.Manifest.load(model_dir)
    table, extent, meta = read_table(model_dir / EXPERTS_FILE)
    expert_bytes = sum(t.count for t in table.values()) * extent
    k = cfg.top_k or manifest.served_top_k or manifest.native_top_k
    if any(base(a) not in ARMS or a.partition("+")[2] not in ("", "nolora") for a in cfg.arms):
        raise ValueError(f"--arms: choose from {', '.join(ARMS)}, each optionally +nolora")
    capped = [a for a in cfg.arms if base(a) != "resident"]
    if capped and not cgroup.available():
        raise PermissionError("memory caps need root and cgroup v1 (/sys/fs/cgroup/memory)")
    floor = (model_dir / modeldir.RESIDENT_FILE).stat().st_size * 2  # bf16 on disk, fp32 in memory
    pool = cfg.expert_cache or cfg.memory_cap - floor - RUNTIME_RESERVE
    staging = (len(table) + 1) * k * extent  # every consumer staged + one layer read exactly
    if capped and pool < staging:
        raise ValueError(
            f"--memory-cap {memory.format_bytes(cfg.memory_cap)} leaves "
            f"{memory.format_bytes(pool)} for experts; staging needs about "
            f"{memory.format_bytes(staging)}"
        )
    if "resident" in map(base, cfg.arms) and expert_bytes + floor > memory.mem_available():
        raise ValueError(
            f"the resident arm needs every expert in memory ({memory.format_bytes(expert_bytes)}"
            f" + floor {memory.format_bytes(floor)}), more than the "
            f"{memory.format_bytes(memory.mem_available())} available; drop it from --arms"
        )
    tokens = replay_tokens(model_dir, 1 + cfg.warmup + cfg.tokens)
    bandwidth = disk_bandwidth(model_dir / EXPERTS_FILE, extent)
    results: dict[str, list[dict]] = {a: [] for a in cfg.arms}
    notes = []
    with tempfile.TemporaryDirectory(prefix="edge0-bench-") as tmp:
        heads = cfg.prerouter or model_dir / modeldir.PREROUTER_FILE
        if "prerouter" in cfg.arms and not heads.exists():
            heads = warm_start_heads(model_dir, Path(tmp) / "warm.safetensors", k)
            notes.append("no prerouter.safetensors: the prerouter arm used warm-start heads")
        for r in range(cfg.rounds):
            order = list(cfg.arms[r % len(cfg.arms) :]) + list(cfg.arms[: r % len(cfg.arms)])
            for arm in order:
                spec = {
                    "arm": arm,
                    "model_dir": str(model_dir),
                    "top_k": k,
                    "tokens": tokens,
                    "warmup": cfg.warmup,
                    "io_mode": cfg.io_mode,
                    "io_threads": cfg.io_threads,
                    "expert_cache": expert_bytes if base(arm) == "resident" else pool,
                    "prerouter": str(heads),
                    "threads": cfg.threads,
                }
                results[arm].append(
                    run_arm(spec, None if base(arm) == "resident" else cfg.memory_cap, Path(tmp))
                )
    return summarize(results, cfg, k, bandwidth, expert_bytes, pool, meta, notes)


def _median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def summarize(results, cfg, k, bandwidth, expert_bytes, pool, meta, notes) -> dict:
    arms = {}
    for arm, rounds in results.items():
        keys = (
            "step_ms",
            "disk_ms_per_step",
            "blocked_ms_per_step",
            "bytes_per_step",
            "reads_per_step",
            "mib_per_read",
            "cache_hits_per_step",
            "loads_per_step",
            "head_ms_per_step",
        )
        arms[arm] = {
            "decode_tok_s": {
                "median": _median(rounds, "decode_tok_s"),
                "rounds": [r["decode_tok_s"] for r in rounds],
            },
            **{key: _median(rounds, key) for key in keys},
            "dropped": sum(r["dropped"] for r in rounds),
            "peak_anon_bytes": max(r["peak_anon_bytes"] for r in rounds),
            "peak_file_bytes": max(r["peak_file_bytes"] for r in rounds),
            "cgroup_max_usage_bytes": max((r["cgroup_max_usage_bytes"] or 0) for r in rounds)
            or None,
            "pool_bytes": rounds[0]["pool_bytes"],
        }
        arms[arm]["D_ms"] = 1e3 * arms[arm]["bytes_per_step"] / bandwidth
    c_ms = arms["resident"]["step_ms"] if "resident" in arms else None
    for a in arms.values():
        if c_ms is not None:
            a["bound_ms"] = max(c_ms, a["D_ms"])
            a["step_over_bound"] = a["step_ms"] / a["bound_ms"]
    speedup = None
    if "prerouter" in arms and "ondemand" in arms:
        speedup = (
            arms["prerouter"]["decode_tok_s"]["median"] / arms["ondemand"]["decode_tok_s"]["median"]
        )
    return {
        "top_k": k,
        "memory_cap_bytes": cfg.memory_cap,
        "expert_pool_bytes": pool,
        "expert_bytes": expert_bytes,
        "experts_over_cap": expert_bytes / cfg.memory_cap,
        "disk_bandwidth_bytes_per_s": bandwidth,
        "C_ms": c_ms,
        "tokens": cfg.tokens,
        "rounds": cfg.rounds,
        "io_mode": cfg.io_mode,
        "torch_threads": torch.get_num_threads(),
        "random_weights": meta.get("random_weights") == "true",
        "arms": arms,
        "prerouter_over_ondemand": speedup,
        "notes": notes,
    }


def report(s: dict) -> str:
    lines = []
    if s["random_weights"]:
        lines.append("model: RANDOM WEIGHTS (speed and memory only)")
    lines.append(
        f"K={s['top_k']}  cap {memory.format_bytes(s['memory_cap_bytes'])}  experts "
        f"{memory.format_bytes(s['expert_bytes'])} ({s['experts_over_cap']:.1f}x cap)  "
        f"pool {memory.format_bytes(s['expert_pool_bytes'])}  disk "
        f"{s['disk_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s  C = "
        f"{s['C_ms'] if s['C_ms'] is None else round(s['C_ms'], 1)} ms"
    )
    lines.append(
        "| arm | tok/s (median) | step ms | D ms | max(C,D) | step/bound | blocked ms | "
        "MiB/step | reads/step | hits/step | dropped | peak anon | peak file |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for arm, a in s["arms"].items():
        lines.append(
            f"| {arm} | {a['decode_tok_s']['median']:.2f} | {a['step_ms']:.1f} | {a['D_ms']:.1f} | "
            f"{a.get('bound_ms', nan):.1f} | {a.get('step_over_bound', nan):.2f} | "
            f"{a['blocked_ms_per_step']:.1f} | {a['bytes_per_step'] / 2**20:.2f} | "
            f"{a['reads_per_step']:.1f} | {a['cache_hits_per_step']:.1f} | {a['dropped']} | "
            f"{memory.format_bytes(a['peak_anon_bytes'])} | "
            f"{memory.format_bytes(a['peak_file_bytes'])} |"
        )
    if s["prerouter_over_ondemand"]:
        lines.append(f"prerouter / on-demand decode: {s['prerouter_over_ondemand']:.2f}x")
    lines += [f"note: {n}" for n in s["notes"]]
    return "\n".join(lines)
