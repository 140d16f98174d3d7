"""The model that ships inside the package, so edge0 runs with no download.

`edge0/builtin/model` is an edge0 directory (int4 experts, prerouter heads, recovery LoRA);
`edge0/builtin/teacher` is the full-precision (bf16) Hugging Face model it was made from.
Both are built from scratch by `make builtin-model` (`python -m edge0.cli.builtin_build`); see
docs/builtin-model.md for what they are and how well they do.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parent
# the id `edge0 serve` gives it (GET /v1/models; a request's `model` names it)
NAME = "edge0-builtin"
# sampling defaults the shipped generation_config.json adds to the teacher's: without a
# penalty the model's greedy text loops on one line (docs/builtin-model.md, "Sampling defaults")
SAMPLING_DEFAULTS = {"frequency_penalty": 0.3}


def model_dir() -> Path:
    path = ROOT / "model"
    if not (path / "edge0.json").is_file():
        raise FileNotFoundError(
            f"no MODEL_DIR given and the built-in model is missing from {path}; "
            "pass a model directory or rebuild it with `make builtin-model`"
        )
    return path


def teacher_dir() -> Path:
    path = ROOT / "teacher"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the built-in teacher is missing from {path}")
    return path


def write_sampling_defaults(model: Path) -> None:
    """Add SAMPLING_DEFAULTS to `model`'s generation_config.json."""
    import json

    path = model / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**cfg, **SAMPLING_DEFAULTS}, indent=2) + "\n")
