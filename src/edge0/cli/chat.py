"""`edge0 chat`: a multi-turn chat in the terminal, or one answer for --prompt / piped text.

Each turn renders the whole conversation with the model's chat template and generates from a
fresh state (the engine resets per request; the expert cache stays warm). The history keeps
answers without their <think> block, as Qwen templates expect. On a terminal, lines are read
with readline: arrow keys edit the line and walk the history, and Ctrl-C at the prompt clears
the line instead of quitting.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from edge0.util.limits import CHAT_MAX_TOKENS

HELP = """commands:
  /reset   forget the conversation
  /stats   speed, memory and expert reads of the last answer
  /exit    leave (or Ctrl-D); Ctrl-C stops an answer"""
PROMPT = ">>> "
QUIT_HINT = "(to leave: /exit or Ctrl-D)"


class ChatSession:
    """A conversation with one engine; reply() runs one turn and streams the answer."""

    def __init__(
        self,
        engine,
        sampling,
        max_tokens: int,
        system: str | None = None,
        template_kwargs: dict | None = None,
    ):
        from edge0.text.prompt import ChatTemplate

        self.engine = engine
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.system = system
        self.template_kwargs = dict(template_kwargs or {})
        self.template = ChatTemplate(engine.tokenizer)
        if not self.template.available:
            raise ValueError(
                f"{engine.path}: the tokenizer config has no chat template; "
                "use `edge0 generate` for raw prompts"
            )
        self.context = engine.max_context
        self.messages: list[dict] = []
        self.last = None  # GenerationStats of the last answer
        self.last_prompt_tokens = 0
        self.cut_to_context = False  # the last answer ran into the end of the context window
        self.interrupted = False  # set from a SIGINT handler: stop at the next token

    def reset(self) -> None:
        self.messages = []

    def reply(self, text: str, out: TextIO) -> str:
        """Answer `text`, writing the answer to `out` as it is generated; returns the answer."""
        from edge0.text.reasoning import ThinkSplitter
        from edge0.text.tokenizer import IncrementalDecoder

        turn = [*self.messages, {"role": "user", "content": text}]
        system = [{"role": "system", "content": self.system}] if self.system else []
        prompt = self.template.render(system + turn, kwargs=self.template_kwargs)
        room = self.context - len(prompt.ids)
        if room < 1:
            raise ValueError(
                f"the conversation is {len(prompt.ids)} tokens, over the context window of "
                f"{self.context}; /reset to start again"
            )
        decoder = IncrementalDecoder(self.engine.tokenizer)
        self.interrupted = False
        gen = self.engine.generate(prompt.ids, min(self.max_tokens, room), self.sampling)
        for token, _ in gen:
            out.write(decoder.push(token))
            out.flush()
            if self.interrupted:
                gen.close()
                break
        out.write(decoder.flush())
        out.flush()
        self.cut_to_context = (
            room < self.max_tokens and gen.finish_reason == "length" and not self.interrupted
        )
        answer = self.engine.tokenizer.decode(gen.tokens, skip_special_tokens=True)
        if prompt.thinking:
            split = ThinkSplitter(prompt.opens_in_reasoning)
            parts = split.feed(answer) + split.finish()
            answer = "".join(t for channel, t in parts if channel == "content")
        self.messages = [*turn, {"role": "assistant", "content": answer}]
        self.last, self.last_prompt_tokens = gen.stats, len(prompt.ids)
        return answer

    def stats(self) -> str:
        from edge0.util import memory

        now = memory.sample()
        lines = [
            f"conversation: {len(self.messages) // 2} turns; context window {self.context} tokens",
            f"memory now: anon {memory.format_bytes(now.anon_bytes)}, "
            f"file {memory.format_bytes(now.file_bytes)}",
        ]
        if self.last is not None:
            lines.insert(0, f"last answer: {self.last.line()}")
        return "\n".join(lines)

    def cut_note(self) -> str:
        return (
            f"[the answer was cut: the conversation filled the context window of "
            f"{self.context} tokens; /reset to start again]"
        )


def repl(
    session: ChatSession,
    read: Callable[[], str],
    out: TextIO,
    show_stats: bool = False,
) -> int:
    """Answer each line `read()` returns until /exit or end of input (EOFError).

    A KeyboardInterrupt while reading (Ctrl-C at the prompt) drops the line, not the
    conversation.
    """
    out.write(f"edge0 chat with {session.engine.path.name}; /help for commands\n")
    while True:
        try:
            line = read()
        except EOFError:  # Ctrl-D
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write(f"\n{QUIT_HINT}\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            out.write("conversation cleared\n")
        elif text == "/stats":
            out.write(session.stats() + "\n")
        elif text == "/help":
            out.write(HELP + "\n")
        elif text.startswith("/"):
            out.write(f"unknown command {text.split()[0]}; /help lists them\n")
        else:
            _answer(session, text, out, show_stats)


def _answer(session: ChatSession, text: str, out: TextIO, show_stats: bool) -> None:
    try:
        with _ctrl_c_stops(session):
            session.reply(text, out)
    except ValueError as e:
        out.write(f"error: {e}\n")
        return  # no stats: the last ones belong to an earlier answer
    out.write("\n")
    if session.cut_to_context:
        out.write(session.cut_note() + "\n")
    if show_stats and session.last is not None:
        out.write(session.last.line() + "\n")


def line_reader(stdin: TextIO, out: TextIO) -> Callable[[], str]:
    """Reads a line after the prompt: with readline (editing, history) on the process's own
    terminal, else plainly from `stdin`."""
    if stdin is sys.stdin and out is sys.stdout and stdin.isatty() and out.isatty():
        import readline  # noqa: F401  (importing it gives input() line editing and history)

        return lambda: input(PROMPT)

    def read() -> str:
        out.write(PROMPT)
        out.flush()
        line = stdin.readline()
        if not line:
            raise EOFError
        return line

    return read


@contextlib.contextmanager
def _ctrl_c_stops(session: ChatSession):
    """While an answer streams, Ctrl-C ends the answer instead of the program."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_sig, _frame):
        session.interrupted = True

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def add_chat_parser(sub) -> argparse.ArgumentParser:
    from edge0.cli.args import add_engine_args, add_sampling_args

    c = sub.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="Interactive chat. With --prompt, or with text piped in, answer once.",
    )
    c.add_argument(
        "model_dir",
        type=Path,
        nargs="?",
        default=None,
        help="edge0 model directory (default: the built-in model)",
    )
    c.add_argument(
        "--prompt",
        default=None,
        help="ask this and exit; text piped into stdin is appended to it",
    )
    c.add_argument("--system", default=None, help="system message")
    c.add_argument(
        "--max-tokens",
        type=int,
        default=CHAT_MAX_TOKENS,
        help=f"per answer (default {CHAT_MAX_TOKENS})",
    )
    thinking = c.add_mutually_exclusive_group()
    thinking.add_argument("--think", dest="thinking", action="store_true", default=None)
    thinking.add_argument("--no-think", dest="thinking", action="store_false")
    c.add_argument("--stats", action="store_true", help="print stats after every answer")
    add_sampling_args(c)
    add_engine_args(c, prefix_cache=True)
    c.set_defaults(func=cmd_chat)
    return c


def cmd_chat(args: argparse.Namespace, stdin: TextIO | None = None, out: TextIO | None = None):
    from edge0.cli.args import constrained, engine_options, model_path, sampling_params
    from edge0.engine.load import load_engine

    stdin = stdin if stdin is not None else sys.stdin  # None when started without one
    out = out or sys.stdout
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    opts = engine_options(args)
    kwargs = {} if args.thinking is None else {"enable_thinking": args.thinking}
    engine = load_engine(model_path(args.model_dir), opts)
    try:
        sampling = constrained(sampling_params(args, engine.path), args, engine)
        if sampling.grammar is not None:  # the answer is the JSON from its first token
            kwargs.setdefault("enable_thinking", False)
        session = ChatSession(engine, sampling, args.max_tokens, args.system, kwargs)
        interactive = stdin is not None and stdin.isatty()
        if args.prompt is None and interactive:
            return repl(session, line_reader(stdin, out), out, args.stats)
        text = args.prompt or ""
        if stdin is not None and not interactive:  # piped in
            extra = stdin.read().strip()
            text = f"{text}\n\n{extra}" if text and extra else text or extra
        if not text.strip():
            raise ValueError("nothing to ask: pass --prompt TEXT or pipe text into stdin")
        session.reply(text.strip(), out)
        out.write("\n")
        if session.cut_to_context:
            print(session.cut_note(), file=sys.stderr)
        if args.stats:
            print(session.stats(), file=sys.stderr)
        return 0
    finally:
        engine.close()
