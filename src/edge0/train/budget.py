"""What phases 2 and 3 need in memory, from a model's shapes alone (`edge0 inspect --train`).

Two students (train/student.py) and three teachers:

  int4 student (CPU)      the resident floor as served (int4 projections, float norms and
                          routers at fp32), an expert pool of at least one layer's experts
                          (less works, in more reads), the LoRA with its gradient and AdamW's
                          two moments, each decoder layer's input kept for checkpointing, one
                          layer recomputed with its backward, and the logits with their
                          log-softmax and gradient
  dequantized student     every weight in fp32, experts included, and every layer's
                          activations (no checkpointing): the GPU path
  teacher                 none (a teacher cache: ~(8 + 6k) bytes a position on disk), edge0's
                          (its floor plus two layers' experts), or a Hugging Face one in bf16

Estimates, not measurements: activations count the large tensors (hidden states, attention
scores, routed outputs, logits) at fp32; a recurrent layer's scan is counted as attention's
scores would be. docs/training.md sets them beside cgroup-measured peaks.
Shape legend: B rows per forward, T tokens per row, D hidden, V vocabulary, K active experts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from edge0.engine.plan import ModelSizes

FP32 = 4
HIDDEN_COPIES = 8  # hidden-sized fp32 tensors one layer's forward and backward hold at once


@dataclass(frozen=True)
class Shapes:
    """What the estimate needs besides ModelSizes."""

    layers: int  # decoder layers
    vocab: int
    params: int  # every weight the dequantized model holds (experts included)
    lora_params: int  # trainable parameters (the LoRA at the trained rank)


@dataclass(frozen=True)
class TrainingMemory:
    rows: int
    length: int
    runtime: int  # the process before any weight: Python, torch, the tokenizer
    int4_floor: int
    int4_pool_min: int
    trainable: int  # LoRA + gradient + AdamW moments
    checkpoints: int
    layer_work: int
    logits: int
    dequantized_weights: int
    dequantized_activations: int
    edge0_teacher: int
    hf_teacher_bf16: int
    cache_bytes_per_position: int

    @property
    def int4_student(self) -> int:
        return (
            self.runtime
            + self.int4_floor
            + self.int4_pool_min
            + self.trainable
            + self.checkpoints
            + self.layer_work
            + self.logits
        )

    @property
    def dequantized_student(self) -> int:
        return (
            self.runtime + self.dequantized_weights + self.trainable + self.dequantized_activations
        )

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "int4_student": self.int4_student,
            "dequantized_student": self.dequantized_student,
        }


def estimate(
    sizes: ModelSizes,
    shapes: Shapes,
    rows: int,
    length: int,
    k: int,
    runtime: int = 0,
    topk: int = 32,
) -> TrainingMemory:
    """The memory of a training step of `rows` sequences of `length` tokens at K = k, in a
    process that holds `runtime` bytes before any weight."""
    d, tokens = sizes.hidden_size, rows * length
    hidden = tokens * d * FP32
    # one layer: its hidden-sized tensors, attention scores and their gradient, the routed
    # outputs with their gradient and weights, and one expert dequantized for the backward
    layer = (
        hidden * HIDDEN_COPIES
        + 2 * sizes.heads * rows * length * length * FP32
        + 3 * tokens * k * d * FP32
        + 2 * sizes.extent_bytes * 8
    )
    two_layers = 2 * sizes.experts_per_layer * sizes.extent_bytes
    return TrainingMemory(
        rows=rows,
        length=length,
        runtime=runtime,
        int4_floor=sizes.resident_params * FP32 + sizes.int4_bytes,
        int4_pool_min=sizes.experts_per_layer * sizes.extent_bytes,
        trainable=shapes.lora_params * FP32 * 4,
        checkpoints=shapes.layers * hidden,
        layer_work=layer,
        logits=3 * tokens * shapes.vocab * FP32,
        dequantized_weights=shapes.params * FP32,
        dequantized_activations=shapes.layers * layer + 3 * tokens * shapes.vocab * FP32,
        edge0_teacher=sizes.resident_params * FP32 + sizes.int4_bytes + two_layers,
        hf_teacher_bf16=shapes.params * 2,
        cache_bytes_per_position=topk * (4 + 2) + 4 + 4,  # ids, log-probs, tail, the token
    )
