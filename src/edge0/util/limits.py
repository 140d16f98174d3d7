"""Defaults the front ends share (`edge0 serve`'s flags and ServerOptions, `edge0 chat`), so
each has one home.

This module imports nothing, so building the CLI's parser stays fast.
"""

# Chat requests that leave max_tokens out; many clients do, and one such request would hold
# the one generation thread to the end of the context (minutes). `edge0 chat` uses the same.
CHAT_MAX_TOKENS = 512
# /v1/completions without max_tokens: the OpenAI API's default for that endpoint
COMPLETIONS_MAX_TOKENS = 16
# on SIGTERM / Ctrl-C, the running request gets this long to finish before it is cut
SHUTDOWN_GRACE_S = 5.0
# requests `edge0 serve` decodes at once (each holds a KV cache for the whole context)
SERVE_MAX_ACTIVE = 4

# `edge0 serve`'s read timeouts (server/http.py): a request head must be in within
# HEADER_TIMEOUT_S of its first byte, and its body within BODY_TIMEOUT_S of the head (1 MiB,
# the default body limit, takes ~1 s at 1 MB/s); a connection idle for KEEP_ALIVE_S, new or
# between requests, is closed. Longer than httpx's 5 s keep-alive expiry (the openai client's),
# so that the client, not the server, closes an idle pooled connection
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 15.0
