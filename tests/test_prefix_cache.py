"""The prefix cache: a later request that starts as an earlier one did prefills only the rest.

Reuse is exact (a conversation's turns give the same tokens with and without it, greedy and
seeded, on the built-in model with its prerouter and on a hybrid with recurrent layers), no
state passes between requests that share no prefix, the bytes held stay within the bound,
the REPL reuses its own earlier turns, and /metrics counts the restored tokens.
"""

from __future__ import annotations

import io

import httpx
import pytest
import torch

from edge0 import builtin
from edge0.cli.chat import ChatSession
from edge0.convert import convert
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.prefix_cache import MIN_PREFILL, PrefixCache
from edge0.engine.sampling import SamplingParams
from edge0.server.app import ServerOptions, create_app
from test_families import make_checkpoint
from test_server import live_server, make_chat_model

KINDS = {"greedy": SamplingParams(temperature=0), "seeded": SamplingParams(temperature=0.9, seed=5)}
TURNS = [
    "Once upon a time there was a little robot who lived by the sea.",
    " Every day it walked along the beach and looked for shells.",
    " One morning it found a bottle with a letter inside.",
]


def engines(path, **kw):
    """The same model with (auto: one request's state) and without a prefix cache."""
    opts = dict(io_mode="buffered", max_context=512) | kw
    return load_engine(path, EngineOptions(prefix_cache=None, **opts)), load_engine(
        path, EngineOptions(prefix_cache=0, **opts)
    )


def conversation(engine, sampling, turns=TURNS, max_tokens=10):
    """Each turn's prompt is the last prompt, its answer, and the next text: a chat's shape.
    Returns each turn's (tokens, prompt tokens restored)."""
    out, context = [], []
    for text in turns:
        context = context + engine.tokenizer.encode(text)
        gen = engine.generate(context, max_tokens, sampling).drain()
        out.append((gen.tokens, gen.stats.prefix_tokens))
        context = context + gen.tokens
    return out


@pytest.fixture(scope="module")
def builtin_engines():
    """The built-in model with its prerouter served (its pool holds every expert, where by
    default an engine leaves the heads out)."""
    with_cache, without = engines(builtin.model_dir(), prerouter_always=True)
    yield with_cache, without
    with_cache.close()
    without.close()


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A tiny qwen3_5_moe: linear-attention (recurrent) layers among attention layers."""
    tmp = tmp_path_factory.mktemp("hybrid")
    make_checkpoint(tmp / "hf", "qwen3_5_moe")
    convert(tmp / "hf", tmp / "e0", progress=False, resident="bf16")
    return tmp / "e0"


@pytest.mark.parametrize("kind", KINDS)
def test_a_conversation_is_the_same_with_and_without_reuse(builtin_engines, kind):
    with_cache, without = builtin_engines
    assert with_cache.prerouter is not None  # staged experts and head features per request
    with_cache.prefix_cache.clear()
    reused = conversation(with_cache, KINDS[kind])
    fresh = conversation(without, KINDS[kind])
    assert [t for t, _ in reused] == [t for t, _ in fresh]
    assert all(n == 0 for _, n in fresh)
    first = len(with_cache.tokenizer.encode(TURNS[0]))
    # turn 2 reuses at least turn 1's prompt (its decode steps were prediction-routed, so they
    # are prefilled again), turn 3 at least turn 2's
    assert reused[0][1] == 0 and reused[1][1] >= first - MIN_PREFILL
    assert reused[2][1] > reused[1][1]
    assert with_cache.pool.available() == with_cache.pool.num_slots  # no pin outlives a request


def test_gate_routed_decode_is_reused_with_the_prompt():
    """The built-in model as served by default (every expert in its pool, so no prerouter):
    its decode steps are gate-routed, exactly what a prefill of the same tokens computes, so
    turn 2 restores turn 1's prompt and answer, and the answers are those without reuse."""
    with_cache, without = engines(builtin.model_dir())
    try:
        assert with_cache.prerouter is None and with_cache.plan.holds_every_expert
        reused = conversation(with_cache, KINDS["greedy"])
        fresh = conversation(without, KINDS["greedy"])
        assert [t for t, _ in reused] == [t for t, _ in fresh]
        prompt1 = len(with_cache.tokenizer.encode(TURNS[0]))
        assert reused[1][1] >= prompt1 + len(reused[0][0]) - 1 - MIN_PREFILL
    finally:
        with_cache.close()
        without.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_hybrid_model_reuses_its_recurrent_state_exactly(hybrid_dir, kind):
    with_cache, without = engines(hybrid_dir)
    try:
        assert with_cache.model.new_cache(8).recurrent
        reused = conversation(with_cache, KINDS[kind], max_tokens=6)
        fresh = conversation(without, KINDS[kind], max_tokens=6)
        assert [t for t, _ in reused] == [t for t, _ in fresh]
        # gate-routed decode is exact too: turn 2 restores turn 1's prompt and answer, as fed
        prompt1 = len(with_cache.tokenizer.encode(TURNS[0]))
        assert reused[1][1] == prompt1 + len(reused[0][0]) - 1  # its last token was not fed
        # a prompt that leaves the saved sequence partway cannot cut a recurrent state back
        cut = with_cache.tokenizer.encode(TURNS[0])[:-3] + with_cache.tokenizer.encode(" sea")
        gen = with_cache.generate(cut, 4, KINDS[kind]).drain()
        alone = without.generate(cut, 4, KINDS[kind]).drain()
        assert gen.stats.prefix_tokens == 0 and gen.tokens == alone.tokens
    finally:
        with_cache.close()
        without.close()


def test_requests_without_a_common_prefix_share_nothing(builtin_engines):
    with_cache, without = builtin_engines
    cache = with_cache.prefix_cache
    cache.clear()
    greedy = KINDS["greedy"]
    tok = with_cache.tokenizer
    conversation(with_cache, greedy)
    unrelated = tok.encode("The weather today is sunny and warm.")
    gen = with_cache.generate(unrelated, 8, greedy).drain()
    assert gen.stats.prefix_tokens == 0
    assert gen.tokens == without.generate(unrelated, 8, greedy).drain().tokens
    # a prompt that shares only the first sentence reuses exactly that much, no more
    shared = tok.encode(TURNS[0])
    branch = shared + tok.encode(" It was very sad because it had no friends.")
    gen = with_cache.generate(branch, 8, greedy).drain()
    assert gen.stats.prefix_tokens == len(shared)
    assert gen.tokens == without.generate(branch, 8, greedy).drain().tokens


def test_the_bytes_held_stay_within_the_bound(builtin_engines):
    with_cache, _ = builtin_engines
    model = with_cache.model
    per_token = model.new_cache(64).snapshot_nbytes(1)
    cache = PrefixCache(capacity_bytes=100 * per_token)
    tok = with_cache.tokenizer
    words = ["Red", "Blue", "Green", "Yellow", "Purple", "Orange"]
    prompts = [tok.encode(f"{w}: " + TURNS[i % 3] * 2) for i, w in enumerate(words)]
    for ids in prompts:  # each about 30 tokens: three fit at once
        state = model.new_cache(256)
        assert cache.restore(state, ids) == 0  # no two start alike
        with torch.no_grad():
            model(torch.tensor([ids]), _forward(with_cache, state))
        cache.save(state, ids)
        assert 0 < cache.bytes <= cache.capacity_bytes
    assert cache.stats.evicted == len(prompts) - len(cache) > 0
    # the most recent is held, the oldest was evicted
    assert cache.restore(model.new_cache(256), prompts[-1] + [5, 6, 7]) == len(prompts[-1])
    assert cache.restore(model.new_cache(256), prompts[0] + [5, 6, 7]) == 0
    too_long = tok.encode(TURNS[0] * 8)
    state = model.new_cache(256)
    with torch.no_grad():
        model(torch.tensor([too_long]), _forward(with_cache, state))
    cache.save(state, too_long)  # larger than the whole bound: not kept, nothing evicted for it
    assert cache.bytes <= cache.capacity_bytes
    assert cache.restore(model.new_cache(256), too_long + [5, 6, 7]) < len(too_long)


def _forward(engine, state):
    from edge0.models.base import Forward

    return Forward(state, executors=engine._exact)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("prefix-chat"))


def test_the_repl_reuses_its_earlier_turns(chat_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with_cache, without = engines(chat_dir)
    try:
        texts = ["def add(a, b):", "and now subtract", "and multiply"]
        answers = {}
        for name, engine in (("reused", with_cache), ("fresh", without)):
            session = ChatSession(engine, KINDS["greedy"], max_tokens=8)
            answers[name] = [session.reply(t, io.StringIO()) for t in texts]
            if name == "reused":
                assert session.last.prefix_tokens > 0  # turn 3 restored the conversation
        assert answers["reused"] == answers["fresh"]
    finally:
        with_cache.close()
        without.close()
        torch.set_num_threads(threads)


def test_metrics_count_the_restored_tokens(chat_dir):
    engine = load_engine(chat_dir, EngineOptions(max_context=512, prefix_cache=None))
    app = create_app(engine, ServerOptions(model_name="tiny"))
    messages = [{"role": "user", "content": "def add(a, b):"}]
    try:
        with live_server(app) as base:
            body = {"messages": messages, "max_tokens": 6, "temperature": 0}
            answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
            messages += [answer["choices"][0]["message"], {"role": "user", "content": "again"}]
            httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).raise_for_status()
            text = httpx.get(f"{base}/metrics", timeout=10).text
    finally:
        engine.close()
    values = {
        line.split("{")[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("edge0_prefix_cache")
    }
    assert values["edge0_prefix_cache_hits_total"] == 1
    assert values["edge0_prefix_cache_hit_tokens_total"] == engine.stats().prefix.hit_tokens > 0
    assert 0 < values["edge0_prefix_cache_bytes"] <= engine.plan.floor.prefix_cache
