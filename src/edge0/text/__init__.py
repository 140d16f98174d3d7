"""Text in and out: tokenizers, chat prompts, stop strings, reasoning, corpora."""
