// AVX-512 paths of mla.h: the channels in blocks of 128 (fp32) or 64 (fp64) held in registers
// while the rows stream past, each row's product and sum in the scalar definition's order.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,fma")

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace di::kern::mla::detail {

void pv_f32_avx512(const float* p, const float* const* rows, int64_t n, int64_t width, float* o) {
  int64_t c0 = 0;
  for (; c0 + 128 <= width; c0 += 128) {
    __m512 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __m512 pt = _mm512_set1_ps(p[t]);
      const float* row = rows[t] + c0;
      for (int i = 0; i < 8; ++i) acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(pt, _mm512_loadu_ps(row + 16 * i)));
    }
    for (int i = 0; i < 8; ++i) _mm512_storeu_ps(o + c0 + 16 * i, acc[i]);
  }
  for (; c0 < width; c0 += 16) {
    const __mmask16 m = width - c0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (width - c0)) - 1);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t)
      acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(p[t]), _mm512_maskz_loadu_ps(m, rows[t] + c0)));
    _mm512_mask_storeu_ps(o + c0, m, acc);
  }
}

void pv_f64_avx512(const float* p, const float* const* rows, int64_t n, int64_t width, double* o) {
  int64_t c0 = 0;
  for (; c0 + 64 <= width; c0 += 64) {
    __m512d acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_pd();
    for (int64_t t = 0; t < n; ++t) {
      const __m512d pt = _mm512_set1_pd(double(p[t]));
      const float* row = rows[t] + c0;
      // float x float is exact in double: the fused form gives the same bits as product then sum.
      for (int i = 0; i < 8; ++i) acc[i] = _mm512_fmadd_pd(pt, _mm512_cvtps_pd(_mm256_loadu_ps(row + 8 * i)), acc[i]);
    }
    for (int i = 0; i < 8; ++i) _mm512_storeu_pd(o + c0 + 8 * i, acc[i]);
  }
  for (; c0 < width; c0 += 8) {
    const __mmask8 m = width - c0 >= 8 ? __mmask8(0xff) : __mmask8((1u << (width - c0)) - 1);
    __m512d acc = _mm512_setzero_pd();
    for (int64_t t = 0; t < n; ++t)
      acc = _mm512_fmadd_pd(_mm512_set1_pd(double(p[t])), _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, rows[t] + c0)), acc);
    _mm512_mask_storeu_pd(o + c0, m, acc);
  }
}

// 16 columns at a time: lane l of the definition is register acc[l] (one column per element),
// fused multiply-adds over k = l, l + 16, ... in order, then the halving tree across registers.
void dot_fma_lanes_cols_avx512(const float* x, const float* w, int64_t K, int64_t N, int64_t ldw, float* y) {
  for (int64_t j0 = 0; j0 < N; j0 += 16) {
    const __mmask16 m = N - j0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (N - j0)) - 1);
    __m512 acc[16];
    for (int l = 0; l < 16; ++l) acc[l] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      for (int l = 0; l < 16; ++l)
        acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(x[k + l]), _mm512_maskz_loadu_ps(m, w + (k + l) * ldw + j0), acc[l]);
    for (int l = 0; k + l < K; ++l)
      acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(x[k + l]), _mm512_maskz_loadu_ps(m, w + (k + l) * ldw + j0), acc[l]);
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_add_ps(acc[i], acc[i + 8]);
    for (int i = 0; i < 4; ++i) acc[i] = _mm512_add_ps(acc[i], acc[i + 4]);
    const __m512 r = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
    _mm512_mask_storeu_ps(y + j0, m, r);
  }
}

}  // namespace di::kern::mla::detail
