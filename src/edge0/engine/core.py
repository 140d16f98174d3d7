"""The engine's mechanics: a loaded model, its plan, pool and backend, one forward at a time.

  Engine.new_request(prompt) -> Request  one request's state: its cache (holding the longest
                                         prefix of `prompt` the prefix cache had), its head
                                         features, the pins of the experts staged for it
  Engine.prefill(req, ids), step(req, t) one forward each; the executors travel in the call's
                                         Forward, nothing is installed into the model
  Engine.prefill_together, step_rows     several requests' prompts, or decode steps, in one
                                         forward, each row with its own state
  Engine.finish(req)                     offer its state to the prefix cache, unpin its experts
  Engine.scheduler(), generate(prompt)   a Scheduler of its forwards; a Generation over one

Which forward runs when is the scheduler's (scheduler.py). Requests share the expert pool (the
cache) and, through the prefix cache, copies of the state of tokens they have in common, so no
output depends on an earlier request. Prefill runs every layer on the whole-layer path; at
decode, prediction-routed layers run on what was staged for them, the rest on the exact path.
Shape legend: B requests, T tokens, V vocabulary, D hidden.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator

import torch
from tqdm import tqdm

from edge0.engine import decode
from edge0.engine.backends.base import Backend
from edge0.engine.executors import (
    ExactExecutor,
    PrefillPlan,
    StagedExecutor,
    WholeLayerExecutor,
    rows_together,
)
from edge0.engine.options import EngineOptions
from edge0.engine.plan import ServingPlan
from edge0.engine.prefix_cache import PrefixCache, PrefixStats
from edge0.engine.request import Request
from edge0.engine.sampling import SamplingParams
from edge0.engine.stats import DecodeStats, EngineStats
from edge0.modeldir import ModelDir
from edge0.models.base import Forward
from edge0.prerouter.runtime import PrerouterRuntime, PrerouterStats, flush_rows
from edge0.store.pool import ExpertPool
from edge0.text.tokenizer import eos_ids
from edge0.util import memory

log = logging.getLogger(__name__)


class Engine:
    """A loaded model and its pool; see the module docstring. Build one with load_engine."""

    def __init__(
        self,
        model_dir: ModelDir,
        options: EngineOptions,
        backend: Backend,
        model: torch.nn.Module,
        plan: ServingPlan,
        pool: ExpertPool,
        prerouter: PrerouterRuntime | None,
        lora_meta: dict[str, str],
        prerouter_meta: dict[str, str],
        schedulers: Callable,
    ):
        self.model_dir, self.path, self.manifest = model_dir, model_dir.path, model_dir.manifest
        self.options, self.backend, self.model = options, backend, model
        self.plan, self.pool, self.prerouter = plan, pool, prerouter
        self.lora_meta, self.prerouter_meta = lora_meta, prerouter_meta
        self._schedulers = schedulers  # (engine, **kw) -> a Scheduler
        self.config = model.config
        self.top_k = plan.top_k
        self.moe_layers = model.moe_layers
        # some layer keeps a recurrent state (it cannot be cut back or right-padded)
        self.recurrent = model.new_cache(1, device="meta").recurrent
        self.tokenizer = model_dir.tokenizer
        self.eos = eos_ids(self.path, self.tokenizer)
        self.experts = backend.ops_for(pool.layout)
        self.layers = backend.layers(model)  # decoder layers the backend computes at decode
        self.attend_rows = backend.attend_rows()  # a batched step's attention, row by row
        # with no heads thread, every request to the pool comes from the thread that decodes
        sole = prerouter is None or prerouter.worker is None
        self._exact = {i: ExactExecutor(pool, i, self.experts, sole) for i in self.moe_layers}
        # a request's exact decode token through every layer in one call, where the pool
        # holds every expert and no prerouter runs
        self.token = None
        if prerouter is None and plan.holds_every_expert:
            self.token = backend.token_decoder(model, self.layers, pool, self.experts)
        # a request's staged token through every layer in one call, the pool's part on a
        # thread (native_staged.py)
        self.staged = None
        if prerouter is not None:
            self.staged = backend.staged_decoder(model, self.layers, pool, self.experts, prerouter)
        bound = plan.floor.prefix_cache
        self.prefix_cache = PrefixCache(bound) if bound else None
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
        cache = self.model.new_cache(
            self.plan.max_context, self.options.dtype, kv_dtype=self.options.kv_dtype
        )
        if self.prerouter is None:
            req = Request(cache, None, self._exact)
        else:
            pre = self.prerouter.new_state()
            consumers = self.prerouter.consumers
            decode = {
                i: StagedExecutor(self.pool, i, pre, self.experts) if i in consumers else ex
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
    def prefill(
        self, req: Request, ids: list[int], last: bool = True, every_position: bool = False
    ) -> torch.Tensor:
        """Run prompt tokens (appended to the request's state); returns the last logits [V],
        or with `every_position` each token's [T, V] (a scored prompt: the routing is the
        same, the LM head runs on every row). A prompt may come in several calls;
        `last=False` says more of it follows, so the heads wait for the end of the prompt to
        predict (and stage) the first decode token."""
        if not ids:
            raise ValueError("the prompt is empty")
        self.check_context(req, len(ids))
        x = torch.tensor([ids], dtype=torch.long)
        with self.whole_layers(len(ids)) as executors:
            logits = decode.prefill(
                self.model, req.cache, x, req.pre, executors, last, every_position
            )
        if req.exact == len(req.tokens):
            req.exact += len(ids)
        req.tokens += ids
        return logits[0].float()

    @contextlib.contextmanager
    def whole_layers(self, tokens: int) -> Iterator[dict[int, WholeLayerExecutor]]:
        """The prefill executors of every MoE layer for a forward of `tokens` tokens (each
        layer's experts read in runs, the next layer's ahead when the forward touches most of
        them); whatever they still pin is released at the end."""
        plan = PrefillPlan(self.pool, self.moe_layers, self.config.num_experts, tokens * self.top_k)
        try:
            yield {i: WholeLayerExecutor(self.pool, i, plan, self.experts) for i in self.moe_layers}
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
        batch = self.model.new_cache(
            t, self.options.dtype, batch=len(reqs), kv_dtype=self.options.kv_dtype
        )
        observer = None
        if self.prerouter is not None:
            states = [req.pre for req in reqs]

            def observer(layer, h, logits, indices):  # each request sees its own rows
                rows = [a.view(len(reqs), t, -1) for a in (h, logits, indices)]
                for i, (pre, n) in enumerate(zip(states, lengths, strict=True)):
                    pre.observe(layer, *(a[i, :n] for a in rows))

        with self.whole_layers(sum(lengths)) as executors:
            h = self.model.hidden(x, Forward(batch, observer=observer, executors=executors))
        last = h[torch.arange(len(reqs)), torch.tensor(lengths) - 1]  # [B, D]
        logits = self.model.logits(last[:, None])[:, 0].float()  # [B, V]
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
        logits = None
        if self.token is not None and req.decode is self._exact:
            logits = self.token(req.cache, token)  # None: not a step it serves
        elif self.staged is not None and req.pre is not None:
            logits = self.staged.step(req.cache, token, req.pre)  # None: not served
        if logits is None:
            x = torch.tensor([[token]], dtype=torch.long)
            logits = decode.step(self.model, req.cache, x, req.pre, req.decode, self.layers)
        logits = logits[0].float()
        self._after_steps([req], [token], [exact])
        return logits

    @torch.inference_mode()
    def step_rows(self, reqs: list[Request], tokens: list[int]) -> list[torch.Tensor]:
        """One decode step of several requests in one forward, each with its own token,
        state, predictions and staged experts; returns each one's next logits [V].
        Where the token op serves the step (every request on the exact path, the pool holding
        every expert: native_token.py) the rows go through every layer in one call and each
        row's logits are its step()'s, bit for bit. Otherwise layer by layer
        (decode.step_rows): attention and each row's experts run per row, the LM head once
        over all rows. Where every layer is a native one (native_layers.py) a row's layers
        give its step()'s bits and its logits are its step()'s up to the LM head's rounding
        over several rows (~1e-6 of the largest); elsewhere the dense layers and routers run
        over all rows too, and the logits agree to about one bf16 step."""
        if len({id(r) for r in reqs}) != len(reqs):
            raise ValueError("step_rows takes each request once")
        exact = [self._before_step(req) for req in reqs]
        logits = None
        if self.token is not None and all(r.decode is self._exact for r in reqs):
            logits = self.token.rows([r.cache for r in reqs], tokens)  # None: not served
        if logits is None:
            x = torch.tensor([[t] for t in tokens], dtype=torch.long)
            together = None
            if len(reqs) >= self.experts.rows_from:
                together = functools.partial(rows_together, self.experts)
            logits = decode.step_rows(
                self.model,
                [r.cache for r in reqs],
                x,
                [r.pre for r in reqs],
                [r.decode for r in reqs],
                together,
                self.attend_rows,
                self.layers,
            )
        logits = logits.float()
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

    def scheduler(self, **kw):
        """A Scheduler of this engine's forwards (its keyword arguments: scheduler.py)."""
        return self._schedulers(self, **kw)

    def generate(self, prompt: list[int], max_tokens: int, sampling: SamplingParams | None = None):
        """A new request: prefill `prompt` (what the prefix cache does not restore), then
        sample up to max_tokens. A Generation: iterate it, or advance() it one forward at a
        time. It runs on a scheduler of its own."""
        return self.scheduler(max_active=1).generation(prompt, max_tokens, sampling)

    def close(self) -> None:
        self.token = None  # its table of expert views keeps the pool's memory alive
        if self.staged is not None:
            self.staged.close()
            self.staged = None
        if self.prerouter is not None:
            self.prerouter.close()
        self.pool.close()
