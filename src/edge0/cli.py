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

from edge0 import memory, modeldir, runtime
from edge0.store.expert_file import IO_MODES

log = logging.getLogger("edge0")

# ImportError: an optional extra that is not installed (its message names the install)
USER_ERRORS = (
    FileNotFoundError,
    NotADirectoryError,
    FileExistsError,
    ValueError,
    KeyError,
    ImportError,
)


def default_model_dir() -> Path:
    from edge0 import builtin

    return builtin.model_dir()


def default_teacher_dir(model_dir: Path) -> Path:
    """The built-in teacher for the built-in model, else the convert source if still present."""
    from edge0 import builtin

    if model_dir.resolve() == builtin.ROOT.joinpath("model").resolve():
        return builtin.teacher_dir()
    src = Path(modeldir.Manifest.load(model_dir).source.get("path", ""))
    if src.is_dir() and (src / "config.json").is_file():
        return src
    raise ValueError(f"{model_dir}: no teacher known; pass --teacher HF_DIR")


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
        "--lora",
        type=Path,
        default=None,
        help="recovery LoRA (default: MODEL_DIR/lora.safetensors if present)",
    )
    g.add_argument("--no-lora", action="store_true", help="serve without the LoRA")
    g.add_argument(
        "--lora-any-base",
        action="store_true",
        help="load a LoRA trained for another base (its base_hash differs)",
    )


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
        prerouter=args.prerouter,
        no_prerouter=args.no_prerouter,
        lora=args.lora,
        no_lora=args.no_lora,
        lora_any_base=args.lora_any_base,
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
    if args.from_mlx:
        from edge0.mlx_import import import_mlx as convert
    else:
        from edge0.convert import convert

    report = convert(args.hf_dir, args.out_dir, force=args.force, progress=not args.quiet)
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
    from edge0.engine import Engine
    from edge0.tokenizer import IncrementalDecoder

    engine = Engine(args.model_dir or default_model_dir(), engine_options(args))

    try:
        prompt = engine.tokenizer.encode(args.prompt)
        decoder = IncrementalDecoder(engine.tokenizer)

        def on_token(token: int, logits) -> None:

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


def cmd_bench(args: argparse.Namespace) -> int:
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
    from edge0.synth import Shape, synth

    shape = config_from_args(Shape, args, top_k="native_top_k")

    out = synth(
        args.out_dir,
        shape,
        fmt=args.format,
        tokenizer_dir=args.tokenizer,
        seed=args.seed,
        progress=not args.quiet,
    )
    print(
        f"wrote {out}: a RANDOM-WEIGHT qwen3_moe ({args.format} format) for speed and memory "
        "measurements only"
    )
    return 0


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


def cmd_train_teacher(args: argparse.Namespace) -> int:
    from edge0.train.teacher import TeacherConfig, train_teacher

    cfg = config_from_args(TeacherConfig, args, top_k="native_top_k")
    cfg.data = tuple(args.data)
    summary = train_teacher(args.out_dir, cfg, progress=not args.quiet)
    print(
        f"teacher in {args.out_dir}: {summary['steps']} steps, "
        f"{summary['train_tokens']} training tokens, held-out perplexity "
        f"{summary['heldout_ppl']:.2f}"
    )
    return 0


def cmd_train_heads(args: argparse.Namespace) -> int:
    from edge0.train.heads import HeadsConfig, train_heads

    cfg = config_from_args(HeadsConfig, args, train_tokens="tokens")
    out = args.out or args.model_dir / modeldir.PREROUTER_FILE
    report = train_heads(args.model_dir, args.data, out, cfg, progress=not args.quiet)
    print(f"wrote {out} (K={report['K']}); held-out top-{report['K']} recall per consumer layer:")
    print("| layer | warm start | trained |\n|---|---|---|")
    for c in report["consumers"]:
        print(
            f"| {c} | {report['warm_start_recall'][str(c)]:.3f} | "
            f"{report['trained_recall'][str(c)]:.3f} |"
        )
    return 0


def cmd_train_sft(args: argparse.Namespace) -> int:
    from edge0.train.sft import SFTConfig, train_sft

    cfg = config_from_args(SFTConfig, args)
    out = args.out or args.model_dir / modeldir.LORA_SFT_FILE
    r = train_sft(
        args.model_dir,
        args.teacher,
        args.data,
        out,
        cfg,
        heads=args.prerouter,
        progress=not args.quiet,
    )
    print(
        f"wrote {out}: {r['steps']} steps on {r['samples']} teacher samples, "
        f"final loss {r['final_loss']:.4f}; log in {out}.run/log.json"
    )
    return 0


def cmd_train_opd(args: argparse.Namespace) -> int:
    from edge0.train.opd import OPDConfig, train_opd

    cfg = config_from_args(OPDConfig, args)

    init = args.init or args.model_dir / modeldir.LORA_SFT_FILE
    out = args.out or args.model_dir / modeldir.LORA_FILE
    r = train_opd(
        args.model_dir,
        args.teacher,
        args.data,
        init,
        out,
        cfg,
        heads=args.prerouter,
        progress=not args.quiet,
    )
    print(
        f"wrote {out}: {r['steps']} on-policy steps, final loss {r['final_loss']:.5f}; "
        f"log in {out}.run/log.json"
    )
    return 0


def add_train_parsers(sub) -> None:

    t = sub.add_parser("train", help="train a teacher, prerouter heads, or the recovery LoRA")
    tsub = t.add_subparsers(dest="phase", required=True)
    te = tsub.add_parser("teacher", help="pre-train a small Qwen3-MoE on the stdlib corpus")
    te.add_argument("out_dir", type=Path)
    te.add_argument("--steps", type=int, default=1200)
    te.add_argument("--batch", type=int, default=8)
    te.add_argument("--seq-len", type=int, default=256)
    te.add_argument("--lr", type=float, default=3e-3)
    te.add_argument("--layers", type=int, default=8)
    te.add_argument("--hidden", type=int, default=256)
    te.add_argument("--experts", type=int, default=32)
    te.add_argument("--native-top-k", type=int, default=8)
    te.add_argument("--expert-width", type=int, default=128)
    te.add_argument("--vocab", type=int, default=8192)
    te.add_argument("--seed", type=int, default=0)
    te.add_argument("--save-every", type=int, default=100, help="checkpoint interval (steps)")
    te.add_argument(
        "--data",
        nargs="+",
        default=["stdlib"],
        help="text files or directories, or 'stdlib' (default)",
    )

    te.add_argument("--quiet", action="store_true")
    te.set_defaults(func=cmd_train_teacher)

    he = tsub.add_parser("heads", help="phase 1: distill prerouter heads from the routers")
    he.add_argument("model_dir", type=Path)
    he.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="text files or directories, or 'stdlib' for the built-in corpus",
    )
    he.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output file (default MODEL_DIR/prerouter.safetensors)",
    )
    he.add_argument("--top-k", type=int, default=None, help="served K (default native)")
    he.add_argument("--width", type=int, default=512)
    he.add_argument("--start-layer", type=int, default=None)
    he.add_argument("--tokens", type=int, default=60_000, help="training tokens to collect")
    he.add_argument("--heldout-tokens", type=int, default=16_000)
    he.add_argument("--epochs", type=int, default=6)
    he.add_argument("--lr", type=float, default=1e-3)
    he.add_argument("--seed", type=int, default=0)
    he.add_argument("--quiet", action="store_true")
    he.set_defaults(func=cmd_train_heads)

    for name, fn, help_ in (
        ("sft", cmd_train_sft, "phase 2: LoRA SFT on teacher samples"),
        ("opd", cmd_train_opd, "phase 3: on-policy reverse-KL distillation"),
    ):
        p = tsub.add_parser(name, help=help_)
        p.add_argument("model_dir", type=Path)
        p.add_argument("--teacher", type=Path, required=True, help="full-precision HF teacher")
        p.add_argument(
            "--data",
            nargs="+",
            default=["stdlib"],
            help="text files or directories, or 'stdlib' (default)",
        )
        p.add_argument("--out", type=Path, default=None)
        p.add_argument(
            "--prerouter",
            type=Path,
            default=None,
            help="heads (default MODEL_DIR/prerouter.safetensors)",
        )
        p.add_argument("--top-k", type=int, default=None, help="served K (default native)")
        p.add_argument("--prompt-len", type=int, default=32)
        p.add_argument("--batch", type=int, default=8)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--quiet", action="store_true")
        p.set_defaults(func=fn)
        if name == "sft":
            p.add_argument("--rank", type=int, default=16)
            p.add_argument("--alpha", type=float, default=32.0)
            p.add_argument("--samples", type=int, default=512, help="teacher continuations")
            p.add_argument("--gen-len", type=int, default=96)
            p.add_argument("--steps", type=int, default=300)
            p.add_argument("--lr", type=float, default=1e-3)
        else:
            p.add_argument(
                "--init",
                type=Path,
                default=None,
                help="phase-2 LoRA (default MODEL_DIR/lora-phase2.safetensors)",
            )
            p.add_argument("--gen-len", type=int, default=64)
            p.add_argument("--steps", type=int, default=100)
            p.add_argument("--lr", type=float, default=3e-4)
            p.add_argument("--teacher-topk", type=int, default=16)


def cmd_eval(args: argparse.Namespace) -> int:
    from edge0 import evaluate

    target = list(args.target)
    if target and target[0] == "lora-retention":
        model_dir = Path(target[1]) if len(target) > 1 else None
        model_dir = model_dir or default_model_dir()
        from edge0.tokenizer import load_tokenizer

        ids = load_tokenizer(model_dir).encode(args.prompt)
        lora_path = args.lora or model_dir / "lora.safetensors"

        k = args.top_k or modeldir.Manifest.load(model_dir).served_top_k
        r = evaluate.lora_retention(model_dir, lora_path, ids, top_k=k, heads=args.prerouter)

        print(evaluate.retention_table(r))
        if args.json:
            evaluate.dump(r, args.json)
        return 0
    model_dir = Path(target[0]) if target else default_model_dir()
    teacher = args.teacher or default_teacher_dir(model_dir)
    cfg = evaluate.EvalConfig(
        teacher=teacher,
        data=tuple(args.data),
        top_k=args.top_k,
        windows=args.windows,
        seq_len=args.seq_len,
        prerouter=args.prerouter,
        lora_sft=args.lora_sft,
        lora_opd=args.lora,
    )
    result = evaluate.evaluate(model_dir, cfg, progress=not args.quiet)
    print(evaluate.table(result))
    if args.json:
        evaluate.dump(result, args.json)
    return 0


def add_eval_parser(sub) -> None:
    e = sub.add_parser(
        "eval",
        help="quality of every approximation against the teacher; "
        "`eval lora-retention` prices merging the LoRA",
    )
    e.add_argument("target", nargs="*", help="[MODEL_DIR] or lora-retention [MODEL_DIR]")
    e.add_argument("--teacher", type=Path, default=None)
    e.add_argument("--data", nargs="+", default=["stdlib"])
    e.add_argument("--top-k", type=int, default=None, help="served K")
    e.add_argument("--windows", type=int, default=32)
    e.add_argument("--seq-len", type=int, default=256)
    e.add_argument("--prerouter", type=Path, default=None)
    e.add_argument("--lora-sft", type=Path, default=None, help="phase-2 LoRA")
    e.add_argument("--lora", type=Path, default=None, help="phase-3 (served) LoRA")
    e.add_argument(
        "--prompt",
        default="def main(argv):\n",
        help="lora-retention: the prompt whose first-token logits are compared",
    )
    e.add_argument("--json", type=Path, default=None)
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=cmd_eval)


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
    from edge0.chat import add_chat_parser
    from edge0.server.cli import add_serve_parser

    add_serve_parser(sub)
    add_chat_parser(sub)

    from edge0.inspect import add_inspect_parser

    add_inspect_parser(sub)

    s = sub.add_parser("synth", help="write a random-weight Qwen3-MoE of a given shape")

    s.add_argument("out_dir", type=Path)
    s.add_argument("--format", choices=("edge0", "hf"), default="edge0")
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
    b.add_argument("--arms", default="prerouter,ondemand,resident")
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
        help="expert pool of the capped arms (default: cap - floor - 600 MiB)",
    )
    b.add_argument("--tokens", type=int, default=64, help="timed decode steps per round")
    b.add_argument("--warmup", type=int, default=8)
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--io-mode", choices=IO_MODES, default="direct")
    b.add_argument("--prerouter", type=Path, default=None)
    b.add_argument("--threads", type=int, default=None)

    b.add_argument("--kernels", action="store_true", help="time the int4 / dense CPU kernels")
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
        help="synth shape when no HF_DIR is given, e.g. layers=8 (default: issue 14's: "
        "layers=24,hidden=1024,experts=128,expert_width=512,top_k=8,vocab=512)",
    )
    pg.add_argument(
        "--runtime-reserve",
        type=memory.parse_size,
        default=memory.parse_size("384M"),
        help="edge0's --memory-budget is the cap less this (default 384M)",
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
    runtime.tune_malloc()
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
