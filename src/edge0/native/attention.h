// edge0's decode attention (attention.cpp), for the layer op.
#pragma once

#include <ATen/ATen.h>

namespace edge0 {

// One query per head, q fp32 [H, Dh], against positions 0..len-1 of caches [1, G, max, Dh]
// (fp32 or bf16), H a multiple of G (query head h reads kv head h / (H / G)), softmax of the
// scores times `scale`, into out fp32 [H, Dh]. `isa`: the int4 kernels' path code (0
// portable, 1 AVX2, 2 AVX-512); AVX-512 has its own compile, the others the portable one,
// and every path computes the same bits.
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      int64_t len, double scale, int64_t isa, at::Tensor& out);

}  // namespace edge0
