"""Building a family's model and loading weights into it, strictly.

Three ways to get a runnable model:
  load_hf_model        a Hugging Face directory, every expert resident in float (the teacher)
  load_edge0_model     an edge0 directory (ModelDir.load_model); experts either stream from
                       disk ("streaming", with int4 resident weights as Int4 modules) or are
                       dequantized from the int4 extents into memory ("dequantized", int4
                       resident weights too: the student path that training runs on, exactly
                       what the kernels compute)
"""

from __future__ import annotations

from pathlib import Path

import torch

from edge0 import modeldir
from edge0.formats.checkpoint import Checkpoint, ExpertSource, ServedCheckpoint, check_dir
from edge0.formats.int4_layout import host_layout
from edge0.models import load_config
from edge0.models.experts import ResidentExperts
from edge0.store.expert_file import FILE_NAME as EXPERTS_FILE
from edge0.store.expert_file import read_table


def build(fam, cfg, experts) -> torch.nn.Module:
    """The family's model with parameters on the meta device (no memory, no init cost)."""
    with torch.device("meta"):
        return fam.Model(cfg, experts=experts)


def expert_prefixes(model) -> dict[int, str]:
    """Each MoE layer's routed experts in the state dict, e.g. `model.layers.3.mlp.experts`."""
    return {i: f"{model.moe_block_path(i)}.experts" for i in model.moe_layers}


def load_state(
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    source: str,
    dtype: torch.dtype | None = None,
) -> None:
    """Assign `state` into a meta-built model; a missing, extra or misshapen tensor is an error."""
    expected = model.state_dict()
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ValueError(f"{source}: unexpected tensor {extra[0]!r}")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{source}: missing tensor {missing[0]!r}")
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise ValueError(
                f"{source}: tensor {k!r} has shape {tuple(v.shape)}, "
                f"the model expects {tuple(expected[k].shape)}"
            )
        if dtype is not None and v.is_floating_point():
            state[k] = v.to(dtype)
    model.load_state_dict(state, strict=True, assign=True)


def load_hf_model(path: Path | str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A Hugging Face MoE checkpoint with all experts resident as float parameters."""
    path = check_dir(path)
    fam, cfg = load_config(path)
    ckpt = ServedCheckpoint(Checkpoint(path), fam, cfg)
    model = build(
        fam,
        cfg,
        lambda layer: ResidentExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size),
    )
    state = {}
    expert_keys = set()
    for prefix in expert_prefixes(model).values():
        src = ExpertSource(ckpt, prefix, cfg.num_experts)
        expert_keys.update(src.keys())
        experts = [src.expert(e) for e in range(cfg.num_experts)]
        state[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
        state[f"{prefix}.down_proj"] = torch.stack([d for _, _, d in experts])
        src.release()
    for k in ckpt.keys():
        if k not in expert_keys:
            state[k] = ckpt.get(k)
    load_state(model, state, str(path), dtype)
    return model.eval()


def load_edge0_model(
    path: Path | str, dtype: torch.dtype = torch.float32, experts: str = "streaming"
):
    """(manifest, model) for an edge0 directory. See the module docstring for `experts`."""
    md = modeldir.ModelDir(path, no_lora=True, no_prerouter=True)
    if experts not in ("streaming", "dequantized"):
        raise ValueError(f"experts must be 'streaming' or 'dequantized', not {experts!r}")
    return md.manifest, md.load_model(dtype, host_layout(), dequantized=experts == "dequantized")


def dequantized_experts(
    path: Path, manifest: modeldir.Manifest, prefixes: dict[int, str]
) -> dict[str, torch.Tensor]:
    """fp32 gate_up/down stacks for every MoE layer, from the extents as the kernel sees them."""
    layout = manifest.layout()
    table, extent_bytes, _ = read_table(path / EXPERTS_FILE)
    if extent_bytes != layout.nbytes:
        raise ValueError(
            f"{path / EXPERTS_FILE}: extent size {extent_bytes} != edge0.json {layout.nbytes}"
        )
    out = {}
    with open(path / EXPERTS_FILE, "rb") as f:
        for layer, prefix in prefixes.items():
            if layer not in table:
                raise ValueError(f"{path / EXPERTS_FILE}: no extents for layer {layer}")
            ext = table[layer]
            f.seek(ext.offset)
            raw = torch.frombuffer(bytearray(f.read(ext.count * extent_bytes)), dtype=torch.uint8)
            w13s, w2s = [], []
            for e in range(ext.count):
                buf = raw[e * extent_bytes : (e + 1) * extent_bytes].clone()
                layout.finalize(buf)
                w13, w2 = layout.dequantize(layout.views(buf))
                w13s.append(w13)
                w2s.append(w2)
            out[f"{prefix}.gate_up_proj"] = torch.stack(w13s)
            out[f"{prefix}.down_proj"] = torch.stack(w2s)
    return out
