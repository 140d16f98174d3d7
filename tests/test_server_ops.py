"""Operating the server: request ids, one log line per request, model ids, read timeouts,
HTTP/1.0 streams. Each failed before its fix (found by probing the server as a client)."""

from __future__ import annotations

import json
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from edge0.server.app import ServerOptions, create_app
from edge0.server.http import Timeouts
from edge0.server.requestlog import JsonFormatter
from test_server import (
    GOOD,
    USER,
    assert_error_shape,
    chat_engine,
    live_server,
    post,
    wait_for,
)

CHAT = "/v1/chat/completions"
# short, so that the stalled sockets' test takes seconds
TIMEOUTS = Timeouts(header_s=1.0, body_s=1.0, keep_alive_s=1.5)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with chat_engine(tmp_path_factory.mktemp("ops")) as e:
        yield e


@pytest.fixture(scope="module")
def base(engine):
    opts = ServerOptions(model_name="tiny", queue_size=8, body_timeout_s=TIMEOUTS.body_s)
    with live_server(create_app(engine, opts), TIMEOUTS) as url:
        yield url


def address(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").split(":")
    return host, int(port)


# -- request ids and log lines ----------------------------------------------------------------


def test_a_request_id_is_echoed_or_made(base):
    sent = httpx.post(f"{base}{CHAT}", json=GOOD, headers={"X-Request-Id": "abc-123"}, timeout=60)
    assert sent.status_code == 200 and sent.headers["x-request-id"] == "abc-123"
    made = httpx.get(f"{base}/health")
    assert len(made.headers["x-request-id"]) == 32  # a uuid4's hex
    other = httpx.get(f"{base}/health")
    assert other.headers["x-request-id"] != made.headers["x-request-id"]
    # one that cannot go into a log line or a header as it is gets replaced
    odd = httpx.get(f"{base}/health", headers={"X-Request-Id": "a b"})
    assert odd.headers["x-request-id"] != "a b"


def lines_for(caplog, request_id: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "edge0.request" and getattr(r, "request", {}).get("id") == request_id
    ]


def test_each_request_logs_one_line(base, caplog):
    caplog.set_level(logging.INFO, logger="edge0.request")
    body = {**GOOD, "max_tokens": 3, "temperature": 0}
    r = httpx.post(f"{base}{CHAT}", json=body, headers={"X-Request-Id": "ok-1"}, timeout=60)
    assert r.status_code == 200
    wait_for(lambda: lines_for(caplog, "ok-1"), timeout=10)
    time.sleep(0.1)  # a second line would come at once
    [line] = lines_for(caplog, "ok-1")
    fields = line.request
    usage = r.json()["usage"]
    assert fields["status"] == 200 and fields["path"] == CHAT and fields["method"] == "POST"
    assert fields["outcome"] == "length"
    assert fields["prompt_tokens"] == usage["prompt_tokens"]
    assert fields["completion_tokens"] == usage["completion_tokens"] == 3
    assert 0 < fields["ttft_s"] <= fields["seconds"] and fields["decode_tok_s"] > 0
    assert fields["queue_s"] >= 0
    text = line.getMessage()
    assert text.startswith("ok-1 POST /v1/chat/completions 200 ")
    assert " length prompt=" in text and " completion=3 " in text and "tok/s" in text

    bad = httpx.post(
        f"{base}{CHAT}", json={**GOOD, "temperature": 7}, headers={"X-Request-Id": "bad-1"}
    )
    assert bad.status_code == 400
    wait_for(lambda: lines_for(caplog, "bad-1"), timeout=10)
    [line] = lines_for(caplog, "bad-1")
    assert line.request["status"] == 400 and "temperature" in line.request["reason"]
    assert line.getMessage().endswith(line.request["reason"])
    assert bad.json()["error"]["message"].startswith(line.request["reason"][:50])


def test_a_stream_logs_its_outcome(base, caplog):
    caplog.set_level(logging.INFO, logger="edge0.request")
    # greedy: a sampled first token may be the tiny random model's end of turn
    body = {**GOOD, "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{base}{CHAT}", json=body, headers={"X-Request-Id": "s-1"}) as r:
        assert r.status_code == 200
        assert r.read().decode().endswith("data: [DONE]\n\n")
    wait_for(lambda: lines_for(caplog, "s-1"), timeout=10)
    [line] = lines_for(caplog, "s-1")
    assert line.request["outcome"] == "length" and line.request["completion_tokens"] == 4


def test_the_json_format_is_one_object_per_line():
    record = logging.LogRecord("edge0.request", logging.INFO, __file__, 1, "%s", ("x",), None)
    record.request = {"id": "r1", "status": 200, "reason": 'quote " and\nnewline'}
    line = JsonFormatter().format(record)
    assert "\n" not in line
    out = json.loads(line)
    assert out["message"] == "x" and out["level"] == "INFO" and out["logger"] == "edge0.request"
    assert out["request"] == record.request
    assert out["time"].endswith("Z") and "T" in out["time"]


# -- what OpenAI refuses ----------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_an_unknown_model_is_a_404(base, path):
    body = {"model": "gpt-4o", "messages": USER, "prompt": "x", "max_tokens": 1}
    err = assert_error_shape(post(base, path, body), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "gpt-4o" in err["message"] and "tiny" in err["message"]
    assert_error_shape(httpx.get(f"{base}/v1/models/gpt-4o"), 404)
    for served in ("tiny", None):  # the served id, or none at all
        ok = (
            {**body, "model": served} if served else {k: v for k, v in body.items() if k != "model"}
        )
        assert post(base, path, ok).status_code == 200


def test_the_model_directory_name_is_served_too(base, engine):
    body = {**GOOD, "model": engine.path.name}
    assert post(base, CHAT, body).status_code == 200


def test_a_tool_message_needs_its_call_id(base):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
        ]},
        {"role": "tool", "content": "sunny"},
    ]  # fmt: skip
    err = assert_error_shape(post(base, CHAT, {**GOOD, "messages": messages}), 400)
    assert err["param"] == "messages" and "tool_call_id" in err["message"]
    messages[2]["tool_call_id"] = "c1"
    assert post(base, CHAT, {**GOOD, "messages": messages}).status_code == 200


# -- read timeouts ----------------------------------------------------------------------------


def stalled(base: str, kind: str) -> socket.socket:
    s = socket.create_connection(address(base))
    if kind == "half head":
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-")
    elif kind == "half body":
        body = json.dumps(GOOD).encode()
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        )
        s.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
    return s


def read_to_close(s: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """What the server sent until it closed the connection, and when it closed it."""
    s.settimeout(limit_s)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except TimeoutError:
        pytest.fail(f"the server held the connection for {limit_s} s; sent {data[:200]!r}")
    except ConnectionResetError:
        pass
    return data, time.monotonic()


def test_stalled_sockets_are_closed_while_chats_are_served(base):
    kinds = ["idle", "half head", "half body"]
    t0 = time.monotonic()
    sockets = [(kind, stalled(base, kind)) for kind in kinds for _ in range(24)]  # 72
    body = {**GOOD, "max_tokens": 4}
    with ThreadPoolExecutor(4) as pool:
        chats = [pool.submit(post, base, CHAT, body) for _ in range(8)]
        assert all(f.result(timeout=60).status_code == 200 for f in chats)
    # every timeout here is at most 1.5 s; the 72 closes may lag behind on a busy machine
    limit = max(TIMEOUTS.header_s, TIMEOUTS.body_s, TIMEOUTS.keep_alive_s) + 5
    for kind, s in sockets:
        with s:
            data, closed = read_to_close(s, limit)
        assert closed - t0 < limit, kind
        if kind == "idle":
            assert data == b""
        elif kind == "half head":
            assert data.startswith(b"HTTP/1.1 408 "), data
        else:  # the body guard answers in the API's error shape
            head, _, payload = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 "), data
            assert json.loads(payload)["error"]["code"] == "request_timeout"
    # and the server still serves
    assert post(base, CHAT, body).status_code == 200


def test_a_kept_alive_connection_serves_requests_until_idle(base):
    with httpx.Client(base_url=base, timeout=60) as c:
        first = c.get("/health")
        again = c.get("/health")  # within the keep-alive: the same connection
        assert first.status_code == again.status_code == 200
    # a connection opened and left idle is closed after keep_alive_s, not held
    s = socket.create_connection(address(base))
    with s:
        _, closed = read_to_close(s, TIMEOUTS.keep_alive_s + 5)


# -- HTTP/1.0 ---------------------------------------------------------------------------------


def raw_request(base: str, version: str, body: dict) -> tuple[bytes, bytes]:
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(address(base)) as s:
        s.sendall(head + payload)
        data, _ = read_to_close(s, 60)
    head, _, rest = data.partition(b"\r\n\r\n")
    return head.lower(), rest


def test_an_http10_stream_is_sent_without_chunked_coding(base):
    stream = {"prompt": "x", "max_tokens": 5, "temperature": 0, "stream": True}
    head, body = raw_request(base, "1.0", stream)
    assert head.startswith(b"http/1.1 200") and b"text/event-stream" in head
    assert b"transfer-encoding" not in head and b"content-length" not in head
    assert body.startswith(b"data: {") and body.endswith(b"data: [DONE]\n\n")
    # HTTP/1.1 gets it chunked, as before
    head11, body11 = raw_request(base, "1.1", stream)
    assert b"transfer-encoding: chunked" in head11 and not body11.startswith(b"data:")
    # a whole answer keeps its Content-Length
    head, body = raw_request(base, "1.0", {**stream, "stream": False})
    assert b"content-length: %d" % len(body) in head
    assert json.loads(body)["choices"][0]["finish_reason"] == "length"
