"""How a model is served: the options every front end (CLI, server, bench, eval) passes on.

Library code names these fields in its errors; the CLI maps them to its flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_IO_MODE = "direct"
INT4_ACTIVATIONS = ("int8", "bf16")  # EngineOptions.int4_activations


@dataclass
class EngineOptions:
    top_k: int | None = None  # serve this many experts per token (default: native)
    # bytes for the whole process (the CLI's --memory-budget): the runtime it holds before any
    # weight (measured), the working memory of its largest forward, the resident floor and
    # the expert pool, which gets what the others leave (engine/plan.py)
    process_budget: int | None = None
    # bytes for resident floor + expert pool alone: for callers that keep their own reserve
    # for the runtime (the benches, under a cgroup cap) and tests
    memory_budget: int | None = None
    expert_cache: int | None = None  # bytes for the expert pool (overrides the budget split)
    io_mode: str = DEFAULT_IO_MODE
    io_threads: int = 4
    relayout: str = "cache"  # codes in another arrangement than the host's: "cache" or "on-read"
    cache_dir: Path | None = None  # where "cache" keeps repacked copies (default ~/.cache/edge0)
    dtype: torch.dtype = torch.float32
    # the kernels (engine/backends): "native" (edge0's compiled ops: a token's K experts in one
    # call, a decode token's attention half in one per layer; built on first use), "torch"
    # (the pure-PyTorch reference; the same numbers), "auto" (native where it builds)
    backend: str = "auto"
    # what the native int4 kernels multiply the weights with: int8 codes with a scale per 64
    # ("int8", the default as in llama.cpp: integer dot products, 1.1-1.3x faster decode, the
    # same bits on every CPU, perplexity within 0.01% of bf16; docs/kernels.md) or activations
    # rounded to bf16 ("bf16", the exact option: torch's int4 kernel bit for bit, the PyTorch
    # path's numbers). The PyTorch paths and a prompt's dense forwards stay bf16.
    int4_activations: str = "int8"
    max_context: int = 4096  # sizes the KV part of the resident floor
    # how keys and values are stored: bf16 (the default whatever the compute dtype: rounded
    # once as stored), float32, or int8 (a scale per 32 channels of a token's head: ~0.53x
    # the bytes of bf16, dequantized for each forward on the PyTorch path; layers.KVCache)
    kv_dtype: torch.dtype = torch.bfloat16
    # requests decoding at once: each holds its own state at max_context and staging room
    max_active: int = 1
    # decode steps of the active requests run in one forward (each row its own state), and
    # fresh prompts prefill in one; off, every forward is one request's, in turn, and each
    # request's logits are bit for bit those it gets alone
    batch_decode: bool = True
    # bytes of finished requests' state kept for prefix reuse (0: none; None: one request's
    # state at max_context, so a conversation's last turn always fits)
    prefix_cache: int | None = 0
    # experts staged per prediction-routed layer (None: K, the prediction is the routing); a
    # wider W lets the layer's router pick its K among the W staged, for W/K the bytes read
    stage_width: int | None = None
    prefill_chunk: int = 256  # prompt tokens per forward; others' steps run between chunks
    prerouter: Path | None = None  # heads file (default: MODEL_DIR/prerouter.safetensors if any)
    # decode's heads on a thread of their own (True), on the compute thread (False), or on a
    # thread only where a core is left beside the intra-op threads (None)
    heads_thread: bool | None = None
    no_prerouter: bool = False  # gate-route every layer: the exact path, no heads, no slots
    # serve the prerouter also where the pool holds every expert; by default such an engine
    # leaves it out (nothing is read ahead there, and each layer's own router is the exact
    # routing: on the built-in model KL 0.0085 to the teacher against 0.0203, and faster)
    prerouter_always: bool = False
    lora: Path | None = None  # adapter file (default: MODEL_DIR/lora.safetensors if any)
    no_lora: bool = False  # serve the base projections only
    # read every expert into the pool at load when the pool holds them all (the first tokens
    # then run at the resident speed); off, or with a smaller pool, experts are read as routed
    preload: bool = True
    lora_any_base: bool = False  # load an adapter whose base_hash differs from this model's
    # serve prerouter heads trained on another base, or to predict another K than served
    prerouter_any_base: bool = False
    # check the expert extents the pool reads against their checksums: each extent's first
    # read in the process ("first"), every read ("all"), or none ("off"); formats/integrity.py
    verify_reads: str = "first"
