"""The engine's counters, and one generation's numbers as the stats line prints them."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from edge0.engine.prefix_cache import PrefixStats
from edge0.prerouter.runtime import PrerouterStats
from edge0.store.pool import PoolStats
from edge0.util import memory


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
