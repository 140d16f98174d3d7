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
// weight row is converted once for up to 8 of them, each keeping its own lanes, and the one-hot
// rows a set names are converted once a call: an 8-row head took 97 us, from 129 (D 256,
// W 512, E 32; one row 22 us either way).
//
// With stage > 0 it also picks the consumer's top-`stage` experts from the logits as
// routing.py softmax_topk does (ATen's softmax and topk, so the same set), each row's ascending,
// and the bool [B, E] mask of them: what the prerouter stages, in the same call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/Half.h>
#include <torch/library.h>

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

#ifdef EDGE0_X86
// tree()'s additions over 16 lanes whose first step, (l, l + 8), gave s8: then (l, l + 4),
// (l, l + 2), (l, l + 1), in registers.
__attribute__((target("avx2"))) inline float tree_from_8(__m256 s8) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// dot_portable(w, x[b]) for `rows` rows b of x [rows, n], bit for bit: each row's 16 lanes
// add the same products in the same order, in registers (AVX2: lanes 0-7 and 8-15 in two
// vectors), and w is converted once for all rows.
template <int64_t rows>
__attribute__((target("avx2,f16c"))) void dots_avx2(const c10::Half* w, const float* x,
                                                    int64_t n, float* out) {
  __m256 lo[rows], hi[rows];
  for (int64_t b = 0; b < rows; ++b) lo[b] = hi[b] = _mm256_setzero_ps();
  const int64_t whole = n / kLanes * kLanes;
  for (int64_t k = 0; k < whole; k += kLanes) {
    const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
    const __m256 w1 =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 8)));
    for (int64_t b = 0; b < rows; ++b) {
      const float* xb = x + b * n;
      lo[b] = _mm256_add_ps(lo[b], _mm256_mul_ps(w0, _mm256_loadu_ps(xb + k)));
      hi[b] = _mm256_add_ps(hi[b], _mm256_mul_ps(w1, _mm256_loadu_ps(xb + k + 8)));
    }
  }
  for (int64_t b = 0; b < rows; ++b) {
    if (whole == n) {
      out[b] = tree_from_8(_mm256_add_ps(lo[b], hi[b]));
      continue;
    }
    float acc[kLanes];
    _mm256_storeu_ps(acc, lo[b]);
    _mm256_storeu_ps(acc + 8, hi[b]);
    tail(w, x + b * n, whole, n, acc);
    out[b] = tree(acc);
  }
}

template <int64_t rows>
__attribute__((target("avx512f,avx2,f16c"))) void dots_avx512(const c10::Half* w,
                                                              const float* x, int64_t n,
                                                              float* out) {
  __m512 a[rows];
  for (int64_t b = 0; b < rows; ++b) a[b] = _mm512_setzero_ps();
  const int64_t whole = n / kLanes * kLanes;
  for (int64_t k = 0; k < whole; k += kLanes) {
    const __m512 wk =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k)));
    for (int64_t b = 0; b < rows; ++b)
      a[b] = _mm512_add_ps(a[b], _mm512_mul_ps(wk, _mm512_loadu_ps(x + b * n + k)));
  }
  for (int64_t b = 0; b < rows; ++b) {
    if (whole == n) {
      out[b] = tree_from_8(_mm256_add_ps(
          _mm512_castps512_ps256(a[b]),
          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[b]), 1))));
      continue;
    }
    float acc[kLanes];
    _mm512_storeu_ps(acc, a[b]);
    tail(w, x + b * n, whole, n, acc);
    out[b] = tree(acc);
  }
}
#endif

// The row counts as template arguments, so that each row's sums stay in registers.
template <template <int64_t> class Kernel>
void dispatch_rows(const c10::Half* w, const float* x, int64_t rows, int64_t n, float* out) {
  switch (rows) {
    case 1: return Kernel<1>::run(w, x, n, out);
    case 2: return Kernel<2>::run(w, x, n, out);
    case 3: return Kernel<3>::run(w, x, n, out);
    case 4: return Kernel<4>::run(w, x, n, out);
    case 5: return Kernel<5>::run(w, x, n, out);
    case 6: return Kernel<6>::run(w, x, n, out);
    case 7: return Kernel<7>::run(w, x, n, out);
    default: return Kernel<8>::run(w, x, n, out);
  }
}

#ifdef EDGE0_X86
template <int64_t R>
struct Avx2Rows {
  static void run(const c10::Half* w, const float* x, int64_t n, float* out) {
    dots_avx2<R>(w, x, n, out);
  }
};
template <int64_t R>
struct Avx512Rows {
  static void run(const c10::Half* w, const float* x, int64_t n, float* out) {
    dots_avx512<R>(w, x, n, out);
  }
};

void dots_avx2_any(const c10::Half* w, const float* x, int64_t rows, int64_t n, float* out) {
  dispatch_rows<Avx2Rows>(w, x, rows, n, out);
}
void dots_avx512_any(const c10::Half* w, const float* x, int64_t rows, int64_t n, float* out) {
  dispatch_rows<Avx512Rows>(w, x, rows, n, out);
}
#endif

void dots_portable(const c10::Half* w, const float* x, int64_t rows, int64_t n, float* out) {
  for (int64_t b = 0; b < rows; ++b) out[b] = dot_portable(w, x + b * n, n);
}

// out[b] = dot(w, x[b]) for rows b of x [rows, n], at most kRowsAtOnce of them a call.
using Dots = void (*)(const c10::Half*, const float*, int64_t, int64_t, float*);

Dots dots_for(int64_t isa) {
#ifdef EDGE0_X86
  if (isa == kAvx512 && __builtin_cpu_supports("avx512f")) return dots_avx512_any;
  if (isa >= kAvx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
    return dots_avx2_any;
#endif
  return dots_portable;
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
// for the rows.
void project(const c10::Half* w, const Hot* hot, const float* x, int64_t rows, int64_t n,
             int64_t d, Dots dots, bool gelu, float* y) {
  const float* hp = hot != nullptr ? hot->rows.data() : nullptr;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (2 * d));  // ~64 KiB of weights
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float v[kRowsAtOnce];
    for (int64_t i = begin; i < end; ++i)
      for (int64_t b0 = 0; b0 < rows; b0 += kRowsAtOnce) {
        const int64_t count = std::min(kRowsAtOnce, rows - b0);
        dots(w + i * d, x + b0 * d, count, d, v);
        for (int64_t j = 0; j < count; ++j) {
          const int64_t b = b0 + j;
          float u = v[j];
          if (hp != nullptr)
            for (int64_t e : hot->sets[b]) u = u + hp[e * n + i];
          if (gelu) u = u * 0.5f * (1.0f + std::erf(u * kAlpha));
          y[b * n + i] = u;
        }
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
  const Dots dots = dots_for(isa);

  std::vector<float> hidden(rows * width), linear(rows * experts), out2(rows * experts);
  const Hot hot1 = hot_floats(w1_hot, sets), hot0 = hot_floats(w0_hot, sets);
  project(half(w1), &hot1, x.data_ptr<float>(), rows, width, d, dots, true, hidden.data());
  project(half(w2), nullptr, hidden.data(), rows, experts, width, dots, false, out2.data());
  project(half(w0), &hot0, x.data_ptr<float>(), rows, experts, d, dots, false, linear.data());
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(edge0, m) {
  m.def(
      "prerouter_head(Tensor h, Tensor executed, Tensor previous, Tensor w1, Tensor w1_hot, "
      "Tensor w2, Tensor w0, Tensor w0_hot, int stage, int isa) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(edge0, CPU, m) { m.impl("prerouter_head", &prerouter_head); }
