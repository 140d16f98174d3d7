"""One run of `edge0 bench --peer`, in its own process: load one engine, decode, measure.

Invoked as `python -m edge0.bench.peer_arm SPEC.json OUT.json` by edge0.bench.peer. The spec
names the engine (one of ENGINES), the model, the prompt
ids and how many tokens to sample. Both engines do what their own generate does: prefill the
prompt, then sample a token and run one decode step per token (end-of-sequence ignored, so
every run does the same number of steps). Only the engine under test is imported: the
llama.cpp process never loads torch.

Instruments, all cheap next to a decode step (STYLE 13): a thread reads /proc/self/status
(RssAnon, RssFile; ~0.02 ms a read) every `sample_ms` and keeps the peaks; /proc/self/io
read_bytes (block-device bytes read by every thread of the process, page faults and
O_DIRECT alike) and the process's CPU time are read around the timed steps, with the load
average before them: on a small shared machine a crowded run is visible as such.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

# llama.cpp as shipped repacks Q4_0 weights into anonymous memory at load (CPU_REPACK);
# llama.cpp-mmap (the CLI's --no-repack) computes from the mapped file, so it can page
# edge0-ondemand: experts read as routed (all at load where the pool holds them all), the int4
# kernels on int8 activations (the default, as llama.cpp runs Q4_0); edge0-bf16: the same
# with the exact option's bf16 activations
ENGINES = ("llama.cpp", "llama.cpp-mmap", "edge0-ondemand", "edge0-bf16", "edge0-prerouter")
ON_DEMAND = ("edge0-ondemand", "edge0-bf16")  # the edge0 runs without a prerouter


def status_bytes(fields: tuple[str, ...] = ("RssAnon", "RssFile", "VmHWM")) -> dict[str, int]:
    """The named /proc/self/status fields, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in fields:
                out[name] = int(value.split()[0]) * 1024
    return out


def read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (/proc/self/io read_bytes)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise OSError("/proc/self/io has no read_bytes line")


class StatusSampler:
    """Peak RssAnon and RssFile from /proc/self/status, sampled on a thread."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.peak_anon = 0
        self.peak_file = 0
        self.samples = 0
        self.cost_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-mem", daemon=True)

    def _take(self) -> None:
        t = time.perf_counter()
        s = status_bytes(("RssAnon", "RssFile"))
        self.peak_anon = max(self.peak_anon, s["RssAnon"])
        self.peak_file = max(self.peak_file, s["RssFile"])
        self.samples += 1
        self.cost_s += time.perf_counter() - t

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take()

    def __enter__(self) -> StatusSampler:
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()


def edge0_steps(spec: dict):
    """Load edge0 and yield once after prefill, then once per decode step."""
    import torch

    from edge0.engine.load import load_engine
    from edge0.engine.options import EngineOptions
    from edge0.engine.sampling import Sampler, SamplingParams

    torch.set_num_threads(spec["threads"])
    opts = EngineOptions(
        top_k=spec["top_k"],
        memory_budget=spec["memory_budget"],
        io_mode=spec["io_mode"],
        max_context=spec["n_ctx"],
        prerouter=Path(spec["prerouter"]) if spec["prerouter"] else None,
        no_prerouter=spec["engine"] in ON_DEMAND,
        prerouter_always=spec["engine"] == "edge0-prerouter",
        int4_activations="bf16" if spec["engine"] == "edge0-bf16" else "int8",
    )
    engine = load_engine(spec["model"], opts)
    try:
        sampler = Sampler(SamplingParams(temperature=spec["temperature"], seed=spec["seed"]))
        yield {"pool_bytes": engine.plan.pool_bytes, "floor_bytes": engine.plan.floor.total}
        with engine.new_request() as req:
            logits = engine.prefill(req, spec["prompt"])
            yield None
            while True:
                logits = engine.step(req, sampler(logits))
                yield None
    finally:
        engine.close()


def llama_steps(spec: dict):
    """Load llama.cpp (mmap; repacked or not) and yield once after prefill, then once per step.

    The binding's C API, the calls of llama.cpp's own simple example: `llama_cpp.Llama` has
    no switch for weight repacking (`use_extra_bufts`, the CLI's --no-repack).
    """
    import llama_cpp as ll

    ll.llama_backend_init()
    mp = ll.llama_model_default_params()
    mp.use_mmap = True
    mp.use_extra_bufts = spec["engine"] == "llama.cpp"  # stock: repack into anonymous memory
    model = ll.llama_model_load_from_file(spec["model"].encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {spec['model']}")
    cp = ll.llama_context_default_params()
    cp.n_ctx = cp.n_batch = spec["n_ctx"]
    cp.n_threads = cp.n_threads_batch = spec["threads"]
    ctx = ll.llama_init_from_model(model, cp)
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    try:
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {spec['n_ctx']} tokens")
        # plain temperature sampling, as edge0's sampler at top_p=1 and no top-k
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(spec["temperature"]))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(spec["seed"]))
        yield {"llama_system_info": ll.llama_print_system_info().decode()}

        def decode(ids: list[int]) -> None:
            arr = (ll.llama_token * len(ids))(*ids)
            rc = ll.llama_decode(ctx, ll.llama_batch_get_one(arr, len(ids)))
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")

        decode(spec["prompt"])
        yield None
        while True:
            decode([ll.llama_sampler_sample(chain, ctx, -1)])
            yield None
    finally:
        ll.llama_sampler_free(chain)
        if ctx:
            ll.llama_free(ctx)
        ll.llama_model_free(model)


def run(spec: dict) -> dict:
    steps = llama_steps(spec) if spec["engine"].startswith("llama.cpp") else edge0_steps(spec)
    t0 = time.perf_counter()
    info = next(steps)
    load_s = time.perf_counter() - t0
    times = []
    with StatusSampler(spec["sample_ms"] / 1e3) as peaks:
        t0 = time.perf_counter()
        next(steps)
        prefill_s = time.perf_counter() - t0
        for _ in range(spec["warmup"]):
            next(steps)
        read0, cpu0, load0 = read_bytes(), os.times(), os.getloadavg()[0]
        for _ in range(spec["tokens"]):
            t = time.perf_counter()
            next(steps)
            times.append(time.perf_counter() - t)
        read1, cpu1 = read_bytes(), os.times()
        sampled_s = time.perf_counter() - t0
    steps.close()
    decode_s = sum(times)
    return {
        "engine": spec["engine"],
        "memory_cap_bytes": spec["memory_cap"],
        "memory_budget_bytes": spec["memory_budget"],
        "load_s": load_s,
        "prefill_s": prefill_s,
        "decode_tok_s": len(times) / decode_s,
        "step_ms": sorted(1e3 * t for t in times),
        "read_bytes_per_token": (read1 - read0) / len(times),
        # cores this process kept busy while timed (2.0 = both of 2 threads, all the time);
        # far below its threads with a loadavg above the core count means it was crowded out
        "cpu_busy": (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / decode_s,
        "loadavg_1min_before": load0,
        "peak_anon_bytes": peaks.peak_anon,
        "peak_file_bytes": peaks.peak_file,
        "vm_hwm_bytes": status_bytes(("VmHWM",))["VmHWM"],
        "sampler_reads": peaks.samples,
        "sampler_cost": peaks.cost_s / sampled_s,  # share of one core, not of the step
        **info,
    }


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
