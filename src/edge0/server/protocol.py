"""Request bodies of the OpenAI API, as pydantic models.

Strict types: a string where a number belongs is a 400, not a silent coercion. Unknown fields
are ignored (clients send vendor extras), but known fields that ask for something edge0 does
not do (n > 1, logit_bias, suffix, ...) are refused with a message
instead of being dropped quietly.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from edge0.engine.sampling import MIN_REPETITION_PENALTY

MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
# JSON schemas in tools rarely nest past ~10 levels; the template renderer recurses per level
MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")

# torch.Generator.manual_seed takes any value in this range
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


class Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def check_json(value: Any, name: str) -> Any:
    """Refuse what the tokenizer and template cannot take: lone surrogates, deep nesting.

    JSON's \\ud800 escape decodes to a lone UTF-16 surrogate, which is not Unicode text; deep
    nesting would exhaust the template renderer's recursion. Walks without recursing itself.
    """
    todo: list[tuple[Any, str, int]] = [(value, name, 0)]
    while todo:
        v, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"{where} nests deeper than {MAX_DEPTH} levels")
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):
                raise ValueError(
                    f"{where} contains a lone UTF-16 surrogate (such as \\ud800), which is not "
                    "Unicode text; send characters outside the BMP as a surrogate pair"
                )
        elif isinstance(v, dict):
            for k, item in v.items():
                todo.append((k, f"a key of {where}", depth))
                if isinstance(item, str | dict | list):
                    todo.append((item, f"{where}.{k}", depth + 1))
        elif isinstance(v, list):
            for i, item in enumerate(v):
                if isinstance(item, str | dict | list):
                    todo.append((item, f"{where}[{i}]", depth + 1))
    return value


def cross_field(param: str, message: str) -> PydanticCustomError:
    """An error about how fields combine, still naming the field to change (see errors.py)."""
    return PydanticCustomError("cross_field", message, {"param": param})


class StreamOptions(Model):
    include_usage: bool = False


class ContentPart(Model):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(unsupported_part(self.type))
        if self.text is None:
            raise ValueError("a text content part needs a 'text' string")
        return self


def unsupported_part(kind: Any) -> str:
    """The message for a content part that is not text; image parts, the usual case, by name."""
    if isinstance(kind, str) and "image" in kind:
        return (
            f"image content parts ({kind!r}) are not supported: the model reads text only; "
            "send the message as text"
        )
    return f"content parts of type {kind!r} are not supported (the model reads text only)"


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

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        # said here, once: else the union reports "Input should be a valid string" first
        if isinstance(v, list):
            for part in v:
                if isinstance(part, dict) and part.get("type") != "text":
                    raise ValueError(unsupported_part(part.get("type")))
        return v

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs 'content' or 'tool_calls'")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs 'tool_call_id': the id of the call it answers")
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


class JsonSchemaFormat(Model):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # every schema is enforced by the grammar, strict or not


class ResponseFormat(Model):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {name, schema}")
        return self


class CommonRequest(Model):
    """Fields both endpoints take: sampling, limits, stop strings, streaming."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)  # 0: only the most likely token (greedy)
    top_k: int | None = Field(None, ge=-1)  # sampling top-k, as in vLLM; 0 and -1 = off
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool | None = False  # null is accepted, as by the OpenAI API
    stream_options: StreamOptions | None = None
    n: int | None = 1
    min_p: float | None = Field(None, ge=0, le=1)  # as in vLLM and llama.cpp's server
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=10)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _text_and_depth(cls, v: Any, info: ValidationInfo) -> Any:
        return check_json(v, info.field_name or "body")

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
    # OpenAI fields that ask for what edge0 does not do: refused, never dropped quietly
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _not_done_here(self) -> ChatCompletionRequest:
        if self.audio is not None or any(m != "text" for m in self.modalities or []):
            raise cross_field("modalities", "edge0 answers in text only; leave audio out")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise cross_field(name, f"{name} is OpenAI's deprecated form; send tools")
        if self.web_search_options is not None:
            raise cross_field("web_search_options", "edge0 does not search the web")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise cross_field("top_logprobs", "top_logprobs needs logprobs: true")
        names = {t.function.name for t in self.tools or []}
        if self.tool_choice == "required" and not names:
            raise cross_field("tool_choice", "tool_choice 'required' needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in names:
                raise cross_field(
                    "tool_choice", f"tool_choice names function {name!r}, which is not in tools"
                )
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: score the prompt (echo), generate nothing
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
            raise cross_field("suffix", "suffix (fill-in-the-middle) is not supported")
        if self.best_of not in (None, 1):
            raise cross_field("best_of", "best_of must be 1")
        if self.max_tokens == 0 and not self.echo:
            raise cross_field(
                "max_tokens",
                "max_tokens 0 generates nothing; it is for scoring a prompt, "
                "with echo: true and logprobs",
            )
        return self

    def scores_prompt(self) -> bool:
        """echo + logprobs: the prompt's tokens come back with their logprobs."""
        return bool(self.echo) and self.logprobs is not None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]
        return p


class TokenizeRequest(Model):
    """POST /tokenize (vLLM's): a raw `prompt`, or chat `messages` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True  # the raw prompt's (a chat template writes its own)

    @field_validator("*", mode="before")
    @classmethod
    def _text_and_depth(cls, v: Any, info: ValidationInfo) -> Any:
        return check_json(v, info.field_name or "body")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise cross_field("prompt", "send either prompt or messages")
        return self


class DetokenizeRequest(Model):
    model: str | None = None
    tokens: list[int]


class ResponsesRequest(Model):
    """POST /v1/responses (server/responses_api.py translates it into a chat request)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Seed | None = None
    stream: bool | None = False
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": "none" | "minimal"} turns thinking off
    metadata: dict[str, Any] | None = None
    store: bool | None = None  # nothing is stored either way
    user: str | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _text_and_depth(cls, v: Any, info: ValidationInfo) -> Any:
        return check_json(v, info.field_name or "body")
