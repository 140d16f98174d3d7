// edge0::rms_norm and the float loops around it (norms.cpp), for the other native ops.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace edge0 {

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

// out[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps)) for each row of n values, as layers.py
// RMSNorm computes it with ATen's ops: in fp32, the same rounding at every step, the mean's sum
// in the order ATen's reduction adds `lanes`-wide vectors (its vector width for floats here;
// native.sum_lanes() finds it); with `bf16` (x, w and out hold bf16 values) the normalised
// rows and the product rounded to bf16, as the module's casts round them. x and out may be the
// same.
void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n,
                   float eps, int64_t lanes, bool bf16);

// The same on an fp32 or bf16 tensor (weight of its dtype) -> a new tensor of its shape.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes);

}  // namespace edge0
