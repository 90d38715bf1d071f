// The V3 projections: FP8 E4M3 weights with one fp32 scale per 128x128 block (partial edge
// blocks), dequantized tile by tile inside the kernel, in the three numerics modes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtypes.h"
#include "core/thread_pool.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/ref_ops.h"
#include "kernel_test_util.h"
#include "model/v3/ops.h"

using namespace di;
using namespace di::v3;
using di::test::IsaGuard;
using di::test::isas;

namespace {

struct Fp8 {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  Linear lin;
};

// A random [out, in] weight quantized like the release: per block absmax / 448.
Fp8 make_fp8(int64_t out, int64_t in, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> w(size_t(out * in));
  for (auto& x : w) x = nd(g) * 0.1f;
  Fp8 f;
  const int64_t so = (out + 127) / 128, si = (in + 127) / 128;
  f.scales.resize(size_t(so * si));
  f.codes.resize(w.size());
  for (int64_t bo = 0; bo < so; ++bo)
    for (int64_t bi = 0; bi < si; ++bi) {
      float amax = 0;
      for (int64_t r = bo * 128; r < std::min(out, bo * 128 + 128); ++r)
        for (int64_t k = bi * 128; k < std::min(in, bi * 128 + 128); ++k) amax = std::max(amax, std::fabs(w[size_t(r * in + k)]));
      const float s = amax / 448.0f * (1.0f + 0.37f * float(bo + 2 * bi));  // distinct per block
      f.scales[size_t(bo * si + bi)] = s;
      for (int64_t r = bo * 128; r < std::min(out, bo * 128 + 128); ++r)
        for (int64_t k = bi * 128; k < std::min(in, bi * 128 + 128); ++k)
          f.codes[size_t(r * in + k)] = f32_to_e4m3(w[size_t(r * in + k)] / s);
    }
  f.lin.fp8 = f.codes.data();
  f.lin.scale = f.scales.data();
  f.lin.out = out, f.lin.in = in;
  return f;
}

std::vector<float> bf16_acts(int64_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = round_bf16(nd(g));
  return x;
}

float weight(const Fp8& f, int64_t r, int64_t k, bool round) {
  const float v = e4m3_to_f32(f.codes[size_t(r * f.lin.in + k)]) * f.scales[size_t((r / 128) * f.lin.scale_cols() + k / 128)];
  return round ? round_bf16(v) : v;
}

}  // namespace

TEST(V3Ops, DequantUsesEachBlocksScaleIncludingEdges) {
  const Fp8 f = make_fp8(200, 300, 1);  // 2 x 3 blocks, partial at the right and bottom edges
  std::vector<float> rows(size_t(3 * 300));
  dequant_rows(f.lin, 127, 3, false, rows.data());  // rows 127 (block 0), 128, 129 (block 1)
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t k = 0; k < 300; ++k) ASSERT_EQ(rows[size_t(r * 300 + k)], weight(f, 127 + r, k, false)) << r << "," << k;
  dequant_rows(f.lin, 199, 1, true, rows.data());
  for (int64_t k = 0; k < 300; ++k) ASSERT_EQ(rows[size_t(k)], weight(f, 199, k, true));
}

// Every mode, both the decode path (m <= 8, straight from the codes) and the tiled one (m > 8), on
// every ISA; in = 300 leaves a partial 32-wide chunk and partial 128 blocks.
class V3LinearDefinition : public ::testing::TestWithParam<int> {};

TEST_P(V3LinearDefinition, LinearModesMatchTheirDefinitions) {
  IsaGuard guard;
  const int64_t out = 200, in = 300, m = GetParam();
  const Fp8 f = make_fp8(out, in, 2);
  const auto x = bf16_acts(m * in, 3);
  for (kern::Isa isa : isas()) {
    kern::set_isa(isa);
    for (Mode mode : {Mode::Fast, Mode::Exact, Mode::Fp32}) {
      std::vector<float> y(size_t(m * out));
      linear(mode, x.data(), m, f.lin, y.data());
      const bool round = mode != Mode::Fp32;
      std::vector<float> wr(static_cast<size_t>(in));
      std::vector<uint16_t> wb(static_cast<size_t>(in));
      for (int64_t i = 0; i < m; ++i)
        for (int64_t n = 0; n < out; ++n) {
          for (int64_t k = 0; k < in; ++k) wr[size_t(k)] = weight(f, n, k, round), wb[size_t(k)] = f32_to_bf16(wr[size_t(k)]);
          float want;
          if (mode == Mode::Fast) {
            want = round_bf16(ref::fast::dot_pair_lanes(x.data() + i * in, wb.data(), in));
          } else {
            double acc = 0;
            for (int64_t k = 0; k < in; ++k) acc += double(x[size_t(i * in + k)]) * wr[size_t(k)];
            want = round ? round_bf16(float(acc)) : float(acc);
          }
          ASSERT_EQ(y[size_t(i * out + n)], want) << kern::isa_name(isa) << " " << mode_name(mode) << " row " << i << " out " << n;
        }
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Rows, V3LinearDefinition, ::testing::Values(1, 3, 8, 11));

TEST(V3Ops, Fp32ModeKeepsFullPrecisionWeights) {
  const Fp8 f = make_fp8(40, 64, 4);
  const auto x = bf16_acts(64, 5);
  std::vector<float> a(40), b(40);
  linear(Mode::Fp32, x.data(), 1, f.lin, a.data());
  linear(Mode::Exact, x.data(), 1, f.lin, b.data());
  int differ = 0;
  for (int n = 0; n < 40; ++n) differ += a[size_t(n)] != b[size_t(n)];
  EXPECT_GT(differ, 20) << "fp32 outputs are neither bf16-rounded nor from bf16-rounded weights";
}

TEST(V3Ops, LinearIsBatchAndThreadInvariant) {
  const int64_t out = 300, in = 256, m = 11;  // all rows: the tiled path; one row: the decode path
  const Fp8 f = make_fp8(out, in, 6);
  const auto x = bf16_acts(m * in, 7);
  ThreadPool pool(3);
  for (Mode mode : {Mode::Fast, Mode::Exact, Mode::Fp32}) {
    std::vector<float> all(size_t(m * out)), threaded(size_t(m * out)), one(static_cast<size_t>(out));
    linear(mode, x.data(), m, f.lin, all.data(), nullptr);
    linear(mode, x.data(), m, f.lin, threaded.data(), &pool);
    EXPECT_EQ(std::memcmp(all.data(), threaded.data(), all.size() * 4), 0) << mode_name(mode);
    for (int64_t i = 0; i < m; ++i) {
      linear(mode, x.data() + i * in, 1, f.lin, one.data(), nullptr);
      EXPECT_EQ(std::memcmp(one.data(), all.data() + i * out, size_t(out) * 4), 0) << mode_name(mode) << " row " << i;
    }
  }
}

TEST(V3Ops, Bf16WeightsAndRopeAndNorm) {
  const int64_t out = 50, in = 64;
  std::vector<uint16_t> w(size_t(out * in));
  std::mt19937 g(8);
  std::normal_distribution<float> nd(0, 0.2f);
  for (auto& v : w) v = f32_to_bf16(nd(g));
  Linear l;
  l.bf16 = w.data();
  l.out = out, l.in = in;
  const auto x = bf16_acts(in, 9);
  std::vector<float> y(static_cast<size_t>(out)), y32(static_cast<size_t>(out));
  linear(Mode::Exact, x.data(), 1, l, y.data());
  linear(Mode::Fp32, x.data(), 1, l, y32.data());
  for (int64_t n = 0; n < out; ++n) {
    double acc = 0;
    for (int64_t k = 0; k < in; ++k) acc += double(x[size_t(k)]) * bf16_to_f32(w[size_t(n * in + k)]);
    EXPECT_EQ(y[size_t(n)], round_bf16(float(acc)));
    EXPECT_EQ(y32[size_t(n)], float(acc));
  }
  // RoPE rotates interleaved pairs.
  float v[4] = {1.0f, 2.0f, 3.0f, -1.0f};
  const float cs[4] = {0.5f, 0.25f, 0.0f, 1.0f};
  rope(v, 4, cs, false);
  EXPECT_FLOAT_EQ(v[0], 1 * 0.5f - 2 * 0.25f);
  EXPECT_FLOAT_EQ(v[1], 1 * 0.25f + 2 * 0.5f);
  EXPECT_FLOAT_EQ(v[2], 1.0f);  // (3, -1) rotated by 90 degrees
  EXPECT_FLOAT_EQ(v[3], 3.0f);
  // RMSNorm: fp32 mode keeps the unrounded value.
  std::vector<uint16_t> nw(8, f32_to_bf16(1.5f));
  const float xs[8] = {1, 2, 3, 4, 5, 6, 7, 8.5f};
  float a[8], b[8];
  rms_norm(Mode::Fp32, xs, nw.data(), 8, 1e-6f, a);
  rms_norm(Mode::Exact, xs, nw.data(), 8, 1e-6f, b);
  double ss = 0;
  for (float q : xs) ss += q * q;
  for (int i = 0; i < 8; ++i) {
    EXPECT_NEAR(a[i], 1.5 * xs[i] / std::sqrt(ss / 8 + 1e-6), 1e-6);
    EXPECT_EQ(b[i], round_bf16(a[i]));
  }
}

// The vectorized dequantization gives the scalar definition's bits (edge blocks, both roundings,
// subnormal and saturated codes included).
TEST(V3Ops, DequantIsaPathsAgree) {
  Fp8 f = make_fp8(130, 300, 10);
  for (size_t i = 0; i < f.codes.size(); i += 7) f.codes[i] = uint8_t(i / 7 % 256 == 0x7f ? 0 : i / 7 % 256 == 0xff ? 0x80 : i / 7 % 256);
  std::vector<float> a(size_t(130 * 300)), b(a.size());
  IsaGuard guard;
  for (bool round : {true, false}) {
    dequant_rows_scalar(f.lin, 0, 130, round, a.data());
    for (kern::Isa isa : isas()) {
      kern::set_isa(isa);
      dequant_rows(f.lin, 0, 130, round, b.data());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << kern::isa_name(isa) << " round " << round;
    }
  }
}

// The fast mode's dot product: every ISA gives ref::fast::dot_fma_lanes's bits, for any length.
TEST(V3Ops, DotIsaPathsAgree) {
  const auto a = bf16_acts(200, 12), b = bf16_acts(200, 13);
  IsaGuard guard;
  for (int64_t n : {1, 15, 16, 17, 31, 48, 200})
    for (kern::Isa isa : isas()) {
      kern::set_isa(isa);
      const float want = ref::fast::dot_fma_lanes(a.data(), b.data(), n), got = dot(Mode::Fast, a.data(), b.data(), n);
      EXPECT_EQ(std::memcmp(&want, &got, 4), 0) << kern::isa_name(isa) << " n " << n;
    }
}
