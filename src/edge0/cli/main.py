"""The `edge0` command line. Each subcommand parses its flags here and calls library code.

Errors a user can fix (a missing directory, a bad config, a budget too small) print one line
naming the problem and exit with status 2; a traceback is printed only with --debug.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from edge0.cli.args import (
    add_engine_args,
    add_sampling_args,
    config_from_args,
    constrained,
    engine_options,
    model_path,
    prefix_cache_size,
    sampling_params,
    source_path,
    with_flags,
)
from edge0.cli.bench import add_bench_parser
from edge0.cli.train import add_eval_parser, add_train_parsers
from edge0.engine.backends import BackendUnavailable
from edge0.formats.int4_layout import LAYOUTS
from edge0.formats.integrity import ModelDataError
from edge0.models.layers import KV_DTYPES
from edge0.util import malloc, memory, threads

log = logging.getLogger("edge0")

# ImportError: an optional extra that is not installed (its message names the install)
USER_ERRORS = (
    FileNotFoundError,
    NotADirectoryError,
    FileExistsError,
    ValueError,
    KeyError,
    ImportError,
    BackendUnavailable,  # --backend native where the ops cannot be built
    ModelDataError,  # a damaged model file (`edge0 verify` says which)
)

# -- commands ---------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    from edge0 import hub

    src = hub.source(args.hf_dir)  # a directory, a GGUF file, a repo id or a hub-cache path
    kind = "mlx" if args.from_mlx else src.kind  # the flag overrides
    if args.experts != "int4" and kind in ("mlx", "gguf"):
        raise ValueError(
            f"--experts {args.experts} keeps a checkpoint's float weights; {src.path} is "
            f"{kind.upper()}, whose experts are already quantized (convert the Hugging Face "
            "checkpoint it came from)"
        )
    convert = hub.converter(kind)

    report = convert(
        src.path,
        args.out_dir,
        force=args.force,
        progress=not args.quiet,
        int4=args.int4_layout,
        resident=args.resident or ("bf16" if args.experts == "bf16" else "int4"),
        **({"experts": args.experts} if args.experts != "int4" else {}),
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
    if report.quant_errors:
        print(format_quant_errors(report.quant_errors))
    return 0


def format_quant_errors(rows: list[dict]) -> str:
    """The stored weights' relative L2 error against the source's values, one class a line."""
    lines = ["relative L2 error of the stored weights against the source's own values:"]
    for r in rows:
        lines.append(f"  {r['tensor']:<20} {r['gguf']:>6} -> {r['stored']:<8} {r['rel_l2']:.2e}")
    return "\n".join(lines)


def cmd_generate(args: argparse.Namespace) -> int:
    from edge0.engine.load import load_engine
    from edge0.text.tokenizer import IncrementalDecoder

    engine = load_engine(model_path(args.model_dir), engine_options(args))
    try:
        prompt = engine.tokenizer.encode(args.prompt)
        decoder = IncrementalDecoder(engine.tokenizer)
        sampling = constrained(sampling_params(args, engine.path), args, engine)
        result = engine.generate(prompt, args.max_tokens, sampling)
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


def cmd_synth(args: argparse.Namespace) -> int:
    from edge0.convert.synth import Shape, synth

    if args.shape is not None:  # a named shape: its widths are fixed, its depth may be cut
        shape, layers = args.shape, args.layers
    else:
        args.layers = 8 if args.layers is None else args.layers
        shape, layers = config_from_args(Shape, args, top_k="native_top_k"), None
    t0 = time.perf_counter()
    out = synth(
        args.out_dir,
        shape,
        fmt=args.format,
        tokenizer_dir=args.tokenizer,
        seed=args.seed,
        progress=not args.quiet,
        resident=args.resident,
        layers=layers,
    )
    family = json.loads((out / "config.json").read_text())["model_type"]
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(
        f"wrote {out}: a RANDOM-WEIGHT {family} ({args.format} format, "
        f"{memory.format_bytes(size)} in {time.perf_counter() - t0:.0f} s) for speed and "
        "memory measurements only"
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
        help="predict edge0's peak memory under this budget for the whole process, as "
        "serve's --memory-budget, e.g. 3G",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype of resident weights (the engine's default: float32)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=tuple(KV_DTYPES),
        default="bfloat16",
        help="how the KV cache stores keys and values, as the engine's flag (default bfloat16)",
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
    p.add_argument(
        "--train",
        nargs=3,
        type=int,
        metavar=("ROWS", "LENGTH", "RANK"),
        default=None,
        help="also estimate phases 2 and 3's memory (edge0 directories): ROWS sequences of "
        "LENGTH tokens a forward, a new LoRA of RANK (docs/training.md), e.g. 8 256 16",
    )
    p.set_defaults(func=cmd_inspect)


def cmd_pull(args: argparse.Namespace) -> int:
    from edge0 import hub

    print(hub.pull(args.repo_id, progress=not args.quiet))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from edge0 import hub

    models = hub.cached()
    if not models:
        print(f"no converted models in {hub.models_root()}")
        return 0
    for m in models:
        name = m.repo_id + (f"@{m.revision[:12]}" if m.revision else "") if m.repo_id else m.source
        print(f"{name:50s} {memory.format_bytes(m.nbytes):>10s}  {m.path}")
    total = sum(m.nbytes for m in models)
    print(f"{len(models)} models, {memory.format_bytes(total)} in {hub.models_root()}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from edge0 import hub

    gone = hub.remove(args.ref)
    if not gone:
        raise FileNotFoundError(f"{args.ref}: no converted model of that id or path (edge0 list)")
    for path in gone:
        print(f"removed {path}")
    return 0


def add_cache_parsers(sub) -> None:
    p = sub.add_parser(
        "pull", help="download a Hugging Face repo (cache first) and convert it into edge0's cache"
    )
    p.add_argument("repo_id", help="org/name[@revision]")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_pull)
    ls = sub.add_parser("list", help="the converted models in edge0's cache, with their sizes")
    ls.set_defaults(func=cmd_list)
    rm = sub.add_parser("rm", help="remove converted models from edge0's cache")
    rm.add_argument("ref", help="org/name (every revision), org/name@revision, or a cache path")
    rm.set_defaults(func=cmd_rm)


def cmd_verify(args: argparse.Namespace) -> int:
    from edge0.modeldir.verify import verify

    report = verify(model_path(args.model_dir), args.quick, args.cache_dir)
    print(report.text())
    return 0 if report.ok else 1


def cmd_inspect(args: argparse.Namespace) -> int:
    from edge0.cli.inspect import format_report, inspect_dir

    report = inspect_dir(
        source_path(args.model_dir),
        top_k=args.top_k,
        process_budget=args.memory_budget,
        dtype=getattr(torch, args.dtype),
        kv_dtype=KV_DTYPES[args.kv_dtype],
        max_context=args.max_context,
        max_active=args.max_active,
        prefix_cache=args.prefix_cache,
        prerouter_always=args.prerouter_always,
        train=tuple(args.train) if args.train else None,
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
        "convert",
        help="convert a Hugging Face, MLX or GGUF MoE checkpoint to an edge0 directory",
    )
    c.add_argument(
        "hf_dir",
        type=Path,
        metavar="SOURCE",
        help="a Hugging Face or MLX directory, a .gguf file, a repo id (org/name[@revision]) "
        "or a hub-cache path; the format is detected from the files",
    )
    c.add_argument("out_dir", type=Path)
    c.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.add_argument(
        "--from-mlx",
        action="store_true",
        help="SOURCE is an MLX affine int4 checkpoint (detected without it): experts are "
        "repacked, not re-quantized",
    )
    c.add_argument(
        "--resident",
        choices=("int4", "bf16"),
        default=None,
        help="resident projections and embeddings as int4 (default, the reference's format) "
        "or bf16 (for parity work; the default with --experts bf16)",
    )
    c.add_argument(
        "--experts",
        choices=("int4", "bf16"),
        default="int4",
        help="the routed experts as int4 (default: what edge0 serves) or as the checkpoint's "
        "bf16 weights, four times the bytes: a model to serve as the teacher of `edge0 train` "
        "(Hugging Face sources)",
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
        help="a model directory, HF repo id (org/name[@revision]) or hub-cache path "
        "(default: the built-in model)",
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
    add_cache_parsers(sub)

    v = sub.add_parser(
        "verify",
        help="check a model directory, and this machine's relayout copies of it, against the "
        "checksums recorded when they were written (exit 1 naming what differs)",
    )
    v.add_argument("model_dir", type=Path, nargs="?", default=None)
    v.add_argument(
        "--quick", action="store_true", help="headers against edge0.json only (reads no data)"
    )
    v.add_argument("--cache-dir", type=Path, default=None, help="where relayout copies are kept")
    v.set_defaults(func=cmd_verify)

    s = sub.add_parser("synth", help="write a random-weight Qwen3-MoE of a given shape")

    s.add_argument("out_dir", type=Path)
    s.add_argument("--format", choices=("edge0", "hf"), default="edge0")
    s.add_argument(
        "--resident",
        choices=("int4", "bf16"),
        default="int4",
        help="edge0 format: resident projections and embeddings as int4 (default) or bf16",
    )
    s.add_argument(
        "--shape",
        choices=("bench", "35b-a3b", "30b-a3b"),
        default=None,
        help="a full-size shape with its released tensor shapes (the other shape flags do "
        "not apply; --layers cuts its depth): bench, 35b-a3b (the reference's 35B tier, with "
        "its heads and LoRA), 30b-a3b (Qwen3-30B-A3B)",
    )
    s.add_argument("--layers", type=int, default=None, help="decoder layers (default 8)")
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

    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    malloc.tune_malloc()
    threads.resolve_vector_math()  # before any command's first parallel op
    try:
        return args.func(args)
    except USER_ERRORS as e:
        if args.debug:
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"edge0: error: {with_flags(str(msg))}", file=sys.stderr)
        return 2
    except OSError as e:  # a file the command needs: one line with the path and the reason
        if args.debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"edge0: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
