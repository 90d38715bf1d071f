// AVX-512 kernels (AVX512F/BW/VL/DQ/VBMI + AVX512_BF16 + AVX512_VNNI).
//
// FP8/FP4 linears: activations are act_quant'ed to E4M3 values held as bf16; weights are
// converted chunk by chunk to bf16 (exact, by table lookup) in a "panel" of 32 output columns laid out as
// [K pair][column] so that one vdpbf16ps accumulates one K pair for 16 columns. Every product is
// exact; each 32-wide K block is summed in fp32 in the fixed order of vdpbf16ps (per K pair: odd
// element, then even; pairs ascending), then x act_scale x weight_scale and accumulated over blocks
// in K order, exactly as the reference does with its (exact) block sums. The same microkernel runs
// for every row count, so results do not depend on m, on the thread count, or on the chunking.
// Weights repacked at load (pack_weight) are read in that order directly; m = 1 converts in registers.
//
// bf16 / fp32 / FP8-dequant linears: exact products summed in fp64 (2 x 8 lanes per 16 K, then the
// tail), rounded once to fp32. The logits head: fp32 vdpbf16ps sums (see linear_bf16_logits).
// Attention: fp64 dots (exact for its operands, so in any order), the reference's recurrence, fp64
// P.V per channel in row order; the fast mode's attention is vdpbf16ps tiles (attention_pairs). Index scores: exact integer block sums (VNNI) combined in fp64, or
// fp64 dots where the data is not FP4-like.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "core/aligned_vector.h"
#include "core/dtypes.h"
#include "core/thread_pool.h"
#include "kernels/cpu/kernels_internal.h"

#pragma GCC push_options
// GCC 12 warns about the deliberately undefined halves inside its own AVX-512 intrinsics.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx512vnni,fma,f16c")

namespace di::kern::avx512 {
namespace {

constexpr int kPanel = 32;        // output columns per panel: two zmm of 16 lanes
constexpr int kChunkBlocks = 8;   // K blocks per packed chunk: 8 x 16 pairs x 32 columns x 4 B = 16 KB
// Rows per microkernel call: 16 block accumulators + 16 totals (a few spill). 16 independent
// chains cover vdpbf16ps's latency at two per cycle (6 rows' 12 barely do); the same per-column
// chains for any row count, so the same bits.
constexpr int kRowTile = 8;
// wo_a rows from which the GEMM layout of the certified kernel (exact numerics) runs: below them
// building the packed group costs more than it saves; on the repacked layout the panel kernel
// stays faster up to about 32 rows (docs/kernels.md).
constexpr int kCertifiedGemmRows = 12, kCertifiedGemmRowsPacked = 32;
constexpr int kCertTile = 6;           // its rows per tile: 12 block sums + 12 magnitude sums (totals in L1)

template <class F>
void run(ThreadPool* pool, int64_t n, int64_t grain, F&& f, int chunks_per_thread = ThreadPool::kChunksPerThread) {
  if (pool && pool->size() > 1 && n > grain) pool->parallel_for(n, grain, f, chunks_per_thread);
  else if (n > 0) f(int64_t(0), n, 0);
}

inline float pow2_ceil_bits(float t) {
  uint32_t b;
  std::memcpy(&b, &t, 4);
  const int ceil_log2 = int((b >> 23) & 0xff) - 127 + ((b & 0x7fffff) != 0);
  const uint32_t r = uint32_t(ceil_log2 + 127) << 23;
  float s;
  std::memcpy(&s, &r, 4);
  return s;
}

// act_quant of one 32-block, bit for bit: returns the 32 E4M3 values as bf16, and the scale.
inline __m512i quant_block32(const float* x, float* scale) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const __m512 absm = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  // std::max(amax, |x|) ignores a NaN |x|; max_ps returns its second operand when one is NaN.
  __m512 mx = _mm512_max_ps(_mm512_and_ps(v0, absm), _mm512_set1_ps(1e-4f));
  mx = _mm512_max_ps(_mm512_and_ps(v1, absm), mx);
  const float s = pow2_ceil_bits(_mm512_reduce_max_ps(mx) * (1.0f / 448.0f));
  *scale = s;
  const __m512 sv = _mm512_set1_ps(s);
  __m512 out[2];
  const __m512 vs[2] = {v0, v1};
  for (int h = 0; h < 2; ++h) {
    // std::clamp keeps NaN; min/max_ps return the second operand for NaN.
    __m512 q = _mm512_div_ps(vs[h], sv);
    q = _mm512_min_ps(_mm512_set1_ps(448.f), _mm512_max_ps(_mm512_set1_ps(-448.f), q));
    const __m512i bits = _mm512_castps_si512(q);
    const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(int(0x80000000u)));
    const __m512i ab = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    // Normal E4M3 range: round the fp32 mantissa to 3 bits, ties to even.
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ab, 20), _mm512_set1_epi32(1));
    const __m512i rn = _mm512_and_si512(_mm512_add_epi32(ab, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff), lsb)),
                                        _mm512_set1_epi32(int(0xfff00000u)));
    // Below 2^-6: multiples of 2^-9, ties to even.
    const __m512 af = _mm512_castsi512_ps(ab);
    const __m512 sub = _mm512_roundscale_ps(af, (9 << 4) | _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 small = _mm512_cmp_ps_mask(af, _mm512_set1_ps(0x1p-6f), _CMP_LT_OQ);
    __m512i r = _mm512_mask_mov_epi32(rn, small, _mm512_castps_si512(sub));
    r = _mm512_or_si512(r, sign);
    const __mmask16 nan = _mm512_cmp_ps_mask(q, q, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, bits);
    out[h] = _mm512_castsi512_ps(r);
  }
  return (__m512i)_mm512_cvtne2ps_pbh(out[1], out[0]);
}

// In-register transpose of 16 rows x 16 dwords.
__attribute__((always_inline)) inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i s[16];
  for (int g = 0; g < 4; ++g) {
    s[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    s[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    s[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    s[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  // s[4g + c], 128-bit lane L = column 4L + c of rows 4g..4g+3.
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(s[c], s[4 + c], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(s[c], s[4 + c], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(s[8 + c], s[12 + c], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(s[8 + c], s[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
}

// E8M0 codes (low byte of each dword) -> 2^(c-127): the code is the fp32 exponent field, except
// 0 (2^-127, a denormal) and 255 (NaN).
inline __m512 e8m0_ps(__m512i codes) {
  const __m512i c = _mm512_and_si512(codes, _mm512_set1_epi32(0xff));
  __m512i b = _mm512_slli_epi32(c, 23);
  b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(c, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
  b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(c, _mm512_set1_epi32(0xff)), _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(b);
}

// Mask of the first `bytes` bytes of a 64-byte load (rows end inside the last chunk).
inline __mmask64 first_bytes(int64_t bytes) { return bytes >= 64 ? ~__mmask64(0) : (__mmask64(1) << bytes) - 1; }

// E4M3 -> bf16 by two 128-entry byte tables (low and high byte of the bf16, indexed by the 7-bit
// magnitude); the sign bit is or'ed into the high byte. Exact, NaN codes give NaN.
struct Fp8Lut {
  __m512i lo0, lo1, hi0, hi1;
  Fp8Lut() {
    alignas(64) uint8_t lo[128], hi[128];
    for (int c = 0; c < 128; ++c) {
      const uint16_t b = f32_to_bf16(e4m3_to_f32(uint8_t(c)));  // exact
      lo[c] = uint8_t(b & 0xff);
      hi[c] = uint8_t(b >> 8);
    }
    lo0 = _mm512_loadu_si512(lo), lo1 = _mm512_loadu_si512(lo + 64);
    hi0 = _mm512_loadu_si512(hi), hi1 = _mm512_loadu_si512(hi + 64);
  }
};

// Packs FP8 rows [n0, n0 + nvalid) x blocks [kb0, kb1) into dst[(kb - kb0) * 16 + pair][32 columns].
// Per row, 64 bytes (two blocks) are converted with the tables; the in-lane interleave of
// unpacklo/hi leaves pair p of the two blocks at dword 4*(p/8) + p%4 of A (p%8 < 4) or of B.
void pack_fp8(const uint8_t* w, int64_t K, int64_t n0, int nvalid, int64_t kb0, int64_t kb1, const Fp8Lut& t,
              uint32_t* dst) {
  const __m512i sign = _mm512_set1_epi32(int(0x80808080u));
  for (int g = 0; g < 2; ++g) {
    for (int64_t kb = kb0; kb < kb1; kb += 2) {
      const __mmask64 mask = first_bytes((kb1 - kb) * 32);
      __m512i A[16], B[16];
      for (int i = 0; i < 16; ++i) {
        const int n = g * 16 + i;
        if (n >= nvalid) {
          A[i] = B[i] = _mm512_setzero_si512();
          continue;
        }
        const uint8_t* row = w + (n0 + n) * K + kb * 32;
        // 32 rows are streamed a few lines at a time: too many streams for the hardware
        // prefetcher to run ahead, so fetch the next chunk of each row explicitly.
        _mm_prefetch(reinterpret_cast<const char*>(row + kChunkBlocks * 32), _MM_HINT_T0);
        const __m512i b = _mm512_maskz_loadu_epi8(mask, row);
        const __m512i lo = _mm512_permutex2var_epi8(t.lo0, b, t.lo1);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, b, t.hi1), b, sign, 0xF8);
        A[i] = _mm512_unpacklo_epi8(lo, hi);
        B[i] = _mm512_unpackhi_epi8(lo, hi);
      }
      transpose16(A);
      transpose16(B);
      const int pairs = int(std::min<int64_t>(2, kb1 - kb)) * 16;
      uint32_t* d = dst + (kb - kb0) * 16 * kPanel + g * 16;
      for (int q = 0; q < 16; ++q) {
        const int pa = 8 * (q / 4) + q % 4, pb = pa + 4;
        if (pa < pairs) _mm512_storeu_si512(d + pa * kPanel, A[q]);
        if (pb < pairs) _mm512_storeu_si512(d + pb * kPanel, B[q]);
      }
    }
  }
}

// Packs FP4 rows: per 16 rows, 64 bytes each (four blocks, one byte = one K pair) are transposed
// as bytes (4 unpack rounds: register = pair within the 128-bit lane, byte = row), then every
// 16-row byte vector becomes 16 dwords of two bf16 via one 32-entry word table.
void pack_fp4(const uint8_t* w, int64_t K, int64_t n0, int nvalid, int64_t kb0, int64_t kb1, __m512i table,
              uint32_t* dst) {
  const int64_t row_bytes = K / 2;
  alignas(64) uint8_t tb[16 * 64];
  for (int g = 0; g < 2; ++g) {
    for (int64_t kb = kb0; kb < kb1; kb += 4) {
      const __mmask64 mask = first_bytes((kb1 - kb) * 16);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int n = g * 16 + i;
        if (n >= nvalid) {
          r[i] = _mm512_setzero_si512();
          continue;
        }
        const uint8_t* row = w + (n0 + n) * row_bytes + kb * 16;
        _mm_prefetch(reinterpret_cast<const char*>(row + kChunkBlocks * 16), _MM_HINT_T0);
        r[i] = _mm512_maskz_loadu_epi8(mask, row);
      }
      for (int round = 0; round < 4; ++round) {
        __m512i o[16];
        for (int i = 0; i < 8; ++i) {
          o[2 * i] = _mm512_unpacklo_epi8(r[i], r[i + 8]);
          o[2 * i + 1] = _mm512_unpackhi_epi8(r[i], r[i + 8]);
        }
        for (int i = 0; i < 16; ++i) r[i] = o[i];
      }
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(tb + c * 64, r[c]);
      const int nb = int(std::min<int64_t>(4, kb1 - kb));
      for (int L = 0; L < nb; ++L)
        for (int c = 0; c < 16; ++c) {
          // dword = byte b: low word indexes with b (the table ignores bit 4), high word with b >> 4.
          const __m512i x = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(tb + c * 64 + L * 16)));
          const __m512i v = _mm512_permutexvar_epi16(_mm512_or_si512(x, _mm512_slli_epi32(x, 12)), table);
          _mm512_storeu_si512(dst + ((kb - kb0 + L) * 16 + c) * kPanel + g * 16, v);
        }
    }
  }
}

// ---- Repacked ("panel") layout, built once at load time by pack_weight ----
// FP8: per panel of 32 output columns, K block and K pair j, one 64-byte chunk laid out so that
// the table conversion's unpacklo/unpackhi land directly in the microkernel's [pair][column]
// order: byte 16L + 2q + e is column 4L + q, byte 16L + 8 + 2q + e column 16 + 4L + q (lane L,
// element e of the pair). FP4: pairs 2j and 2j + 1 share one 64-byte chunk, one 16-bit word per
// column and pair element holding the four nibbles it needs (layout at cvt_pair_fp4), so a
// conversion is at most two shifts and one word lookup per vector, with no byte-to-word expansion.
// After all weights, 32 scale bytes per (panel, block) in column order. Rows past `out` are zero.
inline int64_t n_panels(int64_t out) { return (out + kPanel - 1) / kPanel; }
constexpr int64_t kFp8PairBytes = 64;  // per panel and K pair
constexpr int64_t kFp8BlockBytes = 16 * kFp8PairBytes, kFp4BlockBytes = 8 * 64;  // per panel and K block

// One K pair of a repacked panel -> the bf16 pairs of columns 0-15 (w0) and 16-31 (w1).
inline void cvt_pair_fp8(const uint8_t* chunk, const Fp8Lut& t, __m512i& w0, __m512i& w1) {
  const __m512i b = _mm512_loadu_si512(chunk);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, b, t.lo1);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, b, t.hi1), b,
                                               _mm512_set1_epi32(int(0x80808080u)), 0xF8);  // | the sign bits
  w0 = _mm512_unpacklo_epi8(lo, hi);
  w1 = _mm512_unpackhi_epi8(lo, hi);
}
// bf16(E2M1 code) for word indices 0-31 (vpermw reads five index bits; entry i is code i & 15).
struct Fp4Lut {
  __m512i bf16;
  Fp4Lut() {
    alignas(64) uint16_t t[32];
    for (int i = 0; i < 32; ++i) t[i] = f32_to_bf16(e2m1_to_f32(uint8_t(i & 15)));  // exact
    bf16 = _mm512_loadu_si512(t);
  }
};
// Pair `pair` of a repacked FP4 panel at base -> the bf16 pairs of columns 0-15 (w0) and 16-31 (w1).
// Pairs 2j and 2j + 1 share 64 bytes; word 2i + e holds element e of the pair in column i (nibble 0:
// pair 2j, nibble 2: pair 2j + 1) and in column 16 + i (nibbles 1 and 3). A shift puts the nibble
// in the low bits and one word lookup per vector decodes it, with no byte-to-word expansion.
inline void cvt_pair_fp4(const uint8_t* base, int64_t pair, const Fp4Lut& t, __m512i& w0, __m512i& w1) {
  const __m512i b = _mm512_loadu_si512(base + (pair >> 1) * 64);
  const __m512i lo = pair & 1 ? _mm512_srli_epi16(b, 8) : b;
  w0 = _mm512_permutexvar_epi16(lo, t.bf16);
  w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(lo, 4), t.bf16);
}
// cvt_pair_fp4 for the m <= 8 kernels; kPairsShareLoad has them step two pairs at a time, so the
// parity (which nibbles) is known at compile time.
struct Fp4PairCvt {
  static constexpr bool kPairsShareLoad = true;
  const Fp4Lut& lut;
  void operator()(const uint8_t* base, int64_t pair, __m512i& w0, __m512i& w1) const { cvt_pair_fp4(base, pair, lut, w0, w1); }
};
// 16 E8M0 codes -> fp32 scales.
inline __m512 e8m0x16_ps(const uint8_t* p) {
  return e8m0_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// K blocks kb0..kb1 of a repacked panel into the microkernel's [pair][column] buffer.
void convert_packed_fp8(const uint8_t* src, int64_t kb0, int64_t kb1, const Fp8Lut& t, uint32_t* dst) {
  for (int64_t i = 0; i < (kb1 - kb0) * 16; ++i) {
    __m512i w0, w1;
    cvt_pair_fp8(src + (kb0 * 16 + i) * kFp8PairBytes, t, w0, w1);
    _mm512_storeu_si512(dst + i * kPanel, w0);
    _mm512_storeu_si512(dst + i * kPanel + 16, w1);
  }
}
void convert_packed_fp4(const uint8_t* src, int64_t kb0, int64_t kb1, const Fp4Lut& t, uint32_t* dst) {
  for (int64_t i = 0; i < (kb1 - kb0) * 16; ++i) {
    __m512i w0, w1;
    cvt_pair_fp4(src, kb0 * 16 + i, t, w0, w1);
    _mm512_storeu_si512(dst + i * kPanel, w0);
    _mm512_storeu_si512(dst + i * kPanel + 16, w1);
  }
}

// bf16 of the 16 E2M1 codes, repeated for indices 16..31 (bit 4 of the index is the neighbour's).
__m512i e2m1_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = f32_to_bf16(e2m1_to_f32(uint8_t(i & 15)));  // exact
  return _mm512_loadu_si512(t);
}

inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// Zeroes an R x P x 2 register tile (fully unrolled: a loop left on its own kept the tile on the stack).
template <int R, int P>
inline void zero_tile(__m512 (&a)[R][P][2]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int q = 0; q < P; ++q) a[r][q][0] = a[r][q][1] = _mm512_setzero_ps();
}

// t += (block sums x activation scale of the row) x weight scales, for R rows and P panels: the
// one per-block epilogue of micro and q1_panels, so both give a column the same bits.
template <int R, int P>
inline void add_block_totals(__m512 (&t)[R][P][2], const __m512 (&acc)[R][P][2], const float* sa, int64_t lds,
                             const __m512 (&s)[P][2]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(sa[r * lds]);
#pragma GCC unroll 16
    for (int q = 0; q < P; ++q)
#pragma GCC unroll 16
      for (int h = 0; h < 2; ++h) t[r][q][h] = _mm512_add_ps(t[r][q][h], _mm512_mul_ps(_mm512_mul_ps(acc[r][q][h], a), s[q][h]));
  }
}

// Totals += per block: (block sum of the pair products) x act_scale x weight_scale, for R rows and
// P panels. Panel q's converted weights are at panel + q * pstride, its scales at sw + q * sstride,
// the totals of (row r, panel q) at T + (r * P + q) * 32. Several panels at small R keep enough
// independent vdpbf16ps chains in flight to cover the instruction's latency; each column's own
// chain (and so its rounding) is the same for every R and P.
template <int R, int P>
inline void micro(const uint16_t* xq, int64_t ldx, const float* sa, int64_t lds, const uint32_t* panel,
                  int64_t pstride, const float* sw, int64_t sstride, int nb, float* T) {
  __m512 t[R][P][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int q = 0; q < P; ++q)
#pragma GCC unroll 16
      for (int h = 0; h < 2; ++h) t[r][q][h] = _mm512_loadu_ps(T + (r * P + q) * kPanel + h * 16);
  for (int b = 0; b < nb; ++b) {
    __m512 acc[R][P][2];
    zero_tile(acc);
    const uint16_t* xb = xq + b * 32;
    for (int j = 0; j < 16; ++j) {
      __m512bh w[P][2];
#pragma GCC unroll 16
      for (int q = 0; q < P; ++q) {
        const uint32_t* pw = panel + q * pstride + (b * 16 + j) * kPanel;
        w[q][0] = (__m512bh)_mm512_loadu_si512(pw);
        w[q][1] = (__m512bh)_mm512_loadu_si512(pw + 16);
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = bcast_pair(xb + r * ldx + 2 * j);
#pragma GCC unroll 16
        for (int q = 0; q < P; ++q)
#pragma GCC unroll 16
          for (int h = 0; h < 2; ++h) acc[r][q][h] = _mm512_dpbf16_ps(acc[r][q][h], w[q][h], xv);
      }
    }
    __m512 s[P][2];
#pragma GCC unroll 16
    for (int q = 0; q < P; ++q)
#pragma GCC unroll 16
      for (int h = 0; h < 2; ++h) s[q][h] = _mm512_loadu_ps(sw + q * sstride + b * kPanel + h * 16);
    add_block_totals(t, acc, sa + b, lds, s);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int q = 0; q < P; ++q)
#pragma GCC unroll 16
      for (int h = 0; h < 2; ++h) _mm512_storeu_ps(T + (r * P + q) * kPanel + h * 16, t[r][q][h]);
}

// Row tiles: up to kRowTile rows of one panel, or (at m = 1, 2) rows of several panels at once.
template <int P>
inline void micro_rows(int R, const uint16_t* xq, int64_t ldx, const float* sa, int64_t lds, const uint32_t* panel,
                       int64_t pstride, const float* sw, int64_t sstride, int nb, float* T) {
  if constexpr (P == 4) {
    micro<1, 4>(xq, ldx, sa, lds, panel, pstride, sw, sstride, nb, T);
  } else if constexpr (P == 2) {
    micro<2, 2>(xq, ldx, sa, lds, panel, pstride, sw, sstride, nb, T);
  } else {
    switch (R) {
      case 1: micro<1, 1>(xq, ldx, sa, lds, panel, pstride, sw, sstride, nb, T); break;
      case 2: micro<2, 1>(xq, ldx, sa, lds, panel, pstride, sw, sstride, nb, T); break;
      case 3: micro<3, 1>(xq, ldx, sa, lds, panel, pstride, sw, sstride, nb, T); break;
      case 4: micro<4, 1>(xq, ldx, sa, lds, panel, pstride, sw, sstride, nb, T); break;
      case 5: micro<5, 1>(xq, ldx, sa, lds, panel, pstride, sw, sstride, nb, T); break;
      case 6: micro<6, 1>(xq, ldx, sa, lds, panel, pstride, sw, sstride, nb, T); break;
      case 7: micro<7, 1>(xq, ldx, sa, lds, panel, pstride, sw, sstride, nb, T); break;
      default: micro<8, 1>(xq, ldx, sa, lds, panel, pstride, sw, sstride, nb, T); break;
    }
  }
}

// fp32 -> bf16 -> fp32, round to nearest even, NaN kept quiet (as di::round_bf16), denormals kept.
inline __m512 round_bf16_ps(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)),
                               _mm512_set1_epi32(int(0xffff0000u)));
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))),
                                                    _mm512_set1_epi32(0x00400000)));
  return _mm512_castsi512_ps(r);
}

// glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, as built for x86-64 with FMA: the variant its
// libm runs on every CPU with AVX-512) in 8 fp64 lanes: the same table, constants and operations,
// with the FMAs where that build contracts them, so the bits are std::exp's (checked against it on
// all 2^32 floats once; tests sample them). Arguments it hands to its special cases (|x| >= 88 or
// so, NaN, inf) are left to std::exp.
constexpr uint64_t kExp2fTable[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540};

inline __m256 expf_libm_8(__m256 x) {
  const __m512d inv_ln2_n = _mm512_set1_pd(0x1.71547652b82fep+5), shift = _mm512_set1_pd(0x1.8p+52);
  const __m512d xd = _mm512_cvtps_pd(x);
  const __m512d kd_shifted = _mm512_fmadd_pd(inv_ln2_n, xd, shift);
  const __m512i ki = _mm512_castpd_si512(kd_shifted);
  const __m512d r = _mm512_fmsub_pd(inv_ln2_n, xd, _mm512_sub_pd(kd_shifted, shift));
  const __m512i* tab = reinterpret_cast<const __m512i*>(kExp2fTable);
  const __m512i lo = _mm512_permutex2var_epi64(_mm512_loadu_si512(tab), ki, _mm512_loadu_si512(tab + 1));
  const __m512i hi = _mm512_permutex2var_epi64(_mm512_loadu_si512(tab + 2), ki, _mm512_loadu_si512(tab + 3));
  const __m512i t = _mm512_mask_mov_epi64(lo, _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16)), hi);
  const __m512d s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64(ki, 47)));
  const __m512d z = _mm512_fmadd_pd(_mm512_set1_pd(0x1.c6af84b912394p-20), r, _mm512_set1_pd(0x1.ebfce50fac4f3p-13));
  const __m512d y = _mm512_fmadd_pd(r, _mm512_set1_pd(0x1.62e42ff0c52d6p-6), _mm512_set1_pd(1.0));
  return _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_fmadd_pd(z, _mm512_mul_pd(r, r), y), s));
}

// std::exp of 16 floats.
inline __m512 expf_libm_ps(__m512 v) {
  __m512 e = _mm512_insertf32x8(_mm512_castps256_ps512(expf_libm_8(_mm512_castps512_ps256(v))),
                                expf_libm_8(_mm512_extractf32x8_ps(v, 1)), 1);
  const __m512i top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(v), 20), _mm512_set1_epi32(0x7ff));
  if (const unsigned special = _mm512_cmpgt_epu32_mask(top, _mm512_set1_epi32(0x42a))) {
    alignas(64) float x[16], out[16];
    _mm512_store_ps(x, v);
    _mm512_store_ps(out, e);
    for (unsigned s = special; s; s &= s - 1) out[__builtin_ctz(s)] = std::exp(x[__builtin_ctz(s)]);
    e = _mm512_load_ps(out);
  }
  return e;
}

// std::exp of n floats (n <= 16) from x into out.
inline void expf_libm(const float* x, int n, float* out) {
  const __mmask16 k = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
  _mm512_mask_storeu_ps(out, k, expf_libm_ps(_mm512_maskz_loadu_ps(k, x)));
}

struct ActScratch {
  AlignedVector<uint16_t> xq;  // [m][K] E4M3 values as bf16
  AlignedVector<float> sa;     // [m][K/32]
};

void quantize_rows(const float* x, int64_t m, int64_t K, ActScratch& s, ThreadPool* pool) {
  const int64_t nkb = K / 32;
  if (int64_t(s.xq.size()) < m * K) s.xq.resize(size_t(m * K));
  if (int64_t(s.sa.size()) < m * nkb) s.sa.resize(size_t(m * nkb));
  uint16_t* xq = s.xq.data();
  float* sa = s.sa.data();
  auto body = [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t kb = 0; kb < nkb; ++kb)
        _mm512_storeu_si512(xq + r * K + kb * 32, quant_block32(x + r * K + kb * 32, sa + r * nkb + kb));
  };
  run(m >= 16 ? pool : nullptr, m, 1, body);
}

// The fast wo_a's activations (ref::fast::scale_act_bf16): scaled bf16 values, as bf16 bits.
void scale_rows_bf16(const float* x, int64_t m, int64_t K, ActScratch& s, ThreadPool* pool) {
  const int64_t nkb = (K + 31) / 32;
  if (int64_t(s.xq.size()) < m * K) s.xq.resize(size_t(m * K));
  if (int64_t(s.sa.size()) < m * nkb) s.sa.resize(size_t(m * nkb));
  uint16_t* xq = s.xq.data();
  float* sa = s.sa.data();
  if (K % 32) {
    thread_local std::vector<float> row;
    row.resize(size_t(K));
    for (int64_t r = 0; r < m; ++r) {
      ref::fast::scale_act_bf16(x + r * K, K, row.data(), sa + r * nkb);
      for (int64_t k = 0; k < K; ++k) xq[size_t(r * K + k)] = uint16_t(f32_bits(row[size_t(k)]) >> 16);
    }
    return;
  }
  const __m512 absm = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  auto body = [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const float* xb = x + r * K + kb * 32;
        const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        // std::max(amax, |x|) ignores a NaN |x|; max_ps returns its second operand when one is NaN.
        __m512 mx = _mm512_max_ps(_mm512_and_ps(v0, absm), _mm512_set1_ps(1e-4f));
        mx = _mm512_max_ps(_mm512_and_ps(v1, absm), mx);
        const float sc = pow2_ceil_bits(_mm512_reduce_max_ps(mx) * (1.0f / 448.0f));
        sa[r * nkb + kb] = sc;
        __m256i half[2];
        const __m512 vs[2] = {v0, v1};
        for (int h = 0; h < 2; ++h) {
          __m512 q = _mm512_div_ps(round_bf16_ps(vs[h]), _mm512_set1_ps(sc));  // exact: sc is a power of two
          const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_and_ps(q, absm), _mm512_set1_ps(0x1p-100f), _CMP_LT_OQ);
          q = _mm512_mask_mov_ps(q, tiny, _mm512_andnot_ps(absm, q));  // +-0, as std::copysign
          half[h] = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(q), 16));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * K + kb * 32), half[0]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * K + kb * 32 + 16), half[1]);
      }
  };
  run(m >= 16 ? pool : nullptr, m, 1, body);
}

// Stores one panel's 32 totals (t0: columns 0-15, t1: 16-31) of which `nvalid` are real columns,
// bf16-rounded unless the test hook asks for the fp32 totals.
inline void store_panel(float* y, int nvalid, __m512 t0, __m512 t1) {
  const __mmask16 k0 = __mmask16(nvalid >= 16 ? 0xffff : (1u << nvalid) - 1);
  const __mmask16 k1 = __mmask16(nvalid <= 16 ? 0 : nvalid >= 32 ? 0xffff : (1u << (nvalid - 16)) - 1);
  const bool round = !detail::unrounded_quant_output;
  _mm512_mask_storeu_ps(y, k0, round ? round_bf16_ps(t0) : t0);
  _mm512_mask_storeu_ps(y + 16, k1, round ? round_bf16_ps(t1) : t1);
}

// Any m: groups of P panels; per chunk of K blocks the panels are converted into an L1 buffer
// (pack / scales, see linear_q) and run through the microkernel for all rows.
template <int P, class Pack, class Scales>
void linear_q_panels(const uint16_t* xq, const float* sa, int64_t m, int64_t K, int64_t N, Pack& pack,
                     Scales& scales, float* y, ThreadPool* pool) {
  constexpr int kBlocks = kChunkBlocks / P;  // the P converted panels stay within 16 KB of L1
  constexpr int64_t pstride = kBlocks * 16 * kPanel, sstride = kBlocks * kPanel;
  const int64_t nkb = K / 32, npanels = n_panels(N), ngroups = (npanels + P - 1) / P;
  run(pool, ngroups, 1, [&](int64_t g0, int64_t g1, int) {
    alignas(64) static thread_local uint32_t panel[kChunkBlocks * 16 * kPanel];
    alignas(64) static thread_local float sw[kChunkBlocks * kPanel];
    thread_local AlignedVector<float> totals;
    if (int64_t(totals.size()) < m * P * kPanel) totals.resize(size_t(m * P * kPanel));
    float* T = totals.data();
    for (int64_t grp = g0; grp < g1; ++grp) {
      const int64_t first = grp * P;
      const int np = int(std::min<int64_t>(P, npanels - first));  // the last group may be short
      std::fill(T, T + m * P * kPanel, 0.f);
      for (int64_t kb0 = 0; kb0 < nkb; kb0 += kBlocks) {
        const int64_t kb1 = std::min(nkb, kb0 + kBlocks);
        for (int q = 0; q < P; ++q) {
          // A missing panel of a short group reuses the last one; its totals are not stored.
          const int64_t n0 = std::min(first + q, npanels - 1) * kPanel;
          const int nvalid = int(std::min<int64_t>(kPanel, N - n0));
          pack(n0, nvalid, kb0, kb1, panel + q * pstride);
          scales(n0, nvalid, kb0, kb1, sw + q * sstride);
        }
        for (int64_t r0 = 0; r0 < m; r0 += kRowTile)
          micro_rows<P>(int(std::min<int64_t>(kRowTile, m - r0)), xq + r0 * K + kb0 * 32, K, sa + r0 * nkb + kb0, nkb,
                        panel, pstride, sw, sstride, int(kb1 - kb0), T + r0 * P * kPanel);
      }
      for (int q = 0; q < np; ++q) {
        const int64_t n0 = (first + q) * kPanel;
        for (int64_t r = 0; r < m; ++r) {
          const float* t = T + (r * P + q) * kPanel;
          store_panel(y + r * N + n0, int(std::min<int64_t>(kPanel, N - n0)), _mm512_loadu_ps(t), _mm512_loadu_ps(t + 16));
        }
      }
    }
  });
}

// Up to this many rows, repacked weights go through linear_q1_packed (converted in registers for
// every 8 rows, no panel buffer): its 8-row passes stream each panel once and beat the buffered
// microkernel up to about 256 rows; beyond, the two tie (docs/kernels.md).
constexpr int64_t kFusedRows = 256;
// FP4 weights cost more to convert (a table lookup per pair), so beyond 16 rows converting a panel
// once into L1 for all rows wins: a prefill's experts (~50 rows each) run ~10 % faster.
constexpr int64_t kFusedRowsFp4 = 16;

// The shared FP8/FP4 driver. pack(n0, nvalid, kb0, kb1, panel) converts a panel's weights;
// scales(n0, nvalid, kb0, kb1, sw) writes their fp32 block scales as sw[(kb - kb0) * 32 + column].
// bf16_act: x is taken by scale_rows_bf16 (fast wo_a) instead of act_quant.
template <class Pack, class Scales, class Fused>
void linear_q(const float* x, int64_t m, int64_t K, int64_t N, Pack pack, Scales scales, Fused fused, float* y,
              ThreadPool* pool, bool bf16_act = false, int64_t fused_rows = kFusedRows) {
  thread_local ActScratch act;
  if (bf16_act) scale_rows_bf16(x, m, K, act, pool);
  else quantize_rows(x, m, K, act, pool);
  const uint16_t* xq = act.xq.data();
  const float* sa = act.sa.data();
  if (m <= fused_rows && fused(xq, sa)) return;
  if (m == 1) linear_q_panels<4>(xq, sa, m, K, N, pack, scales, y, pool);
  else if (m == 2) linear_q_panels<2>(xq, sa, m, K, N, pack, scales, y, pool);
  else linear_q_panels<1>(xq, sa, m, K, N, pack, scales, y, pool);
}

// Software prefetch distance for streamed weights: the hardware prefetchers alone leave one core
// well below its share of the memory bandwidth on the machines measured (docs/kernels.md).
constexpr int64_t kPrefetchBytes = 2048;

// M (1-3) rows on repacked weights: converts each pair in registers once and feeds vdpbf16ps for
// every row directly (no panel buffer), P panels at a time for independent chains. Same
// per-column order as micro.
// cvt(q_base, pair, w0, w1) converts pair `pair` (= kb * 16 + j) of the panel at q_base;
// scale(panel, kb, s0, s1) gives the panel's 32 fp32 weight scales of block kb.
// The P panels are first, first + stride, ...: a stride > 1 reads P separate memory streams.
template <int M, int P, class Cvt, class Scale>
void q1_panels(const uint16_t* xq, const float* sa, int64_t nkb, int64_t N, int64_t first, const uint8_t* packed,
               int64_t panel_bytes, int64_t pair_bytes, Cvt& cvt, Scale& scale, float* y, int64_t stride = 1) {
  const int64_t K = nkb * 32;
  const uint8_t* base[P];
#pragma GCC unroll 16
  for (int q = 0; q < P; ++q) base[q] = packed + (first + q * stride) * panel_bytes;
  __m512 t[M][P][2];
  zero_tile(t);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    __m512 acc[M][P][2];
    zero_tile(acc);
    auto pair_step = [&](int j) __attribute__((always_inline)) {
      __m512bh xv[M];
#pragma GCC unroll 16
      for (int r = 0; r < M; ++r) xv[r] = bcast_pair(xq + r * K + kb * 32 + 2 * j);
#pragma GCC unroll 16
      for (int q = 0; q < P; ++q) {
        __m512i w0, w1;
        _mm_prefetch(reinterpret_cast<const char*>(base[q] + (kb * 16 + j) * pair_bytes + kPrefetchBytes), _MM_HINT_T0);
        cvt(base[q], kb * 16 + j, w0, w1);
#pragma GCC unroll 16
        for (int r = 0; r < M; ++r) {
          acc[r][q][0] = _mm512_dpbf16_ps(acc[r][q][0], (__m512bh)w0, xv[r]);
          acc[r][q][1] = _mm512_dpbf16_ps(acc[r][q][1], (__m512bh)w1, xv[r]);
        }
      }
    };
    if constexpr (requires { Cvt::kPairsShareLoad; }) {  // two pairs per step: the parity is known
      for (int j = 0; j < 16; j += 2) pair_step(j), pair_step(j + 1);
    } else {
      for (int j = 0; j < 16; ++j) pair_step(j);
    }
    __m512 s[P][2];
#pragma GCC unroll 16
    for (int q = 0; q < P; ++q) scale(first + q * stride, kb, s[q][0], s[q][1]);
    add_block_totals(t, acc, sa + kb, nkb, s);
  }
#pragma GCC unroll 16
  for (int q = 0; q < P; ++q) {
    const int64_t n0 = (first + q * stride) * kPanel;
#pragma GCC unroll 16
    for (int r = 0; r < M; ++r) store_panel(y + r * N + n0, int(std::min<int64_t>(kPanel, N - n0)), t[r][q][0], t[r][q][1]);
  }
}

// Panels of P at a time, the chunk's remainder as one group of fewer (no repeated panels). The P
// panels of a pass come from the P equal parts of the chunk: P memory streams per thread, not one
// (a core keeps more reads in flight over several streams; docs/kernels.md). Each panel's
// arithmetic is unchanged.
template <int M, int P, class Cvt, class Scale>
void q1_chunk(const uint16_t* xq, const float* sa, int64_t nkb, int64_t N, int64_t p0, int64_t p1, const uint8_t* packed,
              int64_t panel_bytes, int64_t pair_bytes, Cvt& cvt, Scale& scale, float* y) {
  const int64_t part = detail::interleaved_weight_streams ? (p1 - p0) / P : 0;
  for (int64_t j = 0; j < part; ++j)
    q1_panels<M, P>(xq, sa, nkb, N, p0 + j, packed, panel_bytes, pair_bytes, cvt, scale, y, part);
  int64_t first = p0 + P * part;
  for (; first + P <= p1; first += P) q1_panels<M, P>(xq, sa, nkb, N, first, packed, panel_bytes, pair_bytes, cvt, scale, y);
  switch (p1 - first) {
    case 3: if constexpr (P > 3) q1_panels<M, 3>(xq, sa, nkb, N, first, packed, panel_bytes, pair_bytes, cvt, scale, y); break;
    case 2: if constexpr (P > 2) q1_panels<M, 2>(xq, sa, nkb, N, first, packed, panel_bytes, pair_bytes, cvt, scale, y); break;
    case 1: if constexpr (P > 1) q1_panels<M, 1>(xq, sa, nkb, N, first, packed, panel_bytes, pair_bytes, cvt, scale, y); break;
    default: break;
  }
}

// q1_panels<M, 1> for M = 5..8 rows: the 2M block accumulators in registers, the totals in
// memory (updated once per block by add_block_totals' operations: the same bits), so each weight
// pair is converted once for all M rows.
template <int M, class Cvt, class Scale>
void q1_panel_wide(const uint16_t* xq, const float* sa, int64_t nkb, int64_t N, int64_t panel, const uint8_t* packed,
                   int64_t panel_bytes, int64_t pair_bytes, Cvt& cvt, Scale& scale, float* y) {
  const int64_t K = nkb * 32;
  const uint8_t* base = packed + panel * panel_bytes;
  alignas(64) float T[M][kPanel] = {};
  for (int64_t kb = 0; kb < nkb; ++kb) {
    __m512 acc[M][2];
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int j = 0; j < 16; ++j) {
      __m512i w0, w1;
      _mm_prefetch(reinterpret_cast<const char*>(base + (kb * 16 + j) * pair_bytes + kPrefetchBytes), _MM_HINT_T0);
      cvt(base, kb * 16 + j, w0, w1);
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) {
        const __m512bh xv = bcast_pair(xq + r * K + kb * 32 + 2 * j);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)w0, xv);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)w1, xv);
      }
    }
    __m512 s0, s1;
    scale(panel, kb, s0, s1);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const __m512 a = _mm512_set1_ps(sa[r * nkb + kb]);
      _mm512_store_ps(T[r], _mm512_add_ps(_mm512_load_ps(T[r]), _mm512_mul_ps(_mm512_mul_ps(acc[r][0], a), s0)));
      _mm512_store_ps(T[r] + 16, _mm512_add_ps(_mm512_load_ps(T[r] + 16), _mm512_mul_ps(_mm512_mul_ps(acc[r][1], a), s1)));
    }
  }
  const int64_t n0 = panel * kPanel;
  for (int r = 0; r < M; ++r)
    store_panel(y + r * N + n0, int(std::min<int64_t>(kPanel, N - n0)), _mm512_load_ps(T[r]), _mm512_load_ps(T[r] + 16));
}

// m = 1..3 rows on the repacked layout, converting each weight pair once for all rows (the
// microkernel path would convert whole panels into a buffer first, unamortized at so few rows).
// Each column's vdpbf16ps chain and block-scale sums are the microkernel's, so are the bits.
template <class Cvt, class Scale>
void linear_q1_packed(const uint16_t* xq, const float* sa, int64_t m, int64_t K, int64_t N, const uint8_t* packed,
                      int64_t panel_bytes, Cvt& cvt, Scale& scale, float* y, ThreadPool* pool) {
  const int64_t nkb = K / 32, npanels = n_panels(N), pair_bytes = panel_bytes / (nkb * 16);
  run(pool, npanels, 1, [&](int64_t p0, int64_t p1, int) {
    if (m == 1) q1_chunk<1, 4>(xq, sa, nkb, N, p0, p1, packed, panel_bytes, pair_bytes, cvt, scale, y);
    else if (m == 2) q1_chunk<2, 2>(xq, sa, nkb, N, p0, p1, packed, panel_bytes, pair_bytes, cvt, scale, y);
    else if (m == 3) q1_chunk<3, 2>(xq, sa, nkb, N, p0, p1, packed, panel_bytes, pair_bytes, cvt, scale, y);
    else  // up to 8 rows at a time per panel: the panel is streamed once, re-read from cache by the next 8
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t r0 = 0; r0 < m; r0 += 8) {
          const uint16_t* xr = xq + r0 * K;
          const float* sr = sa + r0 * nkb;
          float* yr = y + r0 * N;
          switch (std::min<int64_t>(8, m - r0)) {
            case 8: q1_panel_wide<8>(xr, sr, nkb, N, p, packed, panel_bytes, pair_bytes, cvt, scale, yr); break;
            case 7: q1_panel_wide<7>(xr, sr, nkb, N, p, packed, panel_bytes, pair_bytes, cvt, scale, yr); break;
            case 6: q1_panel_wide<6>(xr, sr, nkb, N, p, packed, panel_bytes, pair_bytes, cvt, scale, yr); break;
            case 5: q1_panel_wide<5>(xr, sr, nkb, N, p, packed, panel_bytes, pair_bytes, cvt, scale, yr); break;
            case 4: q1_panels<4, 1>(xr, sr, nkb, N, p, packed, panel_bytes, pair_bytes, cvt, scale, yr); break;
            case 3: q1_panels<3, 1>(xr, sr, nkb, N, p, packed, panel_bytes, pair_bytes, cvt, scale, yr); break;
            case 2: q1_panels<2, 1>(xr, sr, nkb, N, p, packed, panel_bytes, pair_bytes, cvt, scale, yr); break;
            default: q1_panels<1, 1>(xr, sr, nkb, N, p, packed, panel_bytes, pair_bytes, cvt, scale, yr); break;
          }
        }
  });
}

// ---- fp64-accumulated linears ----

// 16 E4M3 codes -> fp16 bits of value x 2^-8 (subnormals included, exact): sign-extended, the code
// shifted into place, bit 14 (a sign copy) cleared; S.1111.111 is NaN.
inline __m256i e4m3x16_half(const uint8_t* p) {
  const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(int16_t(0xbf80)));
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x3f80)), _mm256_set1_epi16(0x3f80));
  return _mm256_mask_mov_epi16(h, nan, _mm256_set1_epi16(0x7e00));
}

// ---- fp64 linears (bf16, fp32, FP8 x block scale weights) ----
// Exact products summed in fp64 and rounded once. The activation rows are converted to fp64 once
// per call (in the order the weight loop consumes them) and four weight rows share each x load;
// the weight conversions avoid cross-lane shuffles where they can, which bound these loops.
// Each output's sum order depends on K only, never on m, the tile or the thread split.

constexpr int kRows64 = 4;  // weight rows per inner loop

// x as fp64, in order.
void widen_x(const float* x, int64_t K, double* xd) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) _mm512_storeu_pd(xd + k, _mm512_cvtps_pd(_mm256_loadu_ps(x + k)));
  for (; k < K; ++k) xd[k] = x[k];
}

// x widened to fp64 in this thread's buffer (valid until its next use on the thread).
const double* widened_x(const float* x, int64_t n) {
  thread_local AlignedVector<double> xs;
  if (int64_t(xs.size()) < n) xs.resize(size_t(n));
  widen_x(x, n, xs.data());
  return xs.data();
}

// Widened x for the bf16 kernel: per 16 K, x[k + 2d] for d = 0..7, then x[k + 2d + 1].
void widen_x_bf16(const float* x, int64_t K, double* xd) {
  const __m512i even_odd = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_permutexvar_ps(even_odd, _mm512_loadu_ps(x + k));
    _mm512_storeu_pd(xd + k, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    _mm512_storeu_pd(xd + k + 8, _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
  }
  for (; k < K; ++k) xd[k] = x[k];
}

// sums[r kRows64 + i] = sum_k x_r[k] w_i(k) for M x rows (xd + r K) and kRows64 weight rows; wv(i, k, lo,
// hi) gives weights k..k+15 of row i as two fp64 vectors in the order of xd; w1(i, k) one weight
// (the K % 16 tail). Each weight vector is converted once for all M rows; every (r, i) sum has the
// same lanes, reduction and tail for any M, so M changes the speed, never the bits.
template <int M, class W16, class W1>
inline void dot4_f64_rows(const double* xd, int64_t K, int rows, W16&& wv, W1&& w1, double* sums) {
  __m512d a[M][kRows64][2];
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 16
    for (int i = 0; i < kRows64; ++i) a[r][i][0] = a[r][i][1] = _mm512_setzero_pd();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
#pragma GCC unroll 16
    for (int i = 0; i < kRows64; ++i) {
      if (i >= rows) break;
      __m512d w0, w1v;
      wv(i, k, w0, w1v);
#pragma GCC unroll 4
      for (int r = 0; r < M; ++r) {
        a[r][i][0] = _mm512_fmadd_pd(_mm512_loadu_pd(xd + r * K + k), w0, a[r][i][0]);
        a[r][i][1] = _mm512_fmadd_pd(_mm512_loadu_pd(xd + r * K + k + 8), w1v, a[r][i][1]);
      }
    }
  }
  for (int r = 0; r < M; ++r)
    for (int i = 0; i < rows; ++i) {
      double tail = 0;
      for (int64_t t = k; t < K; ++t) tail += xd[r * K + t] * w1(i, t);
      sums[r * kRows64 + i] = _mm512_reduce_add_pd(_mm512_add_pd(a[r][i][0], a[r][i][1])) + tail;
    }
}

// One x row.
template <class W16, class W1>
inline void dot4_f64(const double* xd, int64_t K, int rows, W16&& wv, W1&& w1, double* sums) {
  dot4_f64_rows<1>(xd, K, rows, wv, w1, sums);
}

// dot4_f64_rows for nx <= kDotRows64 x rows.
constexpr int kDotRows64 = 3;  // 24 accumulators, the weights' two vectors and a temporary
template <class W16, class W1>
inline void dot4_f64_nrows(int nx, const double* xd, int64_t K, int rows, W16&& wv, W1&& w1, double* sums) {
  switch (nx) {
    case 1: return dot4_f64_rows<1>(xd, K, rows, wv, w1, sums);
    case 2: return dot4_f64_rows<2>(xd, K, rows, wv, w1, sums);
    default: return dot4_f64_rows<3>(xd, K, rows, wv, w1, sums);
  }
}

// sums[q] = sum_k xs[q][k] ws[q][k] for up to kRows64 independent pairs, each exactly as dot4_f64
// computes one row (same lanes, reduction and tail): the same bits, with 4 chains in flight.
inline void dot_pairs_f64(const double* const* xs, const double* const* ws, int n, int64_t K, double* sums) {
  __m512d a[kRows64][2];
#pragma GCC unroll 16
  for (int i = 0; i < kRows64; ++i) a[i][0] = a[i][1] = _mm512_setzero_pd();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
#pragma GCC unroll 16
    for (int i = 0; i < kRows64; ++i) {
      if (i >= n) break;
      a[i][0] = _mm512_fmadd_pd(_mm512_loadu_pd(xs[i] + k), _mm512_loadu_pd(ws[i] + k), a[i][0]);
      a[i][1] = _mm512_fmadd_pd(_mm512_loadu_pd(xs[i] + k + 8), _mm512_loadu_pd(ws[i] + k + 8), a[i][1]);
    }
  }
  for (int i = 0; i < n; ++i) {
    double tail = 0;
    for (int64_t t = k; t < K; ++t) tail += xs[i][t] * ws[i][t];
    sums[i] = _mm512_reduce_add_pd(_mm512_add_pd(a[i][0], a[i][1])) + tail;
  }
}

// From this many rows the fp64 linears work on (row block x column block) units; below it the
// columns alone are split.
constexpr int64_t kBlockedRows64 = 16;

// y[r, n] = out(n, sum) over m rows. Few rows (decode): x is widened once and the columns are
// split over threads in tiles of kRows64. Many rows (prefill): units of a row block (about
// 128 KB of widened x) by 16 tiles, each unit's rows widened by the thread that runs it and
// reused from cache across its tiles (a column split would re-stream all m widened rows for
// every tile, after a serial widening pass). Each tile takes its rows kDotRows64 at a time
// (dot4_f64_rows: every output's sum is the same whichever rows share a call), so the bits do not
// depend on m, the path or the thread split.
template <class Widen, class Dot4, class Out>
void linear_f64_rows(const float* x, int64_t m, int64_t N, int64_t K, Widen&& widen, Dot4&& dot4, Out&& out, float* y,
                     ThreadPool* pool) {
  const int64_t tiles = (N + kRows64 - 1) / kRows64;
  // Tile t for rows [r0, r1), whose widened x starts at xr.
  auto tile = [&](const double* xr, int64_t r0, int64_t r1, int64_t t) {
    double sums[kDotRows64][kRows64];
    const int64_t n0 = t * kRows64;
    const int rows = int(std::min<int64_t>(kRows64, N - n0));
    for (int64_t r = r0; r < r1; r += kDotRows64) {
      const int nx = int(std::min<int64_t>(kDotRows64, r1 - r));
      dot4(xr + (r - r0) * K, nx, n0, rows, &sums[0][0]);
      for (int j = 0; j < nx; ++j)
        for (int i = 0; i < rows; ++i) y[(r + j) * N + n0 + i] = out(float(sums[j][i]));
    }
  };
  if (m >= kBlockedRows64) {
    constexpr int64_t kBlockTiles = 16;
    const int64_t block_rows = std::clamp<int64_t>(int64_t(16384) / std::max<int64_t>(K, 1), 1, 16);
    const int64_t rblocks = (m + block_rows - 1) / block_rows, cblocks = (tiles + kBlockTiles - 1) / kBlockTiles;
    run(pool, rblocks * cblocks, 1, [&](int64_t u0, int64_t u1, int) {
      thread_local AlignedVector<double> xb;
      if (int64_t(xb.size()) < block_rows * K) xb.resize(size_t(block_rows * K));
      int64_t widened = -1;  // the row block now in xb
      for (int64_t u = u0; u < u1; ++u) {  // row-block major: a chunk's units mostly share their rows
        const int64_t rb = u / cblocks, cb = u % cblocks;
        const int64_t r0 = rb * block_rows, r1 = std::min(m, r0 + block_rows);
        if (rb != widened) {
          for (int64_t r = r0; r < r1; ++r) widen(x + r * K, K, xb.data() + (r - r0) * K);
          widened = rb;
        }
        for (int64_t t = cb * kBlockTiles; t < std::min(tiles, (cb + 1) * kBlockTiles); ++t) tile(xb.data(), r0, r1, t);
      }
    });
    return;
  }
  // Each thread widens x itself, once per call: the fp64 rows written by one core and read by the
  // other cost more than the weights of a small linear (the fp32 rows are half the bytes).
  static std::atomic<uint64_t> calls{0};
  const uint64_t call = calls.fetch_add(1, std::memory_order_relaxed) + 1;
  run(pool, tiles, 1, [&](int64_t t0, int64_t t1, int) {
    thread_local AlignedVector<double> xs;
    thread_local uint64_t widened_call = 0;
    if (widened_call != call) {
      if (int64_t(xs.size()) < m * K) xs.resize(size_t(m * K));
      for (int64_t r = 0; r < m; ++r) widen(x + r * K, K, xs.data() + r * K);
      widened_call = call;
    }
    for (int64_t t = t0; t < t1; ++t) tile(xs.data(), 0, m, t);
  });
}

}  // namespace

namespace {
void linear_fp8_impl(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool, bool bf16_act) {
  const uint8_t* packed = w.packed_layout == detail::kLayoutAvx512 ? w.packed : nullptr;
  static const Fp8Lut lut;
  const float* e8 = detail::e8m0_table();
  const int64_t K = w.in, nkb = K / 32;
  linear_q(
      x, m, K, w.out,
      [&](int64_t n0, int nvalid, int64_t kb0, int64_t kb1, uint32_t* dst) {
        if (packed) convert_packed_fp8(packed + (n0 / kPanel) * nkb * kFp8BlockBytes, kb0, kb1, lut, dst);
        else pack_fp8(w.w, K, n0, nvalid, kb0, kb1, lut, dst);
      },
      [&](int64_t n0, int, int64_t kb0, int64_t kb1, float* sw) {  // one scale per 32 x 32 block
        for (int64_t kb = kb0; kb < kb1; ++kb) {
          const __m512 v = _mm512_set1_ps(e8[w.scale[(n0 / 32) * nkb + kb]]);
          _mm512_storeu_ps(sw + (kb - kb0) * kPanel, v);
          _mm512_storeu_ps(sw + (kb - kb0) * kPanel + 16, v);
        }
      },
      [&](const uint16_t* xq, const float* sa) {
        if (!packed) return false;
        auto cvt = [&](const uint8_t* base, int64_t pair, __m512i& w0, __m512i& w1) {
          cvt_pair_fp8(base + pair * kFp8PairBytes, lut, w0, w1);
        };
        auto scale = [&](int64_t panel, int64_t kb, __m512& s0, __m512& s1) {
          s0 = s1 = _mm512_set1_ps(e8[w.scale[panel * nkb + kb]]);
        };
        linear_q1_packed(xq, sa, m, K, w.out, packed, nkb * kFp8BlockBytes, cvt, scale, y, pool);
        return true;
      },
      y, pool, bf16_act);
}
}  // namespace

void linear_fp8(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  linear_fp8_impl(x, m, w, y, pool, false);
}
void linear_fp8_bf16(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  linear_fp8_impl(x, m, w, y, pool, true);
}
int64_t fp8_panel_bytes(const ref::Fp8Weight& w) { return (w.in / 32) * kFp8BlockBytes; }
void linear_bf16_fast(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out, ThreadPool* pool) {
  thread_local AlignedVector<float> xb;
  const int64_t n = m * w.in, ny = m * w.out;
  if (int64_t(xb.size()) < n) xb.resize(size_t(n));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(xb.data() + i, round_bf16_ps(_mm512_loadu_ps(x + i)));
  for (; i < n; ++i) xb[size_t(i)] = round_bf16(x[i]);
  linear_bf16_logits(xb.data(), m, w, y, pool);  // pair lanes by vdpbf16ps (bf16-valued x: never its fp64 path)
  if (round_out) {
    for (i = 0; i + 16 <= ny; i += 16) _mm512_storeu_ps(y + i, round_bf16_ps(_mm512_loadu_ps(y + i)));
    for (; i < ny; ++i) y[i] = round_bf16(y[i]);
  }
}

void linear_fp4(const float* x, int64_t m, const ref::Fp4Weight& w, float* y, ThreadPool* pool) {
  const uint8_t* packed = w.packed_layout == detail::kLayoutAvx512 ? w.packed : nullptr;
  const int64_t K = w.in, nkb = K / 32;
  static const __m512i table = e2m1_table();  // the checkpoint layout's (built once, not per expert call)
  static const Fp4Lut lut;
  linear_q(
      x, m, K, w.out,
      [&](int64_t n0, int nvalid, int64_t kb0, int64_t kb1, uint32_t* dst) {
        if (packed) convert_packed_fp4(packed + (n0 / kPanel) * nkb * kFp4BlockBytes, kb0, kb1, lut, dst);
        else pack_fp4(w.w, K, n0, nvalid, kb0, kb1, table, dst);
      },
      [&](int64_t n0, int nvalid, int64_t kb0, int64_t kb1, float* sw) {  // one scale per row and block
        if (packed) {
          const uint8_t* ps = packed + n_panels(w.out) * nkb * kFp4BlockBytes + (n0 / kPanel) * nkb * kPanel;
          for (int64_t kb = kb0; kb < kb1; ++kb)
            for (int g = 0; g < 2; ++g) _mm512_storeu_ps(sw + (kb - kb0) * kPanel + g * 16, e8m0x16_ps(ps + kb * kPanel + g * 16));
          return;
        }
        const __m512i lane = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32(int(nkb)));
        for (int g = 0; g < 2; ++g) {
          const int rows = std::clamp(nvalid - g * 16, 0, 16);
          const __mmask16 valid = __mmask16(rows >= 16 ? 0xffff : (1u << rows) - 1);
          for (int64_t kb = kb0; kb < kb1; ++kb) {
            const uint8_t* base = w.scale + (n0 + g * 16) * nkb + kb;
            // 1-byte gathers as dword gathers at byte addresses: only the low byte is used.
            const __m512i codes = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, lane, base, 1);
            _mm512_storeu_ps(sw + (kb - kb0) * kPanel + g * 16, _mm512_maskz_mov_ps(valid, e8m0_ps(codes)));
          }
        }
      },
      [&](const uint16_t* xq, const float* sa) {
        if (!packed) return false;
        const uint8_t* ps = packed + n_panels(w.out) * nkb * kFp4BlockBytes;
        Fp4PairCvt cvt{lut};
        auto scale = [&](int64_t panel, int64_t kb, __m512& s0, __m512& s1) {
          const uint8_t* c = ps + (panel * nkb + kb) * kPanel;
          s0 = e8m0x16_ps(c);
          s1 = e8m0x16_ps(c + 16);
        };
        linear_q1_packed(xq, sa, m, K, w.out, packed, nkb * kFp4BlockBytes, cvt, scale, y, pool);
        return true;
      },
      y, pool, false, kFusedRowsFp4);
}

void linear_bf16(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out, ThreadPool* pool) {
  const int64_t K = w.in;
  linear_f64_rows(
      x, m, w.out, K, widen_x_bf16,
      [&](const double* xd, int nx, int64_t n0, int rows, double* sums) {
        const uint16_t* w0 = w.w + n0 * K;
        dot4_f64_nrows(
            nx, xd, K, rows,
            [&](int i, int64_t k, __m512d& lo, __m512d& hi) {
              // 16 bf16 = 8 dwords: the even elements are the low words, the odd the high words.
              _mm_prefetch(reinterpret_cast<const char*>(w0 + (i + kRows64) * K + k), _MM_HINT_T0);  // the next tile
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + i * K + k));
              lo = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
              hi = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u)))));
            },
            [&](int i, int64_t k) { return double(bits_f32(uint32_t(w0[i * K + k]) << 16)); }, sums);
      },
      [&](float v) { return round_out ? round_bf16(v) : v; }, y, pool);
}

// R weight rows of the head against M bf16 x rows (each weight vector loaded once for all M),
// fp32 accumulation per (row, weight row); out[r][i]. Block `block` of a tile's `blocks` x-row
// blocks prefetches every blocks-th chunk of the next tile (`next` elements on in each weight row):
// spread over the blocks, not all issued by the first, the prefetches leave the loads less bunched.
template <int R, int M>
inline void logits_tile(const uint16_t* xr, int64_t ldx, const uint16_t* const* wr, int64_t nc, __mmask32 tail,
                        int64_t next, int block, int blocks, __m512 (&out)[8][R]) {
  __m512 acc[M][R];
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[r][i] = _mm512_setzero_ps();
  auto chunk = [&](int64_t c, bool ragged) {
    const bool prefetch = c % blocks == block;
    __m512bh wv[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wr[i] + next + c * 32), _MM_HINT_T0);
      wv[i] = ragged ? (__m512bh)_mm512_maskz_loadu_epi16(tail, wr[i] + c * 32) : (__m512bh)_mm512_loadu_si512(wr[i] + c * 32);
    }
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + r * ldx + c * 32);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv[i], xv);
    }
  };
  const bool ragged = tail != ~__mmask32(0);
  for (int64_t c = 0; c < nc - ragged; ++c) chunk(c, false);
  if (ragged) chunk(nc - 1, true);
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) out[r][i] = acc[r][i];
}

template <int R>
inline void logits_rows(int M, const uint16_t* xr, int64_t ldx, const uint16_t* const* wr, int64_t nc, __mmask32 tail,
                        int64_t next, int block, int blocks, __m512 (&out)[8][R]) {
  switch (M) {
    case 1: return logits_tile<R, 1>(xr, ldx, wr, nc, tail, next, block, blocks, out);
    case 2: return logits_tile<R, 2>(xr, ldx, wr, nc, tail, next, block, blocks, out);
    case 3: return logits_tile<R, 3>(xr, ldx, wr, nc, tail, next, block, blocks, out);
    case 4: return logits_tile<R, 4>(xr, ldx, wr, nc, tail, next, block, blocks, out);
    case 5: return logits_tile<R, 5>(xr, ldx, wr, nc, tail, next, block, blocks, out);
    case 6: return logits_tile<R, 6>(xr, ldx, wr, nc, tail, next, block, blocks, out);
    case 7: return logits_tile<R, 7>(xr, ldx, wr, nc, tail, next, block, blocks, out);
    default: return logits_tile<R, 8>(xr, ldx, wr, nc, tail, next, block, blocks, out);
  }
}

// The head's passes over a chunk [t0, t1) of R-row tiles: a tile's R rows come from the R equal
// parts of the chunk (R memory streams per thread: a core keeps more reads in flight over several);
// the chunk's last R * part .. rows go in plain tiles. Blocks of up to MaxM x rows share each
// weight load; together they prefetch the next tile.
template <int R, int MaxM>
void logits_chunk(const uint16_t* xb, int64_t m, const ref::Bf16Weight& w, int64_t nc, __mmask32 tail, int64_t t0, int64_t t1,
                  float* y) {
  static_assert(R * MaxM + R + 1 <= 32, "accumulators, weights and x in registers");
  const int64_t K = w.in, N = w.out;
  const int64_t c0 = t0 * R, c1 = std::min(N, t1 * R), part = detail::interleaved_weight_streams ? (c1 - c0) / R : 0;
  for (int64_t t = 0; t < part + (c1 - c0 - R * part + R - 1) / R; ++t) {
    const bool streams = t < part;
    const int64_t n0 = streams ? c0 + t : c0 + R * part + (t - part) * R, step = streams ? part : 1;
    const int rows = streams ? R : int(std::min<int64_t>(R, c1 - n0));
    const uint16_t* wr[R];
    int64_t n[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) n[i] = n0 + std::min(i, rows - 1) * step, wr[i] = w.w + n[i] * K;  // short tile: repeat the last row
    const int blocks = int((m + MaxM - 1) / MaxM);
    for (int64_t r0 = 0; r0 < m; r0 += MaxM) {
      const int M = int(std::min<int64_t>(MaxM, m - r0));
      const int64_t ldx = nc * 32;
      __m512 acc[8][R];
      logits_rows<R>(M, xb + r0 * ldx, ldx, wr, nc, tail, streams ? K : R * K, int(r0 / MaxM), blocks, acc);
      for (int r = 0; r < M; ++r)
        for (int i = 0; i < rows; ++i) y[(r0 + r) * N + n[i]] = _mm512_reduce_add_ps(acc[r][i]);
    }
  }
}

// The logits head: bf16 weights times bf16-valued x with fp32 accumulation (the reference's head
// is an fp32 F.linear, whose order torch leaves undefined). Every product is exact in fp32, so
// vdpbf16ps applies: 32 weights per instruction instead of the fp64 path's 8, which leaves the
// head bound by memory. The order is fixed by K alone (16 lanes, chunks of 32 in K order, one
// reduction tree), so results do not depend on m, the tile or the thread split. Rows whose x is
// not bf16-exact (not the head's contract) take the exact fp64 path.
void linear_bf16_logits(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, ThreadPool* pool) {
  // 16 chunks per thread, not the pool's 4: a chunk of the head is long enough that the other
  // thread otherwise waits noticeably for the last one claimed.
  constexpr int head_chunks = 16;
  const int64_t K = w.in, N = w.out, nc = (K + 31) / 32;
  // x rows (multiples of 64 bytes) on cache lines: every x load of the tiles is one line, not two
  // (split loads across lines cost the multi-row tiles much of their speed).
  thread_local AlignedVector<uint16_t> xs;
  if (int64_t(xs.size()) < m * nc * 32) xs.resize(size_t(m * nc * 32));
  uint16_t* xb = xs.data();
  for (int64_t r = 0; r < m; ++r) {
    uint16_t* row = xb + r * nc * 32;
    const float* xr = x + r * K;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(xr + k));
      if (_mm512_test_epi32_mask(bits, _mm512_set1_epi32(0xffff))) return linear_bf16(x, m, w, y, false, pool);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
    }
    for (; k < K; ++k) {
      const uint32_t bits = f32_bits(xr[k]);
      if (bits & 0xffff) return linear_bf16(x, m, w, y, false, pool);
      row[k] = uint16_t(bits >> 16);
    }
    std::fill(row + K, row + nc * 32, uint16_t(0));
  }
  const __mmask32 tail = K % 32 ? __mmask32((1u << (K % 32)) - 1) : ~__mmask32(0);
  // Weight rows per tile (independent accumulators hide the dpbf16 latency) and x rows per pass.
  // Above 6 rows with K <= 1024, one pass of up to 8 rows (3 weight rows: 24 accumulators) reads
  // each weight chunk once instead of twice (6 + 2 rows) and keeps the x block (16 KB) in L1; with
  // longer rows that block no longer fits beside the weights, so 4 x 6 stays.
  const bool wide = m > 6 && K <= 1024;
  constexpr int R = 4, R_wide = 3;
  const int r_tile = wide ? R_wide : R;
  const int64_t ntiles = (N + r_tile - 1) / r_tile;
  if (m >= 64 && ntiles < 64) {
    // Few outputs, many rows (the MoE gate over a prompt): threads take blocks of rows, each
    // running every output tile on them (each output is one tile's sum either way).
    const int64_t rb = wide ? 8 : 6;
    run(pool, (m + rb - 1) / rb, 1, [&](int64_t b0, int64_t b1, int) {
      const int64_t r0 = b0 * rb, rows = std::min(m, b1 * rb) - r0;
      if (wide) logits_chunk<R_wide, 8>(xb + r0 * nc * 32, rows, w, nc, tail, 0, ntiles, y + r0 * N);
      else logits_chunk<R, 6>(xb + r0 * nc * 32, rows, w, nc, tail, 0, ntiles, y + r0 * N);
    });
    return;
  }
  run(pool, ntiles, 16, [&](int64_t t0, int64_t t1, int) {
    if (wide) logits_chunk<R_wide, 8>(xb, m, w, nc, tail, t0, t1, y);
    else logits_chunk<R, 6>(xb, m, w, nc, tail, t0, t1, y);
  }, head_chunks);
}

void linear_f32(const float* x, int64_t m, const ref::F32Weight& w, float* y, ThreadPool* pool) {
  const int64_t K = w.in;
  linear_f64_rows(
      x, m, w.out, K, widen_x,
      [&](const double* xd, int nx, int64_t n0, int rows, double* sums) {
        const float* w0 = w.w + n0 * K;
        dot4_f64_nrows(
            nx, xd, K, rows,
            [&](int i, int64_t k, __m512d& lo, __m512d& hi) {
              lo = _mm512_cvtps_pd(_mm256_loadu_ps(w0 + i * K + k));
              hi = _mm512_cvtps_pd(_mm256_loadu_ps(w0 + i * K + k + 8));
            },
            [&](int i, int64_t k) { return double(w0[i * K + k]); }, sums);
      },
      [](float v) { return v; }, y, pool);
}

// One FP8 weight row dequantized to fp64: e4m3 x block scale, the reference's fp32 weight (exact).
inline void dequant_row_f64(const uint8_t* wr, int64_t K, const uint8_t* srow, const float* e8, double* out) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(e4m3x16_half(wr + k)), _mm512_set1_ps(256.f)),
                                   _mm512_set1_ps(e8[srow[k / 32]]));
    _mm512_storeu_pd(out + k, _mm512_cvtps_pd(_mm512_castps512_ps256(f)));
    _mm512_storeu_pd(out + k + 8, _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1)));
  }
  for (; k < K; ++k) out[k] = double(e4m3_to_f32(wr[k]) * e8[srow[k / 32]]);
}

// x x 256 x block scale in fp64 (a power of two times x: exact). With weights taken as e4m3 x 2^-8
// (dot_e4m3_f64) the products are exactly x x (e4m3 x scale), with no scale in the inner loop.
inline void scale_x_f64(const float* x, int64_t K, const uint8_t* srow, const float* e8, double* out) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    _mm512_storeu_pd(out + k, _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + k)), _mm512_set1_pd(256.0 * e8[srow[k / 32]])));
  for (; k < K; ++k) out[k] = double(x[k]) * (256.0 * e8[srow[k / 32]]);
}

// sums[i] = xg . (e4m3 x 2^-8 of weight row i at w0 + i K), `rows` <= kRows64 rows, dot4_f64's order.
inline void dot_e4m3_f64(const double* xg, const uint8_t* w0, int64_t K, int rows, double* sums) {
  dot4_f64(
      xg, K, rows,
      [&](int i, int64_t k, __m512d& lo, __m512d& hi) {
        _mm_prefetch(reinterpret_cast<const char*>(w0 + (i + kRows64) * K + k), _MM_HINT_T0);  // the next tile
        const __m512 f = _mm512_cvtph_ps(e4m3x16_half(w0 + i * K + k));
        lo = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
        hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1));
      },
      [&](int i, int64_t k) { return double(e4m3_to_f32(w0[i * K + k])) * (1.0 / 256); }, sums);
}

// dot_e4m3_f64 of n <= kRows64 weight rows anywhere (rows[i]): each row's sum exactly as there.
inline void dot_e4m3_rows_f64(const double* xg, const uint8_t* const* rows, int n, int64_t K, double* sums) {
  dot4_f64(
      xg, K, n,
      [&](int i, int64_t k, __m512d& lo, __m512d& hi) {
        const __m512 f = _mm512_cvtph_ps(e4m3x16_half(rows[i] + k));
        lo = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
        hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1));
      },
      [&](int i, int64_t k) { return double(e4m3_to_f32(rows[i][k])) * (1.0 / 256); }, sums);
}

// One recomputation queued by the certified panels: out = x . (e4m3 row w x its block scales).
struct E4m3Dot {
  const double* x;       // the widened activation row
  const uint8_t* w;      // the checkpoint weight row
  const uint8_t* srow;   // its E8M0 block scales
  float* out;
};
// dot_e4m3_rows_f64 with the block scale on the weights instead of x, for n <= kRows64 dots with
// their own x rows and scales: sums[i] = x_i . (e4m3 x s_b), x_i the plain widened row. Both give
// the products x x e4m3 x s_b exactly (28 significant bits) in dot4_f64's lanes, order and
// reduction, so the same bits; one widened row serves every panel, and four outputs from
// different rows or panels run as independent chains and memory streams (the checkpoint rows
// they read are cold). Needs 256 s_b exact in fp32 (scales in [2^-40, 2^40]).
inline void dot_e4m3_pairs_f64(const E4m3Dot* d, int n, int64_t K, const float* e8, double* sums) {
  __m512d a[kRows64][2];
#pragma GCC unroll 4
  for (int i = 0; i < kRows64; ++i) a[i][0] = a[i][1] = _mm512_setzero_pd();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
#pragma GCC unroll 4
    for (int i = 0; i < kRows64; ++i) {
      if (i >= n) break;
      const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(e4m3x16_half(d[i].w + k)), _mm512_set1_ps(256.f * e8[d[i].srow[k / 32]]));
      a[i][0] = _mm512_fmadd_pd(_mm512_loadu_pd(d[i].x + k), _mm512_cvtps_pd(_mm512_castps512_ps256(f)), a[i][0]);
      a[i][1] = _mm512_fmadd_pd(_mm512_loadu_pd(d[i].x + k + 8), _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1)), a[i][1]);
    }
  }
  for (int i = 0; i < n; ++i) {
    double tail = 0;
    for (int64_t t = k; t < K; ++t) tail += d[i].x[t] * (double(e4m3_to_f32(d[i].w[t])) * double(e8[d[i].srow[t / 32]]));
    sums[i] = _mm512_reduce_add_pd(_mm512_add_pd(a[i][0], a[i][1])) + tail;
  }
}

// Several rows (prefill, batched decode): each 32-row weight group is dequantized once to fp64
// (e4m3 x scale, the reference's exact fp32 weight) and reused by all rows, two rows and four
// weight rows per pass. Per output the lanes, chunks and tail are summed exactly as in dot4_f64.
void linear_fp8_dequant_rows(const double* xd, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  const float* e8 = detail::e8m0_table();
  const int64_t K = w.in, N = w.out, nkb = (K + 31) / 32, K16 = K / 16 * 16;
  run(pool, (N + 31) / 32, 1, [&](int64_t g0, int64_t g1, int) {
    thread_local AlignedVector<double> wbuf;
    thread_local AlignedVector<double> accs;  // 8 doubles per accumulator (unaligned access)
    if (int64_t(wbuf.size()) < 32 * K) wbuf.resize(size_t(32 * K));
    double* wd = wbuf.data();
    for (int64_t grp = g0; grp < g1; ++grp) {
      const int64_t n_begin = grp * 32, n_rows = std::min<int64_t>(32, N - n_begin);
      const uint8_t* srow = w.scale + grp * nkb;
      for (int64_t i = 0; i < n_rows; ++i) dequant_row_f64(w.w + (n_begin + i) * K, K, srow, e8, wd + i * K);
      // K in chunks whose group slice (32 rows x kChunk doubles) stays in L1 while every row pair
      // passes over it; the accumulators wait in memory between chunks (same FMA sequence).
      constexpr int64_t kChunk = 128;
      const int64_t tiles = (n_rows + kRows64 - 1) / kRows64, pairs = (m + 1) / 2;
      constexpr int kAcc = 2 * kRows64 * 2;
      if (int64_t(accs.size()) < pairs * tiles * kAcc * 8) accs.resize(size_t(pairs * tiles * kAcc * 8));
      std::fill(accs.begin(), accs.begin() + pairs * tiles * kAcc * 8, 0.0);
      auto tile_rows = [&](int64_t t, const double** wt) {
        const int rows = int(std::min<int64_t>(kRows64, n_rows - t * kRows64));
        for (int i = 0; i < kRows64; ++i) wt[i] = wd + (t * kRows64 + std::min(i, rows - 1)) * K;
        return rows;
      };
      for (int64_t k0 = 0; k0 < K16; k0 += kChunk) {
        const int64_t k1 = std::min(K16, k0 + kChunk);
        for (int64_t p = 0; p < pairs; ++p) {
          const double* xr[2] = {xd + 2 * p * K, xd + std::min(2 * p + 1, m - 1) * K};
          for (int64_t t = 0; t < tiles; ++t) {
            const double* wt[kRows64];
            tile_rows(t, wt);
            double* acc = accs.data() + (p * tiles + t) * kAcc * 8;
            __m512d a[2][kRows64][2];
#pragma GCC unroll 16
            for (int q = 0; q < kAcc; ++q) (&a[0][0][0])[q] = _mm512_loadu_pd(acc + 8 * q);
            for (int64_t k = k0; k < k1; k += 16)
#pragma GCC unroll 2
              for (int j = 0; j < 2; ++j) {
                const __m512d x0 = _mm512_loadu_pd(xr[j] + k), x1 = _mm512_loadu_pd(xr[j] + k + 8);
#pragma GCC unroll 4
                for (int i = 0; i < kRows64; ++i) {
                  a[j][i][0] = _mm512_fmadd_pd(x0, _mm512_loadu_pd(wt[i] + k), a[j][i][0]);
                  a[j][i][1] = _mm512_fmadd_pd(x1, _mm512_loadu_pd(wt[i] + k + 8), a[j][i][1]);
                }
              }
#pragma GCC unroll 16
            for (int q = 0; q < kAcc; ++q) _mm512_storeu_pd(acc + 8 * q, (&a[0][0][0])[q]);
          }
        }
      }
      for (int64_t p = 0; p < pairs; ++p)
        for (int64_t t = 0; t < tiles; ++t) {
          const double* wt[kRows64];
          const int rows = tile_rows(t, wt);
          const double* acc = accs.data() + (p * tiles + t) * kAcc * 8;
          for (int j = 0; j < int(std::min<int64_t>(2, m - 2 * p)); ++j)
            for (int i = 0; i < rows; ++i) {
              const double* xr = xd + (2 * p + j) * K;
              double tail = 0;
              for (int64_t k = K16; k < K; ++k) tail += xr[k] * wt[i][k];
              const double* ai = acc + (j * kRows64 + i) * 16;
              const __m512d sum = _mm512_add_pd(_mm512_loadu_pd(ai), _mm512_loadu_pd(ai + 8));
              y[(2 * p + j) * N + n_begin + t * kRows64 + i] = round_bf16(float(_mm512_reduce_add_pd(sum) + tail));
            }
        }
    }
  });
}

// The 16 fp32 lanes of v as 8 fp64 pair sums (exact: each fp32 pair sum fits in fp64 unless the
// exponents differ by more than 29; either way far below the bound's 2^-45 slack).
inline __m512d widen_sum(__m512 v) {
  return _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)), _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
}

// The certificate of both certified wo_a kernels: sum is an fp32 dot product of exact products,
// tracked the sum of the magnitudes of its rounded partial results, abs_sum = sum |x x scale| (so
// sum |products| <= 448 abs_sum), mag the magnitude the fp64 arithmetic on sum works at. 1.01
// covers the fp32 sums of |A_i| and |x x scale|; 2^-45 mag the fp64 reductions and sum +- bound.
// True, with the bf16 in *out, when every value within the bound rounds to that one bf16.
inline bool certify_bf16(double sum, double tracked, double abs_sum, double mag, float* out) {
  const double bound = 0x1p-24 * 1.01 * (2 * tracked + 448 * abs_sum) + 0x1p-45 * mag;
  const float lo = round_bf16(float(sum - bound)), hi = round_bf16(float(sum + bound));
  if (!std::isfinite(sum) || !std::isfinite(bound) || f32_bits(lo) != f32_bits(hi)) return false;
  *out = lo;
  return true;
}

// certify_bf16 for 16 outputs of one row at once (outputs in lanes): the same bound in fp64 lanes,
// with the products' term prod(h) for lanes 8h .. 8h + 7. Stores the settled lanes' bf16 to out
// and returns their mask.
template <class Prod>
inline __mmask16 certify_lanes(__m512 sum32, __m512 tracked32, Prod&& prod, __mmask16 valid, float* out) {
  __m256 lo8[2], hi8[2];
  for (int h = 0; h < 2; ++h) {
    const __m512d sum = _mm512_cvtps_pd(h ? _mm512_extractf32x8_ps(sum32, 1) : _mm512_castps512_ps256(sum32));
    const __m512d tracked = _mm512_cvtps_pd(h ? _mm512_extractf32x8_ps(tracked32, 1) : _mm512_castps512_ps256(tracked32));
    const __m512d inner = _mm512_add_pd(_mm512_mul_pd(_mm512_set1_pd(2.0), tracked), prod(h));
    const __m512d bound = _mm512_add_pd(_mm512_mul_pd(_mm512_set1_pd(0x1p-24 * 1.01), inner),
                                        _mm512_mul_pd(_mm512_set1_pd(0x1p-45), _mm512_abs_pd(sum)));
    lo8[h] = _mm512_cvtpd_ps(_mm512_sub_pd(sum, bound));
    hi8[h] = _mm512_cvtpd_ps(_mm512_add_pd(sum, bound));
  }
  const __m512 lo = round_bf16_ps(_mm512_insertf32x8(_mm512_castps256_ps512(lo8[0]), lo8[1], 1));
  const __m512 hi = round_bf16_ps(_mm512_insertf32x8(_mm512_castps256_ps512(hi8[0]), hi8[1], 1));
  // A finite sum (|x| < inf, not NaN) and a bound that is not NaN (a NaN lo fails the ordered test).
  const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(sum32), _mm512_set1_ps(INFINITY), _CMP_LT_OQ) &
                           _mm512_cmp_ps_mask(lo, lo, _CMP_ORD_Q) & _mm512_cmp_ps_mask(hi, hi, _CMP_ORD_Q);
  const __mmask16 ok = valid & finite & _mm512_cmpeq_epi32_mask(_mm512_castps_si512(lo), _mm512_castps_si512(hi));
  _mm512_mask_storeu_ps(out, ok, lo);
  return ok;
}

// The GEMM layout's certificate: sum |products| <= 448 sum |x x scale| of the row and group.
inline __mmask16 certify_bf16_x16(__m512 sum32, __m512 tracked32, double abs_sum, __mmask16 valid, float* out) {
  return certify_lanes(sum32, tracked32, [&](int) { return _mm512_set1_pd(448 * abs_sum); }, valid, out);
}

// With a bound on sum |products| per lane (prod32, rounded in fp32: the 1.01 covers it).
inline __mmask16 certify_bf16_x16_lanes(__m512 sum32, __m512 tracked32, __m512 prod32, __mmask16 valid, float* out) {
  return certify_lanes(
      sum32, tracked32,
      [&](int h) { return _mm512_cvtps_pd(h ? _mm512_extractf32x8_ps(prod32, 1) : _mm512_castps512_ps256(prod32)); }, valid,
      out);
}

// NR weight rows against M rows of x x scale: the fp32 dot products and, beside each accumulator,
// the running sum of its magnitudes after every step. Compile-time M and NR, fully unrolled, keep
// all of it in registers (arrays indexed at run time were spilled to the stack); several weight
// rows give independent chains and memory streams.
template <int M, int NR>
inline void certified_dots(const uint8_t* wr, int64_t K, const uint16_t* xbf, const Fp8Lut& lut, __m512 (&acc_out)[4][3][2],
                           __m512 (&track_out)[4][3][2]) {
  __m512 acc[NR][M][2], track[NR][M][2];
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 3
    for (int r = 0; r < M; ++r) acc[i][r][0] = acc[i][r][1] = track[i][r][0] = track[i][r][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K / 64; ++c) {
    __m512i w[NR][2];
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      // The same bytes of the next pass's rows: a whole pass ahead (a fixed distance lands in
      // rows this pass is already reading when K is large).
      _mm_prefetch(reinterpret_cast<const char*>(wr + (NR + i) * K + c * 64), _MM_HINT_T0);
      cvt_pair_fp8(wr + i * K + c * 64, lut, w[i][0], w[i][1]);
    }
#pragma GCC unroll 3
    for (int r = 0; r < M; ++r) {
      const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xbf + r * K + c * 64);
      const __m512bh x1 = (__m512bh)_mm512_loadu_si512(xbf + r * K + c * 64 + 32);
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i) {
        acc[i][r][0] = _mm512_dpbf16_ps(acc[i][r][0], (__m512bh)w[i][0], x0);
        acc[i][r][1] = _mm512_dpbf16_ps(acc[i][r][1], (__m512bh)w[i][1], x1);
        track[i][r][0] = _mm512_add_ps(track[i][r][0], _mm512_abs_ps(acc[i][r][0]));
        track[i][r][1] = _mm512_add_ps(track[i][r][1], _mm512_abs_ps(acc[i][r][1]));
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 3
    for (int r = 0; r < M; ++r)
      for (int h = 0; h < 2; ++h) acc_out[i][r][h] = acc[i][r][h], track_out[i][r][h] = track[i][r][h];
}

// R rows of x (bf16 pairs) against one panel of 32 weight rows ([pair][32] bf16 pairs, the group's
// scale folded in): the fp32 sums, one output per lane. Each 32-element K block is summed in a
// fresh accumulator and then added to the lane's total, so the partial sums the bound charges
// stay small (one chain over all of K handed ~7 % of outputs to fp64, blocks ~2.7 %). Beside each
// lane: the sum of the magnitudes of every rounded result, block sums after each step and totals
// after each block (the bound's sum_i |A_i|).
template <int R>
inline void certified_tile(const uint16_t* xb, int64_t ldx, const uint32_t* panel, int64_t nkb, float* acc_out,
                           float* track_out) {
  // The totals live in acc_out (updated once per block: the same additions), which leaves the
  // registers to 2R block sums and 2R magnitude sums: 6 rows keep 12 vdpbf16ps chains in flight.
  __m512 track[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) track[r][0] = track[r][1] = _mm512_setzero_ps();
  std::fill(acc_out, acc_out + R * kPanel, 0.f);
  for (int64_t b = 0; b < nkb; ++b) {
    __m512 acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = b * 16; j < b * 16 + 16; ++j) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + j * kPanel), w1 = (__m512bh)_mm512_loadu_si512(panel + j * kPanel + 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = bcast_pair(xb + r * ldx + 2 * j);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
        track[r][0] = _mm512_add_ps(track[r][0], _mm512_abs_ps(acc[r][0]));
        track[r][1] = _mm512_add_ps(track[r][1], _mm512_abs_ps(acc[r][1]));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        float* t = acc_out + r * kPanel + h * 16;
        const __m512 total = _mm512_add_ps(_mm512_load_ps(t), acc[r][h]);
        _mm512_store_ps(t, total);
        track[r][h] = _mm512_add_ps(track[r][h], _mm512_abs_ps(total));
      }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(track_out + r * kPanel + h * 16, track[r][h]);
}

// sums[q] = sum_k x_q[k] w_q[k] for n <= 4 pairs of bf16 rows (x as bf16 bits, w as bf16 pairs in
// K order) whose products are exact in fp32: each product widened to fp64 and added in
// dot_pairs_f64's lanes (k % 16 < 8 and >= 8) and reduction, so the bits are dot_pairs_f64's on
// the same values (an exact product added is what its FMA adds). K % 16 == 0.
// 16 bf16 values (bits) -> fp32.
inline __m512 bf16x16_ps(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16));
}

inline void handover_dots_bf16(const uint16_t* const* xs, const uint32_t* const* ws, int n, int64_t K, double* sums) {
  __m512d a[4][2];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) a[i][0] = a[i][1] = _mm512_setzero_pd();
  for (int64_t k = 0; k < K; k += 16) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      if (i >= n) break;
      const __m512 p = _mm512_mul_ps(bf16x16_ps(xs[i] + k), bf16x16_ps(ws[i] + k / 2));
      a[i][0] = _mm512_add_pd(a[i][0], _mm512_cvtps_pd(_mm512_castps512_ps256(p)));
      a[i][1] = _mm512_add_pd(a[i][1], _mm512_cvtps_pd(_mm512_extractf32x8_ps(p, 1)));
    }
  }
  const double tail = 0;  // dot_pairs_f64 adds its (here empty) tail: keeps -0 handling identical
  for (int i = 0; i < n; ++i) sums[i] = _mm512_reduce_add_pd(_mm512_add_pd(a[i][0], a[i][1])) + tail;
}

// sum_kb a[kb] x s[kb] in fp64 over 8 lanes (positive terms: used as a bound).
inline double scaled_abs_sum(const float* a, const double* s, int64_t n) {
  __m512d v = _mm512_setzero_pd();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) v = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(a + k)), _mm512_loadu_pd(s + k), v);
  double t = _mm512_reduce_add_pd(v);
  for (; k < n; ++k) t += double(a[k]) * s[k];
  return t;
}

// One row of bf16-valued x for the certified wo_a kernels: x as bf16 bits, the magnitude sum of
// each 32-block, the smallest nonzero magnitude (inf if none) and the largest (inf when NaN or inf
// occur anywhere in the row).
inline void certified_row_prologue(const float* xr, int64_t K, uint16_t* xb, float* abs_blocks, float& lo, float& hi) {
  const int64_t nkb = K / 32;
  __m512 vlo = _mm512_set1_ps(INFINITY), vhi = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const float* v = xr + kb * 32;
    const __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(v)), a1 = _mm512_abs_ps(_mm512_loadu_ps(v + 16));
    abs_blocks[kb] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    vhi = _mm512_max_ps(vhi, _mm512_max_ps(a0, a1));
    vlo = _mm512_mask_min_ps(vlo, _mm512_cmpneq_ps_mask(a0, _mm512_setzero_ps()), vlo, a0);
    vlo = _mm512_mask_min_ps(vlo, _mm512_cmpneq_ps_mask(a1, _mm512_setzero_ps()), vlo, a1);
    // bf16-valued: the high halves are the values
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + kb * 32),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(v)), 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + kb * 32 + 16),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(v + 16)), 16)));
  }
  float total = 0.f;  // NaN or inf anywhere in the row makes it non-finite
  for (int64_t kb = 0; kb < nkb; ++kb) total += abs_blocks[kb];
  lo = _mm512_reduce_min_ps(vlo);
  hi = std::isfinite(total) ? _mm512_reduce_max_ps(vhi) : INFINITY;
}

// wo_a for many rows (prefill, batched decode), same certificate as fp8_dequant_certified below but
// laid out as a GEMM: per 32-row group the E4M3 codes become bf16 pairs with the group's block
// scale folded in (e4m3 x 2^e is exact in bf16), so each lane accumulates one output over all of K
// and every weight conversion serves all m rows. x x (w x s) equals (x x s) x w exactly in fp32
// (both are products of bf16 values without under- or overflow, checked per row and group), so
// the per-lane error bound is the same: 2^-24 (2 sum_i |A_i| + sum |products|).
void fp8_dequant_certified_gemm(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  static const Fp8Lut lut;
  const float* e8 = detail::e8m0_table();
  const int64_t K = w.in, N = w.out, nkb = K / 32, pairs = K / 2;
  // x as bf16, and per row: the magnitude sum of each 32-block, the smallest nonzero and the
  // largest magnitude (non-finite rows take the fp64 path). Rows are independent, so the pass
  // (m x K, four times per layer in prefill) is split over the pool.
  thread_local AlignedVector<uint16_t> xbf;
  thread_local AlignedVector<float> xabs, xlo, xhi;
  if (int64_t(xbf.size()) < m * K) xbf.resize(size_t(m * K));
  if (int64_t(xabs.size()) < m * nkb) xabs.resize(size_t(m * nkb));
  if (int64_t(xlo.size()) < m) xlo.resize(size_t(m)), xhi.resize(size_t(m));
  // The caller's thread-local arrays, by pointer: inside the workers the names are their own.
  uint16_t* const xbf_all = xbf.data();
  float *const abs_blocks = xabs.data(), *const row_lo = xlo.data(), *const row_hi = xhi.data();
  run(pool, m, 1, [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r)
      certified_row_prologue(x + r * K, K, xbf_all + r * K, abs_blocks + r * nkb, row_lo[r], row_hi[r]);
  });
  run(pool, (N + 31) / 32, 1, [&](int64_t g0, int64_t g1, int) {
    int64_t settled = 0, handed = 0;
    thread_local AlignedVector<uint32_t> panel, columns;  // [pairs][32] and the same as [32][pairs]
    thread_local AlignedVector<double> xrow, wrow;        // one row of each in fp64 (out-of-range hand-overs)
    // (row, column in group, products exact in fp32) to recompute
    thread_local std::vector<std::tuple<int64_t, int, bool>> handed_list;
    thread_local AlignedVector<double> gscale;  // the group's block scales
    if (int64_t(gscale.size()) < nkb) gscale.resize(size_t(nkb));
    if (int64_t(panel.size()) < pairs * kPanel) panel.resize(size_t(pairs * kPanel)), columns.resize(size_t(pairs * kPanel));
    if (int64_t(xrow.size()) < K) xrow.resize(size_t(K)), wrow.resize(size_t(K));
    alignas(64) float acc[kCertTile * kPanel], track[kCertTile * kPanel];
    for (int64_t grp = g0; grp < g1; ++grp) {
      const uint8_t* srow = w.scale + grp * nkb;
      const int64_t n0 = grp * 32, nvalid = std::min<int64_t>(32, N - n0);
      float smin = INFINITY, smax = 0.f;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        gscale[size_t(kb)] = e8[srow[kb]];
        smin = std::min(smin, e8[srow[kb]]), smax = std::max(smax, e8[srow[kb]]);
      }
      const bool scales_ok = smin >= 0x1p-40f && smax <= 0x1p40f;
      if (scales_ok) {
        pack_fp8(w.w, K, n0, int(nvalid), 0, nkb, lut, panel.data());
        for (int64_t kb = 0; kb < nkb; ++kb) {  // fold the block scale into both bf16 halves of each pair
          const __m512 sc = _mm512_set1_ps(e8[srow[kb]]);
          for (int64_t q = 0; q < 16 * kPanel; q += 16) {
            uint32_t* d = panel.data() + kb * 16 * kPanel + q;
            const __m512i v = _mm512_loadu_si512(d);
            const __m512 lo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), sc);
            const __m512 hi = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u)))), sc);
            _mm512_storeu_si512(d, _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                                                   _mm512_and_si512(_mm512_castps_si512(hi), _mm512_set1_epi32(int(0xffff0000u)))));
          }
        }
      }
      for (int64_t r0 = 0; r0 < m; r0 += kCertTile) {
        const int R = int(std::min<int64_t>(kCertTile, m - r0));
        if (scales_ok) {
          const uint16_t* xb = xbf_all + r0 * K;
          switch (R) {
            case 6: certified_tile<6>(xb, K, panel.data(), nkb, acc, track); break;
            case 5: certified_tile<5>(xb, K, panel.data(), nkb, acc, track); break;
            case 4: certified_tile<4>(xb, K, panel.data(), nkb, acc, track); break;
            case 3: certified_tile<3>(xb, K, panel.data(), nkb, acc, track); break;
            case 2: certified_tile<2>(xb, K, panel.data(), nkb, acc, track); break;
            default: certified_tile<1>(xb, K, panel.data(), nkb, acc, track); break;
          }
        }
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + r;
          // Every product of this row and group is exact in fp32 (see above): |x| x |w x s| stays
          // within [2^-100 x 2^-9, 2^100 x 448] when the row's and the group's ranges allow it.
          const bool fast = scales_ok && row_hi[row] * smax <= 0x1p100f &&
                            (row_lo[row] == INFINITY || row_lo[row] * smin >= 0x1p-100f);
          // sum |x x scale| of this row and group: a bound (its rounding is within the
          // certificate's 1.01), so 8 lanes in any order (a scalar chain would be latency-bound).
          const double abs_sum = fast ? scaled_abs_sum(abs_blocks + row * nkb, gscale.data(), nkb) : 0.0;
          for (int h = 0; h < 2; ++h) {
            const int cols = int(std::clamp<int64_t>(nvalid - h * 16, 0, 16));
            const __mmask16 valid = __mmask16(cols >= 16 ? 0xffff : (1u << cols) - 1);
            const __mmask16 ok = fast ? certify_bf16_x16(_mm512_load_ps(acc + r * kPanel + h * 16), _mm512_load_ps(track + r * kPanel + h * 16),
                                                         abs_sum, valid, y + row * N + n0 + h * 16)
                                      : __mmask16(0);
            settled += __builtin_popcount(ok);
            for (unsigned rest = valid & ~unsigned(ok); rest; rest &= rest - 1) handed_list.push_back({row, h * 16 + __builtin_ctz(rest), fast});
          }
        }
      }
      // The group's hand-overs. Where the products are exact in fp32 (the row and group in range),
      // from the bf16 x row and the group's bf16 weight column (scale folded), each product widened
      // and added in dot_pairs_f64's lanes and order: the same bits as its fp64 FMAs, from a
      // quarter of the bytes (its fp64 rows are 4x larger and missed the cache). Four at a time.
      handed += int64_t(handed_list.size());
      if (!handed_list.empty() && scales_ok)
        for (int h = 0; h < 2; ++h)  // panel [pair][column] -> columns [column][pair]
          for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
            __m512i t[16];
#pragma GCC unroll 16
            for (int q = 0; q < 16; ++q) t[q] = _mm512_loadu_si512(panel.data() + (j0 + q) * kPanel + h * 16);
            transpose16(t);
#pragma GCC unroll 16
            for (int c = 0; c < 16; ++c) _mm512_storeu_si512(columns.data() + (h * 16 + c) * pairs + j0, t[c]);
          }
      const uint16_t* xs[4];
      const uint32_t* ws[4];
      float* outs[4];
      int n = 0;
      auto flush = [&] {
        double sums[4];
        handover_dots_bf16(xs, ws, n, K, sums);
        for (int q = 0; q < n; ++q) *outs[q] = round_bf16(float(sums[q]));
        n = 0;
      };
      for (const auto& [row, col, exact_fp32] : handed_list) {
        float* out = y + row * N + n0 + col;
        if (!exact_fp32) {  // rare: a row or group out of range, in fp64 from the originals
          widen_x(x + row * K, K, xrow.data());
          dequant_row_f64(w.w + (n0 + col) * K, K, srow, e8, wrow.data());
          const double* xp = xrow.data();
          const double* wp = wrow.data();
          double sum;
          dot_pairs_f64(&xp, &wp, 1, K, &sum);
          *out = round_bf16(float(sum));
          continue;
        }
        xs[n] = xbf_all + row * K;
        ws[n] = columns.data() + int64_t(col) * pairs;
        outs[n] = out;
        if (++n == 4) flush();
      }
      if (n > 0) flush();
      handed_list.clear();
    }
    detail::certified_outputs.fetch_add(settled, std::memory_order_relaxed);
    detail::certified_fallbacks.fetch_add(handed, std::memory_order_relaxed);
  });
}

// M rows of x (bf16 bits, natural K order) against P repacked FP8 panels (first, first + stride,
// ...: separate memory streams) of a certified wo_a: per 32-K block the unscaled E4M3 codes'
// products summed by vdpbf16ps in fresh accumulators beside the sum of their magnitudes after
// every step, then scaled by the block's scale (a power of two: exact) into totals in memory,
// tot += acc x s and trk += mag x s + |tot|. trk bounds sum_i |A_i| over every rounded partial
// result in the scale of the output, which is what the certificate needs (see below).
template <int M, int P>
inline void certified_panel_tile(const uint16_t* xb, int64_t K, const uint8_t* packed, int64_t panel_bytes, int64_t first,
                                 int64_t stride, const uint8_t* scale, const float* e8, const Fp8Lut& lut, float* tot,
                                 float* trk) {
  const int64_t nkb = K / 32;
  const uint8_t* base[P];
#pragma GCC unroll 4
  for (int q = 0; q < P; ++q) base[q] = packed + (first + q * stride) * panel_bytes;
  std::fill(tot, tot + M * P * kPanel, 0.f);
  std::fill(trk, trk + M * P * kPanel, 0.f);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    __m512 acc[M][P][2], mag[M][P][2];
    zero_tile(acc);
    zero_tile(mag);
    for (int j = 0; j < 16; ++j) {
      __m512bh xv[M];
#pragma GCC unroll 4
      for (int r = 0; r < M; ++r) xv[r] = bcast_pair(xb + r * K + kb * 32 + 2 * j);
#pragma GCC unroll 4
      for (int q = 0; q < P; ++q) {
        __m512i w0, w1;
        const uint8_t* chunk = base[q] + (kb * 16 + j) * kFp8PairBytes;
        _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetchBytes), _MM_HINT_T0);
        cvt_pair_fp8(chunk, lut, w0, w1);
#pragma GCC unroll 4
        for (int r = 0; r < M; ++r) {
          acc[r][q][0] = _mm512_dpbf16_ps(acc[r][q][0], (__m512bh)w0, xv[r]);
          acc[r][q][1] = _mm512_dpbf16_ps(acc[r][q][1], (__m512bh)w1, xv[r]);
          mag[r][q][0] = _mm512_add_ps(mag[r][q][0], _mm512_abs_ps(acc[r][q][0]));
          mag[r][q][1] = _mm512_add_ps(mag[r][q][1], _mm512_abs_ps(acc[r][q][1]));
        }
      }
    }
#pragma GCC unroll 4
    for (int q = 0; q < P; ++q) {
      const __m512 sc = _mm512_set1_ps(e8[scale[(first + q * stride) * nkb + kb]]);
#pragma GCC unroll 4
      for (int r = 0; r < M; ++r)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          float* t = tot + (r * P + q) * kPanel + h * 16;
          float* k = trk + (r * P + q) * kPanel + h * 16;
          const __m512 nt = _mm512_fmadd_ps(acc[r][q][h], sc, _mm512_loadu_ps(t));  // exact product, one rounding
          _mm512_storeu_ps(t, nt);
          _mm512_storeu_ps(k, _mm512_add_ps(_mm512_fmadd_ps(mag[r][q][h], sc, _mm512_loadu_ps(k)), _mm512_abs_ps(nt)));
        }
    }
  }
}

// wo_a below kCertifiedGemmRowsPacked rows on its load-time repacked layout (the FP8 linears' panel
// layout): each weight pair is converted in registers once per block of up to 4 rows, P panels
// from separate parts of the thread's chunk at a time, outputs in lanes (no horizontal sums), the
// certificate in 16 lanes. The bound is the GEMM layout's: |fp32 - exact| <= 2^-24 (2 trk + sum
// |products|), sum |products| <= 448 sum_b |x block b|_1 x s_b. Products are exact in fp32 and the
// block scalings exact when the row's nonzero |x| lie in [2^-60, 2^60] and the panel's scales in
// [2^-40, 2^40]; other rows and panels, and outputs the bound does not settle, are recomputed with
// the exact kernel's products and order on the checkpoint rows (the same bits): from one widened
// row per call with the scale folded into the weights, or x x scale per panel beyond that range.
void fp8_dequant_certified_panels(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  static const Fp8Lut lut;
  const float* e8 = detail::e8m0_table();
  const int64_t K = w.in, N = w.out, nkb = K / 32, npanels = n_panels(N), panel_bytes = dequant_panel_bytes(w);
  thread_local AlignedVector<uint16_t> xbf_tl;
  thread_local AlignedVector<float> xabs_tl;
  thread_local std::vector<uint8_t> row_ok_tl;
  if (int64_t(xbf_tl.size()) < m * K) xbf_tl.resize(size_t(m * K));
  if (int64_t(xabs_tl.size()) < m * nkb) xabs_tl.resize(size_t(m * nkb));
  if (int64_t(row_ok_tl.size()) < m) row_ok_tl.resize(size_t(m));
  uint16_t* const xbf = xbf_tl.data();
  float* const xabs = xabs_tl.data();
  uint8_t* const row_ok = row_ok_tl.data();
  for (int64_t r = 0; r < m; ++r) {
    float lo, hi;
    certified_row_prologue(x + r * K, K, xbf + r * K, xabs + r * nkb, lo, hi);
    row_ok[r] = hi <= 0x1p60f && (lo == INFINITY || lo >= 0x1p-60f);
  }
  run(pool, npanels, 1, [&](int64_t p0, int64_t p1, int) {
    int64_t settled = 0, handed = 0;
    alignas(64) float tot[4 * 4 * kPanel], trk[4 * 4 * kPanel];
    thread_local AlignedVector<double> x64;  // one row x 256 x the panel's scales (scales beyond 2^+-40)
    thread_local AlignedVector<double> xwide;  // the rows widened, each on its first recomputation
    thread_local std::vector<uint8_t> wide_ready;
    if (int64_t(x64.size()) < K) x64.resize(size_t(K));
    if (int64_t(xwide.size()) < m * K) xwide.resize(size_t(m * K));
    if (int64_t(wide_ready.size()) < m) wide_ready.resize(size_t(m));
    std::fill(wide_ready.begin(), wide_ready.begin() + m, uint8_t(0));
    E4m3Dot queue[kRows64];
    int queued = 0;
    auto flush = [&] {
      double sums[kRows64];
      dot_e4m3_pairs_f64(queue, queued, K, e8, sums);
      for (int i = 0; i < queued; ++i) *queue[i].out = round_bf16(float(sums[i]));
      handed += queued;
      queued = 0;
    };
    // The outputs of panel p, rows r0 .. r0 + M, from tot/trk at (r * P + q): certified or recomputed.
    auto finish = [&](int64_t p, int64_t r0, int M, int P, int q) {
      const uint8_t* srow = w.scale + p * nkb;
      float smin = INFINITY, smax = 0.f;
      for (int64_t kb = 0; kb < nkb; ++kb) smin = std::min(smin, e8[srow[kb]]), smax = std::max(smax, e8[srow[kb]]);
      const bool panel_ok = smin >= 0x1p-40f && smax <= 0x1p40f;
      const int64_t n0 = p * kPanel;
      const int nvalid = int(std::min<int64_t>(kPanel, N - n0));
      for (int r = 0; r < M; ++r) {
        const int64_t row = r0 + r;
        unsigned rest = nvalid >= 32 ? ~0u : (1u << nvalid) - 1;
        if (panel_ok && row_ok[row]) {
          // Per lane: sum |products| <= sum_b |x block b|_1 x s_b x (the column's largest |E4M3| in b),
          // from the panel's table (e4m3x16_half gives the value x 2^-8, hence the 256).
          const uint8_t* maxcode = w.packed + p * panel_bytes + nkb * kFp8BlockBytes;
          __m512 prod[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
          for (int64_t kb = 0; kb < nkb; ++kb) {
            const __m512 c = _mm512_set1_ps(xabs[row * nkb + kb] * e8[srow[kb]] * 256.f);
            for (int h = 0; h < 2; ++h)
              prod[h] = _mm512_fmadd_ps(_mm512_cvtph_ps(e4m3x16_half(maxcode + kb * kPanel + h * 16)), c, prod[h]);
          }
          for (int h = 0; h < 2; ++h) {
            const unsigned valid = (rest >> (16 * h)) & 0xffff;
            const float* t = tot + (r * P + q) * kPanel + h * 16;
            const float* k = trk + (r * P + q) * kPanel + h * 16;
            const __mmask16 ok = certify_bf16_x16_lanes(_mm512_load_ps(t), _mm512_load_ps(k), prod[h], __mmask16(valid),
                                                        y + row * N + n0 + h * 16);
            settled += __builtin_popcount(ok);
            rest &= ~(unsigned(ok) << (16 * h));
          }
        }
        if (rest && panel_ok) {  // queued: four recomputations from anywhere in the chunk at a time
          double* xr = xwide.data() + row * K;
          if (!wide_ready[row]) widen_x(x + row * K, K, xr), wide_ready[row] = 1;
          for (; rest; rest &= rest - 1) {
            const int64_t col = n0 + __builtin_ctz(rest);
            queue[queued++] = {xr, w.w + col * K, srow, y + row * N + col};
            if (queued == kRows64) flush();
          }
        }
        if (rest) scale_x_f64(x + row * K, K, srow, e8, x64.data());
        while (rest) {  // four at a time: independent chains
          const uint8_t* rows[kRows64];
          int64_t cols[kRows64];
          int n = 0;
          for (; rest && n < kRows64; rest &= rest - 1, ++n) cols[n] = n0 + __builtin_ctz(rest), rows[n] = w.w + cols[n] * K;
          double sums[kRows64];
          dot_e4m3_rows_f64(x64.data(), rows, n, K, sums);
          for (int i = 0; i < n; ++i) y[row * N + cols[i]] = round_bf16(float(sums[i]));
          handed += n;
        }
      }
    };
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
      const int M = int(std::min<int64_t>(4, m - r0));
      const uint16_t* xr = xbf + r0 * K;
      // Panels of P = 4 / M at a time from the P parts of the chunk (P memory streams), the rest one by one.
      const int P = M == 1 ? 4 : M == 2 ? 2 : 1;
      const int64_t part = (p1 - p0) / P;
      auto tile = [&](int64_t first, int64_t stride, int np) {
        switch (M * 8 + np) {
          case 1 * 8 + 4: certified_panel_tile<1, 4>(xr, K, w.packed, panel_bytes, first, stride, w.scale, e8, lut, tot, trk); break;
          case 1 * 8 + 1: certified_panel_tile<1, 1>(xr, K, w.packed, panel_bytes, first, stride, w.scale, e8, lut, tot, trk); break;
          case 2 * 8 + 2: certified_panel_tile<2, 2>(xr, K, w.packed, panel_bytes, first, stride, w.scale, e8, lut, tot, trk); break;
          case 2 * 8 + 1: certified_panel_tile<2, 1>(xr, K, w.packed, panel_bytes, first, stride, w.scale, e8, lut, tot, trk); break;
          case 3 * 8 + 1: certified_panel_tile<3, 1>(xr, K, w.packed, panel_bytes, first, stride, w.scale, e8, lut, tot, trk); break;
          default: certified_panel_tile<4, 1>(xr, K, w.packed, panel_bytes, first, stride, w.scale, e8, lut, tot, trk); break;
        }
        for (int q = 0; q < np; ++q) finish(first + q * stride, r0, M, np, q);
      };
      for (int64_t j = 0; j < (P > 1 ? part : 0); ++j) tile(p0 + j, part, P);
      for (int64_t p = p0 + (P > 1 ? P * part : 0); p < p1; ++p) tile(p, 1, 1);
    }
    if (queued) flush();
    detail::certified_outputs.fetch_add(settled, std::memory_order_relaxed);
    detail::certified_fallbacks.fetch_add(handed, std::memory_order_relaxed);
  });
}

// wo_a when x holds bf16 values: vdpbf16ps with a certified error bound, exact fallback.
// Per 32-row scale group, x x scale is still bf16 (a power of two times a bf16 value; a block of
// rows falls back when it would leave [2^-100, 2^100]), so every product is exact in fp32 and only the
// fp32 additions round. Each vdpbf16ps step adds two products with at most two roundings (round to
// nearest even, per the ISA), each off by <= 2^-24 of its result, so with A_i the accumulator after
// step i:  |fp32 sum - exact sum| <= 2^-24 (2 sum_i |A_i| + sum |products|), where
// sum |products| <= 448 sum |x x scale|.
// The kernel tracks sum_i |A_i| beside each accumulator. When the interval (sum +- bound) maps to
// one bf16 under the fp64 kernel's rounding (fp64 -> fp32 -> bf16, monotone), that bf16 is the fp64
// kernel's result; otherwise (a few % of outputs) the output is recomputed with the fp64 kernels'
// products and order (dot4_f64, one output). So the bits are those of the exact kernel, at the
// speed of an fp32 one.
// From kCertifiedGemmRows rows (kCertifiedGemmRowsPacked on repacked weights, which below that take
// fp8_dequant_certified_panels) the GEMM layout above (fp8_dequant_certified_gemm) runs instead.
bool fp8_dequant_certified(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  static const Fp8Lut lut;
  const float* e8 = detail::e8m0_table();
  const int64_t K = w.in, N = w.out, nkb = K / 32, nch = K / 64;
  if (K % 64 != 0 || detail::exact_fp8_dequant_only) return false;
  std::atomic<bool> bf16_valued{true};  // else the fp64 path; rows checked over the pool
  run(pool, m, 1, [&](int64_t r0, int64_t r1, int) {
    uint32_t low = 0;
    for (int64_t i = r0 * K; i < r1 * K; ++i) low |= f32_bits(x[i]) & 0xffff;
    if (low) bf16_valued.store(false, std::memory_order_relaxed);
  });
  if (!bf16_valued.load(std::memory_order_relaxed)) return false;
  const bool packed = w.packed && w.packed_layout == detail::kLayoutAvx512Dequant;
  if (m >= (packed ? kCertifiedGemmRowsPacked : kCertifiedGemmRows)) {
    fp8_dequant_certified_gemm(x, m, w, y, pool);
    return true;
  }
  if (packed) {
    fp8_dequant_certified_panels(x, m, w, y, pool);
    return true;
  }
  // Exact fallback, same products and order as the fp64 kernels: the E4M3 codes against the row's
  // x x scale in fp64 (made on the row's first hand-over in its block).
  run(pool, (N + 31) / 32, 1, [&](int64_t g0, int64_t g1, int) {
    int64_t settled = 0, handed = 0;
    thread_local AlignedVector<uint16_t> xbf;  // [3][K] x x scale as bf16, in cvt_pair_fp8's word order
    thread_local AlignedVector<double> x64;    // [3][K] x x 256 x scale in fp64 (fallback)
    if (int64_t(xbf.size()) < 3 * K) xbf.resize(size_t(3 * K));
    if (int64_t(x64.size()) < 3 * K) x64.resize(size_t(3 * K));
    for (int64_t grp = g0; grp < g1; ++grp) {
      const uint8_t* srow = w.scale + grp * nkb;
      const int64_t n_begin = grp * 32, n_end = std::min(N, n_begin + 32);
      for (int64_t r0 = 0; r0 < m; r0 += 3) {  // blocks of up to 3 rows share each weight conversion
        const int M = int(std::min<int64_t>(3, m - r0));
        double abs_sum[3];
        bool in_range = true;
        for (int r = 0; r < M; ++r) {
          const float* xr = x + (r0 + r) * K;
          __m512 amax = _mm512_setzero_ps(), amin = _mm512_set1_ps(INFINITY), asum = _mm512_setzero_ps();
          for (int64_t c = 0; c < nch; ++c) {
            __m512 v[4];
            for (int q = 0; q < 4; ++q) {
              v[q] = _mm512_mul_ps(_mm512_loadu_ps(xr + c * 64 + q * 16), _mm512_set1_ps(e8[srow[(c * 64 + q * 16) / 32]]));
              const __m512 av = _mm512_abs_ps(v[q]);
              amax = _mm512_max_ps(amax, av);
              amin = _mm512_mask_min_ps(amin, _mm512_cmpneq_ps_mask(av, _mm512_setzero_ps()), amin, av);
              asum = _mm512_add_ps(asum, av);
            }
            const __m512i z0 = (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]), z1 = (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2]);
            uint16_t* d = xbf.data() + r * K + c * 64;
            _mm512_storeu_si512(d, _mm512_shuffle_i64x2(z0, z1, 0x88));       // words 0-7, 16-23, 32-39, 48-55
            _mm512_storeu_si512(d + 32, _mm512_shuffle_i64x2(z0, z1, 0xDD));  // words 8-15, 24-31, 40-47, 56-63
          }
          const float hi = _mm512_reduce_max_ps(amax), lo = _mm512_reduce_min_ps(amin);
          in_range &= hi <= 0x1p100f && (lo == INFINITY || lo >= 0x1p-100f);
          abs_sum[r] = double(_mm512_reduce_add_ps(asum));
        }
        bool x64_ready[3] = {false, false, false};
        // Four weight rows per pass for one x row, two for more (registers); a last lone row (odd N)
        // and blocks out of range go to the fp64 path.
        for (int64_t n0 = n_begin, cover; n0 < n_end; n0 += cover) {
          const int64_t left = n_end - n0;
          const bool fast = in_range && left >= 2;
          __m512 acc[4][3][2], track[4][3][2];
          cover = left;
          if (fast) {
            const uint8_t* wr = w.w + n0 * K;
            cover = M == 1 && left >= 4 ? 4 : 2;
            if (cover == 4) certified_dots<1, 4>(wr, K, xbf.data(), lut, acc, track);
            else if (M == 1) certified_dots<1, 2>(wr, K, xbf.data(), lut, acc, track);
            else if (M == 2) certified_dots<2, 2>(wr, K, xbf.data(), lut, acc, track);
            else certified_dots<3, 2>(wr, K, xbf.data(), lut, acc, track);
          }
          for (int i = 0; i < cover; ++i)
            for (int r = 0; r < M; ++r) {
              const int64_t n = n0 + i, row = r0 + r;
              if (fast) {
                const __m512 a0 = acc[i][r][0], a1 = acc[i][r][1];
                const double sum = _mm512_reduce_add_pd(_mm512_add_pd(widen_sum(a0), widen_sum(a1)));
                const double mag = _mm512_reduce_add_pd(_mm512_add_pd(widen_sum(_mm512_abs_ps(a0)), widen_sum(_mm512_abs_ps(a1))));
                const double tracked = _mm512_reduce_add_pd(_mm512_add_pd(widen_sum(track[i][r][0]), widen_sum(track[i][r][1])));
                if (certify_bf16(sum, tracked, abs_sum[r], mag, &y[row * N + n])) {
                  ++settled;
                  continue;
                }
              }
              ++handed;
              double sum;
              double* xs = x64.data() + r * K;
              if (!x64_ready[r]) scale_x_f64(x + row * K, K, srow, e8, xs), x64_ready[r] = true;
              dot_e4m3_f64(xs, w.w + n * K, K, 1, &sum);
              y[row * N + n] = round_bf16(float(sum));
            }
        }
      }
    }
    detail::certified_outputs.fetch_add(settled, std::memory_order_relaxed);
    detail::certified_fallbacks.fetch_add(handed, std::memory_order_relaxed);
  });
  return true;
}

// wo_a: the reference dequantizes to an fp32 weight (e4m3 x block scale) and runs a bf16 linear.
// The exact fp64 products are regrouped as (x x 256 x scale) x (e4m3 x 2^-8): the first factor is
// computed once per 32-row scale group (a power of two times x: exact in fp64), the second is the
// E4M3 code's own bits as fp16, so the inner loop has no scale lookups or multiplies. Products and
// sum order are unchanged. Weights with scales where e4m3 x scale overflows fp32 (codes 247-254,
// never seen in checkpoints) take the rows path, which builds the reference's fp32 weight, inf included.
// When x holds bf16 values (the model's case) the certified fp32 kernel above runs instead, with
// the same bits.
void linear_fp8_dequant(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool) {
  const float* e8 = detail::e8m0_table();
  const int64_t K = w.in, N = w.out, nkb = (K + 31) / 32;
  bool fp32_overflow = false;  // scale codes 247-254: e4m3 x scale can exceed the fp32 range
  for (int64_t i = 0; i < ((N + 31) / 32) * nkb; ++i) fp32_overflow |= w.scale[i] >= 247 && w.scale[i] != 255;
  if (!fp32_overflow && fp8_dequant_certified(x, m, w, y, pool)) return;
  if (m >= 4 || fp32_overflow) return linear_fp8_dequant_rows(widened_x(x, m * K), m, w, y, pool);
  run(pool, (N + 31) / 32, 1, [&](int64_t g0, int64_t g1, int) {
    thread_local AlignedVector<double> scaled_x;
    if (int64_t(scaled_x.size()) < K) scaled_x.resize(size_t(K));
    double* xg = scaled_x.data();
    double sums[kRows64];
    for (int64_t grp = g0; grp < g1; ++grp) {
      const uint8_t* srow = w.scale + grp * nkb;
      for (int64_t r = 0; r < m; ++r) {
        scale_x_f64(x + r * K, K, srow, e8, xg);
        for (int64_t n0 = grp * 32; n0 < std::min(N, grp * 32 + 32); n0 += kRows64) {
          const int rows = int(std::min<int64_t>(kRows64, N - n0));
          dot_e4m3_f64(xg, w.w + n0 * K, K, rows, sums);
          for (int i = 0; i < rows; ++i) y[r * N + n0 + i] = round_bf16(float(sums[i]));
        }
      }
    }
  });
}

// mHC collapse / expand, 16 columns per vector: the reference's fp32 products and sums in the
// same order (no FMA: -ffp-contract=off), then one bf16 rounding.
void hc_collapse(const float* X, const float* pre, int hc, int dim, float* y) {
  for (int d = 0; d < dim; d += 16) {
    const __mmask16 k = dim - d >= 16 ? __mmask16(0xffff) : __mmask16((1u << (dim - d)) - 1);  // ragged tail
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < hc; ++i)
      acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(pre[i]), _mm512_maskz_loadu_ps(k, X + size_t(i) * dim + d)));
    _mm512_mask_storeu_ps(y + d, k, round_bf16_ps(acc));
  }
}

void hc_expand(const float* f, const float* X, const float* post, const float* comb, int hc, int dim, float* Y) {
  for (int j = 0; j < hc; ++j)
    for (int d = 0; d < dim; d += 16) {
      const __mmask16 k = dim - d >= 16 ? __mmask16(0xffff) : __mmask16((1u << (dim - d)) - 1);  // ragged tail
      __m512 acc = _mm512_setzero_ps();
      for (int i = 0; i < hc; ++i)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(comb[i * hc + j]), _mm512_maskz_loadu_ps(k, X + size_t(i) * dim + d)));
      const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(post[j]), _mm512_maskz_loadu_ps(k, f + d)), acc);
      _mm512_mask_storeu_ps(Y + size_t(j) * dim + d, k, round_bf16_ps(v));
    }
}

// The indexer's dots in fp64 with 8 lanes (q widened once per call, each key once): the products
// of FP4-quantized q and k have a few significant bits and their sum is exact in fp64 in any order,
// so this gives the reference's bits; the per-head epilogue is the reference's scalar code. Keys
// go 4 at a time: 8 independent FMA chains per head instead of 2 (one key's dot was latency-bound).
// The integer path below hands it whatever is not 7-bit fixed point per block.
static void index_scores_f64(const float* q, const float* w, int n_heads, int d, const float* const* keys, int64_t n,
                             float* out) {
  constexpr int KB = 4;
  thread_local AlignedVector<double> qs, ks;
  if (qs.size() < size_t(n_heads) * d) qs.resize(size_t(n_heads) * d);
  if (ks.size() < size_t(KB) * d) ks.resize(size_t(KB) * d);
  double* qd = qs.data();
  widen_x(q, int64_t(n_heads) * d, qd);
  for (int64_t u0 = 0; u0 < n; u0 += KB) {
    const int nk = int(std::min<int64_t>(KB, n - u0));
    const double* kd[KB];
    for (int b = 0; b < KB; ++b) {
      double* dst = ks.data() + size_t(b) * d;
      kd[b] = dst;
      if (b < nk)
        for (int i = 0; i < d; i += 8) _mm512_storeu_pd(dst + i, _mm512_cvtps_pd(_mm256_loadu_ps(keys[u0 + b] + i)));
      else
        std::fill(dst, dst + d, 0.0);  // padding lanes: computed, never stored
    }
    float acc[KB] = {0.f, 0.f, 0.f, 0.f};
    for (int h = 0; h < n_heads; ++h) {
      const double* qh = qd + size_t(h) * d;
      __m512d a[KB][2];
#pragma GCC unroll 4
      for (int b = 0; b < KB; ++b) a[b][0] = a[b][1] = _mm512_setzero_pd();
      int i = 0;
      for (; i + 16 <= d; i += 16) {
        const __m512d q0 = _mm512_loadu_pd(qh + i), q1 = _mm512_loadu_pd(qh + i + 8);
#pragma GCC unroll 4
        for (int b = 0; b < KB; ++b) {
          a[b][0] = _mm512_fmadd_pd(q0, _mm512_loadu_pd(kd[b] + i), a[b][0]);
          a[b][1] = _mm512_fmadd_pd(q1, _mm512_loadu_pd(kd[b] + i + 8), a[b][1]);
        }
      }
      if (i < d) {
        const __m512d q0 = _mm512_loadu_pd(qh + i);
#pragma GCC unroll 4
        for (int b = 0; b < KB; ++b) a[b][0] = _mm512_fmadd_pd(q0, _mm512_loadu_pd(kd[b] + i), a[b][0]);
      }
#pragma GCC unroll 4
      for (int b = 0; b < KB; ++b) {
        const float v = std::max(round_bf16(float(_mm512_reduce_add_pd(_mm512_add_pd(a[b][0], a[b][1])))), 0.f);
        acc[b] += round_bf16(v * w[h]);
      }
    }
    for (int b = 0; b < nk; ++b) out[u0 + b] = round_bf16(acc[b]);
  }
}

// ---- Index scores with integer block dot products (VNNI) ----
// The indexer's q and k are E2M1 values times a power-of-two scale per 32-block, so every block is
// "7-bit integer codes x 2^e" exactly: its 32 products sum exactly in int32 with vpdpbusd (64
// products per instruction against 8 per fp64 FMA), and the block sums, scaled by their powers of
// two, add exactly in fp64. The fp64 path's sums are exact on the same data, so both round the
// same exact value once and the bits agree. Whatever is not such data takes the fp64 path: blocks
// that are not 7-bit fixed point, NaN or inf, and exponent spreads at which an fp64 sum could round.
namespace {

constexpr int kIdxKeys = 16;          // keys per group: one int32 lane each
constexpr int kIdxMaxD = 512;         // per-head dims the exactness bound below allows
constexpr int kIdxMaxSpread = 30;     // 14 bits per product + log2(512) + 30 <= 53: fp64 sums exact
constexpr int kIdxZeroBlock = 1 << 20;  // exponent marker of an all-zero block (no products)

// Exponent of a finite nonzero float (subnormals included): |x| in [2^E, 2^(E+1)).
inline int float_exponent(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const int field = int((u >> 23) & 0xff);
  if (field != 0) return field - 127;
  return 31 - __builtin_clz(u & 0x7fffff) - 149;
}

// One 32-value block as int8 codes c with v = c * 2^e exactly (|c| <= 127). False when the block
// has no such form (more than 7 significant bits across it, NaN, inf); e = kIdxZeroBlock for zeros.
inline bool fixed_block32(const float* v, __m128i& c0, __m128i& c1, int& e) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  if (!(amax <= FLT_MAX)) return false;  // inf, or NaN picked up by the max
  const int E = amax > 0.f ? float_exponent(amax) : 0;
  const __m512 s = _mm512_set1_ps(float(6 - E));  // |v| 2^(6-E) < 128
  const __m512 sa = _mm512_scalef_ps(a, s), sb = _mm512_scalef_ps(b, s);
  const __m512i ia = _mm512_cvtps_epi32(sa), ib = _mm512_cvtps_epi32(sb);
  // Integral (and not NaN: a NaN compares unequal) in every lane.
  if ((_mm512_cmp_ps_mask(_mm512_cvtepi32_ps(ia), sa, _CMP_EQ_OQ) & _mm512_cmp_ps_mask(_mm512_cvtepi32_ps(ib), sb, _CMP_EQ_OQ)) !=
      0xffff)
    return false;
  c0 = _mm512_cvtepi32_epi8(ia);
  c1 = _mm512_cvtepi32_epi8(ib);
  e = amax > 0.f ? E - 6 : kIdxZeroBlock;
  return true;
}

inline double pow2_f64(int e) {  // e within the fp64 normal range
  const uint64_t u = uint64_t(e + 1023) << 52;
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}

struct IndexQuery {
  AlignedVector<uint32_t> codes;  // [head][block][8 dwords of 4 signed codes]
  AlignedVector<int32_t> corr;    // [head][block] 128 x sum of the codes: the keys' +128 offset
  AlignedVector<double> scale;    // [head][block] 2^e
  int emin = kIdxZeroBlock, emax = -kIdxZeroBlock;
};

bool fixed_query(const float* q, int n_heads, int d, IndexQuery& Q) {
  const int nb = d / 32;
  Q.codes.resize(size_t(n_heads) * nb * 8);
  Q.corr.resize(size_t(n_heads) * nb);
  Q.scale.resize(size_t(n_heads) * nb);
  Q.emin = kIdxZeroBlock;
  Q.emax = -kIdxZeroBlock;
  for (int hb = 0; hb < n_heads * nb; ++hb) {
    __m128i c0, c1;
    int e;
    if (!fixed_block32(q + int64_t(hb) * 32, c0, c1, e)) return false;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(Q.codes.data() + size_t(hb) * 8), c0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(Q.codes.data() + size_t(hb) * 8 + 4), c1);
    Q.corr[size_t(hb)] = 128 * (_mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(c0)) + _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(c1)));
    Q.scale[size_t(hb)] = e == kIdxZeroBlock ? 1.0 : pow2_f64(e);
    if (e != kIdxZeroBlock) Q.emin = std::min(Q.emin, e), Q.emax = std::max(Q.emax, e);
  }
  return true;
}

// Lane u = max over the 16 lanes of m[u] (unsigned dwords): a transposing tree, 45 operations for
// 16 rows instead of 16 serial reductions.
inline __m512i hmax16_epu32(const __m512i (&m)[16]) {
  __m512i x[8], y[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_max_epu32(_mm512_unpacklo_epi32(m[2 * i], m[2 * i + 1]), _mm512_unpackhi_epi32(m[2 * i], m[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: rows 4i..4i+3 over lane L's four dwords
    y[i] = _mm512_max_epu32(_mm512_unpacklo_epi64(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_epi64(x[2 * i], x[2 * i + 1]));
  const __m512i u0 = _mm512_max_epu32(_mm512_shuffle_i32x4(y[0], y[1], 0x44), _mm512_shuffle_i32x4(y[0], y[1], 0xEE));
  const __m512i u1 = _mm512_max_epu32(_mm512_shuffle_i32x4(y[2], y[3], 0x44), _mm512_shuffle_i32x4(y[2], y[3], 0xEE));
  return _mm512_max_epu32(_mm512_shuffle_i32x4(u0, u1, 0x88), _mm512_shuffle_i32x4(u0, u1, 0xDD));
}

// Keys u0 .. u0 + nk (nk <= 16) into the group layout kc[block][dword][key] (codes + 128 as u8)
// and ks[block][key] = 2^e, 16 keys per vector operation (one key's block at a time is a chain of
// dependent reductions). False if any key is not fixed point or its exponents spread too far from
// the query's for an exact fp64 sum.
bool fixed_key_group(const float* const* keys, int nk, int nb, const IndexQuery& Q, uint32_t* kc, double* ks) {
  alignas(64) uint32_t rows[kIdxKeys][16];  // codes of blocks 2c, 2c + 1 per key, transposed per pair
  alignas(64) float shift[kIdxKeys];
  const __m512i abs_bits = _mm512_set1_epi32(0x7fffffff);
  const __m128i offset = _mm_set1_epi8(int8_t(0x80));
  const __m512i none = _mm512_set1_epi32(kIdxZeroBlock);
  __m512i kmin = none, kmax = _mm512_set1_epi32(-kIdxZeroBlock);
  uint32_t bad = 0;
  for (int b = 0; b < nb; ++b) {
    __m512i m[kIdxKeys];
#pragma GCC unroll 16
    for (int u = 0; u < kIdxKeys; ++u)
      m[u] = u < nk ? _mm512_max_epu32(_mm512_and_si512(_mm512_loadu_si512(keys[u] + b * 32), abs_bits),
                                       _mm512_and_si512(_mm512_loadu_si512(keys[u] + b * 32 + 16), abs_bits))
                    : _mm512_setzero_si512();
    const __m512 amax = _mm512_castsi512_ps(hmax16_epu32(m));  // NaN bits sort above inf
    bad |= _mm512_cmp_ps_mask(amax, _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ);
    const __mmask16 zero = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_EQ_OQ);
    const __m512 E = _mm512_mask_mov_ps(_mm512_getexp_ps(amax), zero, _mm512_setzero_ps());
    _mm512_store_ps(shift, _mm512_sub_ps(_mm512_set1_ps(6.f), E));  // |v| 2^(6-E) < 128
    const __m512i e = _mm512_sub_epi32(_mm512_cvttps_epi32(E), _mm512_set1_epi32(6));
    kmin = _mm512_mask_min_epi32(kmin, ~zero, kmin, e);
    kmax = _mm512_mask_max_epi32(kmax, ~zero, kmax, e);
    const __m512i bits = _mm512_slli_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(e)), _mm512_set1_epi64(1023)), 52);
    const __m512i bits_hi =
        _mm512_slli_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(e, 1)), _mm512_set1_epi64(1023)), 52);
    _mm512_storeu_pd(ks + b * kIdxKeys, _mm512_mask_mov_pd(_mm512_castsi512_pd(bits), __mmask8(zero), _mm512_set1_pd(1.0)));
    _mm512_storeu_pd(ks + b * kIdxKeys + 8, _mm512_mask_mov_pd(_mm512_castsi512_pd(bits_hi), __mmask8(zero >> 8), _mm512_set1_pd(1.0)));
    for (int u = 0; u < nk; ++u) {
      const __m512 sv = _mm512_set1_ps(shift[u]);
      const __m512 sa = _mm512_scalef_ps(_mm512_loadu_ps(keys[u] + b * 32), sv);
      const __m512 sb = _mm512_scalef_ps(_mm512_loadu_ps(keys[u] + b * 32 + 16), sv);
      const __m512i ia = _mm512_cvtps_epi32(sa), ib = _mm512_cvtps_epi32(sb);
      // Integral (a NaN compares unequal) in every lane.
      bad |= 0xffffu ^ (_mm512_cmp_ps_mask(_mm512_cvtepi32_ps(ia), sa, _CMP_EQ_OQ) & _mm512_cmp_ps_mask(_mm512_cvtepi32_ps(ib), sb, _CMP_EQ_OQ));
      _mm_store_si128(reinterpret_cast<__m128i*>(rows[u] + (b & 1) * 8), _mm_xor_si128(_mm512_cvtepi32_epi8(ia), offset));
      _mm_store_si128(reinterpret_cast<__m128i*>(rows[u] + (b & 1) * 8 + 4), _mm_xor_si128(_mm512_cvtepi32_epi8(ib), offset));
    }
    for (int u = nk; u < kIdxKeys; ++u) {  // padding keys: code 0
      _mm_store_si128(reinterpret_cast<__m128i*>(rows[u] + (b & 1) * 8), offset);
      _mm_store_si128(reinterpret_cast<__m128i*>(rows[u] + (b & 1) * 8 + 4), offset);
    }
    if ((b & 1) == 1 || b == nb - 1) {  // blocks b - 1, b (or b alone) to [dword][key]
      __m512i r[kIdxKeys];
#pragma GCC unroll 16
      for (int u = 0; u < kIdxKeys; ++u) r[u] = _mm512_load_si512(rows[u]);
      transpose16(r);
      const int b0 = b & ~1, dwords = (b - b0 + 1) * 8;
      for (int t = 0; t < dwords; ++t) _mm512_storeu_si512(kc + (b0 * 8 + t) * kIdxKeys, r[t]);
    }
  }
  if (bad != 0) return false;
  if (Q.emin == kIdxZeroBlock) return true;  // q all zeros: no products
  const __mmask16 any = _mm512_cmp_epi32_mask(kmin, none, _MM_CMPINT_NE);
  const __m512i spread = _mm512_add_epi32(_mm512_sub_epi32(kmax, kmin), _mm512_set1_epi32(Q.emax - Q.emin));
  return _mm512_mask_cmp_epi32_mask(any, spread, _mm512_set1_epi32(kIdxMaxSpread), _MM_CMPINT_GT) == 0;
}

// Scores of one key group: dot[h][key] = sum over blocks of (int32 block sum) x 2^(eq + ek), then
// the reference's per-head epilogue in 16 lanes (each key's heads in order, as the scalar code).
void score_key_group(const IndexQuery& Q, const float* w, int n_heads, int nb, const uint32_t* kc, const double* ks,
                     double* dot, float* out, int nk) {
  for (int b = 0; b < nb; ++b) {
    __m512i kv[8];
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) kv[g] = _mm512_loadu_si512(kc + (b * 8 + g) * kIdxKeys);
    const __m512d ks0 = _mm512_loadu_pd(ks + b * kIdxKeys), ks1 = _mm512_loadu_pd(ks + b * kIdxKeys + 8);
    for (int h = 0; h < n_heads; ++h) {
      const uint32_t* qc = Q.codes.data() + (size_t(h) * nb + b) * 8;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // two chains: half the latency
#pragma GCC unroll 4
      for (int g = 0; g < 8; g += 2) {
        s0 = _mm512_dpbusd_epi32(s0, kv[g], _mm512_set1_epi32(int(qc[g])));
        s1 = _mm512_dpbusd_epi32(s1, kv[g + 1], _mm512_set1_epi32(int(qc[g + 1])));
      }
      const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(Q.corr[size_t(h) * nb + b]));
      const __m512d qs = _mm512_set1_pd(Q.scale[size_t(h) * nb + b]);
      const __m512d v0 = _mm512_mul_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(s)), ks0), qs);
      const __m512d v1 = _mm512_mul_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(s, 1)), ks1), qs);
      double* dh = dot + size_t(h) * kIdxKeys;
      if (b == 0) {
        _mm512_storeu_pd(dh, v0);
        _mm512_storeu_pd(dh + 8, v1);
      } else {
        _mm512_storeu_pd(dh, _mm512_add_pd(_mm512_loadu_pd(dh), v0));
        _mm512_storeu_pd(dh + 8, _mm512_add_pd(_mm512_loadu_pd(dh + 8), v1));
      }
    }
  }
  const __m512 zero = _mm512_setzero_ps();
  __m512 acc = zero;
  for (int h = 0; h < n_heads; ++h) {
    const double* dh = dot + size_t(h) * kIdxKeys;
    __m512 v = round_bf16_ps(_mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(_mm512_loadu_pd(dh))),
                                                _mm512_cvtpd_ps(_mm512_loadu_pd(dh + 8)), 1));
    v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ), zero);  // std::max(v, 0.f): NaN and -0 stay
    acc = _mm512_add_ps(acc, round_bf16_ps(_mm512_mul_ps(v, _mm512_set1_ps(w[h]))));
  }
  _mm512_mask_storeu_ps(out, __mmask16((1u << nk) - 1), round_bf16_ps(acc));
}

}  // namespace

void index_scores(const float* q, const float* w, int n_heads, int d, const float* const* keys, int64_t n, float* out) {
  thread_local IndexQuery Q;
  // A handful of keys do not pay for converting q.
  if (d % 32 != 0 || d > kIdxMaxD || n < 4 || detail::index_scores_fp64_only || !fixed_query(q, n_heads, d, Q)) {
    detail::index_fp64_keys.fetch_add(n, std::memory_order_relaxed);
    return index_scores_f64(q, w, n_heads, d, keys, n, out);
  }
  const int nb = d / 32;
  thread_local AlignedVector<uint32_t> kc;
  thread_local AlignedVector<double> ks, dot;
  kc.resize(size_t(nb) * 8 * kIdxKeys);
  ks.resize(size_t(nb) * kIdxKeys);
  dot.resize(size_t(n_heads) * kIdxKeys);
  int64_t fixed = 0;
  for (int64_t u0 = 0; u0 < n; u0 += kIdxKeys) {
    const int nk = int(std::min<int64_t>(kIdxKeys, n - u0));
    if (fixed_key_group(keys + u0, nk, nb, Q, kc.data(), ks.data())) {
      score_key_group(Q, w, n_heads, nb, kc.data(), ks.data(), dot.data(), out + u0, nk);
      fixed += nk;
    } else {
      index_scores_f64(q, w, n_heads, d, keys + u0, nk, out + u0);
    }
  }
  detail::index_fixed_keys.fetch_add(fixed, std::memory_order_relaxed);
  detail::index_fp64_keys.fetch_add(n - fixed, std::memory_order_relaxed);
}

// P.V of HB heads over the live rows of a chunk: part[h][i] = sum_j pb[h][j] kv_j[i], each output
// summed in row order in fp64 (the reference's bits; the products are exact), 8 NZ outputs x HB
// heads per pass held in registers, each widened kv vector shared by the HB heads (widening is on
// the FMA pipes, so more heads per widened vector leave more of them to the FMAs).
template <int HB, int NZ>
inline void pv_heads(const double* pb, int64_t pb_stride, const float* const* rows, int live, int d, double* part) {
  int e = 0;
  for (; e + 8 * NZ <= d; e += 8 * NZ) {
    __m512d a[HB][NZ];
#pragma GCC unroll 8
    for (int hh = 0; hh < HB; ++hh)
#pragma GCC unroll 4
      for (int z = 0; z < NZ; ++z) a[hh][z] = _mm512_setzero_pd();
    for (int j = 0; j < live; ++j) {
      __m512d v[NZ];
#pragma GCC unroll 4
      for (int z = 0; z < NZ; ++z) v[z] = _mm512_cvtps_pd(_mm256_loadu_ps(rows[j] + e + 8 * z));
#pragma GCC unroll 8
      for (int hh = 0; hh < HB; ++hh) {
        const __m512d p = _mm512_set1_pd(pb[hh * pb_stride + j]);
#pragma GCC unroll 4
        for (int z = 0; z < NZ; ++z) a[hh][z] = _mm512_fmadd_pd(p, v[z], a[hh][z]);
      }
    }
#pragma GCC unroll 8
    for (int hh = 0; hh < HB; ++hh)
#pragma GCC unroll 4
      for (int z = 0; z < NZ; ++z) _mm512_storeu_pd(part + int64_t(hh) * d + e + 8 * z, a[hh][z]);
  }
  for (; e < d; ++e)
    for (int hh = 0; hh < HB; ++hh) {
      double s = 0;
      for (int j = 0; j < live; ++j) s += pb[hh * pb_stride + j] * rows[j][e];
      part[int64_t(hh) * d + e] = s;
    }
}

// sums[h][r] = q_h . row_r for 4 heads (fp64 q, rows of d) x 4 rows (fp32, widened here): 16
// accumulators of 8 lanes over d, then a pairwise reduction; the tail past the last 8 is added
// last. Exact for the attention's operands (see the caller), so the order does not matter.
inline void score_tile(const double* q, int d, const float* const (&rw)[4], double (&sums)[4][4]) {
  __m512d a[4][4];
#pragma GCC unroll 4
  for (int h = 0; h < 4; ++h)
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) a[h][r] = _mm512_setzero_pd();
  int i = 0;
  for (; i + 8 <= d; i += 8) {
    __m512d k[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) k[r] = _mm512_cvtps_pd(_mm256_loadu_ps(rw[r] + i));
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) {
      const __m512d qv = _mm512_loadu_pd(q + int64_t(h) * d + i);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) a[h][r] = _mm512_fmadd_pd(qv, k[r], a[h][r]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < 4; ++h) {
    // [r0, r1] and [r2, r3] pair sums per 128-bit lane, then the four lanes added.
    const __m512d t0 = _mm512_add_pd(_mm512_unpacklo_pd(a[h][0], a[h][1]), _mm512_unpackhi_pd(a[h][0], a[h][1]));
    const __m512d t1 = _mm512_add_pd(_mm512_unpacklo_pd(a[h][2], a[h][3]), _mm512_unpackhi_pd(a[h][2], a[h][3]));
    const __m512d s = _mm512_add_pd(_mm512_shuffle_f64x2(t0, t1, 0x44), _mm512_shuffle_f64x2(t0, t1, 0xEE));
    const __m512d x = _mm512_add_pd(s, _mm512_shuffle_f64x2(s, s, 0xB1));
    alignas(64) double v[8];
    _mm512_store_pd(v, x);
    sums[h][0] = v[0], sums[h][1] = v[1], sums[h][2] = v[4], sums[h][3] = v[5];
    for (int j = i; j < d; ++j)
      for (int r = 0; r < 4; ++r) sums[h][r] += q[int64_t(h) * d + j] * double(rw[r][j]);
  }
}

void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                      const float* attn_sink, float softmax_scale, float* out) {
  constexpr int64_t kChunk = 64;
  const int H = n_heads;
  thread_local AlignedVector<double> part, qd, pb;
  thread_local AlignedVector<float> score, acc, zero_row, running_max, denom, rescale;

  if (part.size() < size_t(H) * d) part.resize(size_t(H) * d);
  if (pb.size() < size_t(H) * kChunk) pb.resize(size_t(H) * kChunk);
  if (rescale.size() < size_t(H)) rescale.resize(size_t(H));
  if (score.size() < size_t(H) * kChunk) score.resize(size_t(H) * kChunk);
  if (acc.size() < size_t(H) * d) acc.resize(size_t(H) * d);
  if (zero_row.size() < size_t(d)) zero_row.assign(size_t(d), 0.f);
  if (running_max.size() < size_t(H)) running_max.resize(size_t(H)), denom.resize(size_t(H));
  std::fill(acc.begin(), acc.begin() + int64_t(H) * d, 0.f);
  std::fill(running_max.begin(), running_max.begin() + H, -1e30f);
  std::fill(denom.begin(), denom.begin() + H, 0.f);
  const int H4 = (H + 3) / 4 * 4;  // score tiles take 4 heads
  if (qd.size() < size_t(H4) * d) qd.resize(size_t(H4) * d);
  widen_x(q, int64_t(H) * d, qd.data());  // widened once
  std::fill(qd.begin() + int64_t(H) * d, qd.begin() + int64_t(H4) * d, 0.0);
  for (int64_t c0 = 0; c0 < n_rows; c0 += kChunk) {
    const int64_t c1 = std::min(n_rows, c0 + kChunk);
    // Only the chunk's live rows are scored: a skipped (-1) entry's probability is exp(-inf) = 0,
    // which leaves the chunk max, the fp64 psum and P.V exactly as they were, and a chunk with no
    // live row rescales by exp(0) = 1 and adds zeros, so it is skipped whole. Same bits, while
    // early positions (short windows, few compressed entries visible) do far less work.
    const float* rows[kChunk];
    int live = 0;
    for (int64_t j = c0; j < c1; ++j)
      if (kv_rows[j]) rows[live++] = kv_rows[j];
    if (live == 0) continue;
    // Scores: tiles of 4 heads x 4 rows, 8-lane fp64 partial dots over d, reduced per tile. Every
    // product is exact (bf16 q times E4M3 or E2M1 x E4M3 kv values: <= 14 significant bits) and
    // fp64 sums of up to 512 of them are exact whenever their exponents span under 30 bits (all
    // test and golden data), so any order gives the sequential dot's bits, without transposing
    // the rows (which cost as much as the dots at 8 heads per call).
    // Heads outside, rows inside: a 4-head q tile (16 KB at d = 512) stays in L1 while the chunk's
    // rows stream past it from L2.
    for (int h0 = 0; h0 < H; h0 += 4) {
      const double* qh = qd.data() + int64_t(h0) * d;  // heads past H are zero rows
      for (int g0 = 0; g0 < live; g0 += 4) {
        const int nr = std::min(4, live - g0);
        const float* rw[4];
        for (int r = 0; r < 4; ++r) rw[r] = r < nr ? rows[g0 + r] : zero_row.data();
        double sums[4][4];
        score_tile(qh, d, rw, sums);
        for (int hh = 0; hh < std::min(4, H - h0); ++hh)
          for (int r = 0; r < nr; ++r) score[size_t(h0 + hh) * kChunk + size_t(g0 + r)] = float(sums[hh][r]) * softmax_scale;
      }
    }
    // Probabilities of every head first (libm expf and the per-head fp64 psum of the reference),
    // then P.V for blocks of heads, so each widened kv vector feeds several heads.
    for (int h = 0; h < H; ++h) {
      const float* sc = score.data() + size_t(h) * kChunk;
      float chunk_max = -INFINITY;
      for (int l = 0; l < live; ++l) chunk_max = std::max(chunk_max, sc[l]);
      const float new_max = std::max(running_max[size_t(h)], chunk_max);
      rescale[size_t(h)] = std::exp(running_max[size_t(h)] - new_max);
      double psum = 0;
      double* pbh = pb.data() + size_t(h) * kChunk;
      alignas(64) float p[kChunk];
      for (int l = 0; l < live; l += 16) {
        alignas(64) float arg[16];
        const __mmask16 k = live - l >= 16 ? __mmask16(0xffff) : __mmask16((1u << (live - l)) - 1);
        _mm512_store_ps(arg, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + l), _mm512_set1_ps(new_max)));
        expf_libm(arg, std::min(16, live - l), p + l);
        const __m512 b = round_bf16_ps(_mm512_maskz_loadu_ps(k, p + l));
        _mm512_mask_storeu_pd(pbh + l, __mmask8(k), _mm512_cvtps_pd(_mm512_castps512_ps256(b)));
        _mm512_mask_storeu_pd(pbh + l + 8, __mmask8(k >> 8), _mm512_cvtps_pd(_mm512_extractf32x8_ps(b, 1)));
      }
      for (int l = 0; l < live; ++l) psum += p[l];  // fp64 in row order, as the reference
      denom[size_t(h)] = denom[size_t(h)] * rescale[size_t(h)] + float(psum);
      running_max[size_t(h)] = new_max;
    }
    int h = 0;
    for (; h + 8 <= H; h += 8) pv_heads<8, 2>(pb.data() + size_t(h) * kChunk, kChunk, rows, live, d, part.data() + size_t(h) * d);
    for (; h + 4 <= H; h += 4) pv_heads<4, 4>(pb.data() + size_t(h) * kChunk, kChunk, rows, live, d, part.data() + size_t(h) * d);
    for (; h < H; ++h) pv_heads<1, 4>(pb.data() + size_t(h) * kChunk, kChunk, rows, live, d, part.data() + size_t(h) * d);
    for (h = 0; h < H; ++h) {
      const double* pt = part.data() + size_t(h) * d;
      float* ah = acc.data() + size_t(h) * d;
      const float rsc = rescale[size_t(h)];
      const __m512 rs = _mm512_set1_ps(rsc);
      int i = 0;
      for (; i + 16 <= d; i += 16) {
        const __m512 pf = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(_mm512_loadu_pd(pt + i))),
                                             _mm512_cvtpd_ps(_mm512_loadu_pd(pt + i + 8)), 1);
        _mm512_storeu_ps(ah + i, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(ah + i), rs), pf));
      }
      for (; i < d; ++i) ah[i] = ah[i] * rsc + float(pt[i]);
    }
  }
  for (int h = 0; h < H; ++h) {
    const float dn = denom[size_t(h)] + std::exp(attn_sink[h] - running_max[size_t(h)]);
    const float* ah = acc.data() + size_t(h) * d;
    float* oh = out + int64_t(h) * d;
    int i = 0;
    for (; i + 16 <= d; i += 16)
      _mm512_storeu_ps(oh + i, round_bf16_ps(_mm512_div_ps(_mm512_loadu_ps(ah + i), _mm512_set1_ps(dn))));
    for (; i < d; ++i) oh[i] = round_bf16(ah[i] / dn);
  }
}

// di::act_qdq_fp4_e8m0 for block 32: the scale is a power of two, so x / s is x times the exact
// reciprocal (normal, as s <= 2^126 for finite x; an infinite amax gives 1 / s = 0, the same zeros
// and NaNs as x / inf), the same correctly rounded value; the E2M1 rounding is the scalar's chain
// of selects on masks (ties to the even code, NaN to 6), the sign copied from x / s.
void act_qdq_fp4_e8m0(float* x, int64_t n) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(int(0x80000000u)));
  constexpr float kMids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f}, kVals[7] = {0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  int64_t b0 = 0;
  for (; b0 + 32 <= n; b0 += 32) {
    __m512 v[2] = {_mm512_loadu_ps(x + b0), _mm512_loadu_ps(x + b0 + 16)};
    // max(|x|, acc) returns acc for a NaN |x|: NaNs are skipped, as std::max(amax, |x|) skips them.
    const float amax = std::max(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[1]), _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_setzero_ps()))),
                                6.f * 0x1p-126f);
    const float s = pow2_ceil(amax * (1.0f / 6.0f));
    const __m512 inv = _mm512_set1_ps(1.0f / s), sv = _mm512_set1_ps(s);
    for (int h = 0; h < 2; ++h) {
      const __m512 q = _mm512_mul_ps(v[h], inv);
      const __m512 a = _mm512_abs_ps(q);
      __m512 r = _mm512_setzero_ps();
#pragma GCC unroll 7
      for (int i = 0; i < 7; ++i) {
        // A tie goes to the even code: up ('>=') where the upper value's code is even, else '>'. The
        // predicates are literals: immediates even where the loop is not unrolled (sanitizer builds).
        const __m512 mid = _mm512_set1_ps(kMids[i]);
        const __mmask16 up = (i & 1) ? _mm512_cmp_ps_mask(a, mid, _CMP_GE_OQ) : _mm512_cmp_ps_mask(a, mid, _CMP_GT_OQ);
        r = _mm512_mask_mov_ps(r, up, _mm512_set1_ps(kVals[i]));
      }
      r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_set1_ps(6.f));
      _mm512_storeu_ps(x + b0 + 16 * h, _mm512_mul_ps(_mm512_or_ps(r, _mm512_and_ps(q, sign)), sv));
    }
  }
  if (b0 < n) di::act_qdq_fp4_e8m0(x + b0, n - b0, 32);
}

// di::act_qdq_fp8 for block 32: act_quant's block (quant_block32, bit for bit) times its scale.
// Blocks holding a NaN take the scalar code (its NaN is the E4M3 table's, not x's).
void act_qdq_fp8(float* x, int64_t n) {
  int64_t b0 = 0;
  for (; b0 + 32 <= n; b0 += 32) {
    const __m512 v0 = _mm512_loadu_ps(x + b0), v1 = _mm512_loadu_ps(x + b0 + 16);
    if (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) {
      di::act_qdq_fp8(x + b0, 32, 32);
      continue;
    }
    float s;
    const __m512i q = quant_block32(x + b0, &s);
    const __m512 sv = _mm512_set1_ps(s);
    const __m512i lo = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q)), 16);
    const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1)), 16);
    _mm512_storeu_ps(x + b0, _mm512_mul_ps(_mm512_castsi512_ps(lo), sv));
    _mm512_storeu_ps(x + b0 + 16, _mm512_mul_ps(_mm512_castsi512_ps(hi), sv));
  }
  if (b0 < n) di::act_qdq_fp8(x + b0, n - b0, 32);
}

// ref::swiglu 16 at a time: the clamps as max/min with the value second (a NaN passes through,
// as through std::clamp and std::min), libm's expf in vectors, IEEE division and products.
void swiglu(float* g, const float* u, int64_t m, int64_t n, float limit, const float* weight) {
  const __m512 hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit), one = _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < n; i += 16) {
      const int cnt = int(std::min<int64_t>(16, n - i));
      const __mmask16 k = cnt == 16 ? __mmask16(0xffff) : __mmask16((1u << cnt) - 1);
      float* gp = g + r * n + i;
      const __m512 up = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_maskz_loadu_ps(k, u + r * n + i)));
      const __m512 gate = _mm512_min_ps(hi, _mm512_maskz_loadu_ps(k, gp));
      alignas(64) float e[16];
      _mm512_store_ps(e, _mm512_xor_ps(gate, _mm512_set1_ps(-0.f)));  // -gate
      expf_libm(e, cnt, e);
      __m512 h = _mm512_mul_ps(_mm512_div_ps(gate, _mm512_add_ps(one, _mm512_load_ps(e))), up);
      if (weight) h = _mm512_mul_ps(_mm512_set1_ps(weight[r]), h);
      _mm512_mask_storeu_ps(gp, k, round_bf16_ps(h));
    }
}

namespace {
// 16 vectors -> their ref::fast::halving_sum16 sums in one vector, by the same adds done across
// vectors: lane 4r + hh holds the sum of v[4hh + r].
inline __m512 halving_sums16(const __m512* v) {
  __m512 w[8], x[4], z[2];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k)  // v8 of v[2k] | v8 of v[2k + 1]
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44), _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m)  // 128-bit lane L: v4 of v[4m + L]
    x[m] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0x88), _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0xDD));
#pragma GCC unroll 2
  for (int n = 0; n < 2; ++n)  // lane L: v2 of v[8n + L], v2 of v[8n + 4 + L]
    z[n] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * n], x[2 * n + 1], 0x44), _mm512_shuffle_ps(x[2 * n], x[2 * n + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
}

// Scores of 4 heads (qb: bf16 rows, stride d) x 4 kv rows (bf16) in pair lanes, x scale, stored as
// out[r * ld + hh].
inline void score_tile_pairs(const uint16_t* qb, int d, const uint16_t* const* kr, float scale, float* out, int64_t ld) {
  __m512 v[16];
#pragma GCC unroll 16
  for (int a = 0; a < 16; ++a) v[a] = _mm512_setzero_ps();
  for (int c = 0; c < d; c += 32) {
    __m512bh k[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) k[r] = (__m512bh)_mm512_loadu_si512(kr[r] + c);
#pragma GCC unroll 4
    for (int hh = 0; hh < 4; ++hh) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + size_t(hh) * d + c);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) v[4 * hh + r] = _mm512_dpbf16_ps(v[4 * hh + r], qv, k[r]);
    }
  }
  const __m512 s = _mm512_mul_ps(halving_sums16(v), _mm512_set1_ps(scale));
  _mm_storeu_ps(out, _mm512_castps512_ps128(s));
  _mm_storeu_ps(out + ld, _mm512_extractf32x4_ps(s, 1));
  _mm_storeu_ps(out + 2 * ld, _mm512_extractf32x4_ps(s, 2));
  _mm_storeu_ps(out + 3 * ld, _mm512_extractf32x4_ps(s, 3));
}

// P.V of one chunk for 4 heads x NC 16-channel vectors: pp = [pair][head] bf16 probability pairs
// (stride kp), vt = this channel block's [pair][64 channels] bf16 row pairs (contiguous: a tile's
// 8 KB stay in L1 for the 4-head blocks that reuse it); then acc = acc x rescale + part per head.
template <int NC>
inline void pv_tile_pairs(const uint32_t* pp, int64_t kp, int np, const uint32_t* vt, int d, int c, const float* rescale,
                          float* acc) {
  __m512 a[4][NC];
#pragma GCC unroll 4
  for (int hh = 0; hh < 4; ++hh)
#pragma GCC unroll 4
    for (int n = 0; n < NC; ++n) a[hh][n] = _mm512_setzero_ps();
  for (int t = 0; t < np; ++t) {
    __m512bh v[NC];
#pragma GCC unroll 4
    for (int n = 0; n < NC; ++n) v[n] = (__m512bh)_mm512_loadu_si512(vt + t * 64 + 16 * n);
#pragma GCC unroll 4
    for (int hh = 0; hh < 4; ++hh) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(int(pp[t * kp + hh]));
#pragma GCC unroll 4
      for (int n = 0; n < NC; ++n) a[hh][n] = _mm512_dpbf16_ps(a[hh][n], p, v[n]);
    }
  }
#pragma GCC unroll 4
  for (int hh = 0; hh < 4; ++hh) {
    const __m512 rs = _mm512_set1_ps(rescale[hh]);
#pragma GCC unroll 4
    for (int n = 0; n < NC; ++n) {
      float* ah = acc + size_t(hh) * d + c + 16 * n;
      _mm512_storeu_ps(ah, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(ah), rs), a[hh][n]));
    }
  }
}

inline void to_bf16_row(const float* x, int d, uint16_t* y) {
  for (int i = 0; i < d; i += 32)
    _mm512_storeu_si512(y + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
}
}  // namespace

// ref::fast::sparse_attention (d % 32 == 0). q and the rows in bf16; scores by 4 x 4 tiles of
// vdpbf16ps chains; the recurrence with the heads across the lanes (sequential per head, as the
// contract); P.V by vdpbf16ps over row pairs interleaved once per chunk, 4 heads x 64 channels
// per tile, so each pair vector feeds 4 heads and each probability pair 4 vectors.
// krow(j), j in [0, n_rows rounded up to 4]: row j as bf16, zeros for a null row and past n_rows;
// kv_rows[j] == nullptr marks the null rows.
template <class Row>
void attention_pairs(const float* q, int n_heads, int d, Row krow, const void* const* kv_rows, int64_t n_rows,
                     const float* attn_sink, float softmax_scale, float* out) {
  constexpr int kChunk = 64, kPairs = kChunk / 2;
  const int H = n_heads, HP = (H + 3) / 4 * 4, HV = (H + 15) / 16 * 16;
  const int64_t n4 = (n_rows + 3) / 4 * 4;
  thread_local std::vector<uint16_t> qb;
  thread_local std::vector<uint32_t> pp, vt;  // [pair][head], [channel / 64][pair][channel % 64]
  thread_local std::vector<float> sc, acc, state;
  qb.assign(size_t(HP) * d, 0);
  for (int h = 0; h < H; ++h) to_bf16_row(q + size_t(h) * d, d, qb.data() + size_t(h) * d);
  sc.resize(size_t(n4) * HV);
  for (int64_t j0 = 0; j0 < n4; j0 += 4) {
    const uint16_t* kr[4] = {krow(j0), krow(j0 + 1), krow(j0 + 2), krow(j0 + 3)};
    for (int h0 = 0; h0 < HP; h0 += 4)
      score_tile_pairs(qb.data() + size_t(h0) * d, d, kr, softmax_scale, sc.data() + size_t(j0) * HV + h0, HV);
    if (HP < HV)
      for (int64_t j = j0; j < j0 + 4; ++j) std::fill(sc.begin() + j * HV + HP, sc.begin() + (j + 1) * HV, 0.f);
  }
  acc.assign(size_t(HP) * d, 0.f);
  state.resize(size_t(3) * HV);
  float *rmax = state.data(), *denom = rmax + HV, *rescale = denom + HV;
  std::fill(rmax, rmax + HV, -1e30f);
  std::fill(denom, denom + HV, 0.f);
  pp.resize(size_t(kPairs) * HV);
  vt.resize(size_t((d + 63) / 64) * kPairs * 64);
  static const __m512i kLo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                               37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  static const __m512i kHi = _mm512_add_epi16(kLo, _mm512_set1_epi16(16));
  for (int64_t c0 = 0; c0 < n_rows; c0 += kChunk) {
    const int L = int(std::min<int64_t>(n_rows - c0, kChunk)), np = (L + 1) / 2;
    bool live = false;
    for (int l = 0; l < L && !live; ++l) live = kv_rows[c0 + l] != nullptr;
    if (!live) continue;  // probabilities 0, rescale exp(0) = 1: an exact no-op
    for (int g = 0; g < HV; g += 16) {
      const __m512 rm = _mm512_loadu_ps(rmax + g);
      __m512 cm = _mm512_set1_ps(-INFINITY);
      for (int l = 0; l < L; ++l)
        if (kv_rows[c0 + l]) cm = _mm512_max_ps(cm, _mm512_loadu_ps(sc.data() + size_t(c0 + l) * HV + g));
      const __m512 nm = _mm512_max_ps(rm, cm);
      const __m512 rs = expf_libm_ps(_mm512_sub_ps(rm, nm));
      __m512 psum = _mm512_setzero_ps();
      __m512i even = _mm512_setzero_si512();
      for (int l = 0; l < L; ++l) {
        const __m512 p = kv_rows[c0 + l] ? expf_libm_ps(_mm512_sub_ps(_mm512_loadu_ps(sc.data() + size_t(c0 + l) * HV + g), nm))
                                         : _mm512_setzero_ps();
        psum = _mm512_add_ps(psum, p);
        const __m512i b = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p));
        if (l & 1) _mm512_storeu_si512(pp.data() + size_t(l / 2) * HV + g, _mm512_or_si512(even, _mm512_slli_epi32(b, 16)));
        else even = b;
      }
      if (L & 1) _mm512_storeu_si512(pp.data() + size_t(L / 2) * HV + g, even);  // the pair's second: 0
      _mm512_storeu_ps(denom + g, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(denom + g), rs), psum));
      _mm512_storeu_ps(rmax + g, nm);
      _mm512_storeu_ps(rescale + g, rs);
    }
    for (int t = 0; t < np; ++t) {
      const uint16_t* a = krow(c0 + 2 * t);
      const uint16_t* b = krow(2 * t + 1 < L ? c0 + 2 * t + 1 : n_rows);
      for (int i = 0; i < d; i += 32) {
        const __m512i va = _mm512_loadu_si512(a + i), vb = _mm512_loadu_si512(b + i);
        uint32_t* o = vt.data() + size_t(i / 64) * kPairs * 64 + t * 64 + i % 64;
        _mm512_storeu_si512(o, _mm512_permutex2var_epi16(va, kLo, vb));
        _mm512_storeu_si512(o + 16, _mm512_permutex2var_epi16(va, kHi, vb));
      }
    }
    int c = 0;
    for (; c + 64 <= d; c += 64)
      for (int h0 = 0; h0 < HP; h0 += 4)
        pv_tile_pairs<4>(pp.data() + h0, HV, np, vt.data() + size_t(c / 64) * kPairs * 64, d, c, rescale + h0,
                         acc.data() + size_t(h0) * d);
    for (; c < d; c += 32)
      for (int h0 = 0; h0 < HP; h0 += 4)
        pv_tile_pairs<2>(pp.data() + h0, HV, np, vt.data() + size_t(c / 64) * kPairs * 64, d, c, rescale + h0,
                         acc.data() + size_t(h0) * d);
  }
  for (int h = 0; h < H; ++h) {
    const float dn = denom[h] + std::exp(attn_sink[h] - rmax[h]);
    const float* ah = acc.data() + size_t(h) * d;
    float* oh = out + size_t(h) * d;
    for (int i = 0; i < d; i += 16)
      _mm512_storeu_ps(oh + i, round_bf16_ps(_mm512_div_ps(_mm512_loadu_ps(ah + i), _mm512_set1_ps(dn))));
  }
}

void sparse_attention_fast(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                           const float* attn_sink, float softmax_scale, float* out) {
  // Rows n_rows .. n4 (tile padding) and null rows are zeros; row n_rows is the pairs' zero row.
  thread_local std::vector<uint16_t> kb;
  const int64_t n4 = (n_rows + 3) / 4 * 4;
  kb.resize(size_t(n4 + 1) * d);
  for (int64_t j = 0; j <= n4; ++j) {
    uint16_t* r = kb.data() + size_t(j) * d;
    if (j < n_rows && kv_rows[j]) to_bf16_row(kv_rows[j], d, r);
    else std::memset(r, 0, size_t(d) * 2);
  }
  attention_pairs(q, n_heads, d, [&](int64_t j) -> const uint16_t* { return kb.data() + size_t(j) * d; },
                  reinterpret_cast<const void* const*>(kv_rows), n_rows, attn_sink, softmax_scale, out);
}

void sparse_attention_fast_bf16(const float* q, int n_heads, int d, const uint16_t* const* kv_rows, int64_t n_rows,
                                const float* attn_sink, float softmax_scale, float* out) {
  thread_local std::vector<uint16_t> zero;
  zero.assign(size_t(d), 0);
  attention_pairs(
      q, n_heads, d,
      [&](int64_t j) -> const uint16_t* { return j < n_rows && kv_rows[j] ? kv_rows[j] : zero.data(); },
      reinterpret_cast<const void* const*>(kv_rows), n_rows, attn_sink, softmax_scale, out);
}

void expf_batch(const float* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 16) expf_libm(x + i, int(std::min<int64_t>(16, n - i)), out + i);
}

size_t packed_bytes_fp8(const ref::Fp8Weight& w) {
  return w.in % 32 ? 0 : size_t(n_panels(w.out) * (w.in / 32) * kFp8BlockBytes);
}
size_t packed_bytes_fp4(const ref::Fp4Weight& w) {
  return w.in % 32 ? 0 : size_t(n_panels(w.out) * (w.in / 32) * (kFp4BlockBytes + kPanel));  // codes + scales
}

// One panel's codes in the FP8 panel layout (see linear_fp8) at dst.
static void pack_fp8_panel(const ref::Fp8Weight& w, int64_t p, uint8_t* dst) {
  const int64_t K = w.in, nkb = K / 32;
  for (int64_t kb = 0; kb < nkb; ++kb)
    for (int j = 0; j < 16; ++j) {
      uint8_t* c = dst + (kb * 16 + j) * kFp8PairBytes;
      for (int col = 0; col < kPanel; ++col) {
        const int64_t n = p * kPanel + col;
        const int half = col / 16, L = (col % 16) / 4, q = col % 4;
        for (int e = 0; e < 2; ++e) c[16 * L + 8 * half + 2 * q + e] = n < w.out ? w.w[n * K + kb * 32 + 2 * j + e] : 0;
      }
    }
}

void pack_weight_fp8(const ref::Fp8Weight& w, uint8_t* dst, ThreadPool* pool) {
  const int64_t nkb = w.in / 32;
  run(pool, n_panels(w.out), 1, [&](int64_t p0, int64_t p1, int) {
    for (int64_t p = p0; p < p1; ++p) pack_fp8_panel(w, p, dst + p * nkb * kFp8BlockBytes);
  });
}

int64_t dequant_panel_bytes(const ref::Fp8Weight& w) { return (w.in / 32) * (kFp8BlockBytes + kPanel); }
size_t packed_bytes_fp8_dequant(const ref::Fp8Weight& w) {
  return w.in % 32 ? 0 : size_t(n_panels(w.out) * dequant_panel_bytes(w));
}
void pack_weight_fp8_dequant(const ref::Fp8Weight& w, uint8_t* dst, ThreadPool* pool) {
  const int64_t K = w.in, nkb = K / 32, panel_bytes = dequant_panel_bytes(w);
  run(pool, n_panels(w.out), 1, [&](int64_t p0, int64_t p1, int) {
    for (int64_t p = p0; p < p1; ++p) {
      uint8_t* d = dst + p * panel_bytes;
      pack_fp8_panel(w, p, d);
      uint8_t* mx = d + nkb * kFp8BlockBytes;  // [kb][column]: max |code| (E4M3 magnitudes order like their codes)
      for (int64_t kb = 0; kb < nkb; ++kb)
        for (int col = 0; col < kPanel; ++col) {
          const int64_t n = p * kPanel + col;
          uint8_t m = 0;
          for (int64_t k = 0; n < w.out && k < 32; ++k) m = std::max<uint8_t>(m, w.w[n * K + kb * 32 + k] & 0x7f);
          mx[kb * kPanel + col] = m;
        }
    }
  });
}

void pack_weight_fp4(const ref::Fp4Weight& w, uint8_t* dst, ThreadPool* pool) {
  const int64_t nkb = w.in / 32, row_bytes = w.in / 2;
  uint8_t* scales = dst + n_panels(w.out) * nkb * kFp4BlockBytes;
  run(pool, n_panels(w.out), 1, [&](int64_t p0, int64_t p1, int) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t kb = 0; kb < nkb; ++kb) {
        uint8_t* block = dst + (p * nkb + kb) * kFp4BlockBytes;
        std::memset(block, 0, size_t(kFp4BlockBytes));
        for (int col = 0; col < kPanel; ++col) {
          const int64_t n = p * kPanel + col;
          for (int j = 0; n < w.out && j < 16; ++j) {  // pair j: cvt_pair_fp4's order
            const uint8_t codes = w.w[n * row_bytes + kb * 16 + j];  // elements 2j (low nibble), 2j + 1
            for (int e = 0; e < 2; ++e)
              block[(j / 2) * 64 + 2 * (2 * (col % 16) + e) + (j % 2)] |= uint8_t(((codes >> (4 * e)) & 15) << (4 * (col / 16)));
          }
          scales[(p * nkb + kb) * kPanel + col] = n < w.out ? w.scale[n * nkb + kb] : 127;
        }
      }
  });
}

}  // namespace di::kern::avx512

#pragma GCC pop_options
