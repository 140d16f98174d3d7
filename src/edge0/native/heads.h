// edge0::prerouter_head (heads.cpp), for the other native ops.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace edge0 {

// A prerouter head on decode rows: h [B, D] (fp32 or bf16), executed [B, K] and previous
// [B, K'] (int64; negative: none), and the head's fp16 parts w1 [W, D], w1_hot [2E, W],
// w2 [E, W], w0 [E, D], w0_hot [2E, E] -> [logits fp32 [B, E]], and with stage > 0 also
// [chosen int64 [B, stage] ascending, allowed bool [B, E]].
std::vector<at::Tensor> prerouter_head(const at::Tensor& h, const at::Tensor& executed,
                                       const at::Tensor& previous, const at::Tensor& w1,
                                       const at::Tensor& w1_hot, const at::Tensor& w2,
                                       const at::Tensor& w0, const at::Tensor& w0_hot,
                                       int64_t stage, int64_t isa);

}  // namespace edge0
