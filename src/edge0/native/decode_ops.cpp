// Native decode ops: the ATen ops of a pure-PyTorch path, in the same order, in one call.
//
// edge0::attention_decode: one decode token of one sequence through a GQA attention layer
// (the reference: models/layers.py Attention.forward), see below. Its int4 projections go
// through edge0::int4_gemv (int4_gemv.cpp), which computes what torch's int4 kernel computes
// bit for bit; everything else is the reference's ATen ops. So the result is bit-identical to
// the reference; what the op saves is the Python and dispatch between the ops.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "int4_gemv.h"

#include <vector>

namespace {

// Projections as models/int4.py Int4Linear, nn.Linear and lora.py LoraLinear compute them.
// Each `p`: [packed, pairs] (int4) or [weight] (float), then [lora_A, lora_B] if it has an
// adapter, whose output is scaled by its `lora_scale`. The int4 ones take one parallel region.
bool dense(const at::Tensor& w) {
  const auto dtype = w.scalar_type();
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

std::vector<at::Tensor> project(const at::Tensor& x, const std::vector<at::TensorList>& ps,
                                at::ArrayRef<double> lora_scale, at::IntArrayRef layout,
                                int64_t isa) {
  std::vector<at::Tensor> ys(ps.size()), packed, pairs;
  std::vector<size_t> int4;
  for (size_t i = 0; i < ps.size(); ++i) {
    if (dense(ps[i][0])) {
      ys[i] = at::linear(x, ps[i][0]);
    } else {
      int4.push_back(i);
      packed.push_back(ps[i][0]);
      pairs.push_back(ps[i][1]);
    }
  }
  const auto outs = edge0::int4_gemv_each(x, packed, pairs, layout, isa);
  for (size_t j = 0; j < int4.size(); ++j) ys[int4[j]] = outs[j];
  for (size_t i = 0; i < ps.size(); ++i) {
    const size_t used = dense(ps[i][0]) ? 1 : 2;
    if (ps[i].size() > used) {
      const at::Tensor& a = ps[i][used];
      const at::Tensor& b = ps[i][used + 1];
      const at::Tensor delta = at::matmul(at::matmul(x.to(a.scalar_type()), a.t()), b.t());
      ys[i] = ys[i] + delta.to(ys[i].scalar_type()).mul(lora_scale[i]);
    }
  }
  return ys;
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
                            int64_t head_dim, double scale, at::IntArrayRef layout,
                            int64_t isa) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.size(1) == 1, "x must be [1, 1, D]");
  TORCH_CHECK(lora_scale.size() == 4, "one LoRA scale per projection");
  const auto qkv = project(x, {q_proj, k_proj, v_proj}, lora_scale.slice(0, 3), layout, isa);
  at::Tensor q = qkv[0].view({1, 1, heads, head_dim});
  at::Tensor k = qkv[1].view({1, 1, kv_heads, head_dim});
  at::Tensor v = qkv[2].view({1, 1, kv_heads, head_dim});
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
  return project(out.transpose(1, 2).reshape({1, 1, -1}), {o_proj}, lora_scale.slice(3), layout,
                 isa)[0];
}

}  // namespace

TORCH_LIBRARY(edge0, m) {
  m.def(
      "attention_decode(Tensor x, Tensor[] q_proj, Tensor[] k_proj, Tensor[] v_proj, "
      "Tensor[] o_proj, float[] lora_scale, Tensor? q_norm, Tensor? k_norm, float eps, "
      "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int n, int heads, "
      "int kv_heads, int head_dim, float scale, int[] layout, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(edge0, CPU, m) {
  m.impl("attention_decode", &attention_decode);
}
