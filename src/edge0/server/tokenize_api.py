"""POST /tokenize and /detokenize, as vLLM serves them: count a prompt's tokens (a raw prompt,
or a conversation through the chat template exactly as /v1/chat/completions renders it) and
turn token ids back into text."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from edge0.server.errors import bad_request
from edge0.server.protocol import DetokenizeRequest, TokenizeRequest
from edge0.server.state import ServerState
from edge0.text.prompt import template_messages


async def tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    state.check_model(body.model)
    if body.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []] or None
        kwargs = dict(body.chat_template_kwargs or {})
        try:
            state.template.check_kwargs(kwargs)
        except ValueError as e:
            raise bad_request(str(e), param="chat_template_kwargs") from e
        try:
            prompt = await run_in_threadpool(
                state.template.render, template_messages(body.messages), tools, kwargs
            )
        except ValueError as e:
            raise bad_request(str(e), param="messages") from e
        ids = prompt.ids
    else:
        ids = await run_in_threadpool(
            state.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
        )
    return {"count": len(ids), "max_model_len": state.context, "tokens": ids}


async def detokenize(state: ServerState, body: DetokenizeRequest) -> dict:
    state.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
    if bad:
        raise bad_request(
            f"token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})", param="tokens"
        )
    return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}
