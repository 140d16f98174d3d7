"""The built-in model: shipped intact, loads in transformers, runs with no arguments."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
import transformers

from edge0 import builtin, modeldir
from edge0.cli import main as cli
from edge0.formats.checkpoint import sha256_file
from edge0.modeldir.loader import load_hf_model
from edge0.models import lora
from helpers import greedy_hf, greedy_ours


def test_shipped_files_match_their_recorded_hashes():
    model = builtin.model_dir()
    manifest = modeldir.Manifest.load(model)
    on_disk = {p.name for p in model.iterdir() if p.is_file() and p.name != modeldir.MANIFEST}
    assert on_disk == set(manifest.files)
    for name, digest in manifest.files.items():
        assert sha256_file(model / name) == digest, name
    record = json.loads((builtin.ROOT / "BUILD.json").read_text())
    for name, digest in record["teacher_files"].items():
        assert sha256_file(builtin.teacher_dir() / name) == digest, name
    assert record["total_bytes"] < 90 * 2**20
    # every stage's wall time, and the machine they were measured on
    assert set(record["stages_s"]) == {"teacher", "convert", "heads", "sft", "opd", "eval"}
    assert all(t > 0 for t in record["stages_s"].values())
    assert record["machine"]["cpu"] and record["machine"]["torch_cpu_capability"]
    assert set(record["stages_machine"]) == set(record["stages_s"])
    assert all(m["cpu"] and m["torch_cpu_capability"] for m in record["stages_machine"].values())


def test_the_served_lora_was_trained_on_the_served_path():
    model = builtin.model_dir()
    manifest = modeldir.Manifest.load(model)
    meta = lora.read(model / modeldir.LORA_FILE).metadata
    assert (meta["K"], meta["W"]) == (str(manifest.served_top_k), str(manifest.served_stage_width))
    assert manifest.served_stage_width > manifest.served_top_k  # the router picks among staged


def test_transformers_loads_the_teacher_and_agrees_greedily():
    path = builtin.teacher_dir()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours = load_hf_model(path)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    ids = torch.tensor(tok.encode("def read_config(path):\n"))
    with torch.no_grad():
        assert (hf(ids[None]).logits - ours(ids[None])).abs().max() < 1e-4
        assert greedy_ours(ours, ids, 16) == greedy_hf(hf, ids, 16)


@pytest.mark.int4
def test_generate_with_no_model_argument(capsys, tmp_path):
    stats = tmp_path / "s.json"
    code = cli.main(
        [
            "generate",
            "--prompt",
            "def read_config(path):\n",
            "--max-tokens",
            "48",
            "--temperature",
            "0",
            "--stats-json",
            str(stats),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    text = out[len("def read_config(path):\n") :]
    # Python-like: several lines, some indented, Python's words and punctuation, not byte soup
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) >= 3
    assert any(line.startswith("    ") for line in lines)
    words = ("def ", "class ", "return", "self", "if ", "import", '"""', "(", ")", "=", ":")
    assert sum(w in text for w in words) >= 5
    assert text.isprintable() or all(c.isprintable() or c in "\n\t" for c in text)

    assert "tok/s" in err and "blocked" in err
    s = json.loads(stats.read_text())
    # every expert fits in memory: nothing to read ahead, so each layer's own router routes
    assert s["prediction_routed_layers"] == 0 and s["dropped"] == 0


def test_generate_under_a_budget_routes_by_the_prerouter(capsys, tmp_path):
    """A pool that holds some of the experts (164 of 256): the prerouter's predictions route
    7 layers, and every routed expert was staged."""
    stats = tmp_path / "s.json"
    argv = ["generate", "--prompt", "def read_config(path):\n", "--max-tokens", "24"]
    argv += ["--temperature", "0", "--max-context", "256", "--expert-cache", "9M"]
    code = cli.main(argv + ["--stats-json", str(stats)])
    _, err = capsys.readouterr()
    assert code == 0, err
    s = json.loads(stats.read_text())
    assert s["prediction_routed_layers"] == 7 and s["dropped"] == 0
    assert s["staged_experts"] > 0 and s["bytes_read"] > 0


def test_chat_with_no_model_argument(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # piped, empty: the prompt alone

    code = cli.main(
        [
            "chat",
            "--prompt",
            "What does os.path.join do?",
            "--max-tokens",
            "24",
            "--temperature",
            "0",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(out.strip()) > 0


def test_serve_with_no_model_argument_answers_the_openai_client(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge0", "serve", "--port", str(port)], stdout=log, stderr=log
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        [model] = client.models.list().data
        r = client.completions.create(
            model=model.id, prompt="import os\n\n\ndef ", max_tokens=16, temperature=0
        )
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens >= 1 and r.choices[0].text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_eval_with_no_argument_prints_every_arm(capsys, tmp_path):
    out_json = tmp_path / "eval.json"
    code = cli.main(["eval", "--windows", "2", "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = json.loads(out_json.read_text())
    text = json.dumps(rows)
    for arm in ("teacher", "prerouter", "phase 2", "phase 3"):
        assert arm in text, arm
    assert "| " in out
