// AVX-512 paths of ops.cpp, each with its scalar definition's bits: the dequantization of FP8 E4M3
// rows with fp32 block scales (every non-NaN code) and the fast mode's fma-lane dot product.
// GCC 12 flags its own _mm512_undefined_* placeholders (a known false positive in the headers).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "core/dtypes.h"
#include "model/v3/ops.h"

namespace di::v3::detail {

namespace {
// 16 E4M3 codes -> fp16 bits of value x 2^-8 (exact, subnormals included).
inline __m256i e4m3x16_half(const uint8_t* p) {
  const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(int16_t(0xbf80)));
}
}  // namespace

void dequant_fp8_rows_avx512(const Linear& w, int64_t r0, int64_t rows, bool round, float* out) {
  const int64_t K = w.in, sc = w.scale_cols();
  const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), hi = _mm512_set1_epi32(int(0xffff0000u));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = r0 + r;
    const uint8_t* codes = w.fp8 + n * K;
    const float* srow = w.scale + (n / w.bo) * sc;
    float* o = out + r * K;
    for (int64_t kb = 0; kb < sc; ++kb) {
      const float s = srow[kb];
      // (v x 2^-8) x (256 s) is the same real number as v x s (power-of-two factors), so one
      // rounding gives the same bits; 256 s is exact for every finite scale below 2^120.
      const __m512 vs = _mm512_set1_ps(s * 256.f);
      const bool fold = s < 0x1p120f;
      const int64_t k1 = std::min(K, (kb + 1) * w.bi);
      int64_t k = kb * w.bi;
      for (; fold && k + 16 <= k1; k += 16) {
        __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(e4m3x16_half(codes + k)), vs);
        if (round) {  // round to nearest even at bit 16 (f32_to_bf16 for non-NaN values)
          __m512i u = _mm512_castps_si512(f);
          u = _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
          f = _mm512_castsi512_ps(_mm512_and_si512(u, hi));
        }
        _mm512_storeu_ps(o + k, f);
      }
      for (; k < k1; ++k) o[k] = round ? round_bf16(e4m3_to_f32(codes[k]) * s) : e4m3_to_f32(codes[k]) * s;
    }
  }
}

namespace {
inline __m512 dequant16(const uint8_t* codes, __m512 vs256, bool round) {
  __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(e4m3x16_half(codes)), vs256);
  if (round) {
    __m512i u = _mm512_castps_si512(f);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                          _mm512_set1_epi32(1))));
    f = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))));
  }
  return f;
}
inline float halving16(__m512 acc) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  float v8[8], v4[4];
  for (int i = 0; i < 8; ++i) v8[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) v4[i] = v8[i] + v8[i + 4];
  return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}
}  // namespace

// Fast-mode outputs [n0, n1) of y[m][out] for m <= 8 rows straight from the FP8 codes: each weight
// chunk of 32 is dequantized once (bf16 values, exactly bf16(code x scale)) and used by every row;
// per output the sum is ref::fast::dot_pair_lanes of the dequantized row (vdpbf16ps: lane l takes
// pair l of every 32-wide chunk, elements past K zero), then the halving tree. x holds bf16 values.
// Needs bi % 32 == 0 and every scale below 2^120.
void linear_fp8_fast_avx512(const float* x, int64_t m, const Linear& w, float* y, int64_t n0, int64_t n1, bool round) {
  const int64_t K = w.in, N = w.out, sc = w.scale_cols(), chunks = (K + 31) / 32;
  thread_local std::vector<uint16_t> xb;  // [m][chunks][32] bf16
  xb.resize(size_t(m * chunks * 32));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = c * 32, left = K - k;
      const __mmask16 lo = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      const __mmask16 hi = left >= 32 ? __mmask16(0xffff) : left <= 16 ? __mmask16(0) : __mmask16((1u << (left - 16)) - 1);
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + i * K + k + 16), _mm512_maskz_loadu_ps(lo, x + i * K + k));
      _mm512_storeu_si512(xb.data() + (i * chunks + c) * 32, (__m512i)v);
    }
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* codes = w.fp8 + n * K;
    const float* srow = w.scale + (n / w.bo) * sc;
    __m512 acc[8];
    for (int64_t i = 0; i < m; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = c * 32, left = K - k;
      const __m512 vs = _mm512_set1_ps(srow[k / w.bi] * 256.f);
      __m512 lo, hi;
      if (left >= 32) {
        lo = dequant16(codes + k, vs, round);
        hi = dequant16(codes + k + 16, vs, round);
      } else {
        alignas(32) uint8_t tail[32] = {};
        for (int64_t j = 0; j < left; ++j) tail[j] = codes[k + j];
        lo = dequant16(tail, vs, round);
        hi = dequant16(tail + 16, vs, round);
      }
      const __m512bh wb = _mm512_cvtne2ps_pbh(hi, lo);  // bf16 values: exact
      for (int64_t i = 0; i < m; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(xb.data() + (i * chunks + c) * 32), wb);
    }
    for (int64_t i = 0; i < m; ++i) {
      const float v = halving16(acc[i]);
      y[i * N + n] = round ? round_bf16(v) : v;
    }
  }
}

// The upper halves of n bf16-valued floats (their exact bf16 bits).
void bf16_bits_avx512(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(x + i)), 16)));
  for (; i < n; ++i) out[i] = f32_to_bf16(x[i]);
}

float dot_fma_lanes_avx512(const float* a, const float* b, int64_t K) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc);
  if (k < K) {  // lanes past K keep their sums untouched
    const __mmask16 m = __mmask16((1u << (K - k)) - 1);
    acc = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(m, a + k), _mm512_maskz_loadu_ps(m, b + k), acc, m);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  float v8[8], v4[4];
  for (int i = 0; i < 8; ++i) v8[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) v4[i] = v8[i] + v8[i + 4];
  return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}

}  // namespace di::v3::detail
