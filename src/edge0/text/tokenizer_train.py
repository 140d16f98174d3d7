"""Train a byte-level BPE tokenizer and save it as a Hugging Face tokenizer with a chat template.

The template is ChatML as the Qwen models use it (`<|im_start|>role ... <|im_end|>`), with
tools listed in the system turn, `<tool_call>` blocks, and the `enable_thinking` switch, so
the server's chat path, tool parsing and thinking split are exercised with our own model.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Whole tokens that stay visible in decoded text (the server parses them).
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Function signatures:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, return <tool_call>\\n{"name": <function-name>, \
"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}
{{- '\\n</tool_response><|im_end|>\\n' }}

{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + \
(fn.arguments if fn.arguments is string else (fn.arguments | tojson)) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: Path) -> None:
    """Train on `texts` and save tokenizer.json + tokenizer_config.json (with the template).

    `vocab_size` is the final size, markup tokens included.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens(MARKUP_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
