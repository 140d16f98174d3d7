"""`edge0 train teacher|heads|sft|opd` and `edge0 eval`: the training phases and the quality
table, parsed here and run by edge0.train and edge0.train.evaluate."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from edge0 import modeldir
from edge0.cli.args import config_from_args, default_model_dir, default_teacher_dir, model_path
from edge0.engine.options import EngineOptions
from edge0.engine.plan import resolve_top_k
from edge0.util import memory


def cmd_train_teacher(args: argparse.Namespace) -> int:
    from edge0.train.teacher import TeacherConfig, train_teacher

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = config_from_args(TeacherConfig, args, top_k="native_top_k")
    cfg.data, cfg.extra_train = tuple(args.data), tuple(args.extra_train)
    summary = train_teacher(args.out_dir, cfg, progress=not args.quiet, stop_at=args.stop_at)
    print("| pass | step | held-out ppl | clean held-out ppl | train ppl |\n|---|---|---|---|---|")
    for p in summary["passes"]:
        print(
            f"| {p['pass']} | {p['step']} | {p['heldout_ppl']:.3f} | "
            f"{p['heldout_clean_ppl']:.3f} | {p['train_ppl']:.3f} |"
        )
    if not summary["finished"]:
        print(f"stopped at step {summary['steps']}; the same command continues the run")
        return 0
    early = ", stopped early" if summary["stopped_early"] else ""
    print(
        f"teacher in {args.out_dir}: {summary['steps']} steps{early}, "
        f"{summary['train_tokens']} training tokens; weights of step {summary['best_step']}: "
        f"held-out perplexity {summary['heldout_ppl']:.2f} "
        f"(clean part {summary['heldout_clean_ppl']:.2f})"
    )
    return 0


def cmd_train_heads(args: argparse.Namespace) -> int:
    from edge0.train.heads import HeadsConfig, train_heads

    cfg = config_from_args(HeadsConfig, args, train_tokens="tokens")
    out = args.out or args.model_dir / modeldir.PREROUTER_FILE
    report = train_heads(args.model_dir, args.data, out, cfg, progress=not args.quiet)
    if _other_rank():
        return 0
    print(
        f"wrote {out} (K={report['K']}); expert pool "
        f"{memory.format_bytes(report['pool_bytes'])} of "
        f"{memory.format_bytes(report['experts_bytes'])} of experts; peak anon "
        f"{memory.format_bytes(report['peak_anon_bytes'])}, file "
        f"{memory.format_bytes(report['peak_file_bytes'])}"
    )
    print(f"held-out top-{report['K']} recall per consumer layer:")
    print("| layer | warm start | trained |\n|---|---|---|")
    for c in report["consumers"]:
        print(
            f"| {c} | {report['warm_start_recall'][str(c)]:.3f} | "
            f"{report['trained_recall'][str(c)]:.3f} |"
        )
    return 0


def cmd_train_teacher_cache(args: argparse.Namespace) -> int:
    import time

    from edge0.train.teacher_cache import CacheConfig, build

    cfg = config_from_args(CacheConfig, args)
    t0 = time.perf_counter()
    with memory.PeakSampler(interval_s=0.1) as peaks:
        r = build(args.teacher_dir, args.data, args.out, cfg, progress=not args.quiet)
    print(
        f"wrote {args.out}: {r['windows']} windows x {r['gen_len']} positions, top-{r['topk']} "
        f"+ tail, {memory.format_bytes(r['bytes'])} ({r['bytes_per_position']:.0f} bytes a "
        f"position) in {time.perf_counter() - t0:.1f} s; peak anonymous "
        f"{memory.format_bytes(peaks.peak_anon)}"
    )
    return 0


def cmd_train_sft(args: argparse.Namespace) -> int:
    from edge0.train.sft import SFTConfig, train_sft

    cfg = config_from_args(SFTConfig, args)
    needs_teacher = args.source == "teacher" or args.loss == "kl"
    if args.teacher is None and args.teacher_cache is None and needs_teacher:
        raise SystemExit(
            "edge0 train sft: give --teacher DIR or --teacher-cache DIR (only --source "
            "corpus --loss ce trains without a teacher)"
        )
    out = args.out or args.model_dir / modeldir.LORA_SFT_FILE
    with memory.PeakSampler(interval_s=0.1) as peaks:
        r = train_sft(
            args.model_dir,
            args.teacher,
            args.data,
            out,
            cfg,
            heads=args.prerouter,
            progress=not args.quiet,
        )
    if _other_rank():
        return 0
    seen = "fresh corpus windows" if r["samples"] is None else f"{r['samples']} teacher samples"
    if r["cache_windows"] is not None:
        seen = f"the teacher cache's {r['cache_windows']} windows"
    print(
        f"wrote {out}: {r['steps']} steps on {seen}, "
        f"final loss {r['final_loss']:.4f}; log in {out}.run/log.json"
    )
    _print_cost(r, peaks)
    return 0


def _other_rank() -> bool:
    """Under torchrun, a rank other than 0: rank 0 alone prints the run's summary."""
    return int(os.environ.get("RANK", "0")) != 0


def _print_cost(r: dict, peaks) -> None:
    print(
        f"{r['base']} base: {r['step_s']:.2f} s a step; peak anonymous "
        f"{memory.format_bytes(peaks.peak_anon)}, file-backed "
        f"{memory.format_bytes(peaks.peak_file)} (this process; rank 0's under torchrun)"
    )


def cmd_train_opd(args: argparse.Namespace) -> int:
    from edge0.train.opd import OPDConfig, train_opd

    cfg = config_from_args(OPDConfig, args)

    init = args.init or args.model_dir / modeldir.LORA_SFT_FILE
    out = args.out or args.model_dir / modeldir.LORA_FILE
    with memory.PeakSampler(interval_s=0.1) as peaks:
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
    if _other_rank():
        return 0
    print(
        f"wrote {out}: {r['steps']} on-policy steps, final loss {r['final_loss']:.5f}; "
        f"log in {out}.run/log.json\n"
        f"time: sampling {r['sample_s']:.1f} s, scoring {r['score_s']:.1f} s, training "
        f"{r['train_s']:.1f} s (the steps this process ran"
        + (f"; {r['rounds']} rounds, the teacher loaded for each" if r["rounds"] else "")
        + ")"
    )
    _print_cost(r, peaks)
    return 0


def add_train_parsers(sub) -> None:

    t = sub.add_parser("train", help="train a teacher, prerouter heads, or the recovery LoRA")
    tsub = t.add_subparsers(dest="phase", required=True)
    te = tsub.add_parser("teacher", help="pre-train a small Qwen3-MoE on the stdlib corpus")
    te.add_argument("out_dir", type=Path)
    te.add_argument(
        "--passes", type=int, default=4, help="passes over the training text (default 4)"
    )
    te.add_argument(
        "--steps", type=int, default=None, help="train exactly this many steps instead of --passes"
    )
    te.add_argument("--batch", type=int, default=8)
    te.add_argument("--seq-len", type=int, default=256)
    te.add_argument("--lr", type=float, default=3e-3)
    te.add_argument("--min-lr", type=float, default=3e-4)
    te.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    te.add_argument(
        "--patience",
        type=int,
        default=1,
        help="stop after this many passes without a better held-out perplexity (default 1)",
    )
    te.add_argument(
        "--eval-every", type=int, default=0, help="also evaluate every N steps within a pass"
    )
    te.add_argument("--layers", type=int, default=8)
    te.add_argument("--hidden", type=int, default=256)
    te.add_argument("--experts", type=int, default=32)
    te.add_argument("--native-top-k", type=int, default=8)
    te.add_argument("--expert-width", type=int, default=128)
    te.add_argument("--vocab", type=int, default=8192)
    te.add_argument("--seed", type=int, default=0)
    te.add_argument("--save-every", type=int, default=100, help="checkpoint interval (steps)")
    te.add_argument("--threads", type=int, default=None, help="torch compute threads")
    te.add_argument(
        "--compile", action="store_true", help="torch.compile the training step (inductor)"
    )
    te.add_argument(
        "--autocast-bf16",
        action="store_true",
        help="bf16 autocast (pays off only where the CPU or GPU has native bf16)",
    )
    te.add_argument(
        "--stop-at",
        type=int,
        default=None,
        help="stop after this global step, checkpointed; the same command continues later",
    )
    te.add_argument(
        "--data",
        nargs="+",
        default=["stdlib"],
        help="text files or directories, or 'stdlib' (default)",
    )
    te.add_argument(
        "--extra-train",
        nargs="+",
        default=[],
        help="train-only text: 'site-packages' (this Python's third-party code) or paths; "
        "files sharing text with the held-out split are dropped",
    )
    te.add_argument("--extra-chars", type=int, default=0, help="characters of --extra-train to use")
    te.add_argument("--quiet", action="store_true")
    te.set_defaults(func=cmd_train_teacher)

    tc = tsub.add_parser(
        "teacher-cache",
        help="run the teacher once over corpus windows and keep its top-k + tail per position "
        "(train sft --teacher-cache then needs no teacher)",
    )
    tc.add_argument("teacher_dir", type=Path, help="HF or edge0 teacher directory")
    tc.add_argument("--out", type=Path, required=True, help="the cache's directory")
    tc.add_argument(
        "--data",
        nargs="+",
        default=["stdlib"],
        help="text files or directories, or 'stdlib' (default)",
    )
    tc.add_argument("--windows", type=int, default=1024, help="corpus windows to score")
    tc.add_argument("--prompt-len", type=int, default=32)
    tc.add_argument("--gen-len", type=int, default=224, help="positions kept per window")
    tc.add_argument("--topk", type=int, default=32, help="teacher tokens kept per position")
    tc.add_argument("--shard-windows", type=int, default=128, help="windows per shard file")
    tc.add_argument("--batch", type=int, default=8, help="windows per teacher forward")
    tc.add_argument("--seed", type=int, default=0)
    tc.add_argument("--quiet", action="store_true")
    tc.set_defaults(func=cmd_train_teacher_cache)

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
    he.add_argument(
        "--memory-budget",
        dest="process_budget",
        metavar="BYTES",
        type=memory.parse_size,
        default=None,
        help="bytes for the whole process while routing the corpus, as serve's flag "
        "(default: what memory allows, as for serving); the collected data goes to files",
    )
    he.add_argument(
        "--windows-per-forward",
        type=int,
        default=16,
        help="windows of the corpus routed per forward (fewer: less working memory, for a "
        "large model in a small budget)",
    )
    he.add_argument("--epochs", type=int, default=6)
    he.add_argument(
        "--batch",
        type=int,
        default=512,
        help="rows of collected data a step (the effective batch: under torchrun each of N "
        "ranks takes batch / N of its own)",
    )
    he.add_argument("--lr", type=float, default=1e-3)
    he.add_argument("--seed", type=int, default=0)
    he.add_argument("--quiet", action="store_true")
    he.set_defaults(func=cmd_train_heads)

    for name, fn, help_ in (
        ("sft", cmd_train_sft, "phase 2: LoRA SFT on teacher samples or corpus windows"),
        ("opd", cmd_train_opd, "phase 3: on-policy reverse-KL distillation"),
    ):
        p = tsub.add_parser(name, help=help_)
        p.add_argument("model_dir", type=Path)
        p.add_argument(
            "--teacher",
            type=Path,
            required=name == "opd",
            help="the teacher: a Hugging Face directory (full precision, in memory) or an "
            "edge0 directory (served by edge0: native K, experts through a small pool; convert "
            "the teacher with --experts bf16 to keep its weights)",
        )
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
        p.add_argument(
            "--stage-width",
            type=int,
            default=None,
            help="train on the path served with --stage-width W: each layer's router picks "
            "its K among the W experts the prerouter stages (default K: the prediction routes)",
        )
        p.add_argument("--prompt-len", type=int, default=32)
        p.add_argument(
            "--batch",
            type=int,
            default=8,
            help="sequences per step over all ranks (the effective batch; under torchrun each "
            "of N ranks computes batch / N of them)",
        )
        p.add_argument(
            "--micro-batch",
            type=int,
            default=None,
            help="sequences per forward: a rank's share of the batch is computed this many "
            "at a time and the gradients added (less activation memory, the same step)",
        )
        p.add_argument(
            "--save-every",
            type=int,
            default=25 if name == "sft" else 10,
            help="steps between checkpoints (a re-run resumes from the last)",
        )
        p.add_argument(
            "--base",
            choices=("auto", "int4", "dequantized"),
            default="auto",
            help="the student's frozen base: int4, as served (resident int4 weights, experts "
            "streamed from the pool, CPU); dequantized (every weight in fp32 in memory, on the "
            "GPU if there is one); auto: int4 on the CPU, dequantized on a GPU",
        )
        p.add_argument(
            "--memory-budget",
            dest="process_budget",
            metavar="BYTES",
            type=memory.parse_size,
            default=None,
            help="int4 base: bytes for the whole process, as serve's flag (default: what "
            "memory allows); the pool gets what the floor and the forward leave",
        )
        p.add_argument(
            "--no-checkpoint",
            dest="checkpoint",
            action="store_false",
            help="int4 base: keep every layer's activations instead of recomputing each "
            "layer in the backward pass (faster, more memory)",
        )
        p.add_argument(
            "--fsdp",
            action="store_true",
            help="under torchrun, with --base dequantized: shard the base and the LoRA over "
            "the ranks (FSDP2's fully_shard per decoder layer) instead of holding all of it "
            "on each, for a base that fits N devices but not one",
        )
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--quiet", action="store_true")
        p.set_defaults(func=fn)
        if name == "sft":
            p.add_argument("--rank", type=int, default=16)
            p.add_argument("--alpha", type=float, default=32.0)
            p.add_argument(
                "--lora-routers",
                action="store_true",
                help="put the adapter on each MoE router too (softmax-top-k families), not "
                "only on the family's attention and shared-expert projections",
            )
            p.add_argument("--samples", type=int, default=512, help="teacher continuations")
            p.add_argument(
                "--teacher-cache",
                type=Path,
                default=None,
                help="train on a teacher cache (edge0 train teacher-cache): its windows and the "
                "teacher's top-k + tail at each continuation position; no teacher is loaded "
                "(--prompt-len, --gen-len, --loss and --source are the cache's)",
            )
            p.add_argument("--gen-len", type=int, default=96)
            p.add_argument("--steps", type=int, default=300)
            p.add_argument("--lr", type=float, default=1e-3)
            p.add_argument(
                "--loss",
                choices=("ce", "kl"),
                default="ce",
                help="ce: cross-entropy of the teacher's sampled tokens; kl: KL to the "
                "teacher's whole distribution at each of those positions",
            )
            p.add_argument(
                "--source",
                choices=("teacher", "corpus"),
                default="teacher",
                help="teacher: train on --samples teacher continuations of corpus prompts; "
                "corpus: on fresh corpus windows of --prompt-len + --gen-len tokens each step "
                "(use with --loss kl to learn the teacher's distribution on real text)",
            )
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
            p.add_argument(
                "--round-steps",
                type=int,
                default=0,
                metavar="R",
                help="work in rounds of R steps: the student samples them all, the teacher is "
                "loaded only to score them (into the run folder) and the student trains on "
                "them; the teacher is then not in memory while the student samples or trains "
                "(default 0: sample, score and train every step with the teacher loaded)",
            )


def cmd_eval(args: argparse.Namespace) -> int:
    from edge0.train import evaluate

    target = list(args.target)
    if target and target[0] == "lora-retention":
        model_dir = Path(target[1]) if len(target) > 1 else None
        model_dir = model_dir or default_model_dir()
        from edge0.text.tokenizer import load_tokenizer

        ids = load_tokenizer(model_dir).encode(args.prompt)
        lora_path = args.lora or model_dir / "lora.safetensors"

        manifest = modeldir.Manifest.load(model_dir)
        k = resolve_top_k(args.top_k, manifest.served_top_k, manifest.native_top_k)
        r = evaluate.lora_retention(model_dir, lora_path, ids, top_k=k, heads=args.prerouter)

        print(evaluate.retention_table(r))
        if args.json:
            evaluate.dump(r, args.json)
        return 0
    if target and target[0] == "served":
        return _eval_served(args, model_path(target[1] if len(target) > 1 else None))
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
        int4_floor=not args.no_int4_floor,
        int8_activations=not args.no_int8_activations,
        kv_arms=not args.no_kv_arms,
    )
    result = evaluate.evaluate(model_dir, cfg, progress=not args.quiet)
    print(evaluate.table(result))
    if args.json:
        evaluate.dump(result, args.json)
    return 0


def _eval_served(args: argparse.Namespace, model_dir: Path) -> int:
    """`edge0 eval served`: documents scored by the engine as the server scores a prompt."""
    import json

    from edge0.engine.load import load_engine
    from edge0.engine.options import EngineOptions
    from edge0.engine.scoring import score_documents

    if args.documents is None:
        raise ValueError("eval served needs --documents FILE.jsonl")
    texts = []
    for i, line in enumerate(args.documents.read_text().splitlines()):
        if line.strip():
            doc = json.loads(line)
            if not isinstance(doc.get(args.field), str):
                raise ValueError(f"{args.documents}:{i + 1}: no string field {args.field!r}")
            texts.append(doc[args.field])
    opts = EngineOptions(top_k=args.top_k, prefill_chunk=args.prefill_chunk)
    engine = load_engine(model_dir, opts)
    try:
        scores = score_documents(engine, texts, progress=not args.quiet)
    finally:
        engine.close()
    result = {
        "model": str(model_dir),
        "documents": len(texts),
        "loglikelihood": scores.loglikelihood,
        "tokens": scores.tokens,
        "words": scores.words,
        "bytes": scores.bytes,
        **scores.metrics(),
    }
    for k, v in result.items():
        print(f"{k:18s} {v:.6g}" if isinstance(v, float) else f"{k:18s} {v}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def add_eval_parser(sub) -> None:
    e = sub.add_parser(
        "eval",
        help="quality of every approximation against the teacher; "
        "`eval lora-retention` prices merging the LoRA",
    )
    e.add_argument(
        "target",
        nargs="*",
        help="[MODEL_DIR], lora-retention [MODEL_DIR], or served [MODEL_DIR] (score "
        "--documents through the engine, as the server's /v1/completions echo+logprobs does)",
    )
    e.add_argument("--documents", type=Path, default=None, help="served: a JSONL file of documents")
    e.add_argument("--field", default="text", help="served: the documents' text field")
    e.add_argument(
        "--prefill-chunk",
        type=int,
        default=EngineOptions.prefill_chunk,
        help="served: prompt tokens per forward, as the server's flag (the same value gives "
        "the server's numbers bit for bit)",
    )
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
    e.add_argument(
        "--no-int4-floor",
        action="store_true",
        help="skip the '+ int4 floor' arm of a bf16-floor model (it converts the teacher into "
        "a scratch folder: the teacher's size in disk and time)",
    )
    e.add_argument(
        "--no-int8-activations",
        action="store_true",
        help="skip the int8-activations arm (what --int4-activations int8 costs)",
    )
    e.add_argument(
        "--no-kv-arms",
        action="store_true",
        help="skip the KV bfloat16 and int8 arms (what --kv-dtype costs)",
    )
    e.add_argument("--json", type=Path, default=None)
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=cmd_eval)
