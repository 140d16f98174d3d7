"""Chat messages to prompt token ids, through the model's own chat template.

The template is the one in the model directory's tokenizer config, rendered by transformers in
its sandboxed Jinja environment; no remote code runs. Control tokens written inside messages
(`<|im_start|>` typed by a user) are encoded as plain text, so a message cannot forge a turn.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

THINK_OPEN = "<think>"


@dataclass
class ChatPrompt:
    ids: list[int]
    thinking: bool  # split <think>...</think> into reasoning_content
    opens_in_reasoning: bool  # the template already opened the <think> block


class ChatTemplate:
    """Renders OpenAI-style messages with a tokenizer's chat template; see the module docstring."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tok = tokenizer
        template = tokenizer.chat_template
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()), None)
        self.template: str | None = template
        # keyword arguments of apply_chat_template itself may not be smuggled in as variables
        self.reserved = set(inspect.signature(tokenizer.apply_chat_template).parameters) | {
            "messages",
            "tools",
            "add_generation_prompt",
        }

    @property
    def available(self) -> bool:
        return bool(self.template)

    @property
    def tool_format(self) -> str:
        """'xml' for Qwen3-Coder style `<function=...>` calls, 'arg' for Ling's
        `<arg_key>`/`<arg_value>` pairs, else 'json' (server/tools.py)."""
        if self.template and "<function=" in self.template:
            return "xml"
        if self.template and "<arg_key>" in self.template:
            return "arg"
        return "json"

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        bad = sorted(set(kwargs) & self.reserved)
        if bad:
            raise ValueError(
                f"chat_template_kwargs may not set {', '.join(bad)}: these are arguments of the "
                "template renderer, not template variables"
            )

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
        prefix: str = "",
    ) -> ChatPrompt:
        """Token ids of the conversation plus the assistant header (and `prefix`, if any).

        Raises ValueError naming the problem when the model has no template or the template
        rejects the conversation.
        """
        if not self.available:
            raise ValueError(
                "this model has no chat template in its tokenizer config; "
                "use /v1/completions with a raw prompt"
            )
        kwargs = dict(kwargs or {})
        self.check_kwargs(kwargs)  # (callers may check first, to name the field)
        try:
            ids = self.tok.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                sanitize_control_tokens=True,
                **kwargs,
            )
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
            # the model's template meets client data here: a failure is the request's shape
            raise ValueError(f"the chat template could not render this conversation: {e}") from e
        ids = list(ids)
        tail = self.tok.decode(ids[-8:], skip_special_tokens=False).rstrip()
        if prefix:
            ids += self.tok.encode(prefix, add_special_tokens=False)
        return ChatPrompt(
            ids=ids,
            thinking=kwargs.get("enable_thinking") is not False and not prefix,
            opens_in_reasoning=tail.endswith(THINK_OPEN),
        )


def template_messages(messages) -> list[dict[str, Any]]:
    """protocol.Message objects as the dicts chat templates expect.

    Tool-call arguments become objects (templates print them with tojson); `developer` is
    the newer name of `system`.
    """
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        d["content"] = m.text()
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _args(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
        out.append(d)
    return out


def _args(arguments: str | dict) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # the template prints it as given
