// edge0::rms_norm: layers.py RMSNorm of fp32 or bf16 rows in one call, bit-identical to its
// ATen ops.
//
// The reference is `w * (x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))`: every step but
// the mean is elementwise, each result rounded once, which a loop compiled without
// contraction (-ffp-contract=off) reproduces exactly. The mean is ATen's sum of the squares
// divided by n, added in ATen's order (norms.h).
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "norms.h"

#include <cmath>
#include <cstdint>

namespace edge0 {

void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n,
                   float eps, int64_t lanes, bool bf16, bool zero_centred) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = out + r * n;
    const float sum = inner_sum(n, lanes, [xr](int64_t i) { return xr[i] * xr[i]; });
    const float mean = sum / static_cast<float>(n);
    const float inv = 1.0f / std::sqrt(mean + eps);
    if (zero_centred) {
      for (int64_t d = 0; d < n; ++d) yr[d] = round_to((xr[d] * inv) * (1.0f + w[d]), bf16);
      continue;
    }
    for (int64_t d = 0; d < n; ++d) {
      const float y = round_to(xr[d] * inv, bf16);
      yr[d] = round_to(w[d] * y, bf16);
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes) {
  return rms_norm_as(x, weight, eps, lanes, false);
}

at::Tensor rms_norm_as(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes,
                       bool zero_centred) {
  RECORD_FUNCTION("edge0::rms_norm", std::vector<c10::IValue>());  // its own row in a profile
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "rms_norm takes fp32 or bf16 rows and a weight of their dtype");
  TORCH_CHECK(lanes >= 1 && lanes <= kMaxLanes, "lanes must be 1 to ", kMaxLanes);
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "weight must be [", n, "]");
  const int64_t rows = n ? x.numel() / n : 0;
  const at::Tensor xf = floats(x), wf = floats(weight);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  rms_norm_rows(xf.data_ptr<float>(), wf.data_ptr<float>(), out.data_ptr<float>(), rows, n,
                static_cast<float>(eps), lanes, dtype == at::kBFloat16, zero_centred);
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace edge0

TORCH_LIBRARY_FRAGMENT(edge0, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int lanes) -> Tensor");
}

TORCH_LIBRARY_IMPL(edge0, CPU, m) {
  m.impl("rms_norm", &edge0::rms_norm);
}
