"""Sampling controls against their reference implementations: repetition_penalty and min_p as
transformers computes them, presence/frequency penalties by OpenAI's formula, and the same
fields through generation_config.json, the CLI and the server's request sampling."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from edge0.engine.sampling import (
    MIN_REPETITION_PENALTY,
    Sampler,
    SamplingDefaults,
    SamplingParams,
)

V = 97


def logits_stream(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(V, generator=g) * 3 for _ in range(n)]


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_is_transformers_over_prompt_and_output(penalty):
    """Greedy with a repetition penalty: each step's penalised logits equal transformers'
    RepetitionPenaltyLogitsProcessor given the prompt plus every token drawn so far."""
    prompt = [3, 5, 5, 90, 11]
    sampler = Sampler(SamplingParams(temperature=0, repetition_penalty=penalty), prompt)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    seen = list(prompt)
    for logits in logits_stream(1, 12):
        want = hf(torch.tensor([seen]), logits[None].clone())[0]
        torch.testing.assert_close(sampler.penalized_logits(logits), want, rtol=0, atol=0)
        token = sampler(logits)
        assert token == int(torch.argmax(want))
        seen.append(token)
    assert len(set(seen[len(prompt) :])) > 1  # the penalty moved the argmax


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.9])
def test_min_p_keeps_what_transformers_keeps(min_p):
    for logits in logits_stream(2, 6):
        sampler = Sampler(SamplingParams(temperature=0.8, min_p=min_p, seed=0))
        ours = sampler.filtered_logits(logits)
        hf = MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), logits[None] / 0.8)[0]
        assert torch.equal(torch.isinf(ours), torch.isinf(hf))
        kept = ~torch.isinf(hf)
        torch.testing.assert_close(ours[kept], hf[kept])
        assert kept.sum() >= 1


@pytest.mark.parametrize(
    "top_k, top_p, min_p", [(0, 0.9, 0), (20, 0.8, 0), (0, 0.5, 0.05), (5, 1.0, 0)]
)
def test_filters_keep_what_transformers_keeps(top_k, top_p, min_p):
    """temperature, top-k, top-p, min-p in transformers' order, on the same logits."""
    warpers = [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    for logits in logits_stream(8, 6):
        params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p)
        ours = Sampler(params).filtered_logits(logits)
        hf = logits[None] / 0.7
        for w in warpers:
            hf = w(torch.zeros(1, 1, dtype=torch.long), hf)
        assert torch.equal(torch.isinf(ours), torch.isinf(hf[0]))


def test_the_nucleus_is_found_past_the_first_candidates():
    """A flat distribution over 8192 tokens: top_p 0.9 keeps 7373 of them, far past the 256
    the nucleus search starts with."""
    logits = torch.zeros(8192)
    logits[:10] = 1e-3  # a few ahead, so the order is not all ties
    kept = ~torch.isinf(Sampler(SamplingParams(temperature=1.0, top_p=0.9)).filtered_logits(logits))
    assert 7370 <= int(kept.sum()) <= 7375 and bool(kept[:10].all())


def test_draws_follow_the_distribution():
    """20,000 seeded draws from 6 tokens: each token's frequency within 4.5 standard
    deviations of its probability; a zero-probability (filtered) token is never drawn."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -9.0])
    params = SamplingParams(temperature=1.0, top_k=5, seed=11)
    sampler = Sampler(params)
    n = 20_000
    counts = torch.bincount(torch.tensor([sampler(logits) for _ in range(n)]), minlength=6)
    probs = torch.softmax(logits[:5], -1)
    assert counts[5] == 0
    sd = (n * probs * (1 - probs)).sqrt()
    assert ((counts[:5] - n * probs).abs() <= 4.5 * sd).all(), (counts, n * probs)


def test_presence_and_frequency_penalties_are_openais_formula():
    """logit - frequency * count - presence * (count > 0), counting generated tokens only
    (the prompt's tokens are not penalised)."""
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=0, presence_penalty=0.6, frequency_penalty=0.4)
    sampler = Sampler(params, prompt)
    counts = torch.zeros(V)
    for logits in logits_stream(3, 15):
        want = logits - 0.4 * counts - 0.6 * (counts > 0).float()
        torch.testing.assert_close(sampler.penalized_logits(logits), want)
        token = sampler(logits)
        assert token == int(torch.argmax(want))
        counts[token] += 1
    fresh = Sampler(params, prompt)
    first = logits_stream(3, 1)[0]
    torch.testing.assert_close(fresh.penalized_logits(first), first)


def test_negative_presence_penalty_repeats_and_sampling_stays_seeded():
    """A negative penalty rewards repeats (OpenAI allows -2..2); a seeded, penalised request
    draws the same tokens twice."""
    logits = logits_stream(4, 1)[0]
    greedy = Sampler(SamplingParams(temperature=0, presence_penalty=-2.0))
    first = greedy(logits)
    assert all(greedy(logits) == first for _ in range(5))
    params = SamplingParams(temperature=1.0, seed=7, frequency_penalty=1.0, min_p=0.02)
    runs = [[Sampler(params, [4])(x) for x in logits_stream(5, 20)] for _ in range(2)]
    assert runs[0] == runs[1]


def test_penalties_off_leave_logits_untouched():
    logits = logits_stream(6, 1)[0]
    sampler = Sampler(SamplingParams(temperature=0.5), [1, 2])
    assert torch.equal(sampler.penalized_logits(logits), logits)
    assert sampler._tokens is None  # no per-request token state without a penalty


@pytest.mark.parametrize(
    "field, value",
    [
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 5e-324),  # would divide logits into inf: NaN probabilities
    ],
)
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_generation_config_sets_min_p_and_repetition_penalty(tmp_path):
    """The model's generation_config.json min_p and repetition_penalty are defaults, as in
    transformers and vLLM; a request's own value wins, and values out of range are ignored."""
    cfg = {"temperature": 0.6, "min_p": 0.05, "repetition_penalty": 1.1}
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
    d = SamplingDefaults.from_model_dir(tmp_path)
    assert (d.min_p, d.repetition_penalty) == (0.05, 1.1)
    got = d.resolve()
    assert (got.min_p, got.repetition_penalty, got.presence_penalty) == (0.05, 1.1, 0.0)
    own = d.resolve(min_p=0.0, repetition_penalty=1.0, presence_penalty=0.5)
    assert (own.min_p, own.repetition_penalty, own.presence_penalty) == (0.0, 1.0, 0.5)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"min_p": 3, "repetition_penalty": -1})
    )
    bad = SamplingDefaults.from_model_dir(tmp_path)
    assert (bad.min_p, bad.repetition_penalty) == (0.0, 1.0)


def test_cli_flags_set_every_sampling_control(tmp_path):
    from edge0.cli.args import sampling_params
    from edge0.cli.main import build_parser

    flags = [
        "--min-p", "0.1", "--repetition-penalty", "1.2",
        "--presence-penalty", "0.5", "--frequency-penalty", "-0.5",
    ]  # fmt: skip
    for argv in (["generate", "--prompt", "x", *flags], ["chat", *flags]):
        got = sampling_params(build_parser().parse_args(argv), tmp_path)
        assert (got.min_p, got.repetition_penalty) == (0.1, 1.2)
        assert (got.presence_penalty, got.frequency_penalty) == (0.5, -0.5)


def test_server_requests_carry_every_sampling_control():
    from edge0.server.jobs import request_sampling
    from edge0.server.protocol import ChatCompletionRequest

    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "presence_penalty": 0.5,
        "frequency_penalty": 1,
    }
    got = request_sampling(SamplingDefaults(), ChatCompletionRequest.model_validate(body))
    assert (got.min_p, got.repetition_penalty) == (0.1, 1.2)
    assert (got.presence_penalty, got.frequency_penalty) == (0.5, 1.0)


# prompts the built-in model never saw (its corpus is the stdlib; none of these is in it)
UNSEEN = [
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser()\n",
    "def parse_header(line):\n",
    'class Matrix:\n    """A dense matrix of floats."""\n\n    def __init__(self, rows, cols):\n',
    "async def fetch_all(urls):\n",
    'def merge_sorted(a, b):\n    """Merge two sorted lists."""\n',
    "class Stack:\n    def __init__(self):\n",
    "def format_table(rows, widths):\n",
]


@pytest.fixture(scope="module")
def builtin_engine():
    from edge0 import builtin
    from edge0.engine.load import load_engine

    engine = load_engine(builtin.model_dir())
    yield engine
    engine.close()


def distinct_4grams(texts: list[str]) -> float:
    """The fraction of the texts' word 4-grams that are distinct (each text's own)."""
    distinct = total = 0
    for text in texts:
        words = text.split()
        grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
        distinct, total = distinct + len(set(grams)), total + len(grams)
    return distinct / total


def test_the_builtin_models_greedy_text_does_not_loop_with_its_shipped_defaults(builtin_engine):
    """96 greedy tokens of each unseen prompt, with the defaults its generation_config.json
    ships: at least 60% of their word 4-grams are distinct. Without the penalty the same
    continuations repeat one line (`self.capacity = capacity` over and over)."""
    from edge0 import builtin

    engine, tok = builtin_engine, builtin_engine.tokenizer
    shipped = SamplingDefaults.from_model_dir(builtin.model_dir()).resolve(temperature=0)
    assert shipped.greedy and shipped.frequency_penalty > 0

    def continuations(params: SamplingParams) -> list[str]:
        return [
            tok.decode(engine.generate(tok.encode(p), 96, params).drain().tokens) for p in UNSEEN
        ]

    with_defaults = distinct_4grams(continuations(shipped))
    without = distinct_4grams(continuations(SamplingParams(temperature=0)))
    assert with_defaults >= 0.6, (with_defaults, without)
    assert without < with_defaults


@settings(max_examples=300, deadline=None)
@given(
    temperature=st.floats(0, 2),
    top_p=st.floats(0, 1),
    top_k=st.integers(-1, 100),
    min_p=st.floats(0, 1),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    repetition=st.floats(MIN_REPETITION_PENALTY, 10),
    scale=st.sampled_from([1.0, 30.0, 1e4]),
)
def test_every_accepted_setting_draws_a_token(
    temperature, top_p, top_k, min_p, presence, frequency, repetition, scale
):
    """Whatever the server's ranges accept, finite logits give a token (a NaN probability
    would be a 500)."""
    params = SamplingDefaults().resolve(
        temperature, top_p, top_k, 1, min_p=min_p, presence_penalty=presence,
        frequency_penalty=frequency, repetition_penalty=repetition,
    )  # fmt: skip
    sampler = Sampler(params, [1, 2, 3])
    for logits in logits_stream(7, 4):
        assert 0 <= sampler(logits * scale) < V
