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

namespace {
// The halving tree of 16 registers at once: lane l of the result is the tree of register
// (4 (l % 4) + l / 4)'s lanes, with the definition's pairings (v8[i] = v[i] + v[i + 8], v4[i] =
// v8[i] + v8[i + 4], (v4[0] + v4[2]) + (v4[1] + v4[3])).
inline __m512 halving16x16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int p = 0; p < 8; ++p)
    b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44), _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
  for (int q = 0; q < 4; ++q)
    c[q] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * q], b[2 * q + 1], 0x88), _mm512_shuffle_f32x4(b[2 * q], b[2 * q + 1], 0xDD));
  for (int r = 0; r < 2; ++r)
    d[r] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * r], c[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * r], c[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
}  // namespace

// 16 rows at a time, one register of 16 lanes per row, reduced together by halving16x16.
void dot_fma_lanes_rows_avx512(const float* q, const float* const* rows, int64_t offset, int64_t K, int64_t n, float* s) {
  const int64_t full = K / 16 * 16;
  const __mmask16 tail = __mmask16((1u << (K - full)) - 1);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, n - t0);
    __m512 acc[16];
    const float* r[16];
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_setzero_ps();
      r[4 * (j & 3) + (j >> 2)] = rows[t0 + std::min<int64_t>(j, cnt - 1)] + offset;  // key j -> register 4 (j % 4) + j / 4
    }
    for (int64_t k = 0; k < full; k += 16) {
      const __m512 qv = _mm512_loadu_ps(q + k);
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(r[j] + k), acc[j]);
    }
    if (tail) {  // lanes past K keep their sums
      const __m512 qv = _mm512_maskz_loadu_ps(tail, q + full);
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_mask3_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, r[j] + full), acc[j], tail);
    }
    const __m512 v = halving16x16(acc);
    _mm512_mask_storeu_ps(s + t0, __mmask16(cnt >= 16 ? 0xffff : (1u << cnt) - 1), v);
  }
}

}  // namespace di::kern::mla::detail
