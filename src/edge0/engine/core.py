"""The engine: a loaded model, its serving plan and expert pool, and the decode policy.

  load_engine(path, options) -> Engine   load the model, plan the memory, open the pool
  Engine.new_request(prompt) -> Request  one request's state: its cache (holding the longest
                                         prefix of `prompt` the prefix cache had), its head
                                         features, the pins of the experts staged for it
  Engine.prefill(req, ids), step(req, t) one forward each; the executors travel in the call's
                                         Forward, nothing is installed into the model
  Engine.step_rows(reqs, tokens)         several requests' decode steps in one forward, each
                                         row with its own state
  Engine.finish(req)                     offer its state to the prefix cache, unpin its experts
  Engine.generate(prompt, ...)           a Generation: iterate it for (token, logprobs), or
                                         advance() it one forward at a time (a scheduler)

Requests share the expert pool (that is the cache) and, through the prefix cache, copies of
the state of tokens they have in common, so no output depends on an earlier request. Prefill
runs every layer on the whole-layer path; at decode, prediction-routed layers run on what was
staged for them and the rest on the exact path. Without a prerouter (or with no_prerouter,
or where the pool holds every expert, unless prerouter_always) every layer is gate-routed and
exact.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from edge0 import modeldir, native
from edge0.engine import decode
from edge0.engine.executors import (
    ExactExecutor,
    FusedExperts,
    PrefillPlan,
    StagedExecutor,
    WholeLayerExecutor,
    decode_experts,
    row_experts,
    rows_together,
)
from edge0.engine.native_layer import native_layers
from edge0.engine.options import INT4_ACTIVATIONS, EngineOptions
from edge0.engine.plan import ServingPlan, make_plan, model_dir_sizes
from edge0.engine.prefix_cache import PrefixCache, PrefixStats
from edge0.engine.sampling import Sampler, SamplingParams
from edge0.formats import int4_layout, quant
from edge0.modeldir.loader import load_edge0_model
from edge0.models import lora
from edge0.models.base import Forward
from edge0.models.layers import CacheSnapshot, KVCache
from edge0.prerouter.head import Prerouter
from edge0.prerouter.runtime import (
    PrerouterRuntime,
    PrerouterState,
    PrerouterStats,
    flush_rows,
)
from edge0.store.expert_file import FILE_NAME as EXPERTS_FILE
from edge0.store.expert_file import ExpertFile
from edge0.store.pool import ExpertPool, PoolStats
from edge0.store.relayout import experts_for_host
from edge0.text.tokenizer import eos_ids, load_tokenizer
from edge0.util import memory

log = logging.getLogger(__name__)


@dataclass
class DecodeStats:
    forwards: int = 0  # decode forwards run
    rows: int = 0  # request steps they ran: rows / forwards is the mean batch

    def snapshot(self) -> DecodeStats:
        return DecodeStats(self.forwards, self.rows)

    def minus(self, other: DecodeStats) -> DecodeStats:
        return DecodeStats(self.forwards - other.forwards, self.rows - other.rows)


@dataclass
class EngineStats:
    """Counters since the engine started (subtract two snapshots for an interval)."""

    pool: PoolStats
    prerouter: PrerouterStats
    prefix: PrefixStats
    decode: DecodeStats

    def minus(self, other: EngineStats) -> EngineStats:
        return EngineStats(
            self.pool.minus(other.pool),
            self.prerouter.minus(other.prerouter),
            self.prefix.minus(other.prefix),
            self.decode.minus(other.decode),
        )


@dataclass
class GenerationStats:
    """One generation's numbers. Pool and prerouter counters are the engine's over the
    generation's lifetime: with several requests interleaved they include the others' work."""

    prompt_tokens: int = 0
    prefix_tokens: int = 0  # of the prompt, restored from the prefix cache (not prefilled)
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
            f"prompt {self.prompt_tokens} tok{self._reused()}, {self.prefill_tok_s:.1f} tok/s | "
            f"generated {self.generated_tokens} tok, {self.decode_tok_s:.2f} tok/s | "
            f"peak anon {memory.format_bytes(self.peak_anon_bytes)}, "
            f"file {memory.format_bytes(self.peak_file_bytes)} | "
            f"read {memory.format_bytes(self.bytes_read)} in {self.reads} reads, "
            f"{self.cache_hits} cache hits | blocked {self.blocked_ms_per_token:.2f} ms/tok"
        )

    def _reused(self) -> str:
        return f" ({self.prefix_tokens} from the prefix cache)" if self.prefix_tokens else ""


class Request:
    """One request's state. Its decode executors read this request's staged experts.

    `tokens` are those its cache holds (restored or fed); the first `exact` of them hold the
    state a fresh prompt of those tokens would get (gate-routed). A prediction-routed decode
    step runs other experts than a prefill of its token would, so it ends the exact part.
    """

    def __init__(self, cache: KVCache, pre: PrerouterState | None, decode: dict):
        self.cache, self.pre, self.decode = cache, pre, decode
        self.tokens: list[int] = []
        self.restored = 0  # of `tokens`, taken from the prefix cache
        self.exact = 0
        # recurrent state cannot be cut back: a copy at `exact` tokens, taken before the first
        # prediction-routed step when there is a prefix cache to offer it to
        self.held: CacheSnapshot | None = None

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
    if opts.expert_kernel == "auto":  # settled now: the plan counts the heads as served
        opts = replace(opts, expert_kernel="fused" if native.available(opts.cache_dir) else "torch")
    if opts.int4_activations not in INT4_ACTIVATIONS:
        raise ValueError(
            f"int4_activations must be one of {', '.join(INT4_ACTIVATIONS)}: "
            f"{opts.int4_activations!r}"
        )
    if opts.expert_kernel == "torch":  # the PyTorch paths are torch's kernel: bf16 activations
        opts = replace(opts, int4_activations="bf16")
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
    if plan.prerouter:  # (not where the pool holds every expert: make_plan)
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
    # Decode on the int8 AVX2 or AVX-512 kernel reads experts in their int8 order, put in as
    # each is read, where the pool holds them all: read once, that costs ~40 us an expert at load.
    # Under a cap every read would pay it again, on the cores that decode (a 1/3 cap on the
    # peer bench shape: 0.87x as fast), so there they stay as stored.
    int8_order = (
        opts.expert_kernel == "fused"
        and opts.int4_activations == "int8"
        and plan.holds_every_expert
        and native.int8_order_pays()
    )
    # Each read's scale pairs turned into the kernel's in one native loop where the native ops
    # run: as torch ops they cost ~85 us an expert of the peer bench shape, on the cores that
    # decode while a prerouter's reads overlap the step.
    kernel_pairs = quant.to_kernel_pairs
    if opts.expert_kernel == "fused":
        kernel_pairs = native.to_kernel_pairs
    pool = ExpertPool(
        ExpertFile(experts_path, opts.io_mode),
        layout.with_int4(host.in_int8_order() if int8_order else host),
        plan.pool_bytes,
        io_threads=opts.io_threads,
        reorder=native.put_in_int8_order if int8_order else None,
        kernel_pairs=kernel_pairs,
    )
    prerouter = None
    if heads is not None:
        prerouter = PrerouterRuntime(
            heads,
            model,
            pool,
            opts.dtype,
            plan.stage_width,
            threaded=opts.heads_thread,
            native=native_heads(opts),
        )
    engine = Engine(path, opts, manifest, model, plan, pool, prerouter, lora_meta, prerouter_meta)
    try:
        if opts.preload and plan.holds_every_expert:
            engine.preload_experts(progress=True)
        else:  # its memory now, not on the decode step's cores at each slot's first read
            pool.fault_in()
    except BaseException:
        engine.close()
        raise
    return engine


def native_heads(opts: EngineOptions) -> tuple[Callable, int] | None:
    """The native head op and its path where decode runs the native ops (the heads' sums
    are then the op's own, the same on every CPU), else None: the heads run in torch."""
    if opts.expert_kernel == "torch":
        return None
    return native.prerouter_head(opts.cache_dir), native.BEST_ISA


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
        # some layer keeps a recurrent state (it cannot be cut back or right-padded)
        self.recurrent = model.new_cache(1, device="meta").recurrent
        self.tokenizer = load_tokenizer(path)
        self.eos = eos_ids(path, self.tokenizer)
        int8 = options.int4_activations == "int8"
        self.decode_experts = decode_experts(
            options.expert_kernel, options.cache_dir, int8, pool.layout.int4
        )
        # prefill's experts, and a batched decode step's, in one native call (else None)
        self.rows_experts = row_experts(self.decode_experts, options.cache_dir)
        # with the native ops, a decode token's norms and attention too, where they serve it
        self._layers = {}
        # and a batched step's attention, row by row in one call
        self.attend_rows = None
        if isinstance(self.decode_experts, FusedExperts):
            self._layers = native_layers(model, options.cache_dir, int8)
            self.attend_rows = native.attend_rows(options.cache_dir)
        # with no heads thread, every request to the pool comes from the thread that decodes
        sole = prerouter is None or prerouter.worker is None
        self._exact = {
            i: ExactExecutor(pool, i, self.decode_experts, sole) for i in self.moe_layers
        }
        bound = plan.floor.prefix_cache
        self.prefix_cache = PrefixCache(bound) if bound else None
        # measured as requests run, for start_together's choice between a restored prefix
        # and the batch: a short prompt's prefill forward of its own, and a prompt token's
        # seconds in a batched prefill
        self.short_prefill_s = MovingAverage()
        self.prompt_token_s = MovingAverage()
        self.decode_stats = DecodeStats()

    @property
    def max_context(self) -> int:
        return self.plan.max_context

    def stats(self) -> EngineStats:
        """A snapshot of the counters (pool reads and hits, prerouter staging and drops)."""
        pre = self.prerouter.stats.snapshot() if self.prerouter else PrerouterStats()
        prefix = self.prefix_cache.stats.snapshot() if self.prefix_cache else PrefixStats()
        return EngineStats(self.pool.stats.snapshot(), pre, prefix, self.decode_stats.snapshot())

    def preload_experts(self, progress: bool = False) -> None:
        """Read every expert into the pool now; the pool must hold them all. load_engine does
        it where it can (EngineOptions.preload), as llama.cpp reads its whole file at load.
        Every read is queued at once, so the I/O threads never wait on this thread."""
        if not self.plan.holds_every_expert:
            raise ValueError(
                f"the expert pool ({memory.format_bytes(self.plan.pool_bytes)}) cannot hold "
                f"every expert ({memory.format_bytes(self.plan.experts_bytes)})"
            )
        n = self.config.num_experts
        t0 = time.perf_counter()
        before = self.pool.stats.bytes_read
        bar = tqdm(
            total=len(self.moe_layers) * n,
            desc="reading experts into memory",
            unit="expert",
            disable=None if progress else True,  # None: off when stderr is not a terminal
        )
        pinned = []
        try:
            for layer in self.moe_layers:
                pinned.append(self.pool.request(layer, list(range(n))))
            for entries in pinned:
                self.pool.wait(entries)
                bar.update(n)
        finally:
            bar.close()
            for entries in pinned:
                self.pool.release(entries)
        log.info(
            "read every expert, %s, in %.2f s",
            memory.format_bytes(self.pool.stats.bytes_read - before),
            time.perf_counter() - t0,
        )

    def new_request(self, prompt: list[int] | None = None, reuse: bool = True) -> Request:
        """Per-request state: a cache for the plan's context, no predictions. With `prompt`
        and a prefix cache, the cache starts with the longest prefix of the prompt that can be
        reused exactly (`req.position` tokens, none with reuse=False); prefill
        `prompt[req.position:]`."""
        cache = self.model.new_cache(self.plan.max_context, self.options.dtype)
        if self.prerouter is None:
            req = Request(cache, None, self._exact)
        else:
            pre = self.prerouter.new_state()
            decode = {
                i: StagedExecutor(self.pool, i, pre, self.decode_experts)
                if i in self.prerouter.consumers
                else ex
                for i, ex in self._exact.items()
            }
            req = Request(cache, pre, decode)
        if prompt and reuse and self.prefix_cache is not None:
            req.restored = req.exact = self.prefix_cache.restore(cache, prompt)
            req.tokens = list(prompt[: req.restored])
        return req

    def finish(self, req: Request) -> None:
        """The end of a request: keep a copy of its state for prefix reuse (if the engine has
        a prefix cache), and unpin what it staged."""
        try:
            if self.prefix_cache is not None:
                self.prefix_cache.save(req.cache, req.tokens[: req.exact], req.held)
        finally:
            req.release()

    def check_context(self, req: Request, n: int) -> None:
        """ValueError before any compute if n more tokens do not fit the request's context."""
        if req.position + n > self.plan.max_context:
            raise ValueError(
                f"{req.position} + {n} tokens exceed the context of {self.plan.max_context} "
                "tokens (max_context)"
            )

    @torch.inference_mode()
    def prefill(self, req: Request, ids: list[int], last: bool = True) -> torch.Tensor:
        """Run prompt tokens (appended to the request's state); returns the last logits [V].
        A prompt may come in several calls; `last=False` says more of it follows, so the heads
        wait for the end of the prompt to predict (and stage) the first decode token."""
        if not ids:
            raise ValueError("the prompt is empty")
        self.check_context(req, len(ids))
        x = torch.tensor([ids], dtype=torch.long)
        t0 = time.perf_counter()
        with self._whole_layers(len(ids)) as executors:
            logits = decode.prefill(self.model, req.cache, x, req.pre, executors, last)
        if len(ids) <= SHORT_PREFILL:
            self.short_prefill_s.add(time.perf_counter() - t0)
        if req.exact == len(req.tokens):
            req.exact += len(ids)
        req.tokens += ids
        return logits[0].float()

    @torch.inference_mode()
    def route(self, windows: torch.Tensor, observer) -> None:
        """Run token windows [B, T] through the model as a prefill does (int4 experts from
        the pool, each layer's own router, nothing cached) so that `observer(layer, h,
        logits, indices)` sees every MoE layer's routing. Phase 1 collects the heads' data
        this way: the routing served, within the memory the plan allows."""
        with self._whole_layers(windows.numel()) as executors:
            self.model.hidden(windows, Forward(observer=observer, executors=executors))

    @contextlib.contextmanager
    def _whole_layers(self, tokens: int) -> Iterator[dict[int, WholeLayerExecutor]]:
        """The prefill executors of every MoE layer for a forward of `tokens` tokens (each
        layer's experts read in runs, the next layer's ahead when the forward touches most of
        them); whatever they still pin is released at the end."""
        plan = PrefillPlan(self.pool, self.moe_layers, self.config.num_experts, tokens * self.top_k)
        try:
            yield {
                i: WholeLayerExecutor(self.pool, i, plan, self.rows_experts)
                for i in self.moe_layers
            }
        finally:
            plan.release_all()

    @torch.inference_mode()
    def prefill_together(self, reqs: list[Request], prompts: list[list[int]]) -> list[torch.Tensor]:
        """Prefill several fresh requests' whole prompts in one forward; returns each one's
        last logits [V]. Prompts are right-padded to the longest: causal attention keeps a
        position from seeing the padding after it, each request's cache gets its own positions
        copied, and its prerouter features are its own rows'. Not for recurrent layers, whose
        state would run on through the padding, nor for a request holding restored tokens."""
        if self.recurrent:
            raise ValueError("recurrent layers cannot be prefilled together (right padding)")
        lengths = [len(ids) for ids in prompts]
        if not all(lengths) or any(req.position for req in reqs):
            raise ValueError("prefill_together takes non-empty prompts of fresh requests")
        for req, n in zip(reqs, lengths, strict=True):
            self.check_context(req, n)
        t = max(lengths)
        x = torch.tensor([ids + [0] * (t - len(ids)) for ids in prompts], dtype=torch.long)
        batch = self.model.new_cache(t, self.options.dtype, batch=len(reqs))
        observer = None
        if self.prerouter is not None:
            states = [req.pre for req in reqs]

            def observer(layer, h, logits, indices):  # each request sees its own rows
                rows = [a.view(len(reqs), t, -1) for a in (h, logits, indices)]
                for i, (pre, n) in enumerate(zip(states, lengths, strict=True)):
                    pre.observe(layer, *(a[i, :n] for a in rows))

        t0 = time.perf_counter()
        with self._whole_layers(sum(lengths)) as executors:
            h = self.model.hidden(x, Forward(batch, observer=observer, executors=executors))
        last = h[torch.arange(len(reqs)), torch.tensor(lengths) - 1]  # [B, D]
        logits = self.model.logits(last[:, None])[:, 0].float()  # [B, V]
        self.prompt_token_s.add((time.perf_counter() - t0) / sum(lengths))
        for i, (req, ids) in enumerate(zip(reqs, prompts, strict=True)):
            req.cache.copy_row(batch, i, len(ids))
            req.exact += len(ids)
            req.tokens += ids
        if self.prerouter is not None:  # heads on the last prompt positions, as decode.prefill
            flush_rows([req.pre for req in reqs])
        return list(logits)

    @torch.inference_mode()
    def step(self, req: Request, token: int) -> torch.Tensor:
        """One decode step; returns the next logits [V]. With a prerouter, the consumers route
        by last step's predictions and this step's flush starts the next step's reads."""
        exact = self._before_step(req)
        x = torch.tensor([[token]], dtype=torch.long)
        logits = decode.step(self.model, req.cache, x, req.pre, req.decode, self._layers)
        logits = logits[0].float()
        self._after_steps([req], [token], [exact])
        return logits

    @torch.inference_mode()
    def step_rows(self, reqs: list[Request], tokens: list[int]) -> list[torch.Tensor]:
        """One decode step of several requests in one forward, each with its own token,
        state, predictions and staged experts; returns each one's next logits [V]. Dense
        layers, norms, routers and the LM head run once over all rows; attention and each
        row's experts run per row (decode.step_rows). A row's logits are its step()'s up to
        the rounding of a matmul over several rows: the int4 kernel rounds activations to
        bf16, so they agree to about one bf16 step of the largest logit."""
        if len({id(r) for r in reqs}) != len(reqs):
            raise ValueError("step_rows takes each request once")
        exact = [self._before_step(req) for req in reqs]
        x = torch.tensor([[t] for t in tokens], dtype=torch.long)
        together = None
        if self.rows_experts is not None and len(reqs) >= ROWS_TOGETHER:
            together = functools.partial(rows_together, self.rows_experts)
        logits = decode.step_rows(
            self.model,
            [r.cache for r in reqs],
            x,
            [r.pre for r in reqs],
            [r.decode for r in reqs],
            together,
            self.attend_rows,
            self._layers,
        ).float()
        self._after_steps(reqs, tokens, exact)
        return list(logits)

    def _before_step(self, req: Request) -> bool:
        """Before a decode step of `req`: its context checked, and with a recurrent state
        to offer the prefix cache, a copy taken while it is exact. Whether it is exact."""
        self.check_context(req, 1)
        exact = req.exact == len(req.tokens)
        if exact and req.pre is not None and self.recurrent and self.prefix_cache:
            req.held = req.cache.snapshot()
        return exact

    def _after_steps(self, reqs: list[Request], tokens: list[int], exact: list[bool]) -> None:
        """After one decode forward of `reqs`: their tokens, exact parts and the counters."""
        for req, token, ex in zip(reqs, tokens, exact, strict=True):
            if ex and req.pre is None:  # gate-routed: the same experts as a prefill
                req.exact += 1
            req.tokens.append(token)
        self.decode_stats.forwards += 1
        self.decode_stats.rows += len(reqs)

    def generate(
        self, prompt: list[int], max_tokens: int, sampling: SamplingParams | None = None
    ) -> Generation:
        """A new request: prefill `prompt` (what the prefix cache does not restore), then
        sample up to max_tokens. Iterate the result, or advance() it (see Generation)."""
        return Generation(self, prompt, max_tokens, sampling or SamplingParams())

    def start_together(self, gens: list[Generation]) -> None:
        """Prefill, in one forward, the prompts of those `gens` that have not started and fit
        one prompt chunk (each then starts decoding from its own logits); the others are left
        to prefill themselves. Seven chat requests arriving at once then wait for one batched
        prefill, not for six others' in turn. A model with recurrent layers takes the usual
        path, and so does a prompt whose restored prefix saves more than the forward of its
        own that the rest then needs (see reuse_beats_batch)."""
        if self.recurrent:
            return
        chunk = self.options.prefill_chunk
        fresh = [
            g
            for g in gens
            if isinstance(g, Generation)
            and g._units is None
            and g._req is None
            and 0 < len(g.prompt) <= chunk
        ]
        if len(fresh) < 2:
            return
        before = self.stats()
        for g in fresh:  # each keeps its request, with what the prefix cache restored
            held = self.prefix_cache.match(g.prompt) if self.prefix_cache is not None else 0
            g._req = self.new_request(g.prompt, reuse=self.reuse_beats_batch(held, len(g.prompt)))
        batch = [g for g in fresh if g._req.position == 0]
        if len(batch) < 2:
            return
        t0 = time.perf_counter()
        try:
            logits = self.prefill_together([g._req for g in batch], [g.prompt for g in batch])
        except BaseException:
            for g in fresh:
                g._req.release()
                g._req = None
            raise
        seconds = time.perf_counter() - t0
        for g, out in zip(batch, logits, strict=True):
            g._prefilled = (out, seconds, before)

    def step_together(self, gens: list[Generation]) -> int:
        """Run the next decode step of those `gens` that wait for one (`pending_step`) in one
        forward (step_rows); each takes its logits at its next advance(). Returns how many
        ran together (none unless at least two wait)."""
        pending = [(g, g.pending_step) for g in gens]
        ready = [(g, p) for g, p in pending if p is not None]
        if len(ready) < 2:
            return 0
        t0 = time.perf_counter()
        logits = self.step_rows([p[0] for _, p in ready], [p[1] for _, p in ready])
        seconds = time.perf_counter() - t0
        for (g, _), out in zip(ready, logits, strict=True):
            g.stepped(out, seconds)
        return len(ready)

    def reuse_beats_batch(self, held: int, n: int) -> bool:
        """Whether restoring `held` of a prompt's n tokens from the prefix cache, then
        prefilling the rest in a forward of its own, is quicker than prefilling all n in a
        batch with other prompts. The batch costs n prompt tokens; the own forward a short
        prefill's cost plus the rest's tokens; so reuse wins when the held tokens cost more in
        the batch than a short prefill forward (measured: a solo prefill of at most
        SHORT_PREFILL tokens). A prompt token's cost is a batched prefill's seconds per token
        (it falls as a batch grows: an expert's matmul serves more tokens). On the built-in
        model a prefill of 1-4 tokens takes ~9.3 ms, 2.3 decode steps (it runs the module
        path, whose experts are dispatched one by one), and a batched prompt token ~0.4-0.8
        ms: seven repeated 18-token chats then join one batch, and a long conversation
        restores its history. Until both were measured: at least REUSE_TOKENS held."""
        own, token = self.short_prefill_s.value, self.prompt_token_s.value
        if own is None or token is None:
            return held >= REUSE_TOKENS
        return held * token > own

    def close(self) -> None:
        if self.prerouter is not None:
            self.prerouter.close()
        self.pool.close()


# before the costs were measured: restoring this many tokens beats prefilling them in a batch
# (built-in model: ~15-25 tokens; a slower forward only moves it up)
REUSE_TOKENS = 64
# a decode forward of at least this many requests computes their experts in one native call
# (rows_together); below it each row's executor computes its own. A forward of 8 requests:
# 16.97 -> 16.06 ms (built-in model), 143.7 -> 123.7 ms (bench shape, every expert
# resident); at 4 level, and 2.5 / 0.4 ms slower at 1 / 2 (the call's fixed cost)
ROWS_TOGETHER = 4
# a prefill forward of at most this many tokens is a short one: the cost of the forward a
# restored prompt's rest needs (its last 2 tokens, and a chat's new turn)
SHORT_PREFILL = 32


class MovingAverage:
    """An exponential moving average of timings (None before the first)."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.value: float | None = None

    def add(self, x: float) -> None:
        v = self.value
        self.value = x if v is None else v + self.weight * (x - v)


class Generation:
    """One request's generation. Iterating it yields (token, logprobs [V]) per sampled token,
    logprobs from the logits it was drawn from (before temperature); it ends at an end-of-text
    token ("stop") or max_tokens ("length"). Breaking out early is allowed: `close()` (or
    reading `stats`) then ends it with finish_reason "stop". Afterwards: tokens, finish_reason,
    stats.

    A scheduler runs several at once with `advance()`, one forward per call: a chunk of at
    most prefill_chunk prompt tokens, or a decode step. Each generation keeps its own state, so
    the order does not change outputs. Engine.step_together runs the pending decode steps of
    several in one forward first; each advance() then only samples from its own row's logits
    (equal to its own step's up to the rounding of a matmul over several rows). (Iterating
    prefills the prompt in one forward: alone, there is nothing to interleave. The two can
    differ in the last bits of the logits.)
    """

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
        self.done = False  # nothing more to run: ended, or its last token handed out
        self._stats: GenerationStats | None = None
        self._units: Iterator[tuple[int, torch.Tensor] | None] | None = None
        # set by Engine.start_together(): its request, and if its prompt ran in the batch,
        # (the prompt's last logits, prefill seconds, the engine's stats before)
        self._req: Request | None = None
        self._prefilled: tuple[torch.Tensor, float, EngineStats] | None = None
        # between a token handed out and its decode step: (request, token); that step's
        # (logits, seconds) when Engine.step_together ran it with other requests' steps
        self._pending: tuple[Request, int] | None = None
        self._stepped: tuple[torch.Tensor, float] | None = None

    def _started(self, chunk: int) -> Iterator[tuple[int, torch.Tensor] | None]:
        if self._units is None:
            self._units = self._run(chunk)
        return self._units

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        for item in self._started(len(self.prompt)):
            if item is not None:
                yield item

    def advance(self) -> tuple[int, torch.Tensor] | None:
        """Run one forward: a prompt chunk, or a decode step. Returns the token it sampled, or
        None (a prompt chunk before the last, or the end: then `done` is set)."""
        item = next(self._started(self.engine.options.prefill_chunk), None)
        if self.done:  # its last token handed out: end it now, releasing its pins
            self.close()
        return item

    @property
    def pending_step(self) -> tuple[Request, int] | None:
        """(its request, the token to feed) when its next advance() runs a decode step."""
        return None if self.done else self._pending

    def stepped(self, logits: torch.Tensor, seconds: float) -> None:
        """Its pending decode step ran elsewhere (Engine.step_together): the next advance()
        samples from these logits [V] instead of running the step."""
        assert self._pending is not None, "no decode step pending"
        self._stepped, self._pending = (logits, seconds), None

    @property
    def prefilled(self) -> bool:
        """Whether its prompt ran in a batch (start_together) and it has not started: its
        next advance() only samples its first token, with no forward."""
        return self._prefilled is not None and self._units is None

    @property
    def started(self) -> bool:
        """Whether it has a request yet (its first forward ran, or start_together began it)."""
        return self._units is not None or self._req is not None

    def close(self) -> None:
        if self._units is not None:
            self._units.close()
        elif self._req is not None:  # prefilled by start_together, never run: unpin it
            self._req.release()
        self.done = True

    def drain(self) -> Generation:
        """Run to the end without looking at the tokens as they come; returns self."""
        for _ in self:
            pass
        return self

    @property
    def stats(self) -> GenerationStats:
        if self._stats is None:
            self.close()
        if self._stats is None:  # closed before it started: nothing ran
            self._stats = GenerationStats(prompt_tokens=len(self.prompt))
        return self._stats

    def _run(self, chunk: int) -> Iterator[tuple[int, torch.Tensor] | None]:
        """Yields None after each prompt chunk but the last, then each sampled token."""
        eng = self.engine
        before = eng.stats()
        steps, decode_s, prefill_s, mid = 0, 0.0, 0.0, before
        peaks = memory.PeakSampler()
        peaks.__enter__()
        req = None
        try:
            req = self._req or eng.new_request(self.prompt)
            if self._prefilled is not None:  # its prompt ran in a batch (start_together)
                logits, prefill_s, before = self._prefilled
            else:
                pos = req.position
                while True:
                    ids = self.prompt[pos : pos + chunk]
                    pos += len(ids)
                    t0 = time.perf_counter()
                    logits = eng.prefill(req, ids, last=pos == len(self.prompt))
                    prefill_s += time.perf_counter() - t0
                    if pos == len(self.prompt):
                        break
                    yield None  # another request may run a forward here
            mid = eng.stats()
            for i in range(self.max_tokens):
                token = self.sampler(logits)
                if token in eng.eos:
                    return
                self.tokens.append(token)
                last = i + 1 == self.max_tokens
                if last:
                    self.finish_reason, self.done = "length", True
                if last:
                    yield token, torch.log_softmax(logits, dim=-1)
                    return
                self._pending = (req, token)
                yield token, torch.log_softmax(logits, dim=-1)
                self._pending = None
                if self._stepped is not None:  # run with others' steps (step_together)
                    (logits, seconds), self._stepped = self._stepped, None
                else:
                    t = time.perf_counter()
                    logits = eng.step(req, token)
                    seconds = time.perf_counter() - t
                decode_s += seconds
                steps += 1
        finally:
            self.done = True
            peaks.__exit__(None, None, None)
            if req is not None:
                eng.finish(req)
            restored = req.restored if req is not None else 0
            self._stats = self._fill_stats(
                eng, before, mid, steps, prefill_s, decode_s, peaks, restored
            )

    def _fill_stats(
        self, eng, before, mid, steps, prefill_s, decode_s, peaks, restored
    ) -> GenerationStats:
        """Decode rates count decode steps (forward passes), not the token prefill produced;
        the prefill rate counts the prompt tokens prefilled (not those restored)."""
        now = eng.stats()
        total, decode = now.minus(before), now.minus(mid)
        s = GenerationStats(prompt_tokens=len(self.prompt), generated_tokens=len(self.tokens))
        s.prefix_tokens = restored
        s.prefill_s, s.decode_s = prefill_s, decode_s
        prefilled = len(self.prompt) - restored
        s.prefill_tok_s = prefilled / prefill_s if prefill_s > 0 else 0.0
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
