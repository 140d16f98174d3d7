"""Constrained decoding: a grammar says which tokens may come next, and the sampler draws only
among them.

llguidance (docs/server.md says why it was chosen) compiles a JSON schema, or a Lark grammar
that embeds JSON schemas, against the model's tokenizer. Each request gets its own matcher:
before every draw it fills a token bitmask that sets the logits of every token the grammar
does not allow to -inf, and after the draw it consumes the token. When the grammar is complete
the matcher allows only an end-of-text token, so the answer ends there.

JSON is generated compact (`{"a": 1, "b": [2, 3]}`, the separators the chat templates print),
so a small model cannot wander off into whitespace. Compiled grammars are cached per grammar
text: a second request with the same schema copies the compiled matcher.

Used by the server (`response_format`, forced `tool_choice`) and by `edge0 generate` and
`edge0 chat` (`--json-schema FILE`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

# compact JSON, the separators json.dumps and the chat templates use
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHED_GRAMMARS = 64


class GrammarError(ValueError):
    """A schema or grammar that does not compile; the message names the part."""


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON text valid against `schema`."""
    import llguidance

    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    return llguidance.LLMatcher.grammar_from_json_schema({**schema, "x-guidance": _COMPACT})


def json_object_grammar() -> str:
    """Any JSON object (response_format json_object)."""
    return json_schema_grammar({"type": "object"})


def tool_call_grammar(
    tools: list[dict[str, Any]], open_tag: str, close_tag: str, parallel: bool
) -> str:
    """One `open_tag`\\n{"name": ..., "arguments": {...}}\\n`close_tag` block (or several, one
    per line, with `parallel`): a call to one of `tools` (OpenAI function tools) with
    arguments valid against its parameters, in the JSON tool-call format of Qwen's and
    Hermes' templates. A tag given as `<[id]>` is that single token."""
    variants = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    call = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = json.dumps({**call, "x-guidance": _COMPACT})
    blocks = 'block ("\\n" block)*' if parallel else "block"
    return (
        f'start: {blocks}\nblock: {open_tag} "\\n" call "\\n" {close_tag}\ncall: %json {schema}\n'
    )


def lark_literal(tokenizer, text: str) -> str:
    """`text` in a Lark grammar: `<[id]>` where the tokenizer holds it as one token (so the
    model writes the token it was trained on), else a quoted string."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1:
        return f"<[{ids[0]}]>"
    return json.dumps(text)


class Constraint:
    """One request's matcher: masks logits before a draw and consumes the drawn token."""

    def __init__(self, matcher, vocab: int, eos: int):
        import llguidance.numpy as ln  # (llguidance.torch compiles a kernel at import: 2.5 s)

        self.matcher, self.vocab, self.eos = matcher, vocab, eos
        self._fill = ln.fill_next_token_bitmask
        self._words = ln.allocate_token_bitmask(1, vocab)  # int32, bit i of word w: 32w + i

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more: the answer ends."""
        return self.matcher.is_stopped()

    def allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] (float32, a copy) with every token the grammar forbids at -inf."""
        self._fill(self.matcher, self._words, 0)
        # little-endian words: bit i of byte b is token 8b + i
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: logits.shape[-1]]
        forbidden = torch.from_numpy(bits.view(np.bool_)).logical_not()
        return logits.float().masked_fill(forbidden, float("-inf"))

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")


class Grammars:
    """Grammars compiled against one tokenizer, cached by their text."""

    def __init__(self, tokenizer, vocab: int):
        import llguidance
        import llguidance.hf

        self.tokenizer, self.vocab = tokenizer, vocab
        self._lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self._llguidance = llguidance
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.eos = tokenizer.eos_token_id

    def compile(self, grammar: str) -> CompiledGrammar:
        """The compiled grammar (GrammarError naming the problem if it does not compile)."""
        with self._lock:
            matcher = self._cache.get(grammar)
            if matcher is not None:
                self._cache.move_to_end(grammar)
                return CompiledGrammar(self, matcher)
        failed, messages = self._llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._lltok
        )
        if failed:
            raise GrammarError("; ".join(messages) or "the grammar does not compile")
        matcher = self._llguidance.LLMatcher(self._lltok, grammar)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        with self._lock:
            self._cache[grammar] = matcher
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return CompiledGrammar(self, matcher)


class CompiledGrammar:
    """A compiled grammar; each request takes its own matcher (`constraint()`)."""

    def __init__(self, grammars: Grammars, matcher):
        self.grammars, self._matcher = grammars, matcher

    def constraint(self) -> Constraint:
        g = self.grammars
        return Constraint(self._matcher.deep_copy(), g.vocab, g.eos)
