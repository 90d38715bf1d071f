// Number formats (src/core/dtypes): every code of every format, and every rounding checked against
// independent brute-force nearest-value searches written from the format definitions.
//
// Conventions checked here (documented in dtypes.h):
// - E4M3 (e4m3fn): S.1111.111 is NaN (0x7f, 0xff); there is no infinity. Encoding keeps the sign
//   of x even when the result is zero (-1e-9 -> 0x80) and of NaN (-NaN -> 0xff); +-inf and every
//   |x| >= 448 saturate to +-448 (0x7e / 0xfe), like the CUDA satfinite conversion.
// - E2M1: no NaN/inf codes; NaN and +-inf encode as +-6 (sign of x kept).
// - E8M0: code 255 is NaN; code 0 is 2^-127 (an fp32 subnormal).
// - pow2_ceil reads the fp32 exponent field, as the reference kernels' fast_round_scale does; for a
//   subnormal input that gives 2^-126 (never reached: callers clamp amax away from zero).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/dtypes.h"
#include "io/safetensors.h"

using namespace di;

namespace {

// ---- Independent reference values, straight from the format definitions ----

// E4M3: 1 sign, 4 exponent (bias 7), 3 mantissa; e = 0 is subnormal (m/8 * 2^-6).
double e4m3_def(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const double mag = e == 0 ? (m / 8.0) * std::pow(2.0, -6) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return (code & 0x80) ? -mag : mag;
}

// Nearest finite non-negative code to |x| among 0x00..0x7e; ties go to the even code (the one
// with an even mantissa: consecutive codes are consecutive values).
uint8_t e4m3_brute(float x) {
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (int c = 0; c <= 0x7e; ++c) v.push_back(e4m3_def(uint8_t(c)));
    return v;
  }();
  const double a = std::fabs(double(x));
  if (a >= 448) return std::signbit(x) ? 0xfe : 0x7e;  // nearest finite value (avoids double cancellation)
  uint8_t best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {
    const double d = std::fabs(values[size_t(c)] - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best_d = d;
      best = uint8_t(c);
    }
  }
  return uint8_t(best | (std::signbit(x) ? 0x80 : 0));
}

uint8_t e4m3_expected(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xff : 0x7f;
  if (std::isinf(x)) return x > 0 ? 0x7e : 0xfe;
  return e4m3_brute(x);
}

// bf16: all non-negative finite values in code order (monotonic), plus 2^128 standing for +inf,
// which IEEE rounding treats as the next value after the largest finite one.
const std::vector<double>& bf16_table() {
  static const std::vector<double> t = [] {
    std::vector<double> v;
    for (uint32_t c = 0; c <= 0x7f7f; ++c) {
      const int e = int(c >> 7), m = int(c & 0x7f);
      v.push_back(e == 0 ? std::ldexp(double(m), -133) : std::ldexp(double(128 + m), e - 134));
    }
    v.push_back(std::ldexp(1.0, 128));  // code 0x7f80
    return v;
  }();
  return t;
}

uint16_t bf16_expected(float x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isinf(x)) return uint16_t(sign | 0x7f80);
  const double a = std::fabs(double(x));
  const auto& t = bf16_table();
  const size_t hi = size_t(std::lower_bound(t.begin(), t.end(), a) - t.begin());
  if (hi < t.size() && t[hi] == a) return uint16_t(sign | hi);
  const size_t lo = hi - 1;  // a > 0 here, so hi >= 1; a < 2^128 so hi < t.size()
  const double dl = a - t[lo], dh = t[hi] - a;
  const size_t pick = dl < dh ? lo : dh < dl ? hi : ((lo & 1) == 0 ? lo : hi);
  return uint16_t(sign | pick);
}

// E2M1 magnitudes by code.
constexpr double kE2M1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};

uint8_t e2m1_expected(float x) {
  const uint8_t sign = std::signbit(x) ? 8 : 0;
  if (std::isnan(x) || std::isinf(x)) return uint8_t(sign | 7);
  const double a = std::fabs(double(x));
  if (a >= 6) return uint8_t(sign | 7);  // nearest value (avoids double cancellation)
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 8; ++c) {
    const double d = std::fabs(kE2M1[c] - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best_d = d;
      best = c;
    }
  }
  return uint8_t(sign | best);
}

// Smallest power of two >= t, found by doubling / halving in double (t normal, > 0).
float pow2_ceil_expected(float t) {
  double p = 1.0;
  while (p < t) p *= 2;
  while (p / 2 >= t) p /= 2;
  return float(p);
}

float random_float_bits(std::mt19937_64& rng) {
  return bits_f32(uint32_t(rng()));
}

void check_e4m3(float x) {
  const uint8_t got = f32_to_e4m3(x), want = e4m3_expected(x);
  ASSERT_EQ(int(got), int(want)) << "x = " << x << " (bits 0x" << std::hex << f32_bits(x) << ")";
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// E4M3

TEST(DtypesE4M3, AllCodesDecode) {
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3_to_f32(uint8_t(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(double(v), e4m3_def(uint8_t(c))) << c;
    EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << c;  // 0x80 is -0
  }
  // Spot values of the format.
  EXPECT_EQ(e4m3_to_f32(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(e4m3_to_f32(0x07), 7 * 0x1p-9f);
  EXPECT_EQ(e4m3_to_f32(0x08), 0x1p-6f);  // smallest normal
  EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(e4m3_to_f32(0x77), 240.0f);
  EXPECT_EQ(e4m3_to_f32(0x78), 256.0f);
}

TEST(DtypesE4M3, AllCodesReencodeToThemselves) {
  // Including -0 (0x80) and both NaNs: decoding keeps the sign, encoding keeps it too.
  for (int c = 0; c < 256; ++c) EXPECT_EQ(int(f32_to_e4m3(e4m3_to_f32(uint8_t(c)))), c) << c;
}

TEST(DtypesE4M3, EdgesMidpointsAndSaturation) {
  std::vector<float> xs = {0.f, -0.f, 448.f, -448.f, 449.f, 463.99f, 464.f, 465.f, 480.f, 1e6f, -1e30f,
                           FLT_MAX, -FLT_MAX, FLT_MIN, -FLT_MIN, FLT_TRUE_MIN, -FLT_TRUE_MIN, 0x1p-10f,
                           0x1p-11f, 3 * 0x1p-11f, 1e-9f, -1e-9f};
  // Every midpoint between consecutive finite codes, and the floats right around it.
  for (int c = 0; c < 0x7e; ++c) {
    const float mid = float((e4m3_def(uint8_t(c)) + e4m3_def(uint8_t(c + 1))) / 2);  // exact in fp32
    ASSERT_EQ(double(mid), (e4m3_def(uint8_t(c)) + e4m3_def(uint8_t(c + 1))) / 2);
    for (float m : {mid, -mid}) {
      xs.push_back(m);
      xs.push_back(std::nextafter(m, INFINITY));
      xs.push_back(std::nextafter(m, -INFINITY));
    }
    // The tie itself goes to the even code.
    EXPECT_EQ(f32_to_e4m3(mid), (c & 1) ? c + 1 : c) << "midpoint after code " << c;
    EXPECT_EQ(int(f32_to_e4m3(std::nextafter(mid, INFINITY))), c + 1);
    EXPECT_EQ(int(f32_to_e4m3(std::nextafter(mid, 0.f))), c);
  }
  // Every code value exactly, and its neighbouring floats.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    const float v = e4m3_to_f32(uint8_t(c));
    xs.push_back(v);
    xs.push_back(std::nextafter(v, INFINITY));
    xs.push_back(std::nextafter(v, -INFINITY));
  }
  for (float x : xs) check_e4m3(x);
  // Saturation, infinity and NaN conventions.
  EXPECT_EQ(f32_to_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(f32_to_e4m3(-INFINITY), 0xfe);
  EXPECT_EQ(f32_to_e4m3(1e30f), 0x7e);
  EXPECT_EQ(f32_to_e4m3(std::nanf("")), 0x7f);
  EXPECT_EQ(f32_to_e4m3(-std::nanf("")), 0xff);
  EXPECT_EQ(f32_to_e4m3(-1e-9f), 0x80);  // rounds to zero, keeps the sign
  EXPECT_EQ(round_e4m3(0.3f), 0.3125f);
}

TEST(DtypesE4M3, MillionsOfRandomFloatsMatchBruteForce) {
  std::mt19937_64 rng(20260917);
  std::uniform_real_distribution<float> wide(-600.f, 600.f), unit(-1.f, 1.f);
  std::uniform_int_distribution<int> expo(-14, 10);
  const int n = 1'500'000;
  for (int i = 0; i < n; ++i) {
    check_e4m3(random_float_bits(rng));  // all of fp32: NaNs, infinities, subnormals, huge
    check_e4m3(wide(rng));
    check_e4m3(std::ldexp(unit(rng), expo(rng)));  // every binade E4M3 covers, and below
  }
  // All fp32 values in [2^-12, 2^-5) (the subnormal range and the first normal binades), every
  // 7th bit pattern: dense coverage of the subnormal/normal transition.
  for (uint32_t b = f32_bits(0x1p-12f); b < f32_bits(0x1p-5f); b += 31) check_e4m3(bits_f32(b));
}

// ---------------------------------------------------------------------------------------------
// bf16

TEST(DtypesBF16, AllCodesDecodeAndReencode) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float v = bf16_to_f32(uint16_t(c));
    EXPECT_EQ(f32_bits(v), c << 16);
    const uint16_t back = f32_to_bf16(v);
    if (std::isnan(v)) {
      EXPECT_EQ(back, uint16_t(c | 0x40)) << c;  // NaNs come back quiet, sign and payload kept
    } else {
      ASSERT_EQ(back, c) << c;
    }
  }
}

TEST(DtypesBF16, RoundToNearestEvenMatchesBruteForce) {
  std::mt19937_64 rng(7);
  auto check = [](float x) {
    if (std::isnan(x)) {
      const uint16_t h = f32_to_bf16(x);
      ASSERT_TRUE(std::isnan(bf16_to_f32(h)));
      ASSERT_EQ(std::signbit(bf16_to_f32(h)), std::signbit(x));
      return;
    }
    ASSERT_EQ(f32_to_bf16(x), bf16_expected(x)) << x << " bits 0x" << std::hex << f32_bits(x);
  };
  // Every bf16 code as the high half, with the low halves that decide rounding: exact, just above,
  // just below the midpoint, the midpoint (tie), and the largest.
  for (uint32_t hi = 0; hi < 65536; ++hi)
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu})
      check(bits_f32((hi << 16) | lo));
  for (int i = 0; i < 2'000'000; ++i) check(random_float_bits(rng));
  EXPECT_EQ(f32_to_bf16(FLT_MAX), 0x7f80);  // rounds up to infinity
  EXPECT_EQ(round_bf16(1.00390625f), 1.0f);  // tie -> even
  EXPECT_EQ(round_bf16(1.01171875f), 1.015625f);  // tie -> even (up)
}

// ---------------------------------------------------------------------------------------------
// E2M1 (FP4)

TEST(DtypesE2M1, AllCodes) {
  for (int c = 0; c < 16; ++c) {
    const float v = e2m1_to_f32(uint8_t(c));
    EXPECT_EQ(double(std::fabs(v)), kE2M1[c & 7]) << c;
    EXPECT_EQ(std::signbit(v), (c & 8) != 0) << c;
    EXPECT_EQ(int(f32_to_e2m1(v)), c) << c;  // including -0 (code 8)
  }
}

TEST(DtypesE2M1, EveryMidpointTiesToEvenCode) {
  for (int c = 0; c < 7; ++c) {
    const float mid = float((kE2M1[c] + kE2M1[c + 1]) / 2);
    const int even = (c & 1) ? c + 1 : c;
    EXPECT_EQ(int(f32_to_e2m1(mid)), even) << mid;
    EXPECT_EQ(int(f32_to_e2m1(-mid)), 8 | even) << -mid;
    EXPECT_EQ(int(f32_to_e2m1(std::nextafter(mid, INFINITY))), c + 1) << mid;
    EXPECT_EQ(int(f32_to_e2m1(std::nextafter(mid, 0.f))), c) << mid;
    EXPECT_EQ(int(f32_to_e2m1(-std::nextafter(mid, INFINITY))), 8 | (c + 1)) << mid;
  }
  // The ties the reference kernels list: 0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0, the rest down.
  EXPECT_EQ(e2m1_to_f32(f32_to_e2m1(0.25f)), 0.f);
  EXPECT_EQ(e2m1_to_f32(f32_to_e2m1(0.75f)), 1.f);
  EXPECT_EQ(e2m1_to_f32(f32_to_e2m1(1.25f)), 1.f);
  EXPECT_EQ(e2m1_to_f32(f32_to_e2m1(1.75f)), 2.f);
  EXPECT_EQ(e2m1_to_f32(f32_to_e2m1(2.5f)), 2.f);
  EXPECT_EQ(e2m1_to_f32(f32_to_e2m1(3.5f)), 4.f);
  EXPECT_EQ(e2m1_to_f32(f32_to_e2m1(5.0f)), 4.f);
}

TEST(DtypesE2M1, RandomAndSpecialValuesMatchBruteForce) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> d(-8.f, 8.f);
  for (int i = 0; i < 1'000'000; ++i) {
    const float x = (i & 1) ? d(rng) : random_float_bits(rng);
    ASSERT_EQ(int(f32_to_e2m1(x)), int(e2m1_expected(x))) << x;
  }
  EXPECT_EQ(f32_to_e2m1(100.f), 7);
  EXPECT_EQ(f32_to_e2m1(-INFINITY), 15);
  EXPECT_EQ(f32_to_e2m1(std::nanf("")), 7);
  EXPECT_EQ(f32_to_e2m1(-0.1f), 8);
}

TEST(DtypesE2M1, PackedNibbleOrder) {
  const uint8_t packed[2] = {0xd9, 0x52};
  EXPECT_EQ(fp4_get(packed, 0), 0x9);  // even element: low nibble
  EXPECT_EQ(fp4_get(packed, 1), 0xd);
  EXPECT_EQ(fp4_get(packed, 2), 0x2);
  EXPECT_EQ(fp4_get(packed, 3), 0x5);
}

// ---------------------------------------------------------------------------------------------
// E8M0 and scale rules

TEST(DtypesE8M0, AllCodes) {
  for (int c = 0; c < 255; ++c) {
    const float v = e8m0_to_f32(uint8_t(c));
    EXPECT_EQ(double(v), std::ldexp(1.0, c - 127)) << c;
    EXPECT_EQ(int(pow2_to_e8m0(v)), c) << c;
  }
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
  EXPECT_EQ(e8m0_to_f32(0), 0x1p-127f);
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(254), 0x1p127f);
}

TEST(DtypesScale, Pow2Ceil) {
  // Exact powers stay; everything else goes to the next power, over every normal binade.
  std::mt19937_64 rng(3);
  for (int e = -126; e <= 126; ++e) {
    const float p = std::ldexp(1.0f, e);
    EXPECT_EQ(pow2_ceil(p), p) << e;
    EXPECT_EQ(pow2_ceil(std::nextafter(p, INFINITY)), 2 * p) << e;
    if (e > -126) {
      EXPECT_EQ(pow2_ceil(std::nextafter(p, 0.f)), p) << e;
    }
    for (int k = 0; k < 200; ++k) {
      const float t = bits_f32(f32_bits(p) | uint32_t(rng() & 0x7fffff));
      ASSERT_EQ(pow2_ceil(t), pow2_ceil_expected(t)) << t;
    }
  }
  // Subnormals: the exponent-field formula gives 2^-126 (see the file comment).
  EXPECT_EQ(pow2_ceil(FLT_TRUE_MIN), 0x1p-126f);
  EXPECT_EQ(pow2_ceil(0x1p-130f), 0x1p-126f);
}

namespace {
// act_quant by the definition: per block, s = smallest power of two >= fp32(max(amax, 1e-4) *
// fp32(1/448)); code = nearest e4m3 of x / s (ties to even).
void act_quant_expected(const std::vector<float>& x, int block, std::vector<uint8_t>* codes, std::vector<float>* scales) {
  codes->assign(x.size(), 0);
  scales->clear();
  const float inv = 1.0f / 448.0f;
  for (size_t b0 = 0; b0 < x.size(); b0 += size_t(block)) {
    const size_t b1 = std::min(x.size(), b0 + size_t(block));
    float amax = 1e-4f;
    for (size_t i = b0; i < b1; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float s = pow2_ceil_expected(amax * inv);
    scales->push_back(s);
    for (size_t i = b0; i < b1; ++i) (*codes)[i] = e4m3_expected(x[i] / s);
  }
}
}  // namespace

TEST(DtypesActQuant, GoldenSelfcheckExample) {
  // selfcheck.json act_quant_example: the 4 values padded with zeros to one block of 32.
  std::vector<float> x(32, 0.f);
  x[0] = -0.09033203125f;
  x[1] = 0.80859375f;
  x[2] = 1.2109375f;
  x[3] = -0.69140625f;
  std::vector<uint8_t> codes(32);
  float scale = 0;
  act_quant_fp8(x.data(), 32, codes.data(), &scale);
  EXPECT_EQ(scale, 0x1p-8f);
  const float want[4] = {-0.09375f, 0.8125f, 1.25f, -0.6875f};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(e4m3_to_f32(codes[size_t(i)]) * scale, want[i]) << i;
  for (int i = 4; i < 32; ++i) EXPECT_EQ(codes[size_t(i)], 0) << i;
  std::vector<float> y = x;
  act_qdq_fp8(y.data(), 32);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(y[size_t(i)], want[i]) << i;
}

TEST(DtypesActQuant, RandomBlocksMatchDefinition) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> len(1, 200), mag(-20, 12);
  for (int it = 0; it < 3000; ++it) {
    const int n = len(rng), block = (it % 3 == 0) ? 128 : 32;
    const float m = std::ldexp(1.0f, mag(rng));
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& v : x) v = round_bf16(nd(rng) * m);
    if (it % 7 == 0) std::fill(x.begin(), x.begin() + n / 2, 0.f);
    std::vector<uint8_t> codes(static_cast<size_t>(n)), want_codes;
    std::vector<float> scales(size_t((n + block - 1) / block)), want_scales;
    act_quant_fp8(x.data(), n, codes.data(), scales.data(), block);
    act_quant_expected(x, block, &want_codes, &want_scales);
    ASSERT_EQ(scales, want_scales) << "iteration " << it;
    ASSERT_EQ(codes, want_codes) << "iteration " << it;
    std::vector<float> y = x;
    act_qdq_fp8(y.data(), n, block);
    for (int i = 0; i < n; ++i) {
      const float want = e4m3_to_f32(want_codes[size_t(i)]) * want_scales[size_t(i / block)];
      ASSERT_EQ(y[size_t(i)], want) << "iteration " << it << " element " << i;
      ASSERT_EQ(round_bf16(want), want);  // the dequantized value is exact in bf16
    }
  }
}

TEST(DtypesActQuant, Fp4QdqMatchesDefinition) {
  std::mt19937_64 rng(9);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> mag(-12, 8);
  for (int it = 0; it < 2000; ++it) {
    const int n = 64 + (it % 5) * 16;
    const float m = std::ldexp(1.0f, mag(rng));
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& v : x) v = round_bf16(nd(rng) * m);
    if (it % 9 == 0) std::fill(x.begin(), x.end(), 0.f);
    // E8M0 scale per 32: s = smallest power of two >= max(amax, 6 * 2^-126) * fp32(1/6).
    std::vector<float> y = x;
    act_qdq_fp4_e8m0(y.data(), n);
    for (int b0 = 0; b0 < n; b0 += 32) {
      float amax = 0;
      for (int i = b0; i < std::min(n, b0 + 32); ++i) amax = std::max(amax, std::fabs(x[size_t(i)]));
      amax = std::max(amax, 6.f * 0x1p-126f);
      const float s = pow2_ceil_expected(amax * (1.0f / 6.0f));
      for (int i = b0; i < std::min(n, b0 + 32); ++i) {
        const float v = std::clamp(x[size_t(i)] / s, -6.f, 6.f);
        ASSERT_EQ(y[size_t(i)], e2m1_to_f32(e2m1_expected(v)) * s) << it << " " << i;
      }
    }
    // E4M3 scale per 16: s = e4m3(max(amax, 6 * 2^-9) / 6).
    y = x;
    act_qdq_fp4_e4m3(y.data(), n);
    for (int b0 = 0; b0 < n; b0 += 16) {
      float amax = 0;
      for (int i = b0; i < std::min(n, b0 + 16); ++i) amax = std::max(amax, std::fabs(x[size_t(i)]));
      amax = std::max(amax, 6.f * 0x1p-9f);
      const float s = float(e4m3_def(e4m3_expected(amax / 6.f)));
      for (int i = b0; i < std::min(n, b0 + 16); ++i) {
        const float v = std::clamp(x[size_t(i)] / s, -6.f, 6.f);
        ASSERT_EQ(y[size_t(i)], e2m1_to_f32(e2m1_expected(v)) * s) << it << " " << i;
      }
    }
  }
}

// Every bf16 magnitude up to 6 (and NaN, +-inf past the clamp) in a block whose scale is 1: all
// E2M1 midpoints and their neighbours, both signs, against the code-table definition.
TEST(DtypesActQuant, Fp4QdqEveryBf16InUnitBlock) {
  std::vector<float> vals;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float v = bits_f32(b << 16);
    if (std::isnan(v) || std::fabs(v) <= 6.f) vals.push_back(v);
  }
  for (float mid : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f})
    for (float v : {std::nextafter(mid, 0.f), mid, std::nextafter(mid, 8.f)}) vals.push_back(v), vals.push_back(-v);
  for (size_t at = 0; at < vals.size(); at += 31) {
    std::vector<float> y(32, 0.f);
    y[0] = 6.f;  // amax 6: the E8M0 scale is exactly 1 (NaN does not raise amax)
    const size_t n = std::min<size_t>(31, vals.size() - at);
    std::copy(vals.begin() + long(at), vals.begin() + long(at + n), y.begin() + 1);
    const std::vector<float> x = y;
    act_qdq_fp4_e8m0(y.data(), 32);
    for (size_t i = 0; i < 32; ++i) {
      const float want = e2m1_to_f32(e2m1_expected(std::clamp(x[i], -6.f, 6.f)));
      ASSERT_EQ(f32_bits(y[i]), f32_bits(want)) << "x = " << x[i];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Golden checkpoint bytes (selfcheck.json examples), read through the loader.

namespace {
const std::string kGolden = std::string(DI_SOURCE_DIR) + "/tests/data/golden/v41-tiny/model";
}

TEST(DtypesGolden, Fp4ExpertDequant) {
  Checkpoint ck = Checkpoint::open(kGolden);
  const TensorView& w = ck.expect("layers.0.ffn.experts.0.w1.weight", DType::I8, {32, 32});
  const TensorView& s = ck.expect("layers.0.ffn.experts.0.w1.scale", DType::F8_E8M0, {32, 2});
  const uint8_t* wb = w.as<uint8_t>();
  const uint8_t want_bytes[4] = {0xd9, 0x52, 0x32, 0x92};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(wb[i], want_bytes[i]) << i;
  EXPECT_EQ(s.as<uint8_t>()[0], 125);
  const float want[8] = {-0.125f, -0.75f, 0.25f, 0.75f, 0.25f, 0.375f, 0.25f, -0.125f};
  const float scale = e8m0_to_f32(s.as<uint8_t>()[0]);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(e2m1_to_f32(fp4_get(wb, i)) * scale, want[i]) << i;
}

// selfcheck.json fp4_requant_idempotent: every FP4 expert block re-quantized with its own scale
// gives back its codes, and the scale is consistent with the generator's rule: at least
// pow2_ceil(amax * fp32(1/6)) of the dequantized block (rounding can only shrink amax) and at most
// 2x that (the original amax/scale is in (3, 6], and rounding never takes it below 3).
TEST(DtypesGolden, Fp4RequantIdempotent) {
  Checkpoint ck = Checkpoint::open(kGolden);
  int64_t blocks = 0;
  for (const auto& [name, w] : ck.tensors()) {
    if (name.find(".experts.") == std::string::npos || name.size() < 7 || name.substr(name.size() - 7) != ".weight")
      continue;
    const TensorView& s = ck.get(name.substr(0, name.size() - 7) + ".scale");
    const int64_t rows = w.dim(0), k = w.dim(1) * 2;
    ASSERT_EQ(s.dim(1), k / 32);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < k / 32; ++b, ++blocks) {
        const float sc = e8m0_to_f32(s.as<uint8_t>()[r * (k / 32) + b]);
        float amax = 0;
        for (int i = 0; i < 32; ++i) {
          const uint8_t code = fp4_get(w.as<uint8_t>(), r * k + b * 32 + i);
          const float v = e2m1_to_f32(code) * sc;
          amax = std::max(amax, std::fabs(v));
          ASSERT_EQ(f32_to_e2m1(v / sc), code) << name << " row " << r;
        }
        const float rule = pow2_ceil(std::max(amax, 6.f * 0x1p-126f) * (1.0f / 6.0f));
        ASSERT_GE(sc, rule) << name << " row " << r << " block " << b;
        ASSERT_LE(sc, 2 * rule) << name << " row " << r << " block " << b;
      }
  }
  EXPECT_EQ(blocks, (8 * 8 + 3 * 6) * (32 * 2 + 64 * 1 + 32 * 2));  // (layer, expert) x blocks of w1, w2, w3
}

TEST(DtypesGolden, Fp8WeightDequant) {
  Checkpoint ck = Checkpoint::open(kGolden);
  const TensorView& w = ck.expect("layers.0.attn.wq_a.weight", DType::F8_E4M3, {32, 64});
  const TensorView& s = ck.expect("layers.0.attn.wq_a.scale", DType::F8_E8M0, {1, 2});
  const uint8_t want_codes[4] = {71, 233, 214, 235};
  const float want[4] = {0.00732421875f, -0.140625f, -0.02734375f, -0.171875f};
  EXPECT_EQ(s.as<uint8_t>()[0], 118);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(w.as<uint8_t>()[i], want_codes[i]) << i;
    EXPECT_EQ(e4m3_to_f32(w.as<uint8_t>()[i]) * e8m0_to_f32(s.as<uint8_t>()[0]), want[i]) << i;
  }
  // absmax of the dequantized tensor (weight x scale[row/32, col/32]).
  float absmax = 0;
  for (int r = 0; r < 32; ++r)
    for (int c = 0; c < 64; ++c) {
      const float v = e4m3_to_f32(w.as<uint8_t>()[r * 64 + c]) * e8m0_to_f32(s.as<uint8_t>()[(r / 32) * 2 + c / 32]);
      absmax = std::max(absmax, std::fabs(v));
    }
  EXPECT_EQ(absmax, 0.4375f);
}
