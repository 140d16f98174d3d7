"""Building a family's model and loading weights into it, strictly.

Three ways to get a runnable model:
  load_hf_model        a Hugging Face directory, every expert resident in float (the teacher)
  load_edge0_model     an edge0 directory (ModelDir.load_model); experts either stream from
                       disk ("streaming", with int4 resident weights as Int4 modules) or are
                       dequantized from the int4 extents into memory ("dequantized", int4
                       resident weights too: the student path that training runs on, exactly
                       what the kernels compute)
  DequantizedTensors   that dequantized model's tensors one rank's rows at a time, for a
                       student sharded over torchrun's ranks (`--fsdp`) that no rank loads
                       whole
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from edge0 import modeldir
from edge0.formats.checkpoint import Checkpoint, ExpertSource, ServedCheckpoint, check_dir
from edge0.formats.int4_layout import host_layout
from edge0.models import int4, load_config
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
    out = {}
    with ExpertReader(path, manifest) as read:
        for layer, prefix in prefixes.items():
            w13, w2 = read(layer)
            out[f"{prefix}.gate_up_proj"], out[f"{prefix}.down_proj"] = w13, w2
    return out


class ExpertReader:
    """Dequantized experts of one MoE layer at a time, from an edge0 directory's extents as
    the kernel sees them: `read(layer, experts)` -> fp32 (gate_up [n, 2I, D], down [n, D, I])
    for the experts in the range (default all). A context manager over the open file."""

    def __init__(self, path: Path, manifest: modeldir.Manifest):
        self.path = path / EXPERTS_FILE
        self.layout = manifest.layout()
        self.table, self.extent_bytes, _ = read_table(self.path)
        if self.extent_bytes != self.layout.nbytes:
            raise ValueError(
                f"{self.path}: extent size {self.extent_bytes} != edge0.json {self.layout.nbytes}"
            )

    def __enter__(self) -> ExpertReader:
        self.file = open(self.path, "rb")  # noqa: SIM115 (closed by __exit__)
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def __call__(
        self, layer: int, experts: range | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.table:
            raise ValueError(f"{self.path}: no extents for layer {layer}")
        ext, size = self.table[layer], self.extent_bytes
        experts = range(ext.count) if experts is None else experts
        self.file.seek(ext.offset + experts.start * size)
        raw = torch.frombuffer(bytearray(self.file.read(len(experts) * size)), dtype=torch.uint8)
        w13s, w2s = [], []
        for e in range(len(experts)):
            buf = raw[e * size : (e + 1) * size].clone()
            self.layout.finalize(buf)
            w13, w2 = self.layout.dequantize(self.layout.views(buf))
            w13s.append(w13)
            w2s.append(w2)
        if not w13s:  # a rank past the last expert holds none of them
            i, d = self.layout.inter, self.layout.hidden
            return torch.empty(0, 2 * i, d), torch.empty(0, d, i)
        return torch.stack(w13s), torch.stack(w2s)


class DequantizedTensors:
    """The dequantized model's tensors one at a time, by state name and a range of rows of
    their first dimension: what one rank of a sharded student holds (train/distributed.py).
    Resident weights are read row-sliced from the safetensors file, int4 ones dequantized;
    routed experts are read and dequantized for the experts in the rows only. So host memory
    holds the rows asked for, never the whole model. A context manager over the open files;
    `source(name, rows)` -> fp32 (or the stored dtype) [rows, ...]."""

    def __init__(self, md: modeldir.ModelDir, model: torch.nn.Module):
        self.md = md
        self.layers = {f"{p}.{w}": i for i, p in expert_prefixes(model).items() for w in _EXPERT}
        md.manifest.check_file(md.resident.path)  # the checksum, as a whole load checks it

    def __enter__(self) -> DequantizedTensors:
        self.resident = safe_open(str(self.md.resident.path), framework="pt")
        self.experts = ExpertReader(self.md.path, self.md.manifest).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.experts.__exit__(*exc)

    def __call__(self, name: str, rows: range) -> torch.Tensor:
        if name in self.layers:
            w13, w2 = self.experts(self.layers[name], rows)
            return w13 if name.endswith(_EXPERT[0]) else w2
        path = name.removesuffix(".weight")
        keys = self.resident.keys()
        if name.endswith(".weight") and f"{path}.scales" in keys:
            part = slice(rows.start, rows.stop)
            words, scales, biases = (
                self.resident.get_slice(f"{path}.{k}")[part] for k in ("weight", "scales", "biases")
            )
            return int4.dequantize(words, scales, biases)
        if name not in keys:
            raise ValueError(f"{self.md.resident.path}: missing tensor {name!r}")
        t = self.resident.get_slice(name)
        return t[rows.start : rows.stop] if t.get_shape() else t[...]


_EXPERT = ("gate_up_proj", "down_proj")
