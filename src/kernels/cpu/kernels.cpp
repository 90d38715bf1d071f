#include "kernels/cpu/kernels.h"

#include <array>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "kernels/cpu/kernels_internal.h"

namespace di::kern {

static_assert(detail::kLayoutAvx2 == int(Isa::Avx2) && detail::kLayoutAvx512 == int(Isa::Avx512));

namespace detail {
bool unrounded_quant_output = false;
bool exact_fp8_dequant_only = false;
std::atomic<int64_t> certified_outputs{0}, certified_fallbacks{0};
bool index_scores_fp64_only = false;
bool interleaved_weight_streams = true;
std::atomic<int64_t> index_fixed_keys{0}, index_fp64_keys{0};

const float* e8m0_table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> a{};
    for (int i = 0; i < 256; ++i) a[size_t(i)] = e8m0_to_f32(uint8_t(i));
    return a;
  }();
  return t.data();
}
}  // namespace detail

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
  }
  return "?";
}

bool isa_supported(Isa i) {
#if defined(__x86_64__)
  switch (i) {
    case Isa::Scalar: return true;
    case Isa::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::Avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi") &&
             __builtin_cpu_supports("avx512vnni") &&
             isa_supported(Isa::Avx2);
  }
  return false;
#else
  return i == Isa::Scalar;
#endif
}

Isa best_isa() {
  if (isa_supported(Isa::Avx512)) return Isa::Avx512;
  if (isa_supported(Isa::Avx2)) return Isa::Avx2;
  return Isa::Scalar;
}

namespace {
Isa parse_isa_env() {
  const char* e = std::getenv("DEEPINFER_ISA");
  if (!e || !*e) return best_isa();
  const std::string s(e);
  Isa i;
  if (s == "scalar") i = Isa::Scalar;
  else if (s == "avx2") i = Isa::Avx2;
  else if (s == "avx512") i = Isa::Avx512;
  else throw std::invalid_argument("DEEPINFER_ISA=" + s + ": expected scalar, avx2 or avx512");
  if (!isa_supported(i)) throw std::invalid_argument("DEEPINFER_ISA=" + s + ": this CPU does not support it");
  return i;
}
Isa& current() {
  static Isa isa = parse_isa_env();
  return isa;
}
// Per calling thread: each engine (or CLI) thread runs its forward passes on its own pool, and
// kernels called from inside a pool worker run inline.
ThreadPool*& pool_slot() {
  thread_local ThreadPool* p = nullptr;
  return p;
}
// Splitting costs a wake-up and a join (microseconds), so small products stay on the caller.
// Results do not depend on the split, only speed does.
constexpr int64_t kMinParallelMacs = int64_t(1) << 16;
template <class W>
ThreadPool* pick(ThreadPool* p, int64_t m, const W& w) {
  return m * w.out * w.in < kMinParallelMacs ? nullptr : (p ? p : pool_slot());
}
}  // namespace

Isa active_isa() { return current(); }
void set_isa(Isa i) {
  if (!isa_supported(i)) throw std::invalid_argument(std::string("ISA ") + isa_name(i) + " is not supported by this CPU");
  current() = i;
}
void set_default_pool(ThreadPool* p) { pool_slot() = p; }
ThreadPool* default_pool() { return pool_slot(); }

// The block kernels need whole 32-wide K blocks (FP4 always has them; FP8 may end short).
void linear_fp8(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  if (m <= 0 || w.out <= 0) return;
  const bool blocks = w.in % 32 == 0;
  switch (current()) {
    case Isa::Avx512: if (blocks) return avx512::linear_fp8(x, m, w, y, pick(pool, m, w)); break;
    case Isa::Avx2: if (blocks) return avx2::linear_fp8(x, m, w, y, pick(pool, m, w)); break;
    case Isa::Scalar: break;
  }
  ref::linear_fp8(x, m, w, y);
}
void linear_fp4(const float* x, int64_t m, const ref::Fp4Weight& w, float* y, ThreadPool* pool) {
  if (m <= 0 || w.out <= 0) return;
  const bool blocks = w.in % 32 == 0;
  switch (current()) {
    case Isa::Avx512: if (blocks) return avx512::linear_fp4(x, m, w, y, pick(pool, m, w)); break;
    case Isa::Avx2: if (blocks) return avx2::linear_fp4(x, m, w, y, pick(pool, m, w)); break;
    case Isa::Scalar: break;
  }
  ref::linear_fp4(x, m, w, y);
}
void linear_bf16(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out, ThreadPool* pool) {
  if (m <= 0 || w.out <= 0) return;
  switch (current()) {
    case Isa::Avx512: return avx512::linear_bf16(x, m, w, y, round_out, pick(pool, m, w));
    case Isa::Avx2: return avx2::linear_bf16(x, m, w, y, round_out, pick(pool, m, w));
    case Isa::Scalar: return ref::linear_bf16(x, m, w, y, round_out);
  }
}
void linear_bf16_logits(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, ThreadPool* pool) {
  if (m <= 0 || w.out <= 0) return;
  if (current() == Isa::Avx512) return avx512::linear_bf16_logits(x, m, w, y, pick(pool, m, w));
  if (current() == Isa::Avx2) return avx2::linear_bf16_logits(x, m, w, y, pick(pool, m, w));
  linear_bf16(x, m, w, y, false, pool);
}
void linear_f32(const float* x, int64_t m, const ref::F32Weight& w, float* y, ThreadPool* pool) {
  if (m <= 0 || w.out <= 0) return;
  switch (current()) {
    case Isa::Avx512: return avx512::linear_f32(x, m, w, y, pick(pool, m, w));
    case Isa::Avx2: return avx2::linear_f32(x, m, w, y, pick(pool, m, w));
    case Isa::Scalar: return ref::linear_f32(x, m, w, y);
  }
}
void linear_fp8_dequant(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  if (m <= 0 || w.out <= 0) return;
  switch (current()) {
    case Isa::Avx512: return avx512::linear_fp8_dequant(x, m, w, y, pick(pool, m, w));
    case Isa::Avx2: return avx2::linear_fp8_dequant(x, m, w, y, pick(pool, m, w));
    case Isa::Scalar: return ref::linear_fp8_dequant(x, m, w, y);
  }
}
void hc_collapse(const float* X, const float* pre, int hc, int dim, float* y) {
  if (current() == Isa::Avx512) return avx512::hc_collapse(X, pre, hc, dim, y);
  if (current() == Isa::Avx2) return avx2::hc_collapse(X, pre, hc, dim, y);
  ref::hc_collapse(X, pre, hc, dim, y);
}
void hc_expand(const float* f, const float* X, const float* post, const float* comb, int hc, int dim, float* Y) {
  if (current() == Isa::Avx512) return avx512::hc_expand(f, X, post, comb, hc, dim, Y);
  if (current() == Isa::Avx2) return avx2::hc_expand(f, X, post, comb, hc, dim, Y);
  ref::hc_expand(f, X, post, comb, hc, dim, Y);
}
void swiglu(float* g, const float* u, int64_t m, int64_t n, float limit, const float* weight) {
  if (current() == Isa::Avx512) return avx512::swiglu(g, u, m, n, limit, weight);
  ref::swiglu(g, u, m, n, limit, weight);
}
void act_qdq_fp8(float* x, int64_t n) {
  if (current() == Isa::Avx512) return avx512::act_qdq_fp8(x, n);
  di::act_qdq_fp8(x, n, 32);
}
void act_qdq_fp4_e8m0(float* x, int64_t n) {
  if (current() == Isa::Avx512) return avx512::act_qdq_fp4_e8m0(x, n);
  di::act_qdq_fp4_e8m0(x, n, 32);
}
void index_scores(const float* q, const float* w, int n_heads, int d, const float* const* keys, int64_t n, float* out) {
  if (current() == Isa::Avx512 && d % 8 == 0) return avx512::index_scores(q, w, n_heads, d, keys, n, out);
  if (current() == Isa::Avx2 && d % 8 == 0) return avx2::index_scores(q, w, n_heads, d, keys, n, out);
  ref::index_scores(q, w, n_heads, d, keys, n, out);
}
void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                      const float* attn_sink, float softmax_scale, float* out) {
  switch (current()) {
    case Isa::Avx512: return avx512::sparse_attention(q, n_heads, d, kv_rows, n_rows, attn_sink, softmax_scale, out);
    case Isa::Avx2: return avx2::sparse_attention(q, n_heads, d, kv_rows, n_rows, attn_sink, softmax_scale, out);
    case Isa::Scalar: return ref::sparse_attention(q, n_heads, d, kv_rows, n_rows, attn_sink, softmax_scale, out);
  }
}

size_t packed_bytes(const ref::Fp8Weight& w) {
  switch (current()) {
    case Isa::Avx512: return avx512::packed_bytes_fp8(w);
    case Isa::Avx2: return avx2::packed_bytes_fp8(w);
    case Isa::Scalar: break;
  }
  return 0;
}
size_t packed_bytes(const ref::Fp4Weight& w) {
  switch (current()) {
    case Isa::Avx512: return avx512::packed_bytes_fp4(w);
    case Isa::Avx2: return avx2::packed_bytes_fp4(w);
    case Isa::Scalar: break;
  }
  return 0;
}
size_t packed_bytes_dequant(const ref::Fp8Weight& w) {
  return current() == Isa::Avx512 ? avx512::packed_bytes_fp8_dequant(w) : 0;
}
void pack_weight_dequant(ref::Fp8Weight& w, uint8_t* dst, ThreadPool* pool) {
  if (!packed_bytes_dequant(w)) return;
  avx512::pack_weight_fp8_dequant(w, dst, pool ? pool : pool_slot());
  w.packed = dst;
  w.packed_layout = detail::kLayoutAvx512Dequant;
}
ref::Fp8Weight fp8_rows(const ref::Fp8Weight& w, int64_t row0, int64_t rows) {
  if (row0 % 32 != 0 || row0 < 0 || rows < 0 || row0 + rows > w.out) throw std::invalid_argument("fp8_rows: bad row range");
  const int64_t nkb = (w.in + 31) / 32;
  ref::Fp8Weight v{w.w + row0 * w.in, w.scale + row0 / 32 * nkb, rows, w.in};
  if (!w.packed) return v;
  // Every repacked layout stores 16- or 32-row panels contiguously, so a view starts at a panel.
  int64_t offset = -1;
  switch (w.packed_layout) {
    case detail::kLayoutAvx512Dequant: offset = row0 / 32 * avx512::dequant_panel_bytes(w); break;
    case detail::kLayoutAvx512: offset = row0 / 32 * avx512::fp8_panel_bytes(w); break;
    case detail::kLayoutAvx2: offset = row0 / 16 * avx2::fp8_panel_bytes(w); break;
    default: break;
  }
  if (offset >= 0) {
    v.packed = w.packed + offset;
    v.packed_layout = w.packed_layout;
  }
  return v;
}
void pack_weight(ref::Fp8Weight& w, uint8_t* dst, ThreadPool* pool) {
  if (!packed_bytes(w)) return;
  if (current() == Isa::Avx512) avx512::pack_weight_fp8(w, dst, pool ? pool : pool_slot());
  else avx2::pack_weight_fp8(w, dst, pool ? pool : pool_slot());
  w.packed = dst;
  w.packed_layout = int(current());
}
void pack_weight(ref::Fp4Weight& w, uint8_t* dst, ThreadPool* pool) {
  if (!packed_bytes(w)) return;
  if (current() == Isa::Avx512) avx512::pack_weight_fp4(w, dst, pool ? pool : pool_slot());
  else avx2::pack_weight_fp4(w, dst, pool ? pool : pool_slot());
  w.packed = dst;
  w.packed_layout = int(current());
}


namespace fast {
void linear_fp8(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  if (m <= 0 || w.out <= 0) return;
  if (current() != Isa::Scalar && w.in % 32 == 0) return kern::linear_fp8(x, m, w, y, pool);
  ref::fast::linear_fp8(x, m, w, y);
}
void linear_fp4(const float* x, int64_t m, const ref::Fp4Weight& w, float* y, ThreadPool* pool) {
  if (m <= 0 || w.out <= 0) return;
  if (current() != Isa::Scalar && w.in % 32 == 0) return kern::linear_fp4(x, m, w, y, pool);
  ref::fast::linear_fp4(x, m, w, y);
}
void linear_fp8_bf16(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  if (m <= 0 || w.out <= 0) return;
  if (w.in % 32 == 0) {
    if (current() == Isa::Avx512) return avx512::linear_fp8_bf16(x, m, w, y, pick(pool, m, w));
    if (current() == Isa::Avx2) return avx2::linear_fp8_bf16(x, m, w, y, pick(pool, m, w));
  }
  ref::fast::linear_fp8_bf16(x, m, w, y);
}
void linear_bf16(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out, ThreadPool* pool) {
  if (m <= 0 || w.out <= 0) return;
  if (current() == Isa::Avx512) return avx512::linear_bf16_fast(x, m, w, y, round_out, pick(pool, m, w));
  if (current() == Isa::Avx2 && w.in % 32 == 0) return avx2::linear_bf16_fast(x, m, w, y, round_out, pick(pool, m, w));
  ref::fast::linear_bf16(x, m, w, y, round_out);
}
void linear_f32(const float* x, int64_t m, const ref::F32Weight& w, float* y, ThreadPool* pool) {
  if (m <= 0 || w.out <= 0) return;
  if (current() != Isa::Scalar && w.in % 16 == 0) return avx2::linear_f32_fast(x, m, w, y, pick(pool, m, w));
  ref::fast::linear_f32(x, m, w, y);
}
void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                      const float* attn_sink, float softmax_scale, float* out) {
  if (current() == Isa::Avx512 && d % 32 == 0)
    return avx512::sparse_attention_fast(q, n_heads, d, kv_rows, n_rows, attn_sink, softmax_scale, out);
  if (current() == Isa::Avx2 && d % 32 == 0)
    return avx2::sparse_attention_fast(q, n_heads, d, kv_rows, n_rows, attn_sink, softmax_scale, out);
  ref::fast::sparse_attention(q, n_heads, d, kv_rows, n_rows, attn_sink, softmax_scale, out);
}
void sparse_attention_bf16(const float* q, int n_heads, int d, const uint16_t* const* kv_rows, int64_t n_rows,
                           const float* attn_sink, float softmax_scale, float* out) {
  if (current() == Isa::Avx512 && d % 32 == 0)
    return avx512::sparse_attention_fast_bf16(q, n_heads, d, kv_rows, n_rows, attn_sink, softmax_scale, out);
  thread_local std::vector<float> rows;
  thread_local std::vector<const float*> ptrs;
  rows.resize(size_t(n_rows) * size_t(d));
  ptrs.resize(size_t(n_rows));
  for (int64_t j = 0; j < n_rows; ++j) {
    ptrs[size_t(j)] = kv_rows[j] ? rows.data() + size_t(j) * size_t(d) : nullptr;
    for (int i = 0; kv_rows[j] && i < d; ++i) rows[size_t(j) * size_t(d) + size_t(i)] = bf16_to_f32(kv_rows[j][i]);
  }
  sparse_attention(q, n_heads, d, ptrs.data(), n_rows, attn_sink, softmax_scale, out);
}
float rms_scale(const float* x, int64_t n, float eps) {
  if (current() != Isa::Scalar && n % 16 == 0) return avx2::rms_scale_fast(x, n, eps);
  return ref::fast::rms_scale(x, n, eps);
}
void rms_scales(const float* x, int64_t stride, int64_t rows, int64_t n, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = rms_scale(x + r * stride, n, eps);
}
void rms_norm(const float* x, const uint16_t* weight, int64_t n, float eps, float* y) {
  const float r = rms_scale(x, n, eps);
  for (int64_t i = 0; i < n; ++i) y[i] = round_bf16(bf16_to_f32(weight[i]) * (x[i] * r));
}
}  // namespace fast

}  // namespace di::kern
