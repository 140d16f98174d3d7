"""`edge0 bench --train-step ARM [ARM ...]`: teacher training steps per second, A/B.

An arm is `name:key=value,...` over TeacherConfig fields (shape, batch, seq_len, compile,
autocast_bf16) plus `threads` and `experts=loop` (the per-expert loop the grouped GEMM
replaced). Every (round, arm) runs in its own process, the arm order rotates each round,
and each process trains on the same real tokens (the stdlib's training split, the built-in
teacher's tokenizer) from the same initial weights. Reported per arm: the first step (it
includes torch.compile's compilation), then medians over rounds of the per-process median
step wall time and CPU time. On a shared machine wall time moves with other people's load;
CPU seconds per step of a one-thread arm move much less, so both are shown.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from edge0 import builtin
from edge0.models.experts import ResidentExperts, for_each_expert, swiglu_dense
from edge0.text import corpus
from edge0.train.teacher import TeacherConfig, TrainStep, build_model
from edge0.util import machine

BENCH_FIELDS = {"threads", "experts"}


class LoopExperts(ResidentExperts):
    """The experts as they ran before the grouped GEMM: one matmul chain per expert."""

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.gate_up_proj, self.down_proj
        return for_each_expert(x, indices, lambda e, xs: swiglu_dense(xs, w13[e], w2[e]))


def parse_arm(spec: str) -> tuple[str, dict]:
    """'name:threads=1,batch=16' -> ('name', {'threads': 1, 'batch': 16}), values typed."""
    name, _, body = spec.partition(":") if ":" in spec else (spec, "", spec)
    fields = {f.name: f for f in dataclasses.fields(TeacherConfig)}
    values: dict = {}
    for item in filter(None, body.split(",")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--train-step {spec!r}: {item!r} is not key=value")
        if key == "experts":
            if raw not in ("grouped", "loop"):
                raise ValueError(f"--train-step {spec!r}: experts must be grouped or loop")
            values[key] = raw
        elif key == "threads":
            values[key] = int(raw)
        elif key in fields:
            default = getattr(TeacherConfig(), key)
            if isinstance(default, bool):
                values[key] = raw not in ("0", "false")
            else:
                values[key] = (int if default is None else type(default))(raw)
        else:
            raise ValueError(
                f"--train-step {spec!r}: unknown key {key!r}; use TeacherConfig fields, "
                "threads or experts"
            )
    return name, values


def real_tokens(n: int) -> torch.Tensor:
    from edge0.text.tokenizer import load_tokenizer

    tok = load_tokenizer(builtin.teacher_dir())
    ids: list[int] = []
    for doc in corpus.documents("train"):
        ids += tok.encode(doc.text)
        if len(ids) >= n:
            return torch.tensor(ids[:n])
    raise ValueError("the stdlib training split is shorter than the benchmark needs")


def child(values: dict, steps: int, warmup: int) -> dict:
    """Time `steps` training steps after `warmup` in this process."""
    if "threads" in values:
        torch.set_num_threads(values["threads"])
    cfg = TeacherConfig(**{k: v for k, v in values.items() if k not in BENCH_FIELDS})
    torch.manual_seed(0)
    experts = LoopExperts if values.get("experts") == "loop" else ResidentExperts
    model = build_model(cfg, experts)
    step = TrainStep(model, cfg)
    tokens = real_tokens((warmup + steps) * cfg.batch * (cfg.seq_len + 1))
    batches = tokens.view(warmup + steps, cfg.batch, cfg.seq_len + 1)
    walls, cpus, losses = [], [], []
    for i in range(warmup + steps):
        w0, c0 = time.perf_counter(), time.process_time()
        loss, _ = step(batches[i], cfg.lr)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        losses.append(loss)
    return {
        "first_s": walls[0],
        "wall_s": statistics.median(walls[warmup:]),
        "cpu_s": statistics.median(cpus[warmup:]),
        "tokens_per_step": cfg.batch * cfg.seq_len,
        "threads": torch.get_num_threads(),
        "last_loss": losses[-1],
    }


def run(arms: list[str], steps: int = 8, warmup: int = 2, rounds: int = 3) -> dict:
    """Every arm in its own process, `rounds` times, order rotated; medians per arm."""
    parsed = [parse_arm(a) for a in arms]
    results: dict[str, list[dict]] = {name: [] for name, _ in parsed}
    load = [os.getloadavg()[0]]
    for r in range(rounds):
        for name, values in parsed[r % len(parsed) :] + parsed[: r % len(parsed)]:
            cmd = [sys.executable, "-m", "edge0.bench.train_step", json.dumps(values)]
            cmd += [str(steps), str(warmup)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"train-step arm {name} failed:\n{proc.stderr[-2000:]}")
            results[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            load.append(os.getloadavg()[0])
    rows = []
    for name, values in parsed:
        runs = results[name]
        wall = statistics.median(x["wall_s"] for x in runs)
        rows.append(
            {
                "arm": name,
                "settings": values,
                "first_step_s": statistics.median(x["first_s"] for x in runs),
                "step_wall_s": wall,
                "step_cpu_s": statistics.median(x["cpu_s"] for x in runs),
                "tokens_per_s": runs[0]["tokens_per_step"] / wall,
                "wall_s_per_round": [round(x["wall_s"], 3) for x in runs],
            }
        )
    return {
        "cpu": f"{machine.cpu_model()}, {os.cpu_count()} CPUs",
        "capability": torch.backends.cpu.get_cpu_capability(),
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "load_average_1min": [round(x, 2) for x in load],
        "rows": rows,
    }


def report(summary: dict) -> str:
    lines = [
        f"{summary['cpu']} ({summary['capability']}); {summary['rounds']} rounds x "
        f"{summary['steps']} steps after {summary['warmup']} warm-up; 1-min load average "
        f"{min(summary['load_average_1min']):.1f}-{max(summary['load_average_1min']):.1f}",
        "| arm | first step s | step s (wall) | step s (CPU) | tokens/s | per round |",
        "|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        lines.append(
            f"| {r['arm']} | {r['first_step_s']:.1f} | {r['step_wall_s']:.3f} | "
            f"{r['step_cpu_s']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{' '.join(map(str, r['wall_s_per_round']))} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
