"""POST /v1/chat/completions: template, generate, then split reasoning, answer and tool calls.

Streamed and whole responses go through the same ChatOutput, so a stream's deltas always add
up to the non-streamed message.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edge0.engine.grammar import (
    CompiledGrammar,
    json_object_grammar,
    json_schema_grammar,
    lark_literal,
    tool_call_grammar,
)
from edge0.server.errors import bad_request, error_body
from edge0.server.jobs import (
    EventStream,
    Pending,
    request_sampling,
    shutting_down,
    sse,
    token_budget,
)
from edge0.server.logprobs import TokenLogprob
from edge0.server.protocol import ChatCompletionRequest, NamedToolChoice
from edge0.server.state import ServerState, new_id, now
from edge0.server.tools import CLOSE, OPEN, ToolCallParser, forced_prefix
from edge0.server.worker import CANCELLED, SHUTTING_DOWN, Done, Failed, Token
from edge0.text.prompt import ChatPrompt, template_messages
from edge0.text.reasoning import REASONING, ThinkSplitter

ENDPOINT = "chat"


class ChatOutput:
    """Generated text -> message deltas: reasoning_content, content, tool_calls."""

    def __init__(self, prompt: ChatPrompt, tools: list[dict] | None, prefix: str):
        self.splitter = ThinkSplitter(prompt.opens_in_reasoning) if prompt.thinking else None
        self.parser = ToolCallParser(tools) if tools is not None else None
        self.calls = 0
        if prefix:
            assert self.parser is not None
            self.parser.feed(prefix)  # opens the forced call; emits nothing

    def feed(self, text: str) -> list[dict[str, Any]]:
        parts = self.splitter.feed(text) if self.splitter else [("content", text)]
        return self._route(parts)

    def finish(self) -> list[dict[str, Any]]:
        deltas = self._route(self.splitter.finish()) if self.splitter else []
        if self.parser is not None:
            deltas += self._answer(self.parser.finish())
        return deltas

    def _route(self, parts: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for channel, text in parts:
            if channel == REASONING:
                out.append({"reasoning_content": text})
            elif self.parser is not None:
                out += self._answer(self.parser.feed(text))
            else:
                out.append({"content": text})
        return out

    def _answer(self, items: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, value in items:
            if kind == "content":
                out.append({"content": value})
            else:
                out.append({"tool_calls": [value.as_dict(index=self.calls)]})
                self.calls += 1
        return out

    def finish_reason(self, done: Done) -> str:
        return "tool_calls" if self.calls and done.finish_reason == "stop" else done.finish_reason


def forced_tools(body: ChatCompletionRequest, tools: list[dict] | None) -> list[dict] | None:
    """The tools a forced tool_choice allows (None: the choice is the model's)."""
    if not tools:
        return None
    if body.tool_choice == "required":
        return tools
    if isinstance(body.tool_choice, NamedToolChoice):
        name = body.tool_choice.function.name
        return [t for t in tools if t["function"]["name"] == name]
    return None


async def request_grammar(
    state: ServerState, body: ChatCompletionRequest, tools: list[dict] | None
) -> CompiledGrammar | None:
    """The grammar a request's reply must follow: a forced tool call (in the template's JSON
    tool-call format), or response_format's JSON; None for free text. A schema the grammar
    compiler refuses is a 400 naming it."""
    forced = forced_tools(body, tools)
    fmt = body.response_format
    if forced is not None and state.template.tool_format == "json":
        tok = state.tokenizer
        parallel = body.tool_choice == "required" and body.parallel_tool_calls is not False
        param = "tools"

        def text() -> str:
            return tool_call_grammar(
                forced, lark_literal(tok, OPEN), lark_literal(tok, CLOSE), parallel
            )
    elif fmt is not None and fmt.type == "json_object":
        param = "response_format"
        text = json_object_grammar
    elif fmt is not None and fmt.type == "json_schema":
        param = "response_format"
        schema = fmt.json_schema.schema_ if fmt.json_schema else None

        def text() -> str:
            return json_schema_grammar(schema if schema is not None else {"type": "object"})
    else:
        return None
    try:
        return await run_in_threadpool(lambda: state.grammars.compile(text()))
    except Exception as e:  # the compiler's own errors name what it cannot take
        part = "response_format.json_schema.schema" if param == "response_format" else param
        raise bad_request(f"{part} cannot be compiled into a grammar: {e}", param=param) from e


@dataclasses.dataclass
class Started:
    """A chat request rendered, checked and queued: what its response is made from."""

    pending: Pending
    output: ChatOutput
    prompt_tokens: int
    top_logprobs: int | None


async def start_chat(state: ServerState, body: ChatCompletionRequest, endpoint: str) -> Started:
    """Render, check and queue a chat request (the chat endpoint's, and /v1/responses' once
    translated); 4xx for what cannot run."""
    state.check_model(body.model)
    template = state.template
    kwargs = dict(body.chat_template_kwargs or {})
    if body.enable_thinking is not None:
        kwargs.setdefault("enable_thinking", body.enable_thinking)
    tools = None
    if body.tools and body.tool_choice != "none":
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
    grammar = await request_grammar(state, body, tools)
    prefix = ""
    if tools and grammar is None:  # a format no grammar is written for: open the call
        prefix = forced_prefix(body.tool_choice, template.tool_format)
    if prefix or grammar is not None:  # the reply starts with the call or the JSON at once
        kwargs.setdefault("enable_thinking", False)
    try:
        template.check_kwargs(kwargs)
    except ValueError as e:
        raise bad_request(str(e), param="chat_template_kwargs") from e
    try:
        # off the event loop: a long prompt takes seconds to tokenize, and streams must flow
        prompt = await run_in_threadpool(
            template.render, template_messages(body.messages), tools, kwargs, prefix
        )
    except ValueError as e:
        raise bad_request(str(e), param="messages") from e
    max_tokens = token_budget(
        body.token_limit(), len(prompt.ids), state.context, state.default_max_tokens, "messages"
    )
    top = (body.top_logprobs or 0) if body.logprobs else None
    pending = state.submit(
        endpoint,
        prompt=prompt.ids,
        max_tokens=max_tokens,
        sampling=dataclasses.replace(request_sampling(state.sampling, body), grammar=grammar),
        stop=body.stop_list(),
        top_logprobs=top,
    )
    return Started(pending, ChatOutput(prompt, tools, prefix), len(prompt.ids), top)


async def chat_completions(
    state: ServerState, body: ChatCompletionRequest, request: Request
) -> Response:
    started = await start_chat(state, body, ENDPOINT)
    pending, output, n_prompt = started.pending, started.output, started.prompt_tokens
    meta = {"id": new_id("chatcmpl"), "created": now(), "model": state.model_name}
    if body.stream:
        return EventStream(_stream(state, body, pending, output, meta, n_prompt))
    want_logprobs = started.top_logprobs is not None
    return await _whole(state, pending, output, meta, n_prompt, request, want_logprobs)


def message_parts(deltas: list[dict]) -> tuple[str | None, str | None, list[dict]]:
    """A whole reply's content, reasoning and tool calls (without their stream index)."""
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    calls = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return _join(deltas, "content"), _join(deltas, "reasoning_content"), calls


async def _whole(state, pending, output, meta, n_prompt, request, want_logprobs) -> Response:
    tokens, done = await state.collect(ENDPOINT, pending, request)
    deltas = [d for t in tokens for d in output.feed(t.text)] + output.feed(done.text)
    deltas += output.finish()
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    content = _join(deltas, "content")
    # content is null only beside tool calls, as in the OpenAI API
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    reasoning = _join(deltas, "reasoning_content")
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    logprobs = None
    if want_logprobs:
        entries = [lp for t in tokens for lp in t.logprobs] + done.logprobs
        logprobs = {"content": [state.strings.chat_entry(lp) for lp in entries]}
    choice = {
        "index": 0,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": output.finish_reason(done),
    }
    return JSONResponse(
        {
            **meta,
            "object": "chat.completion",
            "choices": [choice],
            "usage": usage(n_prompt, done.completion_tokens),
        }
    )


def _join(deltas: list[dict], key: str) -> str | None:
    parts = [d[key] for d in deltas if key in d]
    return "".join(parts) if parts else None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _stream(state, body, pending, output, meta, n_prompt):
    include_usage = body.include_usage()
    strings = state.strings
    held: list[TokenLogprob] = []  # logprobs of tokens whose text is not out yet

    def chunk(delta: dict, finish: str | None = None) -> str:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
        if held:
            choice["logprobs"] = {"content": [strings.chat_entry(lp) for lp in held]}
            held.clear()
        choice["finish_reason"] = finish
        c = {**meta, "object": "chat.completion.chunk", "choices": [choice]}
        if include_usage:
            c["usage"] = None
        return sse(c)

    outcome = CANCELLED
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for event in pending:
            if isinstance(event, Token):
                held.extend(event.logprobs)
                for delta in output.feed(event.text):
                    yield chunk(delta)
            elif isinstance(event, Failed):
                outcome = "error"
                yield sse(error_body(f"generation failed: {event.message}", "server_error"))
                break
            else:
                outcome = event.finish_reason
                if outcome == CANCELLED:  # the client is gone: nobody reads what follows
                    return
                state.record(ENDPOINT, outcome, pending)
                if outcome == SHUTTING_DOWN:
                    yield sse(shutting_down().body())
                    break
                held.extend(event.logprobs)
                for delta in output.feed(event.text) + output.finish():
                    yield chunk(delta)
                yield chunk({}, output.finish_reason(event))
                if include_usage:
                    u = {**meta, "object": "chat.completion.chunk", "choices": []}
                    yield sse({**u, "usage": usage(n_prompt, event.completion_tokens)})
        yield sse("[DONE]")
    finally:
        if outcome in (CANCELLED, "error"):
            pending.cancel()
            state.record(ENDPOINT, outcome, pending)
