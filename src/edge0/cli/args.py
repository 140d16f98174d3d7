"""Argument helpers every `edge0` subcommand shares: engine and sampling flags, the options
they build, the default model, and the flags library errors are translated to.

Front ends (the main CLI, `edge0 chat`, `edge0 serve`) import this module, never each other.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from edge0 import modeldir
from edge0.engine.backends import BACKENDS
from edge0.engine.options import DEFAULT_IO_MODE, INT4_ACTIVATIONS, EngineOptions
from edge0.formats.integrity import VERIFY_READS
from edge0.models.layers import KV_DTYPES
from edge0.store.expert_file import IO_MODES
from edge0.store.relayout import POLICIES
from edge0.util import memory

# Library errors name option fields; the CLI says which flag sets each.
FLAGS = {
    "top_k": "--top-k",
    "process_budget": "--memory-budget",
    "memory_budget": "--memory-budget",
    "expert_cache": "--expert-cache",
    "max_context": "--max-context",
    "max_active": "--max-active",
    "prefix_cache": "--prefix-cache",
    "prefill_chunk": "--prefill-chunk",
    "stage_width": "--stage-width",
    "max_tokens": "--max-tokens",
    "no_prerouter": "--no-prerouter",
    "prerouter_always": "--prerouter-always",
    "no_lora": "--no-lora",
    "lora_any_base": "--lora-any-base",
    "prerouter_any_base": "--prerouter-any-base",
    "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
}
_FIELD = re.compile(r"\b(" + "|".join(FLAGS) + r")\b")


def with_flags(message: str) -> str:
    """A library message with the flag of each option field it names, e.g. `top_k (--top-k)`."""
    return _FIELD.sub(lambda m: f"{m[1]} ({FLAGS[m[1]]})", message)


def default_model_dir() -> Path:
    from edge0 import builtin

    return builtin.model_dir()


def model_path(ref: Path | str | None) -> Path:
    """The edge0 directory a command's MODEL argument names: the built-in model when left
    out; a directory; a HF or MLX directory, a Hugging Face repo id or a hub-cache path,
    converted once into edge0's cache (edge0.hub)."""
    if ref is None:
        return default_model_dir()
    from edge0 import hub

    return hub.resolve(ref)


def source_path(ref: Path | str) -> Path:
    """The directory a MODEL argument names as it is (a repo id's hub snapshot), for the
    commands that read any format: inspect, convert."""
    from edge0 import hub

    return hub.source(ref).path


def default_teacher_dir(model_dir: Path) -> Path:
    """The built-in teacher for the built-in model, else the convert source if still present."""
    from edge0 import builtin

    if model_dir.resolve() == builtin.ROOT.joinpath("model").resolve():
        return builtin.teacher_dir()
    src = Path(modeldir.Manifest.load(model_dir).source.get("path", ""))
    if src.is_dir() and (src / "config.json").is_file():
        return src
    raise ValueError(f"{model_dir}: no teacher known; pass --teacher HF_DIR")


def prefix_cache_size(text: str) -> int | None:
    """--prefix-cache: a size, 0 for none, or 'auto' (None: one request's state)."""
    return None if text.strip().lower() == "auto" else memory.parse_size(text)


def add_engine_args(
    p: argparse.ArgumentParser, max_active: int | None = None, prefix_cache: bool = False
) -> None:
    """The engine's flags; a front end that serves several requests at once passes its default
    `max_active`, one whose requests share prefixes (chat turns) asks for `prefix_cache`."""
    g = p.add_argument_group("engine")
    g.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="routed experts per token (default: the model's native width)",
    )
    g.add_argument(
        "--memory-budget",
        type=memory.parse_size,
        default=None,
        help="bytes for the whole process, e.g. 3G: the runtime (Python, torch, tokenizer), "
        "working memory, resident weights, KV cache, and the expert pool, which gets the rest",
    )
    g.add_argument(
        "--expert-cache",
        type=memory.parse_size,
        default=None,
        help="bytes for the expert pool (instead of deriving it from --memory-budget)",
    )
    g.add_argument(
        "--io-mode",
        choices=IO_MODES,
        default=DEFAULT_IO_MODE,
        help="how experts are read from disk (default: direct, i.e. O_DIRECT)",
    )
    g.add_argument(
        "--max-context",
        type=int,
        default=EngineOptions.max_context,
        help="tokens of prompt plus completion per request; the KV cache is allocated for it "
        f"(default {EngineOptions.max_context})",
    )
    g.add_argument(
        "--stage-width",
        type=int,
        default=None,
        metavar="W",
        help="experts the prerouter stages per layer, W >= K: W = K (default) routes by the "
        "prediction; a wider W lets each layer's router pick its K among the W staged, "
        "reading W/K the bytes",
    )
    g.add_argument(
        "--prefill-chunk",
        type=int,
        default=EngineOptions.prefill_chunk,
        help="prompt tokens per forward; other requests' steps run between chunks "
        f"(default {EngineOptions.prefill_chunk})",
    )
    if max_active is not None:
        g.add_argument(
            "--max-active",
            type=int,
            default=max_active,
            help="requests decoding at once, their decode steps in one forward; each holds "
            f"its own KV cache for --max-context and its staged experts (default {max_active})",
        )
        g.add_argument(
            "--no-batch-decode",
            action="store_true",
            help="run every forward for one request, in turn: no decode step or prompt "
            "prefill of several requests in one forward (each request's logits are then bit "
            "for bit those it gets alone, whatever else runs)",
        )
    if prefix_cache:
        g.add_argument(
            "--prefix-cache",
            type=prefix_cache_size,
            default=None,
            help="memory for finished requests' KV state, reused by a prompt that starts the "
            "same way (a chat's next turn), within --memory-budget; 0 for none (default auto: "
            "one request's state for --max-context)",
        )
    g.add_argument(
        "--io-threads",
        type=int,
        default=EngineOptions.io_threads,
        help=f"reader threads (default {EngineOptions.io_threads})",
    )
    g.add_argument(
        "--relayout",
        choices=POLICIES,
        default="cache",
        help="experts packed for another CPU's int4 kernel: repack once into a cached copy "
        "(default) or on every read",
    )
    g.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where repacked copies and the compiled expert kernel are kept (default "
        "$XDG_CACHE_HOME/edge0 or ~/.cache/edge0)",
    )
    g.add_argument(
        "--backend",
        choices=["auto", *BACKENDS],
        default=EngineOptions.backend,
        help="the kernels: edge0's native ops, one call per token for its experts and one for "
        "each attention layer they compute exactly (native, compiled once on this machine), "
        "the pure-PyTorch reference (torch; the same numbers), or native where it builds "
        "(auto, default)",
    )
    # the flag's name before the backends: fused is native
    g.add_argument(
        "--expert-kernel",
        dest="backend",
        type=lambda v: "native" if v == "fused" else v,
        choices=["auto", *BACKENDS],
        help=argparse.SUPPRESS,
    )
    g.add_argument(
        "--verify-reads",
        choices=VERIFY_READS,
        default=EngineOptions.verify_reads,
        help="check expert extents against their checksums as they are read: each one's first "
        "read in the process (first, default), every read (all), or none (off)",
    )
    g.add_argument(
        "--int4-activations",
        choices=INT4_ACTIVATIONS,
        default=EngineOptions.int4_activations,
        help="what the native int4 kernels multiply weights with: int8 codes with a scale per "
        "64 inputs (int8: integer dot products, faster, the same numbers on every CPU) or "
        "activations rounded to bf16 (bf16, the exact option: torch's int4 kernel bit for bit, "
        "as --backend torch) "
        f"(default {EngineOptions.int4_activations})",
    )
    g.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype of resident weights (default float32)",
    )
    g.add_argument(
        "--kv-dtype",
        choices=tuple(KV_DTYPES),
        default="bfloat16",
        help="how the KV cache stores keys and values: bfloat16 (default, whatever --dtype), "
        "float32, or int8 with a scale per 32 channels (about half of bfloat16's bytes; "
        "decode then attends on the PyTorch path: docs/engine.md prices it)",
    )
    g.add_argument("--threads", type=int, default=None, help="torch compute threads")
    g.add_argument(
        "--prerouter",
        type=Path,
        default=None,
        help="prerouter heads (default: MODEL_DIR/prerouter.safetensors if present)",
    )
    g.add_argument(
        "--no-prerouter",
        action="store_true",
        help="route every layer by its own router (the exact path)",
    )
    g.add_argument(
        "--prerouter-always",
        action="store_true",
        help="serve the prerouter also where the pool holds every expert (by default such "
        "an engine routes every layer by its own router: nothing is read ahead)",
    )
    g.add_argument(
        "--lora",
        type=Path,
        default=None,
        help="recovery LoRA (default: MODEL_DIR/lora.safetensors if present)",
    )
    g.add_argument("--no-lora", action="store_true", help="serve without the LoRA")
    g.add_argument(
        "--no-preload",
        action="store_true",
        help="read experts as they are first routed, even when the expert pool holds them "
        "all (default: such a pool is read in full at load)",
    )
    g.add_argument(
        "--lora-any-base",
        action="store_true",
        help="load a LoRA trained for another base (its base_hash differs)",
    )
    g.add_argument(
        "--prerouter-any-base",
        action="store_true",
        help="serve prerouter heads trained on another base, or for another K than served",
    )


def engine_options(args: argparse.Namespace) -> EngineOptions:
    if args.threads:
        torch.set_num_threads(args.threads)
    return EngineOptions(
        top_k=args.top_k,
        process_budget=args.memory_budget,
        expert_cache=args.expert_cache,
        io_mode=args.io_mode,
        io_threads=args.io_threads,
        max_context=args.max_context,
        max_active=getattr(args, "max_active", EngineOptions.max_active),
        batch_decode=not getattr(args, "no_batch_decode", False),
        prefix_cache=getattr(args, "prefix_cache", EngineOptions.prefix_cache),
        prefill_chunk=args.prefill_chunk,
        stage_width=args.stage_width,
        relayout=args.relayout,
        cache_dir=args.cache_dir,
        backend=args.backend,
        verify_reads=args.verify_reads,
        int4_activations=args.int4_activations,
        dtype=getattr(torch, args.dtype),
        kv_dtype=KV_DTYPES[args.kv_dtype],
        prerouter=args.prerouter,
        no_prerouter=args.no_prerouter,
        prerouter_always=args.prerouter_always,
        lora=args.lora,
        no_lora=args.no_lora,
        preload=not args.no_preload,
        lora_any_base=args.lora_any_base,
        prerouter_any_base=args.prerouter_any_base,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "sampling (default: the model's generation_config.json, as the server's; else 1.0, 1.0, 0)"
    )
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument(
        "--sample-top-k",
        type=int,
        default=None,
        help="sample among the k most likely tokens (0 = all); "
        "--top-k is the number of routed experts",
    )
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--json-schema",
        type=Path,
        default=None,
        metavar="FILE",
        help="answer with JSON valid against the schema in FILE (constrained decoding)",
    )
    g.add_argument(
        "--min-p",
        type=float,
        default=None,
        help="drop tokens less probable than MIN_P times the most probable (0 = off)",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="divide the logit of every token already in the prompt or output by this "
        "(multiply where negative); 1 = off",
    )
    g.add_argument(
        "--presence-penalty",
        type=float,
        default=None,
        help="subtract this from the logit of every token generated so far (-2..2)",
    )
    g.add_argument(
        "--frequency-penalty",
        type=float,
        default=None,
        help="subtract this times a token's count so far from its logit (-2..2)",
    )


def sampling_params(args: argparse.Namespace, model_dir: Path):
    """The flags over the model's defaults (generation_config.json), as the server does."""
    from edge0.engine.sampling import SamplingDefaults

    defaults = SamplingDefaults.from_model_dir(model_dir)
    return defaults.resolve(
        args.temperature,
        args.top_p,
        args.sample_top_k,
        args.seed,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )


def constrained(sampling, args: argparse.Namespace, engine):
    """`sampling` with the grammar of --json-schema, if given (GrammarError names the part
    of the schema that does not compile)."""
    import dataclasses
    import json

    from edge0.engine.grammar import Grammars, json_schema_grammar

    path = getattr(args, "json_schema", None)
    if path is None:
        return sampling
    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--json-schema {path}: {e}") from e
    grammars = Grammars(engine.tokenizer, engine.config.vocab_size)
    try:
        grammar = grammars.compile(json_schema_grammar(schema))
    except Exception as e:  # the compiler's message names what it cannot take
        raise ValueError(f"--json-schema {path} cannot be compiled into a grammar: {e}") from e
    return dataclasses.replace(sampling, grammar=grammar)


def config_from_args(cls, args: argparse.Namespace, **renamed: str):
    """A training config dataclass filled from the same-named CLI arguments.

    `renamed` maps a config field to a differently named argument (field="arg").
    """
    import dataclasses

    values = {}
    for f in dataclasses.fields(cls):
        arg = renamed.get(f.name, f.name)
        if hasattr(args, arg):
            values[f.name] = getattr(args, arg)
    return cls(**values)
