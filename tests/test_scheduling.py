"""Several requests at once: what the serving plan counts for them, and how they share the engine.

The plan counts max_active requests' state and staging room and names what a budget lacks;
requests advanced in turns get exactly the outputs they get alone; the generation thread runs
the active requests round robin, a long prompt chunk by chunk; and with 8 concurrent chat
requests, one of which runs long, the others' first tokens come within the policy's bound
(at most one forward of each other active request before a request's first one).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import edge0.engine.core as engine_module
import edge0.server.worker as worker_module
from edge0 import builtin, native
from edge0.bench.serving import stream_chat
from edge0.cli.args import with_flags
from edge0.convert import convert
from edge0.engine.backends.native import ROWS_TOGETHER
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.plan import ModelSizes, make_plan
from edge0.engine.sampling import SamplingParams
from edge0.engine.scheduler import REUSE_TOKENS, SHORT_PREFILL, Turn
from edge0.server.app import ServerOptions, create_app
from edge0.server.arrivals import Arrivals
from edge0.server.worker import Done, Job, Token, Worker
from edge0.util.memory import MachineMemory
from edge0.util.threads import single_threaded_pool
from helpers import make_hf_model
from test_families import make_checkpoint
from test_server import live_server, make_chat_model

# -- the plan -----------------------------------------------------------------------------------

EXTENT = 1024
# These tests are about prediction-routed decode: the heads are served whatever the pool holds
# (by default a pool of every expert serves none: make_plan)
HEADS = {"prerouter_always": True}


def sizes(**kw) -> ModelSizes:
    """A model of 4 MoE layers x 8 experts, K=2, 3 prediction-routed layers; 100 B per token."""
    base = dict(
        resident_params=1000,
        moe_layers=4,
        experts_per_layer=8,
        extent_bytes=EXTENT,
        native_top_k=2,
        served_top_k=None,
        state_bytes=lambda n, dtype, kv: 100 * n,
        prediction_routed_layers=3,
    )
    return ModelSizes(**(base | kw))


def test_the_plan_counts_every_active_request():
    one = make_plan(sizes(), EngineOptions(max_context=64, memory_budget=1 << 20, **HEADS))
    three = make_plan(
        sizes(), EngineOptions(max_context=64, memory_budget=1 << 20, max_active=3, **HEADS)
    )
    assert one.floor.state == 6400 and three.floor.state == 3 * 6400
    assert one.staging_slots == (3 + 1) * 2 and three.staging_slots == 3 * one.staging_slots
    assert three.max_active == 3 and three.floor.prefix_cache == 0
    auto = make_plan(
        sizes(), EngineOptions(max_context=64, memory_budget=1 << 20, prefix_cache=None, **HEADS)
    )
    assert auto.floor.prefix_cache == 6400  # "auto": one request's state at max_context
    assert auto.floor.total == one.floor.total + 6400


def test_a_budget_too_small_for_the_active_requests_names_what_is_missing():
    opts = dict(max_context=64, max_active=3, prefix_cache=5000, **HEADS)
    fits = make_plan(sizes(), EngineOptions(**opts, memory_budget=1 << 20))
    exact = fits.floor.total + fits.staging_slots * EXTENT
    assert make_plan(sizes(), EngineOptions(**opts, memory_budget=exact)).pool_slots == 24
    with pytest.raises(ValueError) as e:
        make_plan(sizes(), EngineOptions(**opts, memory_budget=exact - 1))
    msg = str(e.value)
    assert "memory_budget" in msg and "1 B more needed" in msg, msg
    assert "max_active 3" in msg and "prefix_cache" in msg and "24 experts" in msg, msg
    assert "--max-active" in with_flags(msg) and "--prefix-cache" in with_flags(msg)


def test_a_process_budget_counts_the_runtime_and_working_memory():
    """--memory-budget is the whole process: the pool gets what the runtime the process holds,
    the working memory of its largest forward and the floor leave; one byte short of the
    pins it needs is refused naming all four."""
    machine = MachineMemory(runtime=300 << 20, limit=None, available=1 << 40)
    opts = dict(max_context=64, **HEADS)
    bare = make_plan(sizes(), EngineOptions(**opts, memory_budget=1 << 20), machine)
    held = machine.runtime + bare.workspace + bare.floor.total
    budget = held + 20 * EXTENT + EXTENT // 2
    plan = make_plan(sizes(), EngineOptions(**opts, process_budget=budget), machine)
    assert plan.pool_slots == 20 and plan.process_budget == budget
    assert plan.peak_bytes == held + 20 * EXTENT <= budget < plan.peak_bytes + EXTENT
    need = plan.staging_slots
    with pytest.raises(ValueError) as e:
        make_plan(sizes(), EngineOptions(**opts, process_budget=held + need * EXTENT - 1), machine)
    msg = str(e.value)
    assert "the whole process" in msg and "runtime 300.00 MiB" in msg, msg
    assert "working memory" in msg and "resident floor" in msg and "1 B more needed" in msg
    assert "--memory-budget" in with_flags(msg)


@pytest.mark.parametrize(
    "field, value", [("max_active", 0), ("prefill_chunk", 0), ("prefix_cache", -1)]
)
def test_bad_serving_options_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        make_plan(sizes(), EngineOptions(**{field: value}))


# -- the engine: requests in turns --------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    """The built-in model (it has prerouter heads: staged experts travel with each request),
    with small prompt chunks so that prompts take several turns."""
    e = load_engine(
        builtin.model_dir(),
        EngineOptions(io_mode="buffered", max_active=3, prefill_chunk=8, **HEADS),
    )
    yield e
    e.close()


def test_a_prompt_fed_in_parts_releases_its_pins(engine):
    """A prompt may be prefilled in several calls; each flushed the heads and staged, and the
    earlier staged sets stayed pinned for good (28 slots on the built-in model)."""
    ids = engine.tokenizer.encode("hello there, how are you doing today? " * 3)
    with engine.new_request() as req:
        engine.prefill(req, ids[:10])
        engine.prefill(req, ids[10:])
    assert engine.pool.available() == engine.pool.num_slots


def in_turns(gens) -> list[list[int]]:
    """Advance the generations one forward each in turn, as the generation thread does, until
    all are done; their tokens."""
    while not all(g.done for g in gens):
        for g in gens:
            if not g.done:
                g.advance()
    return [g.tokens for g in gens]


def test_requests_advanced_in_turns_get_their_solo_outputs(engine):
    prompts = [
        engine.tokenizer.encode(t)
        for t in ("Once upon a time", "The robot looked at the sea and said", "Tom had a dog")
    ]
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)] * 2

    def alone(i: int) -> list[int]:
        gen = engine.generate(prompts[i], 12, kinds[i])
        while not gen.done:
            gen.advance()
        return gen.tokens

    solo = [alone(i) for i in range(3)]
    gens = [engine.generate(prompts[i], 12, kinds[i]) for i in range(3)]
    assert in_turns(gens) == solo
    assert engine.pool.available() == engine.pool.num_slots  # every pin released


@pytest.fixture(scope="module")
def whole_prompts():
    """The built-in model with its default prompt chunk, and a prefix cache."""
    e = load_engine(
        builtin.model_dir(),
        EngineOptions(io_mode="buffered", max_active=3, prefix_cache=None, **HEADS),
    )
    yield e
    e.close()


def test_prompts_prefilled_together_decode_as_they_do_alone(whole_prompts):
    """Three fresh prompts of different lengths in one right-padded forward: each request's
    logits, staged experts and tokens are those it gets alone."""
    engine = whole_prompts
    tok = engine.tokenizer
    texts = ("Once upon a time", "The robot looked at the sea and said", "Tom had a big red dog")
    prompts = [tok.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == 3
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)] * 2
    solo_logits, solo_staged = [], []
    for ids in prompts:
        with engine.new_request() as req:
            solo_logits.append(engine.prefill(req, ids))
            solo_staged.append({c: sorted(e.key for e in v) for c, v in req.pre.staged.items()})
    reqs = [engine.new_request() for _ in prompts]
    together = engine.prefill_together(reqs, prompts)
    for req, got, want, staged in zip(reqs, together, solo_logits, solo_staged, strict=True):
        # within one bf16 step (2^-8) of the largest logit: the int4 kernel rounds its
        # activations to bf16, so the ~1e-5 fp32 differences between a batched and a solo
        # forward can move an activation by one bf16 step (the 3-pass built-in model: 1.9e-3
        # relative on one of these prompts, no routing choice changed). Equal staged experts
        # and tokens, below, are the exact checks.
        assert (got - want).abs().max() <= 2**-8 * want.abs().max()
        assert {c: sorted(e.key for e in v) for c, v in req.pre.staged.items()} == staged
        req.release()
    solo = []
    for i, ids in enumerate(prompts):
        gen = engine.generate(ids, 12, kinds[i])
        while not gen.done:
            gen.advance()
        solo.append(gen.tokens)
    engine.prefix_cache.clear()
    # the scheduler's first turn prefills them in one forward; decode steps one at a time
    sched = engine.scheduler(max_active=3, batch_decode=False, batch_prefill=True)
    seqs = [sched.add(ids, 12, kinds[i]) for i, ids in enumerate(prompts)]
    sched.step()
    assert all(s.fed == len(s.prompt) and s.tokens for s in seqs)  # each sampled its first
    assert run_all(sched, seqs) == solo
    assert engine.pool.available() == engine.pool.num_slots  # every pin released
    # a restored prefix is kept when it saves more than the forward of its own that the rest
    # then needs; a few held tokens are cheaper to prefill again in the batch
    story = tok.encode(" ".join(texts) * 3)
    engine.generate(story, 2).drain()
    sched.short_prefill_s.value, sched.prompt_token_s.value = 0.02, 0.001  # reuse from 20 held
    again = [sched.add(ids + tok.encode(" again"), 4, kinds[0]) for ids in prompts[:2]]
    assert all(0 < engine.prefix_cache.match(s.prompt) < 20 for s in again)
    sched.max_active = 4
    again.append(sched.add(story + tok.encode(" again"), 4, kinds[0]))
    assert engine.prefix_cache.match(again[-1].prompt) > 20
    again.append(sched.add(tok.encode("A new story"), 4, kinds[0]))
    sched.step()
    assert [s.fed == len(s.prompt) for s in again] == [True, True, False, True]
    run_all(sched, again)
    assert [s.stats.prefix_tokens > 0 for s in again] == [False, False, True, False]
    assert engine.pool.available() == engine.pool.num_slots


def run_all(sched, seqs) -> list[list[int]]:
    """Turns of the scheduler until every one of `seqs` is done; their tokens."""
    while not all(s.done for s in seqs):
        sched.step()
    return [s.tokens for s in seqs]


def test_reuse_or_batch_follows_the_measured_costs(whole_prompts):
    sched = whole_prompts.scheduler()
    assert not sched.reuse_beats_batch(REUSE_TOKENS - 1, 200)  # unmeasured: a fixed floor
    assert sched.reuse_beats_batch(REUSE_TOKENS, 200)
    sched.short_prefill_s.add(0.03)
    sched.prompt_token_s.add(0.002)
    assert not sched.reuse_beats_batch(14, 16) and sched.reuse_beats_batch(16, 200)
    sched.prompt_token_s.add(0.001)  # a moving average: 0.0018 s a token now
    assert not sched.reuse_beats_batch(16, 200) and sched.reuse_beats_batch(17, 200)


def test_the_own_forward_is_priced_by_short_prefills(whole_prompts):
    sched = whole_prompts.scheduler()
    greedy = SamplingParams(temperature=0)
    run_all(sched, [sched.add([5 + i % 50 for i in range(SHORT_PREFILL + 1)], 1, greedy)])
    assert sched.short_prefill_s.value is None  # a long prompt's forward is not the price
    run_all(sched, [sched.add([5, 6], 1, greedy)])
    assert sched.short_prefill_s.value > 0


# -- decode steps of several requests in one forward --------------------------------------------


@pytest.fixture(scope="module")
def row_engines(tmp_path_factory):
    """The built-in model with and without its prerouter, a hybrid with recurrent layers (and
    partial rotary, an output gate) and an MLA model, each with room for 4 active requests."""
    tmp = tmp_path_factory.mktemp("rows")
    dirs = {"builtin": builtin.model_dir(), "builtin, no prerouter": builtin.model_dir()}
    for name, family in (("hybrid", "qwen3_5_moe"), ("mla", "deepseek_v3")):
        make_checkpoint(tmp / name, family)
        convert(tmp / name, tmp / f"{name}-e0", progress=False, resident="bf16")
        dirs[name] = tmp / f"{name}-e0"
    engines = {
        name: load_engine(
            path,
            EngineOptions(
                io_mode="buffered",
                max_active=4,
                max_context=256,
                no_prerouter="no" in name,
                prerouter_always=True,
            ),
        )
        for name, path in dirs.items()
    }
    yield engines
    for e in engines.values():
        e.close()


def test_prompts_prefilled_together_predict_once_per_head_as_each_alone(whole_prompts, monkeypatch):
    """After a forward of several prompts, each owner's head runs once over their last
    positions (flush_rows) and each request gets the predictions, sets and staged reads its
    own flush() gives it from the same forward: the native head's rows are their own bits."""
    engine = whole_prompts
    tok = engine.tokenizer
    prompts = [tok.encode(t) for t in ("def add(a, b):", "import os", "class Config(object):")]
    rt, calls = engine.prerouter, []
    predict = rt.predict

    def counted(owner, rows):
        calls.append(rows.h.shape[0])
        return predict(owner, rows)

    def made(each: bool):
        with monkeypatch.context() as m:
            m.setattr(rt, "predict", counted)
            if each:
                m.setattr(engine_module, "flush_rows", lambda states: [s.flush() for s in states])
            reqs = [engine.new_request() for _ in prompts]
            calls.clear()
            engine.prefill_together(reqs, prompts)
        got = [(r.pre.predicted, r.pre.chosen, r.pre.allowed, staged_keys(r)) for r in reqs]
        for r in reqs:
            r.release()
        return got, list(calls)

    once, calls_once = made(each=False)
    each, calls_each = made(each=True)
    assert calls_once == [3] * len(rt.owners) and calls_each == [1] * (3 * len(rt.owners))
    for a, b in zip(once, each, strict=True):
        assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][c], b[0][c]) for c in a[0])
        assert a[1] == b[1] and a[3] == b[3] and a[3]
        assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][c], b[2][c]) for c in a[2])
    assert engine.pool.available() == engine.pool.num_slots


def staged_keys(req) -> dict | None:
    return (
        None
        if req.pre is None
        else {c: sorted(e.key for e in v) for c, v in req.pre.staged.items()}
    )


def three_prompts(engine) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(t) for t in ("def add(a, b):", "import os\nimport sys", "class A")]


def twice_prefilled(engine, prompts: list[list[int]]) -> tuple[list, list]:
    """Two requests per prompt, each prefilled with it: (to step together, to step alone)."""
    batched = [engine.new_request() for _ in prompts]
    alone = [engine.new_request() for _ in prompts]
    for a, b, ids in zip(batched, alone, prompts, strict=True):
        engine.prefill(a, ids)
        engine.prefill(b, ids)
    return batched, alone


@pytest.mark.parametrize("name", ["builtin", "builtin, no prerouter", "hybrid", "mla"])
def test_decode_steps_in_one_forward_match_each_alone(row_engines, name):
    """Requests at different positions step in one forward (Engine.step_rows). One row is
    bit-identical to its own step: each row keeps its cache, positions, recurrent state,
    predictions and executors. With three rows a matmul over 3 rows rounds differently
    (~5e-7 relative in fp32): on the built-in model every logit stays within one bf16 step
    of the largest (the int4 kernel rounds activations to bf16) and each request stages the
    experts it stages alone; on random models, where a router's top-k can be a near tie that
    such a difference flips, the median row agrees to fp32 rounding. Every pin is released.

    The built-in model is held to the bf16 step only: once a bf16 rounding of one row goes
    the other way, that row's cache differs and so do its later steps, so how many rows stay
    at fp32 agreement is chance, set by where the CPU's kernels round (AMD EPYC, AVX-512,
    prerouter: 12 of 18 rows past 1e-5, 2 of 18 under ATEN_CPU_CAPABILITY=avx2)."""
    engine = row_engines[name]
    prompts = three_prompts(engine)
    assert len({len(p) for p in prompts}) == 3
    for rows in (1, 3):
        batched, alone = twice_prefilled(engine, prompts[:rows])
        tokens, errors = [5, 6, 7][:rows], []
        before = engine.stats()
        for _ in range(6):
            together = engine.step_rows(batched, tokens)
            solo = [engine.step(req, t) for req, t in zip(alone, tokens, strict=True)]
            for a, b, got, want in zip(batched, alone, together, solo, strict=True):
                if rows == 1:
                    assert torch.equal(got, want)
                errors.append(float((got - want).abs().max() / want.abs().max()))
                if name.startswith("builtin"):
                    assert errors[-1] <= 2**-8
                    assert staged_keys(a) == staged_keys(b)
            tokens = [int(w.argmax()) for w in solo]
        if not name.startswith("builtin"):
            assert sorted(errors)[len(errors) // 2] < 1e-5, errors
        assert [r.tokens for r in batched] == [r.tokens for r in alone]
        assert [r.position for r in batched] == [len(p) + 6 for p in prompts[:rows]]
        d = engine.stats().minus(before).decode
        assert (d.forwards, d.rows) == (6 + 6 * rows, 12 * rows)
        for req in batched + alone:
            req.release()
        assert engine.pool.available() == engine.pool.num_slots
    with pytest.raises(ValueError, match="once"):
        engine.step_rows([batched[0], batched[0]], [1, 2])


FOUR = ("def add(a, b):", "import os", "class A", "print(")


def four_in_one_forward(engine, steps: int) -> tuple[torch.Tensor, list]:
    """Four requests' greedy decode steps in one forward each (Engine.step_rows): the logits
    [steps, 4, V] and each request's staged sets at the end; their pins released."""
    reqs = [engine.new_request() for _ in FOUR]
    for req, text in zip(reqs, FOUR, strict=True):
        engine.prefill(req, engine.tokenizer.encode(text))
    tokens, logits = [5, 6, 7, 8], []
    for _ in range(steps):
        logits.append(torch.stack(engine.step_rows(reqs, tokens)))
        tokens = [int(row.argmax()) for row in logits[-1]]
    staged = [staged_keys(req) for req in reqs]
    for req in reqs:
        req.release()
    return torch.stack(logits), staged


@pytest.mark.parametrize("name", ["builtin", "builtin, no prerouter"])
def test_a_steps_experts_in_one_call_are_each_rows_own(row_engines, monkeypatch, name):
    """A forward of 4 requests' decode steps computes every row's experts in one native call
    (rows_together), from the experts each row's executor pinned: the logits are those of the
    same forward with each row's experts computed by its own executor, bit for bit. Gate-routed
    rows on the pool's one requesting thread use their loaded experts unpinned, as one row
    alone does (ExpertPool.peek), and count the same hits."""
    engine = row_engines[name]
    assert len(FOUR) >= engine.experts.rows_from == ROWS_TOGETHER
    requests, stepping = [], []
    request, step_rows = engine.pool.request, engine.step_rows

    def steps(*a):
        stepping.append(True)
        try:
            return step_rows(*a)
        finally:
            stepping.pop()

    def requested(*a):
        if stepping:
            requests.append(a)
        return request(*a)

    monkeypatch.setattr(engine, "step_rows", steps)
    monkeypatch.setattr(engine.pool, "request", requested)
    hits = engine.pool.stats.hits
    together = four_in_one_forward(engine, 4)
    hits, together_hits = engine.pool.stats.hits, engine.pool.stats.hits - hits
    # without a prerouter every expert is loaded (the pool holds them all): none requested
    assert bool(requests) == (name == "builtin")
    monkeypatch.setattr(engine.experts, "rows_from", len(FOUR) + 1)  # each row its own
    each_row = four_in_one_forward(engine, 4)
    assert torch.equal(together[0], each_row[0]) and together[1] == each_row[1]
    assert together_hits == engine.pool.stats.hits - hits
    assert engine.pool.available() == engine.pool.num_slots


def test_a_step_of_several_requests_runs_each_head_once(row_engines, monkeypatch):
    """In one forward of 3 requests' decode steps, each owner's head runs once over the 3
    rows (observe_rows), not once per row; each row still stages from its own row."""
    engine = row_engines["builtin"]
    rt, calls = engine.prerouter, []
    predict = rt.predict

    def counted(owner, rows):
        calls.append(rows.h.shape[0])
        return predict(owner, rows)

    monkeypatch.setattr(rt, "predict", counted)
    tok = engine.tokenizer
    reqs = [engine.new_request() for _ in range(3)]
    for req, text in zip(reqs, ("def add(a, b):", "import os", "class A"), strict=True):
        engine.prefill(req, tok.encode(text))
    calls.clear()
    engine.step_rows(reqs, [5, 6, 7])
    for req in reqs:
        req.pre._join()
    assert calls == [3] * len(engine.prerouter.owners)
    for req in reqs:
        req.release()
    assert engine.pool.available() == engine.pool.num_slots


def test_a_step_of_several_requests_stages_the_same_with_a_heads_thread(row_engines):
    """observe_rows on the heads thread (where heads are large, or a core is free): a forward
    of 4 requests' steps gives the logits and staged sets it gives with the heads inline."""
    engine = row_engines["builtin"]
    rt = engine.prerouter
    assert rt.worker is None  # the built-in model's heads run inline on 2 cores
    inline = four_in_one_forward(engine, 6)
    rt.worker = single_threaded_pool(1, "test-heads")
    try:
        threaded = four_in_one_forward(engine, 6)
    finally:
        rt.worker.shutdown()
        rt.worker = None
    assert torch.equal(threaded[0], inline[0]) and threaded[1] == inline[1]
    assert engine.pool.available() == engine.pool.num_slots


def test_generations_stepped_together_sample_their_solo_tokens(row_engines):
    """Requests whose prompts prefill in one forward and whose decode steps run together (a
    scheduler's turns, as the generation thread runs them) sample the tokens they sample
    alone, greedy and seeded, on the built-in model with its prerouter (where no logit
    difference of the batch moves a token)."""
    engine = row_engines["builtin"]
    tok = engine.tokenizer
    prompts = [tok.encode(t) for t in ("def fib(n):", "import os\n", "class Stack:\n    def")]
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)] * 2
    solo = [engine.generate(p, 16, kinds[i]).drain().tokens for i, p in enumerate(prompts)]
    rows, step_rows = [], engine.step_rows

    def counted(reqs, tokens):
        rows.append(len(reqs))
        return step_rows(reqs, tokens)

    sched = engine.scheduler(max_active=3)
    seqs = [sched.add(p, 16, kinds[i]) for i, p in enumerate(prompts)]
    engine.step_rows = counted
    try:
        assert run_all(sched, seqs) == solo
    finally:
        del engine.step_rows
    assert sum(n for n in rows if n == 3) >= 3 * 14  # every step, while all three decode
    assert all(s.stats.decode_tok_s > 0 for s in seqs)
    assert engine.pool.available() == engine.pool.num_slots


# -- the generation thread ----------------------------------------------------------------------


def run_jobs(worker: Worker, jobs: list[Job], events: list) -> None:
    worker.start()
    try:
        for job in jobs:
            worker.submit(job)
        wait_done(events, len(jobs), 120)
    finally:
        worker.stop()


def wait_done(events: list, n: int, timeout_s: float = 60) -> None:
    """Until n of the (name, event) pairs in `events` are Done events."""
    deadline = time.monotonic() + timeout_s
    while sum(isinstance(e, Done) for _, e in events) < n:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def sinks(events: list) -> Callable[[object], Callable[[object], None]]:
    """sink(name): a Job's sink that appends (name, event) to `events` (from any thread)."""
    lock = threading.Lock()

    def sink(name):
        def put(event):
            with lock:
                events.append((name, event))

        return put

    return sink


def test_the_generation_thread_takes_turns_and_chunks_long_prompts(engine):
    """A long prompt (10 chunks of 8 tokens) submitted first does not keep a short request
    waiting: the short one's tokens come between the long prompt's chunks."""
    events: list[tuple[str, object]] = []
    sink = sinks(events)
    long = engine.tokenizer.encode("The little robot read a book about the sea. " * 8)[:80]
    short = engine.tokenizer.encode("Once upon a time")
    greedy = SamplingParams(temperature=0)
    jobs = [Job(long, 4, greedy, sink("long")), Job(short, 4, greedy, sink("short"))]
    worker = Worker(engine)
    assert worker.max_active == 3
    run_jobs(worker, jobs, events)
    short_done = next(i for i, (n, e) in enumerate(events) if n == "short" and isinstance(e, Done))
    long_first = next(i for i, (n, e) in enumerate(events) if n == "long" and isinstance(e, Token))
    assert short_done < long_first, events  # all of the short one ran during the long prompt


@pytest.mark.parametrize("batch_decode", [True, False])
def test_the_generation_thread_steps_active_requests_together(engine, batch_decode):
    """With batch_decode (the default) the thread runs the active requests' decode steps in
    one forward; each request still gets the tokens it gets alone (greedy and seeded, on the
    built-in model). Without it, each decode forward is one request's."""
    prompts = [engine.tokenizer.encode(t) for t in ("def fib(n):", "import os\n", "class Stack:")]
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)] * 2
    solo = [engine.generate(p, 10, kinds[i]).drain().tokens for i, p in enumerate(prompts)]
    events: list[tuple[int, object]] = []
    sink = sinks(events)
    jobs = [Job(p, 10, kinds[i], sink(i)) for i, p in enumerate(prompts)]
    worker = Worker(engine)
    worker.batch_decode = batch_decode
    before = engine.stats()
    run_jobs(worker, jobs, events)
    got = [[e.token for n, e in events if n == i and isinstance(e, Token)] for i in range(3)]
    assert got == solo
    d = engine.stats().minus(before).decode
    assert d.rows == 3 * 9
    assert d.forwards < d.rows if batch_decode else d.forwards == d.rows


@pytest.fixture(scope="module")
def sixteen():
    """The built-in model as `edge0 serve --max-active 16` runs it, prefix cache included."""
    e = load_engine(
        builtin.model_dir(), EngineOptions(io_mode="buffered", max_active=16, prefix_cache=None)
    )
    yield e
    e.close()


def chat_ids(engine, question: str) -> list[int]:
    """A chat prompt: every one shares the template's opening with the others."""
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return engine.tokenizer.encode(text)


QUESTIONS = [f"Write a Python function number {i} that {w}." for i, w in enumerate(
    ["adds", "sorts a list", "reads a file", "parses JSON", "counts words", "reverses text",
     "merges dicts", "zips lists", "finds primes", "formats dates", "hashes bytes",
     "walks a tree", "retries calls", "caches results", "splits paths"]
)]  # fmt: skip


def seeded_run(engine, batch_decode: bool, others: int) -> tuple[list[int], list[float]]:
    """The request of the issue (temperature 0.8, seed 1247) among `others` concurrent chats
    (greedy and seeded, submitted before and after it): its tokens and their logprobs."""
    target = Job(chat_ids(engine, "Write a stack class."), 24, SamplingParams(0.8, seed=1247), None)
    target.top_logprobs = 0
    events: list[tuple[int, object]] = []
    sink = sinks(events)
    jobs = []
    for i, q in enumerate(QUESTIONS[:others]):
        params = SamplingParams(temperature=0) if i % 2 else SamplingParams(0.8, seed=i)
        jobs.append(Job(chat_ids(engine, q), 16 + i, params, sink(i)))
    target.sink = sink("target")
    jobs.insert(others // 2, target)
    engine.prefix_cache.clear()
    worker = Worker(engine)
    worker.batch_decode = batch_decode
    run_jobs(worker, jobs, events)
    mine = [e for n, e in events if n == "target" and isinstance(e, Token | Done)]
    entries = [lp for e in mine for lp in e.logprobs]
    tokens = [e.token for e in mine if isinstance(e, Token)]
    return tokens, [lp.logprob for lp in entries]


@pytest.mark.slow
def test_seeded_logprobs_are_the_same_alone_and_among_fifteen_others(sixteen):
    """--no-batch-decode: every forward is one request's, so a seeded request at temperature
    0.8 gets the same tokens and bit-for-bit the same logprobs alone and among 15 concurrent
    chats that share its prompt's opening (restored from the prefix cache, or not). With
    batching on (the default) a several-row forward rounds differently: the logprobs are
    within a few bf16 steps, the docs say so, and the test bounds it."""
    alone = seeded_run(sixteen, batch_decode=False, others=0)
    among = seeded_run(sixteen, batch_decode=False, others=15)
    assert among[0] == alone[0]
    assert among[1] == alone[1]  # float equality, every token
    assert len(alone[1]) == len(alone[0]) > 0
    batched = seeded_run(sixteen, batch_decode=True, others=15)
    n = min(len(batched[1]), len(alone[1]))
    first_diff = next((i for i in range(n) if batched[0][i] != alone[0][i]), n)
    pairs = zip(batched[1][:first_diff], alone[1][:first_diff], strict=True)
    worst = max((abs(a - b) for a, b in pairs), default=0.0)
    print(f"batched: same tokens for {first_diff} of {n}; worst logprob difference {worst:.2e}")
    assert worst < 0.05


class Fifo:
    """A policy of its own: the request admitted first runs alone to its end, then the next."""

    def next_turn(self, sched):
        return Turn(solo=sched.active[0]) if sched.active else None


@pytest.mark.parametrize("policy", [None, Fifo()], ids=["round-robin", "fifo"])
def test_the_scheduling_policy_is_one_object(engine, policy):
    """The generation thread with another policy object and nothing else changed: strict FIFO
    serves three requests one after another (each one's events before the next one's first),
    where the default round robin interleaves them; every request gets its solo tokens."""
    prompts = [engine.tokenizer.encode(t) for t in ("def fib(n):", "import os\n", "class A:")]
    greedy = SamplingParams(temperature=0)
    solo = [engine.generate(p, 6, greedy).drain().tokens for p in prompts]
    events: list[tuple[int, object]] = []
    sink = sinks(events)
    worker = Worker(engine, policy=policy)
    run_jobs(worker, [Job(p, 6, greedy, sink(i)) for i, p in enumerate(prompts)], events)
    names = [n for n, _ in events]
    blocks = [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]
    assert (blocks == [0, 1, 2]) == isinstance(policy, Fifo), names
    got = [[e.token for n, e in events if n == i and isinstance(e, Token)] for i in range(3)]
    assert got == solo


def test_requests_admitted_mid_decode_prefill_next_and_join_the_next_step(
    whole_prompts, monkeypatch
):
    """Two requests submitted while a third decodes: their prompts prefill in one forward,
    the very next one (the decoding request's next step waits for it, where before it ran
    first), and each samples its first token at once, so the next decode forward holds all
    three rows (not the decoding one and the first of the two, with the second a forward
    behind)."""
    engine = whole_prompts
    engine.prefix_cache.clear()
    events: list[tuple[str, object]] = []
    calls: list[tuple[str, int, int]] = []  # (forward, rows, the long one's tokens by then)

    def counted(name, run):
        def call(reqs, arg):
            long_tokens = sum(n == "long" and isinstance(e, Token) for n, e in events)
            calls.append((name, len(reqs), long_tokens))
            return run(reqs, arg)

        return call

    monkeypatch.setattr(engine, "prefill_together", counted("prefill", engine.prefill_together))
    monkeypatch.setattr(engine, "step_rows", counted("step", engine.step_rows))
    sink = sinks(events)
    tok, greedy = engine.tokenizer, SamplingParams(temperature=0)
    worker = Worker(engine)

    def long_sink(event):
        sink("long")(event)
        n = sum(name == "long" and isinstance(e, Token) for name, e in events)
        if isinstance(event, Token) and n == 3:  # on the generation thread, mid-turn
            for name, text in (("a", "import os\n"), ("b", "class Stack:")):
                worker.submit(Job(tok.encode(text), 4, greedy, sink(name)))

    worker.start()
    try:
        worker.submit(Job(tok.encode("def fib(n):"), 64, greedy, long_sink))
        wait_done(events, 3)
    finally:
        worker.stop()
    first = next(i for i, c in enumerate(calls) if c[0] == "prefill")
    assert calls[first] == ("prefill", 2, 3), calls
    assert calls[first + 1][:2] == ("step", 3), calls


def test_arrivals_are_waited_for_once_each_and_at_most_the_limit():
    arrivals = Arrivals()
    assert arrivals.settle(10.0) == 0.0  # nothing on its way
    coming = arrivals.enter()
    threading.Timer(0.1, coming.done).start()
    assert 0.05 < arrivals.settle(10.0) < 5.0  # until it was submitted
    assert arrivals.open == 0
    stuck = arrivals.enter()  # one that never arrives: one wait of the limit, not one per forward
    assert 0.04 < arrivals.settle(0.05) < 5.0
    assert arrivals.settle(10.0) == 0.0
    arrivals.enter()  # another on its way: waited for again
    assert arrivals.settle(0.05) > 0.04
    stuck.done()
    stuck.done()  # (a second call is nothing)
    assert arrivals.open == 1


def test_arrivals_hand_a_busy_event_loop_turns_to_take_in_what_waits():
    """A request entered and submitted; the event loop is busy for 0.2 s, and what it reads
    next is another request, submitted 0.1 s after it enters. settle() hands the loop turns
    and waits for that one too, instead of going on because none was open when it looked."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        arrivals = Arrivals()

        def read() -> None:  # what the loop takes in once it has a turn
            coming = arrivals.enter(loop)
            loop.call_later(0.1, coming.done)

        def busy() -> None:
            time.sleep(0.2)
            loop.call_soon(read)

        loop.call_soon_threadsafe(busy)
        arrivals.enter(loop).done()
        assert 0.25 < arrivals.settle(10.0) < 5.0
        assert arrivals.open == 0
        assert arrivals.settle(10.0) == 0.0  # nothing entered since
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
    assert arrivals.settle(10.0) == 0.0
    arrivals.enter(loop).done()  # a closed loop: no turns to hand it
    assert arrivals.settle(10.0) < 0.05


def test_the_generation_thread_waits_for_requests_still_arriving(whole_prompts, monkeypatch):
    """A request the server is still receiving when another is submitted: the thread runs no
    forward until it is submitted too, and both prompts prefill in one forward."""
    engine = whole_prompts
    engine.prefix_cache.clear()
    monkeypatch.setattr(worker_module, "ARRIVAL_WAIT_S", 60.0)
    calls: list[tuple[str, int]] = []
    prefill = engine.prefill_together

    def counted(reqs, prompts):
        calls.append(("prefill", len(reqs)))
        return prefill(reqs, prompts)

    monkeypatch.setattr(engine, "prefill_together", counted)
    events: list[tuple[str, object]] = []
    sink = sinks(events)
    tok, greedy = engine.tokenizer, SamplingParams(temperature=0)
    arrivals = Arrivals()
    worker = Worker(engine, arrivals=arrivals)
    add = worker.scheduler.add

    def admitted(*a, **kw):
        calls.append(("admitted", 1))
        return add(*a, **kw)

    monkeypatch.setattr(worker.scheduler, "add", admitted)
    coming = arrivals.enter()
    worker.start()
    try:
        worker.submit(Job(tok.encode("import os\n"), 4, greedy, sink("a")))
        time.sleep(0.3)
        assert calls == [] and events == []  # waiting for the one on its way
        worker.submit(Job(tok.encode("class Stack:"), 4, greedy, sink("b")))
        coming.done()
        wait_done(events, 2)
    finally:
        worker.stop()
    assert calls[:3] == [("admitted", 1), ("admitted", 1), ("prefill", 2)], calls


# -- 8 concurrent chat requests over HTTP -------------------------------------------------------

ACTIVE = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    opts = EngineOptions(max_context=512, max_active=ACTIVE, prefill_chunk=64)
    e = load_engine(make_chat_model(tmp_path_factory.mktemp("fair")), opts)
    # no default cap: a request without max_tokens runs to the end of the context
    app = create_app(e, ServerOptions(model_name="tiny", queue_size=8, default_max_tokens=None))
    with live_server(app) as url:
        yield int(url.rsplit(":", 1)[1])
    e.close()
    torch.set_num_threads(threads)


def chat(i: int, max_tokens: int | None) -> tuple[list[dict], int | None]:
    content = f"{['def', 'class', 'import', 'print'][i % 4]} {i}"
    return [{"role": "user", "content": content}], max_tokens


def first_token(port: int, request, started: threading.Event | None = None) -> dict:
    """Seconds to the first content token of a streamed greedy chat, and the gaps after it."""
    return stream_chat(port, *request, started=started)


@pytest.mark.slow
def test_eight_concurrent_requests_are_not_held_behind_a_long_one(server):
    """The policy's bound: a request admitted while 7 others are active runs its first forward
    after at most one forward of each of them (a decode step, or a prompt chunk: at most what
    a request's first token costs alone), so its first token comes within its own time alone
    plus 7 times the slowest time alone; doubled for a shared machine. One request at a time
    (the policy before) would have them all wait for the long one's ~500 tokens.

    Not asserted here: the issue's tighter bound, twice the time alone plus one decode step
    per active request. On this tiny model a decode step is ~2.5 ms and the 8 streams' HTTP
    work on 2 cores, not the forwards, sets the first tokens (~30 ms), which land at that
    bound; `edge0 bench --serving` measures it on the built-in model (with batched decode
    about half of the first tokens within it on 2 vCPUs: docs/server.md)."""
    others = [chat(i, 16) for i in range(1, ACTIVE)]
    first_token(server, others[0])  # warm-up
    alone = [first_token(server, r)["first_s"] for r in others]

    def trial() -> tuple[list[float], list[float], dict]:
        long_started = threading.Event()
        with ThreadPoolExecutor(ACTIVE) as pool:
            # the one without max_tokens, running when the others arrive
            runner = pool.submit(first_token, server, chat(0, None), long_started)
            assert long_started.wait(60)
            firsts = list(pool.map(lambda r: first_token(server, r)["first_s"], others))
            long = runner.result()
        bounds = [2 * (a + (ACTIVE - 1) * max(alone)) for a in alone]
        return firsts, bounds, long

    for _ in range(3):  # a shared machine can stall any single trial; the bound holds in one
        firsts, bounds, long = trial()
        print(
            f"alone {[round(a, 3) for a in alone]}; together {[round(f, 3) for f in firsts]}; "
            f"bounds {[round(b, 3) for b in bounds]}; the long one {long['total_s']:.2f} s"
        )
        if all(f <= b for f, b in zip(firsts, bounds, strict=True)):
            break
    assert all(f <= b for f, b in zip(firsts, bounds, strict=True)), (firsts, bounds)
    assert len(long["gaps"]) + 1 > 100  # it ran long: what the others had to share the thread with
    assert max(firsts) < long["total_s"] / 4  # they did not wait for it


@pytest.mark.parametrize("activations", ["int8", "bf16"])
@pytest.mark.parametrize("name", ["builtin", "int4 floor", "shared expert, dense layer"])
def test_a_row_stepped_with_others_is_its_own_step_up_to_the_lm_head(tmp_path, name, activations):
    """Where every layer is a native one, a batched step computes each row's layers as that
    row's step alone does: its router, adapters, float projections and shared expert on the
    row alone, its int4 projections (an int4 floor's too) on the kernel its step takes. So the
    LM head's input is the row's own step's bit for bit, with either activations (with int8 a
    product over several rows, ~1e-7 off, would move an activation's int8 code by a whole
    step), and the logits differ only by the LM head's rounding over several rows."""
    path = builtin.model_dir()
    if name != "builtin":
        if name == "int4 floor":
            make_checkpoint(tmp_path / "hf", "mixtral")
        else:  # a gated shared expert, layer 1 a dense MLP
            make_hf_model(tmp_path / "hf", "qwen2_moe", qkv_bias=False, mlp_only_layers=[1])
        convert(tmp_path / "hf", tmp_path / "e0", progress=False)
        path = tmp_path / "e0"
    opts = EngineOptions(
        io_mode="buffered", max_active=4, max_context=256, int4_activations=activations
    )
    engine = load_engine(path, opts)
    engine.token = None  # a step alone through the layers one by one (the token op's bits)
    seen, logits = [], engine.model.logits

    def lm_head(x):
        seen.append(x.clone())
        return logits(x)

    engine.model.logits = lm_head
    try:
        assert engine.layers and len(engine.layers) == len(engine.model.backbone.layers)
        if name == "int4 floor":  # the layer op serves its int4 projections
            int8 = activations == "int8"
            assert all((n.rows_kernel[1] >= native.INT8) == int8 for n in engine.layers.values())
        if name.startswith("shared"):
            assert any(not n.is_moe for n in engine.layers.values())
            assert any(n.is_moe and n.mlp.gated_shared for n in engine.layers.values())
        prompts = three_prompts(engine)
        for rows in (1, 3):
            batched, alone = twice_prefilled(engine, prompts[:rows])
            tokens = [5, 6, 7][:rows]
            for _ in range(6):
                seen.clear()
                together = engine.step_rows(batched, tokens)
                solo = [engine.step(req, t) for req, t in zip(alone, tokens, strict=True)]
                rows_in, solo_in = seen[0].reshape(rows, -1), seen[1:]
                assert len(solo_in) == rows
                for i, (got, want) in enumerate(zip(together, solo, strict=True)):
                    assert torch.equal(rows_in[i], solo_in[i].reshape(-1))
                    if rows == 1:
                        assert torch.equal(got, want)
                    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
                tokens = [int(s.argmax()) for s in solo]
            assert [r.tokens for r in batched] == [r.tokens for r in alone]
            assert [staged_keys(r) for r in batched] == [staged_keys(r) for r in alone]
            for req in batched + alone:
                req.release()
        assert engine.pool.available() == engine.pool.num_slots
    finally:
        engine.close()
