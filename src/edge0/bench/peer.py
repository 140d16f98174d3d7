"""`edge0 bench --peer llama.cpp [HF_DIR]`: edge0 and llama.cpp side by side on one model.

One random Qwen3-MoE checkpoint (`edge0 synth --format hf`, written here at the issue's
bench shape unless HF_DIR is given) is converted twice: by `edge0 convert` (int4 experts)
and by llama.cpp's own converter and quantizer (Q4_0 GGUF, peer_gguf). Each run is one
engine in its own process (peer_arm) under a cgroup-v1 memory cap: none, then fractions
of the experts' int4 size (default 2/3 and 1/3), with edge0 given a memory budget of the
cap less a runtime reserve. Before every run the model files' pages are dropped from the
page cache (fsync + POSIX_FADV_DONTNEED: no global drop_caches, other work keeps its
cache). Rounds repeat every (cap, engine) run with the engine order rotated; medians of
decode tok/s, peaks of anonymous and file-backed memory, bytes read per token.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from edge0 import modeldir
from edge0.bench import peer_gguf
from edge0.bench.peer_arm import ENGINES, ON_DEMAND
from edge0.convert.synth import Shape
from edge0.engine import backends
from edge0.engine.options import EngineOptions
from edge0.engine.plan import RUNTIME_RESERVE, plan_for_dir
from edge0.store.expert_file import FILE_NAME as EXPERTS_FILE
from edge0.store.expert_file import read_table
from edge0.util import cgroup, machine, memory

log = logging.getLogger(__name__)

PEERS = ("llama.cpp",)
# the peer bench's default shape: 2.6 GiB of int4 experts, a 30B-class expert count at 1/4 the width
BENCH_SHAPE = Shape(
    layers=24, hidden=1024, heads=16, kv_heads=4, head_dim=64, experts=128, top_k=8,
    expert_width=512, vocab=512,
)  # fmt: skip
PROMPT = "def read_config(path):\n"


@dataclass
class PeerConfig:
    peer: str = "llama.cpp"
    caps: tuple[str, ...] = ("none", "2/3", "1/3")  # none | a/b of the int4 experts | a size
    tokens: int = 64  # timed decode steps per run
    rounds: int = 3
    warmup: int = 8  # untimed decode steps after the prompt (the cache is still cold)
    threads: int = 2  # llama.cpp n_threads and torch intra-op threads alike
    io_mode: str = "direct"
    temperature: float = 0.7  # edge0 generate's default
    seed: int = 0
    # edge0's budget is the cap less this: Python, torch, the tokenizer and malloc's heap are
    # not in it. Measured on the bench shape under a 1/3 cap: 254 MB of anonymous memory
    # beyond floor + pool, 107 MB file-backed (the libraries); 512 MiB left the pool 94 MB,
    # fewer slots than one token routes (24 layers x 8), and every expert was read again.
    runtime_reserve: int = RUNTIME_RESERVE
    prerouter: Path | None = None  # adds an edge0-prerouter run (default: the model dir's)
    llama_cpp_src: Path | None = None  # llama-cpp-python sdist, see peer_gguf.converter_dir
    sample_ms: float = 20.0  # memory sampler interval
    shape: Shape = field(default_factory=lambda: dataclasses.replace(BENCH_SHAPE))


@dataclass
class Models:
    hf: Path
    edge0: Path
    gguf: Path
    expert_bytes: int  # edge0's int4 extents, what the caps are fractions of


def parse_shape(text: str, base: Shape = BENCH_SHAPE) -> Shape:
    """'layers=8,experts=64' -> base with those fields replaced (names as in synth.Shape)."""
    names = {f.name for f in dataclasses.fields(Shape)}
    values = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in names or not value.strip().isdigit():
            raise ValueError(
                f"shape item {item!r}: write NAME=INT with NAME one of {', '.join(sorted(names))}"
            )
        values[key] = int(value)
    return dataclasses.replace(base, **values)


def resolve_caps(specs: tuple[str, ...], expert_bytes: int) -> list[tuple[str, int | None]]:
    """('none', '2/3', '1G') -> [('none', None), ('2/3', 2/3 of expert_bytes), ('1G', 2**30)]."""
    caps = []
    for spec in specs:
        s = spec.strip().lower()
        if s == "none":
            caps.append((s, None))
            continue
        if "/" in s:
            try:
                frac = Fraction(s)
            except (ValueError, ZeroDivisionError) as e:
                raise ValueError(f"cap {spec!r}: write none, a fraction like 2/3, or 1G") from e
            if not 0 < frac <= 4:
                raise ValueError(f"cap {spec!r}: a fraction of the experts must be in (0, 4]")
            caps.append((s, int(expert_bytes * frac)))
        else:
            caps.append((s, memory.parse_size(s)))
    if not caps:
        raise ValueError("no caps given; e.g. none,2/3,1/3")
    return caps


def engines_for(edge0_dir: Path, prerouter: Path | None) -> list[str]:
    """llama.cpp as shipped and without repacking, edge0 on demand (int8 activations, the
    default, and bf16, the exact option), and edge0 with its prerouter too when there are
    heads."""
    engines = ["llama.cpp", "llama.cpp-mmap", "edge0-ondemand", "edge0-bf16"]
    if prerouter is not None or (edge0_dir / modeldir.PREROUTER_FILE).is_file():
        engines.append("edge0-prerouter")
    assert set(engines) <= set(ENGINES)
    return engines


def rotated(items: list, by: int) -> list:
    k = by % len(items)
    return items[k:] + items[:k]


def shape_name(shape: Shape) -> str:
    return (
        f"synth-l{shape.layers}-d{shape.hidden}-e{shape.experts}x{shape.expert_width}"
        f"-k{shape.top_k}-v{shape.vocab}"
    )


def prepare(work: Path, hf_dir: Path | None, cfg: PeerConfig) -> Models:
    """The HF checkpoint (synthesised if None) and both converted copies; kept across runs."""
    from edge0.convert import convert
    from edge0.convert.synth import synth

    work.mkdir(parents=True, exist_ok=True)
    if hf_dir is None:
        hf_dir = work / shape_name(cfg.shape)
        if not (hf_dir / "model.safetensors.index.json").is_file():
            if hf_dir.exists():
                raise FileExistsError(f"{hf_dir} is an unfinished synth; delete it and rerun")
            synth(hf_dir, cfg.shape, fmt="hf", seed=cfg.seed)
    hf_dir = Path(hf_dir)
    e0 = work / f"{hf_dir.name}.edge0"
    if not (e0 / modeldir.MANIFEST).is_file():
        convert(hf_dir, e0, force=True)
    gguf = work / f"{hf_dir.name}.q4_0.gguf"
    if not gguf.is_file():
        peer_gguf.make_gguf(hf_dir, gguf, work, cfg.llama_cpp_src, cfg.threads)
    table, extent, _ = read_table(e0 / EXPERTS_FILE)
    expert_bytes = sum(t.count for t in table.values()) * extent
    return Models(hf_dir, e0, gguf, expert_bytes)


def drop_page_cache(paths: list[Path]) -> None:
    """Evict these files' pages (written back first), so the next run starts cold."""
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.iterdir()))]
    for f in files:
        if not f.is_file():
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_one(spec: dict, cap: int | None, workdir: Path) -> dict:
    """One engine run in its own process, in a memory cgroup when one can be made."""
    name = f"{spec['engine']}-{spec['cap_label'].replace('/', 'of')}-r{spec['round']}"
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "edge0.bench.peer_arm", str(spec_path), str(out_path)]
    usage = None
    if cgroup.available():  # an uncapped run gets an unlimited group, to read its usage too
        res = cgroup.run_capped(cmd, -1 if cap is None else cap)
        code, err, usage = res.returncode, res.stderr, res.max_usage_bytes
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        code, err = proc.returncode, proc.stderr
    if code == -9 and cap is not None:  # the cgroup's OOM killer: a result, not an error
        result = {"engine": spec["engine"], "killed": f"killed under the {spec['cap_label']} cap"}
    elif code < 0 and not spec["engine"].startswith("edge0"):
        # the peer crashed (llama-cpp-python 0.3.36's repacking path segfaults on an AMX
        # Xeon): a result of the run, reported as such, while the other engines go on
        why = f"crashed: {signal.Signals(-code).name}"
        log.warning("%s %s; its last output:\n%s", name, why, err[-1500:])
        result = {"engine": spec["engine"], "crashed": why}
    elif code != 0:
        raise RuntimeError(f"peer bench run {name} failed (exit {code}):\n{err[-3000:]}")
    else:
        result = json.loads(out_path.read_text())
    result.update(cap_label=spec["cap_label"], round=spec["round"], cgroup_max_usage_bytes=usage)
    return result


def run_peer(work: Path, hf_dir: Path | None, cfg: PeerConfig) -> dict:
    """Prepare both models, run every (round, cap, engine), and summarize."""
    if cfg.peer not in PEERS:
        raise ValueError(f"--peer {cfg.peer!r}: supported peers are {', '.join(PEERS)}")
    if cfg.tokens < 1 or cfg.rounds < 1 or cfg.warmup < 0 or cfg.threads < 1:
        raise ValueError("--tokens, --rounds and --threads must be >= 1, --warmup >= 0")
    version = peer_gguf.installed_version()
    models = prepare(Path(work), hf_dir, cfg)
    caps = resolve_caps(cfg.caps, models.expert_bytes)
    if any(c is not None for _, c in caps) and not cgroup.available():
        raise PermissionError("memory caps need root and cgroup v1 (/sys/fs/cgroup/memory)")
    engines = engines_for(models.edge0, cfg.prerouter)
    from edge0.text.tokenizer import load_tokenizer

    prompt = load_tokenizer(models.edge0).encode(PROMPT)
    n_ctx = 64 * -(-(len(prompt) + cfg.warmup + cfg.tokens + 2) // 64)
    for label, cap in caps:  # the serving plan refuses a cap too small, naming what is missing
        for engine in engines:
            if cap is None or not engine.startswith("edge0"):
                continue
            opts = EngineOptions(
                memory_budget=cap - cfg.runtime_reserve,
                max_context=n_ctx,
                prerouter=cfg.prerouter,
                no_prerouter=engine in ON_DEMAND,
                prerouter_always=engine == "edge0-prerouter",
            )
            try:
                plan_for_dir(models.edge0, opts)
            except ValueError as e:
                raise ValueError(
                    f"cap {label} ({memory.format_bytes(cap)}) less the runtime reserve of "
                    f"{memory.format_bytes(cfg.runtime_reserve)}, {engine}: {e}"
                ) from e
    if any(c is not None for _, c in caps):  # compiled here, not in an arm under its cap
        backends.choose(EngineOptions())  # ("auto": builds the native library)
    runs = []
    with tempfile.TemporaryDirectory(prefix="edge0-peer-") as tmp:
        for r in range(cfg.rounds):
            for ci, (label, cap) in enumerate(caps):
                for engine in rotated(engines, r + ci):
                    llama = engine.startswith("llama.cpp")
                    spec = {
                        "engine": engine,
                        "round": r,
                        "cap_label": label,
                        "memory_cap": cap,
                        "memory_budget": None if cap is None else cap - cfg.runtime_reserve,
                        "model": str(models.gguf if llama else models.edge0),
                        "prompt": prompt,
                        "n_ctx": n_ctx,
                        "tokens": cfg.tokens,
                        "warmup": cfg.warmup,
                        "threads": cfg.threads,
                        "top_k": None,  # native: llama.cpp runs the GGUF's own
                        "io_mode": cfg.io_mode,
                        "prerouter": str(cfg.prerouter) if cfg.prerouter else None,
                        "temperature": cfg.temperature,
                        "seed": cfg.seed + r,
                        "sample_ms": cfg.sample_ms,
                    }
                    drop_page_cache([models.gguf] if llama else [models.edge0])
                    runs.append(run_one(spec, cap, Path(tmp)))
    summary = summarize(runs, caps, engines)
    # ggml's own view of the CPU (AVX-512, VNNI, repack...), next to the kernels torch uses
    ggml = next((r["llama_system_info"] for r in runs if "llama_system_info" in r), None)
    summary.update(
        peer=cfg.peer,
        llama_cpp_python=version,
        machine={**machine.describe(), "llama_cpp_system_info": ggml},
        models={
            "hf": str(models.hf),
            "edge0": str(models.edge0),
            "gguf": str(models.gguf),
            "gguf_bytes": models.gguf.stat().st_size,
            "gguf_tensor_types": peer_gguf.tensor_types(models.gguf),
            "expert_int4_bytes": models.expert_bytes,
            "config": json.loads((models.hf / "config.json").read_text()),
        },
        config={
            k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()
        },
        prompt_tokens=len(prompt),
        n_ctx=n_ctx,
        runs=runs,
    )
    return summary


def summarize(runs: list[dict], caps: list[tuple[str, int | None]], engines: list[str]) -> dict:
    """Per (cap, engine): median tok/s and read bytes per token over the rounds that ran,
    peak memory over them, and how many rounds the cap's OOM killer ended."""
    rows = []
    for label, cap in caps:
        for engine in engines:
            mine = [r for r in runs if r["cap_label"] == label and r["engine"] == engine]
            if not mine:
                continue
            ran = [r for r in mine if "killed" not in r and "crashed" not in r]
            crashed = sorted({r["crashed"] for r in mine if "crashed" in r})
            usage = [r["cgroup_max_usage_bytes"] for r in ran if r["cgroup_max_usage_bytes"]]

            def median(key: str, ran=ran) -> float | None:
                return statistics.median(r[key] for r in ran) if ran else None

            def peak(key: str, ran=ran) -> int | None:
                return max(r[key] for r in ran) if ran else None

            rows.append(
                {
                    "engine": engine,
                    "cap": label,
                    "cap_bytes": cap,
                    "killed_rounds": sum("killed" in r for r in mine),
                    "crashed": crashed,
                    "decode_tok_s": median("decode_tok_s"),
                    "decode_tok_s_rounds": [r["decode_tok_s"] for r in ran],
                    "read_bytes_per_token": median("read_bytes_per_token"),
                    "peak_anon_bytes": peak("peak_anon_bytes"),
                    "peak_file_bytes": peak("peak_file_bytes"),
                    "cgroup_max_usage_bytes": max(usage) if usage else None,
                    "load_s": median("load_s"),
                    "cpu_busy": median("cpu_busy"),
                    "loadavg_1min_before": median("loadavg_1min_before"),
                    "edge0_pool_bytes": ran[0].get("pool_bytes") if ran else None,
                }
            )
    return {"caps": [{"label": lb, "bytes": c} for lb, c in caps], "rows": rows}


def report(s: dict) -> str:
    m = s.get("machine", {})
    lines = [
        f"CPU: {m.get('cpu', '?')} ({m.get('cores', '?')} cores), torch kernels "
        f"{m.get('torch_cpu_capability', '?')}; int4 experts "
        f"{memory.format_bytes(s['models']['expert_int4_bytes'])}, Q4_0 GGUF "
        f"{memory.format_bytes(s['models']['gguf_bytes'])}; RANDOM WEIGHTS (speed and memory)",
        "| cap | engine | tok/s (median) | rounds | load s | read/token | peak anon "
        "| peak file | cgroup max | edge0 pool | cores busy | load before |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(n: float | None) -> str:
        return "-" if n is None else memory.format_bytes(n)

    for row in s["rows"]:
        cap = "none" if row["cap_bytes"] is None else f"{row['cap']} = {fmt(row['cap_bytes'])}"
        usage = row["cgroup_max_usage_bytes"]
        pool = row["edge0_pool_bytes"]
        if row["decode_tok_s"] is None:
            why = ", ".join(row.get("crashed") or ["OOM-killed under the cap"])
            lines.append(f"| {cap} | {row['engine']} | {why} |" + " |" * 9)
            continue
        lines.append(
            f"| {cap} | {row['engine']} | {row['decode_tok_s']:.2f} | "
            f"{', '.join(f'{t:.2f}' for t in row['decode_tok_s_rounds'])} | "
            f"{row['load_s']:.1f} | {fmt(row['read_bytes_per_token'])} | "
            f"{fmt(row['peak_anon_bytes'])} | {fmt(row['peak_file_bytes'])} | {fmt(usage)} | "
            f"{fmt(pool)} | "
            f"{row['cpu_busy']:.2f} | {row['loadavg_1min_before']:.1f} |"
        )
    return "\n".join(lines)
