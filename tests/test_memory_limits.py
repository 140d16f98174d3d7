"""Memory limits honoured up front: the plan reads its cgroup's limit (v1 and v2) and counts the
whole process (runtime, working memory, floor, pool); inspect's prediction matches the peak a
cgroup measures; a cap below it is refused at start naming the missing bytes, never an
out-of-memory kill, and a cap just above it serves four long requests."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from edge0 import builtin
from edge0.engine.options import EngineOptions
from edge0.engine.plan import ModelSizes, make_plan
from edge0.util import cgroup, memory

MiB = 1 << 20
needs_cgroup = pytest.mark.skipif(not cgroup.available(), reason="needs root and cgroup v1")


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroup_limit_is_read_from_v1_and_v2_layouts(tmp_path):
    """The tightest limit on the way to the root, and the group's usage; v1's "unlimited"
    (a number near 2^63) and v2's "max" are no limit; where both hierarchies limit the
    process, the smaller counts."""
    proc = tmp_path / "cgroup"
    fs = tmp_path / "fs"
    write(proc, "4:memory:/a/b\n0::/svc\n")
    write(fs / "memory/a/b/memory.limit_in_bytes", "9223372036854771712\n")
    write(fs / "memory/a/b/memory.usage_in_bytes", "1000\n")
    write(fs / "memory/a/memory.limit_in_bytes", f"{300 * MiB}\n")
    write(fs / "memory/memory.limit_in_bytes", "9223372036854771712\n")
    got = memory.cgroup_memory(proc, fs)
    assert got == memory.CgroupMemory(limit=300 * MiB, usage=1000)
    write(fs / "unified/svc/memory.max", f"{200 * MiB}\n")  # a v2 hierarchy beside it
    write(fs / "unified/svc/memory.current", "2000\n")
    assert memory.cgroup_memory(proc, fs) == memory.CgroupMemory(200 * MiB, 2000)
    write(proc, "0::/svc\n")  # v2 only, mounted at the root
    write(fs / "svc/memory.max", "max\n")
    write(fs / "svc/memory.current", "3000\n")
    assert memory.cgroup_memory(proc, fs) == memory.CgroupMemory(None, 3000)
    write(proc, "1:cpu:/\n")  # no memory controller
    assert memory.cgroup_memory(proc, fs) is None
    assert memory.cgroup_memory(tmp_path / "absent", fs) is None


def sizes(**kw) -> ModelSizes:
    base = dict(
        resident_params=1000,
        moe_layers=4,
        experts_per_layer=8,
        extent_bytes=MiB,
        native_top_k=2,
        served_top_k=None,
        state_bytes=lambda n, dtype, kv: 100 * n,
        hidden_size=64,
        heads=4,
    )
    return ModelSizes(**(base | kw))


def test_the_plan_counts_the_whole_process_against_the_limit():
    opts = EngineOptions(max_context=64, expert_cache=8 * MiB)
    free = memory.MachineMemory(runtime=200 * MiB, limit=None, available=1 << 34)
    plan = make_plan(sizes(), opts, free)
    assert plan.peak_bytes == 200 * MiB + plan.workspace + plan.floor.total + 8 * MiB
    assert plan.workspace > 0
    fits = memory.MachineMemory(200 * MiB, plan.peak_bytes, 1 << 34)
    assert make_plan(sizes(), opts, fits).peak_bytes == plan.peak_bytes
    tight = memory.MachineMemory(200 * MiB, plan.peak_bytes - 1, 1 << 34)
    with pytest.raises(ValueError, match="memory limit .* is .* below the predicted peak") as e:
        make_plan(sizes(), opts, tight)
    assert "1 B more needed" in str(e.value) and "runtime 200.00 MiB" in str(e.value)


def test_no_budget_sizes_the_pool_to_what_the_limit_leaves():
    """Without a budget the pool takes every expert if a quarter of what the process may
    still take holds them; under a limit that is what the limit leaves."""
    opts = EngineOptions(max_context=64)
    roomy = make_plan(sizes(), opts, memory.MachineMemory(200 * MiB, None, 1 << 34))
    assert roomy.holds_every_expert
    small = make_plan(sizes(), opts, memory.MachineMemory(200 * MiB, 300 * MiB, 12 * MiB))
    assert small.pool_slots == 3 and small.peak_bytes <= 300 * MiB


# -- under a real cgroup --------------------------------------------------------------------------

EDGE0 = [sys.executable, "-m", "edge0"]
CONTEXT, PROMPT, ACTIVE = 1024, 200, 4


@pytest.fixture(scope="module", autouse=True)
def native_built():
    """The native library built before anything is measured (a server that compiled it
    under the cap would charge the compiler's memory to the group)."""
    from edge0 import native

    native.build()


def predicted_peak(active: int) -> int:
    """inspect's whole-process prediction, made in a process of its own, as a user runs it."""
    out = subprocess.run(
        EDGE0
        + ["inspect", str(builtin.model_dir()), "--json", "--max-active", str(active)]
        + ["--max-context", str(CONTEXT), "--prefix-cache", "auto"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)["memory"]["predicted_peak_bytes"]


def serve_capped(limit: int, requests: int) -> tuple[int, int, list[int], str]:
    """`edge0 serve` of the built-in model with room for `requests` active requests, under a
    memory cgroup of `limit`, asked that many completions at once that fill the context: (its
    exit status, the group's peak usage, the answers' statuses, what it printed)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = EDGE0 + ["serve", "--port", str(port), "--max-active", str(requests)]
    cmd += ["--max-context", str(CONTEXT)]
    with cgroup.CappedGroup(limit) as group:
        proc = subprocess.Popen(
            group.command(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        printed: list[str] = []
        threading.Thread(target=lambda: printed.extend(proc.stdout), daemon=True).start()
        url, up = f"http://127.0.0.1:{port}", False
        deadline = time.monotonic() + 120
        while not up and proc.poll() is None and time.monotonic() < deadline:
            try:
                up = httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.1)
        statuses: list[int] = []
        if up:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(builtin.model_dir()))
            ids = tok.encode("def read_config(path):\n    return path\n" * 40)[:PROMPT]
            body = {"prompt": ids, "max_tokens": CONTEXT - PROMPT - 1, "temperature": 0}

            def ask() -> None:
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
                statuses.append(r.status_code)

            asking = [threading.Thread(target=ask) for _ in range(requests)]
            for t in asking:
                t.start()
            for t in asking:
                t.join()
            proc.terminate()
        code = proc.wait(timeout=120)
        time.sleep(0.2)
        return code, group.max_usage_bytes, statuses, "".join(printed)


@needs_cgroup
@pytest.mark.slow
@pytest.mark.parametrize("requests", [1, ACTIVE])
def test_inspect_predicts_the_cgroup_measured_peak(requests):
    """One request, and four at once, each filling the context, under a roomy cap: inspect's
    prediction is within 10% of the peak the cgroup measures."""
    code, peak, statuses, printed = serve_capped(16 << 30, requests)
    assert code == 0 and statuses == [200] * requests, printed[-2000:]
    want = predicted_peak(requests)
    print(f"{requests} request(s): cgroup peak {peak / MiB:.1f} MiB, predicted {want / MiB:.1f}")
    assert abs(want - peak) <= 0.1 * peak


@needs_cgroup
@pytest.mark.slow
def test_a_cap_below_the_prediction_is_refused_at_start_and_one_above_it_serves():
    want = predicted_peak(ACTIVE)
    code, _, statuses, printed = serve_capped(int(want * 0.8), ACTIVE)
    assert code == 2 and statuses == [], printed[-2000:]  # refused, not killed (137)
    assert "below the predicted peak" in printed and "more needed" in printed
    code, peak, statuses, printed = serve_capped(int(want * 1.05), ACTIVE)
    assert code == 0 and statuses == [200] * ACTIVE, printed[-2000:]
    assert peak <= want * 1.05
