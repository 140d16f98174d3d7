"""Prometheus metrics for GET /metrics, in a registry owned by one app (no global state).

Expert-pool, prerouter and prefix-cache counters (reads, bytes, hits, time blocked on reads,
staged and dropped experts, restored prompt tokens) are read from the engine's stats when
scraped, so they also count prefill.
Token counts and rates come from the engine's GenerationStats, taken by the generation
thread when a generation ends, however it ends: a cancelled stream and a cancelled whole
request count the tokens that were generated alike.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from edge0.engine.stats import GenerationStats
from edge0.util import memory


class EngineCollector(Collector):
    """The engine's counters since the server started (`stats`: Engine.stats)."""

    def __init__(self, stats):
        self.stats = stats

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
        for name, doc, value in rows:
            yield CounterMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "edge0_read_blocked_seconds",
            "time the generation thread waited for expert reads",
            value=s.blocked_ns / 1e9,
        )


class Metrics:
    """All server metrics; see the module docstring."""

    def __init__(self, engine, queue_depth: Callable[[], int], endpoint: Callable[[str], str]):
        self.registry = r = CollectorRegistry()
        r.register(EngineCollector(engine.stats))
        self.endpoint = endpoint  # URL path -> endpoint label (a bounded set)
        self.requests = Counter(
            "edge0_requests",
            "generation requests by endpoint and outcome: the finish reason (stop, length, "
            "tool_calls), or cancelled, error, rejected (queue full), shutting_down",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.responses = Counter(
            "edge0_responses",
            "HTTP responses by endpoint and status code, errors included",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "edge0_prompt_tokens",
            "prompt tokens, those restored from the prefix cache included",
            registry=r,
        )
        self.generated = Counter("edge0_generation_tokens", "tokens generated", registry=r)
        self.decode_rate = Gauge(
            "edge0_decode_tokens_per_second", "decode rate of the last request", registry=r
        )
        self.prefill_rate = Gauge(
            "edge0_prefill_tokens_per_second", "prefill rate of the last request", registry=r
        )
        self.ttft = Histogram(
            "edge0_time_to_first_token_seconds",
            "from arrival (queueing included) to the first token",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.latency = Histogram(
            "edge0_request_seconds",
            "from arrival to the last token",
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        depth = Gauge("edge0_queue_depth", "requests waiting or running", registry=r)
        depth.set_function(queue_depth)
        self.peak_anon = Gauge(
            "edge0_peak_anon_bytes", "peak anonymous resident memory during a request", registry=r
        )
        self.peak_file = Gauge(
            "edge0_peak_file_bytes", "peak file-backed resident memory during a request", registry=r
        )
        anon = Gauge("edge0_anon_bytes", "anonymous resident memory now", registry=r)
        anon.set_function(lambda: memory.sample().anon_bytes)
        file = Gauge("edge0_file_bytes", "file-backed resident memory now", registry=r)
        file.set_function(lambda: memory.sample().file_bytes)
        pool = Gauge("edge0_expert_pool_bytes", "capacity of the expert pool", registry=r)
        pool.set(engine.plan.pool_bytes)
        if engine.prefix_cache is not None:
            held = engine.prefix_cache
            prefix = Gauge(
                "edge0_prefix_cache_bytes", "finished requests' state kept for reuse", registry=r
            )
            prefix.set_function(lambda: held.bytes)
        self._peaks = (0, 0)

    def response(self, path: str, status: int) -> None:
        self.responses.labels(self.endpoint(path), str(status)).inc()

    def finished(
        self,
        endpoint: str,
        outcome: str,
        seconds: float | None = None,
        first_token_s: float | None = None,
    ) -> None:
        """A request's outcome and times (its tokens are counted by generation_ended())."""
        self.requests.labels(endpoint, outcome).inc()
        if seconds is not None:
            self.latency.observe(seconds)
        if first_token_s is not None:
            self.ttft.observe(first_token_s)

    def generation_ended(self, stats: GenerationStats) -> None:
        """A generation ended (on the generation thread): count its tokens and rates."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated.inc(stats.generated_tokens)
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
