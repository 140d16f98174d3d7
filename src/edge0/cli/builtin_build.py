"""`make builtin-model`: rebuild the built-in model from scratch with edge0's own commands.

  1. edge0 train teacher   a Qwen3-MoE pre-trained on the stdlib corpus (HF directory)
  2. edge0 convert         int4 experts -> an edge0 directory
  3. edge0 train heads     phase 1, on 1 M tokens, served K=6 (of the native 8)
  4. edge0 train sft       phase 2, KL to the teacher on corpus windows, on the served W=12
                           student path, adapting attention and the routers
  5. edge0 train opd       phase 3, on the student's own samples, at W=12
  6. edge0 eval            the quality table (docs/builtin-model.md)
then copies the results into src/edge0/builtin/{model,teacher} and records each stage's wall
time, sizes and hashes in src/edge0/builtin/BUILD.json. A stage whose output already exists
in the work directory is skipped (each training stage also resumes by itself), so an
interrupted build continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from edge0 import builtin, modeldir
from edge0.cli import main as cli
from edge0.formats.checkpoint import sha256_file
from edge0.util import machine

# Of the native 8: with the 3-pass teacher, halving K under the model's own router already
# costs 5.0% held-out perplexity, K=6 1.2% (docs/builtin-model.md)
SERVED_K = 6
# staged per layer; each layer's router picks SERVED_K among them (eval, K=6: +3.2% over the
# teacher at W=12 before the LoRA, +4.5% at 9, +21% when the prediction routes)
SERVED_STAGE_WIDTH = 12


def stages(work: Path) -> list[tuple[str, Path, list[str]]]:
    teacher, model = work / "teacher", work / "model"
    return [
        (
            "teacher",
            teacher / "model.safetensors",
            [
                "train",
                "teacher",
                str(teacher),
                "--passes",
                "3",
                "--warmup",
                "200",
                "--eval-every",
                "460",
                "--threads",
                "1",
                "--compile",
            ],
        ),
        # the floor stays bf16: int4 would save ~5 MiB here and cost +6.6% held-out perplexity
        # against +0.1% for int4 experts alone (eval's "+ int4 floor" arm, docs/builtin-model.md)
        (
            "convert",
            model / "edge0.json",
            ["convert", str(teacher), str(model), "--resident", "bf16"],
        ),
        (
            "heads",
            model / modeldir.PREROUTER_FILE,
            [
                "train",
                "heads",
                str(model),
                "--data",
                "stdlib",
                "--top-k",
                str(SERVED_K),
                "--tokens",
                "1000000",
                "--heldout-tokens",
                "24000",
                "--epochs",
                "6",
            ],
        ),
        (
            "sft",
            model / modeldir.LORA_SFT_FILE,
            [
                "train",
                "sft",
                str(model),
                "--teacher",
                str(teacher),
                "--top-k",
                str(SERVED_K),
                "--stage-width",
                str(SERVED_STAGE_WIDTH),
                # the teacher's whole distribution (not its sampled token: with CE the LoRA
                # made the served W=12 path worse) on fresh corpus windows of 256 tokens, the
                # routers adapted too (docs/training.md compares the phase-2 recipes)
                "--source",
                "corpus",
                "--prompt-len",
                "32",
                "--gen-len",
                "224",
                "--steps",
                "800",
                "--batch",
                "8",
                "--loss",
                "kl",
                "--lr",
                "3e-3",
                "--lora-routers",
            ],
        ),
        (
            "opd",
            model / modeldir.LORA_FILE,
            [
                "train",
                "opd",
                str(model),
                "--teacher",
                str(teacher),
                "--top-k",
                str(SERVED_K),
                "--stage-width",
                str(SERVED_STAGE_WIDTH),
                "--steps",
                "120",
                "--batch",
                "8",
                "--gen-len",
                "64",
            ],
        ),
        (
            "eval",
            work / "eval.json",
            [
                "eval",
                str(model),
                "--teacher",
                str(teacher),
                "--top-k",
                str(SERVED_K),
                "--windows",
                "64",
                "--json",
                str(work / "eval.json"),
            ],
        ),
    ]


def ship(work: Path, timings: dict, machines: dict) -> None:
    """Copy model and teacher (no run directories) into the package and record the build."""
    dst_model, dst_teacher = builtin.ROOT / "model", builtin.ROOT / "teacher"
    for src, dst in ((work / "model", dst_model), (work / "teacher", dst_teacher)):
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        for f in src.iterdir():
            if f.is_file() and f.name != modeldir.MANIFEST:
                shutil.copy2(f, dst / f.name)
    builtin.write_sampling_defaults(dst_model)
    manifest = modeldir.Manifest.load(work / "model")
    manifest.hash_files(dst_model, ["generation_config.json"])
    manifest.source = {"teacher": "../teacher", "built_by": "make builtin-model"}
    manifest.served_top_k = SERVED_K
    manifest.served_stage_width = SERVED_STAGE_WIDTH

    manifest.files = {p.name: sha256_file(p) for p in sorted(dst_model.iterdir()) if p.is_file()}
    manifest.save(dst_model)
    sizes = {d.name: sum(p.stat().st_size for p in d.iterdir()) for d in (dst_model, dst_teacher)}
    record = {
        "machine": machine.describe(),  # where it was shipped (and the eval run)
        "stages_s": timings,
        "stages_machine": machines,  # where each stage took its wall time
        "bytes": sizes,
        "total_bytes": sum(sizes.values()),
        "teacher_files": {p.name: sha256_file(p) for p in sorted(dst_teacher.iterdir())},
        "eval": json.loads((work / "eval.json").read_text()),
    }
    (builtin.ROOT / "BUILD.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edge0.cli.builtin_build", description=__doc__)
    p.add_argument("--work", type=Path, default=Path("build/builtin"), help="work directory")
    p.add_argument("--no-ship", action="store_true", help="do not copy into the package")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    timings_path = args.work / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    machines_path = args.work / "machines.json"  # stage -> machine.describe() where it ran
    machines = json.loads(machines_path.read_text()) if machines_path.exists() else {}
    for name, output, command in stages(args.work):
        if output.exists():
            print(f"== {name}: done ({output})", flush=True)
            continue
        print(f"== {name}: edge0 {' '.join(command)}", flush=True)
        t0 = time.perf_counter()
        code = cli.main(command)
        if code:
            return code
        timings[name] = round(time.perf_counter() - t0 + timings.get(name, 0.0), 1)
        timings_path.write_text(json.dumps(timings, indent=2) + "\n")
        machines[name] = machine.describe()
        machines_path.write_text(json.dumps(machines, indent=2) + "\n")
    if not args.no_ship:
        ship(args.work, timings, machines)
        print(f"shipped into {builtin.ROOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
