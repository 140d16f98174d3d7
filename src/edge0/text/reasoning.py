"""Splits generated text into reasoning (`<think> ... </think>`) and the answer, incrementally.

Qwen-style models open their reply with a think block, or the chat template opens it for them;
what follows `</think>` is the answer. A reply that does not start with `<think>` is all answer;
one cut off inside the block is all reasoning.
"""

from __future__ import annotations

from edge0.text.stops import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
REASONING, CONTENT = "reasoning", "content"


class ThinkSplitter:
    """feed(text) -> [(channel, text)], channel in {"reasoning", "content"}."""

    def __init__(self, opens_in_reasoning: bool):
        self.state = REASONING if opens_in_reasoning else "start"
        self.pending = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.pending += text
        out: list[tuple[str, str]] = []
        while True:
            if self.state == "start":  # not yet known whether the reply opens a think block
                head = self.pending.lstrip()
                if not head or (OPEN.startswith(head) and head != OPEN):
                    return out
                if head.startswith(OPEN):
                    self.pending, self.state = head[len(OPEN) :], REASONING
                else:
                    self.state = CONTENT
            elif self.state == REASONING:
                i = self.pending.find(CLOSE)
                if i < 0:
                    keep = partial_suffix(self.pending, [CLOSE])
                    _emit(out, REASONING, self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    return out
                _emit(out, REASONING, self.pending[:i])
                self.pending, self.state = self.pending[i + len(CLOSE) :], "after"
            elif self.state == "after":  # the newlines between </think> and the answer
                self.pending = self.pending.lstrip("\n")
                if not self.pending:
                    return out
                self.state = CONTENT
            else:
                _emit(out, CONTENT, self.pending)
                self.pending = ""
                return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.state == REASONING:
            _emit(out, REASONING, self.pending)
        elif self.state in ("start", CONTENT):
            _emit(out, CONTENT, self.pending)
        self.pending = ""
        return out


def _emit(out: list[tuple[str, str]], channel: str, text: str) -> None:
    if text:
        out.append((channel, text))
