"""Prompt scoring: /v1/completions with echo + logprobs (max_tokens 0 allowed), computed in the
prefill forward as `edge0 eval served` computes it, and lm-evaluation-harness's
local-completions model running loglikelihood_rolling and multiple_choice tasks against it."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from edge0 import builtin
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.scoring import score_documents
from edge0.server.app import ServerOptions, create_app
from test_server import live_server

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    'import os\n\nfor name in sorted(os.listdir(".")):\n    print(name)\n',
    "def mean(xs):\n    if not xs:\n        raise ValueError('empty')\n"
    "    return sum(xs) / len(xs)\n",
]


@pytest.fixture(scope="module")
def served():
    """The built-in model served as `edge0 serve` serves it, with small prompt chunks so that a
    scored prompt spans several forwards."""
    engine = load_engine(builtin.model_dir(), EngineOptions(max_active=4, prefill_chunk=16))
    app = create_app(engine, ServerOptions(model_name=builtin.NAME))
    with live_server(app) as url:
        yield engine, url
    engine.close()


def complete(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": builtin.NAME, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_scored_prompt_is_its_prefill_forwards_logprobs(served):
    """echo + logprobs + max_tokens 0: the prompt's tokens, the first unscored (null), each
    other with the logprob the prefill forward gave it, bit for bit what the engine computes
    chunk by chunk; the top alternatives come with it; nothing is generated."""
    engine, url = served
    ids = engine.tokenizer.encode(DOCS[3])
    assert len(ids) > 16  # more than one prompt chunk
    out = complete(url, prompt=ids, max_tokens=0, echo=True, logprobs=3)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
    assert choice["text"] == engine.tokenizer.decode(ids)
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    want = []
    with engine.new_request(reuse=False) as req:
        last = None
        for start in range(0, len(ids), 16):
            chunk = ids[start : start + 16]
            logits = engine.prefill(req, chunk, start + 16 >= len(ids), every_position=True)
            rows = logits if last is None else torch.cat([last[None], logits])
            scored = chunk[1:] if last is None else chunk
            lsm = torch.log_softmax(rows[: len(scored)], -1)
            want += lsm.gather(-1, torch.tensor(scored)[:, None])[:, 0].tolist()
            last = logits[-1]
    assert lp["token_logprobs"][1:] == want
    for entries, chosen in zip(lp["top_logprobs"][1:], want, strict=True):
        assert len(entries) <= 3 and max(entries.values()) >= chosen


def test_echo_with_logprobs_and_a_generated_token(served):
    """max_tokens 1 (what lm-evaluation-harness sends): the prompt's entries, then one for the
    drawn token, an end-of-text one included (lm-eval drops the last entry as generated)."""
    engine, url = served
    ids = engine.tokenizer.encode(DOCS[0])
    out = complete(url, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    eos = engine.tokenizer.eos_token_id
    ended = complete(url, prompt=[*ids, eos], max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert len(ended["choices"][0]["logprobs"]["token_logprobs"]) >= len(ids) + 1
    scored = complete(url, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert lp["token_logprobs"][: len(ids)] == scored["choices"][0]["logprobs"]["token_logprobs"]


def test_a_streamed_echo_carries_the_prompts_logprobs_first(served):
    engine, url = served
    ids = engine.tokenizer.encode(DOCS[1])
    body = {"model": builtin.NAME, "prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    first = json.loads(events[0])["choices"][0]
    assert first["text"] == engine.tokenizer.decode(ids)
    assert len(first["logprobs"]["tokens"]) == len(ids)
    whole = complete(url, **body)["choices"][0]["logprobs"]["token_logprobs"][: len(ids)]
    assert first["logprobs"]["token_logprobs"] == whole


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # nothing to return
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ],
)
def test_max_tokens_zero_is_for_scoring_only(served, body, param):
    _, url = served
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_eval_served_scores_documents_as_the_server(served, tmp_path):
    """`edge0 eval served` sums the same logprobs the server returns for each document
    prefixed with the end-of-text token."""
    engine, url = served
    from edge0.cli import main as cli

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    out = tmp_path / "served.json"
    argv = ["eval", "served", "--documents", str(docs), "--prefill-chunk", "16"]
    assert cli.main([*argv, "--json", str(out), "--quiet"]) == 0
    result = json.loads(out.read_text())
    total = 0.0
    for d in DOCS:
        ids = [engine.tokenizer.eos_token_id, *engine.tokenizer.encode(d)]
        got = complete(url, prompt=ids, max_tokens=0, echo=True, logprobs=0)
        total += sum(got["choices"][0]["logprobs"]["token_logprobs"][1:])
    assert result["loglikelihood"] == pytest.approx(total, rel=1e-12)
    assert result["tokens"] == sum(len(engine.tokenizer.encode(d)) for d in DOCS)
    direct = score_documents(engine, DOCS)
    assert direct.loglikelihood == result["loglikelihood"]


def test_lm_evaluation_harness_scores_through_the_server(served, tmp_path, monkeypatch):
    """lm-evaluation-harness's local-completions model runs a local loglikelihood_rolling task
    (Python snippets) and a local multiple_choice task against the server; its perplexities
    equal `edge0 eval served`'s on the same text to 3 significant digits (they are the same
    sums), and the multiple-choice accuracy is computed from the server's scores."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    engine, url = served
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "snippets.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    questions = [
        ("def add(a, b):\n    return", [" a + b", " a - b", " None"], 0),
        ("import", [" os", " the", " 7"], 0),
        ("for i in range(10):\n   ", [" print(i)", " return", " class"], 0),
    ]
    (tmp_path / "choices.jsonl").write_text(
        "".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in questions)
    )
    (tmp_path / "snippets.yaml").write_text(
        "task: edge0_snippets\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'snippets.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n"
    )
    (tmp_path / "choices.yaml").write_text(
        "task: edge0_choices\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'choices.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    model_args = (
        f"model={builtin.NAME},base_url={url}/v1/completions,"
        f"tokenizer={builtin.model_dir()},tokenizer_backend=huggingface,"
        "tokenized_requests=True,max_length=512"
    )
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["edge0_snippets", "edge0_choices"],
        task_manager=TaskManager(include_path=str(tmp_path)),
    )["results"]
    theirs = results["edge0_snippets"]
    ours = score_documents(engine, DOCS).metrics()
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        got = theirs[f"{metric},none"]
        assert f"{got:.3g}" == f"{ours[metric]:.3g}", (metric, got, ours[metric])
        assert math.isclose(got, ours[metric], rel_tol=1e-9)
    acc = results["edge0_choices"]["acc,none"]
    assert 0 <= acc <= 1
