"""Training under torchrun (train/distributed.py): N gloo ranks train what one process does
with the same global batch and seed, and a killed run resumes to the same adapter."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.test_training import stdlib_slice

from edge0 import builtin

pytestmark = pytest.mark.slow

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STEPS = 20


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    model = tmp / "model"
    shutil.copytree(builtin.model_dir(), model)  # training records its adapter in edge0.json
    return {"tmp": tmp, "model": model, "data": stdlib_slice(tmp / "data", count=12)}


def sft_command(setup, out: Path, nproc: int | None, *extra: str) -> list[str]:
    launcher = [sys.executable, "-m"]
    if nproc is not None:
        launcher = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "-m"]
    return launcher + [
        "edge0", "train", "sft", str(setup["model"]),
        "--teacher", str(builtin.teacher_dir()),
        "--data", str(setup["data"]),
        "--source", "corpus", "--loss", "ce",
        "--steps", str(STEPS), "--batch", "4", "--prompt-len", "16", "--gen-len", "32",
        "--save-every", "2", "--out", str(out), "--quiet", *extra,
    ]  # fmt: skip


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def trained(setup, name: str, nproc: int | None, *extra: str) -> dict[str, torch.Tensor]:
    out = setup["tmp"] / f"{name}.safetensors"
    if not out.exists():
        cmd = sft_command(setup, out, nproc, *extra)
        subprocess.run(cmd, check=True, env=env(), timeout=600)
    return load_file(out)


def test_two_gloo_ranks_train_the_adapter_one_process_trains(setup):
    """One process computes the global batch of 4 as two micro-batches of 2, as each of
    two ranks computes its 2: the same arithmetic per row. (With the 4 rows in one forward,
    matmuls over 4 rows round differently in the last bit, and AdamW's first steps, which
    move every weight by about the learning rate whatever its gradient's size, turn that
    into differences of up to 1e-3 in weights whose gradient is near zero.)"""
    one = trained(setup, "one", None, "--micro-batch", "2")
    two = trained(setup, "two", 2)
    assert one.keys() == two.keys() and one
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-4)
    # and they trained: the adapter moved from its start (B = 0)
    assert any(k.endswith("lora_B") and two[k].abs().max() > 1e-3 for k in two)


def test_a_killed_two_rank_run_resumes_to_the_uninterrupted_adapter(setup):
    whole = trained(setup, "two", 2)
    out = setup["tmp"] / "killed.safetensors"
    state = out.with_name(out.name + ".run") / "state.pt"
    proc = subprocess.Popen(sft_command(setup, out, 2), env=env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not state.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    at = torch.load(state, weights_only=False)["step"]
    assert 0 < at < STEPS and not out.exists()  # killed mid-run, after a checkpoint
    subprocess.run(sft_command(setup, out, 2), check=True, env=env(), timeout=600)
    resumed = load_file(out)
    for k in whole:
        assert torch.equal(resumed[k], whole[k]), k
