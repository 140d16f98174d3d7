"""Tiny random Hugging Face MoE checkpoints for tests (built with transformers, saved to disk)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edge0.models.base import Forward

TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\nimport os\nprint(os.path.join('a', 'b'))\n"
    "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本語 テキスト\n"
) * 4


def tiny_tokenizer(path: Path, vocab_size: int = 320) -> None:
    """A byte-level BPE tokenizer saved in Hugging Face format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(str(path))


QWEN3 = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=512,
)


def make_hf_model(
    path: Path,
    family: str = "qwen3_moe",
    seed: int = 0,
    dtype=torch.float32,
    scale: float = 1.0,
    **overrides,
) -> Path:
    """Save a random transformers model of `family` (plus a tokenizer) into `path`."""
    import transformers

    torch.manual_seed(seed)
    cfg_kwargs = dict(QWEN3)
    if family == "qwen2_moe":
        cfg_kwargs.pop("head_dim")
        cfg_kwargs.update(shared_expert_intermediate_size=128)
        cfg_cls, model_cls = transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM
    else:
        cfg_cls, model_cls = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
    cfg_kwargs.update(overrides)
    cfg = cfg_cls(**cfg_kwargs)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # larger weights make routing and logits less degenerate
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    model.to(dtype).save_pretrained(str(path))
    tiny_tokenizer(path)
    return path


def mapping_field(address: int, field: str) -> list[str]:
    """A field (Rss, VmFlags, ...) of this process's mapping that holds `address`, from
    /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == f"{field}:":
                return line.split()[1:]
    raise LookupError(f"no mapping holds {address:#x}")


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def greedy_ours(model, prompt: torch.Tensor, steps: int) -> list[int]:
    """Greedy decode through our model and its cache (prompt [T] -> new ids)."""
    cache = model.new_cache(prompt.shape[0] + steps)
    logits = model(prompt[None], Forward(cache), last_only=True)
    out = []
    for _ in range(steps):
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        logits = model(torch.tensor([[tok]]), Forward(cache), last_only=True)
    return out


def greedy_hf(hf, prompt: torch.Tensor, steps: int) -> list[int]:
    """transformers' generate(), greedy, exactly `steps` new tokens."""
    out = hf.generate(
        prompt[None],
        max_new_tokens=steps,
        do_sample=False,
        min_new_tokens=steps,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, prompt.shape[0] :].tolist()


class DelayedReads:
    """A test double for an ExpertFile whose every read takes `delay_s` longer (a slow disk)."""

    def __init__(self, file, delay_s: float):
        self.file, self.delay_s = file, delay_s

    def read_run(self, *args):
        import time

        time.sleep(self.delay_s)
        return self.file.read_run(*args)

    def __getattr__(self, name):
        return getattr(self.file, name)


def cpu_capabilities() -> list[str]:
    """ATEN_CPU_CAPABILITY values this CPU can run: always `default`, then the vector ISAs
    up to the native one (torch reports e.g. AVX2 or AVX512 on x86)."""
    native = torch.backends.cpu.get_cpu_capability().lower()
    ladder = ["avx2", "avx512"]
    caps = ["default"]
    if native in ladder:
        caps += ladder[: ladder.index(native) + 1]
    elif native != "default":
        caps.append(native)
    return caps


def capability_env(cap: str, cache_dir: Path | None = None) -> dict[str, str]:
    """The environment for a subprocess that must run torch's `cap` kernels."""
    import os

    env = dict(os.environ, ATEN_CPU_CAPABILITY=cap, PYTHONUNBUFFERED="1")
    if cache_dir is not None:
        env["XDG_CACHE_HOME"] = str(cache_dir)
    return env


if __name__ == "__main__":  # `python tests/helpers.py --other-capabilities`, for the Makefile
    import sys

    if sys.argv[1:] != ["--other-capabilities"]:
        sys.exit("usage: helpers.py --other-capabilities")
    native = torch.backends.cpu.get_cpu_capability().lower()
    print(" ".join(c for c in cpu_capabilities() if c != native))


def rows_logits(
    engine, steps: int = 6, alone: bool = False, prompts: list[list[int]] | None = None
) -> list[torch.Tensor]:
    """Engine.step_rows of several requests at different positions, greedy: every row's
    logits of every step (`alone`: each request's own step instead). The prompts: by default
    three (one of a single token, whose first decode step follows a one-token prompt); token
    ids past a small vocabulary wrap around."""
    if prompts is None:
        tok, vocab = engine.tokenizer, engine.model.config.vocab_size
        texts = ["def read_config(path):", "import os\n" * 9]
        prompts = [[t % vocab for t in tok.encode(text)] for text in texts] + [[7]]
    reqs = [engine.new_request() for _ in prompts]
    try:
        first = [engine.prefill(r, ids) for r, ids in zip(reqs, prompts, strict=True)]
        tokens = [int(x.argmax()) for x in first]
        out = []
        for _ in range(steps):
            if alone:
                step = [engine.step(r, t) for r, t in zip(reqs, tokens, strict=True)]
            else:
                step = engine.step_rows(reqs, tokens)
            tokens = [int(x.argmax()) for x in step]
            out += step
        return out
    finally:
        for r in reqs:
            r.release()


# The native decode's activations, each against its reference: fp32 and bf16 with bf16
# activations (torch's int4 kernel's bits), fp32 with int8 activation codes
EVERY_ACTIVATION = pytest.mark.parametrize(
    "dtype, acts",
    [(torch.float32, "bf16"), (torch.bfloat16, "bf16"), (torch.float32, "int8")],
    ids=["fp32", "bf16", "int8"],
)


def decode_logits(path, backend: str, dtype=torch.float32) -> tuple[torch.Tensor, dict[int, str]]:
    """Greedy prefill and 10 decode steps' logits on `backend` (with the exact option's bf16
    activations), and the kind of stand-in the backend gave each layer it serves."""
    from edge0.engine.load import load_engine
    from edge0.engine.options import EngineOptions

    opts = EngineOptions(io_mode="buffered", backend=backend, dtype=dtype, int4_activations="bf16")
    engine = load_engine(path, opts)
    try:
        with engine.new_request() as req:
            logits = [engine.prefill(req, engine.tokenizer.encode("def f(x):"))]
            for _ in range(10):
                logits.append(engine.step(req, int(logits[-1].argmax())))
        return torch.stack(logits), {i: type(s).__name__ for i, s in engine.layers.items()}
    finally:
        engine.close()
