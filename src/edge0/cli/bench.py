"""`edge0 bench`: the A/B of the prerouter, the peer bench, and this machine's kernels, disk,
serving and training step."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edge0.bench.serving import ServingConfig
from edge0.cli.args import model_path
from edge0.engine.options import DEFAULT_IO_MODE, INT4_ACTIVATIONS, EngineOptions
from edge0.engine.plan import RUNTIME_RESERVE
from edge0.store.expert_file import IO_MODES
from edge0.util import memory


def add_bench_parser(sub) -> None:
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
    b.add_argument(
        "--top-k",
        type=top_ks,
        default=None,
        help="routed experts per token; with --read-bandwidth a list, e.g. 2,4,8",
    )
    b.add_argument(
        "--read-bandwidth",
        default=None,
        metavar="RATES",
        help="run the capped arms under a kernel read throttle on the model's disk (cgroup "
        "blkio v1 or io.max v2), once per rate, e.g. 0.2G,0.5G,1G,2G,none (GB/s; none: "
        "unthrottled); with --plot, tok/s against the rate",
    )
    b.add_argument(
        "--plot", type=Path, default=None, help="--read-bandwidth: write the sweep's PNG here"
    )
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
        "less a 600 MiB runtime reserve); with --profile, its pool (default: every expert)",
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
        help="profile --tokens decode steps with every expert in memory (at --top-k): time per "
        "kind of op, and the step against the floor of the bytes it must read over the "
        "machine's measured read bandwidth",
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

        path = model_path(args.model_dir)
        opts = EngineOptions(
            io_mode="buffered",
            int4_activations=args.int4_activations,
            top_k=args.top_k[0] if args.top_k else None,
            no_prerouter=True,  # every expert in the pool: the exact step, without the heads
            expert_cache=args.expert_cache or profile.every_expert_bytes(path),
        )
        row = profile.measure(path, args.tokens, options=opts)
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
            model_path(args.model_dir),
            serving.ServingConfig(
                rounds=args.rounds, threads=args.threads, trials=args.serving_trials
            ),
        )
        print(serving.report(summary))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        return 0
    from edge0.bench.ab import BenchConfig, report, run_bench

    model_dir = model_path(args.model_dir)
    ks = args.top_k or [None]
    if len(ks) > 1 and args.read_bandwidth is None:
        raise ValueError("--top-k: a list of K is for a --read-bandwidth sweep")

    cfg = BenchConfig(
        arms=tuple(a.strip() for a in args.arms.split(",")),
        top_k=ks[0],
        memory_cap=args.memory_cap,
        tokens=args.tokens,
        rounds=args.rounds,
        warmup=args.warmup,
        io_mode=args.io_mode,
        expert_cache=args.expert_cache,
        prerouter=args.prerouter,
        threads=args.threads,
    )
    if args.read_bandwidth is not None:
        return bench_sweep(args, model_dir, cfg, ks)
    summary = run_bench(model_dir, cfg)

    print(report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def top_ks(text: str) -> list[int]:
    try:
        ks = [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: K or a list of K like 2,4,8") from None
    if any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"{text!r}: every K must be at least 1")
    return ks


def bench_sweep(args: argparse.Namespace, model_dir: Path, cfg, ks: list) -> int:
    """The A/B once per K and read rate (bench/sweep.py), with its table, JSON and plot."""
    from edge0.bench import sweep
    from edge0.engine.plan import resolve_top_k
    from edge0.modeldir import Manifest

    rates = sweep.parse_rates(args.read_bandwidth)
    if args.plot:  # before the sweep's minutes, not after them
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(
                "--plot needs matplotlib: pip install 'edge0[plot]' (or leave --plot out and "
                "plot the --json later)"
            ) from None
    manifest = Manifest.load(model_dir)
    ks = [resolve_top_k(k, manifest.served_top_k, manifest.native_top_k) for k in ks]
    summary = sweep.run_sweep(model_dir, cfg, ks, rates)
    print(sweep.sweep_report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    if args.plot:
        title = f"{model_dir.name}: cap {memory.format_bytes(cfg.memory_cap)}"
        print(f"wrote {sweep.plot(summary, args.plot, title)}")
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
