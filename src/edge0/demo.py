"""`make run`: build a small random-weight Qwen3-MoE, convert it, stream-generate from it.

The weights are random, so the text is gibberish: this exercises the whole path (convert,
int4 extents, O_DIRECT reads into a bounded pool, decode) on any machine without a download.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from edge0 import cli


def build_random_model(path: Path) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=True,
    )
    transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = Path(__file__).read_text() * 8
    tok.train_from_iterator(
        [text],
        trainers.BpeTrainer(
            vocab_size=1024,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>"
    ).save_pretrained(str(path))
    return path


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="edge0-demo-") as tmp:
        hf = build_random_model(Path(tmp) / "hf")
        out = Path(tmp) / "edge0"
        print(
            "== a random-weight Qwen3-MoE (4 layers, 32 experts): its output is gibberish",
            flush=True,
        )
        rc = cli.main(["convert", str(hf), str(out)])
        if rc:
            return rc
        return cli.main(
            [
                "generate",
                str(out),
                "--prompt",
                "def main():",
                "--max-tokens",
                "32",
                "--seed",
                "0",
                "--expert-cache",
                "2M",
            ]
        )


if __name__ == "__main__":
    sys.exit(main())
