"""Tool calls in three output formats, parsed incrementally from the answer text.

    <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>              (JSON, Qwen)
    <tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>  (XML)
    <tool_call>f\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>    (arg: Ling)

In the XML and arg formats a value is typed by the tool's JSON schema: a string parameter
stays as written, anything else is read as JSON where it is JSON.

A block becomes a call when its closing tag arrives, so a stream carries each call whole. A
block that does not parse stays in the text, so nothing the model wrote is lost. Whitespace
around calls is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from edge0.text.stops import partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)
ARG_KEY = "<arg_key>"
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text (what the OpenAI API carries)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            d = {"index": index, **d}
        return d


def forced_prefix(tool_choice, tool_format: str) -> str:
    """Text that starts the reply when the request forces a call (no constrained decoding
    needed: the model continues a call that is already open)."""
    if tool_choice == "required":
        return OPEN + "\n"
    name = getattr(getattr(tool_choice, "function", None), "name", None)
    if name is None:
        return ""
    if tool_format == "xml":
        return f"{OPEN}\n<function={name}>\n"
    if tool_format == "arg":
        return f"{OPEN}{name}\n"
    return f'{OPEN}\n{{"name": "{name}", "arguments": '


def parse_block(body: str, schemas: dict[str, dict]) -> ParsedCall | None:
    """One `<tool_call>` body as a call, or None if it is neither format."""
    body = body.strip()
    if body.startswith("<function="):
        return _parse_xml(body, schemas)
    if not body.startswith("{"):
        return _parse_args(body, schemas)
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _parse_xml(body: str, schemas: dict[str, dict]) -> ParsedCall | None:
    m = _FUNCTION.fullmatch(body)
    if m is None:
        return None
    name, inner = m.group(1), m.group(2)
    props = (schemas.get(name) or {}).get("properties") or {}
    args = {}
    for p in _PARAMETER.finditer(inner):
        key, raw = p.group(1), p.group(2).removeprefix("\n").removesuffix("\n")
        args[key] = _coerce(raw, props.get(key) or {})
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def _parse_args(body: str, schemas: dict[str, dict]) -> ParsedCall | None:
    """`name` then `<arg_key>k</arg_key><arg_value>v</arg_value>` pairs and nothing else."""
    name, sep, rest = body.partition(ARG_KEY)
    name, rest = name.strip(), sep + rest
    if not _NAME.fullmatch(name):
        return None
    pairs = list(_ARG.finditer(rest))
    if _ARG.sub("", rest).strip():  # text outside the pairs: not a call in this format
        return None
    props = (schemas.get(name) or {}).get("properties") or {}
    args = {
        m.group(1).strip(): _coerce(m.group(2), props.get(m.group(1).strip()) or {}) for m in pairs
    }
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def _coerce(raw: str, schema: dict) -> Any:
    """A parameter value typed by its JSON schema; an untyped value is read as JSON if it is."""
    if schema.get("type") == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


class ToolCallParser:
    """feed(text) -> [("content", str) | ("tool_call", ParsedCall)]; see the module docstring."""

    def __init__(self, tools: list[dict] | None = None):
        self.schemas = {
            t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []
        }
        self.pending = ""
        self.space = ""  # trailing whitespace of the text, kept until we know what follows
        self.in_call = False
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.pending += text
        out: list[tuple[str, Any]] = []
        while True:
            if self.in_call:
                i = self.pending.find(CLOSE)
                if i < 0:
                    return out
                body, self.pending = self.pending[:i], self.pending[i + len(CLOSE) :]
                self.in_call = False
                call = parse_block(body, self.schemas)
                if call is None:
                    self._text(out, OPEN + body + CLOSE)
                else:
                    self.space = ""
                    self.calls.append(call)
                    out.append(("tool_call", call))
                continue
            i = self.pending.find(OPEN)
            if i >= 0:
                before, self.pending = self.pending[:i], self.pending[i + len(OPEN) :]
                self._text(out, before)
                self.in_call = True
                continue
            keep = partial_suffix(self.pending, [OPEN])
            self._text(out, self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep :]
            return out

    def finish(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self.in_call:  # cut off inside a block: it stays text
            self._text(out, OPEN + self.pending)
        else:
            self._text(out, self.pending)
        self.pending, self.in_call = "", False
        if self.space and not self.calls:
            out.append(("content", self.space))
        self.space = ""
        return out

    def _text(self, out: list[tuple[str, Any]], text: str) -> None:
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body) :]
        if body:
            out.append(("content", body))
