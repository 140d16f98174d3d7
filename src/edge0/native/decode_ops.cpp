// Native decode ops: the operations of a pure-PyTorch path, in the same order, in one call.
//
// edge0::attention_rows: one decode token of each of B sequences (one request's step: B = 1)
// through a decoder layer's norm, GQA attention, residual and post-attention norm (the
// reference: models/blocks.py DecoderLayer.forward with models/layers.py Attention.forward),
// see below. Its int4 projections go through edge0::int4_gemv (int4_gemv.cpp), which computes
// what torch's int4 kernel computes bit for bit; its norms, rotary and residual are loops that
// round where the reference's ops round (norms.cpp); SDPA and float projections are the
// reference's ATen ops. So the result is bit-identical to the reference; what the op saves is
// the ~100 ATen ops, the Python and the dispatch between them.
//
// edge0::router_topk, edge0::softmax_topk and edge0::moe_combine: the same layer's routing
// (the softmax families', with its own router or a prediction) and its weighted sum of
// experts and residual.
//
// edge0.TokenDecoder: a decode token of one sequence (or of each of a batched step's B)
// through every decoder layer in one call, each layer those ops in the order the engine calls
// them one by one, its experts taken from a table of every expert's tensors given once (see
// the class).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "attention.h"
#include "handoff.h"
#include "heads.h"
#include "int4_gemv.h"
#include "norms.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace {

using edge0::floats;

// From this many positions a decode token attends with edge0's own kernel (attention.cpp),
// which reads the cache as stored, once per kv head; below it, with ATen's SDPA, whose bits
// the module path's are. Where they cross on the bench shape: docs/kernels.md. With int8
// activations (an `isa` with edge0::kInt8Flag), whose projections are not the module path's
// bits anyway, from the first position: SDPA's dispatch and the cache's conversion to the
// compute dtype cost more than the attention itself at short contexts.
constexpr int64_t kNativeAttentionFrom = 256;

int64_t native_attention_from() { return kNativeAttentionFrom; }

bool native_attention(int64_t len, int64_t head_dim, int64_t isa) {
  const bool from = len >= kNativeAttentionFrom || isa >= edge0::kInt8Flag;
  return from && head_dim % 16 == 0 && head_dim <= 512;
}

// Projections as models/int4.py Int4Linear, nn.Linear and lora.py LoraLinear compute them.
// Each `p`: [packed, pairs] (int4) or [weight] (float), then [lora_A, lora_B] if it has an
// adapter, whose output is scaled by its `lora_scale`. The int4 ones take one parallel region.
bool dense(const at::Tensor& w) {
  const auto dtype = w.scalar_type();
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

// A float product of one row that ATen's mm (MKL's, on x86) runs on one thread: a layer's
// router, 128 x 1024 fp32 (0.5 MiB, not in the cache after the rest of the step), took 45 us,
// one core's read rate, 1.1 ms of a 12 ms step on the bench shape. Its two halves of outputs
// on two threads compute the same bits as the whole where the kernel sums each output alike
// whatever the output count: on one AMD EPYC (Zen 4) so for halves of multiples of 16, not for
// halves of 30. Where that holds is the library's and the CPU's to say, so the first call of
// each kind of product (shape, dtypes, alignment) computes both and compares; the halves are
// used from then on only where they were equal. Keyed by (outputs, inputs, weight dtype, row
// dtype, weight row stride, weight and row addresses mod 64): 1 the halves, 0 the whole.
using SplitKey = std::tuple<int64_t, int64_t, int, int, int64_t, int64_t, int64_t>;

int split_verdict(const SplitKey& key, int record = -1) {
  static std::mutex mutex;
  static std::map<SplitKey, int> verdicts;
  const std::lock_guard<std::mutex> lock(mutex);
  if (record >= 0) verdicts[key] = record;
  const auto it = verdicts.find(key);
  return it == verdicts.end() ? -1 : it->second;
}

// at::linear(row, w) for one row [1, D], its outputs' halves on two threads where that gives
// the same bits (above).
at::Tensor linear_row(const at::Tensor& row, const at::Tensor& w) {
  const int64_t n = w.size(0), half = n / 2;
  if (n < 64 || half % 16 != 0 || w.size(1) < 256 || at::get_num_threads() < 2 ||
      at::in_parallel_region())
    return at::linear(row, w);
  const auto address = reinterpret_cast<uintptr_t>(w.data_ptr());
  const auto row_address = reinterpret_cast<uintptr_t>(row.data_ptr());
  const SplitKey key{n,
                     w.size(1),
                     static_cast<int>(w.scalar_type()),
                     static_cast<int>(row.scalar_type()),
                     w.stride(0),
                     static_cast<int64_t>(address % 64),
                     static_cast<int64_t>(row_address % 64)};
  const int verdict = split_verdict(key);
  if (verdict == 0) return at::linear(row, w);
  at::Tensor halves[2];
  const bool grad = at::GradMode::is_enabled();
  at::parallel_for(0, 2, 1, [&](int64_t lo, int64_t hi) {
    const at::AutoGradMode mode(grad);  // a worker thread's own grad mode is the default's
    for (int64_t t = lo; t < hi; ++t) halves[t] = at::linear(row, w.narrow(0, t * half, half));
  });
  at::Tensor y = at::cat({halves[0], halves[1]}, -1);
  if (verdict < 0) {  // the first of its kind: keep the whole's result, note whether they agree
    at::Tensor whole = at::linear(row, w);
    split_verdict(key, at::equal(whole, y) ? 1 : 0);
    return whole;
  }
  return y;
}

// at::linear(x, w) (x [..., D], no bias) with each of x's rows computed alone, as a step of
// that row's sequence alone computes it: a float matmul over several rows adds in another
// order than over one (~1e-7 relative), and with int8 activations such a difference upstream
// of an activation's int8 code moves it by a whole step. So a batched decode step's router,
// adapters and float projections give every row the bits of its own step; the weights, small
// next to a step's experts, are read once a row (docs/kernels.md, "Batch-invariant rows").
at::Tensor linear_each_row(const at::Tensor& x, const at::Tensor& w) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  const int64_t n = rows.size(0);
  auto shape = x.sizes().vec();
  shape.back() = w.size(0);
  if (n == 1) return linear_row(rows, w).view(shape);
  std::vector<at::Tensor> ys;
  ys.reserve(n);
  // each row in a fresh buffer of its own, aligned as a lone row is
  for (int64_t i = 0; i < n; ++i) ys.push_back(linear_row(rows.narrow(0, i, 1).clone(), w));
  return at::cat(ys).view(shape);
}

// y + scale * ((x @ A^T) @ B^T), as lora.py LoraLinear adds it, into y (a fresh fp32 or bf16
// result): the products ATen's mm on each row (what matmul folds x [.., D] into), the delta
// rounded to y's dtype, then scaled by the float scale and added, each rounded to y's dtype,
// as the scalar mul's and add's kernels round them. One loop instead of their dispatch,
// conversions and two temporaries: a LoRA'd projection of the built-in model took ~9 us
// outside its products.
void add_lora(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, double scale,
              at::Tensor& y) {
  const bool bf16 = y.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || y.scalar_type() == at::kFloat) && y.is_contiguous(),
              "a LoRA'd projection's result must be contiguous fp32 or bf16");
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  const at::Tensor xa = rows.scalar_type() == a.scalar_type() ? rows : rows.to(a.scalar_type());
  const at::Tensor delta = floats(linear_each_row(linear_each_row(xa, a), b));
  TORCH_CHECK(delta.numel() == y.numel(), "LoRA B's rows must be the projection's outputs");
  const float s = static_cast<float>(scale);
  const float* dp = delta.data_ptr<float>();
  const int64_t n = y.numel();
  if (!bf16) {
    float* yp = y.data_ptr<float>();
    for (int64_t j = 0; j < n; ++j) yp[j] = yp[j] + dp[j] * s;
    return;
  }
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  for (int64_t j = 0; j < n; ++j) {
    const float scaled = edge0::bf16_round(edge0::bf16_round(dp[j]) * s);
    yp[j] = c10::BFloat16(static_cast<float>(yp[j]) + scaled);
  }
}

std::vector<at::Tensor> project(const at::Tensor& x, const std::vector<at::TensorList>& ps,
                                at::ArrayRef<double> lora_scale, at::IntArrayRef layout,
                                int64_t isa) {
  std::vector<at::Tensor> ys(ps.size()), packed, pairs;
  std::vector<size_t> int4;
  for (size_t i = 0; i < ps.size(); ++i) {
    if (dense(ps[i][0])) {
      ys[i] = linear_each_row(x, ps[i][0]);
    } else {
      int4.push_back(i);
      packed.push_back(ps[i][0]);
      pairs.push_back(ps[i][1]);
    }
  }
  const auto outs = edge0::int4_gemv_each(x, packed, pairs, layout, isa);
  for (size_t j = 0; j < int4.size(); ++j) ys[int4[j]] = outs[j];
  for (size_t i = 0; i < ps.size(); ++i) {
    const size_t used = dense(ps[i][0]) ? 1 : 2;
    if (ps[i].size() > used) add_lora(x, ps[i][used], ps[i][used + 1], lora_scale[i], ys[i]);
  }
  return ys;
}

// layers.py apply_rotary over every channel of one head's vector, in place:
// x * cos + rotate_half(x) * sin, each product and the sum rounded as the ATen ops round them
// (to bf16 with `bf16`).
void rotary(float* x, const float* cos, const float* sin, int64_t dim, bool bf16) {
  auto rot = [&](float v, float rotated, int64_t d) {
    const float a = edge0::round_to(v * cos[d], bf16);
    const float b = edge0::round_to(rotated * sin[d], bf16);
    return edge0::round_to(a + b, bf16);
  };
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) {  // rotate_half(x) is [-x2, x1]
    const float x1 = x[d], x2 = x[d + half];
    x[d] = rot(x1, -x2, d);
    x[d + half] = rot(x2, x1, d + half);
  }
}

// Writes the float row `src` [dim] into position n of head g of a cache [1, G, max, dim] in
// its dtype (the values are exact in it: rounded where the reference rounds).
void store_row(at::Tensor& cache, int64_t g, int64_t n, const float* src, int64_t dim) {
  const int64_t at = (g * cache.size(2) + n) * dim;
  if (cache.scalar_type() == at::kFloat) {
    std::memcpy(cache.data_ptr<float>() + at, src, dim * sizeof(float));
  } else {
    c10::BFloat16* dst = cache.data_ptr<c10::BFloat16>() + at;
    for (int64_t d = 0; d < dim; ++d) dst[d] = c10::BFloat16(src[d]);
  }
}

// RMSNorm of the rows of a float buffer in place, with the weight in the compute dtype.
void norm_in_place(at::Tensor& rows, const at::Tensor& weight, double eps, int64_t lanes,
                   bool bf16, bool zero_centred) {
  const at::Tensor w = floats(weight);
  const int64_t n = rows.size(-1);
  edge0::rms_norm_rows(rows.data_ptr<float>(), w.data_ptr<float>(), rows.data_ptr<float>(),
                       rows.numel() / n, n, static_cast<float>(eps), lanes, bf16, zero_centred);
}

// edge0::attention_rows: blocks.py DecoderLayer's attention half for one decode token of each
// of B sequences, x [B, 1, D] -> (x + attention(norm(x)), post_norm(that)), in fp32 or bf16
// (every tensor in x's dtype): what the module path computes on one request's decode token
// (B = 1) or on the B rows of a batched step (models/base.py RowsForward, each row with its
// own cache and position: layers.py RowCaches with attend_rows). The attention is layers.py
// Attention.forward with q/k RMSNorm per head or none, full or partial rotary (the first
// `cos`-row channels of each head), no window, clip or bias, and with `output_gate`
// Qwen3.5's sigmoid gate that q_proj computes beside each head's query; with `zero_centred`
// every norm is ZeroCenteredRMSNorm (1 + w): the same operations in the same order, row b's key and value written at position
// n[b] of its cache buffers [1, G, max, Dh], then its query's attention over positions
// 0..n[b], row by row (SDPA, or edge0's own kernel: native_attention above). The norms, the
// rotary and the residual are loops over floats that round where the module's ops round
// (norms.cpp; `lanes`: sum_lanes), the products edge0's int4 kernels or ATen's on each row
// as on one (linear_each_row): with bf16 activations and SDPA, bit-identical to the module
// path's step of each row alone. `cos` and `sin` hold a row per sequence. The caches
// are in x's dtype, or bf16 under fp32 (KVCache's kv_dtype: keys and values rounded as
// stored, read back in fp32). In fp32 it works on the tensors' memory directly, without
// conversions.
std::vector<at::Tensor> attention_rows(
    const at::Tensor& x, const at::Tensor& input_norm, double input_eps,
    const at::Tensor& post_norm, double post_eps, at::TensorList q_proj, at::TensorList k_proj,
    at::TensorList v_proj, at::TensorList o_proj, at::ArrayRef<double> lora_scale,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
    double eps, const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
    at::TensorList v_caches, at::IntArrayRef n, int64_t heads, int64_t kv_heads, int64_t head_dim,
    double scale, int64_t lanes, at::IntArrayRef layout, int64_t isa, bool output_gate,
    bool zero_centred) {
  const auto dtype = x.scalar_type();
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(x.dim() == 3 && x.size(0) >= 1 && x.size(1) == 1 && (bf16 || dtype == at::kFloat),
              "x must be fp32 or bf16 [B, 1, D]");
  const int64_t rows = x.size(0);
  TORCH_CHECK(lora_scale.size() == 4, "one LoRA scale per projection");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == rows &&
                  static_cast<int64_t>(v_caches.size()) == rows &&
                  static_cast<int64_t>(n.size()) == rows,
              "one key buffer, value buffer and position per row");
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "cos and sin must be in x's dtype");
  const int64_t rot = cos.numel() / rows;  // the rotated channels: Dh, or fewer (partial)
  TORCH_CHECK(cos.numel() == rows * rot && sin.numel() == cos.numel() && rot <= head_dim,
              "cos and sin must be a row of at most Dh per sequence");
  TORCH_CHECK(rot % 2 == 0, "rotary needs an even width");
  for (int64_t b = 0; b < rows; ++b) {
    const at::Tensor &kc = k_caches[b], &vc = v_caches[b];
    TORCH_CHECK((kc.scalar_type() == dtype || kc.scalar_type() == at::kBFloat16) &&
                    vc.scalar_type() == kc.scalar_type(),
                "row ", b, ": the cache buffers must be in x's dtype or bf16");
    TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 4 && kc.size(0) == 1 &&
                    kc.size(1) == kv_heads && kc.size(3) == head_dim && vc.sizes() == kc.sizes(),
                "row ", b, ": the cache buffers must be contiguous [1, G, max, Dh]");
    TORCH_CHECK(n[b] >= 0 && n[b] < kc.size(2), "row ", b, ": position ", n[b],
                " is past its cache");
  }
  const at::Tensor h = edge0::rms_norm_as(x, input_norm, input_eps, lanes, zero_centred);
  const auto qkv = project(h, {q_proj, k_proj, v_proj}, lora_scale.slice(0, 3), layout, isa);
  // the projections' results are fresh tensors: q and k are normalised and rotated in place;
  // with an output gate q_proj gives each head [query | gate]
  at::Tensor q, gate;
  if (output_gate) {
    const at::Tensor both = qkv[0].view({rows, heads, 2, head_dim});
    q = floats(both.select(2, 0).contiguous()).view({rows * heads, head_dim});
    gate = both.select(2, 1).reshape({rows, 1, heads * head_dim});
  } else {
    q = floats(qkv[0]).view({rows * heads, head_dim});
  }
  at::Tensor k = floats(qkv[1]).view({rows * kv_heads, head_dim});
  const at::Tensor v = floats(qkv[2]);
  if (q_norm.has_value()) {
    RECORD_FUNCTION("edge0::rms_norm", std::vector<c10::IValue>());
    norm_in_place(q, *q_norm, eps, lanes, bf16, zero_centred);
    norm_in_place(k, *k_norm, eps, lanes, bf16, zero_centred);
  }
  {
    RECORD_FUNCTION("edge0::rotary", std::vector<c10::IValue>());
    const at::Tensor cf = floats(cos), sf = floats(sin);
    for (int64_t b = 0; b < rows; ++b) {
      const float* c = cf.data_ptr<float>() + b * rot;
      const float* s = sf.data_ptr<float>() + b * rot;
      for (int64_t i = 0; i < heads; ++i)
        rotary(q.data_ptr<float>() + (b * heads + i) * head_dim, c, s, rot, bf16);
      at::Tensor kc = k_caches[b], vc = v_caches[b];
      for (int64_t g = 0; g < kv_heads; ++g) {
        float* kg = k.data_ptr<float>() + (b * kv_heads + g) * head_dim;
        rotary(kg, c, s, rot, bf16);
        // the token's key and value at position n[b]
        store_row(kc, g, n[b], kg, head_dim);
        store_row(vc, g, n[b], v.data_ptr<float>() + (b * kv_heads + g) * head_dim, head_dim);
      }
    }
  }
  const at::Tensor qs = (bf16 ? q.to(dtype) : q).view({rows, heads, 1, head_dim});
  std::vector<at::Tensor> outs;
  outs.reserve(rows);
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t len = n[b] + 1;
    if (native_attention(len, head_dim, isa)) {
      // q's floats are what SDPA would take (under bf16 they are bf16 values already)
      at::Tensor o = at::empty({heads, head_dim}, x.options().dtype(at::kFloat));
      edge0::decode_attention(q.narrow(0, b * heads, heads), k_caches[b], v_caches[b], len,
                              scale, isa % edge0::kInt8Flag, o);
      outs.push_back((bf16 ? o.to(dtype) : o).view({1, heads, 1, head_dim}));
      continue;
    }
    outs.push_back(at::scaled_dot_product_attention(
        qs.narrow(0, b, 1), k_caches[b].narrow(2, 0, len).to(dtype),
        v_caches[b].narrow(2, 0, len).to(dtype), std::nullopt, 0.0, false, scale,
        kv_heads != heads));
  }
  const at::Tensor out = rows == 1 ? outs[0] : at::cat(outs);
  at::Tensor attended = out.transpose(1, 2).reshape({rows, 1, -1});
  if (output_gate) attended = at::mul(attended, at::sigmoid(gate));  // the module's ops
  const at::Tensor o =
      floats(project(attended, {o_proj}, lora_scale.slice(3), layout, isa)[0]);
  at::Tensor x1 = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  {
    RECORD_FUNCTION("edge0::residual", std::vector<c10::IValue>());
    const at::Tensor xf = floats(x);
    const float* xp = xf.data_ptr<float>();
    const float* op = o.data_ptr<float>();
    float* yp = x1.data_ptr<float>();
    for (int64_t i = 0; i < x1.numel(); ++i) yp[i] = edge0::round_to(xp[i] + op[i], bf16);
  }
  const at::Tensor x_out = bf16 ? x1.to(dtype) : x1;
  return {x_out, edge0::rms_norm_as(x_out, post_norm, post_eps, lanes, zero_centred)};
}

// The vector loops' functions: built for the CPU's widest vectors (x86: AVX-512, AVX2 or the
// baseline, picked at load through glibc's ifunc; elsewhere the baseline's) with GCC's
// vectorizer on. Their loops run along columns that do not depend on each other and
// contraction stays off (-ffp-contract=off), so every width computes the same bits.
#if defined(__x86_64__) && defined(__GLIBC__)
#define EDGE0_VECTOR_LOOPS                                 \
  __attribute__((target_clones("avx512f", "avx2", "default"), \
                 optimize("tree-vectorize", "vect-cost-model=dynamic")))
#else
#define EDGE0_VECTOR_LOOPS \
  __attribute__((optimize("tree-vectorize", "vect-cost-model=dynamic")))
#endif

// One value head's gated delta rule at one token, its state s [Dk, Dv] advanced in place and
// its output o [Dv], with q and k normalised: key row i decays by e[i * e_step] (one decay a
// head: e_step 0; one a key channel: 1) as S^T k sums the rows (ks); u = beta * (v - ks);
// then each row takes its update k_i u as S^T q sums it. Two passes over the state, the sums
// in ATen's cascaded order (norms.h cascade_rows): for Dv a multiple of 4 vectors of ATen's
// lanes.
EDGE0_VECTOR_LOOPS void delta_head(const float* q, const float* k, const float* v, float* s,
                                   float* o, const float* e, int64_t e_step, float beta,
                                   int64_t dk, int64_t dv, float* u, float* levels) {
  // norms.h cascade_rows written out: a function built for other vectors cannot inline it
  const int64_t power = std::max<int64_t>(4, edge0::sums::ceil_log2(dk) / edge0::sums::kLevels);
  const int64_t mask = (int64_t(1) << power) - 1;
  float* acc[edge0::sums::kLevels];
  for (int j = 0; j < edge0::sums::kLevels; ++j) acc[j] = levels + j * dv;
  auto merge = [&](int64_t n) {  // after row n - 1
    for (int j = 1; j < edge0::sums::kLevels; ++j) {
      float* lo = acc[j - 1];
      float* hi = acc[j];
      for (int64_t c = 0; c < dv; ++c) {
        hi[c] = hi[c] + lo[c];
        lo[c] = 0.0f;
      }
      if ((n & (mask << (j * power))) != 0) break;
    }
  };
  auto finish = [&](float* out) {
    for (int j = 1; j < edge0::sums::kLevels; ++j)
      for (int64_t c = 0; c < dv; ++c) acc[0][c] = acc[0][c] + acc[j][c];
    for (int64_t c = 0; c < dv; ++c) {
      out[c] = 0.0f + acc[0][c];
      for (int j = 0; j < edge0::sums::kLevels; ++j) acc[j][c] = 0.0f;
    }
  };
  for (int j = 0; j < edge0::sums::kLevels; ++j)
    for (int64_t c = 0; c < dv; ++c) acc[j][c] = 0.0f;
  float* a0 = acc[0];
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    const float ki = k[i], ei = e[i * e_step];
#pragma GCC ivdep
    for (int64_t c = 0; c < dv; ++c) {
      const float decayed = row[c] * ei;
      row[c] = decayed;
      a0[c] = a0[c] + ki * decayed;
    }
    if (((i + 1) & mask) == 0) merge(i + 1);
  }
  float* ks = u;  // S^T k, then u in its place
  finish(ks);
  for (int64_t c = 0; c < dv; ++c) u[c] = beta * (v[c] - ks[c]);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    const float ki = k[i], qi = q[i];
#pragma GCC ivdep
    for (int64_t c = 0; c < dv; ++c) {
      const float updated = row[c] + ki * u[c];
      row[c] = updated;
      a0[c] = a0[c] + qi * updated;
    }
    if (((i + 1) & mask) == 0) merge(i + 1);
  }
  finish(o);
}

// The linear-attention layers' shared parts at one token of one row (delta_rule.py
// causal_conv and gated_delta with `recurrent`, layers.py GatedRMSNorm), each rounding where
// the module's ops round.
namespace linear {

void check_state(at::TensorList windows, at::TensorList states, int64_t rows, at::ScalarType dtype,
                 int64_t channels, int64_t w, int64_t cells) {
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == rows &&
                  static_cast<int64_t>(states.size()) == rows,
              "one conv window and one state per row");
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(windows[b].is_contiguous() && windows[b].scalar_type() == dtype &&
                    windows[b].numel() == channels * (w - 1),
                "row ", b, ": the conv window must be contiguous [1, C, W-1] in h's dtype");
    TORCH_CHECK(states[b].is_contiguous() && states[b].scalar_type() == at::kFloat &&
                    states[b].numel() == cells,
                "row ", b, ": the state must be contiguous fp32 [1, H, Dk, Dv]");
  }
}

// causal_conv then SiLU on one row's projected channels x (floats of h's dtype) with the
// taps [C, W] in h's dtype: its window [1, C, W-1] moves on by the row; -> the [q|k|v] floats.
at::Tensor conv(const float* xp, at::Tensor window, const at::Tensor& taps, int64_t channels,
                at::ScalarType dtype) {
  RECORD_FUNCTION("edge0::causal_conv", std::vector<c10::IValue>());
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t w = taps.size(1);
  const at::Tensor old = floats(window);
  const float* wp = old.data_ptr<float>();
  const float* tp = taps.data_ptr<float>();
  const auto options = window.options().dtype(at::kFloat);
  at::Tensor mixed = at::empty({1, channels, 1}, options);
  at::Tensor next = at::empty({1, channels, w - 1}, options);
  float* mp = mixed.data_ptr<float>();
  float* np = next.data_ptr<float>();
  for (int64_t c = 0; c < channels; ++c) {
    const float* prev = wp + c * (w - 1);
    auto at_tap = [&](int64_t i) { return i < w - 1 ? prev[i] : xp[c]; };
    // Python's sum(): 0 + the first product, then each product added
    float acc = edge0::round_to(0.0f + edge0::round_to(tp[c * w] * at_tap(0), bf16), bf16);
    for (int64_t i = 1; i < w; ++i)
      acc = edge0::round_to(acc + edge0::round_to(tp[c * w + i] * at_tap(i), bf16), bf16);
    mp[c] = acc;
    for (int64_t i = 0; i < w - 1; ++i) np[c * (w - 1) + i] = at_tap(i + 1);
  }
  window.copy_(next);
  return floats(at::silu(bf16 ? mixed.to(dtype) : mixed));
}

// gated_delta's l2norm and `recurrent` for every value head of one row: y holds [q|k|v]
// (hk key heads of dk, hv value heads of dv; `rep` = hv / hk value heads a key head), decay
// the per-head (e_step 0) or per-key-channel (e_step 1) factors exp(g), beta per head; the
// row's state [hv, dk, dv] advances in place -> out [hv, dv] (fp32).
void rule(const float* y, int64_t hk, int64_t hv, int64_t dk, int64_t dv, const float* decay,
          int64_t e_step, const float* beta, float* state, float* out, int64_t lanes) {
  RECORD_FUNCTION("edge0::delta_rule", std::vector<c10::IValue>());
  const int64_t kd = hk * dk, rep = hv / hk;
  const float step_scale = static_cast<float>(std::pow(static_cast<double>(dk), -0.5));
  // every column in ATen's cascaded vectors (outer_sum): the passes can be fused
  const bool fused = dv % (4 * lanes) == 0;
  at::parallel_for(0, hv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> q(dk), k(dk), u(dv), ks(dv), levels(edge0::sums::kLevels * dv);
    for (int64_t head = lo; head < hi; ++head) {
      const int64_t key = head / rep;  // repeat_interleave: `rep` value heads a key head
      const float* q0 = y + key * dk;
      const float* k0 = y + kd + key * dk;
      const float* v0 = y + 2 * kd + head * dv;
      // l2norm: x * rsqrt(sum(x * x) + 1e-6), q then times Dk^-0.5
      const float qs = edge0::inner_sum(dk, lanes, [&](int64_t i) { return q0[i] * q0[i]; });
      const float ksum = edge0::inner_sum(dk, lanes, [&](int64_t i) { return k0[i] * k0[i]; });
      const float qinv = 1.0f / std::sqrt(qs + 1e-6f);
      const float kinv = 1.0f / std::sqrt(ksum + 1e-6f);
      for (int64_t i = 0; i < dk; ++i) {
        q[i] = (q0[i] * qinv) * step_scale;
        k[i] = k0[i] * kinv;
      }
      float* s = state + head * dk * dv;
      float* o = out + head * dv;
      const float* e = decay + head * (e_step ? dk : 1);
      const float bh = beta[head];
      if (fused) {
        delta_head(q.data(), k.data(), v0, s, o, e, e_step, bh, dk, dv, u.data(),
                   levels.data());
        continue;
      }
      // the module's passes one by one (columns that do not fill ATen's vectors)
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t c = 0; c < dv; ++c) s[i * dv + c] = s[i * dv + c] * e[i * e_step];
      edge0::outer_sum(
          dk, dv, lanes, [&](int64_t i, int64_t c) { return k[i] * s[i * dv + c]; },
          ks.data());
      for (int64_t c = 0; c < dv; ++c) u[c] = bh * (v0[c] - ks[c]);
      for (int64_t i = 0; i < dk; ++i) {
        float* row = s + i * dv;
        const float ki = k[i];
#pragma GCC ivdep
        for (int64_t c = 0; c < dv; ++c) row[c] = row[c] + ki * u[c];
      }
      edge0::outer_sum(
          dk, dv, lanes, [&](int64_t i, int64_t c) { return q[i] * s[i * dv + c]; }, o);
    }
  });
}

// The output (fp32 [hv, dv]) in h's dtype, then GatedRMSNorm in fp32: w * (x * rsqrt(mean(x^2)
// + eps)) * act(gate) (`gate`: act already applied, fp32 [hv * dv]), rounded to h's dtype.
at::Tensor norm(at::Tensor out, const at::Tensor& gate, const at::Tensor& weight, double eps,
                int64_t lanes, at::ScalarType dtype) {
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t hv = out.size(0), dv = out.size(1);
  float* op = out.data_ptr<float>();
  const float* zp = gate.data_ptr<float>();
  const float* nw = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for (int64_t head = 0; head < hv; ++head) {
    float* o = op + head * dv;
    for (int64_t c = 0; c < dv; ++c) o[c] = edge0::round_to(o[c], bf16);
    const float sum = edge0::inner_sum(dv, lanes, [&](int64_t c) { return o[c] * o[c]; });
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dv) + e);
    for (int64_t c = 0; c < dv; ++c)
      o[c] = edge0::round_to((nw[c] * (o[c] * inv)) * zp[head * dv + c], bf16);
  }
  return (bf16 ? out.to(dtype) : out).view({1, 1, hv * dv});
}

void check_rows(const at::Tensor& h, int64_t lanes) {
  const auto dtype = h.scalar_type();
  TORCH_CHECK(h.dim() == 3 && h.size(0) >= 1 && h.size(1) == 1 &&
                  (dtype == at::kBFloat16 || dtype == at::kFloat),
              "h must be fp32 or bf16 [B, 1, D]");
  TORCH_CHECK(lanes >= 1 && lanes <= edge0::kMaxLanes, "lanes must be 1 to ", edge0::kMaxLanes);
}

}  // namespace linear

// edge0::delta_rows: models/qwen3_5_moe.py GatedDeltaNet.forward (Gated DeltaNet's linear
// attention) for one decode token of each of B sequences, h [B, 1, D] (the layer's normed
// input) -> [B, 1, D], advancing each row's state in place: its conv window [1, C, W-1] (in
// h's dtype) and its delta-rule matrix [1, Hv, Dk, Dv] (fp32), zero before its first token.
// The operations are the module's at one token (delta_rule.py causal_conv, gated_delta with
// `recurrent`, layers.py GatedRMSNorm), in the same order, each result rounded where the
// module's op rounds it: the projections as project() computes them; the conv's products and
// sums, l2norm, the delta rule and the output norm as loops over floats, their sums in ATen's
// order (norms.h: the key and query products down the matrix's rows are outer sums); exp,
// sigmoid, softplus and SiLU as ATen's own ops on tensors of the module's shape (their
// vector paths' bits are not libm's). Each row is computed alone, as its own step computes it.
at::Tensor delta_rows(const at::Tensor& h, at::TensorList qkv_proj, at::TensorList z_proj,
                      at::TensorList b_proj, at::TensorList a_proj, at::TensorList out_proj,
                      at::ArrayRef<double> lora_scale, const at::Tensor& conv,
                      const at::Tensor& dt_bias, const at::Tensor& a_log, const at::Tensor& norm,
                      double norm_eps, at::TensorList windows, at::TensorList states,
                      int64_t key_heads, int64_t value_heads, int64_t key_dim, int64_t value_dim,
                      int64_t lanes, at::IntArrayRef layout, int64_t isa) {
  linear::check_rows(h, lanes);
  const auto dtype = h.scalar_type();
  const int64_t rows = h.size(0), hk = key_heads, hv = value_heads, dk = key_dim, dv = value_dim;
  TORCH_CHECK(hk >= 1 && hv % hk == 0, "value heads must be a multiple of key heads");
  TORCH_CHECK(lora_scale.size() == 5, "one LoRA scale per projection");
  const int64_t vd = hv * dv, channels = 2 * hk * dk + vd;
  TORCH_CHECK(conv.dim() == 3 && conv.size(0) == channels && conv.size(1) == 1 && conv.size(2) >= 2,
              "conv must be [C, 1, W]");
  linear::check_state(windows, states, rows, dtype, channels, conv.size(2), hv * dk * dv);
  TORCH_CHECK(norm.numel() == dv && dt_bias.numel() == hv && a_log.numel() == hv,
              "norm must be [Dv], dt_bias and A_log [Hv]");
  const auto ps = project(h, {qkv_proj, z_proj, b_proj, a_proj}, lora_scale.slice(0, 4), layout,
                          isa);
  TORCH_CHECK(ps[0].size(-1) == channels && ps[1].size(-1) == vd && ps[2].size(-1) == hv &&
                  ps[3].size(-1) == hv,
              "the projections' outputs must be [q|k|v], z, b and a");
  // the conv's taps in h's dtype, as causal_conv casts them
  const at::Tensor taps = floats(conv.to(dtype)).view({channels, -1});
  const at::Tensor normw = floats(norm);
  // -exp(A_log) * softplus(a + dt_bias), as the module's ops compute it
  const at::Tensor neg_a = at::neg(at::exp(a_log.to(at::kFloat)));
  std::vector<at::Tensor> normed(rows);
  for (int64_t b = 0; b < rows; ++b) {
    const at::Tensor qkv = floats(ps[0].narrow(0, b, 1));
    const at::Tensor y = linear::conv(qkv.data_ptr<float>(), windows[b], taps, channels, dtype);
    const at::Tensor beta = floats(at::sigmoid(ps[2].narrow(0, b, 1)));
    const at::Tensor g = neg_a * at::softplus(ps[3].narrow(0, b, 1).to(at::kFloat) + dt_bias);
    const at::Tensor decay = floats(at::exp(g));
    at::Tensor out = at::empty({hv, dv}, h.options().dtype(at::kFloat));
    linear::rule(y.data_ptr<float>(), hk, hv, dk, dv, decay.data_ptr<float>(), 0,
                 beta.data_ptr<float>(), states[b].data_ptr<float>(), out.data_ptr<float>(),
                 lanes);
    const at::Tensor gate = floats(at::silu(ps[1].narrow(0, b, 1).to(at::kFloat)));
    normed[b] = linear::norm(out, gate, normw, norm_eps, lanes, dtype);
  }
  const at::Tensor all = rows == 1 ? normed[0] : at::cat(normed);
  return project(all, {out_proj}, lora_scale.slice(4), layout, isa)[0];
}

// edge0::kda_rows: models/bailing_hybrid.py KimiDeltaAttention.forward (Ling's linear
// attention, the reference 8B tier's) as delta_rows computes Gated DeltaNet: q, k and v
// projected and convolved apart from each other's taps (their channels side by side), one
// head per key and value head, a decay per key channel
//   g = lower_bound * sigmoid(exp(A_log) * f)   (safe_gate)  or  -exp(A_log) * softplus(f),
//   f = f_proj(h) + dt_bias,
// and a sigmoid-gated output norm (g_proj) before the output projection (`dense`).
at::Tensor kda_rows(const at::Tensor& h, at::TensorList q_proj, at::TensorList k_proj,
                    at::TensorList v_proj, at::TensorList f_proj, at::TensorList b_proj,
                    at::TensorList g_proj, at::TensorList out_proj,
                    at::ArrayRef<double> lora_scale, const at::Tensor& conv,
                    const at::Tensor& dt_bias, const at::Tensor& a_log, const at::Tensor& norm,
                    double norm_eps, bool safe_gate, double lower_bound, at::TensorList windows,
                    at::TensorList states, int64_t heads, int64_t head_dim, int64_t lanes,
                    at::IntArrayRef layout, int64_t isa) {
  linear::check_rows(h, lanes);
  const auto dtype = h.scalar_type();
  const int64_t rows = h.size(0), dh = head_dim, c = heads * head_dim, channels = 3 * c;
  TORCH_CHECK(lora_scale.size() == 7, "one LoRA scale per projection");
  TORCH_CHECK(conv.dim() == 3 && conv.size(0) == channels && conv.size(1) == 1 && conv.size(2) >= 2,
              "conv must be q's, k's and v's taps together, [3C, 1, W]");
  linear::check_state(windows, states, rows, dtype, channels, conv.size(2), heads * dh * dh);
  TORCH_CHECK(norm.numel() == dh && dt_bias.numel() == c && a_log.numel() == heads,
              "norm must be [Dh], dt_bias [H * Dh], A_log [H]");
  const auto ps = project(h, {q_proj, k_proj, v_proj, f_proj, b_proj, g_proj},
                          lora_scale.slice(0, 6), layout, isa);
  for (int i : {0, 1, 2, 3, 5})
    TORCH_CHECK(ps[i].size(-1) == c, "q, k, v, f and g must project to H * Dh");
  TORCH_CHECK(ps[4].size(-1) == heads, "b must project to H");
  const at::Tensor taps = floats(conv.to(dtype)).view({channels, -1});
  const at::Tensor normw = floats(norm);
  const at::Tensor rate = at::exp(a_log.to(at::kFloat)).unsqueeze(1);  // [H, 1]
  std::vector<at::Tensor> normed(rows);
  for (int64_t b = 0; b < rows; ++b) {
    // torch.cat([q, k, v], -1) of the row's projections
    const at::Tensor qkv = floats(at::cat({ps[0].narrow(0, b, 1), ps[1].narrow(0, b, 1),
                                           ps[2].narrow(0, b, 1)}, -1));
    const at::Tensor y = linear::conv(qkv.data_ptr<float>(), windows[b], taps, channels, dtype);
    const at::Tensor beta = floats(at::sigmoid(ps[4].narrow(0, b, 1)));
    const at::Tensor f =
        (ps[3].narrow(0, b, 1).to(at::kFloat) + dt_bias.to(at::kFloat)).view({1, 1, heads, dh});
    const at::Tensor g = safe_gate ? at::mul(at::sigmoid(rate * f), lower_bound)
                                   : at::neg(rate) * at::softplus(f);
    const at::Tensor decay = floats(at::exp(g));
    at::Tensor out = at::empty({heads, dh}, h.options().dtype(at::kFloat));
    linear::rule(y.data_ptr<float>(), heads, heads, dh, dh, decay.data_ptr<float>(), 1,
                 beta.data_ptr<float>(), states[b].data_ptr<float>(), out.data_ptr<float>(),
                 lanes);
    const at::Tensor gate = floats(at::sigmoid(ps[5].narrow(0, b, 1).to(at::kFloat)));
    normed[b] = linear::norm(out, gate, normw, norm_eps, lanes, dtype);
  }
  const at::Tensor all = rows == 1 ? normed[0] : at::cat(normed);
  return project(all, {out_proj}, lora_scale.slice(6), layout, isa)[0];
}

// edge0::moe_combine: blocks.py MoEBlock's weighted sum of one token's K experts and
// DecoderLayer's residual, x + (sum_k routed[0, k] * weights[0, k] (+ shared)), as
//   y = (routed * weights[..., None].to(dtype)).sum(dim=1); y = y + shared; x + y
// computes it: the weights cast to the dtype, each product rounded to it, the sum over K in
// ATen's order in float (norms.h) and rounded once, each addition rounded.
// routed [1, K, D], weights [1, K], x [..., D] with one row, shared [1, D] -> x's shape.
at::Tensor moe_combine(const at::Tensor& routed, const at::Tensor& weights, const at::Tensor& x,
                       const std::optional<at::Tensor>& shared, int64_t lanes) {
  const auto dtype = x.scalar_type();
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(bf16 || dtype == at::kFloat, "moe_combine takes fp32 or bf16");
  TORCH_CHECK(routed.dim() == 3 && routed.size(0) == 1 && routed.scalar_type() == dtype,
              "routed must be [1, K, D] in x's dtype");
  const int64_t k = routed.size(1), d = routed.size(2);
  TORCH_CHECK(x.numel() == d && weights.numel() == k, "x must be one row of D, weights [1, K]");
  TORCH_CHECK(lanes >= 1 && lanes <= edge0::kMaxLanes, "lanes must be 1 to ", edge0::kMaxLanes);
  const at::Tensor r = floats(routed);
  const at::Tensor w = floats(weights);
  const float* rp = r.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  std::vector<float> wk(k), y(d);
  for (int64_t i = 0; i < k; ++i) wk[i] = edge0::round_to(wp[i], bf16);
  if (bf16) {
    edge0::outer_sum(
        k, d, lanes, [&](int64_t i, int64_t c) { return edge0::bf16_round(rp[i * d + c] * wk[i]); },
        y.data());
  } else {  // no rounding to test per product: the compiler can vectorize the rows' sums
    edge0::outer_sum(k, d, lanes, [&](int64_t i, int64_t c) { return rp[i * d + c] * wk[i]; },
                     y.data());
  }
  for (int64_t c = 0; c < d; ++c) y[c] = edge0::round_to(y[c], bf16);
  if (shared.has_value()) {
    TORCH_CHECK(shared->numel() == d && shared->scalar_type() == dtype,
                "shared must be one row of D in x's dtype");
    const at::Tensor sf = floats(*shared);
    const float* sp = sf.data_ptr<float>();
    for (int64_t c = 0; c < d; ++c) y[c] = edge0::round_to(y[c] + sp[c], bf16);
  }
  const at::Tensor xf = floats(x);
  const float* xp = xf.data_ptr<float>();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  for (int64_t c = 0; c < d; ++c) op[c] = edge0::round_to(xp[c] + y[c], bf16);
  return bf16 ? out.to(dtype) : out;
}

// edge0::softmax_topk: routing.py softmax_topk, its ATen ops in one call: logits [T, E] (and
// the allowed experts, bool [T, E], if any) -> (weights [T, K] in the logits' dtype, indices).
std::vector<at::Tensor> softmax_topk(const at::Tensor& logits, int64_t k, bool norm_topk_prob,
                                     const std::optional<at::Tensor>& allowed) {
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  at::Tensor weights, indices;
  if (allowed.has_value()) {
    indices = std::get<1>(at::topk(probs.masked_fill(allowed->logical_not(), -1.0), k, -1));
    weights = probs.gather(-1, indices);
  } else {
    std::tie(weights, indices) = at::topk(probs, k, -1);
  }
  if (norm_topk_prob) weights = weights / weights.sum(-1, true);
  return {weights.to(logits.scalar_type()), indices};
}

// edge0::attend_rows: a batched decode step's attention (layers.py RowCaches.attend with
// layers.attend, one token a row, no window): row b's key and value written at position n[b]
// of its cache buffers [1, G, max, Dh], then SDPA of its query over positions 0..n[b], row by
// row. The same ATen ops on the same values as the module path, so the same bits; what it
// saves is the ~20 ATen calls and the Python a row. q [B, H, 1, Dh], k, v [B, G, 1, Dh] ->
// [B, 1, H * Dh].
at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef n,
                       double scale) {
  const int64_t rows = q.size(0);
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && k.dim() == 4 && k.size(0) == rows &&
                  k.size(2) == 1 && v.sizes() == k.sizes(),
              "q must be [B, H, 1, Dh] and k, v [B, G, 1, Dh]");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == rows &&
                  static_cast<int64_t>(v_caches.size()) == rows &&
                  static_cast<int64_t>(n.size()) == rows,
              "one key buffer, value buffer and position per row");
  const bool gqa = k.size(1) != q.size(1);
  std::vector<at::Tensor> outs;
  outs.reserve(rows);
  for (int64_t b = 0; b < rows; ++b) {
    at::Tensor kc = k_caches[b], vc = v_caches[b];
    TORCH_CHECK(kc.dim() == 4 && kc.size(0) == 1 && kc.size(1) == k.size(1) &&
                    kc.size(3) == k.size(3) && vc.sizes() == kc.sizes(),
                "row ", b, ": the cache buffers must be [1, G, max, Dh]");
    TORCH_CHECK(n[b] >= 0 && n[b] < kc.size(2), "row ", b, ": position ", n[b],
                " is past its cache");
    kc.narrow(2, n[b], 1).copy_(k.narrow(0, b, 1));
    vc.narrow(2, n[b], 1).copy_(v.narrow(0, b, 1));
    // a cache stored in bf16 under fp32 compute is read back in q's dtype, as KVCache.update
    const auto dt = q.scalar_type();
    outs.push_back(at::scaled_dot_product_attention(
        q.narrow(0, b, 1), kc.narrow(2, 0, n[b] + 1).to(dt), vc.narrow(2, 0, n[b] + 1).to(dt),
        std::nullopt, 0.0, false, scale, gqa));
  }
  return at::cat(outs).transpose(1, 2).reshape({rows, 1, -1});
}

// edge0::router_topk: an MoE block's own router (a bias-free nn.Linear, h [T, D] -> logits
// [T, E]; `gate`: [weight], or [weight, lora_A, lora_B] under an enabled LoraLinear, whose
// delta is scaled by `lora_scale`) and softmax_topk of its logits (among the allowed experts,
// if given) in one call -> (logits, weights, indices).
std::vector<at::Tensor> router_topk(const at::Tensor& h, at::TensorList gate, double lora_scale,
                                    int64_t k, bool norm_topk_prob,
                                    const std::optional<at::Tensor>& allowed) {
  TORCH_CHECK(gate.size() == 1 || gate.size() == 3, "gate is [weight] or [weight, A, B]");
  at::Tensor logits = linear_each_row(h, gate[0]);
  if (gate.size() == 3) add_lora(h, gate[1], gate[2], lora_scale, logits);
  auto routed = softmax_topk(logits, k, norm_topk_prob, allowed);
  return {logits, routed[0], routed[1]};
}

// The arguments of one decoder layer that do not change from token to token.
struct LayerArgs {
  at::Tensor input_norm, post_norm;
  double input_eps, post_eps;
  std::vector<at::Tensor> q, k, v, o;
  std::vector<double> lora_scale;
  std::optional<at::Tensor> q_norm, k_norm;
  double eps;
  int64_t heads, kv_heads, head_dim;
  double scale;
  std::vector<at::Tensor> gate;
  double gate_scale;
  int64_t top_k;
  bool norm_topk;
  std::vector<at::Tensor> w13, p13, w2, p2;  // every expert's, by its index
};

// edge0.TokenDecoder: one decode token of one sequence through every decoder layer, as the
// engine's native layers (engine/backends/native_layers.py) compute it layer by layer with
// the ops above: attention_rows, router_topk on the layer's own router, the routed experts
// through swiglu_int4_gemv in routing order, moe_combine. The same calls on the same tensors
// in the same order, so the same bits; what it removes is the Python and the dispatch between
// them, ~24 layers x 5 calls a token. Each layer is added once (`add_layer`: its weights, its
// router and the tensors of every one of its experts, which must stay where they are: the
// engine hands over a pool that holds every expert). `step` takes a token of each of B
// sequences (one request's step: B = 1; a batched step, models/base.py RowsForward: B > 1),
// their embeddings x [B, 1, D], their rotary rows, and each layer's B cache buffers and
// positions; it returns the last layer's output, every layer's routed experts [L, B, K], and
// the logits [B, 1, V] where the LM head was given (`set_head`). Each row is computed as a
// step of it alone, so a row's logits are its own step's bits (see step()).
class TokenDecoder : public torch::CustomClassHolder {
 public:
  TokenDecoder(int64_t lanes, std::vector<int64_t> layout, int64_t isa,
               std::vector<int64_t> expert_layout, int64_t expert_isa)
      : lanes_(lanes),
        layout_(std::move(layout)),
        isa_(isa),
        expert_layout_(std::move(expert_layout)),
        expert_isa_(expert_isa) {}

  void add_layer(at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps,
                 std::vector<at::Tensor> q, std::vector<at::Tensor> k, std::vector<at::Tensor> v,
                 std::vector<at::Tensor> o, std::vector<double> lora_scale,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm, double eps,
                 int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
                 std::vector<at::Tensor> gate, double gate_scale, int64_t top_k, bool norm_topk,
                 std::vector<at::Tensor> w13, std::vector<at::Tensor> p13,
                 std::vector<at::Tensor> w2, std::vector<at::Tensor> p2) {
    // every expert's tensors, or none: the staged step takes its experts from the pool's slots
    const size_t n = w13.size();
    TORCH_CHECK(p13.size() == n && w2.size() == n && p2.size() == n,
                "a layer needs every expert's w13, p13, w2 and p2, or none");
    TORCH_CHECK(top_k >= 1 && (n == 0 || top_k <= static_cast<int64_t>(n)), "top_k must be 1 to ",
                n);
    TORCH_CHECK(gate.size() == 1 || gate.size() == 3, "gate is [weight] or [weight, A, B]");
    TORCH_CHECK(lora_scale.size() == 4, "one LoRA scale per projection");
    layers_.push_back({std::move(input_norm), std::move(post_norm), input_eps, post_eps,
                       std::move(q), std::move(k), std::move(v), std::move(o),
                       std::move(lora_scale), std::move(q_norm), std::move(k_norm), eps, heads,
                       kv_heads, head_dim, scale, std::move(gate), gate_scale, top_k, norm_topk,
                       std::move(w13), std::move(p13), std::move(w2), std::move(p2)});
    consumer_row_.push_back(-1), head_row_.push_back(-1);  // set_consumers(), add_head()
  }

  // The final norm and the LM head (blocks.py CausalLM: logits(backbone.norm(x))), for step()
  // to return the logits too: `head` a projection's tensors as `project` takes them, its int4
  // product on the kernel path of bf16 activations whatever the layers' (the module's LM head
  // is torch's int4 kernel in either: models/int4.py Int4Linear), so the same bits.
  void set_head(at::Tensor norm, double eps, std::vector<at::Tensor> head, double lora_scale) {
    TORCH_CHECK(!head.empty(), "the LM head needs its tensors");
    head_norm_ = std::move(norm);
    head_eps_ = eps;
    head_ = std::move(head);
    head_scale_ = lora_scale;
  }

  // The token embedding held as int4 (models/int4.py Int4Embedding), for embed(): `codes`
  // [V, D/2] bytes, each the codes of two columns, low nibble first; `scales` and `biases`
  // [V, D/64] bf16, one pair per group of 64 columns; the rows in bf16 (`bf16`) or fp32.
  void set_embedding(at::Tensor codes, at::Tensor scales, at::Tensor biases, bool bf16) {
    TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
                "codes must be contiguous [V, D/2] bytes");
    const int64_t groups = codes.size(1) * 2 / edge0::kGroup;
    for (const at::Tensor* t : {&scales, &biases}) {
      TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->dim() == 2 &&
                      t->size(0) == codes.size(0) && t->size(1) == groups &&
                      groups * edge0::kGroup == codes.size(1) * 2,
                  "scales and biases must be contiguous [V, D/64] bf16");
    }
    embedding_ = {std::move(codes), std::move(scales), std::move(biases)};
    embedding_bf16_ = bf16;
  }

  // The row of `token` [1, 1, D], as the module computes it: each code widened to fp32, times
  // its group's scale, plus its bias (two roundings: no contraction in this build), then in
  // the rows' dtype (round to nearest even, as .to() rounds).
  at::Tensor embed(int64_t token) {
    TORCH_CHECK(embedding_.size() == 3, "no embedding set");
    const at::Tensor& codes = embedding_[0];
    TORCH_CHECK(token >= 0 && token < codes.size(0), "token ", token, " is not in the vocabulary");
    const int64_t half = codes.size(1), dim = half * 2;
    const uint8_t* row = codes.data_ptr<uint8_t>() + token * half;
    const int64_t groups = dim / edge0::kGroup;
    const c10::BFloat16* s = embedding_[1].data_ptr<c10::BFloat16>() + token * groups;
    const c10::BFloat16* b = embedding_[2].data_ptr<c10::BFloat16>() + token * groups;
    at::Tensor out = at::empty({1, 1, dim}, at::TensorOptions().dtype(
                                                embedding_bf16_ ? at::kBFloat16 : at::kFloat));
    float* wide = embedding_bf16_ ? nullptr : out.data_ptr<float>();
    c10::BFloat16* narrow = embedding_bf16_ ? out.data_ptr<c10::BFloat16>() : nullptr;
    for (int64_t d = 0; d < dim; ++d) {
      const int code = d % 2 == 0 ? row[d / 2] & 15 : row[d / 2] >> 4;
      const int64_t g = d / edge0::kGroup;
      float y = static_cast<float>(s[g]) * static_cast<float>(code);
      y = y + static_cast<float>(b[g]);
      if (narrow != nullptr) {
        narrow[d] = c10::BFloat16(y);
      } else {
        wide[d] = y;
      }
    }
    return out;
  }

  // Every row as a step of it alone computes it: attention over its own cache, the router
  // row by row (linear_each_row), its experts through swiglu_experts or, from `rows_from`
  // rows (0: never), each expert once over the rows routed to it (swiglu_int4_rows, the same
  // bits per row), its weighted sum, final norm and LM head on its own. So each row's logits
  // are its own step's, bit for bit, where the native layers' batched step rounds its LM
  // head over the rows. The caches and positions: layer after layer, B of each.
  std::vector<at::Tensor> step(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                               std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                               std::vector<int64_t> n, int64_t rows_from) {
    RECORD_FUNCTION("edge0::decode_token", std::vector<c10::IValue>());
    TORCH_CHECK(x.dim() == 3 && x.size(0) >= 1 && x.size(1) == 1, "x must be [B, 1, D]");
    const int64_t rows = x.size(0);
    const size_t layers = layers_.size();
    check_caches(rows, k_caches, v_caches, n);
    std::vector<at::Tensor> routed_sets;
    routed_sets.reserve(layers);
    for (size_t l = 0; l < layers; ++l) {
      const LayerArgs& a = layers_[l];
      const std::vector<at::Tensor> xh = attention(l, x, cos, sin, k_caches, v_caches, n);
      const at::Tensor h = xh[1].view({rows, -1});
      std::vector<at::Tensor> route;
      {
        RECORD_FUNCTION("edge0::router_topk", std::vector<c10::IValue>());
        route = router_topk(h, a.gate, a.gate_scale, a.top_k, a.norm_topk, std::nullopt);
      }
      const at::Tensor indices = route[2].contiguous();  // [B, K], int64
      const at::Tensor routed = experts(a, l, h, indices, rows_from);  // [B, K, D]
      {
        RECORD_FUNCTION("edge0::moe_combine", std::vector<c10::IValue>());
        if (rows == 1) {
          x = moe_combine(routed, route[1], xh[0], std::nullopt, lanes_);
        } else {  // each row's own sum, as its step alone computes it
          std::vector<at::Tensor> xs;
          for (int64_t b = 0; b < rows; ++b)
            xs.push_back(moe_combine(routed.narrow(0, b, 1), route[1].narrow(0, b, 1),
                                     xh[0].narrow(0, b, 1), std::nullopt, lanes_));
          x = at::cat(xs);
        }
      }
      routed_sets.push_back(indices);
    }
    std::vector<at::Tensor> out = {x, at::stack(routed_sets)};
    if (head_norm_.has_value()) out.push_back(lm_head(x));
    return out;
  }

  // The pool's slots as the staged step takes its experts (`set_slots`): each slot's tensors,
  // made once for the pool's life, and the handoff whose states and messages the step shares
  // with the pool's Python side (handoff.h).
  void set_slots(std::vector<at::Tensor> w13, std::vector<at::Tensor> p13,
                 std::vector<at::Tensor> w2, std::vector<at::Tensor> p2,
                 c10::intrusive_ptr<edge0::Handoff> handoff) {
    const size_t n = w13.size();
    TORCH_CHECK(n > 0 && p13.size() == n && w2.size() == n && p2.size() == n &&
                    static_cast<int64_t>(n) == handoff->slots(),
                "every slot's w13, p13, w2 and p2, as many as the handoff's slots");
    slot_w13_ = std::move(w13), slot_p13_ = std::move(p13), slot_w2_ = std::move(w2);
    slot_p2_ = std::move(p2);
    handoff_ = std::move(handoff);
  }

  // The prerouter (prerouter/runtime.py) as the staged step runs it: which layers route by a
  // prediction (`consumers`, ascending: row i of the step's `predicted` is consumers[i]'s), and
  // each owner's head (native/heads.cpp's fp16 parts) with the consumer it stages for.
  void set_consumers(std::vector<int64_t> consumers) {
    std::fill(consumer_row_.begin(), consumer_row_.end(), -1);
    for (size_t i = 0; i < consumers.size(); ++i) {
      TORCH_CHECK(consumers[i] >= 0 && consumers[i] < static_cast<int64_t>(layers_.size()),
                  "consumer ", consumers[i], " is not a layer");
      consumer_row_[consumers[i]] = static_cast<int64_t>(i);
    }
  }

  void add_head(int64_t owner, int64_t consumer, at::Tensor w1, at::Tensor w1_hot, at::Tensor w2,
                at::Tensor w0, at::Tensor w0_hot, int64_t isa) {
    TORCH_CHECK(owner >= 0 && owner < static_cast<int64_t>(layers_.size()) && consumer > owner &&
                    consumer < static_cast<int64_t>(layers_.size()),
                "head of layer ", owner, " for layer ", consumer);
    TORCH_CHECK(head_row_[owner] < 0, "layer ", owner, " has a head already");
    head_row_[owner] = static_cast<int64_t>(heads_.size());
    heads_.push_back({consumer, std::move(w1), std::move(w1_hot), std::move(w2), std::move(w0),
                      std::move(w0_hot), isa});
  }

  // A staged decode token of one sequence (prerouter/runtime.py, engine/executors.py
  // StagedExecutor), every layer in one call, as the native layers compute it one by one:
  // - a consumer routes by softmax_topk of its prediction (`predicted` [C, E] fp32, row
  //   consumer_row_), any other layer by router_topk of its own router;
  // - an owner's head runs on the layer's MoE input with the experts it routed to and those it
  //   ran a step before (`previous` [H, K'], by head), and its consumer's top-K for the next
  //   token goes to the Python side to request (kStage, with the K slots it keeps for its own
  //   reads where its own experts were not staged; the call goes on once the reads are
  //   started), so that they land while the layers after it compute;
  // - the layer's experts come from the slots staged for it (`staged` [L, 2, K]: its experts,
  //   ascending, then their slots; -1: not staged), or, where a routed expert was not staged,
  //   from slots the Python side pins and reads now (kNeed); the call waits for their reads
  //   (handoff.h), computes them in routing order (swiglu_experts), and lets them go (kRelease).
  // The same ops on the same tensors in the same order: the native layers' bits.
  // -> [last layer's output, routed [L, 1, K], heads' logits [H, E] fp32, their chosen [H, K],
  // their MoE inputs [H, D], counters int64 [3] (ns waited for reads, ns in heads, routed
  // experts that were not staged), logits [1, 1, V] where the LM head is set].
  std::vector<at::Tensor> staged_step(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                      std::vector<at::Tensor> k_caches,
                                      std::vector<at::Tensor> v_caches, std::vector<int64_t> n,
                                      const at::Tensor& predicted, const at::Tensor& staged,
                                      const at::Tensor& previous) {
    RECORD_FUNCTION("edge0::decode_staged", std::vector<c10::IValue>());
    TORCH_CHECK(handoff_, "set_slots first: the staged step takes its experts from the slots");
    TORCH_CHECK(!heads_.empty(), "add_head first: a staged step runs the prerouter's heads");
    TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.size(1) == 1, "x must be [1, 1, D]");
    check_caches(1, k_caches, v_caches, n);
    const int64_t layers = static_cast<int64_t>(layers_.size());
    const int64_t k = layers_[0].top_k;
    for (const LayerArgs& a : layers_) TORCH_CHECK(a.top_k == k, "one top_k for every layer");
    TORCH_CHECK(predicted.scalar_type() == at::kFloat && predicted.dim() == 2,
                "predicted must be fp32 [C, E]");
    TORCH_CHECK(staged.scalar_type() == at::kLong && staged.is_contiguous() &&
                    staged.sizes() == at::IntArrayRef({layers, 2, k}),
                "staged must be contiguous int64 [L, 2, K]");
    TORCH_CHECK(previous.scalar_type() == at::kLong && previous.dim() == 2 &&
                    previous.size(0) == static_cast<int64_t>(heads_.size()),
                "previous must be int64 [H, K']");
    const int64_t* st = staged.data_ptr<int64_t>();
    std::vector<at::Tensor> routed_sets, head_logits, head_chosen, head_h;
    int64_t blocked = 0, head_ns = 0, dropped = 0;
    try {
      for (int64_t l = 0; l < layers; ++l) {
        const LayerArgs& a = layers_[l];
        const std::vector<at::Tensor> xh = attention(l, x, cos, sin, k_caches, v_caches, n);
        const at::Tensor h = xh[1].view({1, -1});
        at::Tensor weights, indices;
        if (consumer_row_[l] >= 0) {
          TORCH_CHECK(consumer_row_[l] < predicted.size(0), "no prediction for layer ", l);
          RECORD_FUNCTION("edge0::softmax_topk", std::vector<c10::IValue>());
          const auto route = softmax_topk(predicted.narrow(0, consumer_row_[l], 1), a.top_k,
                                          a.norm_topk, std::nullopt);
          weights = route[0], indices = route[1].contiguous();
        } else {
          RECORD_FUNCTION("edge0::router_topk", std::vector<c10::IValue>());
          const auto route = router_topk(h, a.gate, a.gate_scale, a.top_k, a.norm_topk,
                                         std::nullopt);
          weights = route[1], indices = route[2].contiguous();
        }
        const int64_t* own = st + l * 2 * k;  // the layer's staged experts, then their slots
        const bool was_staged = own[0] >= 0;
        if (head_row_[l] >= 0) {
          const HeadArgs& hd = heads_[head_row_[l]];
          const auto t0 = std::chrono::steady_clock::now();
          const auto made = edge0::prerouter_head(h, indices, previous.narrow(0, head_row_[l], 1),
                                                  hd.w1, hd.w1_hot, hd.w2, hd.w0, hd.w0_hot, k,
                                                  hd.isa);
          head_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now() - t0)
                         .count();
          const at::Tensor chosen = made[1].contiguous();
          handoff_->ask(edge0::Handoff::kStage, hd.consumer, was_staged ? 0 : k,
                        chosen.data_ptr<int64_t>(), k);
          head_logits.push_back(made[0]), head_chosen.push_back(chosen), head_h.push_back(h);
        }
        const int64_t* idx = indices.data_ptr<int64_t>();
        std::vector<int64_t> slots(k, -1), late;
        for (int64_t j = 0; j < k; ++j) {
          for (int64_t i = 0; was_staged && i < k; ++i)
            if (own[i] == idx[j]) slots[j] = own[k + i];
          if (slots[j] < 0) late.push_back(idx[j]);
        }
        if (!late.empty()) {  // as the executors request them: in routing order
          if (was_staged) dropped += static_cast<int64_t>(late.size());
          const auto got = handoff_->ask(edge0::Handoff::kNeed, l, 0, late.data(),
                                         static_cast<int64_t>(late.size()));
          TORCH_CHECK(got.size() == late.size(), "layer ", l, ": a slot for every expert read");
          for (int64_t j = 0, i = 0; j < k; ++j)
            if (slots[j] < 0) slots[j] = got[i++];
        }
        {
          RECORD_FUNCTION("edge0::wait_reads", std::vector<c10::IValue>());
          blocked += handoff_->wait_loaded(slots);
        }
        std::vector<at::Tensor> w13, p13, w2, p2;
        for (int64_t s : slots) {
          TORCH_CHECK(s >= 0 && s < static_cast<int64_t>(slot_w13_.size()), "slot ", s);
          w13.push_back(slot_w13_[s]), p13.push_back(slot_p13_[s]), w2.push_back(slot_w2_[s]);
          p2.push_back(slot_p2_[s]);
        }
        const at::Tensor routed =
            edge0::swiglu_experts(h, w13, p13, w2, p2, expert_layout_, expert_isa_).unsqueeze(0);
        handoff_->post(edge0::Handoff::kRelease, l, 0, nullptr, 0);
        {
          RECORD_FUNCTION("edge0::moe_combine", std::vector<c10::IValue>());
          x = moe_combine(routed, weights, xh[0], std::nullopt, lanes_);
        }
        routed_sets.push_back(indices);
      }
    } catch (...) {  // the Python side takes every message before the error reaches it
      try {
        handoff_->ask(edge0::Handoff::kEnd, -1, 0, nullptr, 0);
      } catch (...) {
      }
      throw;
    }
    handoff_->ask(edge0::Handoff::kEnd, -1, 0, nullptr, 0);
    std::vector<at::Tensor> out = {
        x,
        at::stack(routed_sets),
        at::cat(head_logits),
        at::cat(head_chosen),
        at::cat(head_h),
        at::tensor(std::vector<int64_t>{blocked, head_ns, dropped}, staged.options())};
    if (head_norm_.has_value()) out.push_back(lm_head(x));
    return out;
  }

 private:
  struct HeadArgs {
    int64_t consumer;
    at::Tensor w1, w1_hot, w2, w0, w0_hot;
    int64_t isa;
  };

  void check_caches(int64_t rows, const std::vector<at::Tensor>& k_caches,
                    const std::vector<at::Tensor>& v_caches, const std::vector<int64_t>& n) const {
    const size_t want = layers_.size() * static_cast<size_t>(rows);
    TORCH_CHECK(k_caches.size() == want && v_caches.size() == want && n.size() == want,
                "one key buffer, value buffer and position per layer and row, layer after layer");
  }

  // Layer l's attention half for the rows of x [B, 1, D] (attention_rows), with its B cache
  // buffers and positions (layer after layer in the step's lists) -> (x', its post norm).
  std::vector<at::Tensor> attention(int64_t l, const at::Tensor& x, const at::Tensor& cos,
                                    const at::Tensor& sin, std::vector<at::Tensor>& k_caches,
                                    std::vector<at::Tensor>& v_caches,
                                    const std::vector<int64_t>& n) const {
    RECORD_FUNCTION("edge0::attention_rows", std::vector<c10::IValue>());
    const LayerArgs& a = layers_[l];
    const size_t rows = static_cast<size_t>(x.size(0)), from = static_cast<size_t>(l) * rows;
    return attention_rows(x, a.input_norm, a.input_eps, a.post_norm, a.post_eps, a.q, a.k, a.v,
                          a.o, a.lora_scale, a.q_norm, a.k_norm, a.eps, cos, sin,
                          at::TensorList(k_caches.data() + from, rows),
                          at::TensorList(v_caches.data() + from, rows),
                          at::IntArrayRef(n.data() + from, rows), a.heads, a.kv_heads,
                          a.head_dim, a.scale, lanes_, layout_, isa_, false, false);
  }

  // The final norm and the LM head on x [B, 1, D] -> logits [B, 1, V].
  at::Tensor lm_head(const at::Tensor& x) const {
    RECORD_FUNCTION("edge0::lm_head", std::vector<c10::IValue>());
    const at::Tensor h = edge0::rms_norm(x, *head_norm_, head_eps_, lanes_);
    const std::vector<at::TensorList> head = {head_};
    return project(h, head, {head_scale_}, layout_, isa_ % edge0::kInt8Flag)[0];
  }

  // Layer l's routed experts for rows h [B, D] and their routing indices [B, K] -> [B, K, D]
  // in h's dtype: each row's K in routing order through swiglu_experts (as the exact path's
  // token() computes them), or, from `rows_from` rows (0: never), each expert once over the
  // rows routed to it, as the exact path's rows_together does (engine/executors.py).
  at::Tensor experts(const LayerArgs& a, size_t l, const at::Tensor& h,
                     const at::Tensor& indices, int64_t rows_from) {
    const int64_t rows = indices.size(0), k = indices.size(1), d = h.size(1);
    const int64_t count = static_cast<int64_t>(a.w13.size());
    const int64_t* idx = indices.data_ptr<int64_t>();
    for (int64_t p = 0; p < rows * k; ++p)
      TORCH_CHECK(idx[p] >= 0 && idx[p] < count, "layer ", l, ": routed to expert ", idx[p],
                  " of ", count);
    std::vector<at::Tensor> w13, p13, w2, p2;
    if (rows_from < 2 || rows < rows_from) {
      std::vector<at::Tensor> outs;
      for (int64_t b = 0; b < rows; ++b) {
        w13.clear(), p13.clear(), w2.clear(), p2.clear();
        for (int64_t j = 0; j < k; ++j) {
          const int64_t e = idx[b * k + j];
          w13.push_back(a.w13[e]), p13.push_back(a.p13[e]), w2.push_back(a.w2[e]);
          p2.push_back(a.p2[e]);
        }
        outs.push_back(edge0::swiglu_experts(h.narrow(0, b, 1), w13, p13, w2, p2,
                                             expert_layout_, expert_isa_));
      }
      return rows == 1 ? outs[0].unsqueeze(0) : at::stack(outs);
    }
    std::map<int64_t, std::vector<int64_t>> places;  // expert -> its places b * K + j
    for (int64_t p = 0; p < rows * k; ++p) places[idx[p]].push_back(p);
    std::vector<at::Tensor> tokens;
    std::vector<int64_t> order;
    for (const auto& [e, its] : places) {
      std::vector<int64_t> its_rows;
      for (int64_t p : its) its_rows.push_back(p / k);
      tokens.push_back(at::tensor(its_rows, at::kLong));
      order.insert(order.end(), its.begin(), its.end());
      w13.push_back(a.w13[e]), p13.push_back(a.p13[e]), w2.push_back(a.w2[e]);
      p2.push_back(a.p2[e]);
    }
    const at::Tensor computed = edge0::swiglu_experts_rows(h, tokens, w13, p13, w2, p2,
                                                           expert_layout_, expert_isa_);
    at::Tensor out = at::empty({rows * k, d}, h.options());
    out.index_copy_(0, at::tensor(order, at::kLong), computed.to(h.scalar_type()));
    return out.view({rows, k, d});
  }

  int64_t lanes_;
  std::vector<int64_t> layout_;
  int64_t isa_;
  std::vector<int64_t> expert_layout_;
  int64_t expert_isa_;
  std::vector<LayerArgs> layers_;
  std::optional<at::Tensor> head_norm_;
  double head_eps_ = 0.0;
  std::vector<at::Tensor> head_;
  double head_scale_ = 0.0;
  std::vector<at::Tensor> embedding_;  // codes, scales, biases: set_embedding()
  bool embedding_bf16_ = false;
  std::vector<at::Tensor> slot_w13_, slot_p13_, slot_w2_, slot_p2_;  // set_slots()
  c10::intrusive_ptr<edge0::Handoff> handoff_;
  std::vector<int64_t> consumer_row_, head_row_;  // by layer: its prediction's row, its head's
  std::vector<HeadArgs> heads_;
};

}  // namespace

TORCH_LIBRARY(edge0, m) {
  // before TokenDecoder, whose set_slots takes one
  m.class_<edge0::Handoff>("Handoff")
      .def(torch::init<int64_t>())
      .def("set_slot", &edge0::Handoff::set_slot)
      .def("next", &edge0::Handoff::next)
      .def("answer", &edge0::Handoff::answer)
      .def("refuse", &edge0::Handoff::refuse)
      .def("stop", &edge0::Handoff::stop);
  m.class_<TokenDecoder>("TokenDecoder")
      .def(torch::init<int64_t, std::vector<int64_t>, int64_t, std::vector<int64_t>, int64_t>())
      .def("add_layer", &TokenDecoder::add_layer)
      .def("set_head", &TokenDecoder::set_head)
      .def("set_embedding", &TokenDecoder::set_embedding)
      .def("embed", &TokenDecoder::embed)
      .def("step", &TokenDecoder::step)
      .def("set_slots", &TokenDecoder::set_slots)
      .def("set_consumers", &TokenDecoder::set_consumers)
      .def("add_head", &TokenDecoder::add_head)
      .def("staged_step", &TokenDecoder::staged_step);
  m.def(
      "attention_rows(Tensor x, Tensor input_norm, float input_eps, Tensor post_norm, "
      "float post_eps, Tensor[] q_proj, Tensor[] k_proj, Tensor[] v_proj, Tensor[] o_proj, "
      "float[] lora_scale, Tensor? q_norm, Tensor? k_norm, float eps, Tensor cos, Tensor sin, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] n, int heads, int kv_heads, "
      "int head_dim, float scale, int lanes, int[] layout, int isa, bool output_gate=False, "
      "bool zero_centred=False) -> Tensor[]");
  m.def(
      "delta_rows(Tensor h, Tensor[] qkv_proj, Tensor[] z_proj, Tensor[] b_proj, Tensor[] a_proj, "
      "Tensor[] out_proj, float[] lora_scale, Tensor conv, Tensor dt_bias, Tensor A_log, "
      "Tensor norm, float norm_eps, Tensor(a!)[] windows, Tensor(b!)[] states, int key_heads, "
      "int value_heads, int key_dim, int value_dim, int lanes, int[] layout, int isa) -> Tensor");
  m.def(
      "kda_rows(Tensor h, Tensor[] q_proj, Tensor[] k_proj, Tensor[] v_proj, Tensor[] f_proj, "
      "Tensor[] b_proj, Tensor[] g_proj, Tensor[] out_proj, float[] lora_scale, Tensor conv, "
      "Tensor dt_bias, Tensor A_log, Tensor norm, float norm_eps, bool safe_gate, "
      "float lower_bound, Tensor(a!)[] windows, Tensor(b!)[] states, int heads, int head_dim, "
      "int lanes, int[] layout, int isa) -> Tensor");
  m.def("native_attention_from() -> int", &native_attention_from);
  m.def(
      "moe_combine(Tensor routed, Tensor weights, Tensor x, Tensor? shared, int lanes) -> "
      "Tensor");
  m.def("softmax_topk(Tensor logits, int k, bool norm_topk_prob, Tensor? allowed) -> Tensor[]");
  m.def(
      "router_topk(Tensor h, Tensor[] gate, float lora_scale, int k, bool norm_topk_prob, "
      "Tensor? allowed) -> Tensor[]");
  m.def(
      "attend_rows(Tensor q, Tensor k, Tensor v, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
      "int[] n, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(edge0, CPU, m) {
  m.impl("attention_rows", &attention_rows);
  m.impl("delta_rows", &delta_rows);
  m.impl("kda_rows", &kda_rows);
  m.impl("moe_combine", &moe_combine);
  m.impl("softmax_topk", &softmax_topk);
  m.impl("router_topk", &router_topk);
  m.impl("attend_rows", &attend_rows);
}
