"""edge0 bench --serving: the server under concurrent chats, and a multi-turn chat's reuse.

Each arm is its own `edge0 serve` process; rounds rotate the arms' order.

- concurrency: one streamed chat without max_tokens (it runs to the server's default cap) is
  decoding when 7 more arrive at once. Their first-token latency (p50, p95) with
  `--max-active 1` (one request at a time, in arrival order), `--max-active 8
  --no-batch-decode` (each active request runs one forward in turn) and `--max-active 8`
  (the active requests' decode steps in one forward), and each one's time alone on the same
  server just before. The acceptance bound per request: twice its time alone plus one decode
  step per active request. Each server runs `trials` such bursts (one trial's 7 first tokens
  come within a few ms of each other, and trials scatter by tens of ms on a shared machine).
- prefill: the 7 short chats' prompts prefilled one after another against in one batched
  forward (Engine.prefill_together), in this process: the compute a simultaneous arrival
  costs.
- decode: B = 1, 2, 4, 8 requests' decode steps one after another against in one forward
  (Engine.step_rows), in this process.
- prefix: a 3-turn chat whose first user turn is about 1,000 tokens. Turn 2's time to first
  token with `--prefix-cache auto` against `--prefix-cache 0`, and whether the texts agree.
"""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CONCURRENT = 8
STORY = (
    "The lighthouse keeper wrote in her log every evening: the wind, the ships that passed, "
    "the colour of the water, and whatever the gulls had stolen from the kitchen that day. "
)


@dataclass
class ServingConfig:
    rounds: int = 2
    threads: int | None = None
    max_tokens: int = 16  # each of the 7 short requests, and each chat turn
    trials: int = 4  # concurrency bursts per server and round


class Server:
    """`edge0 serve MODEL_DIR ARGS` on a free loopback port, until close()."""

    def __init__(self, model_dir: Path, args: list[str], threads: int | None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "edge0", "serve", str(model_dir), "--port", str(self.port)]
        cmd += args + (["--threads", str(threads)] if threads else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace")
                raise RuntimeError(f"edge0 serve exited with {self.proc.returncode}:\n{out}")
            try:
                if self.get("/health").get("status") == "ok":
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("edge0 serve did not start within 300 s")
            time.sleep(0.2)

    def get(self, path: str) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def chat(self, messages: list[dict], max_tokens: int | None) -> dict:
        return stream_chat(self.port, messages, max_tokens)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def stream_chat(
    port: int, messages: list[dict], max_tokens: int | None, started=None, host="127.0.0.1"
) -> dict:
    """A streamed greedy chat on its own connection: seconds to the first content token, to
    the end, the gaps between content tokens, the text. `started` (an Event) is set at the
    first token. (http.client sends a small request in one segment: no Nagle delay.)"""
    body = {"messages": messages, "stream": True, "temperature": 0}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    conn = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    times, text = [], []
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:500]!r}")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            delta = event["choices"][0]["delta"].get("content")
            if delta:
                times.append(time.perf_counter() - t0)
                text.append(delta)
                if started is not None:
                    started.set()
    finally:
        conn.close()
    return {
        "first_s": times[0] if times else None,
        "total_s": time.perf_counter() - t0,
        "gaps": [b - a for a, b in zip(times, times[1:], strict=False)],
        "text": "".join(text),
    }


def short_chats() -> list[list[dict]]:
    topics = ["tides", "gulls", "ships", "storms", "lamps", "maps", "fog"]
    return [[{"role": "user", "content": f"Tell me about {t}."}] for t in topics]


# label -> serve's arguments
CONCURRENCY_ARMS = {
    "one at a time": ["--max-active", "1"],
    "in turn": ["--max-active", str(CONCURRENT), "--no-batch-decode"],
    "batched": ["--max-active", str(CONCURRENT)],
}


def concurrency_arm(model_dir: Path, arm: str, cfg: ServingConfig) -> dict:
    server = Server(model_dir, CONCURRENCY_ARMS[arm], cfg.threads)
    try:
        chats = short_chats()
        server.chat(chats[0], cfg.max_tokens)  # warm up
        trials = [_burst(server, chats, cfg) for _ in range(cfg.trials)]
    finally:
        server.close()
    firsts = [f for t in trials for f in t["together_first_s"]]
    bounds = [b for t in trials for b in t["bounds_s"]]
    return {
        "arm": arm,
        "trials": trials,
        "p50_s": statistics.median(firsts),
        "p95_s": _p95(firsts),
        "trial_p50_s": [statistics.median(t["together_first_s"]) for t in trials],
        "within_bound": sum(f <= b for f, b in zip(firsts, bounds, strict=True)),
        "first_tokens": len(firsts),
        "worst_ratio": max(f / b for f, b in zip(firsts, bounds, strict=True)),
        "alone_first_s": [a for t in trials for a in t["alone_first_s"]],
        "bounds_s": bounds,
    }


def _burst(server: Server, chats: list[list[dict]], cfg: ServingConfig) -> dict:
    """One trial: each short chat alone, then all of them at once while a chat without
    max_tokens decodes; each one's bound from its own time alone."""
    alone = [server.chat(c, cfg.max_tokens) for c in chats]
    with ThreadPoolExecutor(CONCURRENT) as pool:
        long = pool.submit(server.chat, [{"role": "user", "content": STORY}], None)
        while server.get("/health").get("queue_depth", 0) < 1:
            time.sleep(0.01)
        time.sleep(0.3)  # it is decoding
        together = list(pool.map(lambda c: server.chat(c, cfg.max_tokens), chats))
        long_result = long.result()
    solo_step = statistics.median(g for a in alone for g in a["gaps"])
    return {
        "alone_first_s": [a["first_s"] for a in alone],
        "together_first_s": [t["first_s"] for t in together],
        "bounds_s": [2 * a["first_s"] + CONCURRENT * solo_step for a in alone],
        "long_total_s": long_result["total_s"],
    }


def prefill_arm(model_dir: Path, cfg: ServingConfig, reps: int = 5) -> dict:
    """Seconds to prefill the short chats' prompts one by one, and together in one forward."""
    import torch

    from edge0.engine.load import load_engine
    from edge0.engine.options import EngineOptions
    from edge0.text.prompt import ChatTemplate

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    engine = load_engine(model_dir, EngineOptions(max_active=CONCURRENT))
    try:
        template = ChatTemplate(engine.tokenizer)
        prompts = [template.render(c).ids for c in short_chats()]
        serial, together = [], []
        for _ in range(reps + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            for ids in prompts:
                with engine.new_request() as req:
                    engine.prefill(req, ids)
            t1 = time.perf_counter()
            reqs = [engine.new_request() for _ in prompts]
            engine.prefill_together(reqs, prompts)
            for req in reqs:
                req.release()
            serial.append(t1 - t0)
            together.append(time.perf_counter() - t1)
    finally:
        engine.close()
    return {
        "prompt_tokens": [len(p) for p in prompts],
        "serial_s": statistics.median(serial[1:]),
        "together_s": statistics.median(together[1:]),
    }


def decode_arm(model_dir: Path, cfg: ServingConfig, reps: int = 9) -> dict:
    """Milliseconds for B requests' decode steps one after another and in one forward."""
    import torch

    from edge0.engine.load import load_engine
    from edge0.engine.options import EngineOptions
    from edge0.text.prompt import ChatTemplate

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    engine = load_engine(model_dir, EngineOptions(max_active=CONCURRENT))
    rows = {}
    try:
        template = ChatTemplate(engine.tokenizer)
        prompts = [template.render(c).ids for c in short_chats()] + [[1, 2, 3]]
        reqs = [engine.new_request() for _ in prompts]
        for req, ids in zip(reqs, prompts, strict=True):
            engine.prefill(req, ids)
        for b in (1, 2, 4, CONCURRENT):
            serial, together = [], []
            for _ in range(reps + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                for req in reqs[:b]:
                    engine.step(req, 5)
                t1 = time.perf_counter()
                engine.step_rows(reqs[:b], [5] * b)
                serial.append(t1 - t0)
                together.append(time.perf_counter() - t1)
            rows[b] = {
                "serial_ms": statistics.median(serial[1:]) * 1e3,
                "together_ms": statistics.median(together[1:]) * 1e3,
            }
        for req in reqs:
            req.release()
    finally:
        engine.close()
    return rows


def prefix_arm(model_dir: Path, prefix: str, cfg: ServingConfig) -> dict:
    server = Server(model_dir, ["--prefix-cache", prefix], cfg.threads)
    try:
        server.chat([{"role": "user", "content": "hello"}], 2)  # warm up
        messages = [{"role": "user", "content": STORY * 17 + "What happened next?"}]
        turns = []
        for follow_up in ("And then?", "How did it end?", None):
            r = server.chat(messages, cfg.max_tokens)
            turns.append(r)
            messages = messages + [{"role": "assistant", "content": r["text"]}]
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
    finally:
        server.close()
    return {
        "arm": f"prefix_cache={prefix}",
        "turn_first_s": [t["first_s"] for t in turns],
        "texts": [t["text"] for t in turns],
    }


def _p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20, method="inclusive")[-1] if len(xs) > 1 else xs[0]


def run_serving(model_dir: Path, cfg: ServingConfig) -> dict:
    conc: dict[str, list[dict]] = {}
    pref: dict[str, list[dict]] = {}
    names = list(CONCURRENCY_ARMS)
    for r in range(cfg.rounds):
        for arm in names[r % len(names) :] + names[: r % len(names)]:  # rotated
            row = concurrency_arm(model_dir, arm, cfg)
            conc.setdefault(row["arm"], []).append(row)
        for prefix in ["auto", "0"] if r % 2 == 0 else ["0", "auto"]:
            row = prefix_arm(model_dir, prefix, cfg)
            pref.setdefault(row["arm"], []).append(row)
    return {
        "concurrency": conc,
        "prefill": prefill_arm(model_dir, cfg),
        "decode": decode_arm(model_dir, cfg),
        "prefix": pref,
    }


def report(summary: dict) -> str:
    lines = [
        f"{CONCURRENT} concurrent chats (one without max_tokens); first-token latency of "
        f"the other {CONCURRENT - 1}, per round (each the server's bursts together):"
    ]
    for arm, rows in summary["concurrency"].items():
        for row in rows:
            lines.append(
                f"  {arm:>14}: p50 {row['p50_s']:.3f} s, p95 {row['p95_s']:.3f} s (trials' "
                f"p50 {min(row['trial_p50_s']):.3f}-{max(row['trial_p50_s']):.3f} s); alone "
                f"median {statistics.median(row['alone_first_s']):.3f} s; within bound "
                f"{row['within_bound']}/{row['first_tokens']} (bounds "
                f"{min(row['bounds_s']):.3f}-{max(row['bounds_s']):.3f} s, worst "
                f"first/bound {row['worst_ratio']:.2f})"
            )
    p = summary["prefill"]
    lines.append(
        f"prefill of the {len(p['prompt_tokens'])} prompts ({min(p['prompt_tokens'])}-"
        f"{max(p['prompt_tokens'])} tokens): one after another {p['serial_s'] * 1e3:.1f} ms, "
        f"in one forward {p['together_s'] * 1e3:.1f} ms ({p['serial_s'] / p['together_s']:.1f}x)"
    )
    lines.append("decode steps of B requests, one after another / in one forward:")
    for b, row in summary["decode"].items():
        lines.append(
            f"  B={b}: {row['serial_ms']:.1f} ms / {row['together_ms']:.1f} ms "
            f"({row['serial_ms'] / row['together_ms']:.2f}x)"
        )
    lines.append("3-turn chat, ~1,000-token first turn; time to first token per turn:")
    texts = {}
    for arm, rows in summary["prefix"].items():
        for row in rows:
            t = row["turn_first_s"]
            lines.append(
                f"  {arm:>17}: " + ", ".join(f"turn {i + 1} {s:.3f} s" for i, s in enumerate(t))
            )
            texts.setdefault(arm, row["texts"])
    on, off = "prefix_cache=auto", "prefix_cache=0"
    if on in texts and off in texts:
        turn2 = {
            a: statistics.median(r["turn_first_s"][1] for r in summary["prefix"][a])
            for a in (on, off)
        }
        lines.append(
            f"  turn 2 median: without / with = {turn2[off] / turn2[on]:.1f}x; texts "
            f"{'identical' if texts[on] == texts[off] else 'DIFFER'}"
        )
    return "\n".join(lines)
