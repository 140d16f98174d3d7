"""Prometheus metrics for GET /metrics, in a registry owned by one app (no global state).

Every series carries the served model's name as its `model_name` label, as vLLM's do, and the
request-level metrics that vLLM also has are exported under vLLM's names (`vllm:...`), so a
dashboard built for vLLM reads them unchanged (docs/server.md has the mapping); the rest
(the expert pool, memory, outcomes vLLM does not count) are edge0's own.

Expert-pool, prerouter and prefix-cache counters (reads, bytes, hits, time blocked on reads,
staged and dropped experts, restored prompt tokens) are read from the engine's stats when
scraped, so they also count prefill.
Token counts and rates come from the engine's GenerationStats, taken by the generation
thread when a generation ends, however it ends: a cancelled stream and a cancelled whole
request count the tokens that were generated alike. Times (queue, first token, between tokens,
end to end) are taken on the event loop, as the client gets them.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from edge0.engine.stats import GenerationStats
from edge0.util import memory

MODEL = "model_name"
# vLLM's buckets for the same histograms, so that their dashboards' quantiles read alike
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
# the finish reasons vLLM's request_success counts (a tool call ends with the stop token)
SUCCESS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


class EngineCollector(Collector):
    """The engine's counters since the server started (`stats`: Engine.stats)."""

    def __init__(self, stats, model_name: str):
        self.stats = stats
        self.model_name = model_name

    def collect(self):
        now = self.stats()
        s, pre = now.pool, now.prerouter
        rows = [
            ("edge0_expert_cache_hits", "experts found resident in the pool", s.hits),
            ("edge0_expert_loads", "experts read from disk", s.loads),
            ("edge0_expert_reads", "read calls issued (a run of adjacent experts is one)", s.reads),
            ("edge0_expert_read_bytes", "bytes read from the expert file", s.bytes_read),
            ("edge0_expert_evictions", "experts evicted from the pool", s.evictions),
            ("edge0_experts_staged", "experts the prerouter requested a token ahead", pre.staged),
            ("edge0_experts_dropped", "routed experts missing from their staged set", pre.dropped),
        ]
        px = now.prefix
        rows += [
            ("edge0_prefix_cache_hits", "requests that restored a prompt prefix", px.hits),
            (
                "edge0_prefix_cache_hit_tokens",
                "prompt tokens restored from the prefix cache instead of prefilled",
                px.hit_tokens,
            ),
        ]
        rows += [
            (
                "edge0_decode_forwards",
                "decode forwards run (one or several requests' steps)",
                now.decode.forwards,
            ),
            (
                "edge0_decode_rows",
                "request decode steps those forwards ran (rows / forwards: the mean batch)",
                now.decode.rows,
            ),
        ]
        rows.append(
            (
                "edge0_read_blocked_seconds",
                "time the generation thread waited for expert reads",
                s.blocked_ns / 1e9,
            )
        )
        for name, doc, value in rows:
            family = CounterMetricFamily(name, doc, labels=[MODEL])
            family.add_metric([self.model_name], value)
            yield family


class Metrics:
    """All server metrics; see the module docstring."""

    def __init__(self, engine, worker, model_name: str, endpoint: Callable[[str], str]) -> None:
        self.registry = r = CollectorRegistry()
        self.model = model_name
        r.register(EngineCollector(engine.stats, model_name))
        self.endpoint = endpoint  # URL path -> endpoint label (a bounded set)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, [MODEL, *labels], registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, [MODEL], registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, [MODEL], buckets=buckets, registry=r).labels(model_name)

        self.requests = counter(
            "edge0_requests",
            "generation requests by endpoint and outcome: the finish reason (stop, length, "
            "tool_calls), or cancelled, error, rejected (queue full), shutting_down",
            "endpoint",
            "outcome",
        )
        self.responses = counter(
            "edge0_responses",
            "HTTP responses by endpoint and status code, errors included",
            "endpoint",
            "status",
        )
        self.success = counter(
            "vllm:request_success",
            "generation requests that ended by a stop (or a tool call) or their length",
            "finished_reason",
        )
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "prompt tokens, those restored from the prefix cache included"
        ).labels(model_name)
        self.generated = counter("vllm:generation_tokens", "tokens generated").labels(model_name)
        self.request_prompt = histogram(
            "vllm:request_prompt_tokens", "prompt tokens per request", TOKEN_BUCKETS
        )
        self.request_generated = histogram(
            "vllm:request_generation_tokens", "tokens generated per request", TOKEN_BUCKETS
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "from arrival (queueing included) to the first token",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "between successive tokens of a request, as the server sent them",
            ITL_BUCKETS,
        )
        self.latency = histogram(
            "vllm:e2e_request_latency_seconds", "from arrival to the last token", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "from arrival until the request entered the scheduler",
            LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "the request's prefill", LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "the request's decode steps", LATENCY_BUCKETS
        )
        gauge("vllm:num_requests_running", "requests prefilling or decoding").set_function(
            lambda: worker.running
        )
        gauge("vllm:num_requests_waiting", "requests queued, not yet started").set_function(
            lambda: worker.waiting
        )
        gauge("edge0_queue_depth", "requests waiting or running").set_function(lambda: worker.depth)
        self.decode_rate = gauge(
            "edge0_decode_tokens_per_second", "decode rate of the last request"
        )
        self.prefill_rate = gauge(
            "edge0_prefill_tokens_per_second", "prefill rate of the last request"
        )
        self.peak_anon = gauge(
            "edge0_peak_anon_bytes", "peak anonymous resident memory during a request"
        )
        self.peak_file = gauge(
            "edge0_peak_file_bytes", "peak file-backed resident memory during a request"
        )
        gauge("edge0_anon_bytes", "anonymous resident memory now").set_function(
            lambda: memory.sample().anon_bytes
        )
        gauge("edge0_file_bytes", "file-backed resident memory now").set_function(
            lambda: memory.sample().file_bytes
        )
        gauge("edge0_expert_pool_bytes", "capacity of the expert pool").set(engine.plan.pool_bytes)
        if engine.prefix_cache is not None:
            held = engine.prefix_cache
            gauge(
                "edge0_prefix_cache_bytes", "finished requests' state kept for reuse"
            ).set_function(lambda: held.bytes)
        self._peaks = (0, 0)

    def response(self, path: str, status: int) -> None:
        self.responses.labels(self.model, self.endpoint(path), str(status)).inc()

    def finished(self, endpoint: str, outcome: str, pending=None) -> None:
        """A request's outcome, and its times when it reached the generation thread
        (`pending`: jobs.Pending); its tokens are counted by generation_ended()."""
        self.requests.labels(self.model, endpoint, outcome).inc()
        if outcome in SUCCESS:
            self.success.labels(self.model, SUCCESS[outcome]).inc()
        if pending is None:
            return
        self.latency.observe(pending.elapsed())
        if pending.first_token_s is not None:
            self.ttft.observe(pending.first_token_s)
        for interval in pending.intervals:
            self.itl.observe(interval)
        queued = pending.queue_s()
        if queued is not None:
            self.queue_time.observe(queued)

    def generation_ended(self, stats: GenerationStats) -> None:
        """A generation ended (on the generation thread): count its tokens and rates."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated.inc(stats.generated_tokens)
        self.request_prompt.observe(stats.prompt_tokens)
        self.request_generated.observe(stats.generated_tokens)
        self.prefill_time.observe(stats.prefill_s)
        self.decode_time.observe(stats.decode_s)
        if stats.decode_tok_s:
            self.decode_rate.set(stats.decode_tok_s)
        if stats.prefill_tok_s:
            self.prefill_rate.set(stats.prefill_tok_s)
        anon, file = self._peaks
        self._peaks = (max(anon, stats.peak_anon_bytes), max(file, stats.peak_file_bytes))
        self.peak_anon.set(self._peaks[0])
        self.peak_file.set(self._peaks[1])

    def render(self) -> bytes:
        return generate_latest(self.registry)
