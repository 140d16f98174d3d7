"""POST /v1/completions: a raw prompt (text or token ids) continued, with legacy logprobs."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edge0.server.chat_api import usage
from edge0.server.errors import bad_request, error_body
from edge0.server.jobs import EventStream, request_sampling, shutting_down, sse, token_budget
from edge0.server.logprobs import TokenLogprob, legacy_logprobs
from edge0.server.protocol import CompletionRequest
from edge0.server.state import ServerState, new_id, now
from edge0.server.worker import CANCELLED, SHUTTING_DOWN, Failed, Token
from edge0.util.limits import COMPLETIONS_MAX_TOKENS

ENDPOINT = "completions"


def prompt_ids(state: ServerState, body: CompletionRequest) -> tuple[list[int], str]:
    """The prompt as token ids, and as text (for echo)."""
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        ids = state.tokenizer.encode(prompt)
        text = prompt
    else:
        bad = [t for t in prompt if not 0 <= t < state.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
                param="prompt",
            )
        ids = list(prompt)
        text = state.tokenizer.decode(ids)
    if not ids:
        raise bad_request("the prompt is empty", param="prompt")
    return ids, text


async def completions(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    state.check_model(body.model)
    # off the event loop: a long prompt takes seconds to tokenize, and streams must flow
    ids, text = await run_in_threadpool(prompt_ids, state, body)
    requested = body.max_tokens if body.max_tokens is not None else COMPLETIONS_MAX_TOKENS
    max_tokens = token_budget(requested, len(ids), state.context, None, "prompt")
    scored = body.scores_prompt()
    pending = state.submit(
        ENDPOINT,
        prompt=ids,
        max_tokens=max_tokens,
        sampling=request_sampling(state.sampling, body),
        stop=body.stop_list(),
        top_logprobs=body.logprobs,
        score_prompt=body.logprobs if scored else None,
    )
    meta = {"id": new_id("cmpl"), "created": now(), "model": state.model_name}
    echo = text if body.echo else ""
    if body.stream:
        return EventStream(_stream(state, body, pending, meta, len(ids), echo))
    tokens, done = await state.collect(ENDPOINT, pending, request)
    logprobs = None
    if body.logprobs is not None:
        entries = [lp for t in tokens for lp in t.logprobs] + done.logprobs
        if scored:  # the prompt's entries first, their offsets from the start of the echo
            first = tokens[0] if tokens else done
            logprobs = legacy_logprobs(state.strings, (first.prompt_logprobs or []) + entries, 0)
        else:
            logprobs = legacy_logprobs(state.strings, entries, len(echo))
    choice = {
        "index": 0,
        "text": echo + "".join(t.text for t in tokens) + done.text,
        "logprobs": logprobs,
        "finish_reason": done.finish_reason,
    }
    return JSONResponse(
        {
            **meta,
            "object": "text_completion",
            "choices": [choice],
            "usage": usage(len(ids), done.completion_tokens),
        }
    )


async def _stream(state, body, pending, meta, n_prompt, echo):
    include_usage = body.include_usage()
    offset = len(echo)

    def chunk(text: str, entries: list[TokenLogprob], finish: str | None = None) -> str:
        nonlocal offset
        logprobs = None
        if body.logprobs is not None:
            logprobs = legacy_logprobs(state.strings, entries, offset)
        offset += sum(len(state.strings.text(e.token)) for e in entries)
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        c = {**meta, "object": "text_completion", "choices": [choice]}
        if include_usage:
            c["usage"] = None
        return sse(c)

    outcome = CANCELLED
    scored = body.scores_prompt()
    try:
        if echo and not scored:
            yield chunk(echo, [])
        async for event in pending:
            if scored and not isinstance(event, Failed) and event.prompt_logprobs is not None:
                offset = 0  # the echo, with its tokens' logprobs, once the prompt is scored
                yield chunk(echo, event.prompt_logprobs)
            if isinstance(event, Token):
                if event.text:  # logprobs come only with text (see worker.Token)
                    yield chunk(event.text, event.logprobs)
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
                yield chunk(event.text, event.logprobs, event.finish_reason)
                if include_usage:
                    u = {**meta, "object": "text_completion", "choices": []}
                    yield sse({**u, "usage": usage(n_prompt, event.completion_tokens)})
        yield sse("[DONE]")
    finally:
        if outcome in (CANCELLED, "error"):
            pending.cancel()
            state.record(ENDPOINT, outcome, pending)
