"""A model directory computes the same on every CPU: convert under one of torch's kernels,
serve under another (each in its own process, ATEN_CPU_CAPABILITY picking the kernel)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers

from edge0 import modeldir
from edge0.convert import convert
from edge0.modeldir.loader import load_edge0_model
from helpers import capability_env, cpu_capabilities, greedy_hf, make_hf_model

pytestmark = pytest.mark.slow

PROMPT = "def add(a, b):\n    return"
TOKENS = 12


def edge0(*args: str, cap: str, cache) -> str:
    cmd = [sys.executable, "-m", "edge0", *args]
    r = subprocess.run(cmd, env=capability_env(cap, cache), capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(args)} under {cap}: {r.stderr[-2000:]}"
    return r.stdout


def test_convert_under_one_capability_serve_under_another(tmp_path):
    # larger weights than the parity tests' give wide greedy margins (>= 0.05 nats here), which
    # int4 attention's bf16 activations must not cross on any kernel
    hf_dir = make_hf_model(tmp_path / "hf", scale=8.0)
    converted = {}
    for cap in cpu_capabilities():
        out = tmp_path / f"e0-{cap}"
        edge0("convert", str(hf_dir), str(out), "--quiet", cap=cap, cache=tmp_path / "cache")
        converted[cap] = out

    # transformers on exactly the served weights (bf16 resident + dequantized int4 experts);
    # the dequantized weights do not depend on the arrangement the codes were packed in
    ref = tmp_path / "ref"
    convert(hf_dir, ref, progress=False)
    _, deq = load_edge0_model(ref, experts="dequantized")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    hf.load_state_dict(deq.state_dict(), strict=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ids = torch.tensor(tok.encode(PROMPT))
    with torch.no_grad():
        want = greedy_hf(hf.eval(), ids, TOKENS)
        logits = hf(torch.cat([ids, torch.tensor(want)])[None]).logits[0, len(ids) - 1 : -1]
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() >= 0.05  # the test's premise: no near ties
    if tok.eos_token_id in want:  # edge0 stops at the end-of-text token; transformers did not
        want = want[: want.index(tok.eos_token_id)]
    expected = PROMPT + tok.decode(want)

    layouts = {cap: modeldir.Manifest.load(d).layout().int4.name for cap, d in converted.items()}
    print(layouts)
    for a, model in converted.items():
        for b in cpu_capabilities():
            got = edge0(
                "generate",
                str(model),
                "--prompt",
                PROMPT,
                "--max-tokens",
                str(TOKENS),
                "--temperature",
                "0",
                cap=b,
                cache=tmp_path / "cache",
            )
            assert got.rstrip("\n") == expected, f"converted under {a}, served under {b}"


def test_builtin_model_gives_the_same_greedy_text_under_every_capability(tmp_path):
    texts = {}
    for cap in cpu_capabilities():
        texts[cap] = edge0(
            "generate",
            "--prompt",
            "def read_config(path):\n",
            "--max-tokens",
            "32",
            "--temperature",
            "0",
            cap=cap,
            cache=tmp_path / "cache",
        )
    print(texts)
    assert len(set(texts.values())) == 1, texts
    # and it is the model's text, not a shared failure: Python-like lines
    text = next(iter(texts.values()))
    assert text.count("\n") >= 3 and any(w in text for w in ("return", "self", '"""', "def "))
