// Float sums in ATen's order, and the norms built on them (norms.cpp), for the native ops.
//
// A float sum's bits depend on the order of its additions. These add in the order ATen's
// cascade sum (aten/src/ATen/native/cpu/SumKernel.cpp, torch 2.13) adds a contiguous row (an
// inner reduction) or the rows of a matrix (an outer one) with `lanes`-wide vectors: the values
// as a (-1, 4) array whose columns accumulate through a cascade of 16-step levels, leftovers
// into the first column, then the columns together. Vector lanes are independent, so a loop
// per lane adds what the vector instructions add. The width is the one thing that varies by
// CPU capability; sum_lanes in the engine finds it by comparing with ATen instead of assuming it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace edge0 {

constexpr int64_t kMaxLanes = 16;

// v rounded to bf16 (nearest even), as torch's conversion rounds it; NaN is kept.
inline float bf16_round(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return v;
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &u, 4);
  return v;
}

// Rounds a float result to the compute dtype's precision (bf16, or fp32 as it is).
inline float round_to(float v, bool bf16) { return bf16 ? bf16_round(v) : v; }

// A tensor's values as contiguous floats: the tensor itself if it is so already (to read),
// else a converted copy (without a dispatch where nothing needs converting).
inline at::Tensor floats(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_contiguous() ? t : t.to(at::kFloat).contiguous();
}

namespace sums {

constexpr int kLevels = 4;   // multi_row_sum's num_levels
constexpr int kColumns = 4;  // row_sum's ilp_factor

inline int64_t ceil_log2(int64_t x) {  // ATen's utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// multi_row_sum for one column: f(0..size-1) through a cascade of kLevels accumulators, each
// level taking the one below every 2^power values (power >= 4). Its columns share the level
// structure, so each can be computed alone.
template <class F>
float cascade(int64_t size, F f) {
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  float acc[kLevels] = {0.0f, 0.0f, 0.0f, 0.0f};
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) acc[0] = acc[0] + f(i);
    for (int j = 1; j < kLevels; ++j) {
      acc[j] = acc[j] + acc[j - 1];
      acc[j - 1] = 0.0f;
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i) acc[0] = acc[0] + f(i);
  for (int j = 1; j < kLevels; ++j) acc[0] = acc[0] + acc[j];
  return acc[0];
}

// row_sum: f(0..count-1) as a (-1, 4) array whose columns cascade, the leftover values into
// column 0, then columns 1..3 into column 0.
template <class F>
float row_sum(int64_t count, F f) {
  const int64_t size = count / kColumns;
  float part[kColumns];
  for (int64_t k = 0; k < kColumns; ++k)
    part[k] = cascade(size, [&](int64_t i) { return f(i * kColumns + k); });
  for (int64_t e = size * kColumns; e < count; ++e) part[0] = part[0] + f(e);
  for (int64_t k = 1; k < kColumns; ++k) part[0] = part[0] + part[k];
  return part[0];
}

}  // namespace sums

// sum(f(i) for i < n) as ATen sums a contiguous row of n floats.
template <class F>
float inner_sum(int64_t n, int64_t lanes, F f) {
  float total = 0.0f;
  if (n >= lanes) {  // vectorized_inner_sum: a row_sum of whole vectors, lane by lane
    const int64_t vectors = n / lanes;
    float vec[kMaxLanes];
    for (int64_t l = 0; l < lanes; ++l)
      vec[l] = sums::row_sum(vectors, [&](int64_t e) { return f(e * lanes + l); });
    for (int64_t k = vectors * lanes; k < n; ++k) total = total + f(k);
    for (int64_t l = 0; l < lanes; ++l) total = total + vec[l];
  } else {  // scalar_inner_sum
    total = sums::row_sum(n, f);
  }
  return 0.0f + total;  // the output starts at zero and accumulates the row's sum
}

// out[c] = sum over rows i < k of row i's values, for d columns side by side, in the order
// outer_sum's cascade adds each column (its level merges at the same rows): the additions
// column by column are those of every column at once, row after row, so each column's bits
// come out of vector loops. `row(i, acc)` adds row i's d values into acc[0..d) (and may do
// other work on that row as it goes: the delta rule updates its state row there).
template <class Row>
void cascade_rows(int64_t k, int64_t d, Row row, float* out) {
  const int64_t power = std::max<int64_t>(4, sums::ceil_log2(k) / sums::kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  std::vector<float> levels(sums::kLevels * d, 0.0f);
  float* acc[sums::kLevels];
  for (int j = 0; j < sums::kLevels; ++j) acc[j] = levels.data() + j * d;
  int64_t i = 0;
  while (i + step <= k) {
    for (const int64_t end = i + step; i < end; ++i) row(i, acc[0]);
    for (int j = 1; j < sums::kLevels; ++j) {
      for (int64_t c = 0; c < d; ++c) {
        acc[j][c] = acc[j][c] + acc[j - 1][c];
        acc[j - 1][c] = 0.0f;
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < k; ++i) row(i, acc[0]);
  for (int j = 1; j < sums::kLevels; ++j)
    for (int64_t c = 0; c < d; ++c) acc[0][c] = acc[0][c] + acc[j][c];
  for (int64_t c = 0; c < d; ++c) out[c] = 0.0f + acc[0][c];
}

// out[c] = sum(f(i, c) for i < k) for c < d, as ATen sums dim 0 of a [k, d] whose rows are
// contiguous: columns in runs of 4 vectors cascade down the rows; the columns after the last
// such run (whole vectors, then single floats) take row_sum's order.
template <class F>
void outer_sum(int64_t k, int64_t d, int64_t lanes, F f, float* out) {
  const int64_t cascaded = d / (4 * lanes) * (4 * lanes);
  int64_t c = 0;
  if (k < 16) {
    // fewer rows than a level's 16 steps: the cascade is one running sum from +0 (its other
    // levels stay +0, and adding +0 to a sum that started at +0 changes nothing), so the
    // columns can run side by side, row after row
    for (; c < cascaded; ++c) out[c] = 0.0f;
    for (int64_t i = 0; i < k; ++i)
#pragma GCC ivdep
      for (int64_t j = 0; j < cascaded; ++j) out[j] = out[j] + f(i, j);
  }
  if (c < cascaded) {
    cascade_rows(
        k, cascaded,
        [&](int64_t i, float* acc) {
#pragma GCC ivdep
          for (int64_t j = 0; j < cascaded; ++j) acc[j] = acc[j] + f(i, j);
        },
        out);
    c = cascaded;
  }
  for (; c < d; ++c) {
    auto column = [&](int64_t i) { return f(i, c); };
    out[c] = 0.0f + sums::row_sum(k, column);
  }
}

// out[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps)) for each row of n values, as layers.py
// RMSNorm computes it with ATen's ops: in fp32, the same rounding at every step and the mean's
// sum in ATen's order; with `bf16` (x, w and out hold bf16 values) the normalised rows and the
// product rounded to bf16, as the module's casts round them. x and out may be the same.
// With `zero_centred`, layers.py ZeroCenteredRMSNorm instead: (x * rsqrt(mean(x^2) + eps))
// * (1 + w) in fp32, rounded once.
void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n,
                   float eps, int64_t lanes, bool bf16, bool zero_centred = false);

// The same on an fp32 or bf16 tensor (weight of its dtype) -> a new tensor of its shape.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes);
at::Tensor rms_norm_as(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes,
                       bool zero_centred);

}  // namespace edge0
