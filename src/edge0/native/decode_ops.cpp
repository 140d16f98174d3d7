// Native decode ops: the ATen ops of a pure-PyTorch path, in the same order, in one call.
//
// Each op runs exactly the ops of its reference path, so its result is bit-identical to it.
// What it saves is the Python and dispatch between those ops. It calls only ATen ops, so ATen
// picks the int4 kernel for the CPU it runs on (ATEN_CPU_CAPABILITY included) and this file
// needs no ISA-specific flags.
//
// edge0::swiglu_int4_experts: one decode token through K int4 experts (the reference:
// streaming/executors.py swiglu_int4, once per expert, then a stack). Shapes: x [1, D]; per
// expert e: w13[e] and w2[e] packed int4, p13[e] and p2[e] their (scale, zero) pairs;
// returns [K, D] in x's dtype.
//
// edge0::attention_decode: one decode token of one sequence through a GQA attention layer
// (the reference: models/layers.py Attention.forward), see below.
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

// One projection as models/int4.py Int4Linear, nn.Linear and lora.py LoraLinear compute it.
// `p`: [packed, pairs] (int4) or [weight] (float), then [lora_A, lora_B] if it has an adapter,
// whose output is scaled by `lora_scale`.
at::Tensor project(const at::Tensor& x, at::TensorList p, double lora_scale) {
  at::Tensor y;
  size_t used;
  if (p[0].scalar_type() == at::kFloat || p[0].scalar_type() == at::kBFloat16 ||
      p[0].scalar_type() == at::kHalf) {
    y = at::linear(x, p[0]);
    used = 1;
  } else {
    const int64_t out = p[1].size(1), in = x.size(-1);
    const at::Tensor flat = x.reshape({-1, in});
    y = at::_weight_int4pack_mm_for_cpu(flat.to(at::kBFloat16), p[0], kGroup, p[1])
            .to(x.scalar_type());
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(out);
    y = y.view(shape);
    used = 2;
  }
  if (p.size() > used) {
    const at::Tensor& a = p[used];
    const at::Tensor& b = p[used + 1];
    const at::Tensor delta = at::matmul(at::matmul(x.to(a.scalar_type()), a.t()), b.t());
    y = y + delta.to(y.scalar_type()).mul(lora_scale);
  }
  return y;
}

// layers.py RMSNorm
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto dtype = x.scalar_type();
  at::Tensor xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  return weight * xf.to(dtype);
}

// layers.py apply_rotary over every channel: x * cos + rotate_half(x) * sin
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto halves = x.chunk(2, -1);
  const at::Tensor rotated = at::cat({-halves[1], halves[0]}, -1);
  return x * cos + rotated * sin;
}

// edge0::attention_decode: layers.py Attention.forward for one token of one sequence, with
// q/k RMSNorm per head or none, full rotary, no window, clip, gate or bias: the same ops in
// the same order. Writes the token's key and value at position n of the cache buffers
// [1, G, max, Dh] and attends over positions 0..n. x [1, 1, D] -> [1, 1, D].
at::Tensor attention_decode(const at::Tensor& x, at::TensorList q_proj, at::TensorList k_proj,
                            at::TensorList v_proj, at::TensorList o_proj,
                            at::ArrayRef<double> lora_scale,
                            const std::optional<at::Tensor>& q_norm,
                            const std::optional<at::Tensor>& k_norm, double eps,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                            at::Tensor v_cache, int64_t n, int64_t heads, int64_t kv_heads,
                            int64_t head_dim, double scale) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.size(1) == 1, "x must be [1, 1, D]");
  TORCH_CHECK(lora_scale.size() == 4, "one LoRA scale per projection");
  at::Tensor q = project(x, q_proj, lora_scale[0]).view({1, 1, heads, head_dim});
  at::Tensor k = project(x, k_proj, lora_scale[1]).view({1, 1, kv_heads, head_dim});
  at::Tensor v = project(x, v_proj, lora_scale[2]).view({1, 1, kv_heads, head_dim});
  if (q_norm.has_value()) {
    q = rms_norm(q, *q_norm, eps);
    k = rms_norm(k, *k_norm, eps);
  }
  q = rotary(q.transpose(1, 2), cos, sin);
  k = rotary(k.transpose(1, 2), cos, sin);
  v = v.transpose(1, 2);
  k_cache.narrow(2, n, 1).copy_(k);
  v_cache.narrow(2, n, 1).copy_(v);
  const at::Tensor out = at::scaled_dot_product_attention(
      q, k_cache.narrow(2, 0, n + 1), v_cache.narrow(2, 0, n + 1), std::nullopt, 0.0, false,
      scale, kv_heads != heads);
  return project(out.transpose(1, 2).reshape({1, 1, -1}), o_proj, lora_scale[3]);
}

}  // namespace

TORCH_LIBRARY(edge0, m) {
  m.def(
      "swiglu_int4_experts(Tensor x, Tensor[] w13, Tensor[] p13, Tensor[] w2, Tensor[] p2)"
      " -> Tensor");
  m.def(
      "attention_decode(Tensor x, Tensor[] q_proj, Tensor[] k_proj, Tensor[] v_proj, "
      "Tensor[] o_proj, float[] lora_scale, Tensor? q_norm, Tensor? k_norm, float eps, "
      "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int n, int heads, "
      "int kv_heads, int head_dim, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(edge0, CPU, m) {
  m.impl("swiglu_int4_experts", &swiglu_int4_experts);
  m.impl("attention_decode", &attention_decode);
}
