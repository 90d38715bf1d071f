#include "core/dtypes.h"

#include <algorithm>
#include <array>
#include <limits>

namespace di {

namespace {
// One E4M3 code's value, for the compile-time table below: decoding sits in per-token loops
// (Engram rows, activation QDQ), where ldexp per element showed in profiles.
constexpr float e4m3_decode(uint8_t code) {
  const int e = (code >> 3) & 0xf, m = code & 7;
  const bool neg = code & 0x80;
  if (e == 15 && m == 7) return neg ? -std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::quiet_NaN();
  float v = e == 0 ? float(m) / 512.f : float(8 + m);  // subnormal: m x 2^-9; normal: (8 + m) x 2^(e-10)
  for (int i = 0; e != 0 && i < 10 - e; ++i) v /= 2.f;     // exact: powers of two
  for (int i = 0; e != 0 && i < e - 10; ++i) v *= 2.f;
  return neg ? -v : v;
}
// Round to nearest even through the fp32 adder: exact for 0 <= v < 2^22, and what nearbyint gives
// in the engine's rounding mode (never changed from to-nearest-even), without a libm call.
inline float round_even_small(float v) { return (v + 0x1p23f) - 0x1p23f; }
}  // namespace

// All 256 values, constant-initialized (no static-initialization order to worry about).
constinit const std::array<float, 256> detail::kE4m3Values = [] {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) t[size_t(c)] = e4m3_decode(uint8_t(c));
  return t;
}();

uint8_t f32_to_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return uint8_t(sign | 0x7f);
  float a = std::fabs(x);
  if (a >= 448.f) return uint8_t(sign | 0x7e);
  if (a < 0.015625f) {  // below the smallest normal 2^-6: fixed quantum 2^-9
    const int q = int(round_even_small(a * 0x1p9f));  // 0..8, 8 = smallest normal (the product is exact)
    return uint8_t(sign | q);
  }
  const int ub = int((f32_bits(a) >> 23) & 0xff) - 127;  // a is normal here: its unbiased exponent
  int q = int(round_even_small(a * bits_f32(uint32_t(3 - ub + 127) << 23)));  // a x 2^(3-ub), exact: 8..16
  int be = ub + 7;
  if (q == 16) { q = 8; ++be; }
  uint8_t code = uint8_t((be << 3) | (q - 8));
  if ((code & 0x7f) > 0x7e) code = 0x7e;  // 464 <= a < 448 cannot happen; kept for safety
  return uint8_t(sign | code);
}

uint8_t f32_to_e2m1(float x) {
  static constexpr float mids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f};
  static constexpr bool tie_up[7] = {false, true, false, true, false, true, false};
  const uint8_t sign = std::signbit(x) ? 8 : 0;
  const float a = std::fabs(x);
  if (std::isnan(a)) return uint8_t(sign | 7);
  uint8_t code = 0;
  for (int i = 0; i < 7; ++i) code += uint8_t(a > mids[i] || (a == mids[i] && tie_up[i]));
  return uint8_t(sign | code);
}

float pow2_ceil(float t) {
  const uint32_t b = f32_bits(t);
  const int exp = int((b >> 23) & 0xff);
  const int ceil_log2 = exp - 127 + ((b & 0x7fffff) != 0);
  return bits_f32(uint32_t(ceil_log2 + 127) << 23);
}

namespace {
constexpr float kFp8MaxInv = 1.0f / 448.0f;
constexpr float kFp4MaxInv = 1.0f / 6.0f;
}  // namespace

void act_quant_fp8(const float* x, int64_t n, uint8_t* codes, float* scales, int block) {
  for (int64_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
    const int64_t b1 = std::min<int64_t>(n, b0 + block);
    float amax = 1e-4f;
    for (int64_t i = b0; i < b1; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float s = pow2_ceil(amax * kFp8MaxInv);
    scales[bi] = s;
    for (int64_t i = b0; i < b1; ++i) codes[i] = f32_to_e4m3(std::clamp(x[i] / s, -448.f, 448.f));
  }
}

void act_qdq_fp8(float* x, int64_t n, int block) {
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t b1 = std::min<int64_t>(n, b0 + block);
    float amax = 1e-4f;
    for (int64_t i = b0; i < b1; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float s = pow2_ceil(amax * kFp8MaxInv);
    for (int64_t i = b0; i < b1; ++i) x[i] = e4m3_to_f32(f32_to_e4m3(std::clamp(x[i] / s, -448.f, 448.f))) * s;
  }
}

// e2m1_to_f32(f32_to_e2m1(clamp(v, -6, 6))) for a = |v|, as selects the compiler vectorizes
// (the code loop ran serially on every decode step's index queries and compressed keys).
// Thresholds and ties as f32_to_e2m1: ties go to the even code; NaN saturates to 6.
static inline float e2m1_round_magnitude(float a) {
  float r = a > 0.25f ? 0.5f : 0.f;
  r = a >= 0.75f ? 1.f : r;
  r = a > 1.25f ? 1.5f : r;
  r = a >= 1.75f ? 2.f : r;
  r = a > 2.5f ? 3.f : r;
  r = a >= 3.5f ? 4.f : r;
  r = a > 5.f ? 6.f : r;
  return a != a ? 6.f : r;
}

static void fp4_qdq_block(float* x, int64_t b0, int64_t b1, float s) {
  for (int64_t i = b0; i < b1; ++i) {
    const float v = x[i] / s;
    x[i] = std::copysign(e2m1_round_magnitude(std::fabs(v)), v) * s;
  }
}

void act_qdq_fp4_e8m0(float* x, int64_t n, int block) {
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t b1 = std::min<int64_t>(n, b0 + block);
    float amax = 0.f;
    for (int64_t i = b0; i < b1; ++i) amax = std::max(amax, std::fabs(x[i]));
    amax = std::max(amax, 6.f * 0x1p-126f);
    fp4_qdq_block(x, b0, b1, pow2_ceil(amax * kFp4MaxInv));
  }
}

void act_qdq_fp4_e4m3(float* x, int64_t n, int block) {
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t b1 = std::min<int64_t>(n, b0 + block);
    float amax = 0.f;
    for (int64_t i = b0; i < b1; ++i) amax = std::max(amax, std::fabs(x[i]));
    amax = std::max(amax, 6.f * 0x1p-9f);
    fp4_qdq_block(x, b0, b1, round_e4m3(amax / 6.f));
  }
}

}  // namespace di
