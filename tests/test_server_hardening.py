"""Regressions for defects found by probing the server as a client: each failed before its fix.

Bad input gives a 4xx that names the field (never a 500 that drops the connection), a long
prompt does not stall other clients, a request without max_tokens is capped, seeds use all
their bits, logprobs end where the text ends, every response is counted, and SIGTERM ends
every request with an answer or an OpenAI-shaped error, then exits 0 (a real `edge0 serve`).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.sampling import SamplingParams
from edge0.server.app import ServerOptions, create_app
from edge0.server.worker import Done, Job, Worker
from edge0.util.limits import CHAT_MAX_TOKENS
from test_server import (
    GOOD,
    USER,
    ScriptedEngine,
    SlowEngine,
    Wrapped,
    assert_error_shape,
    live_server,
    make_chat_model,
    metrics,
    post,
    wait_for,
)

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # positions for 4096 tokens: requests that must outlast a shutdown grace run that long
    return make_chat_model(tmp_path_factory.mktemp("hardening"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def engine(model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    e = load_engine(model_dir, EngineOptions())
    yield e
    e.close()
    torch.set_num_threads(threads)


class ExplodingEncode(Wrapped):
    """The real tokenizer, except that encode() raises: a failure no handler expects."""

    def encode(self, *args, **kwargs):
        raise RuntimeError("tokenizer exploded " + "x" * 5000)


class Exploding(Wrapped):
    """/v1/completions fails inside its route: the tokenizer's encode() raises."""

    def __init__(self, engine):
        super().__init__(engine)
        self.tokenizer = ExplodingEncode(engine.tokenizer)


@pytest.fixture(scope="module")
def base(engine):
    app = create_app(engine, ServerOptions(model_name="tiny", queue_size=8))
    with live_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


# -- 1. bad input: a 400 naming the field, never a 500 --------------------------------------------


def test_a_lone_surrogate_is_a_400_that_names_the_field(base):
    # the raw JSON escape: json.dumps would write it the same way
    r = post(base, "/v1/completions", '{"prompt": "hi \\ud800", "max_tokens": 2}')
    err = assert_error_shape(r, 400)
    assert err["param"] == "prompt" and "surrogate" in err["message"]
    body = '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'
    err = assert_error_shape(post(base, CHAT, body), 400)
    assert err["param"] == "messages" and "messages[0].content" in err["message"]
    assert "TextEncodeInput" not in err["message"]  # not the tokenizer's internals


def test_deeply_nested_tool_parameters_are_a_400(base):
    deep = '{"a": ' * 900 + "1" + "}" * 900
    tools = '[{"type": "function", "function": {"name": "f", "parameters": ' + deep + "}}]"
    body = '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tools": '
    body += tools + "}"
    err = assert_error_shape(post(base, CHAT, body), 400)
    assert err["param"] == "tools" and "deeper than" in err["message"]


def test_an_unexpected_failure_is_a_500_on_a_connection_that_stays_open(engine, caplog):
    with live_server(create_app(Exploding(engine), ServerOptions(model_name="tiny"))) as url:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        body = json.dumps({"prompt": "hi", "max_tokens": 2})
        with caplog.at_level(logging.ERROR, logger="edge0.server.failsafe"):
            conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            first = conn.getresponse()
            err = json.loads(first.read())["error"]
        sock = conn.sock
        assert first.status == 500 and err["type"] == "server_error"
        assert "Traceback" not in err["message"] and len(err["message"]) < 200
        conn.request("GET", "/health")  # the same connection serves the next request
        assert conn.getresponse().status == 200 and conn.sock is sock
        conn.close()
    lines = [r for r in caplog.records if r.name == "edge0.server.failsafe"]
    assert len(lines) == 1 and "RuntimeError" in lines[0].getMessage()
    assert "\n" not in lines[0].getMessage() and len(lines[0].getMessage()) < 600


class ExplodingPieces(Wrapped):
    """The real tokenizer, except that a token's pieces (for logprob bytes) cannot be read."""

    def convert_ids_to_tokens(self, *args, **kwargs):
        raise RuntimeError("no pieces")


def test_a_stream_that_fails_midway_ends_with_an_error_event(engine):
    broken = Wrapped(engine)
    broken.tokenizer = ExplodingPieces(engine.tokenizer)
    # logprob entries need the pieces. Seeded: about one unseeded sample in 300 is the end of
    # text at once, and then no piece is ever read.
    body = {**GOOD, "stream": True, "logprobs": True, "seed": 0}
    with live_server(create_app(broken, ServerOptions(model_name="tiny"))) as url:
        with httpx.Client(base_url=url, timeout=30) as c:
            r = c.post(CHAT, json=body)
            assert r.status_code == 200  # the headers went out before it failed
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["type"] == "server_error"
            assert c.get("/health").status_code == 200


# -- 3. a long prompt is tokenized off the event loop --------------------------------------------


def test_a_long_prompt_does_not_stall_other_clients(base):
    big = {"prompt": "word " * 190_000, "max_tokens": 2}  # under 1 MB; far over the context
    worst = 0.0
    with ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        refused = pool.submit(post, base, "/v1/completions", big)
        time.sleep(0.1)  # it is being parsed and tokenized now
        while not refused.done():
            t = time.monotonic()
            assert httpx.get(f"{base}/health", timeout=30).status_code == 200
            worst = max(worst, time.monotonic() - t)
        took = time.monotonic() - t0
    assert_error_shape(refused.result(), 400)
    assert took > 0.5, "the prompt was handled too fast to tell"
    assert worst < took / 3, (worst, took)


# -- 4. a chat request without max_tokens is capped -----------------------------------------------


class LongContext(ScriptedEngine):
    """A scripted engine reporting a 100k-token context, so the default cap is what binds."""

    def __init__(self, engine):
        super().__init__(engine)
        self.max_context = 100_000


def test_chat_without_max_tokens_is_capped_by_default(engine):
    fake = LongContext(engine)
    fake.script = "Ünïcödé ✓ 日本語 テキスト " * 200
    assert len(fake.tokenizer.encode(fake.script)) > CHAT_MAX_TOKENS
    with live_server(create_app(fake, ServerOptions(model_name="tiny"))) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="tiny", messages=USER)
        assert r.usage.completion_tokens == CHAT_MAX_TOKENS
        assert r.choices[0].finish_reason == "length"
        # --default-max-tokens 0 (None here) restores "to the end of the context"
    with live_server(
        create_app(fake, ServerOptions(model_name="tiny", default_max_tokens=None))
    ) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="tiny", messages=USER)
        assert r.usage.completion_tokens > CHAT_MAX_TOKENS
        assert r.choices[0].finish_reason == "stop"


# -- 5. seeds ---------------------------------------------------------------------------------


def test_seeds_use_all_their_bits(client):
    def text(seed: int) -> str:
        r = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=24, temperature=1.0, seed=seed
        )
        return r.choices[0].message.content

    texts = [text(s) for s in (0, 2**32, 2**63, -1, 2**64 - 1)]
    assert len(set(texts)) == len(texts), texts  # seeds equal in their low 32 bits differ
    assert text(2**63) == texts[2]  # and each is still reproducible


# -- 6. compatibility -------------------------------------------------------------------------


def test_stream_null_is_accepted(base):
    r = post(base, CHAT, {**GOOD, "stream": None})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    r = post(base, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": None})
    assert r.status_code == 200


def test_a_model_id_with_a_slash_is_retrievable(engine):
    name = "Qwen/Qwen3-30B-A3B"
    with live_server(create_app(engine, ServerOptions(model_name=name))) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert c.models.retrieve(name).id == name
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("Qwen/other")


def test_top_p_zero_is_greedy(client):
    greedy = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=12, temperature=0
    )
    # 1e-300 rounds to 0 in float32: the sampler would keep no token at all (a 500 before)
    for top_p in (0, 1e-300):
        r = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=12, temperature=1.0, top_p=top_p
        )
        assert r.choices[0].message.content == greedy.choices[0].message.content


def stop_at_a_token(entries: list[tuple[str, int]], text: str) -> int:
    """Index k of a token whose text first occurs in `text` where that token starts."""
    for k, (piece, offset) in enumerate(entries):
        if k > 2 and len(piece) > 1 and "\ufffd" not in piece and text.find(piece) == offset:
            return k
    pytest.fail(f"no token to stop at in {text!r}")


def test_logprobs_end_where_the_text_ends(client):
    kw = dict(model="tiny", prompt="x", max_tokens=30, temperature=0, logprobs=2)
    full = client.completions.create(**kw).choices[0]
    lp = full.logprobs
    k = stop_at_a_token(list(zip(lp.tokens, lp.text_offset, strict=True)), full.text)
    stop = lp.tokens[k]  # completed by token k: its text and logprob are not in the answer
    cut = client.completions.create(**kw, stop=stop)
    choice = cut.choices[0]
    assert choice.text == full.text[: lp.text_offset[k]] and choice.finish_reason == "stop"
    assert choice.logprobs.tokens == lp.tokens[:k]
    assert choice.logprobs.text_offset == lp.text_offset[:k]
    assert all(o < len(choice.text) for o in choice.logprobs.text_offset)
    assert cut.usage.completion_tokens == k + 1  # usage still counts the stop token
    chunks = list(client.completions.create(**kw, stop=stop, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in
                c.choices[0].logprobs.tokens]  # fmt: skip
    assert streamed == lp.tokens[:k]
    # chat: the same contract on logprobs.content
    chat = dict(model="tiny", messages=USER, max_tokens=30, temperature=0, logprobs=True)
    whole = client.chat.completions.create(**chat).choices[0]
    pieces = [e.token for e in whole.logprobs.content]
    offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    k = stop_at_a_token(list(zip(pieces, offsets, strict=True)), whole.message.content)
    cut = client.chat.completions.create(**chat, stop=pieces[k]).choices[0]
    assert cut.message.content == whole.message.content[: offsets[k]]
    assert [e.token for e in cut.logprobs.content] == pieces[:k]


# -- 7. clear errors ----------------------------------------------------------------------------


def test_an_image_part_is_named_in_the_error(base):
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {**GOOD, "messages": [{"role": "user", "content": [part]}]}
    err = assert_error_shape(post(base, CHAT, body), 400)
    assert err["param"] == "messages" and "image" in err["message"]
    assert "valid string" not in err["message"]


def test_invalid_utf8_is_invalid_json(base):
    r = httpx.post(
        f"{base}{CHAT}",
        content=b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        headers={"content-type": "application/json"},
    )
    err = assert_error_shape(r, 400)
    assert err["code"] == "invalid_json" and "UTF-8" in err["message"]


def test_an_empty_body_says_so(base):
    err = assert_error_shape(post(base, CHAT, ""), 400)
    assert "empty" in err["message"] and err["code"] == "invalid_json"


# -- 8. metrics ---------------------------------------------------------------------------------


def test_every_response_is_counted_by_status(base):
    def count(endpoint: str, status: int) -> float:
        key = f'edge0_responses_total{{endpoint="{endpoint}",status="{status}"}}'
        return metrics(base).get(key, 0)

    before = {k: count(*k) for k in [("chat", 200), ("chat", 400), ("other", 404)]}
    post(base, CHAT, GOOD)
    post(base, CHAT, {**GOOD, "max_tokens": 0})
    post(base, CHAT, {**GOOD, "max_tokens": 0})
    httpx.get(f"{base}/v1/nothing")
    assert count("chat", 200) == before[("chat", 200)] + 1
    assert count("chat", 400) == before[("chat", 400)] + 2
    assert count("other", 404) == before[("other", 404)] + 1


@pytest.fixture(scope="module")
def slow(engine):
    slow_engine = SlowEngine(engine, delay_s=0.05)
    with live_server(create_app(slow_engine, ServerOptions(model_name="tiny"))) as url:
        yield url, slow_engine


def leave_a_stream(base: str) -> None:
    body = {**GOOD, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}{CHAT}", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)


def leave_a_whole_request(base: str) -> None:
    body = json.dumps({**GOOD, "max_tokens": 400, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        time.sleep(0.5)  # it is generating now


@pytest.mark.parametrize("leave", [leave_a_stream, leave_a_whole_request])
def test_a_cancelled_request_counts_the_tokens_it_generated(slow, leave):
    base, engine = slow
    before = len(engine.finished)
    counted = metrics(base)["vllm:generation_tokens_total"]
    leave(base)
    wait_for(lambda: len(engine.finished) > before)
    # read its tokens once it has ended: until the server hears the client leave, it goes on
    wait_for(lambda: engine.finished[before].done)
    generated = len(engine.finished[before].tokens)
    assert 0 < generated < 60  # it was cut
    wait_for(lambda: metrics(base)["vllm:generation_tokens_total"] == counted + generated)


def test_a_request_no_longer_counts_as_running_when_its_end_is_heard(engine):
    depths: list[int] = []
    worker = Worker(engine)

    def sink(event) -> None:  # on the generation thread, as the server's sink is
        if isinstance(event, Done):
            depths.append(worker.depth)

    prompt = engine.tokenizer.encode("hi")
    worker.start()
    try:
        for n in range(1, 4):
            worker.submit(Job(prompt, 2, SamplingParams(temperature=0), sink))
            wait_for(lambda n=n: len(depths) == n)
    finally:
        worker.stop()
    assert depths == [0, 0, 0]


# -- 2. SIGTERM: every client gets its answer or an error, and the process exits 0 -------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def block_shutdown_signals() -> None:
    """Run in the child before exec: as when a supervisor spawns the server from a thread that
    blocks signals. The mask survives exec; the server must still hear SIGTERM and SIGINT."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


class ServeProcess:
    """`edge0 serve` on the test model, in its own process."""

    def __init__(self, model_dir: Path, *flags: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "edge0", "serve", str(model_dir), "--port", str(self.port)]
        argv += ["--threads", "1", "--max-context", "512", "--queue-size", "4"]
        argv += ["--model-name", "tiny", *flags]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=os.environ,
            preexec_fn=block_shutdown_signals,
        )
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.proc.communicate()[0]
            assert time.monotonic() < deadline, "edge0 serve did not start"
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)

    def depth(self) -> int:
        return httpx.get(f"{self.base}/health", timeout=5).json()["queue_depth"]

    def finish(self) -> tuple[int, str]:
        """Its exit code and output, once it has exited (killed if not within 30 s)."""
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out = self.proc.communicate()[0]
            pytest.fail(f"edge0 serve did not exit:\n{out}")
        return self.proc.returncode, out


def sse_events(base: str, path: str, body: dict, started: threading.Event | None = None):
    """All `data:` payloads of a stream, parsed (the client reads to the end); `started` is
    set once some text has arrived."""
    events = []
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if started is not None and has_text(events[-1]):
                    started.set()
    return events


def has_text(event) -> bool:
    choices = event.get("choices") if isinstance(event, dict) else None
    return bool(choices and (choices[0].get("delta", {}).get("content") or choices[0].get("text")))


def ends_with_shutting_down(events: list) -> bool:
    if len(events) < 2 or events[-1] != "[DONE]":
        return False
    err = events[-2].get("error") or {}
    return err.get("code") == "shutting_down" and err.get("type") == "server_error"


@pytest.mark.slow
def test_sigterm_cuts_the_running_request_and_refuses_the_queued_ones(model_dir):
    # one active request, so the other two wait in the queue
    # the running request must outlast the grace: a decode step of the test model is ~1 ms
    server = ServeProcess(
        model_dir, "--shutdown-grace", "0.5", "--max-active", "1", "--max-context", "4096"
    )
    long = {"messages": USER, "max_tokens": 4000, "temperature": 0, "stream": True}
    started = threading.Event()
    try:
        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(sse_events, server.base, CHAT, long, started)
            assert started.wait(60)
            whole = pool.submit(post, server.base, CHAT, {**GOOD, "max_tokens": 4})
            stream = pool.submit(
                sse_events, server.base, "/v1/completions", {"prompt": "x", "stream": True}
            )
            wait_for(lambda: server.depth() == 3, timeout=30)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            err = assert_error_shape(whole.result(timeout=30), 503)
            assert err["code"] == "shutting_down" and time.monotonic() - t0 < 1.5
            assert ends_with_shutting_down(stream.result(timeout=30))
            events = running.result(timeout=30)
        assert ends_with_shutting_down(events)
        assert any(has_text(e) for e in events[:-2])  # it was cut, after some text
    finally:
        code, out = server.finish()
    assert code == 0, out
    assert "stopped serving" in out and "Traceback" not in out  # the engine was closed


@pytest.mark.slow
def test_sigterm_under_load_ends_every_active_request(model_dir):
    """Four requests decoding at once (serve's default max_active) and two queued: on SIGTERM
    the queued ones end at once and the active ones after the grace, each with a
    shutting_down error event and [DONE]."""
    # the active requests must outlast the grace, batched decode steps of ~1-2 ms included
    server = ServeProcess(model_dir, "--shutdown-grace", "1", "--max-context", "4096")
    long = {"messages": USER, "max_tokens": 4000, "temperature": 0, "stream": True}
    try:
        with ThreadPoolExecutor(6) as pool:
            started = [threading.Event() for _ in range(4)]
            active = [pool.submit(sse_events, server.base, CHAT, long, e) for e in started]
            assert all(e.wait(60) for e in started)  # all four are decoding
            queued = [pool.submit(sse_events, server.base, CHAT, long) for _ in range(2)]
            wait_for(lambda: server.depth() == 6, timeout=30)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            for f in queued:
                assert ends_with_shutting_down(f.result(timeout=30))
            assert time.monotonic() - t0 < 1.0  # not after the grace
            for f in active:
                events = f.result(timeout=30)
                assert ends_with_shutting_down(events)
                assert any(has_text(e) for e in events[:-2])
    finally:
        code, out = server.finish()
    assert code == 0, out
    assert "stopped serving" in out and "Traceback" not in out


@pytest.mark.slow
def test_sigterm_lets_the_running_request_finish(model_dir):
    server = ServeProcess(model_dir, "--shutdown-grace", "60", "--max-active", "1")
    body = {"messages": USER, "max_tokens": 480, "temperature": 0, "stream": True}
    started = threading.Event()
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(sse_events, server.base, CHAT, body, started)
            assert started.wait(60)
            queued = pool.submit(post, server.base, CHAT, {**GOOD, "max_tokens": 4})
            wait_for(lambda: server.depth() == 2, timeout=30)
            server.proc.send_signal(signal.SIGTERM)
            assert_error_shape(queued.result(timeout=30), 503)
            assert not running.done()  # refused at once, while the running one goes on
            events = running.result(timeout=60)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    finally:
        code, out = server.finish()
    assert code == 0, out
    assert "stopped serving" in out


@pytest.mark.slow
def test_a_second_signal_does_not_cut_the_drain(model_dir):
    """SIGTERM, then SIGTERM and SIGINT again during the grace: the running stream still
    ends with its shutting_down event and [DONE] at the grace's end, nothing is cut short, no
    traceback, exit 0. Logged as JSON, one object per line, each request's line among them."""
    grace = 2.0
    server = ServeProcess(
        model_dir, "--shutdown-grace", str(grace), "--max-active", "1", "--max-context", "4096",
        "--log-format", "json",
    )  # fmt: skip
    long = {"messages": USER, "max_tokens": 4000, "temperature": 0, "stream": True}
    started = threading.Event()
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(sse_events, server.base, CHAT, long, started)
            assert started.wait(60)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            server.proc.send_signal(signal.SIGINT)
            events = running.result(timeout=60)
            ended = time.monotonic() - t0
        assert ends_with_shutting_down(events) and ended >= grace - 0.1
    finally:
        code, out = server.finish()
    assert code == 0, out
    assert "Traceback" not in out and "CancelledError" not in out, out
    logged = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert sum("already stopping" in e["message"] for e in logged) == 2, out
    [line] = [e for e in logged if e.get("request", {}).get("path") == CHAT]
    assert line["request"]["outcome"] == "shutting_down" and line["request"]["status"] == 200


def test_a_stream_whose_client_left_during_a_send_closes_its_generator():
    """A disconnect that lands in the response's send (ASGI 2.4: send raises OSError) left
    starlette's stream suspended at its generator's yield, so the generator's `finally`
    (which cancels the generation and counts the outcome) waited for garbage collection, and
    a cancelled stream could go uncounted for seconds: test_server's disconnect test failed
    now and then. EventStream closes its generator however the response ends."""
    import asyncio
    import gc

    from starlette.requests import ClientDisconnect

    from edge0.server.jobs import EventStream

    closed = []

    async def events():
        try:
            for i in range(100):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        if message["type"] == "http.response.body":
            raise OSError("the client is gone")

    async def serve() -> list:
        response = EventStream(events())
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        with pytest.raises(ClientDisconnect):
            await response(scope, receive, send)
        return list(closed)  # before asyncio.run's own clean-up closes leftover generators

    gc.disable()  # nothing may finalize the generator behind the response's back
    try:
        assert asyncio.run(serve()) == [True]
    finally:
        gc.enable()
