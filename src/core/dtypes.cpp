#include "core/dtypes.h"

#include <algorithm>

namespace di {

float e4m3_to_f32(uint8_t code) {
  const int e = (code >> 3) & 0xf, m = code & 7;
  const bool neg = code & 0x80;
  if (e == 15 && m == 7) return neg ? -std::nanf("") : std::nanf("");  // sign kept, as f32_to_e4m3 keeps it
  float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
  return neg ? -v : v;
}

uint8_t f32_to_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return uint8_t(sign | 0x7f);
  float a = std::fabs(x);
  if (a >= 448.f) return uint8_t(sign | 0x7e);
  // nearbyint uses the current rounding mode; the engine never changes it from to-nearest-even.
  if (a < 0.015625f) {  // below the smallest normal 2^-6: fixed quantum 2^-9
    int q = int(std::nearbyint(std::ldexp(a, 9)));  // 0..8, 8 = smallest normal
    return uint8_t(sign | q);
  }
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): unbiased exponent is e-1
  const int ub = e - 1;
  int q = int(std::nearbyint(std::ldexp(a, 3 - ub)));  // 8..16
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

static void fp4_qdq_block(float* x, int64_t b0, int64_t b1, float s) {
  for (int64_t i = b0; i < b1; ++i) x[i] = e2m1_to_f32(f32_to_e2m1(std::clamp(x[i] / s, -6.f, 6.f))) * s;
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
