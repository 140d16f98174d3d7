"""`edge0 chat`: the REPL driven through a pseudo-terminal, and the one-shot piped mode.

The command runs in a thread on the terminal's other end, so the test drives exactly what a
user types without paying for a second interpreter start.
"""

from __future__ import annotations

import argparse
import io
import os
import pty
import re
import select
import signal
import sys
import termios
import threading
import time

import pytest
import torch

from edge0.cli.chat import ChatSession, add_chat_parser, cmd_chat, repl
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.sampling import SamplingParams
from test_server import ScriptedEngine, make_chat_model

ARGS = ["--temperature", "0", "--max-tokens", "6", "--threads", "1", "--max-context", "512"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def session(model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = load_engine(model_dir, EngineOptions(max_context=512))
    yield ChatSession(engine, SamplingParams(temperature=0), max_tokens=6)
    engine.close()
    torch.set_num_threads(threads)


def expected(session: ChatSession, *turns: str) -> list[str]:
    """What a fresh conversation prints for each turn."""
    session.reset()
    printed = []
    for text in turns:
        out = io.StringIO()
        session.reply(text, out)
        printed.append(out.getvalue())
    session.reset()
    return printed


class Terminal:
    """`edge0 chat` on a pseudo-terminal, run in a thread; read_until() returns its output."""

    def __init__(self, argv: list[str]):
        self.master, slave = pty.openpty()
        attrs = termios.tcgetattr(slave)
        attrs[3] &= ~termios.ECHO  # do not echo what we type back into the output
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        self.stdin = os.fdopen(slave, "r", encoding="utf-8")
        self.stdout = os.fdopen(os.dup(slave), "w", encoding="utf-8")
        self.code: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(parse(*argv),), daemon=True)
        self.thread.start()
        self.buffer = b""

    def _run(self, args: argparse.Namespace) -> None:
        try:
            self.code = cmd_chat(args, self.stdin, self.stdout)  # sees a terminal: the REPL
        except BaseException as e:  # reported by close()
            self.error = e

    def read_until(self, marker: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        want = marker.encode()
        while want not in self.buffer:
            left = deadline - time.monotonic()
            assert left > 0 and self.thread.is_alive(), f"no {marker!r} in {self.buffer!r}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                self.buffer += os.read(self.master, 4096)
        head, _, self.buffer = self.buffer.partition(want)
        return head.decode().replace("\r\n", "\n")

    def send(self, line: str) -> str:
        """Type a line; returns what is printed before the next prompt."""
        os.write(self.master, line.encode() + b"\n")
        return self.read_until(">>> ")

    def close(self) -> int | None:
        self.thread.join(timeout=30)
        self.stdin.close()
        self.stdout.close()
        os.close(self.master)
        if self.error is not None:
            raise self.error
        return self.code


def prompt_tokens(stats: str) -> int:
    return int(re.search(r"prompt (\d+) tok", stats).group(1))


def test_repl_through_a_terminal(model_dir, session):
    first, second = expected(session, "hello", "and again?")
    term = Terminal([str(model_dir), *ARGS])
    try:
        banner = term.read_until(">>> ")
        assert "/help" in banner
        assert term.send("hello") == first + "\n"
        stats1 = term.send("/stats")
        assert "tok/s" in stats1 and "anon" in stats1 and "1 turns" in stats1
        assert term.send("and again?") == second + "\n"  # the answer sees the first turn
        stats2 = term.send("/stats")
        assert prompt_tokens(stats2) > prompt_tokens(stats1) + 6
        assert "conversation cleared" in term.send("/reset")
        assert term.send("hello") == first + "\n"
        assert prompt_tokens(term.send("/stats")) == prompt_tokens(stats1)
        assert "unknown command" in term.send("/frobnicate")
        os.write(term.master, b"/exit\n")
    finally:
        code = term.close()
    assert code == 0


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="edge0")
    add_chat_parser(p.add_subparsers())
    return p.parse_args(["chat", *argv])


def test_piped_text_is_answered_once(model_dir, session):
    out = io.StringIO()
    assert cmd_chat(parse(str(model_dir), *ARGS), io.StringIO("hello\n"), out) == 0
    assert out.getvalue() == expected(session, "hello")[0] + "\n"
    # --prompt, with piped text appended to it
    out = io.StringIO()
    args = parse(str(model_dir), "--prompt", "Summarize:", *ARGS)
    assert cmd_chat(args, io.StringIO("some text\n"), out) == 0
    assert out.getvalue() == expected(session, "Summarize:\n\nsome text")[0] + "\n"


def test_nothing_to_ask_is_a_clear_error(model_dir):
    with pytest.raises(ValueError, match="--prompt"):
        cmd_chat(parse(str(model_dir), *ARGS), io.StringIO(""), io.StringIO())


def test_a_conversation_over_the_context_is_refused(session):
    session.reset()
    with pytest.raises(ValueError, match="context window of 512"):
        session.reply("def add(a, b): return a + b " * 80, io.StringIO())
    assert session.messages == []  # the refused turn is not kept


def test_history_keeps_answers_without_their_thinking(session):
    fake = ScriptedEngine(session.engine)
    fake.script = "<think>\nplan it\n</think>\n\nThe answer."
    chat = ChatSession(fake, SamplingParams(temperature=0), max_tokens=50)
    out = io.StringIO()
    assert chat.reply("hello", out) == "The answer."
    assert out.getvalue() == fake.script  # the terminal shows the thinking
    assert chat.messages[-1] == {"role": "assistant", "content": "The answer."}
    chat.reply("more", io.StringIO())
    history = fake.tokenizer.decode(fake.prompts[-1])
    assert "The answer." in history and "plan it" not in history


def test_stats_are_not_reprinted_after_an_error(model_dir):
    term = Terminal([str(model_dir), *ARGS, "--stats"])
    try:
        term.read_until(">>> ")
        answered = term.send("hello")
        refused = term.send("def add(a, b): return a + b " * 80)
    finally:
        os.write(term.master, b"/exit\n")  # (a REPL left reading would block close())
        code = term.close()
    assert "tok/s" in answered  # --stats: after every answer
    assert "error:" in refused and "context window" in refused
    assert "tok/s" not in refused  # the last stats belong to the answer before
    assert code == 0


def typed(*lines: str):
    """A line reader for repl(): these lines, then end of input."""
    rest = iter(lines)

    def read() -> str:
        line = next(rest, None)
        if line is None:
            raise EOFError
        return line

    return read


def test_an_answer_cut_to_the_context_says_so(session):
    fake = ScriptedEngine(session.engine)
    fake.script = "Ünïcödé ✓ 日本語 テキスト " * 100  # more than the 512-token window holds
    chat = ChatSession(fake, SamplingParams(temperature=0), max_tokens=2000)  # the engine: 512
    out = io.StringIO()
    assert repl(chat, typed("hello"), out) == 0
    assert "the answer was cut" in out.getvalue() and "512 tokens" in out.getvalue()
    short = ChatSession(fake, SamplingParams(temperature=0), max_tokens=5)
    out = io.StringIO()
    repl(short, typed("hello"), out)
    assert "cut" not in out.getvalue()  # --max-tokens ending it is what the user asked for


class ChatProcess:
    """`edge0 chat` in its own process on a pseudo-terminal that is its controlling terminal,
    so readline runs and Ctrl-C typed there is a real SIGINT."""

    def __init__(self, argv: list[str]):
        self.pid, self.master = pty.fork()
        if self.pid == 0:  # the child: exec at once
            # as a shell starts a foreground job: Ctrl-C interrupts. (A test run started in
            # the background by a non-interactive shell inherits SIGINT ignored, and one
            # spawned from a thread that blocks signals inherits SIGINT blocked; both stay
            # so across exec, and then Ctrl-C does nothing at all.)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            env = {**os.environ, "TERM": "xterm"}
            os.execve(sys.executable, [sys.executable, "-m", "edge0", "chat", *argv], env)
        self.buffer = b""

    def interrupt_until(self, marker: str, tries: int = 5) -> str:
        """Type Ctrl-C until `marker` shows. CPython's readline checks for signals only when
        its select() is interrupted: a SIGINT that lands between readline's echo and its
        next select() waits for the next key (a person presses Ctrl-C again). On a loaded
        machine that window is wide enough to hit."""
        for _ in range(tries - 1):
            self.type("\x03")
            try:
                return self.read_until(marker, timeout=10)
            except AssertionError:
                continue
        self.type("\x03")
        return self.read_until(marker)

    def read_until(self, marker: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        want = marker.encode()
        while want not in self.buffer:
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} in {self.buffer!r}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    self.buffer += os.read(self.master, 4096)
                except OSError:  # the child exited: its side of the terminal is gone
                    assert want in self.buffer, f"no {marker!r} in {self.buffer!r}"
        head, _, self.buffer = self.buffer.partition(want)
        return head.decode(errors="replace")

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def wait(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.master)
                return os.waitstatus_to_exitcode(status)
            try:  # keep draining, or the child may block writing
                if select.select([self.master], [], [], 0.1)[0]:
                    self.buffer += os.read(self.master, 4096)
            except OSError:
                time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        pytest.fail(f"edge0 chat did not exit: {self.buffer!r}")


@pytest.mark.slow
def test_the_prompt_has_history_and_survives_ctrl_c(model_dir):
    chat = ChatProcess([str(model_dir), *ARGS])
    try:
        chat.read_until(">>> ")
        chat.type("/stats\r")
        chat.read_until("conversation: 0 turns")
        chat.read_until(">>> ")
        chat.type("\x1b[A\r")  # up arrow: /stats again, from the history
        chat.read_until("conversation: 0 turns")
        chat.read_until(">>> ")
        chat.type("hello\r")
        chat.read_until(">>> ")
        chat.type("half a line")
        chat.read_until("half a line")  # readline has the line
        chat.interrupt_until(
            "/exit or Ctrl-D"
        )  # Ctrl-C at the prompt: the line goes, the chat stays
        chat.read_until(">>> ")
        chat.type("/stats\r")
        chat.read_until("conversation: 1 turns")
        chat.read_until(">>> ")
        chat.type("/exit\r")
    finally:
        code = chat.wait()
    assert code == 0
