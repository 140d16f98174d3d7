// edge0's own int4 kernels for decode: a token's activations (a few rows) against int4 affine
// group-64 weights, read in place from the arrangement torch's packer chose for this host
// (int4_layout.py), with an AVX-512, an AVX2 and a portable path.
//
// Each path computes what torch's own int4 kernel (aten._weight_int4pack_mm_for_cpu,
// torch 2.13) computes for the CPU capability of the same name, operation for operation, so
// the results are bit-identical to the pure-PyTorch path that calls it; the caller picks the
// path of torch's capability (native/__init__.py: kernel_isa). For output row r, with x
// rounded to bf16, (s, z) the row's kernel pair of the group of k and c from 0:
//   AVX-512   for k in order: c = fma(x[k], fma(q - 8, s, z), c)
//   AVX2      z' = fma(s, -8, z) per group; for k in order: c = fma(x[k], fma(q, s, z'), c)
//   portable  for k in order: c = c + x[k] * ((q - 8) * s + z), no fused operations
//             (on aarch64 torch's NEON loop: c = fma(w, x[k], c) with w as above)
// and y[r] = c rounded to bf16. What the paths save over torch's kernel is not arithmetic but
// everything around it: one call and one parallel region for a token's K experts instead of
// ~16 ATen ops per expert, no dtype round trips, activations converted once. A block kernel
// call takes up to 4 activation rows, each with its own sums: the weights are decoded once
// for all of them, which made prefill's experts 1.7-1.9x faster than a row at a time. From 9
// rows on, AVX-512 decodes a group's weights into a tile once for up to 32 rows
// (tiled_avx512): same sums in the same order, 1.08-1.13x faster again.
//
// With kInt8Flag added to the path's code, the same ops run the int8 paths instead (q8_*,
// below): activations become int8 codes with a scale per group of 64, and the products are
// integer dot products (VNNI's dpbusd where the CPU has it, AVX2's maddubs, or scalar code),
// ~2x the bf16 path's rounding error and faster: their sums are their own, the same bits on
// every path (quant.int4_linear_int8 is their PyTorch reference). They also read codes in
// the int8 order (a fifth layout code; edge0::int8_order_ puts them in it), where each run of
// 4 columns already holds the bytes as the AVX2 kernel's unpacks, or the AVX-512 kernel's
// byte permutes, would leave them.
//
// edge0::swiglu_int4_gemv: a decode token's K experts, down(silu(gate x) * up x), with the
// reference's rounding points and its silu (ATen's, over all experts at once).
// edge0::swiglu_int4_rows: the same for prefill, each expert on the tokens routed to it.
// edge0::int4_gemv: one projection, y = x W^T, for a few rows of x.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "int4_gemv.h"
#include "norms.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define EDGE0_X86 1

#endif

namespace {

using edge0::bf16_round;
using edge0::kGroup;  // quant.GROUP

// Software prefetch distance into a block's bytes. Experts come from a pool far larger than
// the caches, and the hardware prefetcher alone leaves the kernel waiting: 4 KiB ahead made a
// layer's 8 experts 1.6x faster on a 2.4 GiB pool (docs/kernels.md).
constexpr int64_t kPrefetch = 4096;

enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };
using edge0::kInt8Flag;  // added to a path's code: the int8-activation kernels (q8_*), see Path

// What a call computes with: the vector path, and whether activations go in as bf16 (the
// exact paths, torch's kernel bit for bit) or as int8 codes (the int8 paths, their own sums,
// the same on every path).
struct Path {
  Isa isa;
  bool int8;
};

// One run of like blocks of an arrangement: rows [first, first + rows), blocks of `block`
// rows, each stored as [K][block / 2] bytes; within a byte column, lane j of the low nibbles
// and lane j of the high ones are rows (j, j + block/2) split, or (2j, 2j + 1) interleaved.
// In the int8 order (`int8_order`), each run of 4 columns, 4 * block/2 bytes, has its bytes
// in the order the int8 kernels take them: byte j of chunk c (16 bytes: c = 0 for blocks of
// 32 rows, 0 and 1 for 64) of column i (0..3) at 64c + 4j + i, not at i * block/2 + 16c + j
// (see int8_order below).
struct Segment {
  int64_t first, rows, block;
  bool interleaved;
  bool int8_order;
};

// layout: [block, interleaved, tail block, tail interleaved], and optionally a fifth code,
// 1 for the int8 order (int4_layout.Int4Layout.int8_order).
std::vector<Segment> segments(int64_t n, at::IntArrayRef layout) {
  TORCH_CHECK(layout.size() == 4 || layout.size() == 5,
              "layout is [block, interleaved, tail block, tail interleaved(, int8 order)]");
  const int64_t block = layout[0], tail = layout[2];
  const bool order = layout.size() == 5 && layout[4] != 0;
  TORCH_CHECK(block == 32 || block == 64, "int4 blocks of 32 or 64 rows, got ", block);
  std::vector<Segment> out;
  const int64_t full = n / block * block;
  if (full) out.push_back({0, full, block, layout[1] != 0, order});
  if (n > full) {
    TORCH_CHECK(tail == 32 && (n - full) % 32 == 0, n, " rows do not fill blocks of ", block);
    out.push_back({full, n - full, 32, layout[3] != 0, order});
  }
  return out;
}

// Where byte lane j (0 <= j < block/2) of column k sits in a block's bytes: k * half + j, or
// in the int8 order, within the run of 4 columns from k - k % 4, at 64c + 4(j % 16) + k % 4
// for chunk c = j / 16.
inline int64_t byte_at(const Segment& s, int64_t k, int64_t j) {
  const int64_t half = s.block / 2;
  if (!s.int8_order) return k * half + j;
  return (k - k % 4) * half + 64 * (j / 16) + 4 * (j % 16) + k % 4;
}

// The output row of lane l (0 <= l < block): lanes [0, block/2) are the low nibbles.
inline int64_t lane_row(int64_t lane, int64_t block, bool interleaved) {
  const int64_t half = block / 2;
  if (!interleaved) return lane;
  return lane < half ? 2 * lane : 2 * (lane - half) + 1;
}

inline float bf16_bits(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// One int4 matrix as the kernel reads it.
struct Matrix {
  const uint8_t* packed;  // [N, K/2]
  const uint32_t* pairs;  // [G, N]: low half scale, high half zero (bf16 each)
  int64_t n, k;
};

// One row of activations as a path reads it: `f`, rounded to bf16 and held as floats, for the
// exact paths; for the int8 ones, the codes `q` [K] and, per group of 64 inputs, their scale
// `d` and the codes' sum.
struct Row {
  const float* f;
  const int8_t* q;
  const float* d;
  const int32_t* sum;
};

// Block kernels: `acc` gets the block's rows in lane order.

// R rows of activations at once, each its own sums (every weight is decoded once for them):
// row r's lanes go to acc[r * 64 + l].
template <int R>
void block_portable(const Matrix& m, const Segment& s, int64_t b0, const Row* x,
                    float* acc) {
  const int64_t half = s.block / 2;
  const uint8_t* base = m.packed + b0 * (m.k / 2);
  float scale[64], zero[64];
  for (int r = 0; r < R; ++r)
    for (int64_t l = 0; l < s.block; ++l) acc[r * 64 + l] = 0.f;
  for (int64_t k = 0; k < m.k; ++k) {
    if (k % kGroup == 0) {
      const uint32_t* pr = m.pairs + (k / kGroup) * m.n + b0;
      for (int64_t l = 0; l < s.block; ++l) {
        const uint32_t p = pr[lane_row(l, s.block, s.interleaved)];
        scale[l] = bf16_bits(p & 0xffff);
        zero[l] = bf16_bits(p >> 16);
      }
    }
    const uint8_t* col = base + k * half;
    if ((k * half) % 64 == 0) __builtin_prefetch(col + kPrefetch);
    for (int64_t j = 0; j < half; ++j) {  // lanes j (low nibbles) and half + j (high ones)
      const float w0 = static_cast<float>((col[j] & 15) - 8) * scale[j] + zero[j];
      const float w1 = static_cast<float>((col[j] >> 4) - 8) * scale[half + j] + zero[half + j];
      for (int r = 0; r < R; ++r) {
        float* a = acc + r * 64;
#if defined(__aarch64__)
        a[j] = std::fma(w0, x[r].f[k], a[j]);
        a[half + j] = std::fma(w1, x[r].f[k], a[half + j]);
#else
        a[j] = a[j] + x[r].f[k] * w0;
        a[half + j] = a[half + j] + x[r].f[k] * w1;
#endif
      }
    }
  }
}

// The int8 paths. Each row's activations are int8 codes with a scale per group of 64
// inputs (quantize_row), and every path computes the same sums: per group g and output row,
// the exact integer I = sum over the group of q * xq (the weight codes 0..15 against the
// activation codes), then, in fp32 with no fused operations and the groups in order,
//   c = c + d[g] * (s * float(I - 8 * X[g]) + z * float(X[g]))
// with (s, z) the row's kernel pair and X[g] the group's sum of activation codes (the
// weight is (q - 8) * s + z, the activation ~ d * xq); y = bf16(c). The integer part is
// exact and the float part is per lane, so the bits do not depend on the vector width.

// One group's integer sums into the block's lanes: c = c + d * (s * (I - 8X) + z * X).
template <int R>
void q8_combine(const Matrix& m, const Segment& s, int64_t b0, int64_t g, const Row* x,
                const int32_t (*dot)[64], float* acc) {
  const uint32_t* pr = m.pairs + g * m.n + b0;
  for (int64_t l = 0; l < s.block; ++l) {
    const uint32_t p = pr[lane_row(l, s.block, s.interleaved)];
    const float scale = bf16_bits(p & 0xffff), zero = bf16_bits(p >> 16);
    for (int r = 0; r < R; ++r) {
      const int32_t sum = x[r].sum[g];
      const float t = static_cast<float>(dot[r][l] - 8 * sum);
      const float v = scale * t + zero * static_cast<float>(sum);
      acc[r * 64 + l] = acc[r * 64 + l] + x[r].d[g] * v;
    }
  }
}

template <int R>
void q8_portable(const Matrix& m, const Segment& s, int64_t b0, const Row* x, float* acc) {
  const int64_t half = s.block / 2;
  const uint8_t* base = m.packed + b0 * (m.k / 2);
  int32_t dot[R][64];
  for (int r = 0; r < R; ++r)
    for (int64_t l = 0; l < s.block; ++l) acc[r * 64 + l] = 0.f;
  for (int64_t g = 0; g < m.k / kGroup; ++g) {
    std::memset(dot, 0, sizeof(dot));
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      if ((k * half) % 64 == 0) __builtin_prefetch(base + k * half + kPrefetch);
      for (int64_t j = 0; j < half; ++j) {
        const uint8_t byte = base[byte_at(s, k, j)];
        const int32_t lo = byte & 15, hi = byte >> 4;
        for (int r = 0; r < R; ++r) {
          dot[r][j] += lo * x[r].q[k];
          dot[r][half + j] += hi * x[r].q[k];
        }
      }
    }
    q8_combine<R>(m, s, b0, g, x, dot, acc);
  }
}

#ifdef EDGE0_X86

// 4 byte columns' chunk of 16 bytes (at q, q + half, q + 2 half, q + 3 half) as 4-byte
// lanes [col k][col k+1][col k+2][col k+3] of byte j: out[v] holds bytes j = 4v .. 4v + 3.
// The int8 order is these 64 bytes in this order (SSE2: every x86-64 CPU).
inline void column_quads(const uint8_t* q, int64_t half, __m128i* out) {
  const __m128i a0 = _mm_loadu_si128((const __m128i*)q);
  const __m128i a1 = _mm_loadu_si128((const __m128i*)(q + half));
  const __m128i a2 = _mm_loadu_si128((const __m128i*)(q + 2 * half));
  const __m128i a3 = _mm_loadu_si128((const __m128i*)(q + 3 * half));
  const __m128i t0 = _mm_unpacklo_epi8(a0, a1), t1 = _mm_unpackhi_epi8(a0, a1);
  const __m128i t2 = _mm_unpacklo_epi8(a2, a3), t3 = _mm_unpackhi_epi8(a2, a3);
  out[0] = _mm_unpacklo_epi16(t0, t2);
  out[1] = _mm_unpackhi_epi16(t0, t2);
  out[2] = _mm_unpacklo_epi16(t1, t3);
  out[3] = _mm_unpackhi_epi16(t1, t3);
}

// 4 activation codes from k on, as one int32 to broadcast.
inline int32_t quad(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return v;
}

// C 16-byte chunks per byte column (1: blocks of 32 rows, 2: of 64). For 4 columns at a
// time, chunk c's bytes become 4-byte lanes [col k][col k+1][col k+2][col k+3] of byte j
// (unpacks), whose nibbles go through maddubs against the 4 activation codes: lanes 16c + j
// of the low nibbles (vectors 2c, 2c + 1), half + 16c + j of the high ones.
// In the int8 order (O), the 4 columns' bytes are already in that order: two loads per chunk
// replace the 4 loads and 6 unpacks. A layer's 8 experts: 1.10-1.13x faster from memory,
// 1.25x from the cache (docs/kernels.md).
template <int C, int R, bool O>
__attribute__((target("avx2,fma"))) void q8_avx2(const Matrix& m, const Segment& s, int64_t b0,
                                                 const Row* x, float* acc) {
  constexpr int V = 4 * C;
  constexpr int64_t half = 16 * C;
  const uint8_t* base = m.packed + b0 * (m.k / 2);
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  alignas(32) uint32_t lanes[8];
  for (int r = 0; r < R; ++r)
    for (int64_t l = 0; l < s.block; ++l) acc[r * 64 + l] = 0.f;
  for (int64_t g = 0; g < m.k / kGroup; ++g) {
    __m256i dot[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) dot[r][v] = _mm256_setzero_si256();
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; k += 4) {
      const uint8_t* col = base + k * half;
      _mm_prefetch((const char*)(col + kPrefetch), _MM_HINT_T0);
      if (C == 2) _mm_prefetch((const char*)(col + kPrefetch + 64), _MM_HINT_T0);
      __m256i w[V];
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) {
        __m256i u0, u1;
        if (O) {
          u0 = _mm256_loadu_si256((const __m256i*)(col + 64 * c));
          u1 = _mm256_loadu_si256((const __m256i*)(col + 64 * c + 32));
        } else {
          __m128i v[4];
          column_quads(col + 16 * c, half, v);
          u0 = _mm256_set_m128i(v[1], v[0]);
          u1 = _mm256_set_m128i(v[3], v[2]);
        }
        w[2 * c] = _mm256_and_si256(u0, nib);
        w[2 * c + 1] = _mm256_and_si256(u1, nib);
        w[2 * C + 2 * c] = _mm256_and_si256(_mm256_srli_epi16(u0, 4), nib);
        w[2 * C + 2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(u1, 4), nib);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i xq = _mm256_set1_epi32(quad(x[r].q + k));
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v)
          dot[r][v] = _mm256_add_epi32(
              dot[r][v], _mm256_madd_epi16(_mm256_maddubs_epi16(w[v], xq), ones));
      }
    }
    const uint32_t* pr = m.pairs + g * m.n + b0;
    for (int v = 0; v < V; ++v) {
      __m256i p;
      if (s.interleaved) {
        for (int i = 0; i < 8; ++i) lanes[i] = pr[lane_row(8 * v + i, s.block, true)];
        p = _mm256_load_si256((const __m256i*)lanes);
      } else {
        p = _mm256_loadu_si256((const __m256i*)(pr + 8 * v));
      }
      const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
      const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(p, hi_mask));
      for (int r = 0; r < R; ++r) {
        const int32_t sum = x[r].sum[g];
        const __m256i sub = _mm256_set1_epi32(8 * sum);
        const __m256 sumf = _mm256_set1_ps(static_cast<float>(sum)), d = _mm256_set1_ps(x[r].d[g]);
        const __m256 t = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot[r][v], sub));
        const __m256 val = _mm256_add_ps(_mm256_mul_ps(scale, t), _mm256_mul_ps(zero, sumf));
        float* a = acc + r * 64 + 8 * v;
        _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_mul_ps(d, val)));
      }
    }
  }
}

#endif  // EDGE0_X86

#ifdef EDGE0_X86

// V vectors of 8 lanes: V = block / 8; vector v reads 8 bytes at 8 * (v % (V/2)) of a byte
// column, low nibbles for v < V/2, high ones after.
template <int V, int R>
__attribute__((target("avx2,fma"))) void block_avx2(const Matrix& m, const Segment& s,
                                                    int64_t b0, const Row* x,
                                                    float* acc) {
  constexpr int H = V / 2;
  const int64_t half = s.block / 2;
  const uint8_t* base = m.packed + b0 * (m.k / 2);
  const __m256i low = _mm256_set1_epi32(15);
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256 minus8 = _mm256_set1_ps(-8.f);
  __m256 c[R][V], scale[V], zero[V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) c[r][v] = _mm256_setzero_ps();
  alignas(32) uint32_t lanes[8];
  for (int64_t g = 0; g < m.k / kGroup; ++g) {
    const uint32_t* pr = m.pairs + g * m.n + b0;
    for (int v = 0; v < V; ++v) {
      __m256i p;
      if (s.interleaved) {
        for (int i = 0; i < 8; ++i) lanes[i] = pr[lane_row(8 * v + i, s.block, true)];
        p = _mm256_load_si256((const __m256i*)lanes);
      } else {
        p = _mm256_loadu_si256((const __m256i*)(pr + 8 * v));
      }
      scale[v] = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
      zero[v] = _mm256_fmadd_ps(scale[v], minus8,
                                _mm256_castsi256_ps(_mm256_and_si256(p, hi_mask)));
    }
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      const uint8_t* col = base + k * half;
      if ((k * half) % 64 == 0) _mm_prefetch((const char*)(col + kPrefetch), _MM_HINT_T0);
      __m256 xk[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) xk[r] = _mm256_set1_ps(x[r].f[k]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(col + 8 * (v % H))));
        b = v < H ? _mm256_and_si256(b, low) : _mm256_srli_epi32(b, 4);
        const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), scale[v], zero[v]);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) c[r][v] = _mm256_fmadd_ps(xk[r], w, c[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc + r * 64 + 8 * v, c[r][v]);
}

// A group's kernel pairs for the V vectors of a block: scale (low half) and zero (high half)
// of each lane's row, as floats.
template <int V>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) inline void pairs_avx512(
    const Matrix& m, const Segment& s, int64_t b0, int64_t g, __m512* scale, __m512* zero) {
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  alignas(64) uint32_t lanes[16];
  const uint32_t* pr = m.pairs + g * m.n + b0;
  for (int v = 0; v < V; ++v) {
    __m512i p;
    if (s.interleaved) {
      for (int i = 0; i < 16; ++i) lanes[i] = pr[lane_row(16 * v + i, s.block, true)];
      p = _mm512_load_si512(lanes);
    } else {
      p = _mm512_loadu_si512(pr + 16 * v);
    }
    scale[v] = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
    zero[v] = _mm512_castsi512_ps(_mm512_and_si512(p, hi_mask));
  }
}

// V vectors of 16 lanes; vector v reads 16 bytes at 16 * (v % (V/2)) of a byte column.
// The codes become q - 8 by a permute from the table -8..7 indexed by their low 4 bits.
template <int V, int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void block_avx512(
    const Matrix& m, const Segment& s, int64_t b0, const Row* x, float* acc) {
  constexpr int H = V / 2;
  const int64_t half = s.block / 2;
  const uint8_t* base = m.packed + b0 * (m.k / 2);
  const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  __m512 c[R][V], scale[V], zero[V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) c[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < m.k / kGroup; ++g) {
    pairs_avx512<V>(m, s, b0, g, scale, zero);
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      const uint8_t* col = base + k * half;
      if ((k * half) % 64 == 0) _mm_prefetch((const char*)(col + kPrefetch), _MM_HINT_T0);
      __m512 xk[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) xk[r] = _mm512_set1_ps(x[r].f[k]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) {
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(col + 16 * (v % H))));
        if (v >= H) b = _mm512_srli_epi32(b, 4);
        const __m512 w = _mm512_fmadd_ps(_mm512_permutexvar_ps(b, table), scale[v], zero[v]);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) c[r][v] = _mm512_fmadd_ps(xk[r], w, c[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + r * 64 + 16 * v, c[r][v]);
}

// Tiled kernels for many rows: a group's 64 columns of weights are decoded once, into a
// tile in the cache, then every row runs over the tile with its own sums. A row's sums are the
// block kernel's: the same weights, the same fma, k in the same order, carried in `acc`
// from one group to the next, so the bits are too. What changes is that decoding is paid once
// per group for all the rows, not once per 4 of them.

template <int V>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void decode_avx512(
    const Matrix& m, const Segment& s, int64_t b0, int64_t g, __m512* tile) {
  constexpr int H = V / 2;
  const int64_t half = s.block / 2;
  const uint8_t* base = m.packed + b0 * (m.k / 2);
  const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  __m512 scale[V], zero[V];
  pairs_avx512<V>(m, s, b0, g, scale, zero);
  for (int64_t i = 0; i < kGroup; ++i) {
    const int64_t k = g * kGroup + i;
    const uint8_t* col = base + k * half;
    if ((k * half) % 64 == 0) _mm_prefetch((const char*)(col + kPrefetch), _MM_HINT_T0);
    for (int v = 0; v < V; ++v) {
      __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(col + 16 * (v % H))));
      if (v >= H) b = _mm512_srli_epi32(b, 4);
      tile[i * V + v] = _mm512_fmadd_ps(_mm512_permutexvar_ps(b, table), scale[v], zero[v]);
    }
  }
}

template <int V, int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void tile_avx512(
    const __m512* tile, const Row* x, int64_t k0, float* acc, bool first) {
  __m512 c[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      c[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * 64 + 16 * v);
  for (int64_t i = 0; i < kGroup; ++i) {
    __m512 xk[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xk[r] = _mm512_set1_ps(x[r].f[k0 + i]);
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const __m512 w = tile[i * V + v];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) c[r][v] = _mm512_fmadd_ps(xk[r], w, c[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + r * 64 + 16 * v, c[r][v]);
}

template <int V>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void tiled_avx512(
    const Matrix& m, const Segment& s, int64_t b0, const Row* x, float* acc,
    int rows) {
  alignas(64) __m512 tile[kGroup * V];
  for (int64_t g = 0; g < m.k / kGroup; ++g) {
    decode_avx512<V>(m, s, b0, g, tile);
    for (int r0 = 0; r0 < rows; r0 += 4) {
      const Row* xr = x + r0;
      float* a = acc + r0 * 64;
      switch (rows - r0) {
        case 1: tile_avx512<V, 1>(tile, xr, g * kGroup, a, g == 0); break;
        case 2: tile_avx512<V, 2>(tile, xr, g * kGroup, a, g == 0); break;
        case 3: tile_avx512<V, 3>(tile, xr, g * kGroup, a, g == 0); break;
        default: tile_avx512<V, 4>(tile, xr, g * kGroup, a, g == 0); break;
      }
    }
  }
}

// The int8 AVX-512 kernel's prefetch distance, -1 for none. On AMD it reads faster with the
// hardware prefetcher alone: on Zen 4 a layer's 8 experts from a 2.4 GiB pool took 1.10x
// longer with the 4 KiB prefetch, and the bench shape's decode step 1.15x (docs/kernels.md),
// while the exact AVX-512 and the AVX2 kernels moved by less than the rounds' spread. On
// Intel the prefetch was what made the exact kernel 1.6x faster from memory; it stays.
int64_t q8_avx512_ahead() {
  static const int64_t ahead = __builtin_cpu_is("amd") ? -1 : kPrefetch;
  return ahead;
}

// The int8 path with AVX-512 VBMI and VNNI: C 16-byte chunks per byte column, as q8_avx2;
// 4 columns are 4 * half contiguous bytes, and one byte permute (two sources for C = 2) puts
// chunk c's bytes in 4-byte lanes [col k..k+3] of byte j, whose nibbles go through dpbusd.
// In the int8 order (`Ordered`) chunk c's 64 bytes are already so, and load as they are.
template <int C, int R, bool Ordered>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512vnni"))) void
q8_avx512(const Matrix& m, const Segment& s, int64_t b0, const Row* x, float* acc) {
  constexpr int V = 2 * C;
  constexpr int64_t half = 16 * C;
  const int64_t ahead = q8_avx512_ahead();
  const uint8_t* base = m.packed + b0 * (m.k / 2);
  alignas(64) uint8_t order[C][64];
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < 16; ++j)
      for (int i = 0; i < 4; ++i) order[c][4 * j + i] = static_cast<uint8_t>(i * half + 16 * c + j);
  __m512i idx[C];
  for (int c = 0; c < C; ++c) idx[c] = _mm512_load_si512(order[c]);
  const __m512i nib = _mm512_set1_epi8(15);
  __m512 scale[V], zero[V];
  for (int r = 0; r < R; ++r)
    for (int64_t l = 0; l < s.block; ++l) acc[r * 64 + l] = 0.f;
  for (int64_t g = 0; g < m.k / kGroup; ++g) {
    __m512i dot[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) dot[r][v] = _mm512_setzero_si512();
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; k += 4) {
      const uint8_t* col = base + k * half;
      __m512i t[C];
      if (ahead >= 0) {
        _mm_prefetch((const char*)(col + ahead), _MM_HINT_T0);
        if (C == 2) _mm_prefetch((const char*)(col + ahead + 64), _MM_HINT_T0);
      }
      if (Ordered) {
        for (int c = 0; c < C; ++c) t[c] = _mm512_loadu_si512(col + 64 * c);
      } else if (C == 1) {
        t[0] = _mm512_permutexvar_epi8(idx[0], _mm512_loadu_si512(col));
      } else {
        const __m512i z0 = _mm512_loadu_si512(col), z1 = _mm512_loadu_si512(col + 64);
        for (int c = 0; c < C; ++c) t[c] = _mm512_permutex2var_epi8(z0, idx[c], z1);
      }
      __m512i w[V];
      for (int c = 0; c < C; ++c) {
        w[c] = _mm512_and_si512(t[c], nib);
        w[C + c] = _mm512_and_si512(_mm512_srli_epi16(t[c], 4), nib);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i xq = _mm512_set1_epi32(quad(x[r].q + k));
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], w[v], xq);
      }
    }
    pairs_avx512<V>(m, s, b0, g, scale, zero);
    for (int r = 0; r < R; ++r) {
      const int32_t sum = x[r].sum[g];
      const __m512i sub = _mm512_set1_epi32(8 * sum);
      const __m512 sumf = _mm512_set1_ps(static_cast<float>(sum)), d = _mm512_set1_ps(x[r].d[g]);
      for (int v = 0; v < V; ++v) {
        const __m512 t = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][v], sub));
        const __m512 val = _mm512_add_ps(_mm512_mul_ps(scale[v], t), _mm512_mul_ps(zero[v], sumf));
        float* a = acc + r * 64 + 16 * v;
        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_mul_ps(d, val)));
      }
    }
  }
}

#endif  // EDGE0_X86

bool supported(Isa isa) {
#ifdef EDGE0_X86
  if (isa == kAvx512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (isa == kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == kPortable;
}

// The int8 path's AVX-512 kernel wants VBMI (its byte permutes) and VNNI (dpbusd) as well.
bool int8_avx512() {
#ifdef EDGE0_X86
  return supported(kAvx512) && __builtin_cpu_supports("avx512vbmi") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// Rows of activations one block kernel call takes at once (the weights decoded once for all).
constexpr int kRows = 4;

// A block for R rows on the path's kernel: exact (block_*) or int8 (q8_*).
template <int R>
void block_rows(Path path, const Matrix& m, const Segment& s, int64_t b0, const Row* x,
                float* acc) {
#ifdef EDGE0_X86
  const bool wide = s.block == 64;
  if (s.int8_order) {  // int8 only (run checks)
    if (path.isa == kPortable) {
      q8_portable<R>(m, s, b0, x, acc);
    } else if (path.isa == kAvx512) {
      wide ? q8_avx512<2, R, true>(m, s, b0, x, acc) : q8_avx512<1, R, true>(m, s, b0, x, acc);
    } else {
      wide ? q8_avx2<2, R, true>(m, s, b0, x, acc) : q8_avx2<1, R, true>(m, s, b0, x, acc);
    }
    return;
  }
  if (path.isa == kAvx512) {
    if (path.int8)
      wide ? q8_avx512<2, R, false>(m, s, b0, x, acc) : q8_avx512<1, R, false>(m, s, b0, x, acc);
    else
      wide ? block_avx512<4, R>(m, s, b0, x, acc) : block_avx512<2, R>(m, s, b0, x, acc);
    return;
  }
  if (path.isa == kAvx2) {
    if (path.int8)
      wide ? q8_avx2<2, R, false>(m, s, b0, x, acc) : q8_avx2<1, R, false>(m, s, b0, x, acc);
    else
      wide ? block_avx2<8, R>(m, s, b0, x, acc) : block_avx2<4, R>(m, s, b0, x, acc);
    return;
  }
#endif
  path.int8 ? q8_portable<R>(m, s, b0, x, acc) : block_portable<R>(m, s, b0, x, acc);
}

// Rows one AVX-512 job takes: from kTiledFrom of them, its path decodes each group's weights
// once for all (tiled_avx512); fewer go kRows at a time. At 8 rows the tile's stores and
// loads cost more than the second decoding they save.
constexpr int kTile = 32;
constexpr int kTiledFrom = 9;

// One block of rows for each of `rows` activation rows: y[i][row] for the block's rows,
// rounded to bf16.
void block(Path path, const Matrix& m, const Segment& s, int64_t b0, const Row* x,
           float* const* y, int rows) {
  alignas(64) float acc[kTile * 64];
#ifdef EDGE0_X86
  if (!path.int8 && path.isa == kAvx512 && rows >= kTiledFrom) {
    s.block == 64 ? tiled_avx512<4>(m, s, b0, x, acc, rows)
                  : tiled_avx512<2>(m, s, b0, x, acc, rows);
  } else
#endif
    for (int r0 = 0; r0 < rows; r0 += kRows) {
      const Row* xr = x + r0;
      float* a = acc + r0 * 64;
      switch (rows - r0) {
        case 1: block_rows<1>(path, m, s, b0, xr, a); break;
        case 2: block_rows<2>(path, m, s, b0, xr, a); break;
        case 3: block_rows<3>(path, m, s, b0, xr, a); break;
        default: block_rows<4>(path, m, s, b0, xr, a); break;
      }
    }
  for (int r = 0; r < rows; ++r)
    for (int64_t l = 0; l < s.block; ++l)
      y[r][b0 + lane_row(l, s.block, s.interleaved)] = bf16_round(acc[r * 64 + l]);
}

// One matrix against up to kTile rows of activations, into their y rows.
struct Job {
  Matrix m;
  std::vector<Segment> segs;
  Row x[kTile];
  float* y[kTile];
  int rows;
};

// Jobs for one matrix against rows x[i] -> y[i]: kTile at a time where the tiled path takes
// them, else kRows (more, smaller units for the threads to share).
void add_rows(Path path, std::vector<Job>& jobs, const Matrix& m, const std::vector<Segment>& segs,
              const std::vector<Row>& x, const std::vector<float*>& y) {
  const size_t per = path.isa == kAvx512 && !path.int8 ? kTile : kRows;
  for (size_t i = 0; i < x.size(); i += per) {
    Job j{m, segs, {}, {}, 0};
    for (size_t r = i; r < x.size() && r < i + per; ++r, ++j.rows) {
      j.x[j.rows] = x[r];
      j.y[j.rows] = y[r];
    }
    jobs.push_back(j);
  }
}

// Every block of every job, in one parallel region (torch's intra-op threads).
void run(Path path, const std::vector<Job>& jobs) {
  for (const Job& j : jobs)
    for (const Segment& sg : j.segs)
      TORCH_CHECK(path.int8 || !sg.int8_order,
                  "int4 codes in the int8 order are read by the int8 kernels only");
  struct Unit {
    size_t job, segment;
    int64_t b0;
  };
  std::vector<Unit> units;
  for (size_t j = 0; j < jobs.size(); ++j)
    for (size_t i = 0; i < jobs[j].segs.size(); ++i) {
      const Segment& sg = jobs[j].segs[i];
      for (int64_t b = sg.first; b < sg.first + sg.rows; b += sg.block) units.push_back({j, i, b});
    }
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u) {
      const Job& j = jobs[units[u].job];
      block(path, j.m, j.segs[units[u].segment], units[u].b0, j.x, j.y, j.rows);
    }
  });
}

// One row's int8 codes per group of 64: scale d = a / 127 for the group's largest magnitude
// a, codes q = round(x * (127 / a)) (to nearest, ties to even) within [-127, 127], and their
// sum; a group of zeros has d = 0, one holding an inf or a NaN d = NaN (so y is NaN, as the
// exact paths' would be).
void quantize_row(const float* x, int64_t k, int8_t* q, float* d, int32_t* sum) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    float a = 0.f;
    bool finite = true;
    for (int64_t i = 0; i < kGroup; ++i) {
      const float v = std::fabs(xg[i]);
      if (!(v <= std::numeric_limits<float>::max())) finite = false;
      else if (v > a) a = v;
    }
    int32_t total = 0;
    if (finite && a > 0.f) {
      const float inv = 127.f / a;
      for (int64_t i = 0; i < kGroup; ++i) {
        const float v = std::nearbyint(xg[i] * inv);
        const int32_t c = static_cast<int32_t>(std::min(127.f, std::max(-127.f, v)));
        q[g * kGroup + i] = static_cast<int8_t>(c);
        total += c;
      }
      d[g] = a / 127.f;
    } else {
      std::memset(q + g * kGroup, 0, kGroup);
      d[g] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
    }
    sum[g] = total;
  }
}

// Rows [rows, K] of activations, prepared once for the path that reads them: rounded to
// bf16 as .to(torch.bfloat16) rounds them (the exact paths), or as int8 codes.
struct Acts {
  std::vector<float> f;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum;
  int64_t k = 0;

  Acts(const at::Tensor& x, bool int8) : k(x.size(-1)) {
    const at::Tensor xf = edge0::floats(x);
    const float* p = xf.data_ptr<float>();
    const int64_t n = xf.numel();
    if (!int8) {
      f.resize(n);
      for (int64_t i = 0; i < n; ++i) f[i] = bf16_round(p[i]);
      return;
    }
    TORCH_CHECK(k % kGroup == 0, "int8 activations come in groups of 64, got ", k, " inputs");
    const int64_t rows = k ? n / k : 0, groups = k / kGroup;
    q.resize(n);
    d.resize(rows * groups);
    sum.resize(rows * groups);
    for (int64_t r = 0; r < rows; ++r)
      quantize_row(p + r * k, k, q.data() + r * k, d.data() + r * groups, sum.data() + r * groups);
  }

  Row row(int64_t r) const {
    if (q.empty()) return {f.data() + r * k, nullptr, nullptr, nullptr};
    const int64_t groups = k / kGroup;
    return {nullptr, q.data() + r * k, d.data() + r * groups, sum.data() + r * groups};
  }
};

Matrix matrix(const at::Tensor& packed, const at::Tensor& pairs, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed int4 weights must be contiguous uint8 [N, K/2]");
  const int64_t n = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == k && k % kGroup == 0, "weights [", n, ", ", packed.size(1),
              "] do not take ", k, " inputs");
  TORCH_CHECK(pairs.is_contiguous() && pairs.element_size() * pairs.numel() == (k / kGroup) * n * 4,
              "pairs must be contiguous bf16 [K/64, N, 2]");
  return {packed.data_ptr<uint8_t>(), reinterpret_cast<const uint32_t*>(pairs.data_ptr()), n, k};
}

// A path's code: 0 (portable), 1 (AVX2) or 2 (AVX-512), plus kInt8Flag for int8 activations.
// The int8 paths compute the same bits, so where the CPU has AVX-512 but not VBMI and VNNI,
// the int8 AVX-512 code runs the AVX2 kernel.
Path checked(int64_t code) {
  const bool int8 = code >= kInt8Flag;
  const int64_t isa = int8 ? code - kInt8Flag : code;
  TORCH_CHECK(isa >= kPortable && isa <= kAvx512,
              "isa is 0 (portable), 1 (AVX2) or 2 (AVX-512), plus 16 for int8 activations");
  Isa i = static_cast<Isa>(isa);
  TORCH_CHECK(supported(i), "this CPU cannot run the int4 kernel's path ", isa);
  if (int8 && i == kAvx512 && !int8_avx512()) i = kAvx2;
  return {i, int8};
}

// Every block of one matrix's segments against one row, on this thread.
void blocks_here(Path path, const Matrix& m, const std::vector<Segment>& segs, const Row& x,
                 float* y) {
  for (const Segment& sg : segs)
    for (int64_t b = sg.first; b < sg.first + sg.rows; b += sg.block)
      block(path, m, sg, b, &x, &y, 1);
}

// The reference, per expert e (engine/backends/torch.py swiglu_int4):
//   gate, up = int4_linear(x, w13[e], p13[e]).float().chunk(2)   (x to bf16, result bf16)
//   y[e] = int4_linear(silu(gate) * up, w2[e], p2[e]).float()    (the product to bf16)
// Where the threads can share the experts evenly (K a multiple of their count), each takes
// whole experts, gate/up, silu and down, in one parallel region; else every block of the
// gate/up products is shared out, then every block of the down ones (a region each, the silu
// between them on one thread). Either computes the same bits: the silu and the product run
// per expert row as they do over the [K, I] halves, and every sum is per output row.
at::Tensor swiglu_int4_gemv(const at::Tensor& x, at::TensorList w13, at::TensorList p13,
                            at::TensorList w2, at::TensorList p2, at::IntArrayRef layout,
                            int64_t isa_code) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "x must be [1, D], got ", x.sizes());
  const Path path = checked(isa_code);
  const int64_t n_exp = static_cast<int64_t>(w13.size()), d = x.size(1);
  TORCH_CHECK(p13.size() == w13.size() && w2.size() == w13.size() && p2.size() == w13.size(),
              "one w13, p13, w2 and p2 per expert");
  const Acts xa(x, path.int8);
  const int64_t width = n_exp ? w13[0].size(0) / 2 : 0;
  const auto up_segs = segments(2 * width, layout), down_segs = segments(d, layout);
  TORCH_CHECK(path.int8 || up_segs.empty() || !up_segs[0].int8_order,
              "int4 codes in the int8 order are read by the int8 kernels only");
  std::vector<Matrix> ups, downs;
  for (int64_t e = 0; e < n_exp; ++e) {
    ups.push_back(matrix(w13[e], p13[e], d));
    TORCH_CHECK(ups.back().n == 2 * width, "the experts of one call share their width");
    downs.push_back(matrix(w2[e], p2[e], width));
    TORCH_CHECK(downs.back().n == d, "w2 must give ", d, " outputs");
  }
  at::Tensor gate_up = at::empty({n_exp, 2 * width}, x.options().dtype(at::kFloat));
  at::Tensor out = at::empty({n_exp, d}, x.options().dtype(at::kFloat));
  float* gu = gate_up.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const int64_t threads = at::get_num_threads();
  if (n_exp >= threads && n_exp % threads == 0) {
    // no barrier between the products, and each expert's hidden row stays on its core:
    // a layer's 8 experts 1.03-1.04x faster from memory (docs/kernels.md)
    at::parallel_for(0, n_exp, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t e = lo; e < hi; ++e) {
        blocks_here(path, ups[e], up_segs, xa.row(0), gu + e * 2 * width);
        const at::Tensor row = gate_up.select(0, e);
        const Acts h(at::silu(row.narrow(0, 0, width)) * row.narrow(0, width, width), path.int8);
        blocks_here(path, downs[e], down_segs, h.row(0), y + e * d);
      }
    });
  } else {
    std::vector<Job> up, down;
    for (int64_t e = 0; e < n_exp; ++e)
      add_rows(path, up, ups[e], up_segs, {xa.row(0)}, {gu + e * 2 * width});
    run(path, up);
    const auto halves = gate_up.chunk(2, -1);
    const Acts h(at::silu(halves[0]) * halves[1], path.int8);  // [K, I]
    for (int64_t e = 0; e < n_exp; ++e)
      add_rows(path, down, downs[e], down_segs, {h.row(e)}, {y + e * d});
    run(path, down);
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// Prefill's experts, each on the tokens routed to it: expert e takes the rows tokens[e] of x
// [T, D]. Returns fp32 [R, D], R the number of (expert, token) pairs, row by row in that
// order: for each, what swiglu_int4(x[tokens[e]], e) computes for that token, bit for bit
// (the kernel's sums are per row, and the silu runs row by row either way), in two parallel
// regions for all of them instead of ~12 ATen ops per expert.
at::Tensor swiglu_int4_rows(const at::Tensor& x, at::TensorList tokens, at::TensorList w13,
                            at::TensorList p13, at::TensorList w2, at::TensorList p2,
                            at::IntArrayRef layout, int64_t isa_code) {
  RECORD_FUNCTION("edge0::int4_gemv", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() == 2, "x must be [T, D], got ", x.sizes());
  const Path path = checked(isa_code);
  const int64_t n_exp = static_cast<int64_t>(w13.size()), t = x.size(0), d = x.size(1);
  TORCH_CHECK(tokens.size() == w13.size() && p13.size() == w13.size() &&
                  w2.size() == w13.size() && p2.size() == w13.size(),
              "one token list, w13, p13, w2 and p2 per expert");
  std::vector<at::Tensor> idx;
  int64_t rows = 0;
  for (const at::Tensor& tk : tokens) {
    TORCH_CHECK(tk.dim() == 1 && tk.scalar_type() == at::kLong, "token lists are int64 [n]");
    idx.push_back(tk.contiguous());
    const int64_t* p = idx.back().data_ptr<int64_t>();
    for (int64_t i = 0; i < tk.numel(); ++i)
      TORCH_CHECK(p[i] >= 0 && p[i] < t, "token ", p[i], " is not a row of x [", t, ", D]");
    rows += tk.numel();
  }
  const Acts xa(x, path.int8);
  const int64_t width = n_exp ? w13[0].size(0) / 2 : 0;
  at::Tensor gate_up = at::empty({rows, 2 * width}, x.options().dtype(at::kFloat));
  at::Tensor out = at::empty({rows, d}, x.options().dtype(at::kFloat));
  std::vector<Job> up, down;
  const auto up_segs = segments(2 * width, layout), down_segs = segments(d, layout);
  int64_t r = 0;
  for (int64_t e = 0; e < n_exp; ++e) {
    const Matrix m = matrix(w13[e], p13[e], d);
    TORCH_CHECK(m.n == 2 * width, "the experts of one call share their width");
    const int64_t* p = idx[e].data_ptr<int64_t>();
    std::vector<Row> xs;
    std::vector<float*> ys;
    for (int64_t i = 0; i < idx[e].numel(); ++i, ++r) {
      xs.push_back(xa.row(p[i]));
      ys.push_back(gate_up.data_ptr<float>() + r * 2 * width);
    }
    add_rows(path, up, m, up_segs, xs, ys);
  }
  run(path, up);
  const auto halves = gate_up.chunk(2, -1);
  const Acts h(at::silu(halves[0]) * halves[1], path.int8);  // [R, I]
  r = 0;
  for (int64_t e = 0; e < n_exp; ++e) {
    const Matrix m = matrix(w2[e], p2[e], width);
    TORCH_CHECK(m.n == d, "w2 must give ", d, " outputs");
    std::vector<Row> xs;
    std::vector<float*> ys;
    for (int64_t i = 0; i < idx[e].numel(); ++i, ++r) {
      xs.push_back(h.row(r));
      ys.push_back(out.data_ptr<float>() + r * d);
    }
    add_rows(path, down, m, down_segs, xs, ys);
  }
  run(path, down);
  return out;
}

// One run of 4 columns of a block of 32C rows (4 * 16C bytes at p) into the int8 order, in
// place: byte j of chunk c of column i from i * 16C + 16c + j to 64c + 4j + i. Every chunk
// is loaded before any is stored. On x86 the unpacks q8_avx2 does per use (column_quads).
template <int C>
inline void int8_order_run(uint8_t* p) {
  constexpr int64_t half = 16 * C;
#ifdef EDGE0_X86
  __m128i out[C][4];
  for (int c = 0; c < C; ++c) column_quads(p + 16 * c, half, out[c]);
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < 4; ++v) _mm_storeu_si128((__m128i*)(p + 64 * c + 16 * v), out[c][v]);
#else
  uint8_t from[4 * half];
  std::memcpy(from, p, 4 * half);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < 16; ++j)
      for (int64_t i = 0; i < 4; ++i) p[64 * c + 4 * j + i] = from[i * half + 16 * c + j];
#endif
}

// Codes packed [N, K/2] in `layout`'s arrangement, put in its int8 order in place: what the
// pool does to each expert it reads where decode runs the int8 AVX2 kernel, at about the
// speed of a copy (int4_layout.Int4Layout.in_int8_order is its PyTorch reference).
void int8_order(const at::Tensor& packed, at::IntArrayRef layout) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed int4 codes must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(layout.size() == 4, "the codes' own arrangement: [block, interleaved, tail block, "
              "tail interleaved]");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(k % kGroup == 0, "int4 codes come in groups of 64 columns, got ", k);
  uint8_t* codes = packed.data_ptr<uint8_t>();
  for (const Segment& sg : segments(n, layout)) {
    const int64_t half = sg.block / 2;
    // a segment's blocks are contiguous: its runs of 4 columns follow one another
    uint8_t* p = codes + sg.first * (k / 2);
    for (int64_t r = 0; r < sg.rows * k / 2; r += 4 * half)
      half == 16 ? int8_order_run<1>(p + r) : int8_order_run<2>(p + r);
  }
}

// quant.to_kernel_pairs in one loop, in place: each stored (scale, bias) pair of bf16 into
// the kernel's (scale, zero), zero = bf16(bias + 8 * scale) with the sum in fp32 (8 * scale
// is exact) and rounded to nearest even, as the PyTorch ops round it. What the pool does to
// every expert it reads: the ops took ~85 us an expert of the peer bench shape on a reader's
// thread, this loop a few, and under a memory cap those reads share the cores that decode.
// One pair as a 32-bit word: the scale in its low half, the bias in its high half.
inline uint32_t kernel_pair(uint32_t word) {
  float scale, bias;
  const uint32_t s = word << 16, b = word & 0xFFFF0000u;
  std::memcpy(&scale, &s, 4);
  std::memcpy(&bias, &b, 4);
  const float z = bias + 8.0f * scale;
  uint32_t bits;
  std::memcpy(&bits, &z, 4);
  // c10::BFloat16's rounding: to nearest even, a NaN to the canonical quiet NaN
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  return (word & 0xFFFFu) | (z != z ? 0x7FC00000u : rounded);
}

void kernel_pairs(const at::Tensor& pairs) {
  TORCH_CHECK(pairs.scalar_type() == at::kBFloat16 && pairs.is_contiguous() && pairs.dim() >= 1 &&
                  pairs.size(-1) == 2,
              "pairs must be contiguous bf16 [..., 2]");
  uint32_t* p = reinterpret_cast<uint32_t*>(pairs.data_ptr());  // (little-endian)
  const int64_t n = pairs.numel() / 2;
  int64_t i = 0;
#ifdef EDGE0_X86
  // kernel_pair on 4 words at once (SSE2: every x86-64 CPU), ~4x the scalar loop
  const __m128i high = _mm_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m128i one = _mm_set1_epi32(1), half = _mm_set1_epi32(0x7FFF);
  const __m128i qnan = _mm_set1_epi32(0x7FC00000), low = _mm_set1_epi32(0xFFFF);
  const __m128 eight = _mm_set1_ps(8.0f);
  for (; i + 4 <= n; i += 4) {
    const __m128i word = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
    const __m128 scale = _mm_castsi128_ps(_mm_slli_epi32(word, 16));
    const __m128 bias = _mm_castsi128_ps(_mm_and_si128(word, high));
    const __m128 z = _mm_add_ps(bias, _mm_mul_ps(eight, scale));
    const __m128i bits = _mm_castps_si128(z);
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(bits, 16), one);
    __m128i rounded = _mm_and_si128(_mm_add_epi32(_mm_add_epi32(bits, half), lsb), high);
    const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(z, z));
    rounded = _mm_or_si128(_mm_and_si128(nan, qnan), _mm_andnot_si128(nan, rounded));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + i),
                     _mm_or_si128(_mm_and_si128(word, low), rounded));
  }
#endif
  for (; i < n; ++i) p[i] = kernel_pair(p[i]);
}

bool isa_supported(int64_t isa) {
  return isa >= kPortable && isa <= kAvx512 && supported(static_cast<Isa>(isa));
}

}  // namespace

namespace edge0 {

std::vector<at::Tensor> int4_gemv_each(const at::Tensor& x, at::TensorList packed,
                                       at::TensorList pairs, at::IntArrayRef layout,
                                       int64_t isa_code) {
  // its own row in a profile, also when another native op calls it
  RECORD_FUNCTION("edge0::int4_gemv", std::vector<c10::IValue>());
  const Path path = checked(isa_code);
  TORCH_CHECK(packed.size() == pairs.size(), "one pairs tensor per packed matrix");
  const int64_t k = x.size(-1), rows = k ? x.numel() / k : 0;
  const Acts xa(x, path.int8);
  std::vector<at::Tensor> outs;
  std::vector<Job> jobs;
  for (size_t i = 0; i < packed.size(); ++i) {
    const Matrix m = matrix(packed[i], pairs[i], k);
    outs.push_back(at::empty({rows, m.n}, x.options().dtype(at::kFloat)));
    std::vector<Row> xs;
    std::vector<float*> ys;
    for (int64_t r = 0; r < rows; ++r) {
      xs.push_back(xa.row(r));
      ys.push_back(outs.back().data_ptr<float>() + r * m.n);
    }
    add_rows(path, jobs, m, segments(m.n, layout), xs, ys);
  }
  run(path, jobs);
  for (at::Tensor& out : outs) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(out.size(1));
    out = out.view(shape);
    if (x.scalar_type() != at::kFloat) out = out.to(x.scalar_type());
  }
  return outs;
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs,
                     at::IntArrayRef layout, int64_t isa) {
  return int4_gemv_each(x, {packed}, {pairs}, layout, isa)[0];
}

at::Tensor swiglu_experts(const at::Tensor& x, at::TensorList w13, at::TensorList p13,
                          at::TensorList w2, at::TensorList p2, at::IntArrayRef layout,
                          int64_t isa) {
  // the row the dispatcher gives the op, also when another native op calls it
  RECORD_FUNCTION("edge0::swiglu_int4_gemv", std::vector<c10::IValue>());
  return swiglu_int4_gemv(x, w13, p13, w2, p2, layout, isa);
}

at::Tensor swiglu_experts_rows(const at::Tensor& x, at::TensorList tokens, at::TensorList w13,
                               at::TensorList p13, at::TensorList w2, at::TensorList p2,
                               at::IntArrayRef layout, int64_t isa) {
  return swiglu_int4_rows(x, tokens, w13, p13, w2, p2, layout, isa);
}

}  // namespace edge0

TORCH_LIBRARY_FRAGMENT(edge0, m) {
  m.def(
      "swiglu_int4_gemv(Tensor x, Tensor[] w13, Tensor[] p13, Tensor[] w2, Tensor[] p2, "
      "int[] layout, int isa) -> Tensor");
  m.def(
      "swiglu_int4_rows(Tensor x, Tensor[] tokens, Tensor[] w13, Tensor[] p13, Tensor[] w2, "
      "Tensor[] p2, int[] layout, int isa) -> Tensor");
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor pairs, int[] layout, int isa) -> Tensor");
  m.def("int4_isa_supported(int isa) -> bool", &isa_supported);
  m.def("int8_order_(Tensor(a!) packed, int[] layout) -> ()");
  m.def("kernel_pairs_(Tensor(a!) pairs) -> ()");
}

TORCH_LIBRARY_IMPL(edge0, CPU, m) {
  m.impl("swiglu_int4_gemv", &swiglu_int4_gemv);
  m.impl("swiglu_int4_rows", &swiglu_int4_rows);
  m.impl("int4_gemv", &edge0::int4_gemv);
  m.impl("int8_order_", &int8_order);
  m.impl("kernel_pairs_", &kernel_pairs);
}
