"""A process killed at any moment (SIGKILL) leaves a model that verifies: `convert --force` over
an existing model, and the relayout copy a start on another CPU writes. What a killed run left
behind (a .partial folder, a copy's unfinished file) does not outlive the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from edge0.convert import convert
from edge0.convert.synth import Shape, synth
from edge0.formats.int4_layout import LAYOUTS, host_layout
from edge0.modeldir import Manifest
from edge0.modeldir.verify import verify

pytestmark = pytest.mark.slow

KILLS = 20
SHAPE = Shape(
    layers=4, hidden=512, heads=8, kv_heads=2, head_dim=64, experts=32, top_k=4,
    expert_width=256, vocab=512,
)  # fmt: skip
EDGE0 = [sys.executable, "-m", "edge0"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("kill") / "hf", SHAPE, fmt="hf", progress=False)


def first_sign(proc: subprocess.Popen, sign) -> float | None:
    """Seconds until sign() is true while `proc` runs (None if it ended first)."""
    t0 = time.perf_counter()
    while not sign():
        if proc.poll() is not None:
            return None
        time.sleep(0.002)
    return time.perf_counter() - t0


def work_span(cmd: list[str], sign) -> float:
    """How long a run writes: from its first sign of writing (sign() true) to the sign's end
    (what it wrote renamed into place), or to its exit."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert first_sign(proc, sign) is not None, "no sign of the run writing"
    t0 = time.perf_counter()
    while sign() and proc.poll() is None:
        time.sleep(0.002)
    span = time.perf_counter() - t0
    proc.wait()
    return span


def killed_at(cmd: list[str], sign, seconds: float) -> bool:
    """Run `cmd`; `seconds` after its first sign of writing, SIGKILL it. Whether it was still
    running then."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if first_sign(proc, sign) is None:
        return False
    try:
        proc.wait(timeout=seconds)
        return False
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return True


def spread(span: float) -> list[float]:
    """KILLS moments over a run's writing, the last ones just past it."""
    return [span * 1.1 * (i + 0.5) / KILLS for i in range(KILLS)]


def test_convert_force_killed_at_any_moment_leaves_the_old_model_or_the_new(hf, tmp_path):
    out = tmp_path / "e0"
    convert(hf, out, progress=False, resident="bf16")  # the old model
    cmd = EDGE0 + ["convert", str(hf), str(out), "--force", "--quiet"]  # the new: int4 floor
    partial = out.with_name(out.name + ".partial")
    sign = partial.exists  # it writes (the new model is renamed into place at the end)
    kinds, killed = [], 0
    for seconds in spread(work_span(cmd, sign)):
        convert(hf, out, progress=False, resident="bf16", force=True)  # the old model again
        killed += killed_at(cmd, sign, seconds)
        report = verify(out, progress=False)
        assert report.ok, (seconds, report.text())
        kinds.append(Manifest.load(out).quantization["resident"])  # bf16 old, int4 new
    assert killed >= KILLS // 2  # most kills landed while it ran
    subprocess.run(cmd, check=True, capture_output=True)  # a later run finishes
    assert Manifest.load(out).quantization["resident"] == "int4" and verify(out, progress=False).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e0"]  # no .partial, no aside copy
    print(f"{killed} of {KILLS} kills landed; the model found after each: {kinds}")


def test_a_relayout_copy_killed_at_any_moment_is_whole_or_absent(hf, tmp_path):
    other = next(name for name in LAYOUTS if name != host_layout().name)
    model = tmp_path / "other"
    convert(hf, model, progress=False, int4=other)
    cache = tmp_path / "cache"
    cmd = EDGE0 + ["generate", str(model), "--prompt", "def", "--max-tokens", "1"]
    cmd += ["--cache-dir", str(cache)]
    relayout = cache / "relayout"

    def sign() -> bool:  # it has begun to write the copy
        return any(relayout.glob("*.safetensors.*[0-9]*"))

    def fresh() -> None:  # each run writes the copy again
        for p in relayout.glob("*.safetensors"):
            p.unlink()

    fresh()
    span = work_span(cmd, sign)
    killed = 0
    for seconds in spread(span):
        fresh()
        killed += killed_at(cmd, sign, seconds)
        assert verify(model, cache_dir=cache, progress=False).ok  # a copy there is whole
    assert killed >= KILLS // 2
    subprocess.run(cmd, check=True, capture_output=True)
    names = [p.name for p in (cache / "relayout").iterdir()]
    assert len(names) == 1 and names[0].endswith(f"-{host_layout().name}.safetensors"), names
    # (the copy, and nothing a killed run left)
    assert verify(model, cache_dir=cache, progress=False).ok
