"""POST /v1/responses: OpenAI's Responses API over the chat machinery.

A request is translated into a chat request (instructions -> a system message; input text,
messages, function calls and their outputs -> the conversation; function tools, tool_choice
and text.format -> tools, tool_choice and response_format), then rendered, constrained and
generated exactly as /v1/chat/completions does. The answer comes back as output items:
a `reasoning` item (a thinking model's think block), a `message` with `output_text`, and one
`function_call` item per call. Streamed, it is the Responses API's typed events, each with a
sequence_number, ending in `response.completed` (or `response.incomplete`).

Nothing is stored: `previous_response_id` is refused (send the conversation as `input`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edge0.server.chat_api import ChatOutput, message_parts, start_chat
from edge0.server.errors import APIError, bad_request, error_body
from edge0.server.jobs import EventStream, shutting_down
from edge0.server.protocol import ChatCompletionRequest, ResponsesRequest
from edge0.server.state import ServerState, new_id
from edge0.server.worker import CANCELLED, SHUTTING_DOWN, Done, Failed, Token

ENDPOINT = "responses"
# a chat field's name in a Responses request, for the 400s the chat checks give
_PARAM = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",  # (the context-window check's name for the limit)
    "response_format": "text",
}


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise bad_request(
                    f"{where}.content[{i}] is {kind!r}; edge0 takes text parts only "
                    "(input_text, output_text)",
                    param="input",
                )
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise bad_request(f"{where}.content must be text or a list of text parts", param="input")


def chat_messages(body: ResponsesRequest) -> list[dict]:
    """The conversation a Responses request describes, as chat messages."""
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role {role!r} is not a message role", param="input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif kind == "reasoning":
            continue  # a previous answer's think block: templates drop it from history
        else:
            raise bad_request(
                f"{where} is a {kind!r} item, which edge0 does not take", param="input"
            )
    return messages


def as_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request asks for (400s name the Responses field)."""
    if body.previous_response_id is not None:
        raise bad_request(
            "edge0 stores no responses; send the whole conversation as input",
            param="previous_response_id",
        )
    chat: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "parallel_tool_calls"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise bad_request(
                    f"tools[{i}] is a {tool.get('type')!r} tool; edge0 runs function tools",
                    param="tools",
                )
            fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            chat["tools"].append({"type": "function", "function": fn})
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None:
        chat["response_format"] = fmt
    if body.reasoning is not None and body.reasoning.get("effort") in ("none", "minimal"):
        chat["enable_thinking"] = False
    try:
        return ChatCompletionRequest.model_validate(chat)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "input"
        raise bad_request(f"{field}: {err['msg']}", param=_PARAM.get(field, field)) from e


class Items:
    """The response's output items, built as the reply's deltas arrive."""

    def __init__(self):
        self.reasoning: list[str] = []
        self.text: list[str] = []
        self.message_id = new_id("msg")
        self.calls: list[dict] = []

    def message(self, status: str = "completed") -> dict:
        part = {"type": "output_text", "text": "".join(self.text), "annotations": []}
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [part],
        }

    def output(self) -> list[dict]:
        out: list[dict] = []
        if self.reasoning:
            text = "".join(self.reasoning)
            out.append(
                {
                    "type": "reasoning",
                    "id": new_id("rs"),
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": text}],
                }
            )
        if self.text or not self.calls:
            out.append(self.message())
        return out + self.calls


def function_call(call: dict) -> dict:
    return {
        "type": "function_call",
        "id": new_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


def response_object(
    body: ResponsesRequest, rid: str, created: float, status: str, output: list[dict], usage
) -> dict:
    return {
        "id": rid,
        "object": "response",
        "created_at": int(created),
        "status": status,
        "error": None,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": body.model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": body.reasoning,
        "store": False,
        "temperature": body.temperature,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": usage,
        "metadata": body.metadata or {},
    }


def usage_of(prompt_tokens: int, done: Done | None) -> dict | None:
    if done is None:
        return None
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": done.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + done.completion_tokens,
    }


def _status(done: Done) -> str:
    return "incomplete" if done.finish_reason == "length" else "completed"


async def responses(state: ServerState, body: ResponsesRequest, request: Request) -> Response:
    chat = as_chat(body)
    body = body.model_copy(update={"model": body.model or state.model_name})
    try:
        started = await start_chat(state, chat, ENDPOINT)
    except APIError as e:  # the chat checks' 400s, in this API's names
        e.param = _PARAM.get(e.param, e.param)
        e.message = e.message.replace("response_format.json_schema.schema", "text.format.schema")
        e.message = e.message.replace("max_tokens ", "max_output_tokens ")
        raise
    rid, created = new_id("resp"), time.time()
    if body.stream:
        return EventStream(_stream(state, body, started, rid, created))
    tokens, done = await state.collect(ENDPOINT, started.pending, request)
    output: ChatOutput = started.output
    deltas = [d for t in tokens for d in output.feed(t.text)] + output.feed(done.text)
    content, reasoning, calls = message_parts(deltas + output.finish())
    items = Items()
    items.text = [content] if content else []
    items.reasoning = [reasoning] if reasoning else []
    items.calls = [function_call(c) for c in calls]
    usage = usage_of(started.prompt_tokens, done)
    obj = response_object(body, rid, created, _status(done), items.output(), usage)
    obj["output_text"] = content or ""
    return JSONResponse(obj)


async def _stream(state, body, started, rid: str, created: float):
    """The Responses API's typed events (`event:` and `data:` lines)."""
    seq = 0
    items = Items()
    text_index: int | None = None  # the message item's output_index, once its text starts
    next_index = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def snapshot(status: str, output: list[dict], usage=None) -> dict:
        return response_object(body, rid, created, status, output, usage)

    def route(deltas: list[dict]):
        nonlocal text_index, next_index
        for d in deltas:
            if "reasoning_content" in d:
                items.reasoning.append(d["reasoning_content"])
            if d.get("content"):
                if text_index is None:
                    text_index, next_index = next_index, next_index + 1
                    yield event(
                        "response.output_item.added",
                        output_index=text_index,
                        item={**items.message("in_progress"), "content": []},
                    )
                    part = {"type": "output_text", "text": "", "annotations": []}
                    yield event(
                        "response.content_part.added",
                        item_id=items.message_id,
                        output_index=text_index,
                        content_index=0,
                        part=part,
                    )
                items.text.append(d["content"])
                yield event(
                    "response.output_text.delta",
                    item_id=items.message_id,
                    output_index=text_index,
                    content_index=0,
                    delta=d["content"],
                    logprobs=[],
                )
            for call in d.get("tool_calls", []):
                item = function_call(call)
                index, next_index = next_index, next_index + 1
                items.calls.append(item)
                yield event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"},
                )
                yield event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                )
                yield event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
                yield event("response.output_item.done", output_index=index, item=item)

    def streamed() -> list[dict]:
        """The output items in the order they were announced; reasoning (not streamed) and an
        empty message (when nothing else came) after them."""
        calls = iter(items.calls)
        out = [items.message() if i == text_index else next(calls) for i in range(next_index)]
        if text_index is None and not items.calls:
            out.append(items.message())
        return out + [i for i in items.output() if i["type"] == "reasoning"]

    pending, output = started.pending, started.output
    outcome = CANCELLED
    try:
        yield event("response.created", response=snapshot("in_progress", []))
        yield event("response.in_progress", response=snapshot("in_progress", []))
        async for ev in pending:
            if isinstance(ev, Token):
                for e in route(output.feed(ev.text)):
                    yield e
            elif isinstance(ev, Failed):
                outcome = "error"
                failed = snapshot("failed", streamed())
                failed["error"] = error_body(f"generation failed: {ev.message}", "server_error")[
                    "error"
                ]
                yield event("response.failed", response=failed)
                break
            else:
                outcome = ev.finish_reason
                if outcome == CANCELLED:
                    return
                state.record(ENDPOINT, outcome, pending)
                if outcome == SHUTTING_DOWN:
                    yield event("error", **shutting_down().body()["error"])
                    break
                for e in route(output.feed(ev.text) + output.finish()):
                    yield e
                if text_index is not None:
                    text = "".join(items.text)
                    yield event(
                        "response.output_text.done",
                        item_id=items.message_id,
                        output_index=text_index,
                        content_index=0,
                        text=text,
                        logprobs=[],
                    )
                    yield event(
                        "response.content_part.done",
                        item_id=items.message_id,
                        output_index=text_index,
                        content_index=0,
                        part={"type": "output_text", "text": text, "annotations": []},
                    )
                    yield event(
                        "response.output_item.done", output_index=text_index, item=items.message()
                    )
                status = _status(ev)
                final = snapshot(status, streamed(), usage_of(started.prompt_tokens, ev))
                kind = "response.completed" if status == "completed" else "response.incomplete"
                yield event(kind, response=final)
    finally:
        if outcome in (CANCELLED, "error"):
            pending.cancel()
            state.record(ENDPOINT, outcome, pending)
