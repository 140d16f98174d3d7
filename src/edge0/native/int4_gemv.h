// edge0::int4_gemv (int4_gemv.cpp), for the other native ops.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace edge0 {

// Added to a kernel path's code (`isa` below): its int8-activation kernel (int4_gemv.cpp, Path)
constexpr int64_t kInt8Flag = 16;

// Columns per (scale, zero) pair of an int4 row: quant.GROUP, the kernels' and the int4
// embedding's (TokenDecoder.embed)
constexpr int64_t kGroup = 64;

// y = x W^T as aten._weight_int4pack_mm_for_cpu(x.to(bf16), packed, 64, pairs).to(x.dtype)
// computes it, bit for bit, for each row of x [..., K] -> [..., N]. `layout`: the packed
// arrangement [block, interleaved, tail block, tail interleaved]; `isa`: 0 portable, 1 AVX2,
// 2 AVX-512, the path of torch's CPU capability.
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs,
                     at::IntArrayRef layout, int64_t isa);

// The same for several matrices that take the same x, in one parallel region.
std::vector<at::Tensor> int4_gemv_each(const at::Tensor& x, at::TensorList packed,
                                       at::TensorList pairs, at::IntArrayRef layout, int64_t isa);

// edge0::swiglu_int4_gemv: a decode token x [1, D] through its K experts (each expert's w13,
// p13, w2 and p2), for the other native ops -> [K, D] in x's dtype.
at::Tensor swiglu_experts(const at::Tensor& x, at::TensorList w13, at::TensorList p13,
                          at::TensorList w2, at::TensorList p2, at::IntArrayRef layout,
                          int64_t isa);

// edge0::swiglu_int4_rows: rows of x [T, D] through experts, expert e on the rows tokens[e]
// (int64 [n]) -> fp32 [R, D], the (expert, row) pairs in that order, each row what
// swiglu_experts computes for it alone, bit for bit.
at::Tensor swiglu_experts_rows(const at::Tensor& x, at::TensorList tokens, at::TensorList w13,
                               at::TensorList p13, at::TensorList w2, at::TensorList p2,
                               at::IntArrayRef layout, int64_t isa);

}  // namespace edge0
