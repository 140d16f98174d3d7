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

from edge0.bench.serving import ServingConfig
from edge0.cli.args import (
    add_engine_args,
    add_sampling_args,
    config_from_args,
    default_model_dir,
    engine_options,
    prefix_cache_size,
    sampling_params,
    with_flags,
)
from edge0.cli.train import add_eval_parser, add_train_parsers
from edge0.engine.options import DEFAULT_IO_MODE, INT4_ACTIVATIONS, EngineOptions
from edge0.engine.plan import RUNTIME_RESERVE
from edge0.formats.int4_layout import LAYOUTS
from edge0.native import NativeUnavailable
from edge0.store.expert_file import IO_MODES
from edge0.util import malloc, memory

log = logging.getLogger("edge0")

# ImportError: an optional extra that is not installed (its message names the install)
USER_ERRORS = (
    FileNotFoundError,
    NotADirectoryError,
    FileExistsError,
    ValueError,
    KeyError,
    ImportError,
    NativeUnavailable,  # --expert-kernel fused where the op cannot be built
)

# -- commands ---------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    if args.from_mlx:
        from edge0.convert.mlx import import_mlx as convert
    else:
        from edge0.convert import convert

    report = convert(
        args.hf_dir,
        args.out_dir,
        force=args.force,
        progress=not args.quiet,
        int4=args.int4_layout,
        resident=args.resident,
    )
    print(
        f"wrote {report.out_dir}: {report.num_extents} expert extents of {report.extent_bytes} "
        f"bytes ({memory.format_bytes(report.expert_bytes)}), resident "
        f"{memory.format_bytes(report.resident_bytes)}, in {report.seconds:.1f} s; source "
        f"{memory.format_bytes(report.source_bytes)}, peak RSS "
        f"{memory.format_bytes(report.peak_rss_bytes)} (anon "
        f"{memory.format_bytes(report.peak_anon_bytes)}, file "
        f"{memory.format_bytes(report.peak_file_bytes)})"
    )

    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from edge0.engine.core import load_engine
    from edge0.text.tokenizer import IncrementalDecoder

    engine = load_engine(args.model_dir or default_model_dir(), engine_options(args))
    try:
        prompt = engine.tokenizer.encode(args.prompt)
        decoder = IncrementalDecoder(engine.tokenizer)
        result = engine.generate(prompt, args.max_tokens, sampling_params(args))
        sys.stdout.write(args.prompt)
        for token, _ in result:
            sys.stdout.write(decoder.push(token))
            sys.stdout.flush()
        sys.stdout.write(decoder.flush() + "\n")
        sys.stdout.flush()
        print(result.stats.line(), file=sys.stderr)
        if args.stats_json:
            Path(args.stats_json).write_text(json.dumps(result.stats.as_dict(), indent=2) + "\n")
    finally:
        engine.close()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.train_step:
        from edge0.bench import train_step

        summary = train_step.run(args.train_step, args.train_steps, rounds=args.rounds)
        print(train_step.report(summary))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        return 0
    if args.profile:
        from edge0.bench import profile

        opts = EngineOptions(io_mode="buffered", int4_activations=args.int4_activations)
        row = profile.measure(args.model_dir or default_model_dir(), args.tokens, options=opts)
        print(profile.report(row))
        if args.json:
            Path(args.json).write_text(json.dumps(row, indent=2) + "\n")
        return 0
    if args.kernels:
        from edge0.bench import kernels

        rows = kernels.measure()
        print(kernels.report(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    if args.io:
        from edge0.bench import io

        scratch = Path(args.io) / "edge0-io-bench.bin"
        rows = io.measure(scratch, args.io_size)
        print(io.report(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        if not args.keep:
            scratch.unlink(missing_ok=True)
        return 0
    if args.peer:
        return bench_peer(args)
    if args.serving:
        from edge0.bench import serving

        summary = serving.run_serving(
            args.model_dir or default_model_dir(),
            serving.ServingConfig(
                rounds=args.rounds, threads=args.threads, trials=args.serving_trials
            ),
        )
        print(serving.report(summary))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        return 0
    from edge0.bench.ab import BenchConfig, report, run_bench

    model_dir = args.model_dir or default_model_dir()

    cfg = BenchConfig(
        arms=tuple(a.strip() for a in args.arms.split(",")),
        top_k=args.top_k,
        memory_cap=args.memory_cap,
        tokens=args.tokens,
        rounds=args.rounds,
        warmup=args.warmup,
        io_mode=args.io_mode,
        expert_cache=args.expert_cache,
        prerouter=args.prerouter,
        threads=args.threads,
    )
    summary = run_bench(model_dir, cfg)

    print(report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def bench_peer(args: argparse.Namespace) -> int:
    from edge0.bench import peer, peer_plot

    if args.top_k is not None:
        raise ValueError(
            "--top-k: the peer bench runs both engines at the model's native top-k; "
            "write a model with another one with --shape top_k=K"
        )
    cfg = peer.PeerConfig(
        peer=args.peer,
        caps=tuple(args.caps.split(",")),
        tokens=args.tokens,
        rounds=args.rounds,
        warmup=args.warmup,
        threads=args.threads or 2,
        io_mode=args.io_mode,
        runtime_reserve=args.runtime_reserve,
        prerouter=args.prerouter,
        llama_cpp_src=args.llama_cpp_src,
        shape=peer.parse_shape(args.shape),
    )
    summary = peer.run_peer(args.work, args.model_dir, cfg)
    print(peer.report(summary))
    out = args.json or args.work / "peer.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    png = peer_plot.plot(summary, out.with_suffix(".png"))
    print(f"wrote {out} and {png}")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from edge0.convert.synth import Shape, synth

    shape = config_from_args(Shape, args, top_k="native_top_k")

    out = synth(
        args.out_dir,
        shape,
        fmt=args.format,
        tokenizer_dir=args.tokenizer,
        seed=args.seed,
        progress=not args.quiet,
        resident=args.resident,
    )
    print(
        f"wrote {out}: a RANDOM-WEIGHT qwen3_moe ({args.format} format) for speed and memory "
        "measurements only"
    )
    return 0


def add_inspect_parser(sub) -> None:
    """`edge0 inspect DIR`."""
    p = sub.add_parser(
        "inspect",
        help="count parameters, bytes and memory of a HF, MLX or edge0 directory (headers only)",
    )
    p.add_argument("model_dir", type=Path)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--top-k", type=int, default=None, help="served experts per token")
    p.add_argument(
        "--memory-budget",
        type=memory.parse_size,
        default=None,
        help="predict edge0's peak memory under this budget, e.g. 3G",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype of resident weights (the engine's default: float32)",
    )
    p.add_argument("--max-context", type=int, default=4096, help="tokens of KV/state to budget")
    p.add_argument(
        "--max-active",
        type=int,
        default=1,
        help="requests decoding at once, as `edge0 serve --max-active` (default 1)",
    )
    p.add_argument(
        "--prefix-cache",
        type=prefix_cache_size,
        default=0,
        help="prefix cache bytes, as `edge0 serve --prefix-cache` ('auto': one request's "
        "state; default 0)",
    )
    p.add_argument(
        "--prerouter-always",
        action="store_true",
        help="plan the prerouter also where the pool holds every expert, as the engine flag",
    )
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    from edge0.cli.inspect import format_report, inspect_dir

    report = inspect_dir(
        args.model_dir,
        top_k=args.top_k,
        memory_budget=args.memory_budget,
        dtype=getattr(torch, args.dtype),
        max_context=args.max_context,
        max_active=args.max_active,
        prefix_cache=args.prefix_cache,
        prerouter_always=args.prerouter_always,
    )
    print(
        json.dumps(report.as_dict(), indent=2) if args.json else with_flags(format_report(report))
    )
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
    c.add_argument(
        "--from-mlx",
        action="store_true",
        help="HF_DIR is an MLX affine int4 checkpoint: experts are repacked, not re-quantized",
    )
    c.add_argument(
        "--resident",
        choices=("int4", "bf16"),
        default="int4",
        help="resident projections and embeddings as int4 (default, the reference's format) "
        "or bf16 (for parity work)",
    )
    c.add_argument(
        "--int4-layout",
        choices=list(LAYOUTS),
        default=None,
        help="arrangement of the int4 codes (default: this machine's kernel's); every "
        "arrangement is served correctly on every CPU",
    )
    c.set_defaults(func=cmd_convert)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument(
        "model_dir",
        type=Path,
        nargs="?",
        default=None,
        help="edge0 model directory (default: the built-in model)",
    )
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--stats-json", type=Path, default=None, help="write the run's stats here")
    add_sampling_args(g)
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    add_train_parsers(sub)
    add_eval_parser(sub)
    from edge0.cli.chat import add_chat_parser
    from edge0.cli.serve import add_serve_parser

    add_serve_parser(sub)
    add_chat_parser(sub)

    add_inspect_parser(sub)

    s = sub.add_parser("synth", help="write a random-weight Qwen3-MoE of a given shape")

    s.add_argument("out_dir", type=Path)
    s.add_argument("--format", choices=("edge0", "hf"), default="edge0")
    s.add_argument(
        "--resident",
        choices=("int4", "bf16"),
        default="int4",
        help="edge0 format: resident projections and embeddings as int4 (default) or bf16",
    )
    s.add_argument("--layers", type=int, default=8)
    s.add_argument("--hidden", type=int, default=1024)
    s.add_argument("--heads", type=int, default=16)
    s.add_argument("--kv-heads", type=int, default=4)
    s.add_argument("--head-dim", type=int, default=64)
    s.add_argument("--experts", type=int, default=64)
    s.add_argument("--native-top-k", type=int, default=8)
    s.add_argument("--expert-width", type=int, default=512)
    s.add_argument("--vocab", type=int, default=8192)
    s.add_argument("--tokenizer", type=Path, default=None, help="copy tokenizer files from here")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=cmd_synth)

    b = sub.add_parser(
        "bench", help="decode A/B of prerouter vs on-demand vs resident; kernels; I/O"
    )
    b.add_argument("model_dir", type=Path, nargs="?", default=None)
    b.add_argument(
        "--arms",
        default="prerouter,ondemand,resident",
        help="comma-separated: prerouter, ondemand, resident; +nolora serves an arm without "
        "the LoRA, +torch with the pure-PyTorch expert path (--expert-kernel torch), "
        "prerouter+wN stages N experts per layer (--stage-width N), prerouter+thread and "
        "prerouter+inline run the heads on a thread of their own or on the decoding thread",
    )
    b.add_argument("--top-k", type=int, default=None, help="routed experts per token")
    b.add_argument(
        "--memory-cap",
        type=memory.parse_size,
        default=memory.parse_size("1G"),
        help="cgroup memory cap of the prerouter and ondemand arms",
    )
    b.add_argument(
        "--expert-cache",
        type=memory.parse_size,
        default=None,
        help="expert pool of the capped arms (default: the serving plan's pool under the cap "
        "less a 600 MiB runtime reserve)",
    )
    b.add_argument("--tokens", type=int, default=64, help="timed decode steps per round")
    b.add_argument("--warmup", type=int, default=8)
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--io-mode", choices=IO_MODES, default=DEFAULT_IO_MODE)
    b.add_argument("--prerouter", type=Path, default=None)
    b.add_argument("--threads", type=int, default=None)

    b.add_argument("--kernels", action="store_true", help="time the int4 / dense CPU kernels")
    b.add_argument(
        "--profile",
        action="store_true",
        help="profile --tokens decode steps with every expert in memory: time per kind of op",
    )
    b.add_argument(
        "--int4-activations",
        choices=INT4_ACTIVATIONS,
        default=EngineOptions.int4_activations,
        help="--profile: the native int4 kernels' activations (as generate's option; the "
        "arms take +int8 or +bf16)",
    )
    b.add_argument(
        "--io",
        type=Path,
        default=None,
        metavar="DIR",
        help="time cold extent reads per I/O mode, with a scratch file in DIR",
    )
    b.add_argument(
        "--io-size",
        type=memory.parse_size,
        default=memory.parse_size("2G"),
        help="scratch file size for --io (default 2G)",
    )
    b.add_argument("--keep", action="store_true", help="keep the --io scratch file")
    b.add_argument(
        "--train-step",
        nargs="+",
        metavar="ARM",
        default=None,
        help="time teacher training steps per arm, e.g. loop:experts=loop,threads=1 "
        "grouped:threads=1 (TeacherConfig fields, threads, experts=grouped|loop)",
    )
    b.add_argument("--train-steps", type=int, default=8, help="timed steps per --train-step arm")
    b.add_argument(
        "--serving",
        action="store_true",
        help="8 concurrent chats with --max-active 1 vs 8, and a 3-turn chat's turn-2 time to "
        "first token with and without the prefix cache, each on its own `edge0 serve`",
    )
    b.add_argument(
        "--serving-trials",
        type=int,
        default=ServingConfig.trials,
        help="--serving: bursts of concurrent chats per server and round",
    )
    pg = b.add_argument_group(
        "peer", "edge0 bench --peer llama.cpp [HF_DIR]: side by side with llama.cpp (docs/peer.md)"
    )
    pg.add_argument("--peer", choices=("llama.cpp",), default=None, help="the other engine")
    pg.add_argument(
        "--work",
        type=Path,
        default=Path("build/peer"),
        help="models (synthesised, converted) and results (default build/peer)",
    )
    pg.add_argument(
        "--caps",
        default="none,2/3,1/3",
        help="cgroup caps: none, fractions of the int4 experts, or sizes (default none,2/3,1/3)",
    )
    pg.add_argument(
        "--shape",
        default="",
        help="synth shape when no HF_DIR is given, e.g. layers=8 (default: "
        "layers=24,hidden=1024,experts=128,expert_width=512,top_k=8,vocab=512)",
    )
    pg.add_argument(
        "--runtime-reserve",
        type=memory.parse_size,
        default=RUNTIME_RESERVE,
        help="edge0's --memory-budget is the cap less this (default: the serving plan's "
        f"{RUNTIME_RESERVE >> 20}M)",
    )
    pg.add_argument(
        "--llama-cpp-src",
        type=Path,
        default=None,
        help="llama-cpp-python sdist or tree holding convert_hf_to_gguf.py "
        "(default ~/.cache/edge0/llama_cpp_python-VERSION.tar.gz)",
    )
    b.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    malloc.tune_malloc()
    try:
        return args.func(args)
    except USER_ERRORS as e:
        if args.debug:
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"edge0: error: {with_flags(str(msg))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
