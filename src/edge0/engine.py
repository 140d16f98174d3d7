"""The engine: one model, one expert pool, one request's state at a time.

It owns everything a request touches (KV cache, prerouter features, staged slots) and resets
it between requests, so no output depends on an earlier request. The expert pool is shared
across requests: that is the cache. Executors are installed explicitly per phase and layer
role: whole-layer for prefill; at decode, staged for prediction-routed layers and exact for
the rest. Without a prerouter (or with no_prerouter) every layer is gate-routed and exact.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from edge0 import int4_layout, lora, memory, modeldir
from edge0.loader import load_edge0_model
from edge0.models.base import Forward
from edge0.prerouter.head import Prerouter, StackedHeads
from edge0.prerouter.runtime import PrerouterRuntime
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

DEFAULT_IO_MODE = "direct"


@dataclass
class EngineOptions:
    top_k: int | None = None  # serve this many experts per token (default: native)
    memory_budget: int | None = None  # bytes for resident floor + expert pool
    expert_cache: int | None = None  # bytes for the expert pool (overrides the budget split)
    io_mode: str = DEFAULT_IO_MODE
    io_threads: int = 4
    relayout: str = "cache"  # codes in another arrangement than the host's: "cache" or "on-read"
    cache_dir: Path | None = None  # where "cache" keeps repacked copies (default ~/.cache/edge0)
    dtype: torch.dtype = torch.float32
    max_context: int = 4096  # sizes the KV part of the resident floor
    read_delay_s: float = 0.0  # extra latency per read (tests of overlap)
    prerouter: Path | None = None  # heads file (default: MODEL_DIR/prerouter.safetensors if any)
    no_prerouter: bool = False  # gate-route every layer: the exact path, no heads, no slots
    lora: Path | None = None  # adapter file (default: MODEL_DIR/lora.safetensors if any)
    no_lora: bool = False  # serve the base projections only
    lora_any_base: bool = False  # load an adapter whose base_hash differs from this model's


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


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    stats: GenerationStats = field(default_factory=GenerationStats)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Engine:
    """Loads an edge0 directory and generates from it; see the module docstring."""

    def __init__(self, model_dir: Path | str, options: EngineOptions | None = None):
        self.options = opts = options or EngineOptions()
        self.path = Path(model_dir)
        self.manifest, self.model = load_edge0_model(self.path, opts.dtype, experts="streaming")
        self.config = cfg = self.model.config
        self.top_k = opts.top_k or self.manifest.served_top_k or cfg.num_experts_per_tok
        if self.top_k != cfg.num_experts_per_tok:
            self.model.set_top_k(self.top_k)

        self.tokenizer = load_tokenizer(self.path)
        self.eos = eos_ids(self.path, self.tokenizer)
        self.moe_layers = self.model.moe_layers

        self.lora_meta: dict[str, str] = {}
        lora_path = opts.lora or self.path / modeldir.LORA_FILE
        if not opts.no_lora and (opts.lora is not None or lora_path.exists()):
            self.lora_meta = lora.load(
                self.model,
                lora_path,
                base_hash=modeldir.base_hash(self.path),
                allow_other_base=opts.lora_any_base,
            )
            self.model.to(opts.dtype)

        heads, self.prerouter_meta = None, {}
        heads_path = opts.prerouter or self.path / modeldir.PREROUTER_FILE
        if not opts.no_prerouter and (opts.prerouter is not None or heads_path.exists()):
            heads, self.prerouter_meta = Prerouter.load(  # fp16 as stored: only stacked below
                heads_path, cfg.hidden_size, cfg.num_experts, self.moe_layers, torch.float16
            )
            trained_k = self.prerouter_meta.get("K")
            if trained_k and int(trained_k) != self.top_k:
                log.warning(
                    "%s was trained at K=%s; serving K=%d", heads_path, trained_k, self.top_k
                )

        # The kernel's arrangement on this machine, checked by one small matmul before serving.
        host = int4_layout.host_layout()
        int4_layout.self_check(host)
        layout = self.manifest.layout()
        experts_path = experts_for_host(
            self.path,
            layout,
            self.manifest.files.get(EXPERTS_FILE),
            host,
            opts.relayout,
            opts.cache_dir,
        )
        kv_bytes = self.model.cache_bytes(opts.max_context, opts.dtype)
        self.floor_bytes = (
            param_bytes(self.model) + kv_bytes + (StackedHeads.nbytes(heads) if heads else 0)
        )
        self.pool = ExpertPool(
            ExpertFile(experts_path, opts.io_mode),
            layout.with_int4(host),
            self._pool_bytes(layout.nbytes),
            io_threads=opts.io_threads,
            read_delay_s=opts.read_delay_s,
        )
        self._experts = {i: self.model.moe_block(i).experts for i in self.moe_layers}
        self._exact = {i: ExactExecutor(self.pool, i) for i in self.moe_layers}
        self._decode = self._exact
        self.prerouter: PrerouterRuntime | None = None
        if heads is not None:
            self.prerouter = PrerouterRuntime(heads, self.model, self.pool)
            self._decode = {
                i: StagedExecutor(self.pool, i, self.prerouter)
                if i in self.prerouter.consumers
                else self._exact[i]
                for i in self.moe_layers
            }
        self.cache = self.model.new_cache()

    def _pool_bytes(self, extent: int) -> int:
        opts, cfg = self.options, self.config
        total = len(self.moe_layers) * cfg.num_experts * extent
        minimum = self.top_k * extent  # one layer's routed experts at a time
        if opts.expert_cache is not None:
            pool = opts.expert_cache
        elif opts.memory_budget is not None:
            pool = opts.memory_budget - self.floor_bytes
            if pool < minimum:
                raise ValueError(
                    f"--memory-budget {memory.format_bytes(opts.memory_budget)} is below the "
                    f"resident "
                    f"floor {memory.format_bytes(self.floor_bytes)} plus the minimum expert pool "
                    f"{memory.format_bytes(minimum)} ({self.top_k} experts of {extent} bytes)"
                )
        else:  # everything if it fits in a quarter of what the machine has free
            pool = min(total, max(minimum, memory.mem_available() // 4))
        if pool < minimum:
            raise ValueError(
                f"--expert-cache {memory.format_bytes(pool)} holds fewer than "
                f"{self.top_k} experts of {extent} bytes"
            )
        return min(pool, total)

    # -- per-request state ------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the current request: KV cache, head features, staged pins. The expert
        cache is kept."""
        self.cache = self.model.new_cache()
        if self.prerouter is not None:
            self.prerouter.reset()

    @property
    def position(self) -> int:
        return self.cache.length[0]

    def _use(self, executors: dict[int, object]) -> None:
        for i, ex in executors.items():
            self._experts[i].executor = ex

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Run prompt tokens (appended to the current state); returns the last logits [V]."""
        if not ids:
            raise ValueError("the prompt is empty")
        plan = PrefillPlan(
            self.pool, self.moe_layers, self.config.num_experts, len(ids) * self.top_k
        )
        self._use({i: WholeLayerExecutor(self.pool, i, plan) for i in self.moe_layers})
        pre = self.prerouter
        try:
            x = torch.tensor([ids], dtype=torch.long)
            fwd = Forward(self.cache, observer=pre.observe if pre else None)  # gates route prompts
            logits = self.model(x, fwd, last_only=True)
        finally:
            plan.release_all()
        if pre is not None:
            pre.flush()  # heads on the last prompt position: the first decode token is predicted
        return logits[0, -1].float()

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """One decode step; returns the next logits [V]. With a prerouter, the consumers route
        by last step's predictions and this step's flush starts the next step's reads."""
        self._use(self._decode)
        x = torch.tensor([[token]], dtype=torch.long)
        pre = self.prerouter
        if pre is None:
            return self.model(x, Forward(self.cache), last_only=True)[0, -1].float()
        logits = self.model(
            x, Forward(self.cache, dict(pre.predicted), pre.observe), last_only=True
        )
        pre.flush()
        return logits[0, -1].float()

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingParams | None = None,
        on_token: Callable[[int, torch.Tensor], bool | None] | None = None,
    ) -> Generation:
        """Reset, prefill, then sample up to max_tokens.

        on_token(token, logits) sees each sampled token and the logits [V] it was drawn
        from (before temperature); returning True stops the generation (finish "stop").
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        sampler = Sampler(sampling or SamplingParams())
        self.reset()
        out = Generation()
        before = self.pool.stats.snapshot()
        pre_before = self.prerouter.stats.snapshot() if self.prerouter else None
        steps, decode_s = 0, 0.0
        with memory.PeakSampler() as peaks:
            t0 = time.perf_counter()
            logits = self.prefill(prompt)
            prefill_s = time.perf_counter() - t0
            mid = self.pool.stats.snapshot()
            for i in range(max_tokens):
                token = sampler(logits)
                if token in self.eos:
                    out.finish_reason = "stop"
                    break
                out.tokens.append(token)
                if on_token is not None and on_token(token, logits):
                    out.finish_reason = "stop"
                    break
                if i + 1 < max_tokens:
                    t = time.perf_counter()
                    logits = self.step(token)
                    decode_s += time.perf_counter() - t
                    steps += 1
        self._fill_stats(
            out.stats,
            len(prompt),
            len(out.tokens),
            steps,
            prefill_s,
            decode_s,
            self.pool.stats.minus(before),
            self.pool.stats.minus(mid),
            peaks,
        )
        if self.prerouter is not None:
            now, s = self.prerouter.stats, out.stats
            s.prediction_routed_layers = len(self.prerouter.consumers)
            s.staged_experts = now.staged - pre_before.staged
            s.dropped = now.dropped - pre_before.dropped
            s.head_ms_per_token = (now.head_ns - pre_before.head_ns) / 1e6 / max(1, steps + 1)
        return out

    def _fill_stats(
        self,
        s: GenerationStats,
        n_prompt: int,
        n_gen: int,
        steps: int,
        prefill_s: float,
        decode_s: float,
        total: PoolStats,
        decode: PoolStats,
        peaks,
    ) -> None:
        """Decode rates count decode steps (forward passes), not the token prefill produced."""
        s.prompt_tokens, s.generated_tokens = n_prompt, n_gen
        s.prefill_s, s.decode_s = prefill_s, decode_s
        s.prefill_tok_s = n_prompt / prefill_s if prefill_s > 0 else 0.0
        s.decode_tok_s = steps / decode_s if decode_s > 0 else 0.0
        s.peak_anon_bytes, s.peak_file_bytes = peaks.peak_anon, peaks.peak_file
        s.bytes_read, s.reads, s.cache_hits = total.bytes_read, total.reads, total.hits
        s.blocked_ms_per_token = decode.blocked_ns / 1e6 / steps if steps else 0.0
        s.expert_pool_bytes = self.pool.capacity_bytes
        s.resident_floor_bytes = self.floor_bytes

    def close(self) -> None:
        if self.prerouter is not None:
            self.prerouter.close()
        self.pool.close()
