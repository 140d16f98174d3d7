// edge0's decode attention: one query per head against a cache's positions 0..len-1, GQA, read
// in the cache's own dtype (fp32, or bf16 under fp32 or bf16 compute).
//
// At a long context ATen's SDPA is slow for one query: the layer op first widened a bf16
// cache to fp32 (a copy of the whole cache, every layer, every token), then the flash
// kernel went over each query head's group separately in blocks sized for many queries.
// On the bench shape (16 heads, 4 kv heads, Dh 64) a decode step took 39 ms at 4,096
// positions against 15 ms at 64, most of it there (docs/kernels.md). Here each kv head's
// keys and values are read once, for all the query heads that share them, straight from the
// cache.
//
// Its sums are its own, not SDPA's (whose products are BLAS calls, which no loop of ours can
// match), so it is used from a context length on where it pays (kNativeAttentionFrom in
// decode_ops.cpp) and states a tolerance against SDPA (tests/test_native_attention.py). They
// are the same on every CPU and path: each dot product and each sum over positions goes
// through 16 lanes in a fixed order with no fused operations, the exponential is a
// polynomial of our own, and the AVX-512 and portable functions are one body compiled
// twice.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "attention.h"
#include "norms.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;
constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kBlock = 64;  // positions summed apart before they are added up

// 16 floats as one value: GCC lowers each operation to the target's vectors (one AVX-512
// register, two AVX2 ones, four SSE ones), lane by lane, so every path computes the same.
typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));

__attribute__((always_inline)) inline f16v load(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

__attribute__((always_inline)) inline void store(float* p, f16v v) { std::memcpy(p, &v, sizeof v); }

// 16 bf16 values widened to floats (exact).
__attribute__((always_inline)) inline f16v load_bf16(const uint16_t* p) {
  h16v h;
  std::memcpy(&h, p, sizeof h);
  const u16v u = __builtin_convertvector(h, u16v) << 16;
  f16v v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

__attribute__((always_inline)) inline f16v splat(float x) { return f16v{} + x; }

// exp(x) for x <= 0, lane by lane, the same bits on every path: x = n ln2 + r (|r| <= ~ln2/2,
// ln2 in two parts), e^r by its Taylor polynomial to degree 7 (relative error ~1e-8 there),
// times 2^n. Below -87 it is 0 (a softmax weight under 1e-38 of the largest).
__attribute__((always_inline)) inline f16v exp_nonpositive(f16v x) {
  const i16v low = x < -87.0f;
  x = low ? splat(-87.0f) : x;
  const f16v t = x * 1.44269504088896341f - 0.5f;  // <= -0.5: truncation rounds to nearest
  const i16v n = __builtin_convertvector(t, i16v);
  const f16v nf = __builtin_convertvector(n, f16v);
  f16v r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  f16v p = splat(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const i16v bits = (n + 127) << 23;
  f16v scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return low ? f16v{} : p * scale;
}

// The lanes' sum, in a fixed tree: lanes l and l + 8, then l and l + 4, l + 2, l + 1.
typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));
typedef float f2v __attribute__((vector_size(8)));
__attribute__((always_inline)) inline float tree_sum(f16v v) {
  const f8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f2v c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
}

// Row j of a cache as floats, 16 at a time: bf16 widened into `buf`, fp32 as it is.
__attribute__((always_inline)) inline const float* row_floats(const void* base, bool bf16, int64_t j, int64_t dh, float* buf) {
  if (!bf16) return static_cast<const float*>(base) + j * dh;
  const uint16_t* src = static_cast<const uint16_t*>(base) + j * dh;
  for (int64_t c = 0; c < dh; c += kLanes) store(buf + c, load_bf16(src + c));
  return buf;
}

struct Group {
  const float* q;  // [rep, dh], this kv head's query heads
  const void* k;   // [len, dh] rows of this kv head, in the cache's dtype
  const void* v;
  bool bf16;
  int64_t rep, len, dh;
  float scale;
  float* out;  // [rep, dh]
};

// One kv head's query heads: scores, softmax, weighted sum of values, in that order.
// C: a head's 16-float chunks (Dh / 16), fixed where it is 4 or 8 so that the loops unroll.
template <int64_t C>
__attribute__((always_inline)) inline void attend_group(const Group& g) {
  const int64_t rep = g.rep, len = g.len, dh = C ? C * kLanes : g.dh;
  std::vector<float> s(rep * len + kLanes);  // each head's scores, then its weights
  alignas(64) float row[kMaxHeadDim];
  for (int64_t j = 0; j < len; ++j) {
    const float* k = row_floats(g.k, g.bf16, j, dh, row);
    for (int64_t r = 0; r < rep; ++r) {
      const float* q = g.q + r * dh;
      f16v acc{};
      for (int64_t c = 0; c < dh; c += kLanes) acc = acc + load(q + c) * load(k + c);
      s[r * len + j] = tree_sum(acc) * g.scale;
    }
  }
  std::vector<float> total(rep);
  for (int64_t r = 0; r < rep; ++r) {
    float* sr = s.data() + r * len;
    float m = sr[0];
    for (int64_t j = 1; j < len; ++j) m = sr[j] > m ? sr[j] : m;
    f16v acc{};
    int64_t j = 0;
    for (; j + kLanes <= len; j += kLanes) {
      const f16v p = exp_nonpositive(load(sr + j) - m);
      store(sr + j, p);
      acc = acc + p;
    }
    if (j < len) {  // the tail, in the lanes its positions fall in (the rest add zeros)
      alignas(64) float tail[kLanes];
      for (int l = 0; l < kLanes; ++l) tail[l] = j + l < len ? sr[j + l] - m : -100.0f;
      const f16v p = exp_nonpositive(load(tail));
      store(tail, p);
      for (int64_t l = 0; j + l < len; ++l) sr[j + l] = tail[l];
      acc = acc + p;
    }
    total[r] = tree_sum(acc);
  }
  // the weighted values summed per block of kBlock positions, then the blocks in order: the
  // rounding error grows with len / kBlock + kBlock instead of len
  std::vector<float> part(rep * dh);
  for (int64_t i = 0; i < rep * dh; ++i) g.out[i] = 0.0f;
  for (int64_t j0 = 0; j0 < len; j0 += kBlock) {
    for (int64_t i = 0; i < rep * dh; ++i) part[i] = 0.0f;
    for (int64_t j = j0; j < len && j < j0 + kBlock; ++j) {
      const float* v = row_floats(g.v, g.bf16, j, dh, row);
      for (int64_t r = 0; r < rep; ++r) {
        const f16v p = splat(s[r * len + j]);
        float* o = part.data() + r * dh;
        for (int64_t c = 0; c < dh; c += kLanes) store(o + c, load(o + c) + p * load(v + c));
      }
    }
    for (int64_t i = 0; i < rep * dh; ++i) g.out[i] = g.out[i] + part[i];
  }
  for (int64_t r = 0; r < rep; ++r)
    for (int64_t d = 0; d < dh; ++d) g.out[r * dh + d] = g.out[r * dh + d] / total[r];
}

__attribute__((always_inline)) inline void attend_any(const Group& g) {
  if (g.dh == 4 * kLanes) return attend_group<4>(g);
  if (g.dh == 8 * kLanes) return attend_group<8>(g);
  attend_group<0>(g);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void attend_avx512(const Group& g) {
  attend_any(g);
}
// No AVX2 body: compiled for AVX2, the same loops ran 2.0-2.5x slower than the baseline (SSE)
// compile on an AVX-512 Xeon, so AVX2 CPUs take the portable one (the same bits either way).
void attend_portable(const Group& g) { attend_any(g); }

bool runs_here(int64_t isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == 2) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (isa == 1) return __builtin_cpu_supports("avx2");
#endif
  return isa == 0;
}

// edge0::decode_attention, the op for tests: q [H, Dh] (fp32) over positions 0..len-1 of
// caches [1, G, max, Dh] -> fp32 [H, Dh].
at::Tensor decode_attention_op(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, int64_t len, double scale,
                               int64_t isa) {
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  edge0::decode_attention(edge0::floats(q), k_cache, v_cache, len, scale, isa, out);
  return out;
}

}  // namespace

namespace edge0 {

void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      int64_t len, double scale, int64_t isa, at::Tensor& out) {
  RECORD_FUNCTION("edge0::decode_attention", std::vector<c10::IValue>());
  TORCH_CHECK(isa >= 0 && isa <= 2 && runs_here(isa), "this CPU cannot run attention path ", isa);
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && v_cache.scalar_type() == dtype,
              "the caches must be fp32 or bf16, both alike");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.size(0) == 1 && v_cache.sizes() == k_cache.sizes(),
              "the caches must be contiguous [1, G, max, Dh]");
  const int64_t kv_heads = k_cache.size(1), max = k_cache.size(2), dh = k_cache.size(3);
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 2 &&
                  q.size(1) == dh && q.size(0) % kv_heads == 0,
              "q must be contiguous fp32 [H, Dh], H a multiple of the kv heads");
  TORCH_CHECK(dh % kLanes == 0 && dh <= kMaxHeadDim, "the head dim must be a multiple of ",
              kLanes, " up to ", kMaxHeadDim);
  TORCH_CHECK(len >= 1 && len <= max, "attending to ", len, " of ", max, " positions");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == q.sizes(),
              "out must be contiguous fp32 like q");
  const int64_t rep = q.size(0) / kv_heads;
  const bool bf16 = dtype == at::kBFloat16;
  const size_t item = bf16 ? 2 : 4;
  const char* kp = static_cast<const char*>(k_cache.data_ptr());
  const char* vp = static_cast<const char*>(v_cache.data_ptr());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto run = isa == 2 ? attend_avx512 : attend_portable;
  at::parallel_for(0, kv_heads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; ++g) {
      const size_t at = static_cast<size_t>(g * max * dh) * item;
      run({qp + g * rep * dh, kp + at, vp + at, bf16, rep, len, dh, static_cast<float>(scale),
           op + g * rep * dh});
    }
  });
}

}  // namespace edge0

TORCH_LIBRARY_FRAGMENT(edge0, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, int len, float scale, int isa) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(edge0, CPU, m) { m.impl("decode_attention", &decode_attention_op); }
