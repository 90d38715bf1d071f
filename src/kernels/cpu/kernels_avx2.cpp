// AVX2 + FMA kernels: the FP8/FP4 linears with the same numerics as the AVX-512 path, bit for bit.
// Weights are converted to fp32 per chunk of a 16-column panel ([k][column]); each block sum is
// accumulated with FMAs of exact products (FMA of an exact product = one rounded add) in the
// order of vdpbf16ps: per K pair the odd element, then the even one. The fp64 linears and the
// attention fall back to the scalar reference on this ISA (see docs/kernels.md).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "core/dtypes.h"
#include "core/thread_pool.h"
#include "kernels/cpu/kernels_internal.h"

namespace di::kern::avx2 {
namespace {
// Built outside the target region: plain scalar code.
const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> a{};
    for (int i = 0; i < 256; ++i) a[size_t(i)] = e4m3_to_f32(uint8_t(i));
    return a;
  }();
  return t;
}
}  // namespace
}  // namespace di::kern::avx2

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace di::kern::avx2 {
namespace {

constexpr int kPanel = 16;
constexpr int kChunkBlocks = 8;  // 8 x 32 k x 16 columns x 4 B = 16 KB
constexpr int kRowTile = 4;

template <class F>
void run(ThreadPool* pool, int64_t n, int64_t grain, F&& f) {
  if (pool && pool->size() > 1 && n > grain) pool->parallel_for(n, grain, f);
  else if (n > 0) f(int64_t(0), n, 0);
}

template <int R>
inline void micro(const float* xq, int64_t ldx, const float* sa, int64_t lds, const float* panel, const float* sw,
                  int nb, float* T) {
  for (int b = 0; b < nb; ++b) {
    __m256 p0[R], p1[R];
    for (int r = 0; r < R; ++r) p0[r] = p1[r] = _mm256_setzero_ps();
    const float* pw = panel + b * 32 * kPanel;
    const float* xb = xq + b * 32;
    for (int j = 0; j < 16; ++j) {
      for (int e = 1; e >= 0; --e) {  // odd element of the pair first, as vdpbf16ps
        const int k = 2 * j + e;
        const __m256 w0 = _mm256_load_ps(pw + k * kPanel), w1 = _mm256_load_ps(pw + k * kPanel + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(xb + r * ldx + k);
          p0[r] = _mm256_fmadd_ps(w0, xv, p0[r]);
          p1[r] = _mm256_fmadd_ps(w1, xv, p1[r]);
        }
      }
    }
    const __m256 s0 = _mm256_loadu_ps(sw + b * kPanel), s1 = _mm256_loadu_ps(sw + b * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_set1_ps(sa[r * lds + b]);
      float* t = T + r * kPanel;
      _mm256_storeu_ps(t, _mm256_add_ps(_mm256_loadu_ps(t), _mm256_mul_ps(_mm256_mul_ps(p0[r], a), s0)));
      _mm256_storeu_ps(t + 8, _mm256_add_ps(_mm256_loadu_ps(t + 8), _mm256_mul_ps(_mm256_mul_ps(p1[r], a), s1)));
    }
  }
}

struct ActScratch {
  std::vector<uint8_t> codes;
  std::vector<float> xq, sa;
};

// row_value(n, k) -> fp32 weight value (exact), block_scale(n, kb) -> fp32 scale.
template <class RowValues, class BlockScale>
void linear_q(const float* x, int64_t m, int64_t K, int64_t N, RowValues row_values, BlockScale block_scale, float* y,
              ThreadPool* pool) {
  const int64_t nkb = K / 32, npanels = (N + kPanel - 1) / kPanel;
  thread_local ActScratch act;
  if (int64_t(act.xq.size()) < m * K) act.xq.resize(size_t(m * K)), act.codes.resize(size_t(m * K));
  if (int64_t(act.sa.size()) < m * nkb) act.sa.resize(size_t(m * nkb));
  const auto& t8 = e4m3_values();
  for (int64_t r = 0; r < m; ++r) {
    act_quant_fp8(x + r * K, K, act.codes.data() + r * K, act.sa.data() + r * nkb, 32);
    for (int64_t k = 0; k < K; ++k) act.xq[size_t(r * K + k)] = t8[act.codes[size_t(r * K + k)]];
  }
  const float* xq = act.xq.data();
  const float* sa = act.sa.data();
  run(pool, npanels, 1, [&](int64_t p0, int64_t p1, int) {
    alignas(32) static thread_local float panel[kChunkBlocks * 32 * kPanel];
    alignas(32) static thread_local float sw[kChunkBlocks * kPanel];
    thread_local std::vector<float> totals;
    if (int64_t(totals.size()) < m * kPanel) totals.resize(size_t(m * kPanel));
    float* T = totals.data();
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel;
      const int nvalid = int(std::min<int64_t>(kPanel, N - n0));
      std::fill(T, T + m * kPanel, 0.f);
      for (int64_t kb0 = 0; kb0 < nkb; kb0 += kChunkBlocks) {
        const int64_t kb1 = std::min(nkb, kb0 + kChunkBlocks);
        for (int c = 0; c < kPanel; ++c)
          for (int64_t k = kb0 * 32; k < kb1 * 32; ++k)
            panel[(k - kb0 * 32) * kPanel + c] = c < nvalid ? row_values(n0 + c, k) : 0.f;
        for (int64_t kb = kb0; kb < kb1; ++kb)
          for (int c = 0; c < kPanel; ++c) sw[(kb - kb0) * kPanel + c] = c < nvalid ? block_scale(n0 + c, kb) : 0.f;
        for (int64_t r0 = 0; r0 < m; r0 += kRowTile) {
          const int R = int(std::min<int64_t>(kRowTile, m - r0));
          const float* xr = xq + r0 * K + kb0 * 32;
          const float* sr = sa + r0 * nkb + kb0;
          const int nb = int(kb1 - kb0);
          float* tr = T + r0 * kPanel;
          switch (R) {
            case 1: micro<1>(xr, K, sr, nkb, panel, sw, nb, tr); break;
            case 2: micro<2>(xr, K, sr, nkb, panel, sw, nb, tr); break;
            case 3: micro<3>(xr, K, sr, nkb, panel, sw, nb, tr); break;
            default: micro<4>(xr, K, sr, nkb, panel, sw, nb, tr); break;
          }
        }
      }
      const bool round = !detail::unrounded_quant_output;
      for (int64_t r = 0; r < m; ++r)
        for (int c = 0; c < nvalid; ++c) y[r * N + n0 + c] = round ? round_bf16(T[r * kPanel + c]) : T[r * kPanel + c];
    }
  });
}

}  // namespace

void linear_fp8(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  const float* e8 = detail::e8m0_table();
  const auto& t8 = e4m3_values();
  const int64_t K = w.in, nkb = K / 32;
  linear_q(
      x, m, K, w.out, [&](int64_t n, int64_t k) { return t8[w.w[n * K + k]]; },
      [&](int64_t n, int64_t kb) { return e8[w.scale[(n / 32) * nkb + kb]]; }, y, pool);
}

void linear_fp4(const float* x, int64_t m, const ref::Fp4Weight& w, float* y, ThreadPool* pool) {
  const float* e8 = detail::e8m0_table();
  const int64_t K = w.in, nkb = K / 32;
  linear_q(
      x, m, K, w.out, [&](int64_t n, int64_t k) { return e2m1_to_f32(fp4_get(w.w + n * (K / 2), k)); },
      [&](int64_t n, int64_t kb) { return e8[w.scale[n * nkb + kb]]; }, y, pool);
}

void linear_bf16(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out, ThreadPool*) {
  ref::linear_bf16(x, m, w, y, round_out);
}
void linear_f32(const float* x, int64_t m, const ref::F32Weight& w, float* y, ThreadPool*) { ref::linear_f32(x, m, w, y); }
void linear_fp8_dequant(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool*) {
  ref::linear_fp8_dequant(x, m, w, y);
}
void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                      const float* attn_sink, float softmax_scale, float* out) {
  ref::sparse_attention(q, n_heads, d, kv_rows, n_rows, attn_sink, softmax_scale, out);
}

}  // namespace di::kern::avx2

#pragma GCC pop_options
