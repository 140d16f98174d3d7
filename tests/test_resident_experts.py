"""ResidentExperts' grouped GEMM against the per-expert loop: same outputs, same gradients."""

from __future__ import annotations

import pytest
import torch

from edge0.models.experts import ResidentExperts, for_each_expert, swiglu_dense


def reference(experts: ResidentExperts, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    w13, w2 = experts.gate_up_proj, experts.down_proj
    return for_each_expert(x, indices, lambda e, xs: swiglu_dense(xs, w13[e], w2[e]))


@pytest.mark.parametrize("tokens", [1, 5, 96])
def test_grouped_matches_per_expert_loop(tokens):
    torch.manual_seed(0)
    num_experts, hidden, inter, k = 8, 64, 32, 3
    experts = ResidentExperts(num_experts, hidden, inter)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
    x = torch.randn(tokens, hidden, requires_grad=True)
    # expert 7 never chosen: an empty group must neither fail nor receive a gradient
    indices = torch.stack([torch.randperm(num_experts - 1)[:k] for _ in range(tokens)])
    grad_out = torch.randn(tokens, k, hidden)

    got = experts(x, indices)
    got.backward(grad_out)
    got_grads = [x.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
    x.grad = experts.gate_up_proj.grad = experts.down_proj.grad = None
    ref = reference(experts, x, indices)
    ref.backward(grad_out)
    ref_grads = [x.grad, experts.gate_up_proj.grad, experts.down_proj.grad]

    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    assert experts.gate_up_proj.grad[num_experts - 1].abs().max() == 0


def test_unaligned_widths_fall_back_to_the_loop():
    # 30 fp32 columns = 120 bytes: not a 16-byte row stride, which torch's grouped GEMM refuses
    torch.manual_seed(1)
    experts = ResidentExperts(4, 30, 6)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
    x = torch.randn(7, 30)
    indices = torch.randint(0, 4, (7, 2))
    torch.testing.assert_close(experts(x, indices), reference(experts, x, indices))


@pytest.mark.parametrize("hidden", [64, 30])  # the grouped GEMM, and the per-expert loop
def test_the_input_gradient_repeats_bit_for_bit_on_two_threads(hidden):
    """A token's gradient sums over its K slots. Summed through a scatter-add, two threads
    add in whatever order they run, and a seeded training run does not repeat its own
    bits from one process to the next."""
    torch.set_num_threads(2)  # conftest restores the count
    torch.manual_seed(2)
    experts = ResidentExperts(8, hidden, 32)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
    x = torch.randn(1024, hidden, requires_grad=True)
    indices = torch.stack([torch.randperm(8)[:4] for _ in range(1024)])
    grad_out = torch.randn(1024, 4, hidden)
    grads = []
    for _ in range(4):
        x.grad = None
        experts(x, indices).backward(grad_out)
        grads.append(x.grad.clone())
    assert all(torch.equal(g, grads[0]) for g in grads[1:])
