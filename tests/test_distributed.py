"""Training under torchrun (train/distributed.py): N gloo ranks train what one process does
with the same global batch and seed, and a killed run resumes to the same adapter; phase 1's
ranks route disjoint shares of the corpus and train the heads one process trains."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tests.test_training import stdlib_slice
from torch.distributed.tensor import DTensor

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


def kill_run(proc: subprocess.Popen, out: Path) -> None:
    """SIGKILL a torchrun job as a crash would: torchrun and its workers, which it starts in
    sessions of their own (so killing torchrun's process group would leave them running)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(out) in cmdline.read_bytes().decode(errors="replace"):
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # gone meanwhile


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


def killed_and_resumed(command, out: Path, last: int) -> tuple[dict, dict]:
    """A two-rank run, `command(out)`, killed after its first checkpoint (of `last`), then
    run again: (what it wrote, the checkpoint it resumed from)."""
    state = out.with_name(out.name + ".run") / "state.pt"
    proc = subprocess.Popen(command(out), env=env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not state.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        kill_run(proc, out)
    checkpoint = torch.load(state, weights_only=False)
    assert 0 < checkpoint["step"] < last and not out.exists()  # killed mid-run, after one
    subprocess.run(command(out), check=True, env=env(), timeout=600)
    return load_file(out), checkpoint


def sft_killed_and_resumed(setup, name: str, *extra: str) -> tuple[dict, dict]:
    out = setup["tmp"] / f"{name}.safetensors"
    return killed_and_resumed(lambda o: sft_command(setup, o, 2, *extra), out, STEPS)


def test_a_killed_two_rank_run_resumes_to_the_uninterrupted_adapter(setup):
    whole = trained(setup, "two", 2)
    resumed, _ = sft_killed_and_resumed(setup, "killed")
    for k in whole:
        assert torch.equal(resumed[k], whole[k]), k


FSDP = ("--base", "dequantized", "--fsdp")


def test_two_fsdp_ranks_train_the_adapter_one_process_trains(setup):
    """--fsdp shards the dequantized base and the LoRA over the ranks (FSDP2): each rank
    holds half of every weight, gathers a layer's whole while it computes, and steps its half
    of the adapter. The adapter is one process's with the same micro-batches, bit for bit:
    averaging two ranks' gradients by reduce-scatter adds what one process accumulates."""
    one = trained(setup, "one-dequantized", None, "--base", "dequantized", "--micro-batch", "2")
    two = trained(setup, "fsdp", 2, *FSDP)
    assert one.keys() == two.keys() and one
    for k in one:
        assert torch.equal(two[k], one[k]), k
    assert any(k.endswith("lora_B") and two[k].abs().max() > 1e-3 for k in two)


SHARDED_LOAD = """
import sys, torch
from edge0.train import distributed
from edge0.train.student import load_student
ranks = distributed.join("cpu")
student = load_student(sys.argv[1], heads=False, new_lora=(8, 16.0), seed=3,
                       base="dequantized", shard=ranks, device=torch.device("cpu"))
held = sum(p.to_local().numel() for p in student.model.parameters())
with distributed.gathered(student.model):
    whole = {n: p.detach().clone() for n, p in student.model.named_parameters()}
if ranks.main:
    torch.save({"whole": whole}, sys.argv[2])
torch.save(held, f"{sys.argv[2]}.{ranks.rank}")
"""


def test_each_fsdp_rank_loads_only_its_shard_of_the_dequantized_base(setup):
    """With --fsdp each rank reads and dequantizes only its rows of every weight (its experts
    of each layer) into memory built sharded: the two ranks hold the model once between
    them, and the weights they gather are the whole-model load's, bit for bit, with the
    same fresh adapter."""
    from edge0.train.student import load_student

    script, out = setup["tmp"] / "sharded_load.py", setup["tmp"] / "sharded.pt"
    script.write_text(SHARDED_LOAD)
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), str(setup["model"])]
    subprocess.run([*cmd, str(out)], check=True, env=env(), timeout=300)
    whole = torch.load(out)["whole"]
    plain = load_student(setup["model"], heads=False, new_lora=(8, 16.0), seed=3)
    expected = dict(plain.model.named_parameters())
    assert whole.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(whole[name], t), name
    held = [torch.load(f"{out}.{r}") for r in range(2)]
    assert sum(held) == sum(t.numel() for t in expected.values())
    assert max(held) < 0.51 * sum(held)  # each rank about half, never the whole


def test_a_killed_fsdp_run_resumes_to_the_uninterrupted_adapter(setup):
    """Its checkpoints hold the whole adapter and AdamW state, gathered from both ranks;
    each rank takes its shards of them again."""
    whole = trained(setup, "fsdp", 2, *FSDP)
    resumed, checkpoint = sft_killed_and_resumed(setup, "fsdp-killed", *FSDP)
    lora_keys = [k for k in checkpoint["model"] if ".lora_" in k]
    assert lora_keys and all(not isinstance(v, DTensor) for v in checkpoint["model"].values())
    assert set(checkpoint["optimizer"]["state"]) == set(lora_keys)  # keyed by name, whole
    for k in whole:
        assert torch.equal(resumed[k], whole[k]), k


# phase 1: `train heads` under torchrun

HEADS_EPOCHS = 3


def heads_command(setup, out: Path, nproc: int | None, *extra: str) -> list[str]:
    launcher = [sys.executable, "-m"]
    if nproc is not None:
        launcher = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "-m"]
    return launcher + [
        "edge0", "train", "heads", str(setup["model"]), "--data", str(setup["data"]),
        "--tokens", "4000", "--heldout-tokens", "1000", "--epochs", str(HEADS_EPOCHS),
        "--batch", "256", "--out", str(out), "--quiet", *extra,
    ]  # fmt: skip


def heads_run(setup, name: str, nproc: int | None, *extra: str) -> Path:
    """The run folder of `train heads` run to its end (once per module)."""
    out = setup["tmp"] / f"{name}.safetensors"
    if not out.exists():
        subprocess.run(heads_command(setup, out, nproc, *extra), check=True, env=env(), timeout=600)
    return out.with_name(out.name + ".run")


def collected(run: Path, owner: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(head inputs, consumer router logits) of one owner layer, every rank's share in
    rank order."""
    ranks = sorted(run.glob("rank*")) or [run]
    feats = [np.fromfile(r / "train" / f"features-{owner}.f16", np.float16) for r in ranks]
    targets = [np.fromfile(r / "train" / f"targets-{owner + 1}.f32", np.float32) for r in ranks]
    return torch.from_numpy(np.concatenate(feats)), torch.from_numpy(np.concatenate(targets))


def test_two_heads_ranks_route_disjoint_shares_of_the_windows_one_process_routes(setup):
    """The 16 windows split 8 and 8: each rank's routing is one forward of its 8, so one
    process routing 8 windows a forward collects the same rows, bit for bit and in order."""
    one = heads_run(setup, "heads-one", None, "--windows-per-forward", "8")
    two = heads_run(setup, "heads-two", 2)
    shares = [json.loads((two / f"rank{r}" / "features.json").read_text()) for r in (0, 1)]
    whole = json.loads((one / "features.json").read_text())
    assert shares[0]["train_rows"] == shares[1]["train_rows"] == whole["train_rows"] // 2 > 0
    assert shares[0]["heldout_rows"] + shares[1]["heldout_rows"] == whole["heldout_rows"]
    for owner in range(builtin_layers(setup) - 1):
        f1, t1 = collected(one, owner)
        f2, t2 = collected(two, owner)
        assert torch.equal(f1, f2) and torch.equal(t1, t2), owner
    # rank 0 alone wrote the checkpoint and the heads; the shares are not rewritten there
    assert (two / "state.pt").exists() and not (two / "train").exists()


def test_two_ranks_train_heads_as_well_as_one_process(setup):
    """Each rank orders its own rows, so the heads are not one process's bits; DDP averages
    their gradients over the effective batch, and held-out recall (over both shares) is one
    process's to within a point per layer, above the warm start."""
    one = json.loads(
        (
            heads_run(setup, "heads-one", None, "--windows-per-forward", "8") / "report.json"
        ).read_text()
    )
    two = json.loads((heads_run(setup, "heads-two", 2) / "report.json").read_text())
    assert two["ranks"] == 2 and one["ranks"] == 1
    # (the held-out windows are routed 2 a forward there, 4 here: near-ties may round apart)
    assert one["warm_start_recall"] == pytest.approx(two["warm_start_recall"], abs=5e-3)
    for c in one["consumers"]:
        c = str(c)
        assert abs(two["trained_recall"][c] - one["trained_recall"][c]) < 0.01, c
        assert two["trained_recall"][c] > two["warm_start_recall"][c] + 0.05, c


def test_a_killed_two_rank_heads_run_resumes_to_the_uninterrupted_heads(setup):
    whole = load_file(heads_run(setup, "heads-two", 2).with_suffix(""))
    out = setup["tmp"] / "heads-killed.safetensors"
    resumed, state = killed_and_resumed(lambda o: heads_command(setup, o, 2), out, HEADS_EPOCHS)
    assert len(state["extra"]["gens"]) == 2  # every rank's order, kept by rank 0
    assert resumed.keys() == whole.keys() and whole
    for k in whole:
        assert torch.equal(resumed[k], whole[k]), k


def builtin_layers(setup) -> int:
    return json.loads((setup["model"] / "config.json").read_text())["num_hidden_layers"]
