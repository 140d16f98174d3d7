"""The engine: a loaded model, its serving plan and expert pool, and the decode policy.

  load_engine(path, options) -> Engine   load the model, plan the memory, open the pool
  Engine.new_request() -> Request        one request's state: its cache, its head features,
                                         the pins of the experts staged for it
  Engine.prefill(req, ids), step(req, t) one forward each; the executors travel in the call's
                                         Forward, nothing is installed into the model
  Engine.generate(prompt, ...)           a Generation: iterate it for (token, logprobs)

Requests share the expert pool (that is the cache) and nothing else, so no output depends on an
earlier request. Prefill runs every layer on the whole-layer path; at decode, prediction-routed
layers run on what was staged for them and the rest on the exact path. Without a prerouter (or
with no_prerouter) every layer is gate-routed and exact.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from edge0 import decode, int4_layout, lora, memory, modeldir
from edge0.loader import load_edge0_model
from edge0.models.layers import KVCache
from edge0.options import EngineOptions
from edge0.plan import ServingPlan, make_plan, model_dir_sizes
from edge0.prerouter.head import Prerouter
from edge0.prerouter.runtime import PrerouterRuntime, PrerouterState, PrerouterStats
from edge0.sampling import Sampler, SamplingParams
from edge0.store.expert_file import FILE_NAME as EXPERTS_FILE
from edge0.store.expert_file import ExpertFile
from edge0.store.pool import ExpertPool, PoolStats
from edge0.store.relayout import experts_for_host
from edge0.streaming.executors import (
    ExactExecutor,
    PrefillPlan,
    StagedExecutor,
    WholeLayerExecutor,
)
from edge0.tokenizer import eos_ids, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters since the engine started (subtract two snapshots for an interval)."""

    pool: PoolStats
    prerouter: PrerouterStats

    def minus(self, other: EngineStats) -> EngineStats:
        return EngineStats(self.pool.minus(other.pool), self.prerouter.minus(other.prerouter))


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    peak_anon_bytes: int = 0
    peak_file_bytes: int = 0
    bytes_read: int = 0
    reads: int = 0
    cache_hits: int = 0
    blocked_ms_per_token: float = 0.0
    expert_pool_bytes: int = 0
    resident_floor_bytes: int = 0
    prediction_routed_layers: int = 0
    staged_experts: int = 0
    dropped: int = 0
    head_ms_per_token: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok, {self.prefill_tok_s:.1f} tok/s | "
            f"generated {self.generated_tokens} tok, {self.decode_tok_s:.2f} tok/s | "
            f"peak anon {memory.format_bytes(self.peak_anon_bytes)}, "
            f"file {memory.format_bytes(self.peak_file_bytes)} | "
            f"read {memory.format_bytes(self.bytes_read)} in {self.reads} reads, "
            f"{self.cache_hits} cache hits | blocked {self.blocked_ms_per_token:.2f} ms/tok"
        )


class Request:
    """One request's state. Its decode executors read this request's staged experts."""

    def __init__(self, cache: KVCache, pre: PrerouterState | None, decode: dict):
        self.cache, self.pre, self.decode = cache, pre, decode

    @property
    def position(self) -> int:
        return self.cache.length[0]

    def release(self) -> None:
        """Unpin what this request staged (it keeps its cache until dropped)."""
        if self.pre is not None:
            self.pre.release()

    def __enter__(self) -> Request:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def load_engine(path: Path | str, options: EngineOptions | None = None) -> Engine:
    """Load an edge0 directory for serving: model, adapters, plan, expert pool, heads."""
    opts = options or EngineOptions()
    path = Path(path)
    manifest, model = load_edge0_model(path, opts.dtype, experts="streaming")
    plan = make_plan(model_dir_sizes(path, manifest, model, opts), opts)
    if plan.top_k != model.config.num_experts_per_tok:
        model.set_top_k(plan.top_k)

    lora_meta: dict[str, str] = {}
    lora_path = opts.lora or path / modeldir.LORA_FILE
    if not opts.no_lora and (opts.lora is not None or lora_path.exists()):
        lora_meta = lora.load(
            model,
            lora_path,
            base_hash=modeldir.base_hash(path),
            allow_other_base=opts.lora_any_base,
        )
        model.to(opts.dtype)

    heads, prerouter_meta = None, {}
    heads_path = opts.prerouter or path / modeldir.PREROUTER_FILE
    if not opts.no_prerouter and (opts.prerouter is not None or heads_path.exists()):
        cfg = model.config
        heads, prerouter_meta = Prerouter.load(  # fp16 as stored: only stacked below
            heads_path, cfg.hidden_size, cfg.num_experts, model.moe_layers, torch.float16
        )
        trained_k = prerouter_meta.get("K")
        if trained_k and int(trained_k) != plan.top_k:
            log.warning("%s was trained at K=%s; serving K=%d", heads_path, trained_k, plan.top_k)

    # The kernel's arrangement on this machine, checked by one small matmul before serving.
    host = int4_layout.host_layout()
    int4_layout.self_check(host)
    layout = manifest.layout()
    experts_path = experts_for_host(
        path, layout, manifest.files.get(EXPERTS_FILE), host, opts.relayout, opts.cache_dir
    )
    pool = ExpertPool(
        ExpertFile(experts_path, opts.io_mode),
        layout.with_int4(host),
        plan.pool_bytes,
        io_threads=opts.io_threads,
    )
    prerouter = PrerouterRuntime(heads, model, pool, opts.dtype) if heads is not None else None
    return Engine(path, opts, manifest, model, plan, pool, prerouter, lora_meta, prerouter_meta)


class Engine:
    """A loaded model and its pool; see the module docstring. Build one with load_engine."""

    def __init__(
        self,
        path: Path,
        options: EngineOptions,
        manifest: modeldir.Manifest,
        model: torch.nn.Module,
        plan: ServingPlan,
        pool: ExpertPool,
        prerouter: PrerouterRuntime | None,
        lora_meta: dict[str, str],
        prerouter_meta: dict[str, str],
    ):
        self.path, self.options, self.manifest, self.model = path, options, manifest, model
        self.plan, self.pool, self.prerouter = plan, pool, prerouter
        self.lora_meta, self.prerouter_meta = lora_meta, prerouter_meta
        self.config = model.config
        self.top_k = plan.top_k
        self.moe_layers = model.moe_layers
        self.tokenizer = load_tokenizer(path)
        self.eos = eos_ids(path, self.tokenizer)
        self._exact = {i: ExactExecutor(pool, i) for i in self.moe_layers}

    @property
    def max_context(self) -> int:
        return self.plan.max_context

    def stats(self) -> EngineStats:
        """A snapshot of the counters (pool reads and hits, prerouter staging and drops)."""
        pre = self.prerouter.stats.snapshot() if self.prerouter else PrerouterStats()
        return EngineStats(self.pool.stats.snapshot(), pre)

    def preload_experts(self) -> None:
        """Read every expert into the pool now (the pool must hold them all): a bench's
        compute-only arm."""
        for layer in self.moe_layers:
            entries = self.pool.request(layer, list(range(self.config.num_experts)))
            self.pool.wait(entries)
            self.pool.release(entries)

    def new_request(self) -> Request:
        """Fresh per-request state: an empty cache for the plan's context, no predictions."""
        cache = self.model.new_cache(self.plan.max_context, self.options.dtype)
        if self.prerouter is None:
            return Request(cache, None, self._exact)
        pre = self.prerouter.new_state()
        decode = {
            i: StagedExecutor(self.pool, i, pre) if i in self.prerouter.consumers else ex
            for i, ex in self._exact.items()
        }
        return Request(cache, pre, decode)

    def check_context(self, req: Request, n: int) -> None:
        """ValueError before any compute if n more tokens do not fit the request's context."""
        if req.position + n > self.plan.max_context:
            raise ValueError(
                f"{req.position} + {n} tokens exceed the context of {self.plan.max_context} "
                "tokens (max_context)"
            )

    @torch.inference_mode()
    def prefill(self, req: Request, ids: list[int]) -> torch.Tensor:
        """Run prompt tokens (appended to the request's state); returns the last logits [V]."""
        if not ids:
            raise ValueError("the prompt is empty")
        self.check_context(req, len(ids))
        plan = PrefillPlan(
            self.pool, self.moe_layers, self.config.num_experts, len(ids) * self.top_k
        )
        executors = {i: WholeLayerExecutor(self.pool, i, plan) for i in self.moe_layers}
        x = torch.tensor([ids], dtype=torch.long)
        try:
            logits = decode.prefill(self.model, req.cache, x, req.pre, executors)
        finally:
            plan.release_all()
        return logits[0].float()

    @torch.inference_mode()
    def step(self, req: Request, token: int) -> torch.Tensor:
        """One decode step; returns the next logits [V]. With a prerouter, the consumers route
        by last step's predictions and this step's flush starts the next step's reads."""
        self.check_context(req, 1)
        x = torch.tensor([[token]], dtype=torch.long)
        return decode.step(self.model, req.cache, x, req.pre, req.decode)[0].float()

    def generate(
        self, prompt: list[int], max_tokens: int, sampling: SamplingParams | None = None
    ) -> Generation:
        """A new request: prefill `prompt`, then sample up to max_tokens. Iterate the result."""
        return Generation(self, prompt, max_tokens, sampling or SamplingParams())

    def close(self) -> None:
        if self.prerouter is not None:
            self.prerouter.close()
        self.pool.close()


class Generation:
    """One request's generation. Iterating it yields (token, logprobs [V]) per sampled token,
    logprobs from the logits it was drawn from (before temperature); it ends at an end-of-text
    token ("stop") or max_tokens ("length"). Breaking out early is allowed: `close()` (or
    reading `stats`) then ends it with finish_reason "stop". Afterwards: tokens, finish_reason,
    stats."""

    def __init__(self, engine: Engine, prompt: list[int], max_tokens: int, sampling):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + max_tokens > engine.max_context:
            raise ValueError(
                f"the prompt's {len(prompt)} tokens plus max_tokens {max_tokens} exceed the "
                f"context of {engine.max_context} tokens (max_context)"
            )
        self.engine, self.prompt, self.max_tokens = engine, prompt, max_tokens
        self.sampler = Sampler(sampling)
        self.tokens: list[int] = []
        self.finish_reason = "stop"
        self._stats: GenerationStats | None = None
        self._it = self._run()

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        return self._it

    def close(self) -> None:
        self._it.close()

    def drain(self) -> Generation:
        """Run to the end without looking at the tokens as they come; returns self."""
        for _ in self._it:
            pass
        return self

    @property
    def stats(self) -> GenerationStats:
        if self._stats is None:
            self.close()
        if self._stats is None:  # closed before it started: nothing ran
            self._stats = GenerationStats(prompt_tokens=len(self.prompt))
        return self._stats

    def _run(self) -> Iterator[tuple[int, torch.Tensor]]:
        eng = self.engine
        req = eng.new_request()
        before = eng.stats()
        steps, decode_s, prefill_s, mid = 0, 0.0, 0.0, before
        peaks = memory.PeakSampler()
        peaks.__enter__()
        try:
            t0 = time.perf_counter()
            logits = eng.prefill(req, self.prompt)
            prefill_s = time.perf_counter() - t0
            mid = eng.stats()
            for i in range(self.max_tokens):
                token = self.sampler(logits)
                if token in eng.eos:
                    return
                self.tokens.append(token)
                yield token, torch.log_softmax(logits, dim=-1)
                if i + 1 == self.max_tokens:
                    self.finish_reason = "length"
                    return
                t = time.perf_counter()
                logits = eng.step(req, token)
                decode_s += time.perf_counter() - t
                steps += 1
        finally:
            peaks.__exit__(None, None, None)
            req.release()
            self._stats = self._fill_stats(eng, before, mid, steps, prefill_s, decode_s, peaks)

    def _fill_stats(self, eng, before, mid, steps, prefill_s, decode_s, peaks) -> GenerationStats:
        """Decode rates count decode steps (forward passes), not the token prefill produced."""
        now = eng.stats()
        total, decode = now.minus(before), now.minus(mid)
        s = GenerationStats(prompt_tokens=len(self.prompt), generated_tokens=len(self.tokens))
        s.prefill_s, s.decode_s = prefill_s, decode_s
        s.prefill_tok_s = len(self.prompt) / prefill_s if prefill_s > 0 else 0.0
        s.decode_tok_s = steps / decode_s if decode_s > 0 else 0.0
        s.peak_anon_bytes, s.peak_file_bytes = peaks.peak_anon, peaks.peak_file
        s.bytes_read, s.reads, s.cache_hits = (
            total.pool.bytes_read,
            total.pool.reads,
            total.pool.hits,
        )
        s.blocked_ms_per_token = decode.pool.blocked_ns / 1e6 / steps if steps else 0.0
        s.expert_pool_bytes = eng.pool.capacity_bytes
        s.resident_floor_bytes = eng.plan.floor.total
        if eng.prerouter is not None:
            s.prediction_routed_layers = len(eng.prerouter.consumers)
            s.staged_experts = total.prerouter.staged
            s.dropped = total.prerouter.dropped
            s.head_ms_per_token = total.prerouter.head_ns / 1e6 / max(1, steps + 1)
        return s
