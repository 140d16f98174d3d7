"""The command line: bad input gets one clear line, and generate streams under a small budget."""

from __future__ import annotations

import json

import pytest

from edge0.cli import main as cli
from edge0.convert import convert
from helpers import make_hf_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("cli") / "hf", scale=4.0)


@pytest.fixture(scope="module")
def e0_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-e0") / "e0"
    convert(hf_dir, out, progress=False)
    return out


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def copy_hf(hf_dir, dst):
    dst.mkdir()
    for f in hf_dir.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def assert_user_error(code, err, *needles):
    assert code == 2
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("edge0: error: ")
    for n in needles:
        assert n in err, err


def test_missing_directory(capsys, tmp_path):
    code, _, err = run(capsys, "convert", tmp_path / "nope", tmp_path / "out")
    assert_user_error(code, err, str(tmp_path / "nope"), "does not exist")
    code, _, err = run(capsys, "generate", tmp_path / "nope", "--prompt", "x")
    assert_user_error(code, err, str(tmp_path / "nope"))


def test_truncated_safetensors(capsys, hf_dir, tmp_path):
    bad = copy_hf(hf_dir, tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 3])
    code, _, err = run(capsys, "convert", bad, tmp_path / "out")
    assert_user_error(code, err, "model.safetensors", "truncated")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_unsupported_model_type(capsys, hf_dir, tmp_path):
    bad = copy_hf(hf_dir, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, "convert", bad, tmp_path / "out")
    assert_user_error(code, err, "config.json", "'llama'", "qwen3_moe")


def test_mismatched_shapes(capsys, hf_dir, tmp_path):
    bad = copy_hf(hf_dir, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 256  # dense MLP width that the tensors do not have
    cfg["mlp_only_layers"] = [0]
    (bad / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, "convert", bad, tmp_path / "out")
    assert_user_error(code, err, "model.layers.0.mlp")
    cfg["mlp_only_layers"] = []
    cfg["moe_intermediate_size"] = 128
    (bad / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, "convert", bad, tmp_path / "out")
    assert_user_error(code, err, "expert", "shape")


def test_budget_below_the_resident_floor(capsys, e0_dir):
    code, _, err = run(capsys, "generate", e0_dir, "--prompt", "def", "--memory-budget", "64K")
    assert_user_error(code, err, "--memory-budget", "resident floor")


def test_convert_refuses_to_overwrite(capsys, hf_dir, e0_dir):
    code, _, err = run(capsys, "convert", hf_dir, e0_dir)
    assert_user_error(code, err, "exists", "--force")
    assert (e0_dir / "edge0.json").exists()


def test_generate_streams_experts_under_a_small_budget(capsys, e0_dir, tmp_path):
    manifest = json.loads((e0_dir / "edge0.json").read_text())
    extent = manifest["experts"]["extent_bytes"]
    total = extent * manifest["experts"]["num_experts"] * len(manifest["experts"]["layers"])
    cache = 5 * extent  # far less than the model's experts
    assert total > 3 * cache
    stats = tmp_path / "stats.json"
    code, out, err = run(
        capsys,
        "generate",
        e0_dir,
        "--prompt",
        "def add(a, b):",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--expert-cache",
        cache,
        "--stats-json",
        stats,
    )
    assert code == 0, err
    assert out.startswith("def add(a, b):")
    s = json.loads(stats.read_text())
    for key in (
        "prompt_tokens",
        "generated_tokens",
        "prefill_tok_s",
        "decode_tok_s",
        "peak_anon_bytes",
        "peak_file_bytes",
        "bytes_read",
        "reads",
        "cache_hits",
        "blocked_ms_per_token",
    ):
        assert key in s
    assert s["generated_tokens"] == 12
    assert s["expert_pool_bytes"] <= cache
    # experts were evicted and read again: more bytes streamed than the pool can hold
    assert s["bytes_read"] > s["expert_pool_bytes"]
    assert s["bytes_read"] % extent == 0
    assert "tok/s" in err and "read" in err


def test_generate_and_chat_sample_with_the_models_defaults_as_the_server_does(tmp_path):
    """One sampling default: generation_config.json's temperature, top_p and top_k for the CLI
    as for the server (the built-in model's top_p 0.95 used to be lost here); a flag
    overrides its own field only; a model without the file gets the OpenAI defaults."""
    from edge0 import builtin
    from edge0.cli.args import sampling_params
    from edge0.cli.main import build_parser
    from edge0.engine.sampling import SamplingDefaults, SamplingParams

    def parsed(*flags: str) -> SamplingParams:
        args = build_parser().parse_args(["generate", "--prompt", "x", *flags])
        return sampling_params(args, builtin.model_dir())

    model = SamplingDefaults.from_model_dir(builtin.model_dir())
    assert (model.temperature, model.top_p, model.frequency_penalty) == (0.7, 0.95, 0.3)
    shipped = dict(temperature=0.7, top_p=0.95, top_k=0, frequency_penalty=0.3)
    assert parsed() == SamplingParams(**shipped)
    assert parsed("--top-p", "0.5", "--seed", "3") == SamplingParams(
        **{**shipped, "top_p": 0.5, "seed": 3}
    )
    assert parsed("--frequency-penalty", "0") == SamplingParams(
        **{**shipped, "frequency_penalty": 0}
    )
    assert parsed("--temperature", "0").greedy
    chat = build_parser().parse_args(["chat", "--sample-top-k", "40"])
    assert sampling_params(chat, builtin.model_dir()) == SamplingParams(**{**shipped, "top_k": 40})
    bare = SamplingDefaults.from_model_dir(tmp_path)
    assert bare.resolve() == SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
