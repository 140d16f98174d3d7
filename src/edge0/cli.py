"""The `edge0` command line. Each subcommand parses its flags here and calls library code.

Errors a user can fix (a missing directory, a bad config, a budget too small) print one line
naming the problem and exit with status 2; a traceback is printed only with --debug.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from edge0 import memory
from edge0.store.expert_file import IO_MODES

log = logging.getLogger("edge0")

USER_ERRORS = (FileNotFoundError, NotADirectoryError, FileExistsError, ValueError, KeyError)


def add_engine_args(p: argparse.ArgumentParser) -> None:
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
        help="total bytes for resident weights, KV cache and expert pool, e.g. 2G",
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
        default="direct",
        help="how experts are read from disk (default: direct, i.e. O_DIRECT)",
    )
    g.add_argument("--io-threads", type=int, default=4, help="reader threads (default 4)")
    g.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype of resident weights (default float32)",
    )
    g.add_argument("--threads", type=int, default=None, help="torch compute threads")


def engine_options(args: argparse.Namespace):
    from edge0.engine import EngineOptions

    if args.threads:
        torch.set_num_threads(args.threads)
    return EngineOptions(
        top_k=args.top_k,
        memory_budget=args.memory_budget,
        expert_cache=args.expert_cache,
        io_mode=args.io_mode,
        io_threads=args.io_threads,
        dtype=getattr(torch, args.dtype),
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument(
        "--sample-top-k",
        type=int,
        default=0,
        help="sample among the k most likely tokens (0 = all); "
        "--top-k is the number of routed experts",
    )
    g.add_argument("--seed", type=int, default=None)


def sampling_params(args: argparse.Namespace):
    from edge0.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.sample_top_k, seed=args.seed
    )


# -- commands ---------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    from edge0.convert import convert

    report = convert(args.hf_dir, args.out_dir, force=args.force, progress=not args.quiet)
    print(
        f"wrote {report.out_dir}: {report.num_extents} expert extents of {report.extent_bytes} "
        f"bytes ({memory.format_bytes(report.expert_bytes)}), resident "
        f"{memory.format_bytes(report.resident_bytes)}, in {report.seconds:.1f} s, "
        f"peak RSS {memory.format_bytes(report.peak_rss_bytes)}"
    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from edge0.engine import Engine
    from edge0.tokenizer import IncrementalDecoder

    engine = Engine(args.model_dir, engine_options(args))
    try:
        prompt = engine.tokenizer.encode(args.prompt)
        decoder = IncrementalDecoder(engine.tokenizer)

        def on_token(token: int) -> None:
            sys.stdout.write(decoder.push(token))
            sys.stdout.flush()

        sys.stdout.write(args.prompt)
        result = engine.generate(prompt, args.max_tokens, sampling_params(args), on_token)
        sys.stdout.write(decoder.flush() + "\n")
        sys.stdout.flush()
        print(result.stats.line(), file=sys.stderr)
        if args.stats_json:
            Path(args.stats_json).write_text(json.dumps(result.stats.as_dict(), indent=2) + "\n")
    finally:
        engine.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edge0", description="Serve MoE language models from SSD.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser(
        "convert", help="convert a Hugging Face MoE checkpoint to an edge0 directory"
    )
    c.add_argument("hf_dir", type=Path)
    c.add_argument("out_dir", type=Path)
    c.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_convert)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("model_dir", type=Path)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--stats-json", type=Path, default=None, help="write the run's stats here")
    add_sampling_args(g)
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except USER_ERRORS as e:
        if args.debug:
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"edge0: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
