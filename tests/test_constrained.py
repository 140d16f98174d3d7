"""Constrained decoding on the built-in model: response_format json_object / json_schema and
forced tool calls produce what the grammar guarantees, whole or streamed, alone or in a
batched decode step; the openai SDK's `.parse()` gets its object; a schema the grammar
compiler refuses is a 400 that names it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum

import httpx
import openai
import pydantic
import pytest
import torch

from edge0 import builtin
from edge0.engine.grammar import GrammarError, Grammars, json_schema_grammar
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.sampling import SamplingParams
from edge0.server.app import ServerOptions, create_app
from test_server import live_server


class Color(StrEnum):
    red = "red"
    green = "green"


class Item(pydantic.BaseModel):
    name: str
    count: int


class Order(pydantic.BaseModel):
    customer: str
    color: Color
    items: list[Item]
    note: str | None = None


class Person(pydantic.BaseModel):
    name: str
    age: int


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "local_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Write the order as JSON."}]


@pytest.fixture(scope="module")
def served():
    """The built-in model writes Python: asked for JSON, some prompts make it write one JSON
    string until max_tokens, which no grammar prevents, and which ones depends on every bit
    of the logits. The KV cache is kept in fp32 and the activations in bf16 (the exact
    option) so that the answers these tests pin (those that end where their JSON does) do not
    move with the default bf16 storage or int8 activations' rounding (with them, the Person
    schema's greedy answer is such a string)."""
    opts = EngineOptions(max_active=8, kv_dtype=torch.float32, int4_activations="bf16")
    engine = load_engine(builtin.model_dir(), opts)
    app = create_app(engine, ServerOptions(model_name=builtin.NAME, default_max_tokens=400))
    with live_server(app) as url:
        yield engine, url
    engine.close()


def chat(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def schema_format(model: type[pydantic.BaseModel]) -> dict:
    schema = model.model_json_schema()
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": schema}}


@pytest.mark.parametrize("model", [Person, Order])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema_answers_validate(served, model, temperature):
    """Greedy and sampled, a nested schema with $defs, an enum and an optional field: the
    content validates (pydantic), and the answer ends where the JSON does."""
    _, url = served
    out = chat(url, response_format=schema_format(model), temperature=temperature, seed=5)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    model.model_validate_json(choice["message"]["content"])


def test_json_object_is_an_object(served):
    _, url = served
    out = chat(url, response_format={"type": "json_object"}, temperature=0)
    content = out["choices"][0]["message"]
    assert isinstance(json.loads(content["content"]), dict)


def test_a_streamed_json_answer_is_the_whole_one(served):
    _, url = served
    body = {"messages": ASK, "response_format": schema_format(Order), "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert (
        text
        == chat(url, **{k: v for k, v in body.items() if k != "messages"})["choices"][0]["message"][
            "content"
        ]
    )
    Order.model_validate_json(text)


@pytest.mark.parametrize(
    "choice, allowed",
    [
        ({"type": "function", "function": {"name": "local_time"}}, {"local_time"}),
        ("required", {"weather", "local_time"}),
    ],
)
def test_a_forced_tool_call_is_well_formed(served, choice, allowed):
    """tool_choice required or named: the reply is a call to an allowed tool, its arguments
    valid against its parameters, parsed into tool_calls; finish_reason tool_calls."""
    _, url = served
    out = chat(
        url,
        messages=[{"role": "user", "content": "What time is it in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice=choice,
        parallel_tool_calls=False,
        temperature=0,
    )
    c = out["choices"][0]
    assert c["finish_reason"] == "tool_calls", c
    calls = c["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] in allowed
    args = json.loads(calls[0]["function"]["arguments"])
    if calls[0]["function"]["name"] == "local_time":
        assert args["zone"] in ("UTC", "CET") and set(args) == {"zone"}
    else:
        assert isinstance(args["city"], str)


def test_parallel_calls_are_each_well_formed(served):
    _, url = served
    out = chat(
        url,
        messages=[{"role": "user", "content": "Weather in Paris and Rome?"}],
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=120,
    )
    calls = out["choices"][0]["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "weather" for c in calls)
    for c in calls:
        assert isinstance(json.loads(c["function"]["arguments"])["city"], str)


def test_eight_constrained_rows_decode_together(served):
    """Eight concurrent requests, each with its own prompt, schema and matcher, in batched
    decode steps: every answer validates against its own schema. (Greedy: sampled at
    temperature 1 this small model can write one JSON string until max_tokens, which no
    grammar prevents; the answer then ends with finish_reason "length".)"""
    engine, url = served
    before = engine.stats()
    kinds = [Person, Order] * 4

    def one(i: int) -> dict:
        ask = [{"role": "user", "content": f"Record number {i} as JSON."}]
        return chat(url, messages=ask, response_format=schema_format(kinds[i]), temperature=0)

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(8)))
    for model, out in zip(kinds, outs, strict=True):
        model.model_validate_json(out["choices"][0]["message"]["content"])
    d = engine.stats().minus(before).decode
    assert d.forwards < d.rows  # some steps held several constrained rows


def test_the_openai_sdks_parse_gets_its_object(served):
    _, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    done = client.chat.completions.parse(
        model=builtin.NAME, messages=ASK, response_format=Order, temperature=0
    )
    assert isinstance(done.choices[0].message.parsed, Order)


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
        {"type": "json_schema"},
        {"type": "xml"},
    ],
)
def test_a_schema_that_does_not_compile_is_a_400(served, fmt):
    _, url = served
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "response_format": fmt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"


def test_compiled_grammars_are_cached_per_schema(served):
    engine, _ = served
    grammars = Grammars(engine.tokenizer, engine.config.vocab_size)
    first = grammars.compile(json_schema_grammar(Person.model_json_schema()))
    again = grammars.compile(json_schema_grammar(Person.model_json_schema()))
    assert first._matcher is again._matcher
    assert first.constraint().matcher is not again.constraint().matcher  # one per request
    with pytest.raises(GrammarError, match="strng"):
        grammars.compile(json_schema_grammar({"type": "strng"}))


def test_generate_with_a_json_schema_file(tmp_path, capsys):
    from edge0.cli import main as cli

    path = tmp_path / "person.json"
    path.write_text(json.dumps(Person.model_json_schema()))
    argv = ["generate", "--prompt", "A person: ", "--json-schema", str(path), "--temperature", "0"]
    assert cli.main([*argv, "--max-tokens", "200"]) == 0
    Person.model_validate_json(capsys.readouterr().out.strip().removeprefix("A person: "))


def test_greedy_constrained_tokens_are_the_masked_argmax(served):
    """The sampler draws among the allowed tokens only: a greedy constrained draw is the
    argmax of the logits over the tokens the matcher allows."""
    engine, _ = served
    grammars = Grammars(engine.tokenizer, engine.config.vocab_size)
    grammar = grammars.compile(json_schema_grammar(Person.model_json_schema()))
    gen = engine.generate(
        engine.tokenizer.encode("A person: "), 40, SamplingParams(temperature=0, grammar=grammar)
    )
    text = engine.tokenizer.decode(gen.drain().tokens)
    Person.model_validate_json(text)


# -- real clients -------------------------------------------------------------------------------


def test_langchain_structured_output_and_forced_tools(served):
    """langchain-openai's with_structured_output (json_schema, its default, and
    function_calling) and bind_tools(tool_choice="any"): each extraction succeeds because the
    grammar guarantees its shape."""
    langchain_openai = pytest.importorskip("langchain_openai")
    _, url = served
    llm = langchain_openai.ChatOpenAI(
        model=builtin.NAME, base_url=f"{url}/v1", api_key="unused", temperature=0, max_retries=0
    )
    question = "Write the order as JSON."
    for method in ("json_schema", "function_calling"):
        got = llm.with_structured_output(Order, method=method).invoke(question)
        assert isinstance(got, Order), (method, got)
    tools = [WEATHER, TIME]
    msg = llm.bind_tools(tools, tool_choice="any", parallel_tool_calls=False).invoke("Time?")
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] in ("weather", "local_time")


def test_pydantic_ai_native_and_tool_output(served):
    """pydantic-ai's NativeOutput (response_format json_schema) and its default tool output
    (a forced call of its final_result tool) both return the typed object."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    _, url = served
    provider = OpenAIProvider(base_url=f"{url}/v1", api_key="unused")
    model = OpenAIChatModel(builtin.NAME, provider=provider)
    settings = {"temperature": 0.0, "parallel_tool_calls": False}
    for output in (NativeOutput(Person), Person):
        agent = Agent(model, output_type=output, model_settings=settings)
        result = agent.run_sync("Describe a person.")
        assert isinstance(result.output, Person), (output, result.output)
