// edge0::prerouter_head: a prerouter head (prerouter/head.py) on a few decode rows, read from
// the file's fp16 weights, and its consumer's staged set.
//
// The head is logits = fc2(gelu_erf(fc1(x))) + linear_init(x) with x = [h, onehot(executed),
// onehot(previous)]. A one-hot block times a matrix is the sum of the matrix's columns of the
// set experts, so the op reads the h columns of fc1 and linear_init as matrices ([W, D], [E,
// D]) and the one-hot columns as rows of their transposes ([2E, W], [2E, E]), K of each: a
// head's bytes are its h part in fp16 plus 2K short rows, not 2E columns in fp32. What the
// torch path (StackedHeads.one) gives, it gives up to the order of float sums (about 1e-6 of
// a logit), and it gives the same bits on every path and every CPU: each sum runs 16 lanes
// (lane l adds products k = l mod 16, in order, multiply then add, no fused operations) that
// are then added in a fixed tree, the one-hot rows are added after the product, ascending by
// expert, and GELU is the C library's erff; the AVX-512 and AVX2 (F16C) paths only do the same
// lanes in registers. The weights come in as fp16 and convert exactly. On several rows each
// weight row is converted once for up to 8 of them, each keeping its own lanes; on few rows
// several weight rows go at once (8 for one row on AVX-512), so that their adds do not wait on
// one another, and the one-hot rows a set names are converted once a call and added over a
// span of outputs at once. The built-in model's head (D 256, W 512, E 32, K 8), stage 12, in
// cache: from 28 us to 18 us a row, and 8 rows from 131-134 us to 82-87 us; in a decode step,
// its weights coming from L3, from 42 us to 33 us.
//
// With stage > 0 it also picks the consumer's top-`stage` experts from the logits as
// routing.py softmax_topk does (ATen's softmax and topk, so the same set), each row's ascending,
// and the bool [B, E] mask of them: what the prerouter stages, in the same call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "heads.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define EDGE0_X86 1
#endif

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kRowsAtOnce = 8;  // rows a weight row is converted once for (project)
enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// The lanes' fixed tree: (l, l + 8), then (l, l + 4), (l, l + 2), (l, l + 1).
inline float tree(float* acc) {
  for (int64_t s = kLanes / 2; s >= 1; s /= 2)
    for (int64_t l = 0; l < s; ++l) acc[l] = acc[l] + acc[l + s];
  return acc[0];
}

// The products past the last whole 16 (k from `from`), into their lanes.
inline void tail(const c10::Half* w, const float* x, int64_t from, int64_t n, float* acc) {
  for (int64_t k = from; k < n; ++k) acc[k - from] = acc[k - from] + static_cast<float>(w[k]) * x[k];
}

float dot_portable(const c10::Half* w, const float* x, int64_t n) {
  float acc[kLanes] = {};
  const int64_t whole = n / kLanes * kLanes;
  for (int64_t k = 0; k < whole; k += kLanes)
    for (int64_t l = 0; l < kLanes; ++l)
      acc[l] = acc[l] + static_cast<float>(w[k + l]) * x[k + l];
  tail(w, x, whole, n, acc);
  return tree(acc);
}

// The kernels' loops over weight rows and rows run a template's count of times: unrolled,
// their sums stay in registers (GCC's -O2 left them on the stack, a load and store per add).
#define EDGE0_UNROLL _Pragma("GCC unroll 8")

#ifdef EDGE0_X86
// tree()'s additions over 16 lanes whose first step, (l, l + 8), gave s8: then (l, l + 4),
// (l, l + 2), (l, l + 1), in registers.
__attribute__((target("avx2"))) inline float tree_from_8(__m256 s8) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// dot_portable(w[j], x[b]) for `m` rows j of w [m, n] and `rows` rows b of x [rows, n], into
// out[j * rows + b], bit for bit: each (j, b) keeps its own 16 lanes, adding the same
// products in the same order, in registers (AVX2: lanes 0-7 and 8-15 in two vectors). A
// weight row is converted once for all rows; several weight rows at once give the adds
// chains that do not wait on each other (one row's chain is an add's latency per 16 weights).
// A step reads every head once, from memory: the kernels prefetch the same place in the next
// m weight rows, where the hardware prefetcher alone left a head at ~11 GB/s.
template <int64_t rows, int64_t m>
__attribute__((target("avx2,f16c"))) void dots_avx2(const c10::Half* w, const float* x,
                                                    int64_t n, float* out) {
  __m256 lo[m][rows], hi[m][rows];
  EDGE0_UNROLL
  for (int64_t j = 0; j < m; ++j)
    EDGE0_UNROLL
    for (int64_t b = 0; b < rows; ++b) lo[j][b] = hi[j][b] = _mm256_setzero_ps();
  const int64_t whole = n / kLanes * kLanes;
  for (int64_t k = 0; k < whole; k += kLanes)
    EDGE0_UNROLL
    for (int64_t j = 0; j < m; ++j) {
      const c10::Half* wj = w + j * n + k;
      _mm_prefetch(reinterpret_cast<const char*>(wj + m * n), _MM_HINT_T0);
      const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj)));
      const __m256 w1 =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj + 8)));
      EDGE0_UNROLL
      for (int64_t b = 0; b < rows; ++b) {
        const float* xb = x + b * n;
        lo[j][b] = _mm256_add_ps(lo[j][b], _mm256_mul_ps(w0, _mm256_loadu_ps(xb + k)));
        hi[j][b] = _mm256_add_ps(hi[j][b], _mm256_mul_ps(w1, _mm256_loadu_ps(xb + k + 8)));
      }
    }
  EDGE0_UNROLL
  for (int64_t j = 0; j < m; ++j)
    EDGE0_UNROLL
    for (int64_t b = 0; b < rows; ++b) {
      if (whole == n) {
        out[j * rows + b] = tree_from_8(_mm256_add_ps(lo[j][b], hi[j][b]));
        continue;
      }
      float acc[kLanes];
      _mm256_storeu_ps(acc, lo[j][b]);
      _mm256_storeu_ps(acc + 8, hi[j][b]);
      tail(w + j * n, x + b * n, whole, n, acc);
      out[j * rows + b] = tree(acc);
    }
}

template <int64_t rows, int64_t m>
__attribute__((target("avx512f,avx2,f16c"))) void dots_avx512(const c10::Half* w,
                                                              const float* x, int64_t n,
                                                              float* out) {
  __m512 a[m][rows];
  EDGE0_UNROLL
  for (int64_t j = 0; j < m; ++j)
    EDGE0_UNROLL
    for (int64_t b = 0; b < rows; ++b) a[j][b] = _mm512_setzero_ps();
  const int64_t whole = n / kLanes * kLanes;
  for (int64_t k = 0; k < whole; k += kLanes)
    EDGE0_UNROLL
    for (int64_t j = 0; j < m; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + m) * n + k), _MM_HINT_T0);
      const __m512 wk =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * n + k)));
      EDGE0_UNROLL
      for (int64_t b = 0; b < rows; ++b)
        a[j][b] = _mm512_add_ps(a[j][b], _mm512_mul_ps(wk, _mm512_loadu_ps(x + b * n + k)));
    }
  EDGE0_UNROLL
  for (int64_t j = 0; j < m; ++j)
    EDGE0_UNROLL
    for (int64_t b = 0; b < rows; ++b) {
      if (whole == n) {
        out[j * rows + b] = tree_from_8(_mm256_add_ps(
            _mm512_castps512_ps256(a[j][b]),
            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j][b]), 1))));
        continue;
      }
      float acc[kLanes];
      _mm512_storeu_ps(acc, a[j][b]);
      tail(w + j * n, x + b * n, whole, n, acc);
      out[j * rows + b] = tree(acc);
    }
}
#endif

// Weight rows taken at once for `rows` rows of x, within the registers: AVX-512 has 32 of
// them, AVX2 16, and an AVX2 sum takes two.
constexpr int64_t kMaxWeightRows = 8;
constexpr int64_t weight_rows_avx512(int64_t rows) {
  return rows == 1 ? 8 : rows == 2 ? 4 : rows <= 4 ? 2 : 1;
}
constexpr int64_t weight_rows_avx2(int64_t rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

// The row counts as template arguments, so that each row's sums stay in registers. A kernel
// takes Kernel<R>::kWide weight rows where that many are left, else one; it returns how many.
template <template <int64_t> class Kernel>
int64_t dispatch_rows(const c10::Half* w, int64_t left, const float* x, int64_t rows, int64_t n,
                      float* out) {
  switch (rows) {
    case 1: return Kernel<1>::run(w, left, x, n, out);
    case 2: return Kernel<2>::run(w, left, x, n, out);
    case 3: return Kernel<3>::run(w, left, x, n, out);
    case 4: return Kernel<4>::run(w, left, x, n, out);
    case 5: return Kernel<5>::run(w, left, x, n, out);
    case 6: return Kernel<6>::run(w, left, x, n, out);
    case 7: return Kernel<7>::run(w, left, x, n, out);
    default: return Kernel<8>::run(w, left, x, n, out);
  }
}

#ifdef EDGE0_X86
template <int64_t R>
struct Avx2Rows {
  static constexpr int64_t kWide = weight_rows_avx2(R);
  static int64_t run(const c10::Half* w, int64_t left, const float* x, int64_t n, float* out) {
    if (left >= kWide) return dots_avx2<R, kWide>(w, x, n, out), kWide;
    return dots_avx2<R, 1>(w, x, n, out), 1;
  }
};
template <int64_t R>
struct Avx512Rows {
  static constexpr int64_t kWide = weight_rows_avx512(R);
  static int64_t run(const c10::Half* w, int64_t left, const float* x, int64_t n, float* out) {
    if (left >= kWide) return dots_avx512<R, kWide>(w, x, n, out), kWide;
    return dots_avx512<R, 1>(w, x, n, out), 1;
  }
};

int64_t dots_avx2_any(const c10::Half* w, int64_t left, const float* x, int64_t rows, int64_t n,
                      float* out) {
  return dispatch_rows<Avx2Rows>(w, left, x, rows, n, out);
}
int64_t dots_avx512_any(const c10::Half* w, int64_t left, const float* x, int64_t rows,
                        int64_t n, float* out) {
  return dispatch_rows<Avx512Rows>(w, left, x, rows, n, out);
}
#endif

int64_t dots_portable(const c10::Half* w, int64_t, const float* x, int64_t rows, int64_t n,
                      float* out) {
  for (int64_t b = 0; b < rows; ++b) out[b] = dot_portable(w, x + b * n, n);
  return 1;
}

// out[j * rows + b] = dot(w[j], x[b]) for rows b of x [rows, n] (at most kRowsAtOnce) and the
// first m rows j of w [left, n], m (returned) at least 1 and at most min(left, kMaxWeightRows).
using Dots = int64_t (*)(const c10::Half*, int64_t, const float*, int64_t, int64_t, float*);

// y[i] = y[i] + r[i] for i in [0, n): element by element, so each path's bits are the scalar
// loop's (GCC's -O2 does not vectorize a loop of unknown length).
using AddRow = void (*)(float*, const float*, int64_t);

#ifdef EDGE0_X86
__attribute__((target("avx512f"))) void add_row_avx512(float* y, const float* r, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_add_ps(_mm512_loadu_ps(y + i), _mm512_loadu_ps(r + i)));
  for (; i < n; ++i) y[i] = y[i] + r[i];
}
__attribute__((target("avx2"))) void add_row_avx2(float* y, const float* r, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(r + i)));
  for (; i < n; ++i) y[i] = y[i] + r[i];
}
#endif

void add_row_portable(float* y, const float* r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] + r[i];
}

// A path's kernels: the dots and the row additions.
struct Kernels {
  Dots dots;
  AddRow add_row;
};

Kernels kernels_for(int64_t isa) {
#ifdef EDGE0_X86
  if (isa == kAvx512 && __builtin_cpu_supports("avx512f"))
    return {dots_avx512_any, add_row_avx512};
  if (isa >= kAvx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
    return {dots_avx2_any, add_row_avx2};
#endif
  return {dots_portable, add_row_portable};
}

// Each row's set experts, ascending: executed ones at their index, previous ones at E + index
// (a negative index is no expert: a request's first position has no previous step).
std::vector<std::vector<int64_t>> hot_rows(const at::Tensor& executed, const at::Tensor& previous,
                                           int64_t rows, int64_t experts) {
  std::vector<std::vector<int64_t>> out(rows);
  const auto ex = executed.accessor<int64_t, 2>();
  const auto pr = previous.accessor<int64_t, 2>();
  for (int64_t b = 0; b < rows; ++b) {
    std::vector<int64_t> now, before;
    for (int64_t j = 0; j < ex.size(1); ++j) now.push_back(ex[b][j]);
    for (int64_t j = 0; j < pr.size(1); ++j)
      if (pr[b][j] >= 0) before.push_back(pr[b][j]);
    std::sort(now.begin(), now.end());
    std::sort(before.begin(), before.end());
    for (int64_t e : now) {
      TORCH_CHECK(e < experts, "executed expert ", e, " of ", experts);
      out[b].push_back(e);
    }
    for (int64_t e : before) {
      TORCH_CHECK(e < experts, "previous expert ", e, " of ", experts);
      out[b].push_back(experts + e);
    }
  }
  return out;
}

constexpr float kAlpha = static_cast<float>(M_SQRT1_2);

// The rows of hot [2E, N] that some row's set names, in fp32 (fp16 converts exactly), and
// each set as indices of them, in the set's order.
struct Hot {
  std::vector<float> rows;  // [U, N]
  std::vector<std::vector<int64_t>> sets;
};

#ifdef EDGE0_X86
__attribute__((target("avx2,f16c"))) void widen_f16c(const c10::Half* src, int64_t n,
                                                     float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

void widen(const c10::Half* src, int64_t n, float* dst) {
#ifdef EDGE0_X86
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return widen_f16c(src, n, dst);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

Hot hot_floats(const at::Tensor& hot, const std::vector<std::vector<int64_t>>& sets) {
  std::vector<int64_t> used;
  for (const auto& set : sets) used.insert(used.end(), set.begin(), set.end());
  std::sort(used.begin(), used.end());
  used.erase(std::unique(used.begin(), used.end()), used.end());
  const int64_t n = hot.size(1);
  const c10::Half* src = reinterpret_cast<const c10::Half*>(hot.data_ptr<at::Half>());
  Hot out{std::vector<float>(used.size() * n), {}};
  for (size_t j = 0; j < used.size(); ++j) widen(src + used[j] * n, n, out.rows.data() + j * n);
  for (const auto& set : sets) {
    std::vector<int64_t> at;
    for (int64_t e : set) at.push_back(std::lower_bound(used.begin(), used.end(), e) - used.begin());
    out.sets.push_back(at);
  }
  return out;
}

// y[b, n] = W[n] . x[b] + the hot rows' column n, for n in [0, N): W [N, D], `hot` the rows
// of hot_floats; then with `gelu`, ATen's gelu_erf of it. Each weight row is converted once
// for the rows. A row's hot rows are added after its dots, one after another in the set's
// order, over the whole span of outputs at once (per output they were a chain of dependent
// scalar adds: 8K of them for a row of the built-in model's fc1).
void project(const c10::Half* w, const Hot* hot, const float* x, int64_t rows, int64_t n,
             int64_t d, const Kernels& k, bool gelu, float* y) {
  const float* hp = hot != nullptr ? hot->rows.data() : nullptr;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (2 * d));  // ~64 KiB of weights
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float v[kMaxWeightRows * kRowsAtOnce];
    for (int64_t b0 = 0; b0 < rows; b0 += kRowsAtOnce) {
      const int64_t count = std::min(kRowsAtOnce, rows - b0);
      for (int64_t i0 = begin; i0 < end;) {
        const int64_t m = k.dots(w + i0 * d, end - i0, x + b0 * d, count, d, v);
        for (int64_t j = 0; j < m; ++j)
          for (int64_t c = 0; c < count; ++c) y[(b0 + c) * n + i0 + j] = v[j * count + c];
        i0 += m;
      }
    }
    for (int64_t b = 0; b < rows; ++b) {
      float* yb = y + b * n + begin;
      if (hp != nullptr)
        for (int64_t e : hot->sets[b]) k.add_row(yb, hp + e * n + begin, end - begin);
      if (gelu)
        for (int64_t i = 0; i < end - begin; ++i)
          yb[i] = yb[i] * 0.5f * (1.0f + std::erf(yb[i] * kAlpha));
    }
  });
}

const c10::Half* half(const at::Tensor& t) {
  return reinterpret_cast<const c10::Half*>(t.data_ptr<at::Half>());
}

void check_half(const at::Tensor& t, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 2 &&
                  t.size(0) == rows && t.size(1) == cols,
              name, " must be contiguous fp16 [", rows, ", ", cols, "], got ", t.sizes());
}

}  // namespace

namespace edge0 {

// h [B, D] (fp32 or bf16), executed [B, K] and previous [B, K'] (int64; negative: none), and
// the head's fp16 parts: w1 [W, D], w1_hot [2E, W], w2 [E, W], w0 [E, D], w0_hot [2E, E]
// -> [logits fp32 [B, E]], and with stage > 0 also [chosen int64 [B, stage] ascending, allowed
// bool [B, E]].
std::vector<at::Tensor> prerouter_head(const at::Tensor& h, const at::Tensor& executed,
                                       const at::Tensor& previous, const at::Tensor& w1,
                                       const at::Tensor& w1_hot, const at::Tensor& w2,
                                       const at::Tensor& w0, const at::Tensor& w0_hot,
                                       int64_t stage, int64_t isa) {
  RECORD_FUNCTION("edge0::prerouter_head", std::vector<c10::IValue>());
  TORCH_CHECK(h.dim() == 2, "h must be [B, D], got ", h.sizes());
  const int64_t rows = h.size(0), d = h.size(1), width = w1.size(0), experts = w2.size(0);
  check_half(w1, width, d, "w1");
  check_half(w1_hot, 2 * experts, width, "w1_hot");
  check_half(w2, experts, width, "w2");
  check_half(w0, experts, d, "w0");
  check_half(w0_hot, 2 * experts, experts, "w0_hot");
  TORCH_CHECK(executed.scalar_type() == at::kLong && executed.dim() == 2 &&
                  executed.size(0) == rows,
              "executed must be int64 [B, K]");
  TORCH_CHECK(previous.scalar_type() == at::kLong && previous.dim() == 2 &&
                  previous.size(0) == rows,
              "previous must be int64 [B, K]");
  TORCH_CHECK(stage >= 0 && stage <= experts, "stage ", stage, " of ", experts, " experts");
  const at::Tensor x = h.to(at::kFloat).contiguous();
  const auto sets = hot_rows(executed.contiguous(), previous.contiguous(), rows, experts);
  const Kernels kernels = kernels_for(isa);

  std::vector<float> hidden(rows * width), linear(rows * experts), out2(rows * experts);
  const Hot hot1 = hot_floats(w1_hot, sets), hot0 = hot_floats(w0_hot, sets);
  project(half(w1), &hot1, x.data_ptr<float>(), rows, width, d, kernels, true, hidden.data());
  project(half(w2), nullptr, hidden.data(), rows, experts, width, kernels, false, out2.data());
  project(half(w0), &hot0, x.data_ptr<float>(), rows, experts, d, kernels, false, linear.data());
  at::Tensor logits = at::empty({rows, experts}, x.options());
  float* lp = logits.data_ptr<float>();
  for (int64_t i = 0; i < rows * experts; ++i) lp[i] = out2[i] + linear[i];
  if (stage == 0) return {logits};

  // routing.softmax_topk's choice at k = stage: top-k of the fp32 softmax
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  at::Tensor chosen = std::get<1>(at::topk(probs, stage, -1)).contiguous();
  at::Tensor allowed = at::zeros({rows, experts}, x.options().dtype(at::kBool));
  int64_t* cp = chosen.data_ptr<int64_t>();
  bool* ap = allowed.data_ptr<bool>();
  for (int64_t b = 0; b < rows; ++b) {
    std::sort(cp + b * stage, cp + (b + 1) * stage);
    for (int64_t j = 0; j < stage; ++j) ap[b * experts + cp[b * stage + j]] = true;
  }
  return {logits, chosen, allowed};
}

}  // namespace edge0

TORCH_LIBRARY_FRAGMENT(edge0, m) {
  m.def(
      "prerouter_head(Tensor h, Tensor executed, Tensor previous, Tensor w1, Tensor w1_hot, "
      "Tensor w2, Tensor w0, Tensor w0_hot, int stage, int isa) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(edge0, CPU, m) { m.impl("prerouter_head", &edge0::prerouter_head); }
