// Number formats of the V4.1 release and exact conversions between them.
//
// Every conversion here is exact or rounds exactly once (round-to-nearest-even), because the
// reference's numerics are reproduced bit for bit: FP8 E4M3 and FP4 E2M1 values are exactly
// representable in bf16 and fp32, E8M0 scales are powers of two.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace di {

inline uint32_t f32_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float bits_f32(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

// ---- bf16: the top 16 bits of an fp32 ----
inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }
inline uint16_t f32_to_bf16(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN, keep sign
  u += 0x7fffu + ((u >> 16) & 1u);                                           // round to nearest even
  return uint16_t(u >> 16);
}
inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// ---- FP8 E4M3 (e4m3fn): bias 7, no infinity, S.1111.111 = NaN, max 448 ----
namespace detail {
extern const std::array<float, 256> kE4m3Values;  // every code's value (NaN for S.1111.111)
}
inline float e4m3_to_f32(uint8_t code) { return detail::kE4m3Values[code]; }
// Round to nearest even, saturating at +-448; NaN -> 0x7f (sign kept).
uint8_t f32_to_e4m3(float x);
inline float round_e4m3(float x) { return e4m3_to_f32(f32_to_e4m3(x)); }

// ---- E8M0 (ue8m0): 2^(code-127), 255 = NaN ----
// Built from the exponent field (ldexp per element showed in per-token loops); code 0 is the
// subnormal 2^-127.
inline float e8m0_to_f32(uint8_t code) {
  if (code == 255) return std::nanf("");
  return code ? bits_f32(uint32_t(code) << 23) : bits_f32(0x00400000u);
}
// Code of a power of two (exact; the caller guarantees x = 2^k, -127 <= k <= 127).
inline uint8_t pow2_to_e8m0(float x) { int e; std::frexp(x, &e); return uint8_t(e - 1 + 127); }

// ---- FP4 E2M1: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 = sign ----
inline constexpr float kE2M1Values[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
inline float e2m1_to_f32(uint8_t code) {
  float v = kE2M1Values[code & 7];
  return (code & 8) ? -v : v;
}
// Nearest value, ties to the even code, saturating at +-6. Sign bit taken from x (so -0.1 -> 0x8).
uint8_t f32_to_e2m1(float x);
// Packed storage: two codes per byte, even element in the low nibble.
inline uint8_t fp4_get(const uint8_t* packed, int64_t i) {
  uint8_t b = packed[i >> 1];
  return (i & 1) ? uint8_t(b >> 4) : uint8_t(b & 0xf);
}

// ---- Scale rules of the reference kernels ----
// 2^ceil(log2(t)) for t > 0, read off the fp32 exponent (+1 when the mantissa is non-zero).
float pow2_ceil(float t);

// act_quant: per block of 32 along K, amax = max(|x|, 1e-4), scale = pow2_ceil(amax * fp32(1/448)),
// q = e4m3(clamp(x / scale, +-448)). Writes codes and per-block scales; n need not be a multiple
// of 32 (the last block is short).
void act_quant_fp8(const float* x, int64_t n, uint8_t* codes, float* scales, int block = 32);
// Quantize-dequantize in place (values become e4m3 * scale; exact in bf16).
void act_qdq_fp8(float* x, int64_t n, int block = 32);

// FP4 QDQ with an E8M0 scale (indexer q/k): per 32, amax >= 6*2^-126, scale = pow2_ceil(amax * fp32(1/6)).
void act_qdq_fp4_e8m0(float* x, int64_t n, int block = 32);
// FP4 QDQ with an E4M3 scale (compressed KV): per 16, amax >= 6*2^-9, scale = e4m3(amax / 6).
void act_qdq_fp4_e4m3(float* x, int64_t n, int block = 16);

}  // namespace di
