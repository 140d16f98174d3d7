"""Request bodies of the OpenAI API, as pydantic models.

Strict types: a string where a number belongs is a 400, not a silent coercion. Unknown fields
are ignored (clients send vendor extras), but known fields that ask for something edge0 does
not do (n > 1, penalties, logit_bias, echo with logprobs, ...) are refused with a message
instead of being dropped quietly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20

# torch.Generator.manual_seed takes any value in this range
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


class Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(Model):
    include_usage: bool = False


class ContentPart(Model):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"only text content parts are supported, not {self.type!r}")
        if self.text is None:
            raise ValueError("a text content part needs a 'text' string")
        return self


class FunctionCall(Model):
    name: str
    arguments: str | dict[str, Any] = "{}"  # a JSON string per the API; objects are accepted


class ToolCall(Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs 'content' or 'tool_calls'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


class FunctionDef(Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Model):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Model):
    name: str


class NamedToolChoice(Model):
    type: Literal["function"]
    function: FunctionName


class ResponseFormat(Model):
    type: Literal["text"]


class CommonRequest(Model):
    """Fields both endpoints take: sampling, limits, stop strings, streaming."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # sampling top-k, as in vLLM; 0 and -1 = off
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError(f"n must be 1 (edge0 generates one choice per request), got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v:
            raise ValueError("penalties are not supported; leave them out or send 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(CommonRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None  # shorthand for chat_template_kwargs.enable_thinking
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = {t.function.name for t in self.tools or []}
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in names:
                raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError(f"send one prompt per request, got {len(v)}")
        return v

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of must be 1")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs needs prompt logprobs, which edge0 does not score")
        return self

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]
        return p
