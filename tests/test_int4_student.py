"""The int4 student of phases 2 and 3 (train/int4_base.py): the served base, differentiable in
its inputs, against the dequantized student and against autograd."""

from __future__ import annotations

import pytest
import torch

from edge0 import builtin, modeldir
from edge0.engine.options import EngineOptions
from edge0.formats.int4_layout import host_layout
from edge0.models.experts import swiglu_dense
from edge0.models.int4 import Int4Linear, quantize
from edge0.train.int4_base import swiglu_input_grad
from edge0.train.sft import continuation_loss
from edge0.train.student import load_student, lora_parameters


def test_the_experts_input_gradient_is_autograds():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=g, dtype=torch.float64, requires_grad=True)
    w13 = torch.randn(2 * 32, 64, generator=g, dtype=torch.float64)
    w2 = torch.randn(64, 32, generator=g, dtype=torch.float64)
    dy = torch.randn(7, 64, generator=g, dtype=torch.float64)
    (want,) = torch.autograd.grad(swiglu_dense(x, w13, w2), x, dy)
    torch.testing.assert_close(swiglu_input_grad(x.detach(), w13, w2, dy), want)


def test_an_int4_projection_passes_the_gradient_of_its_dequantized_weight():
    g = torch.Generator().manual_seed(0)
    lin = Int4Linear(*quantize(torch.randn(64, 128, generator=g)), host_layout())
    x = torch.randn(5, 128, generator=g, requires_grad=True)
    dy = torch.randn(5, 64, generator=g)
    (got,) = torch.autograd.grad(lin(x), x, dy)
    torch.testing.assert_close(got, dy @ lin.dequantized())
    with torch.no_grad():  # serving is untouched: the kernel's product, no graph
        assert torch.equal(lin(x), lin.product(x).float())


def loss_and_grads(base: str, tokens: torch.Tensor, **kw):
    checkpoint = kw.pop("checkpoint", None)
    student = load_student(builtin.model_dir(), new_lora=(8, 16.0), seed=0, base=base, **kw)
    try:
        if checkpoint is not None:
            student.checkpoint = checkpoint
        params = lora_parameters(student.model)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # a trained-looking adapter: B = 0 would pass no gradient to A
            for p in params:
                p.add_(0.02 * torch.randn(p.shape, generator=g))
        loss = continuation_loss(student.forward(tokens, 16), tokens, 16)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in params])
    finally:
        student.close()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 8000, (3, 48), generator=torch.Generator().manual_seed(2))


def test_the_int4_student_trains_what_the_dequantized_one_does(tokens):
    """Same loss and LoRA gradients up to the int4 kernels' bf16 activations."""
    loss_d, grad_d = loss_and_grads("dequantized", tokens)
    loss_i, grad_i = loss_and_grads("int4", tokens)
    assert abs(loss_i - loss_d) / loss_d < 1e-3
    assert (grad_i - grad_d).norm() / grad_d.norm() < 1e-2


def test_checkpointing_and_a_small_pool_change_no_bit_of_the_gradient(tokens):
    """Recomputing each layer and reading the experts in several waves through a pool of
    a few slots give the same loss and gradients as keeping everything."""
    loss_a, grad_a = loss_and_grads("int4", tokens, checkpoint=False)
    small = EngineOptions(expert_cache=12 * 57344)  # 12 of the 8 x 32 experts
    loss_b, grad_b = loss_and_grads("int4", tokens, options=small)
    assert loss_a == loss_b
    assert torch.equal(grad_a, grad_b)


def test_an_edge0_teacher_is_its_model_at_native_k_through_a_two_layer_pool(tokens):
    """`--teacher` may be an edge0 directory: served by edge0 (its routers, native K, int4
    experts through a pool of two layers' experts), it scores as its dequantized model does
    up to the int4 kernels' bf16 activations."""
    from edge0.modeldir import loader
    from edge0.train.student import EngineTeacher, load_teacher

    experts = modeldir.Manifest.load(builtin.model_dir()).experts
    two_layers = 2 * experts["num_experts"] * experts["extent_bytes"]
    teacher = EngineTeacher(builtin.model_dir(), rows=3, length=48, expert_cache=two_layers)
    try:
        assert not teacher.engine.plan.holds_every_expert
        got = teacher(tokens)
    finally:
        teacher.close()
    # by default, as serving: every expert where they fit a quarter of the free memory
    default = load_teacher(builtin.model_dir(), rows=3, length=48)
    try:
        assert isinstance(default, EngineTeacher) and default.engine.plan.holds_every_expert
        assert torch.equal(default(tokens), got)
    finally:
        default.close()
    manifest, model = loader.load_edge0_model(builtin.model_dir(), experts="dequantized")
    model.set_top_k(manifest.native_top_k)
    with torch.no_grad():
        want = model(tokens)
    logp, logq = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    assert kl < 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.97


def test_inspect_estimates_training_memory_from_the_shapes():
    """`edge0 inspect --train ROWS LENGTH RANK`: the parts add up, the LoRA is the one
    training attaches, the logits and the dequantized weights are what those shapes hold."""
    from edge0.cli.inspect import inspect_dir

    report = inspect_dir(builtin.model_dir(), train=(8, 256, 16))
    t = report.memory["training"]
    parts = ("runtime", "int4_floor", "int4_pool_min", "trainable", "checkpoints")
    parts += ("layer_work", "logits")
    assert t["int4_student"] == sum(t[p] for p in parts)
    student = load_student(builtin.model_dir(), new_lora=(16, 32.0), base="dequantized")
    lora_params = sum(p.numel() for p in lora_parameters(student.model))
    weights = sum(p.numel() for n, p in student.model.named_parameters() if ".lora_" not in n)
    assert t["trainable"] == lora_params * 4 * 4  # fp32 weight, gradient, AdamW's two moments
    assert t["dequantized_weights"] == weights * 4
    assert t["logits"] == 3 * 8 * 256 * student.model.config.vocab_size * 4
    assert t["checkpoints"] == 8 * 8 * 256 * student.model.config.hidden_size * 4
    assert t["int4_student"] < t["dequantized_student"]


def test_a_wide_projection_passes_its_gradient_a_block_of_rows_at_a_time(monkeypatch):
    """The backward dequantizes BACKWARD_ROWS output rows at a time (a 248k-token lm_head
    whole would be 1.9 GiB): the same gradient as the whole matrix, across a tail block."""
    from edge0.models import int4

    monkeypatch.setattr(int4, "BACKWARD_ROWS", 64)
    g = torch.Generator().manual_seed(3)
    lin = Int4Linear(*quantize(torch.randn(64 * 5 + 32, 128, generator=g)), host_layout())
    x = torch.randn(4, 128, generator=g, requires_grad=True)
    dy = torch.randn(4, 64 * 5 + 32, generator=g)
    (got,) = torch.autograd.grad(lin(x), x, dy)
    # against float64: a block-wise sum adds in another order than one matmul, so each
    # element is held to fp32's rounding of its 352 products (1e-5 of their magnitudes' sum),
    # not to another fp32 order's bits (which differ by CPU: 1.5e-5 on an AMD EPYC)
    w = lin.dequantized().double()
    want = dy.double() @ w
    bound = 1e-5 * (dy.double().abs() @ w.abs())
    assert ((got.double() - want).abs() <= bound).all()
    torch.testing.assert_close(
        lin.dequantized_rows(128, 64 * 3 + 32), lin.dequantized()[128:], rtol=0, atol=0
    )
