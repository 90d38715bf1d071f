// AVX2 + FMA kernels: the FP8/FP4 linears with the same numerics as the AVX-512 path, bit for bit.
// Each block sum is accumulated with FMAs of exact products (FMA of an exact product = one
// rounded add) in the order of vdpbf16ps: per K pair the odd element, then the even one. Weights
// come from a load-time repacked layout (16-column panels, converted in registers) or, for
// tensors that cannot be repacked, are converted per chunk of a panel ([k][column]) from the
// checkpoint layout.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
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
constexpr int kRowTile = 6;  // rows per microkernel pass: 12 accumulators hide the FMA latency

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
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) p0[r] = p1[r] = _mm256_setzero_ps();
    const float* pw = panel + b * 32 * kPanel;
    const float* xb = xq + b * 32;
#pragma GCC unroll 2
    for (int j = 0; j < 16; ++j) {
#pragma GCC unroll 2
      for (int e = 1; e >= 0; --e) {  // odd element of the pair first, as vdpbf16ps
        const int k = 2 * j + e;
        const __m256 w0 = _mm256_loadu_ps(pw + k * kPanel), w1 = _mm256_loadu_ps(pw + k * kPanel + 8);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(xb + r * ldx + k);
          p0[r] = _mm256_fmadd_ps(w0, xv, p0[r]);
          p1[r] = _mm256_fmadd_ps(w1, xv, p1[r]);
        }
      }
    }
    const __m256 s0 = _mm256_loadu_ps(sw + b * kPanel), s1 = _mm256_loadu_ps(sw + b * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_set1_ps(sa[r * lds + b]);
      float* t = T + r * kPanel;
      _mm256_storeu_ps(t, _mm256_add_ps(_mm256_loadu_ps(t), _mm256_mul_ps(_mm256_mul_ps(p0[r], a), s0)));
      _mm256_storeu_ps(t + 8, _mm256_add_ps(_mm256_loadu_ps(t + 8), _mm256_mul_ps(_mm256_mul_ps(p1[r], a), s1)));
    }
  }
}


// ---- load-time repacked layout ----
// FP8: per 16-column panel, per 32-wide K block, per K pair u, 32 bytes: both elements of the
// pair for the 16 columns, placed so that in-lane byte and word unpacks with zero (fp8_unit)
// put each code in the top of its column's fp32 lane, odd element first (the block sum's order);
// 512 B. A shift and a mask turn a code into the bits of e4m3 x 2^-120 (E4M3's exponent lands in
// the low exponent bits, its subnormals become subnormals of the same scale): only cheap
// shuffles and shifts (vcvtph2ps, the other route, is slow on Zen 2). E4M3 NaN codes would need a
// fix-up per element, so a tensor that holds any is not repacked (the checkpoint-layout path
// handles it).
// FP4: per panel, per block, per 4-K group u, 32 bytes: byte i holds, for column 8 (f % 2) + l
// (f = (i % 16) / 4, l = i % 4 + 4 [i >= 16], the FP8 unit's unpack order), the even element of
// pair 2u + f / 2 in its low nibble and the odd one in its high nibble. Unpacked to the top byte of
// a dword, a shift and a mask give the fp32 bits of the E2M1 value x 2^-126 (E2M1's exponent in
// fp32's low exponent bits, 0.5 as the fp32 subnormal 2^-127), no table; then the 16 columns' E8M0
// codes. 272 B.
constexpr int64_t kFp8BlockBytes = 32 * kPanel;
constexpr int64_t kFp8Ahead = 4096, kFp4Ahead = 2048;
constexpr int64_t kFp4CodeBytes = 16 * kPanel, kFp4BlockBytes = kFp4CodeBytes + kPanel;

inline int64_t n_panels(int64_t out) { return (out + kPanel - 1) / kPanel; }

bool has_e4m3_nan(const uint8_t* w, int64_t n) {
  const __m256i low7 = _mm256_set1_epi8(0x7f);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i b = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i)), low7);
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(b, low7))) return true;
  }
  for (; i < n; ++i)
    if ((w[i] & 0x7f) == 0x7f) return true;
  return false;
}

// Which byte of an FP8 unit holds column c (0..15) of the pair's element e (1 = odd, 0 = even):
// unpack vector f = 2 (1 - e) + c / 8 takes bytes 4f..4f+3 (lanes 0-3) and 16+4f..16+4f+3 (4-7).
inline int fp8_unit_byte(int c, int e) {
  const int f = 2 * (1 - e) + c / 8, l = c % 8;
  return l < 4 ? 4 * f + l : 16 + 4 * f + (l - 4);
}

// An FP8 unit (32 bytes) -> odd element of columns 0-7, 8-15, then the even element's, as the
// fp32 bits of e4m3 x 2^-120: each code goes to the high byte of a word, an arithmetic shift by
// 4 and a mask make the word the bf16 bits of that value, and a word unpack with zero widens it.
inline void fp8_unit_scaled(const uint8_t* p, __m256 (&v)[4]) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), z = _mm256_setzero_si256();
  const __m256i mask = _mm256_set1_epi16(int16_t(0x87f0));
  const __m256i w0 = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(z, b), 4), mask);
  const __m256i w1 = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(z, b), 4), mask);
  v[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, w0));
  v[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, w0));
  v[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, w1));
  v[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, w1));
}
// The same, exact values (x 2^120).
inline void fp8_unit(const uint8_t* p, __m256 (&v)[4]) {
  fp8_unit_scaled(p, v);
  const __m256 scale = _mm256_set1_ps(0x1p120f);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(v[i], scale);
}

// An FP4 unit (32 bytes) -> per pair q (0, 1) and column half h, vector 2q + h of the odd
// elements (odd) and of the even ones (even), as E2M1 value x 2^-126.
inline void fp4_unit_scaled(const uint8_t* p, __m256 (&odd)[4], __m256 (&even)[4]) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), z = _mm256_setzero_si256();
  const __m256i w0 = _mm256_unpacklo_epi8(z, b), w1 = _mm256_unpackhi_epi8(z, b);
  const __m256i d[4] = {_mm256_unpacklo_epi16(z, w0), _mm256_unpackhi_epi16(z, w0), _mm256_unpacklo_epi16(z, w1),
                        _mm256_unpackhi_epi16(z, w1)};
  const __m256i mask = _mm256_set1_epi32(int(0x81c00000u));
#pragma GCC unroll 4
  for (int f = 0; f < 4; ++f) {
    odd[f] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(d[f], 6), mask));
    even[f] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(d[f], 4), 6), mask));
  }
}

// 8 E8M0 codes -> 2^(code - 127): the code is the fp32 exponent field, except 0 (2^-127, an fp32
// subnormal) and 255 (NaN). No gather: a vgatherdps per 8 scales costs a large share of an FP4 block.
inline __m256 fp4_scales(const uint8_t* p, int half) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half)));
  __m256i bits = _mm256_slli_epi32(c, 23);
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(c, _mm256_setzero_si256()));
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000), _mm256_cmpeq_epi32(c, _mm256_set1_epi32(255)));
  return _mm256_castsi256_ps(bits);
}

// T[r] += (block sum x act scale) x weight scale, the block order of the panel path (micro).
inline void add_block(float* t, __m256 p0, __m256 p1, float a, __m256 s0, __m256 s1) {
  const __m256 av = _mm256_set1_ps(a);
  _mm256_storeu_ps(t, _mm256_add_ps(_mm256_loadu_ps(t), _mm256_mul_ps(_mm256_mul_ps(p0, av), s0)));
  _mm256_storeu_ps(t + 8, _mm256_add_ps(_mm256_loadu_ps(t + 8), _mm256_mul_ps(_mm256_mul_ps(p1, av), s1)));
}

// Register path for up to 4 rows: NB blocks in flight (independent chains hide the FMA latency),
// each weight vector converted once for the R rows. T: R x 16 totals, updated block by block.
// Weights come as e4m3 x 2^-120 (no multiply per weight) against x x 2^119 (E4M3 values stay
// below 2^128): every product is the exact one halved, normal, so each partial sum is exactly half
// of the unscaled chain's and doubling the block sum restores its bits.
template <int R, int NB>
inline void fp8_blocks(const float* xq, int64_t ldx, const float* sa, int64_t lds, const uint8_t* pb, int64_t kb,
                       float sw_scalar[NB], float* T) {
  __m256 acc[R][NB][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  for (int u = 0; u < 16; ++u) {
    // The hardware prefetcher alone leaves one thread well below its share of the bandwidth: fetch
    // the codes kFp8Ahead bytes ahead (this pass reads NB x 512 contiguous bytes).
    for (int l = 0; l < NB * 2; l += 2) _mm_prefetch(reinterpret_cast<const char*>(pb + kFp8Ahead + (u * NB * 2 + l) * 32), _MM_HINT_T0);
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      __m256 w[4];
      fp8_unit_scaled(pb + b * kFp8BlockBytes + u * 32, w);
#pragma GCC unroll 2
      for (int e = 0; e < 2; ++e)  // odd element first
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(xq + r * ldx + (kb + b) * 32 + 2 * u + 1 - e);
          acc[r][b][0] = _mm256_fmadd_ps(w[2 * e], xv, acc[r][b][0]);
          acc[r][b][1] = _mm256_fmadd_ps(w[2 * e + 1], xv, acc[r][b][1]);
        }
    }
  }
  // Every loop over acc is unrolled: an index GCC cannot resolve at compile time keeps the array
  // in memory, with a store after every FMA.
#pragma GCC unroll 16
  for (int b = 0; b < NB; ++b) {
    const __m256 s = _mm256_set1_ps(sw_scalar[b]);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      add_block(T + r * kPanel, _mm256_add_ps(acc[r][b][0], acc[r][b][0]), _mm256_add_ps(acc[r][b][1], acc[r][b][1]),
                sa[r * lds + kb + b], s, s);
  }
}

// As fp8_blocks: weights as E2M1 value x 2^-126 against x x 2^118, so every product is the exact
// one x 2^-8 (normal) and the block sum x 2^8 restores the unscaled chain's bits.
template <int R, int NB>
inline void fp4_blocks(const float* xq, int64_t ldx, const float* sa, int64_t lds, const uint8_t* pb, int64_t kb,
                       float* T) {
  __m256 acc[R][NB][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  for (int u = 0; u < 8; ++u) {
    for (int l = 0; l < NB * 2; l += 2)  // this pass reads 32 bytes of each block: 64 of NB
      _mm_prefetch(reinterpret_cast<const char*>(pb + kFp4Ahead + (u * NB + l / 2) * 32), _MM_HINT_T0);
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      __m256 odd[4], even[4];
      fp4_unit_scaled(pb + b * kFp4BlockBytes + u * 32, odd, even);
#pragma GCC unroll 2
      for (int q = 0; q < 2; ++q)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const float* xk = xq + r * ldx + (kb + b) * 32 + 4 * u + 2 * q;
          const __m256 xo = _mm256_broadcast_ss(xk + 1), xe = _mm256_broadcast_ss(xk);
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            acc[r][b][h] = _mm256_fmadd_ps(odd[2 * q + h], xo, acc[r][b][h]);
            acc[r][b][h] = _mm256_fmadd_ps(even[2 * q + h], xe, acc[r][b][h]);
          }
        }
    }
  }
  const __m256 undo = _mm256_set1_ps(256.f);
#pragma GCC unroll 16
  for (int b = 0; b < NB; ++b) {
    const uint8_t* sp = pb + b * kFp4BlockBytes + kFp4CodeBytes;
    const __m256 s0 = fp4_scales(sp, 0), s1 = fp4_scales(sp, 1);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      add_block(T + r * kPanel, _mm256_mul_ps(acc[r][b][0], undo), _mm256_mul_ps(acc[r][b][1], undo), sa[r * lds + kb + b],
                s0, s1);
  }
}

// Converts blocks kb0..kb1 of a repacked panel into the [k][16] fp32 chunk the panel path uses.
void packed_fp8_chunk(const uint8_t* pp, int64_t kb0, int64_t kb1, const uint8_t* srow, const float* e8, float* panel,
                      float* sw) {
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const uint8_t* pb = pp + kb * kFp8BlockBytes;
    float* dst = panel + (kb - kb0) * 32 * kPanel;
    for (int u = 0; u < 16; ++u) {
      __m256 w[4];
      fp8_unit(pb + u * 32, w);
      for (int e = 0; e < 2; ++e) {
        _mm256_storeu_ps(dst + (2 * u + 1 - e) * kPanel, w[2 * e]);
        _mm256_storeu_ps(dst + (2 * u + 1 - e) * kPanel + 8, w[2 * e + 1]);
      }
    }
    for (int c = 0; c < kPanel; ++c) sw[(kb - kb0) * kPanel + c] = e8[srow[kb]];
  }
}
void packed_fp4_chunk(const uint8_t* pp, int64_t kb0, int64_t kb1, float* panel, float* sw) {
  const __m256 scale = _mm256_set1_ps(0x1p126f);
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const uint8_t* pb = pp + kb * kFp4BlockBytes;
    float* dst = panel + (kb - kb0) * 32 * kPanel;
    for (int u = 0; u < 8; ++u) {
      __m256 odd[4], even[4];
      fp4_unit_scaled(pb + u * 32, odd, even);
      for (int q = 0; q < 2; ++q)
        for (int h = 0; h < 2; ++h) {
          const int k = 4 * u + 2 * q;
          _mm256_storeu_ps(dst + (k + 1) * kPanel + 8 * h, _mm256_mul_ps(odd[2 * q + h], scale));
          _mm256_storeu_ps(dst + k * kPanel + 8 * h, _mm256_mul_ps(even[2 * q + h], scale));
        }
    }
    _mm256_storeu_ps(sw + (kb - kb0) * kPanel, fp4_scales(pb + kFp4CodeBytes, 0));
    _mm256_storeu_ps(sw + (kb - kb0) * kPanel + 8, fp4_scales(pb + kFp4CodeBytes, 1));
  }
}

// act_quant_fp8 of one row (K % 32 == 0) straight to E4M3 values, bit for bit: the block's scale
// as the reference computes it, x / scale clamped to +-448, then rounded to E4M3 in the fp32
// bits (RNE to 3 mantissa bits; below 2^-6, to multiples of 2^-9 by adding and removing 2^14).
// A block holding a NaN takes the scalar code.
void quant_row(const float* x, int64_t K, float* xq, float* sa, uint8_t* codes) {
  const auto& t8 = e4m3_values();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), lim = _mm256_set1_ps(448.f);
  const __m256 small = _mm256_set1_ps(0x1p-6f), magic = _mm256_set1_ps(0x1p14f);
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7ffff), keep = _mm256_set1_epi32(int(0xfff00000u));
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    __m256 v[4], amax = _mm256_set1_ps(1e-4f), nan = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) {
      act_quant_fp8(xb, 32, codes, sa + b, 32);
      for (int i = 0; i < 32; ++i) xq[b * 32 + i] = t8[codes[i]];
      continue;
    }
    alignas(32) float mx[8];
    _mm256_store_ps(mx, amax);
    float a = mx[0];
    for (int i = 1; i < 8; ++i) a = std::max(a, mx[i]);
    const float scale = pow2_ceil(a * (1.0f / 448.0f));
    sa[b] = scale;
    const __m256 sv = _mm256_set1_ps(scale);
    for (int i = 0; i < 4; ++i) {
      const __m256 q = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v[i], sv), _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
      const __m256 mag = _mm256_and_ps(q, abs_mask), sign = _mm256_andnot_ps(abs_mask, q);
      const __m256i bits = _mm256_castps_si256(mag);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 20), one);
      const __m256 normal = _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(bias, lsb)), keep));
      const __m256 sub = _mm256_sub_ps(_mm256_add_ps(mag, magic), magic);
      const __m256 r = _mm256_blendv_ps(normal, sub, _mm256_cmp_ps(mag, small, _CMP_LT_OQ));
      _mm256_storeu_ps(xq + b * 32 + 8 * i, _mm256_or_ps(r, sign));
    }
  }
}

struct ActScratch {
  std::vector<uint8_t> codes;
  std::vector<float> xq, sa, xs;
};

// chunk(p, n0, nvalid, kb0, kb1, panel, sw) fills a panel chunk ([k][16] fp32 weights, [block][16]
// scales); direct(p, R, xq, sa, T), if given, computes a panel's totals for R <= kDirectRows rows
// straight from repacked codes, with the E4M3 activation values times direct_x_scale.
constexpr int64_t kDirectRows = 4;

// bf16_act: the activations are ref::fast::scale_act_bf16's scaled bf16 values (fast wo_a), not
// act_quant's E4M3 values; both stay below 2^9 in magnitude, so the direct path's x scale applies.
template <class Chunk, class Direct>
void linear_q(const float* x, int64_t m, int64_t K, int64_t N, Chunk chunk, Direct direct, bool use_direct,
              float direct_x_scale, float* y, ThreadPool* pool, bool bf16_act = false) {
  const int64_t nkb = K / 32, npanels = n_panels(N);
  thread_local ActScratch act;
  if (int64_t(act.xq.size()) < m * K) act.xq.resize(size_t(m * K)), act.codes.resize(size_t(m * K));
  if (int64_t(act.sa.size()) < m * nkb) act.sa.resize(size_t(m * nkb));
  for (int64_t r = 0; r < m; ++r) {
    if (bf16_act) ref::fast::scale_act_bf16(x + r * K, K, act.xq.data() + r * K, act.sa.data() + r * nkb);
    else quant_row(x + r * K, K, act.xq.data() + r * K, act.sa.data() + r * nkb, act.codes.data());
  }
  const float* xq = act.xq.data();
  const float* sa = act.sa.data();
  const bool in_registers = use_direct && m <= kDirectRows;
  const float* xd = xq;
  if (in_registers && direct_x_scale != 1.f) {
    if (int64_t(act.xs.size()) < m * K) act.xs.resize(size_t(m * K));
    const __m256 f = _mm256_set1_ps(direct_x_scale);
    for (int64_t i = 0; i < m * K; i += 8) _mm256_storeu_ps(act.xs.data() + i, _mm256_mul_ps(_mm256_loadu_ps(xq + i), f));
    xd = act.xs.data();
  }
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
      if (in_registers) {
        direct(p, int(m), xd, sa, T);
      } else {
        for (int64_t kb0 = 0; kb0 < nkb; kb0 += kChunkBlocks) {
          const int64_t kb1 = std::min(nkb, kb0 + kChunkBlocks);
          chunk(p, n0, nvalid, kb0, kb1, panel, sw);
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
              case 4: micro<4>(xr, K, sr, nkb, panel, sw, nb, tr); break;
              case 5: micro<5>(xr, K, sr, nkb, panel, sw, nb, tr); break;
              default: micro<6>(xr, K, sr, nkb, panel, sw, nb, tr); break;
            }
          }
        }
      }
      const bool round = !detail::unrounded_quant_output;
      for (int64_t r = 0; r < m; ++r)
        for (int c = 0; c < nvalid; ++c) y[r * N + n0 + c] = round ? round_bf16(T[r * kPanel + c]) : T[r * kPanel + c];
    }
  });
}

// A panel's totals for R rows from repacked codes, NB blocks in flight (4 at one row).
template <int R>
void fp8_direct(const float* xq, int64_t K, const float* sa, const uint8_t* pp, const uint8_t* srow, const float* e8,
                float* T) {
  constexpr int NB = R == 1 ? 4 : R == 2 ? 2 : 1;
  const int64_t nkb = K / 32;
  int64_t kb = 0;
  for (; kb + NB <= nkb; kb += NB) {
    float s[NB];
    for (int b = 0; b < NB; ++b) s[b] = e8[srow[kb + b]];
    fp8_blocks<R, NB>(xq, K, sa, nkb, pp + kb * kFp8BlockBytes, kb, s, T);
  }
  for (; kb < nkb; ++kb) {
    float s[1] = {e8[srow[kb]]};
    fp8_blocks<R, 1>(xq, K, sa, nkb, pp + kb * kFp8BlockBytes, kb, s, T);
  }
}
template <int R>
void fp4_direct(const float* xq, int64_t K, const float* sa, const uint8_t* pp, float* T) {
  constexpr int NB = R == 1 ? 2 : 1;
  const int64_t nkb = K / 32;
  int64_t kb = 0;
  for (; kb + NB <= nkb; kb += NB) fp4_blocks<R, NB>(xq, K, sa, nkb, pp + kb * kFp4BlockBytes, kb, T);
  for (; kb < nkb; ++kb) fp4_blocks<R, 1>(xq, K, sa, nkb, pp + kb * kFp4BlockBytes, kb, T);
}
template <class F>
void by_rows(int R, F&& f) {
  switch (R) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    default: return f(std::integral_constant<int, 4>());
  }
}

}  // namespace

size_t packed_bytes_fp8(const ref::Fp8Weight& w) {
  if (w.in % 32 || has_e4m3_nan(w.w, w.out * w.in)) return 0;
  return size_t(n_panels(w.out) * (w.in / 32) * kFp8BlockBytes);
}
size_t packed_bytes_fp4(const ref::Fp4Weight& w) {
  if (w.in % 32) return 0;
  return size_t(n_panels(w.out) * (w.in / 32) * kFp4BlockBytes);
}

void pack_weight_fp8(const ref::Fp8Weight& w, uint8_t* dst, ThreadPool* pool) {
  const int64_t K = w.in, nkb = K / 32;
  run(pool, n_panels(w.out), 1, [&](int64_t p0, int64_t p1, int) {
    for (int64_t p = p0; p < p1; ++p)
      for (int c = 0; c < kPanel; ++c) {
        const int64_t n = p * kPanel + c;
        const uint8_t* src = n < w.out ? w.w + n * K : nullptr;
        int at[2];
        for (int e = 0; e < 2; ++e) at[e] = fp8_unit_byte(c, e);
        for (int64_t kb = 0; kb < nkb; ++kb) {
          uint8_t* d = dst + (p * nkb + kb) * kFp8BlockBytes;
          for (int u = 0; u < 16; ++u)
            for (int e = 0; e < 2; ++e) d[u * 32 + at[e]] = src ? src[kb * 32 + 2 * u + e] : 0;
        }
      }
  });
}

void pack_weight_fp4(const ref::Fp4Weight& w, uint8_t* dst, ThreadPool* pool) {
  const int64_t K = w.in, nkb = K / 32;
  run(pool, n_panels(w.out), 1, [&](int64_t p0, int64_t p1, int) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t kb = 0; kb < nkb; ++kb) {
        uint8_t* d = dst + (p * nkb + kb) * kFp4BlockBytes;
        for (int c = 0; c < kPanel; ++c) {
          const int64_t n = p * kPanel + c;
          d[kFp4CodeBytes + c] = n < w.out ? w.scale[n * nkb + kb] : 127;
          // A checkpoint byte is one pair (even element low), as the unit wants it.
          const int f0 = c / 8, l = c % 8, at = l < 4 ? 4 * f0 + l : 16 + 4 * f0 + (l - 4);
          const uint8_t* src = n < w.out ? w.w + n * (K / 2) + kb * 16 : nullptr;
          for (int u = 0; u < 8; ++u)
            for (int q = 0; q < 2; ++q) d[u * 32 + at + 8 * q] = src ? src[2 * u + q] : 0;
        }
      }
  });
}

namespace {
void linear_fp8_impl(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool, bool bf16_act) {
  const float* e8 = detail::e8m0_table();
  const auto& t8 = e4m3_values();
  const int64_t K = w.in, nkb = K / 32;
  const uint8_t* packed = w.packed_layout == detail::kLayoutAvx2 ? w.packed : nullptr;
  linear_q(
      x, m, K, w.out,
      [&](int64_t p, int64_t n0, int nvalid, int64_t kb0, int64_t kb1, float* panel, float* sw) {
        if (packed)
          return packed_fp8_chunk(packed + p * nkb * kFp8BlockBytes, kb0, kb1, w.scale + (n0 / 32) * nkb, e8, panel, sw);
        for (int c = 0; c < kPanel; ++c)
          for (int64_t k = kb0 * 32; k < kb1 * 32; ++k)
            panel[(k - kb0 * 32) * kPanel + c] = c < nvalid ? t8[w.w[(n0 + c) * K + k]] : 0.f;
        for (int64_t kb = kb0; kb < kb1; ++kb)
          for (int c = 0; c < kPanel; ++c)
            sw[(kb - kb0) * kPanel + c] = c < nvalid ? e8[w.scale[((n0 + c) / 32) * nkb + kb]] : 0.f;
      },
      [&](int64_t p, int R, const float* xq, const float* sa, float* T) {
        by_rows(R, [&](auto r) {
          fp8_direct<decltype(r)::value>(xq, K, sa, packed + p * nkb * kFp8BlockBytes, w.scale + (p * kPanel / 32) * nkb,
                                         e8, T);
        });
      },
      packed != nullptr, 0x1p119f, y, pool, bf16_act);
}
}  // namespace

void linear_fp8(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  linear_fp8_impl(x, m, w, y, pool, false);
}
void linear_fp8_bf16(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  linear_fp8_impl(x, m, w, y, pool, true);
}
int64_t fp8_panel_bytes(const ref::Fp8Weight& w) { return (w.in / 32) * kFp8BlockBytes; }

void linear_fp4(const float* x, int64_t m, const ref::Fp4Weight& w, float* y, ThreadPool* pool) {
  const float* e8 = detail::e8m0_table();
  const int64_t K = w.in, nkb = K / 32;
  const uint8_t* packed = w.packed_layout == detail::kLayoutAvx2 ? w.packed : nullptr;
  linear_q(
      x, m, K, w.out,
      [&](int64_t p, int64_t n0, int nvalid, int64_t kb0, int64_t kb1, float* panel, float* sw) {
        if (packed) return packed_fp4_chunk(packed + p * nkb * kFp4BlockBytes, kb0, kb1, panel, sw);
        for (int c = 0; c < kPanel; ++c)
          for (int64_t k = kb0 * 32; k < kb1 * 32; ++k)
            panel[(k - kb0 * 32) * kPanel + c] = c < nvalid ? e2m1_to_f32(fp4_get(w.w + (n0 + c) * (K / 2), k)) : 0.f;
        for (int64_t kb = kb0; kb < kb1; ++kb)
          for (int c = 0; c < kPanel; ++c) sw[(kb - kb0) * kPanel + c] = c < nvalid ? e8[w.scale[(n0 + c) * nkb + kb]] : 0.f;
      },
      [&](int64_t p, int R, const float* xq, const float* sa, float* T) {
        by_rows(R, [&](auto r) {
          fp4_direct<decltype(r)::value>(xq, K, sa, packed + p * nkb * kFp4BlockBytes, T);
        });
      },
      packed != nullptr, 0x1p118f, y, pool);
}

// ---- fp64 linears (bf16, fp32, FP8 x block scale weights) ----
// Exact products summed in fp64 (4 lanes x 2 per 8 K, then the K % 8 tail) and rounded once: the
// sum is exact in practice, so this gives the reference's bits except at rare 1-ulp near ties.
// Per tile of 4 weight rows the weights are converted to fp64 once (into an L2-resident buffer)
// and reused by every x row; each output's order depends on K only.
namespace {
constexpr int kRows64 = 4;

// R x rows (xr, stride K) against 2 fp64 weight rows (wd, stride K; `rows` of them are real):
// per output two 4-lane accumulators (K % 8 < 4, >= 4), then ((l0 + l1) + (l2 + l3)) + tail.
template <int R, class Out>
inline void f64_block(const double* xr, int64_t K, int64_t K8, const double* wd, int rows, int64_t r0, int64_t n0,
                      int64_t N, Out& out, float* y) {
  __m256d a[R][2][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) a[r][i][0] = a[r][i][1] = _mm256_setzero_pd();
  const double* w1 = wd + (rows > 1 ? K : 0);
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256d w00 = _mm256_loadu_pd(wd + k), w01 = _mm256_loadu_pd(wd + k + 4);
    const __m256d w10 = _mm256_loadu_pd(w1 + k), w11 = _mm256_loadu_pd(w1 + k + 4);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256d x0 = _mm256_loadu_pd(xr + r * K + k), x1 = _mm256_loadu_pd(xr + r * K + k + 4);
      a[r][0][0] = _mm256_fmadd_pd(x0, w00, a[r][0][0]);
      a[r][0][1] = _mm256_fmadd_pd(x1, w01, a[r][0][1]);
      a[r][1][0] = _mm256_fmadd_pd(x0, w10, a[r][1][0]);
      a[r][1][1] = _mm256_fmadd_pd(x1, w11, a[r][1][1]);
    }
  }
  alignas(32) double l[R][2][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) _mm256_store_pd(l[r][i], _mm256_add_pd(a[r][i][0], a[r][i][1]));
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < rows; ++i) {
      const double* wi = wd + i * K;
      double tail = 0;
      for (int64_t k = K8; k < K; ++k) tail += xr[r * K + k] * wi[k];
      y[(r0 + r) * N + n0 + i] = out(float(((l[r][i][0] + l[r][i][1]) + (l[r][i][2] + l[r][i][3])) + tail));
    }
}

// x rows widened to fp64 in this thread's buffer (valid until its next use on the thread).
const double* widened(const float* x, int64_t n) {
  thread_local std::vector<double> xs;
  if (int64_t(xs.size()) < n) xs.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) xs[size_t(i)] = x[i];
  return xs.data();
}

// xd: m fp64 rows; dq(n0, rows, wd): weight rows n0..n0+rows-1 as fp64 into wd[i * K].
template <class Dequant, class Out>
void linear_f64(const double* xd, int64_t m, int64_t N, int64_t K, Dequant&& dq, Out&& out, float* y, ThreadPool* pool) {
  const int64_t K8 = K / 8 * 8;
  run(pool, (N + kRows64 - 1) / kRows64, 1, [&](int64_t t0, int64_t t1, int) {
    thread_local std::vector<double> wbuf;
    if (int64_t(wbuf.size()) < kRows64 * K) wbuf.resize(size_t(kRows64 * K));
    double* wd = wbuf.data();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kRows64;
      const int rows = int(std::min<int64_t>(kRows64, N - n0));
      dq(n0, rows, wd);
      // Blocks of up to 3 x rows x 2 weight rows (12 accumulators, 5 loads per 6 FMAs); every
      // output's lanes and sequence are those of any other block shape (order fixed by K alone).
      for (int64_t r0 = 0; r0 < m; r0 += 3) {
        const int R = int(std::min<int64_t>(3, m - r0));
        for (int i0 = 0; i0 < rows; i0 += 2) {
          if (R == 3) f64_block<3>(xd + r0 * K, K, K8, wd + i0 * K, std::min(2, rows - i0), r0, n0 + i0, N, out, y);
          else if (R == 2) f64_block<2>(xd + r0 * K, K, K8, wd + i0 * K, std::min(2, rows - i0), r0, n0 + i0, N, out, y);
          else f64_block<1>(xd + r0 * K, K, K8, wd + i0 * K, std::min(2, rows - i0), r0, n0 + i0, N, out, y);
        }
      }
    }
  });
}

inline void store_pd8(double* d, __m256 f) {
  _mm256_storeu_pd(d, _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
  _mm256_storeu_pd(d + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
}

}  // namespace

void linear_bf16(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out, ThreadPool* pool) {
  const int64_t K = w.in;
  linear_f64(
      widened(x, m * K), m, w.out, K,
      [&](int64_t n0, int rows, double* wd) {
        for (int i = 0; i < rows; ++i) {
          const uint16_t* wr = w.w + (n0 + i) * K;
          int64_t k = 0;
          for (; k + 8 <= K; k += 8) {
            const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k)));
            store_pd8(wd + i * K + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
          }
          for (; k < K; ++k) wd[i * K + k] = bf16_to_f32(wr[k]);
        }
      },
      [&](float v) { return round_out ? round_bf16(v) : v; }, y, pool);
}

void linear_f32(const float* x, int64_t m, const ref::F32Weight& w, float* y, ThreadPool* pool) {
  const int64_t K = w.in;
  linear_f64(
      widened(x, m * K), m, w.out, K,
      [&](int64_t n0, int rows, double* wd) {
        for (int i = 0; i < rows; ++i) {
          const float* wr = w.w + (n0 + i) * K;
          int64_t k = 0;
          for (; k + 8 <= K; k += 8) store_pd8(wd + i * K + k, _mm256_loadu_ps(wr + k));
          for (; k < K; ++k) wd[i * K + k] = wr[k];
        }
      },
      [](float v) { return v; }, y, pool);
}

// wo_a: the weight is e4m3 x its block's scale in fp32 (exact), as the reference dequantizes it.
// Codes go 32 at a time straight to fp64 bits of e4m3 x 2^-1016 (each code in the top byte of a
// word, an arithmetic shift by 7 and a mask put E4M3's exponent in fp64's low exponent bits; two
// unpacks with zero widen the word to the top of a qword: no conversion instructions). That is
// the reference's weight over 2^1016 x scale whenever the weight is a normal fp32 (scale codes
// 10..134); other blocks, and units holding an E4M3 NaN code, take the table's fp32 weights. The
// unpacks leave the codes in "qword order" within each 32-wide K block; x is permuted the same
// way, so the products are the same and the exact fp64 sum does not depend on the order.
namespace {
// Position j of a block in qword order holds K offset qword_source(j): vector v = j / 4 takes
// lanes {0, 1, 4, 5} or {2, 3, 6, 7} of dword vector v / 2, whose lanes 0-3 / 4-7 are bytes
// 4f..4f+3 / 16+4f..16+4f+3 (the FP8 unit's unpack order).
inline int qword_source(int j) {
  static constexpr int kLane[2][4] = {{0, 1, 4, 5}, {2, 3, 6, 7}};
  const int v = j / 4, f = v / 2, l = kLane[v % 2][j % 4];
  return l < 4 ? 4 * f + l : 16 + 4 * f + (l - 4);
}

// 32 codes at p -> 8 fp64 vectors in qword order: e4m3 x 2^-1016 (true), or the reference's fp32
// weights themselves (false: scale code outside 10..134 or a NaN code).
inline bool fp8_qwords(const uint8_t* p, uint8_t scale_code, const float* e8, const float* t8, __m256d (&q)[8]) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), z = _mm256_setzero_si256();
  const __m256i nan = _mm256_cmpeq_epi8(_mm256_and_si256(b, _mm256_set1_epi8(0x7f)), _mm256_set1_epi8(0x7f));
  if (scale_code < 10 || scale_code > 134 || _mm256_movemask_epi8(nan)) {
    alignas(32) double wd[32];
    for (int j = 0; j < 32; ++j) wd[j] = double(t8[p[qword_source(j)]] * e8[scale_code]);
    for (int v = 0; v < 8; ++v) q[v] = _mm256_load_pd(wd + 4 * v);
    return false;
  }
  const __m256i mask = _mm256_set1_epi16(int16_t(0x80fe));
  const __m256i w0 = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(z, b), 7), mask);
  const __m256i w1 = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(z, b), 7), mask);
  const __m256i d[4] = {_mm256_unpacklo_epi16(z, w0), _mm256_unpackhi_epi16(z, w0), _mm256_unpacklo_epi16(z, w1),
                        _mm256_unpackhi_epi16(z, w1)};
#pragma GCC unroll 4
  for (int f = 0; f < 4; ++f) {
    q[2 * f] = _mm256_castsi256_pd(_mm256_unpacklo_epi32(z, d[f]));
    q[2 * f + 1] = _mm256_castsi256_pd(_mm256_unpackhi_epi32(z, d[f]));
  }
  return true;
}

// x rows in qword order, times `scale` (the K % 32 tail stays in place).
void permute_qwords(const float* x, int64_t m, int64_t K, double scale, double* xp) {
  for (int64_t r = 0; r < m; ++r) {
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
      for (int j = 0; j < 32; ++j) xp[r * K + k + j] = double(x[r * K + k + qword_source(j)]) * scale;
    for (; k < K; ++k) xp[r * K + k] = double(x[r * K + k]) * scale;
  }
}

// One x row (decode), per 32-row scale group: the codes' fp64 bits against x x 2^504 x the block's
// scale, made once per group (exact in fp64, far from overflow for any finite fp32 x), so each
// product is exactly 2^-512 x x x weight; table weights meet x x 2^-512; the sum is scaled back by
// 2^512.
void fp8_dequant_row(const float* x, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  const float* e8 = detail::e8m0_table();
  const float* t8 = e4m3_values().data();
  const int64_t K = w.in, N = w.out, nkb = (K + 31) / 32, K32 = K / 32 * 32;
  thread_local std::vector<double> xs;
  if (int64_t(xs.size()) < K) xs.resize(size_t(K));
  double* xu = xs.data();  // x x 2^-512 in qword order
  permute_qwords(x, 1, K32, 0x1p-512, xu);
  run(pool, (N + 31) / 32, 1, [&](int64_t g0, int64_t g1, int) {
    thread_local std::vector<double> xgs;
    if (int64_t(xgs.size()) < K) xgs.resize(size_t(K));
    double* xg = xgs.data();
    for (int64_t grp = g0; grp < g1; ++grp) {
      const uint8_t* srow = w.scale + grp * nkb;
      for (int64_t kb = 0; kb < K32 / 32; ++kb) {
        const __m256d f = _mm256_set1_pd(0x1p1016 * double(e8[srow[kb]]));  // x 2^-512 already in xu
        for (int j = 0; j < 32; j += 4) _mm256_storeu_pd(xg + kb * 32 + j, _mm256_mul_pd(_mm256_loadu_pd(xu + kb * 32 + j), f));
      }
      // Pass j takes rows j, j + q, j + 2q, j + 3q of the group: four long sequential streams (as
      // in the head; adjacent rows would restart four short ones every pass).
      const int64_t nrows = std::min<int64_t>(32, N - grp * 32), q = (nrows + kRows64 - 1) / kRows64;
      for (int64_t j = 0; j < q; ++j) {
        int64_t row[kRows64];
        for (int i = 0; i < kRows64; ++i) row[i] = grp * 32 + std::min(i * q + j, nrows - 1);  // past the end: repeat
        const uint8_t* wr[kRows64];
        for (int i = 0; i < kRows64; ++i) wr[i] = w.w + row[i] * K;
        __m256d a[kRows64][2];
#pragma GCC unroll 8
        for (int i = 0; i < kRows64; ++i) a[i][0] = a[i][1] = _mm256_setzero_pd();
        for (int64_t k = 0; k < K32; k += 32) {
#pragma GCC unroll 8
          for (int i = 0; i < kRows64; ++i) {
            _mm_prefetch(reinterpret_cast<const char*>(wr[i] + k + 512), _MM_HINT_T0);
            __m256d q[8];
            const double* xk = fp8_qwords(wr[i] + k, srow[k / 32], e8, t8, q) ? xg + k : xu + k;
#pragma GCC unroll 8
            for (int v = 0; v < 8; ++v) a[i][v & 1] = _mm256_fmadd_pd(q[v], _mm256_loadu_pd(xk + 4 * v), a[i][v & 1]);
          }
        }
        alignas(32) double l[kRows64][4];
#pragma GCC unroll 8
        for (int i = 0; i < kRows64; ++i) _mm256_store_pd(l[i], _mm256_add_pd(a[i][0], a[i][1]));
        for (int i = 0; i < kRows64; ++i) {
          if (i * q + j >= nrows) continue;
          double tail = 0;
          for (int64_t k = K32; k < K; ++k) tail += double(x[k]) * double(t8[wr[i][k]] * e8[srow[k / 32]]);
          y[row[i]] = round_bf16(float(((l[i][0] + l[i][1]) + (l[i][2] + l[i][3])) * 0x1p512 + tail));
        }
      }
    }
  });
}
}  // namespace

void linear_fp8_dequant(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  const float* e8 = detail::e8m0_table();
  const float* t8 = e4m3_values().data();
  const int64_t K = w.in, nkb = (K + 31) / 32, K32 = K / 32 * 32;
  if (m == 1) return fp8_dequant_row(x, w, y, pool);
  thread_local std::vector<double> xperm;
  if (int64_t(xperm.size()) < m * K) xperm.resize(size_t(m * K));
  permute_qwords(x, m, K, 1.0, xperm.data());
  linear_f64(
      xperm.data(), m, w.out, K,
      [&](int64_t n0, int rows, double* wd) {
        for (int i = 0; i < rows; ++i) {
          const int64_t n = n0 + i;
          const uint8_t* wr = w.w + n * K;
          const uint8_t* sr = w.scale + (n / 32) * nkb;
          for (int64_t k = 0; k < K32; k += 32) {
            __m256d q[8];
            const bool scaled = fp8_qwords(wr + k, sr[k / 32], e8, t8, q);
            const __m256d f = _mm256_set1_pd(scaled ? 0x1p1016 * double(e8[sr[k / 32]]) : 1.0);  // exact weights
            for (int v = 0; v < 8; ++v) _mm256_storeu_pd(wd + i * K + k + 4 * v, _mm256_mul_pd(q[v], f));
          }
          for (int64_t k = K32; k < K; ++k) wd[i * K + k] = double(t8[wr[k]] * e8[sr[k / 32]]);
        }
      },
      [](float v) { return round_bf16(v); }, y, pool);
}

// ---- the logits head: fp32 accumulation in the AVX-512 kernel's order ----
// Per output 16 lanes (two vectors of 8 here), lane l taking K pair l of each 32-wide chunk, the
// odd element first (vdpbf16ps's order, by FMAs of exact products), then GCC's
// _mm512_reduce_add_ps tree. x rows are split once into odd/even fp32 halves per chunk.
namespace {
inline float reduce16(__m256 lo, __m256 hi) {
  const __m256 t = _mm256_add_ps(hi, lo);
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
  const __m128 p = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, _MM_SHUFFLE(2, 3, 0, 1))));
}

// MXCSR's DAZ and FTZ on this thread while in scope: the FMAs then treat denormals as vdpbf16ps does
// (inputs read as zero, results flushed), so the lanes match the AVX-512 kernel in every case; the
// reduction tree runs outside it, as AVX-512's does.
struct DenormalsAsVdpbf16ps {
  const unsigned saved = _mm_getcsr();
  DenormalsAsVdpbf16ps() { _mm_setcsr(saved | 0x8040); }
  ~DenormalsAsVdpbf16ps() { _mm_setcsr(saved); }
};

// R weight rows x M x rows; xs: per row, per chunk [odd 0-7, even 0-7, odd 8-15, even 8-15].
template <int R, int M>
inline void logits_tile(const float* xs, int64_t ldx, const uint16_t* const* wr, int64_t nc, float* out, int64_t ldo) {
  __m256 acc[M][R][2];
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
  const __m256i hi_mask = _mm256_set1_epi32(int(0xffff0000u));
  {
    const DenormalsAsVdpbf16ps daz;
    for (int64_t c = 0; c < nc; ++c) {
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[i] + c * 32 + 16 * h));
          const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
          const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r) {
            const float* xc = xs + r * ldx + c * 32 + 16 * h;
            acc[r][i][h] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xc), acc[r][i][h]);
            acc[r][i][h] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xc + 8), acc[r][i][h]);
          }
        }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) out[r * ldo + i] = reduce16(acc[r][i][0], acc[r][i][1]);
}
}  // namespace

void linear_bf16_logits(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, ThreadPool* pool) {
  const int64_t K = w.in, N = w.out, nc = K / 32;
  if (K % 32) return linear_bf16(x, m, w, y, false, pool);  // no masked 16-bit loads here: not the head's shape
  thread_local std::vector<float> xsplit;
  if (int64_t(xsplit.size()) < m * K) xsplit.resize(size_t(m * K));
  float* xs = xsplit.data();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const float v = x[r * K + k];
      if (f32_bits(v) & 0xffff) return linear_bf16(x, m, w, y, false, pool);  // not bf16-valued: the exact path
      const int64_t c = k / 32, j = k % 32, h = j / 16, l = (j % 16) / 2;
      xs[r * K + c * 32 + 16 * h + (j % 2 ? 0 : 8) + l] = v;
    }
  // One row: 4 weight rows per pass (8 independent chains); more rows: 2 weight rows x 3 x rows.
  const int R = m == 1 ? 4 : 2;
  run(pool, (N + R - 1) / R, 16, [&](int64_t t0, int64_t t1, int) {
    const uint16_t* wr[4];
    float out[3][4];
    if (m == 1) {
      // One row: the 4 weight rows of a pass come from the 4 quarters of this chunk's rows, so
      // each is a long sequential stream across passes (adjacent rows, 4 streams of K x 2 bytes
      // restarting every pass, leave the hardware prefetcher behind at small K). Each output's
      // sum is the same either way.
      const int64_t b0 = t0 * R, b1 = std::min(N, t1 * R), q = (b1 - b0 + R - 1) / R;
      for (int64_t j = 0; j < q; ++j) {
        int64_t row[4];
        for (int i = 0; i < 4; ++i) row[i] = std::min(b0 + i * q + j, b1 - 1);  // past the end: repeat the last row
        for (int i = 0; i < 4; ++i) wr[i] = w.w + row[i] * K;
        logits_tile<4, 1>(xs, K, wr, nc, &out[0][0], 4);
        for (int i = 0; i < 4; ++i)
          if (b0 + i * q + j < b1) y[row[i]] = out[0][i];
      }
      return;
    }
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * R;
      const int rows = int(std::min<int64_t>(R, N - n0));
      for (int i = 0; i < 4; ++i) wr[i] = w.w + (n0 + std::min(i, rows - 1)) * K;  // short tile: repeat the last row
      for (int64_t r0 = 0; r0 < m; r0 += 3) {
        const int M = int(std::min<int64_t>(3, m - r0));
        const float* xr = xs + r0 * K;
        if (M == 3) logits_tile<2, 3>(xr, K, wr, nc, &out[0][0], 4);
        else if (M == 2) logits_tile<2, 2>(xr, K, wr, nc, &out[0][0], 4);
        else logits_tile<2, 1>(xr, K, wr, nc, &out[0][0], 4);
        for (int r = 0; r < M; ++r)
          for (int i = 0; i < rows; ++i) y[(r0 + r) * N + n0 + i] = out[r][i];
      }
    }
  });
}

// ---- mHC collapse / expand: the reference's fp32 order, 8 columns at a time ----
void hc_collapse(const float* X, const float* pre, int hc, int dim, float* y) {
  int d = 0;
  for (; d + 8 <= dim; d += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < hc; ++i)
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(pre[i]), _mm256_loadu_ps(X + size_t(i) * dim + d)));
    _mm256_storeu_ps(y + d, acc);
    for (int j = 0; j < 8; ++j) y[d + j] = round_bf16(y[d + j]);
  }
  for (; d < dim; ++d) {
    float acc = 0.f;
    for (int i = 0; i < hc; ++i) acc += pre[i] * X[size_t(i) * dim + d];
    y[d] = round_bf16(acc);
  }
}

void hc_expand(const float* f, const float* X, const float* post, const float* comb, int hc, int dim, float* Y) {
  for (int j = 0; j < hc; ++j) {
    float* yj = Y + size_t(j) * dim;
    int d = 0;
    for (; d + 8 <= dim; d += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int i = 0; i < hc; ++i)
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(comb[i * hc + j]), _mm256_loadu_ps(X + size_t(i) * dim + d)));
      _mm256_storeu_ps(yj + d, _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(post[j]), _mm256_loadu_ps(f + d)), acc));
      for (int t = 0; t < 8; ++t) yj[d + t] = round_bf16(yj[d + t]);
    }
    for (; d < dim; ++d) {
      float acc = 0.f;
      for (int i = 0; i < hc; ++i) acc += comb[i * hc + j] * X[size_t(i) * dim + d];
      yj[d] = round_bf16(post[j] * f[d] + acc);
    }
  }
}

// ---- sparse attention: the reference's chunked online softmax, fp64 dots over 4 lanes ----
// q and every kv row are bf16/FP8/FP4-valued, so each fp64 dot (and each chunk's P.V sum) is exact
// in any order: this gives the reference's bits. Scores of all heads for the whole list come
// first (each kv row read once for 4 heads at a time); then per head the reference's recurrence
// (libm expf, fp64 psum) and P.V over channel blocks of 8 for 4 heads. Only live rows are scored;
// a chunk with none is skipped (exp(-inf) = 0 and a rescale of exp(0) = 1 leave everything as is).
namespace {
inline __m256d sum4(__m256d a, __m256d b, __m256d c, __m256d d) {  // lanes: total of a, b, c, d
  const __m256d ab = _mm256_hadd_pd(a, b), cd = _mm256_hadd_pd(c, d);  // a01 b01 a23 b23 / c01 d01 c23 d23
  return _mm256_add_pd(_mm256_permute2f128_pd(ab, cd, 0x20), _mm256_permute2f128_pd(ab, cd, 0x31));
}
}  // namespace

void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                      const float* attn_sink, float softmax_scale, float* out) {
  if (d % 8) return ref::sparse_attention(q, n_heads, d, kv_rows, n_rows, attn_sink, softmax_scale, out);
  constexpr int64_t kChunk = 64;
  constexpr int HG = 4;  // heads sharing each kv load
  const int H = n_heads, HP = (H + HG - 1) / HG * HG;
  thread_local std::vector<double> qs;
  thread_local std::vector<float> scores, accs;
  if (qs.size() < size_t(HP) * d) qs.resize(size_t(HP) * d);
  if (scores.size() < size_t(HP) * n_rows) scores.resize(size_t(HP) * n_rows);
  if (accs.size() < size_t(HP) * d) accs.resize(size_t(HP) * d);
  double* qd = qs.data();
  for (int h = 0; h < HP; ++h)
    for (int i = 0; i < d; ++i) qd[size_t(h) * d + i] = h < H ? double(q[size_t(h) * d + i]) : 0.0;
  float* sc = scores.data();  // [head][row]
  for (int64_t j = 0; j < n_rows; ++j) {
    const float* kv = kv_rows[j];
    if (!kv) {
      for (int h = 0; h < HP; ++h) sc[size_t(h) * n_rows + j] = -INFINITY;
      continue;
    }
    for (int h0 = 0; h0 < HP; h0 += HG) {
      __m256d a[HG][2];
#pragma GCC unroll 4
      for (int h = 0; h < HG; ++h) a[h][0] = a[h][1] = _mm256_setzero_pd();
      for (int i = 0; i < d; i += 8) {
        const __m256 kf = _mm256_loadu_ps(kv + i);
        const __m256d k0 = _mm256_cvtps_pd(_mm256_castps256_ps128(kf)), k1 = _mm256_cvtps_pd(_mm256_extractf128_ps(kf, 1));
#pragma GCC unroll 4
        for (int h = 0; h < HG; ++h) {
          const double* qh = qd + size_t(h0 + h) * d + i;
          a[h][0] = _mm256_fmadd_pd(_mm256_loadu_pd(qh), k0, a[h][0]);
          a[h][1] = _mm256_fmadd_pd(_mm256_loadu_pd(qh + 4), k1, a[h][1]);
        }
      }
      alignas(32) double dots[HG];
      _mm256_store_pd(dots, sum4(_mm256_add_pd(a[0][0], a[0][1]), _mm256_add_pd(a[1][0], a[1][1]),
                                 _mm256_add_pd(a[2][0], a[2][1]), _mm256_add_pd(a[3][0], a[3][1])));
      for (int h = 0; h < HG; ++h) sc[size_t(h0 + h) * n_rows + j] = float(dots[h]) * softmax_scale;
    }
  }
  float* acc = accs.data();
  std::fill(acc, acc + size_t(HP) * d, 0.f);
  float running_max[HG], denom[HG], rescale[HG];
  alignas(32) double pb[kChunk][HG];
  for (int h0 = 0; h0 < HP; h0 += HG) {
    for (int h = 0; h < HG; ++h) running_max[h] = -1e30f, denom[h] = 0.f;
    for (int64_t c0 = 0; c0 < n_rows; c0 += kChunk) {
      const int64_t c1 = std::min(n_rows, c0 + kChunk);
      bool live = false;
      for (int64_t j = c0; j < c1 && !live; ++j) live = kv_rows[j] != nullptr;
      if (!live) continue;
      for (int h = 0; h < HG; ++h) {
        const float* sh = sc + size_t(h0 + h) * n_rows;
        float chunk_max = -INFINITY;
        for (int64_t j = c0; j < c1; ++j) chunk_max = std::max(chunk_max, sh[j]);
        const float new_max = std::max(running_max[h], chunk_max);
        rescale[h] = std::exp(running_max[h] - new_max);
        double psum = 0;
        for (int64_t j = c0; j < c1; ++j) {
          const float p = kv_rows[j] ? std::exp(sh[j] - new_max) : 0.f;  // exp(-inf) = 0
          psum += p;
          pb[j - c0][h] = round_bf16(p);
        }
        denom[h] = denom[h] * rescale[h] + float(psum);
        running_max[h] = new_max;
      }
      for (int i = 0; i < d; i += 8) {
        __m256d part[HG][2];
#pragma GCC unroll 4
        for (int h = 0; h < HG; ++h) part[h][0] = part[h][1] = _mm256_setzero_pd();
        for (int64_t j = c0; j < c1; ++j) {
          if (!kv_rows[j]) continue;
          const __m256 kf = _mm256_loadu_ps(kv_rows[j] + i);
          const __m256d k0 = _mm256_cvtps_pd(_mm256_castps256_ps128(kf)), k1 = _mm256_cvtps_pd(_mm256_extractf128_ps(kf, 1));
#pragma GCC unroll 4
          for (int h = 0; h < HG; ++h) {
            const __m256d p = _mm256_broadcast_sd(&pb[j - c0][h]);
            part[h][0] = _mm256_fmadd_pd(p, k0, part[h][0]);
            part[h][1] = _mm256_fmadd_pd(p, k1, part[h][1]);
          }
        }
#pragma GCC unroll 4
        for (int h = 0; h < HG; ++h) {
          float* ah = acc + size_t(h0 + h) * d + i;
          const __m256 pf = _mm256_set_m128(_mm256_cvtpd_ps(part[h][1]), _mm256_cvtpd_ps(part[h][0]));
          _mm256_storeu_ps(ah, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(ah), _mm256_set1_ps(rescale[h])), pf));
        }
      }
    }
    for (int h = 0; h < HG && h0 + h < H; ++h) {
      const float dn = denom[h] + std::exp(attn_sink[h0 + h] - running_max[h]);
      const float* ah = acc + size_t(h0 + h) * d;
      float* oh = out + size_t(h0 + h) * d;
      for (int i = 0; i < d; ++i) oh[i] = round_bf16(ah[i] / dn);
    }
  }
}

// ---- indexer scores: fp64 dots over 4 lanes, four keys per pass ----
// FP4-valued q and k: every product has a few significant bits and the fp64 sum is exact in any
// order, so this is the reference's bits; the per-head epilogue is the reference's scalar code.
void index_scores(const float* q, const float* w, int n_heads, int d, const float* const* keys, int64_t n, float* out) {
  constexpr int KB = 4;
  thread_local std::vector<double> qs, ks;
  if (qs.size() < size_t(n_heads) * d) qs.resize(size_t(n_heads) * d);
  if (ks.size() < size_t(KB) * d) ks.resize(size_t(KB) * d);
  double* qd = qs.data();
  for (size_t i = 0; i < size_t(n_heads) * d; ++i) qd[i] = q[i];
  for (int64_t u0 = 0; u0 < n; u0 += KB) {
    const int nk = int(std::min<int64_t>(KB, n - u0));
    const double* kd[KB];
    for (int b = 0; b < KB; ++b) {
      double* dst = ks.data() + size_t(b) * d;
      kd[b] = dst;
      if (b < nk)
        for (int i = 0; i < d; i += 8) store_pd8(dst + i, _mm256_loadu_ps(keys[u0 + b] + i));
      else
        std::fill(dst, dst + d, 0.0);  // padding lanes: computed, never stored
    }
    float acc[KB] = {0.f, 0.f, 0.f, 0.f};
    for (int h = 0; h < n_heads; ++h) {
      const double* qh = qd + size_t(h) * d;
      __m256d a[KB][2];
#pragma GCC unroll 4
      for (int b = 0; b < KB; ++b) a[b][0] = a[b][1] = _mm256_setzero_pd();
      for (int i = 0; i < d; i += 8) {
        const __m256d q0 = _mm256_loadu_pd(qh + i), q1 = _mm256_loadu_pd(qh + i + 4);
#pragma GCC unroll 4
        for (int b = 0; b < KB; ++b) {
          a[b][0] = _mm256_fmadd_pd(q0, _mm256_loadu_pd(kd[b] + i), a[b][0]);
          a[b][1] = _mm256_fmadd_pd(q1, _mm256_loadu_pd(kd[b] + i + 4), a[b][1]);
        }
      }
      alignas(32) double dots[KB];
      _mm256_store_pd(dots, sum4(_mm256_add_pd(a[0][0], a[0][1]), _mm256_add_pd(a[1][0], a[1][1]),
                                 _mm256_add_pd(a[2][0], a[2][1]), _mm256_add_pd(a[3][0], a[3][1])));
#pragma GCC unroll 4
      for (int b = 0; b < KB; ++b) {
        const float v = std::max(round_bf16(float(dots[b])), 0.f);
        acc[b] += round_bf16(v * w[h]);
      }
    }
    for (int b = 0; b < nk; ++b) out[u0 + b] = round_bf16(acc[b]);
  }
}

// ---- fast numerics (contracts: ref::fast) ----

void linear_bf16_fast(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out, ThreadPool* pool) {
  thread_local std::vector<float> xb;
  if (int64_t(xb.size()) < m * w.in) xb.resize(size_t(m * w.in));
  for (int64_t i = 0; i < m * w.in; ++i) xb[size_t(i)] = round_bf16(x[i]);
  linear_bf16_logits(xb.data(), m, w, y, pool);  // the head's pair lanes, K % 32 == 0
  if (round_out)
    for (int64_t i = 0; i < m * w.out; ++i) y[i] = round_bf16(y[i]);
}

namespace {
// Lanes 0-7 (lo) and 8-15 (hi) of an fma-lane sum -> the halving tree (reduce16 above is that tree).
// R weight rows x M x rows, 16 elements per step.
template <int R, int M>
inline void f32_tile(const float* x, int64_t K, const float* const* wr, float (&out)[3][4]) {
  __m256 acc[M][R][2];
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 w0 = _mm256_loadu_ps(wr[i] + k), w1 = _mm256_loadu_ps(wr[i] + k + 8);
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) {
        acc[r][i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, acc[r][i][0]);
        acc[r][i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), w1, acc[r][i][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) out[r][i] = reduce16(acc[r][i][0], acc[r][i][1]);
}
}  // namespace

void linear_f32_fast(const float* x, int64_t m, const ref::F32Weight& w, float* y, ThreadPool* pool) {
  const int64_t K = w.in, N = w.out, ntiles = (N + 3) / 4;
  auto tile = [&](int64_t t, int64_t r0) {
    const int64_t n0 = t * 4;
    const int rows = int(std::min<int64_t>(4, N - n0));
    const float* wr[4];
    for (int i = 0; i < 4; ++i) wr[i] = w.w + (n0 + std::min(i, rows - 1)) * K;  // short tile: repeat the last row
    float out[3][4];
    const int M = int(std::min<int64_t>(3, m - r0));
    if (M == 3) f32_tile<4, 3>(x + r0 * K, K, wr, out);
    else if (M == 2) f32_tile<4, 2>(x + r0 * K, K, wr, out);
    else f32_tile<4, 1>(x + r0 * K, K, wr, out);
    for (int r = 0; r < M; ++r)
      for (int i = 0; i < rows; ++i) y[(r0 + r) * N + n0 + i] = out[r][i];
  };
  // Many rows (the mHC mixes of a prefill: thousands of K, a few dozen outputs): threads take row
  // tiles and run every column tile on them, so x streams once while the small weight stays in
  // cache. Few rows: threads take column tiles. Each output is one tile's sum either way.
  if (m >= 32) {
    run(pool, (m + 2) / 3, 1, [&](int64_t a, int64_t b, int) {
      for (int64_t rt = a; rt < b; ++rt)
        for (int64_t t = 0; t < ntiles; ++t) tile(t, rt * 3);
    });
    return;
  }
  run(pool, ntiles, 1, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r0 = 0; r0 < m; r0 += 3) tile(t, r0);
  });
}

float rms_scale_fast(const float* x, int64_t n, float eps) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  return 1.0f / std::sqrt(reduce16(a0, a1) / float(n) + eps);
}

// ref::fast::sparse_attention. Pair steps are FMAs under DAZ/FTZ on operands split into odd and
// even halves per 32-wide chunk (lane l: element 2l + 1, then 2l); the halving trees, the rescaling
// and libm's expf run outside that scope, as the contract's plain fp32 steps.
void sparse_attention_fast(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                           const float* attn_sink, float softmax_scale, float* out) {
  constexpr int64_t kChunk = 64;
  constexpr int HG = 4;
  const int H = n_heads, HP = (H + HG - 1) / HG * HG;
  thread_local std::vector<float> qs, rows_b, split, lanes, scores, accs, parts;
  auto grow = [](std::vector<float>& v, size_t n) -> float* {
    if (v.size() < n) v.resize(n);
    return v.data();
  };
  // q and the rows rounded to bf16; q split per 32-chunk into [odd 16][even 16].
  float* qp = grow(qs, size_t(HP) * d);
  for (int h = 0; h < HP; ++h)
    for (int c = 0; c < d; c += 32)
      for (int l = 0; l < 16; ++l) {
        qp[size_t(h) * d + c + l] = h < H ? round_bf16(q[size_t(h) * d + c + 2 * l + 1]) : 0.f;
        qp[size_t(h) * d + c + 16 + l] = h < H ? round_bf16(q[size_t(h) * d + c + 2 * l]) : 0.f;
      }
  float* rb = grow(rows_b, size_t(n_rows + 1) * d);  // natural order; one zero row past the end
  float* sp = grow(split, size_t(d));
  float* ln = grow(lanes, size_t(HP) * 16);
  float* sc = grow(scores, size_t(HP) * n_rows);  // [head][row]
  std::fill(rb + size_t(n_rows) * d, rb + size_t(n_rows + 1) * d, 0.f);
  for (int64_t j = 0; j < n_rows; ++j) {
    float* r = rb + size_t(j) * d;
    const float* kv = kv_rows[j];
    if (!kv) {
      std::fill(r, r + d, 0.f);
      for (int h = 0; h < HP; ++h) sc[size_t(h) * n_rows + j] = -INFINITY;
      continue;
    }
    for (int i = 0; i < d; ++i) r[i] = round_bf16(kv[i]);
    for (int c = 0; c < d; c += 32)
      for (int l = 0; l < 16; ++l) sp[c + l] = r[c + 2 * l + 1], sp[c + 16 + l] = r[c + 2 * l];
    {
      const DenormalsAsVdpbf16ps daz;
      for (int h0 = 0; h0 < HP; h0 += HG) {
        __m256 a[HG][2];
#pragma GCC unroll 4
        for (int h = 0; h < HG; ++h) a[h][0] = a[h][1] = _mm256_setzero_ps();
        for (int c = 0; c < d; c += 32)
#pragma GCC unroll 2
          for (int half = 0; half < 2; ++half) {  // odd halves, then even
            const __m256 k0 = _mm256_loadu_ps(sp + c + 16 * half), k1 = _mm256_loadu_ps(sp + c + 16 * half + 8);
#pragma GCC unroll 4
            for (int h = 0; h < HG; ++h) {
              const float* qh = qp + size_t(h0 + h) * d + c + 16 * half;
              a[h][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qh), k0, a[h][0]);
              a[h][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8), k1, a[h][1]);
            }
          }
#pragma GCC unroll 4
        for (int h = 0; h < HG; ++h) {
          _mm256_storeu_ps(ln + (h0 + h) * 16, a[h][0]);
          _mm256_storeu_ps(ln + (h0 + h) * 16 + 8, a[h][1]);
        }
      }
    }
    for (int h = 0; h < HP; ++h) sc[size_t(h) * n_rows + j] = ref::fast::halving_sum16(ln + h * 16) * softmax_scale;
  }
  float* acc = grow(accs, size_t(HP) * d);
  float* part = grow(parts, size_t(HG) * d);
  std::fill(acc, acc + size_t(HP) * d, 0.f);
  float running_max[HG], denom[HG], rescale[HG];
  alignas(32) float pb[kChunk][HG];
  for (int h0 = 0; h0 < HP; h0 += HG) {
    for (int h = 0; h < HG; ++h) running_max[h] = -1e30f, denom[h] = 0.f;
    for (int64_t c0 = 0; c0 < n_rows; c0 += kChunk) {
      const int64_t c1 = std::min(n_rows, c0 + kChunk);
      bool live = false;
      for (int64_t j = c0; j < c1 && !live; ++j) live = kv_rows[j] != nullptr;
      if (!live) continue;  // probabilities 0, rescale exp(0) = 1: an exact no-op
      for (int h = 0; h < HG; ++h) {
        const float* sh = sc + size_t(h0 + h) * n_rows;
        float chunk_max = -INFINITY;
        for (int64_t j = c0; j < c1; ++j) chunk_max = std::max(chunk_max, sh[j]);
        const float new_max = std::max(running_max[h], chunk_max);
        rescale[h] = std::exp(running_max[h] - new_max);
        float psum = 0.f;
        for (int64_t j = c0; j < c1; ++j) {
          const float p = kv_rows[j] ? std::exp(sh[j] - new_max) : 0.f;  // exp(-inf) = 0
          psum += p;
          pb[j - c0][h] = round_bf16(p);
        }
        if ((c1 - c0) & 1) pb[c1 - c0][h] = 0.f;
        denom[h] = denom[h] * rescale[h] + psum;
        running_max[h] = new_max;
      }
      std::fill(part, part + size_t(HG) * d, 0.f);
      {
        const DenormalsAsVdpbf16ps daz;
        for (int i = 0; i < d; i += 16) {
          __m256 pt[HG][2];
#pragma GCC unroll 4
          for (int h = 0; h < HG; ++h) pt[h][0] = pt[h][1] = _mm256_setzero_ps();
          for (int64_t j0 = c0; j0 < c1; j0 += 2) {
            // The second row of the pair first; past the chunk's end: the zero row.
            const float* r1 = rb + size_t(j0 + 1 < c1 ? j0 + 1 : n_rows) * d + i;
            const float* r0 = rb + size_t(j0) * d + i;
            const __m256 a0 = _mm256_loadu_ps(r1), a1 = _mm256_loadu_ps(r1 + 8);
            const __m256 b0 = _mm256_loadu_ps(r0), b1 = _mm256_loadu_ps(r0 + 8);
#pragma GCC unroll 4
            for (int h = 0; h < HG; ++h) {
              const __m256 p1 = _mm256_broadcast_ss(&pb[j0 + 1 - c0][h]), p0 = _mm256_broadcast_ss(&pb[j0 - c0][h]);
              pt[h][0] = _mm256_fmadd_ps(p0, b0, _mm256_fmadd_ps(p1, a0, pt[h][0]));
              pt[h][1] = _mm256_fmadd_ps(p0, b1, _mm256_fmadd_ps(p1, a1, pt[h][1]));
            }
          }
#pragma GCC unroll 4
          for (int h = 0; h < HG; ++h) {
            _mm256_storeu_ps(part + size_t(h) * d + i, pt[h][0]);
            _mm256_storeu_ps(part + size_t(h) * d + i + 8, pt[h][1]);
          }
        }
      }
      for (int h = 0; h < HG; ++h) {
        float* ah = acc + size_t(h0 + h) * d;
        const float* ph = part + size_t(h) * d;
        const __m256 r = _mm256_set1_ps(rescale[h]);
        for (int i = 0; i < d; i += 8)
          _mm256_storeu_ps(ah + i, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(ah + i), r), _mm256_loadu_ps(ph + i)));
      }
    }
    for (int h = 0; h < HG && h0 + h < H; ++h) {
      const float dn = denom[h] + std::exp(attn_sink[h0 + h] - running_max[h]);
      const float* ah = acc + size_t(h0 + h) * d;
      float* oh = out + size_t(h0 + h) * d;
      for (int i = 0; i < d; ++i) oh[i] = round_bf16(ah[i] / dn);
    }
  }
}

}  // namespace di::kern::avx2

#pragma GCC pop_options
