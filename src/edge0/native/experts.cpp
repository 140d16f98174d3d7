// edge0::swiglu_int4_experts: one decode token through K int4 experts in one call.
//
// It runs exactly the ops of the reference path (streaming/executors.py swiglu_int4, once
// per expert, then a stack), in the same order, so its result is bit-identical to it. What
// it saves is the Python and dispatch between those ops: ~16 Python-level calls per expert.
// It calls only ATen ops, so ATen picks the int4 kernel for the CPU it runs on
// (ATEN_CPU_CAPABILITY included) and this file needs no ISA-specific flags.
//
// Shapes: x [1, D]; per expert e: w13[e] and w2[e] packed int4, p13[e] and p2[e] their
// (scale, zero) pairs; returns [K, D] in x's dtype.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

namespace {

constexpr int64_t kGroup = 64;  // quant.GROUP

at::Tensor swiglu_int4_experts(const at::Tensor& x, at::TensorList w13, at::TensorList p13,
                               at::TensorList w2, at::TensorList p2) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "x must be [1, D], got ", x.sizes());
  const auto k = w13.size();
  TORCH_CHECK(p13.size() == k && w2.size() == k && p2.size() == k,
              "one w13, p13, w2 and p2 per expert");
  const at::Tensor xb = x.to(at::kBFloat16);  // the kernel is ~10x slower on fp32 input
  std::vector<at::Tensor> ys;
  ys.reserve(k);
  for (size_t e = 0; e < k; ++e) {
    const auto gate_up =
        at::_weight_int4pack_mm_for_cpu(xb, w13[e], kGroup, p13[e]).to(at::kFloat).chunk(2, -1);
    const at::Tensor h = (at::silu(gate_up[0]) * gate_up[1]).to(at::kBFloat16);
    ys.push_back(at::_weight_int4pack_mm_for_cpu(h, w2[e], kGroup, p2[e])
                     .to(at::kFloat)
                     .squeeze(0)
                     .to(x.scalar_type()));
  }
  return at::stack(ys);
}

}  // namespace

TORCH_LIBRARY(edge0, m) {
  m.def(
      "swiglu_int4_experts(Tensor x, Tensor[] w13, Tensor[] p13, Tensor[] w2, Tensor[] p2)"
      " -> Tensor");
}

TORCH_LIBRARY_IMPL(edge0, CPU, m) { m.impl("swiglu_int4_experts", &swiglu_int4_experts); }
