"""`edge0 bench MODEL_DIR --arms prerouter,ondemand,resident ...`: the decode A/B.

Every arm runs in its own process; `prerouter` and `ondemand` run under a cgroup memory cap,
`resident` (every expert in memory: the compute-only step C) without one. Arm order rotates
each round, each arm warms up first, and all arms replay the same token sequence. The disk's
cold O_DIRECT bandwidth is measured once, to price each arm's bytes as disk time D. Overlap
can at best turn C + D into max(C, D); the table reports how close each arm comes.
"""

from __future__ import annotations

import contextlib
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

from edge0 import modeldir
from edge0.engine import backends
from edge0.engine.options import EngineOptions
from edge0.engine.plan import RUNTIME_RESERVE, plan_for_dir, resolve_top_k
from edge0.store.expert_file import FILE_NAME as EXPERTS_FILE
from edge0.store.expert_file import read_table
from edge0.text import corpus
from edge0.util import cgroup, memory
from edge0.util.throttle import ReadThrottle

ARMS = ("prerouter", "ondemand", "resident")


@dataclass
class BenchConfig:
    arms: tuple[str, ...] = ARMS
    top_k: int | None = None
    memory_cap: int = 1 << 30
    tokens: int = 64
    rounds: int = 3
    warmup: int = 8
    io_mode: str = EngineOptions.io_mode
    io_threads: int = EngineOptions.io_threads
    expert_cache: int | None = None
    prerouter: Path | None = None
    threads: int | None = None
    read_bandwidth: int | None = None  # bytes/s the capped arms read the disk at (a throttle)


def _valid_arm(arm: str) -> bool:
    name, _, variant = arm.partition("+")
    wide = name == "prerouter" and variant[:1] == "w" and variant[1:].isdigit()
    heads = name == "prerouter" and variant in ("thread", "inline")
    return name in ARMS and (variant in ("", "nolora", "torch", "int8", "bf16") or wide or heads)


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
    from edge0.text.tokenizer import load_tokenizer

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
    from edge0.modeldir.loader import load_edge0_model
    from edge0.prerouter.head import Prerouter, Wiring

    _, model = load_edge0_model(model_dir)
    cfg = model.config
    pre = Prerouter(Wiring.default(model.moe_layers), cfg.hidden_size, cfg.num_experts)
    pre.warm_start({c: model.moe_block(c).gate.weight for c in pre.wiring.consumers})
    pre.save(out, {"model": model_dir.name, "K": str(k), "phase": "warm-start"})
    return out


def throttled_bandwidth(path: Path, extent: int, throttle: ReadThrottle) -> float:
    """disk_bandwidth measured by a child process inside the read throttle, over about a
    second of reads (the kernel lets a first slice through unthrottled: 48 reads measured
    1.44 GB/s under 1 GB/s), and never above the throttle's rate."""
    reads = max(48, throttle.rate // extent)
    code = (
        "import sys; from pathlib import Path; from edge0.bench.ab import disk_bandwidth; "
        "print(disk_bandwidth(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))"
    )
    cmd = [sys.executable, "-c", code, str(path), str(extent), str(reads)]
    proc = subprocess.run(
        cgroup.joining(cmd, (throttle.procs,)), capture_output=True, text=True, check=True
    )
    return min(float(proc.stdout.split()[-1]), throttle.rate)


def run_arm(
    spec: dict, cap: int | None, workdir: Path, throttle: ReadThrottle | None = None
) -> dict:
    spec_path = workdir / f"{spec['arm']}.spec.json"
    out_path = workdir / f"{spec['arm']}.out.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "edge0.bench.arm", str(spec_path), str(out_path)]
    if cap is None:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        usage, code, err = None, proc.returncode, proc.stderr
    else:
        res = cgroup.run_capped(cmd, cap, also=(throttle.procs,) if throttle else ())
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
    if manifest.source.get("random_weights") is True:  # (synth records it in the manifest)
        meta = {**meta, "random_weights": "true"}
    expert_bytes = sum(t.count for t in table.values()) * extent
    if not all(_valid_arm(a) for a in cfg.arms):
        raise ValueError(
            f"--arms: choose from {', '.join(ARMS)}, each optionally +nolora, +torch, +int8 or "
            "+bf16, and prerouter+wN (a stage width of N experts), prerouter+thread or +inline"
        )
    capped = [a for a in cfg.arms if base(a) != "resident"]
    if capped and not cgroup.available():
        raise PermissionError("memory caps need root and cgroup v1 (/sys/fs/cgroup/memory)")
    tokens = replay_tokens(model_dir, 1 + cfg.warmup + cfg.tokens)
    if capped:  # compiled (once) here, not in an arm under its cap: the compiler took ~1 GiB
        backends.choose(EngineOptions())  # ("auto": builds the native library)
    results: dict[str, list[dict]] = {a: [] for a in cfg.arms}
    notes = []
    with contextlib.ExitStack() as stack:
        throttle = None
        if cfg.read_bandwidth is not None:  # the kernel limits the capped arms' disk reads
            throttle = stack.enter_context(
                ReadThrottle(model_dir / EXPERTS_FILE, cfg.read_bandwidth)
            )
            bandwidth = throttled_bandwidth(model_dir / EXPERTS_FILE, extent, throttle)
            dev = "{}:{}".format(*throttle.device)
            notes.append(
                f"capped arms read device {dev} through a cgroup v{throttle.version} read "
                f"throttle of {cfg.read_bandwidth / 1e9:.2f} GB/s"
            )
        else:
            bandwidth = disk_bandwidth(model_dir / EXPERTS_FILE, extent)
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="edge0-bench-"))
        k = resolve_top_k(cfg.top_k, manifest.served_top_k, manifest.native_top_k)
        heads = cfg.prerouter or model_dir / modeldir.PREROUTER_FILE
        with_heads = "prerouter" in map(base, cfg.arms)
        if with_heads and not heads.exists():
            heads = warm_start_heads(model_dir, Path(tmp) / "warm.safetensors", k)
            notes.append("no prerouter.safetensors: the prerouter arm used warm-start heads")
        # Every capped arm gets the pool the serving plan gives the prerouter arm under the cap
        # (its floor holds the heads): the arms differ in routing, not in memory.
        opts = EngineOptions(
            top_k=k,
            expert_cache=cfg.expert_cache if capped else expert_bytes,
            prerouter=heads if with_heads else None,
            no_prerouter=not with_heads,
            prerouter_always=with_heads,
        )
        if capped and cfg.expert_cache is None:
            opts.memory_budget = cfg.memory_cap - RUNTIME_RESERVE
        try:
            plan = plan_for_dir(model_dir, opts)
        except ValueError as e:
            raise ValueError(
                f"--memory-cap {memory.format_bytes(cfg.memory_cap)} less the runtime's "
                f"{memory.format_bytes(RUNTIME_RESERVE)}: {e}"
            ) from e
        pool, floor = plan.pool_bytes, plan.floor.total
        if "resident" in map(base, cfg.arms) and expert_bytes + floor > memory.mem_available():
            raise ValueError(
                f"the resident arm needs every expert in memory "
                f"({memory.format_bytes(expert_bytes)} + floor {memory.format_bytes(floor)}), "
                f"more than the {memory.format_bytes(memory.mem_available())} available; drop "
                "it from --arms"
            )
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
                resident = base(arm) == "resident"  # (unthrottled and uncapped: C)
                results[arm].append(
                    run_arm(
                        spec,
                        None if resident else cfg.memory_cap,
                        Path(tmp),
                        None if resident else throttle,
                    )
                )
    return summarize(results, cfg, k, bandwidth, expert_bytes, pool, meta, notes)


def _median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def summarize(results, cfg, k, bandwidth, expert_bytes, pool, meta, notes) -> dict:
    arms = {}
    for arm, rounds in results.items():
        keys = (
            "step_ms",
            "io_thread_ms_per_step",
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
    if c_ms is not None:
        bound(arms, c_ms)
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
        "read_bandwidth": cfg.read_bandwidth,
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


def bound(arms: dict[str, dict], c_ms: float) -> None:
    """Each arm's bound max(C, D) and its step over it, given the compute step C."""
    for a in arms.values():
        a["bound_ms"] = max(c_ms, a["D_ms"])
        a["step_over_bound"] = a["step_ms"] / a["bound_ms"]


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
