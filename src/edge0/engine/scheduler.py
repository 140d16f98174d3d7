"""The scheduler: which forward runs next, for which requests, and each request's progress.

A request is a `Sequence` that goes waiting -> prefilling -> decoding -> done. `Scheduler.step`
admits waiting ones while fewer than max_active are active, asks its policy for a `Turn`, runs
it (one forward, or a batched prefill and then one forward) and samples every sequence whose
forward gave logits, at once. The policy is the one thing to change to schedule otherwise.

RoundRobin, the default, takes the active requests in turn, one forward each: a prompt chunk
(at most prefill_chunk tokens) or a decode step, so no request holds the engine while another
waits and a long prompt shares it chunk by chunk. A request admitted since the last turn goes
first, and every other one not started joins it: their prompts (each within one chunk)
prefill in one forward (batch_prefill), unless a restored prefix saves more
(`reuse_beats_batch`). When a decoding request's turn comes, every decoding one joins its step
in one forward (batch_decode) and all of them go to the back of the line.

A forward of several rows rounds differently from a forward of one, so only with both off is
each request's every logit bit for bit the one it gets alone, whatever else runs (a restored
prefix, and a prompt in chunks, give the same bits as a prompt prefilled whole).
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass, field

import torch

from edge0.engine.core import Engine
from edge0.engine.generation import Generation
from edge0.engine.request import Request
from edge0.engine.sampling import Sampler, SamplingParams
from edge0.engine.scoring import ScoredToken, score
from edge0.engine.stats import EngineStats, GenerationStats
from edge0.formats.integrity import ModelDataError
from edge0.util import memory

# before the costs were measured: restoring this many tokens beats prefilling them in a batch
# (built-in model: ~15-25 tokens; a slower forward only moves it up)
REUSE_TOKENS = 64
# a prefill forward of at most this many tokens is a short one: the cost of the forward a
# restored prompt's rest needs (its last 2 tokens, and a chat's new turn)
SHORT_PREFILL = 32


class NonFiniteLogits(ModelDataError):
    """A forward gave NaN or Inf logits: sampling from them would be noise (or, by argmax of
    NaNs, token 0, an end of text), so the request fails and names the likely cause."""


class State(enum.Enum):
    WAITING = "waiting"  # added, not admitted
    PREFILLING = "prefilling"  # admitted: its prompt runs, chunk by chunk
    DECODING = "decoding"  # holds a sampled token its next decode step feeds
    DONE = "done"  # ended (finish_reason), its state offered to the prefix cache


class Sequence:
    """One request in a scheduler: its prompt and sampler, its state, and what it produced.
    `out` holds (token, logprobs [V]) pairs sampled and not yet taken; logprobs are those of
    the logits the token was drawn from (before temperature)."""

    def __init__(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        context,
        score_top: int | None = None,
    ):
        if max_tokens < (0 if score_top is not None else 1):
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + max_tokens > context:
            raise ValueError(
                f"the prompt's {len(prompt)} tokens plus max_tokens {max_tokens} exceed the "
                f"context of {context} tokens (max_context)"
            )
        self.prompt, self.max_tokens = prompt, max_tokens
        self.sampler = Sampler(sampling, prompt)
        self.state = State.WAITING
        self.req: Request | None = None
        self.fed = 0  # prompt tokens in its cache, restored or prefilled
        self.token: int | None = None  # DECODING: the token its next step feeds
        self.tokens: list[int] = []
        self.out: collections.deque[tuple[int, torch.Tensor]] = collections.deque()
        self.finish_reason = "stop"  # or "length"; "stop" too where it was cancelled
        self.error: BaseException | None = None  # its forward failed (it is DONE)
        self.stats: GenerationStats | None = None  # once DONE
        self._clock = _Clock()
        # a scored prompt: its tokens after the first, each with its logprob and score_top
        # most likely alternatives at that position (engine.scoring)
        self.score_top = score_top
        self.prompt_scores: list[ScoredToken] = []
        self._last_row: torch.Tensor | None = None  # the previous chunk's last logits
        # the end-of-text token a scored prompt's generation drew, with its logprobs [V]
        # (vLLM reports it; lm-evaluation-harness expects an entry for the drawn token)
        self.ended_on: tuple[int, torch.Tensor] | None = None

    @property
    def started(self) -> bool:
        return self.req is not None

    @property
    def done(self) -> bool:
        return self.state is State.DONE


@dataclass
class _Clock:
    """A sequence's timings and the engine's counters at its start and after its prompt."""

    before: EngineStats | None = None
    mid: EngineStats | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    peaks: memory.PeakSampler = field(default_factory=memory.PeakSampler)


@dataclass
class Turn:
    """What one turn runs: `prefill`'s fresh prompts in one forward where they can share it
    (those that cannot, or gain more from a restored prefix, are only started), `decode`'s
    steps in one forward, then `solo`'s own forward unless it already ran."""

    prefill: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    solo: Sequence | None = None


class RoundRobin:
    """The default policy (see the module docstring)."""

    def next_turn(self, sched: Scheduler) -> Turn | None:
        if not sched.active:
            return None
        fresh = [s for s in sched.active if not s.started]
        if fresh:
            sched.to_back(fresh[:1])
            together = fresh if len(fresh) > 1 and sched.batch_prefill else []
            return Turn(prefill=together, solo=fresh[0])
        first = sched.active[0]
        sched.to_back([first])
        if sched.batch_decode and first.state is State.DECODING:
            decoding = [s for s in sched.active if s.state is State.DECODING]
            if len(decoding) > 1:
                sched.to_back(decoding)
                return Turn(decode=decoding)
        return Turn(solo=first)


class MovingAverage:
    """An exponential moving average of timings (None before the first)."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.value: float | None = None

    def add(self, x: float) -> None:
        v = self.value
        self.value = x if v is None else v + self.weight * (x - v)


class Scheduler:
    """Runs the engine's forwards for its sequences, one turn per step(); see the module
    docstring. It is used from one thread, the one that owns the engine."""

    def __init__(
        self,
        engine: Engine,
        max_active: int | None = None,
        batch_decode: bool | None = None,
        prefill_chunk: int | None = None,
        policy=None,
        batch_prefill: bool | None = None,
    ):
        self.engine = engine
        self.max_active = max_active or engine.plan.max_active
        opts = engine.options
        self.batch_decode = opts.batch_decode if batch_decode is None else batch_decode
        self._batch_prefill = batch_prefill
        self.prefill_chunk = prefill_chunk or opts.prefill_chunk
        self.policy = policy or RoundRobin()
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.active: collections.deque[Sequence] = collections.deque()  # the line
        # measured as requests run, for the choice between a restored prefix and the batch:
        # a short prompt's prefill forward of its own, and a prompt token's seconds in a batch
        self.short_prefill_s = MovingAverage()
        self.prompt_token_s = MovingAverage()

    @property
    def batch_prefill(self) -> bool:
        """Whether fresh prompts prefill in one forward: as batch_decode unless set."""
        return self.batch_decode if self._batch_prefill is None else self._batch_prefill

    def add(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        score_top: int | None = None,
    ) -> Sequence:
        """A new waiting sequence (ValueError for one the engine cannot run). With
        `score_top` its prompt is scored as it prefills (Sequence.prompt_scores), and
        max_tokens may be 0."""
        seq = Sequence(prompt, max_tokens, sampling, self.engine.max_context, score_top)
        self.waiting.append(seq)
        return seq

    def generation(
        self, prompt: list[int], max_tokens: int, sampling: SamplingParams | None = None
    ) -> Generation:
        """A new sequence, as a Generation to iterate (Engine.generate)."""
        return Generation(self, self.add(prompt, max_tokens, sampling or SamplingParams()))

    @property
    def room(self) -> bool:
        return len(self.active) + len(self.waiting) < self.max_active

    def to_back(self, seqs: list[Sequence]) -> None:
        """Move `seqs` to the back of the line, in their order (for policies)."""
        for s in seqs:
            self.active.remove(s)
        self.active.extend(seqs)

    def cancel(self, seq: Sequence) -> None:
        """End `seq` before its next forward (finish_reason "stop")."""
        if seq.state is State.WAITING:
            self.waiting.remove(seq)
        if not seq.done:
            self._end(seq, "stop")

    def step(self) -> list[Sequence]:
        """Admit what fits, run one turn; the sequences it sampled for or ended, in order."""
        while self.waiting and len(self.active) < self.max_active:
            seq = self.waiting.popleft()
            seq.state = State.PREFILLING
            self.active.append(seq)
        turn = self.policy.next_turn(self)
        if turn is None:
            return []
        touched: list[Sequence] = []
        if turn.prefill:
            self._guarded(turn.prefill, touched, self._prefill_together)
        if len(turn.decode) > 1:
            self._guarded(turn.decode, touched, self._step_together)
        elif turn.decode:
            turn.solo = turn.decode[0]
        solo = turn.solo
        if solo is not None and not solo.done and solo not in touched:
            self._guarded([solo], touched, lambda seqs: self._forward(seqs[0]))
        return touched

    def _guarded(self, seqs: list[Sequence], touched: list[Sequence], run) -> None:
        """run(seqs) for one forward of them; they are touched. If it fails, they all end with
        the error (the caller sees it in seq.error) and the others go on; an interrupt
        (KeyboardInterrupt) ends them too, then goes on up."""
        try:
            run(seqs)
        except BaseException as e:
            for s in seqs:
                if not s.done:
                    s.error = e
                    self._end(s, "stop")
            if not isinstance(e, Exception):
                raise
        touched.extend(s for s in seqs if s not in touched and (s.out or s.done))

    def _start(self, seq: Sequence, reuse: bool = True, before: EngineStats | None = None):
        """Its request, holding what the prefix cache restored of its prompt (none: reuse
        False); its clock starts."""
        # a scored prompt needs every position's logits: nothing restored
        reuse = reuse and seq.score_top is None
        seq.req = self.engine.new_request(seq.prompt, reuse=reuse)
        seq.fed = seq.req.position
        seq._clock.before = before or self.engine.stats()
        seq._clock.peaks.start()

    def _forward(self, seq: Sequence) -> None:
        """seq's own forward: its next prompt chunk, or its decode step; then it samples."""
        eng, clock = self.engine, seq._clock
        if seq.req is None:
            self._start(seq)
        if seq.state is State.PREFILLING:
            ids = seq.prompt[seq.fed : seq.fed + self.prefill_chunk]
            seq.fed += len(ids)
            t0 = time.perf_counter()
            scored = seq.score_top is not None
            logits = eng.prefill(seq.req, ids, seq.fed == len(seq.prompt), every_position=scored)
            if scored:
                logits = self._score(seq, ids, logits)
            seconds = time.perf_counter() - t0
            clock.prefill_s += seconds
            if len(ids) <= SHORT_PREFILL:
                self.short_prefill_s.add(seconds)
            if seq.fed == len(seq.prompt):
                self._sample(seq, logits)
            return
        t0 = time.perf_counter()
        logits = eng.step(seq.req, seq.token)
        clock.decode_s += time.perf_counter() - t0
        clock.steps += 1
        self._sample(seq, logits)

    def _score(self, seq: Sequence, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Score a prompt chunk from its every position's logits [T, V] (the previous chunk's
        last row scores this chunk's first token); returns the last row."""
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogits(
                "the model computed non-finite logits (NaN or Inf) for this prompt: its "
                "weights are likely damaged; run `edge0 verify` on the model directory"
            )
        last = seq._last_row
        rows = logits[:-1] if last is None else torch.cat([last[None], logits[:-1]])
        targets = ids[1:] if last is None else ids
        seq.prompt_scores += score(rows, targets, seq.score_top or 0)
        seq._last_row = logits[-1]
        return logits[-1]

    def _prefill_together(self, seqs: list[Sequence]) -> None:
        """Prefill, in one forward, the prompts of those `seqs` that fit one chunk (each then
        samples its first token); the others are left to prefill themselves. Seven chat
        requests arriving at once then wait for one batched prefill, not for six others' in
        turn. A model with recurrent layers takes the usual path, and so does a prompt whose
        restored prefix saves more than the forward of its own that the rest then needs."""
        eng = self.engine
        if eng.recurrent:
            return
        fresh = [
            s
            for s in seqs
            if not s.started and len(s.prompt) <= self.prefill_chunk and s.score_top is None
        ]
        if len(fresh) < 2:
            return
        before = eng.stats()
        for s in fresh:  # each keeps its request, with what the prefix cache restored
            held = eng.prefix_cache.match(s.prompt) if eng.prefix_cache is not None else 0
            self._start(s, self.reuse_beats_batch(held, len(s.prompt)), before)
        batch = [s for s in fresh if s.fed == 0]
        if len(batch) < 2:
            return
        t0 = time.perf_counter()
        logits = eng.prefill_together([s.req for s in batch], [s.prompt for s in batch])
        seconds = time.perf_counter() - t0
        self.prompt_token_s.add(seconds / sum(len(s.prompt) for s in batch))
        for s, out in zip(batch, logits, strict=True):
            s.fed = len(s.prompt)
            s._clock.prefill_s = seconds
            self._sample(s, out)

    def _step_together(self, seqs: list[Sequence]) -> None:
        """The decode steps of `seqs` in one forward (Engine.step_rows); each samples."""
        t0 = time.perf_counter()
        logits = self.engine.step_rows([s.req for s in seqs], [s.token for s in seqs])
        seconds = time.perf_counter() - t0
        for s, out in zip(seqs, logits, strict=True):
            s._clock.decode_s += seconds
            s._clock.steps += 1
            self._sample(s, out)

    def reuse_beats_batch(self, held: int, n: int) -> bool:
        """Whether restoring `held` of a prompt's n tokens from the prefix cache, then
        prefilling the rest in a forward of its own, is quicker than prefilling all n in a
        batch with other prompts: when the held tokens cost more in the batch (a batched
        prompt token's measured seconds each) than a short prefill forward of its own (as
        measured). Until both were measured: at least REUSE_TOKENS held."""
        own, token = self.short_prefill_s.value, self.prompt_token_s.value
        if own is None or token is None:
            return held >= REUSE_TOKENS
        return held * token > own

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> None:
        """seq's next token from the logits [V] its forward gave: it ends at an end-of-text
        token ("stop") or its max_tokens ("length"), else it decodes that token next."""
        if not bool(torch.isfinite(logits).all()):  # never an end-of-text drawn from NaNs
            raise NonFiniteLogits(
                f"the model computed non-finite logits (NaN or Inf) for token "
                f"{len(seq.tokens) + 1} of this request: its weights are likely damaged; run "
                "`edge0 verify` on the model directory"
            )
        if seq.state is State.PREFILLING:
            seq._clock.mid = self.engine.stats()
            seq.state = State.DECODING
        if seq.max_tokens == 0:  # a scored prompt, nothing to generate
            self._end(seq, "length")
            return
        token = seq.sampler(logits)
        if token in self.engine.eos:
            if seq.score_top is not None:  # a scored prompt reports what it ended on
                seq.ended_on = (token, torch.log_softmax(logits, dim=-1))
            self._end(seq, "stop")
            return
        seq.tokens.append(token)
        seq.out.append((token, torch.log_softmax(logits, dim=-1)))
        if len(seq.tokens) == seq.max_tokens:
            self._end(seq, "length")
        else:
            seq.token = token

    def _end(self, seq: Sequence, reason: str) -> None:
        """seq is done: its state offered to the prefix cache, its pins released, its stats."""
        seq.finish_reason, seq.state, seq.token = reason, State.DONE, None
        if seq in self.active:
            self.active.remove(seq)
        if seq.req is None:  # ended before it started: nothing ran
            seq.stats = GenerationStats(prompt_tokens=len(seq.prompt))
            return
        try:
            self.engine.finish(seq.req)
        finally:
            seq._clock.peaks.stop()
            seq.stats = _stats(self.engine, seq)


def _stats(eng: Engine, seq: Sequence) -> GenerationStats:
    """Decode rates count decode steps (forward passes), not the token prefill produced; the
    prefill rate counts the prompt tokens prefilled (not those restored)."""
    c, now = seq._clock, eng.stats()
    total, decode = now.minus(c.before), now.minus(c.mid or now)
    restored = seq.req.restored
    s = GenerationStats(prompt_tokens=len(seq.prompt), generated_tokens=len(seq.tokens))
    s.prefix_tokens = restored
    s.prefill_s, s.decode_s = c.prefill_s, c.decode_s
    s.prefill_tok_s = (len(seq.prompt) - restored) / c.prefill_s if c.prefill_s > 0 else 0.0
    s.decode_tok_s = c.steps / c.decode_s if c.decode_s > 0 else 0.0
    s.peak_anon_bytes, s.peak_file_bytes = c.peaks.peak_anon, c.peaks.peak_file
    s.bytes_read, s.reads, s.cache_hits = total.pool.bytes_read, total.pool.reads, total.pool.hits
    s.blocked_ms_per_token = decode.pool.blocked_ns / 1e6 / c.steps if c.steps else 0.0
    s.expert_pool_bytes = eng.pool.capacity_bytes
    s.resident_floor_bytes = eng.plan.floor.total
    if eng.prerouter is not None:
        s.prediction_routed_layers = len(eng.prerouter.consumers)
        s.staged_experts = total.prerouter.staged
        s.dropped = total.prerouter.dropped
        s.head_ms_per_token = total.prerouter.head_ns / 1e6 / max(1, c.steps + 1)
    return s
