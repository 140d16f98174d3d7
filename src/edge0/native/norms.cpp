// edge0::rms_norm: layers.py RMSNorm of fp32 rows in one call, bit-identical to its ATen ops.
//
// The reference is `w * (x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))`: every step but
// the mean is elementwise, each result rounded to float once, which a loop compiled without
// contraction (-ffp-contract=off) reproduces exactly. The mean is ATen's cascade sum
// (aten/src/ATen/native/cpu/SumKernel.cpp, torch 2.13) divided by n, and a float sum's bits
// depend on the order of its additions. So `sum_squares` adds in the order that kernel adds a
// contiguous row: whole vectors of `lanes` floats, as a (-1, 4) array of vectors whose four
// columns accumulate through a cascade of 16-step levels, the leftover vectors into the first
// column, the columns together, then the leftover floats and the lanes one by one. Lanes are
// independent, so a plain loop over them adds what the vector instructions add. The width is
// the one thing that varies by CPU capability; Python finds it by comparing with ATen
// (native.sum_lanes) instead of assuming it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "norms.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kMaxLanes = 16;
constexpr int kLevels = 4;   // multi_row_sum's num_levels
constexpr int kColumns = 4;  // row_sum's ilp_factor

int64_t ceil_log2(int64_t x) {  // ATen's utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// A group of `lanes` accumulators, added lane by lane.
struct Lanes {
  float v[kMaxLanes];
};

// Element e of the row is the `width` floats at x + e * width, squared (width: the lanes of a
// vector, or 1 for the scalar loop). Adds element `e` into acc.
inline void add_squares(Lanes& acc, const float* x, int64_t e, int64_t width) {
  const float* p = x + e * width;
  for (int64_t l = 0; l < width; ++l) {
    const float sq = p[l] * p[l];
    acc.v[l] = acc.v[l] + sq;
  }
}

inline void add_into(Lanes& acc, const Lanes& other, int64_t width) {
  for (int64_t l = 0; l < width; ++l) acc.v[l] = acc.v[l] + other.v[l];
}

// ATen's row_sum over `count` elements: multi_row_sum of the (-1, 4) array, the leftover
// elements into column 0, then columns 1..3 into column 0.
Lanes row_sum(const float* x, int64_t count, int64_t width) {
  const int64_t size = count / kColumns;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  Lanes acc[kLevels][kColumns];
  std::memset(acc, 0, sizeof(acc));
  auto add_row = [&](int64_t i) {
    for (int64_t k = 0; k < kColumns; ++k) add_squares(acc[0][k], x, i * kColumns + k, width);
  };
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) add_row(i);
    for (int j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kColumns; ++k) {
        add_into(acc[j][k], acc[j - 1][k], width);
        std::memset(&acc[j - 1][k], 0, sizeof(Lanes));
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i) add_row(i);
  for (int j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kColumns; ++k) add_into(acc[0][k], acc[j][k], width);
  Lanes out = acc[0][0];
  for (int64_t e = size * kColumns; e < count; ++e) add_squares(out, x, e, width);
  for (int64_t k = 1; k < kColumns; ++k) add_into(out, acc[0][k], width);
  return out;
}

// sum(x[i]^2 for i < n) as ATen sums a contiguous row of n floats with `lanes`-wide vectors.
float sum_squares(const float* x, int64_t n, int64_t lanes) {
  float total = 0.0f;
  if (n >= lanes) {  // vectorized_inner_sum
    const int64_t vectors = n / lanes;
    const Lanes vec = row_sum(x, vectors, lanes);
    for (int64_t k = vectors * lanes; k < n; ++k) total = total + x[k] * x[k];
    for (int64_t l = 0; l < lanes; ++l) total = total + vec.v[l];
  } else {  // scalar_inner_sum
    total = row_sum(x, n, 1).v[0];
  }
  return 0.0f + total;  // the output starts at zero and accumulates the row's sum
}

}  // namespace

namespace edge0 {

void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n,
                   float eps, int64_t lanes, bool bf16) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = out + r * n;
    const float mean = sum_squares(xr, n, lanes) / static_cast<float>(n);
    const float inv = 1.0f / std::sqrt(mean + eps);
    for (int64_t d = 0; d < n; ++d) {
      const float y = round_to(xr[d] * inv, bf16);
      yr[d] = round_to(w[d] * y, bf16);
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "rms_norm takes fp32 or bf16 rows and a weight of their dtype");
  TORCH_CHECK(lanes >= 1 && lanes <= kMaxLanes, "lanes must be 1 to ", kMaxLanes);
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "weight must be [", n, "]");
  at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor wf = weight.to(at::kFloat).contiguous();
  if (xf.data_ptr() == x.data_ptr()) xf = xf.clone();  // the rows are normalised in place
  const int64_t rows = n ? xf.numel() / n : 0;
  rms_norm_rows(xf.data_ptr<float>(), wf.data_ptr<float>(), xf.data_ptr<float>(), rows, n,
                static_cast<float>(eps), lanes, dtype == at::kBFloat16);
  return xf.to(dtype);
}

}  // namespace edge0

TORCH_LIBRARY_FRAGMENT(edge0, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int lanes) -> Tensor");
}

TORCH_LIBRARY_IMPL(edge0, CPU, m) {
  m.impl("rms_norm", &edge0::rms_norm);
}
