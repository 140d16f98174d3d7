"""POST /v1/responses through the official openai SDK, on the built-in model: text, streamed
events, function tools and their outputs, structured output (`responses.parse`), and the
refusals that name their field."""

from __future__ import annotations

import httpx
import openai
import pydantic
import pytest

from edge0 import builtin
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.server.app import ServerOptions, create_app
from test_server import live_server


class Person(pydantic.BaseModel):
    name: str
    age: int


WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def served():
    engine = load_engine(builtin.model_dir(), EngineOptions(max_active=4))
    app = create_app(engine, ServerOptions(model_name=builtin.NAME))
    with live_server(app) as url:
        yield engine, url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    engine.close()


def test_text_matches_the_chat_endpoint(served):
    """The same conversation through /v1/responses and /v1/chat/completions gives the same
    text and token counts (one machinery); a cut answer is `incomplete`."""
    _, _, client = served
    kw = {"temperature": 0}
    r = client.responses.create(
        model=builtin.NAME, instructions="Be brief.", input="def add(a, b):",
        max_output_tokens=16, **kw,
    )  # fmt: skip
    c = client.chat.completions.create(
        model=builtin.NAME,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "def add(a, b):"},
        ],
        max_tokens=16, **kw,
    )  # fmt: skip
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")
    assert r.output[-1].type == "message" and r.output[-1].role == "assistant"


def test_parse_and_stream_structured_output(served):
    _, _, client = served
    parsed = client.responses.parse(
        model=builtin.NAME, input="A person as JSON.", text_format=Person, temperature=0
    )
    assert isinstance(parsed.output_parsed, Person) and parsed.status == "completed"
    with client.responses.stream(
        model=builtin.NAME, input="A person as JSON.", text_format=Person, temperature=0
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    assert final.output_parsed == parsed.output_parsed


def test_function_tools_round_trip(served):
    """A forced call comes back as a function_call item with valid arguments; its output sent
    back as a function_call_output item continues the conversation."""
    _, _, client = served
    r = client.responses.create(
        model=builtin.NAME, input="Weather in Paris?", tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, temperature=0,
    )  # fmt: skip
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "weather"
    assert set(pydantic.TypeAdapter(dict).validate_json(calls[0].arguments)) == {"city"}
    again = client.responses.create(
        model=builtin.NAME,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        ],
        tools=[WEATHER], max_output_tokens=8, temperature=0,
    )  # fmt: skip
    assert again.output and again.usage.input_tokens > r.usage.input_tokens


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),  # past the context
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p",
                                             "schema": {"type": "strng"}}}}, "text"),
        ({"input": "x", "model": "gpt-4o"}, "model"),
    ],
)  # fmt: skip
def test_what_cannot_run_is_refused_by_name(served, body, param):
    _, url, _ = served
    r = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text
