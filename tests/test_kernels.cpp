// Op-by-op tests of the optimized kernels against the scalar reference (in the spirit of
// llama.cpp's test-backend-ops): every kernel, every ISA this CPU supports, random shapes with
// ragged edges, realistic and extreme values, and thread-count / batching invariance.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <random>
#include <vector>

#include "core/dtypes.h"
#include "core/thread_pool.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/kernels_internal.h"
#include "kernel_test_util.h"

using namespace di;
using di::test::IsaGuard;
using di::test::isas;

namespace {

// Activations: per 32-block a random magnitude (so block scales vary), some zero blocks, some
// blocks below the 1e-4 amax floor, bf16-valued like the model's.
std::vector<float> make_activations(std::mt19937& g, int64_t n, bool extreme) {
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> e(extreme ? -30 : -6, extreme ? 30 : 6);
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; b += 32) {
    const int kind = int(g() % 16);
    const float mag = std::ldexp(1.f, e(g));
    for (int64_t i = b; i < std::min(n, b + 32); ++i) {
      float v = nd(g) * mag;
      if (kind == 0) v = 0.f;                       // all-zero block
      if (kind == 1) v *= 1e-7f;                    // below the amax floor: tiny subnormal E4M3 codes
      if (kind == 2 && i == b) v = 1e4f * mag;      // one outlier: the rest quantize to tiny codes
      // Wide dynamic range inside the block (log-uniform over 2^-16..1): the block's fp32 partial
      // sums round, so any change of the summation order shows up (AVX2 vs AVX-512 check).
      if (extreme && kind >= 3 && kind < 10) v = std::ldexp(v > 0 ? 1.f : -1.f, -int(g() % 25)) * mag * (1 + float(g() % 8) / 8);
      // Spikes next to the smallest E4M3 codes: partial sums above 2^14 drop 2^-10 products.
      if (extreme && kind >= 10 && kind < 13) v = (i % 2 ? 0x1p-17f : 1.f) * mag * (v > 0 ? 1.f : -1.f);
      x[size_t(i)] = round_bf16(v);
    }
  }
  return x;
}

uint8_t random_e4m3(std::mt19937& g, bool extreme) {
  for (;;) {
    uint8_t c = uint8_t(g());
    if ((c & 0x7f) == 0x7f) continue;  // NaN codes do not occur in checkpoints
    if (extreme) {
      const int k = int(g() % 8);
      if (k == 0) c = uint8_t((c & 0x80) | (g() % 8));  // zero / subnormal
      if (k == 1) c = uint8_t((c & 0x80) | 0x7e);       // +-448
    }
    return c;
  }
}

uint8_t random_scale(std::mt19937& g, bool extreme) {
  if (!extreme) return uint8_t(118 + g() % 12);
  const int k = int(g() % 4);
  if (k == 0) return uint8_t(g() % 8);          // 2^-127 .. 2^-120 (fp32 denormal scales)
  if (k == 1) return uint8_t(240 + g() % 15);   // up to 2^127
  return uint8_t(100 + g() % 50);
}

// The reference's value before its final bf16 rounding (same arithmetic as ref::linear_fp8/fp4),
// and a bound on how far an fp32 block-sum kernel's total may lie from it: each 32-wide block
// summed in fp32 (at most 32 roundings, each within 2^-24 of a partial sum bounded by the block's
// magnitude sum S) instead of exactly, plus the reference's own rounding of the block sum, plus
// one rounding on each side for every block's add to the running total (bounded by sum S).
struct BlockAcc {
  float acc;
  float tol;
};
BlockAcc ref_block_acc(const float* x, int64_t K, const std::function<float(int64_t)>& wval,
                       const std::function<float(int64_t)>& wscale) {
  const int64_t nkb = (K + 31) / 32;
  std::vector<uint8_t> codes(static_cast<size_t>(K));
  std::vector<float> s(static_cast<size_t>(nkb));
  act_quant_fp8(x, K, codes.data(), s.data(), 32);
  float acc = 0.f;
  double magnitude = 0;  // sum over blocks of S x scales
  for (int64_t kb = 0; kb < nkb; ++kb) {
    double part = 0, abs_part = 0;
    for (int64_t k = kb * 32; k < std::min(K, kb * 32 + 32); ++k) {
      const double p = double(e4m3_to_f32(codes[size_t(k)])) * wval(k);
      part += p;
      abs_part += std::fabs(p);
    }
    acc += float(part) * s[size_t(kb)] * wscale(kb);
    magnitude += abs_part * double(s[size_t(kb)]) * double(wscale(kb));
  }
  const float tol = float((0x1p-19 + 0x1p-24 + double(nkb) * 0x1p-23) * magnitude * 1.01);
  return {acc, std::isfinite(tol) ? tol : 0.f};  // beyond fp32's range: only the strict check
}

uint32_t bits(float f) { return f32_bits(f); }

struct Mismatch {
  int64_t total = 0, differ = 0;
};

// got vs ref (both bf16 values): equal, or one bf16 ulp apart with the reference's value `acc`
// near the midpoint between the two: within a few fp32 ulps, or within `tol`, the bound on what
// fp32 block sums may move the total (then the midpoint lies between the two totals: a near tie
// that those roundings flipped). Blocks whose products cancel have large bounds, but only there.
void check_bf16_out(const float* got, const float* want, const float* acc, const float* tol, int64_t n, Mismatch& mm,
                    const char* what) {
  for (int64_t i = 0; i < n; ++i) {
    ++mm.total;
    if (bits(got[i]) == bits(want[i]) || (std::isnan(got[i]) && std::isnan(want[i]))) continue;
    ++mm.differ;
    const uint32_t a = bits(got[i]), b = bits(want[i]);
    ASSERT_EQ(a >> 31, b >> 31) << what << " element " << i << ": " << got[i] << " vs " << want[i];
    ASSERT_EQ(std::max(a, b) - std::min(a, b), 0x10000u) << what << " element " << i << ": " << got[i] << " vs " << want[i];
    const float mid = (got[i] + want[i]) / 2;  // exact: halfway between adjacent bf16 values
    const float ulp = std::fabs(got[i] - want[i]);
    ASSERT_LE(std::fabs(acc[i] - mid), std::max(ulp * 0x1p-10f, tol[i]))
        << what << " element " << i << ": not a near tie (exact " << acc[i] << ", mid " << mid << ", bound " << tol[i] << ")";
  }
}

struct Shape {
  int64_t m, n, k;
};
const Shape kShapes[] = {{1, 1, 32},   {1, 33, 64},  {2, 31, 96},  {3, 64, 160}, {7, 100, 320},
                         {1, 130, 256}, {64, 47, 128}, {129, 65, 96}, {8, 257, 512}, {5, 32, 1024},
                         {1, 16, 1024}, {2, 5, 2048}, {1, 200, 2048}, {2, 100, 256}, {3, 161, 128}};
// Row counts around the repacked layout's register path (8-row passes up to 128 rows, ragged
// last passes) and the panel buffer's. Drawn from their own generator, so the shapes above keep
// their data.
const Shape kMoreShapes[] = {{4, 40, 64}, {13, 70, 256}, {16, 33, 96}, {17, 64, 64}, {37, 70, 96}, {128, 40, 64}, {256, 40, 64}, {257, 33, 64}};

template <class Make, class RefFn, class KernFn, class AccFn>
void run_quant_linear(const char* name, Make make, RefFn ref_fn, KernFn kern_fn, AccFn acc_fn) {
  IsaGuard guard;
  ThreadPool pool2(2), pool3(3);
  std::mt19937 g(1234);
  std::vector<Mismatch> mm(3);
  std::vector<int64_t> raw_total(3), raw_differ(3);
  int packed_checked = 0;
  std::mt19937 g_more(4321);
  std::vector<std::pair<const Shape*, std::mt19937*>> cases;
  for (const Shape& s : kShapes) cases.emplace_back(&s, &g);
  for (const Shape& s : kMoreShapes) cases.emplace_back(&s, &g_more);
  for (int rep = 0; rep < 3; ++rep)
    for (const auto& [shape, gen] : cases) {
      const Shape& s = *shape;
      std::mt19937& g = *gen;
      const bool extreme = rep == 2;
      auto w = make(g, s.n, s.k, extreme);
      const auto x = make_activations(g, s.m * s.k, extreme);
      std::vector<float> want(size_t(s.m * s.n)), acc(want.size()), tol(want.size());
      ref_fn(x.data(), s.m, w, want.data());
      for (int64_t r = 0; r < s.m; ++r)
        for (int64_t n = 0; n < s.n; ++n) {
          const BlockAcc a = acc_fn(x.data() + r * s.k, w, n);
          acc[size_t(r * s.n + n)] = a.acc;
          tol[size_t(r * s.n + n)] = a.tol;
        }
      std::vector<float> first;
      for (kern::Isa isa : isas()) {
        kern::set_isa(isa);
        std::vector<float> got(want.size(), -1.f), got2(want.size(), -2.f), got3(want.size(), -3.f), rows(want.size());
        kern_fn(x.data(), s.m, w, got.data(), nullptr);
        kern_fn(x.data(), s.m, w, got2.data(), &pool2);
        kern_fn(x.data(), s.m, w, got3.data(), &pool3);
        for (int64_t r = 0; r < s.m; ++r) kern_fn(x.data() + r * s.k, 1, w, rows.data() + r * s.n, &pool2);
        const std::string what = std::string(name) + " " + kern::isa_name(isa) + " m=" + std::to_string(s.m) +
                                 " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k) + " rep " + std::to_string(rep);
        ASSERT_EQ(0, std::memcmp(got.data(), got2.data(), got.size() * 4)) << what << ": 1 vs 2 threads";
        ASSERT_EQ(0, std::memcmp(got.data(), got3.data(), got.size() * 4)) << what << ": 1 vs 3 threads";
        ASSERT_EQ(0, std::memcmp(got.data(), rows.data(), got.size() * 4)) << what << ": batched vs row by row";
        if (const size_t bytes = kern::packed_bytes(w.view)) {
          // The load-time repacked layout gives the same bits as the checkpoint layout.
          std::vector<uint8_t> buf(bytes + 64, 0xAB);
          uint8_t* aligned = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
          auto wp = w;
          kern::pack_weight(wp.view, aligned, &pool3);
          ASSERT_EQ(wp.view.packed, aligned);
          std::vector<float> packed1(want.size(), -4.f), packed2(want.size(), -5.f);
          kern_fn(x.data(), s.m, wp, packed1.data(), nullptr);
          kern_fn(x.data(), s.m, wp, packed2.data(), &pool2);
          ASSERT_EQ(0, std::memcmp(got.data(), packed1.data(), got.size() * 4)) << what << ": repacked weights";
          ASSERT_EQ(0, std::memcmp(got.data(), packed2.data(), got.size() * 4)) << what << ": repacked weights, 2 threads";
          // Same block order too: the fp32 totals before rounding agree bit for bit.
          std::vector<float> raw_ckpt(want.size()), raw_packed(want.size());
          kern::detail::unrounded_quant_output = true;
          kern_fn(x.data(), s.m, w, raw_ckpt.data(), nullptr);
          kern_fn(x.data(), s.m, wp, raw_packed.data(), nullptr);
          kern::detail::unrounded_quant_output = false;
          ASSERT_EQ(0, std::memcmp(raw_ckpt.data(), raw_packed.data(), raw_ckpt.size() * 4)) << what << ": repacked fp32 totals";
          ++packed_checked;
        }
        if (isa == kern::Isa::Scalar) {  // the dispatch's scalar path is the reference itself
          ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << what;
        } else {
          check_bf16_out(got.data(), want.data(), acc.data(), tol.data(), int64_t(got.size()), mm[size_t(isa)], what.c_str());
          // The fp32 totals before rounding: AVX2 and AVX-512 use the same block order, so they
          // agree bit for bit; against the exact block sums they differ only where a block's fp32
          // partial sums rounded.
          std::vector<float> raw(want.size());
          kern::detail::unrounded_quant_output = true;
          kern_fn(x.data(), s.m, w, raw.data(), &pool2);
          kern::detail::unrounded_quant_output = false;
          if (!first.empty()) {
            ASSERT_EQ(0, std::memcmp(raw.data(), first.data(), raw.size() * 4)) << what << ": avx2 vs avx512 fp32 totals";
          }
          first = raw;
          for (size_t i = 0; i < raw.size(); ++i) {
            ++raw_total[size_t(isa)];
            if (bits(raw[i]) != bits(acc[i])) ++raw_differ[size_t(isa)];
          }
        }
      }
    }
  if (kern::isa_supported(kern::Isa::Avx2)) {
    EXPECT_GT(packed_checked, 0) << "the AVX2 and AVX-512 paths have repacked layouts; they must be tested";
  }
  for (kern::Isa isa : isas()) {
    const Mismatch& m = mm[size_t(isa)];
    if (isa == kern::Isa::Scalar) continue;
    std::printf("%s %s: %lld of %lld outputs differ from the reference by one bf16 ulp (near ties); "
                "%lld fp32 totals differ from the exact-block-sum totals\n",
                name, kern::isa_name(isa), (long long)m.differ, (long long)m.total, (long long)raw_differ[size_t(isa)]);
    // FP8 blocks span up to 41 bits, so the wide-range data makes some fp32 block sums round and
    // the order check above has teeth. E4M3 x E2M1 blocks need at most ~27 bits and practically
    // never round (0 here); FP4 shares the microkernel, so the FP8 check covers its order.
    if (std::string(name) == "linear_fp8") {
      EXPECT_GT(raw_differ[size_t(isa)], 0) << "the wide-range test blocks should make some fp32 block sums round";
    }
    EXPECT_LT(double(m.differ), 1e-3 * double(m.total)) << name << " " << kern::isa_name(isa);
  }
}

struct Fp8W {
  std::vector<uint8_t> w, s;
  ref::Fp8Weight view;
};
Fp8W make_fp8(std::mt19937& g, int64_t n, int64_t k, bool extreme) {
  Fp8W f;
  f.w.resize(size_t(n * k));
  for (auto& c : f.w) c = random_e4m3(g, extreme);
  for (int64_t r = 0; r < n; r += 32)  // an all-zero weight block now and then
    if (g() % 8 == 0) std::fill(f.w.begin() + r * k, f.w.begin() + r * k + std::min<int64_t>(32, k), 0);
  f.s.resize(size_t(((n + 31) / 32) * ((k + 31) / 32)));
  for (auto& c : f.s) c = random_scale(g, extreme);
  f.view = {f.w.data(), f.s.data(), n, k};
  return f;
}

struct Fp4W {
  std::vector<uint8_t> w, s;
  ref::Fp4Weight view;
};
Fp4W make_fp4(std::mt19937& g, int64_t n, int64_t k, bool extreme) {
  Fp4W f;
  f.w.resize(size_t(n * k / 2));
  for (auto& c : f.w) c = uint8_t(g());
  f.s.resize(size_t(n * (k / 32)));
  for (auto& c : f.s) c = random_scale(g, extreme);
  f.view = {f.w.data(), f.s.data(), n, k};
  return f;
}

}  // namespace

TEST(Kernels, IsaSelection) {
  IsaGuard guard;
  EXPECT_TRUE(kern::isa_supported(kern::Isa::Scalar));
  EXPECT_TRUE(kern::isa_supported(kern::best_isa()));
  for (kern::Isa i : isas()) {
    kern::set_isa(i);
    EXPECT_EQ(kern::active_isa(), i);
  }
  for (kern::Isa i : {kern::Isa::Avx2, kern::Isa::Avx512}) {
    if (!kern::isa_supported(i)) {
      EXPECT_THROW(kern::set_isa(i), std::invalid_argument);
    }
  }
  std::printf("best ISA: %s; testing:", kern::isa_name(kern::best_isa()));
  for (kern::Isa i : isas()) std::printf(" %s", kern::isa_name(i));
  std::printf("\n");
}

TEST(Kernels, LinearFp8) {
  run_quant_linear(
      "linear_fp8", make_fp8,
      [](const float* x, int64_t m, const Fp8W& w, float* y) { ref::linear_fp8(x, m, w.view, y); },
      [](const float* x, int64_t m, const Fp8W& w, float* y, ThreadPool* p) { kern::linear_fp8(x, m, w.view, y, p); },
      [](const float* x, const Fp8W& w, int64_t n) {
        const int64_t K = w.view.in, nkb = (K + 31) / 32;
        return ref_block_acc(
            x, K, [&](int64_t k) { return e4m3_to_f32(w.w[size_t(n * K + k)]); },
            [&](int64_t kb) { return e8m0_to_f32(w.s[size_t((n / 32) * nkb + kb)]); });
      });
}

TEST(Kernels, LinearFp4) {
  run_quant_linear(
      "linear_fp4", make_fp4,
      [](const float* x, int64_t m, const Fp4W& w, float* y) { ref::linear_fp4(x, m, w.view, y); },
      [](const float* x, int64_t m, const Fp4W& w, float* y, ThreadPool* p) { kern::linear_fp4(x, m, w.view, y, p); },
      [](const float* x, const Fp4W& w, int64_t n) {
        const int64_t K = w.view.in, nkb = K / 32;
        return ref_block_acc(
            x, K, [&](int64_t k) { return e2m1_to_f32(fp4_get(w.w.data() + n * (K / 2), k)); },
            [&](int64_t kb) { return e8m0_to_f32(w.s[size_t(n * nkb + kb)]); });
      });
}

// FP8 with K not a multiple of 32 takes the reference path on every ISA: still exact.
TEST(Kernels, LinearFp8RaggedK) {
  IsaGuard guard;
  std::mt19937 g(7);
  auto w = make_fp8(g, 40, 70, false);
  const auto x = make_activations(g, 3 * 70, false);
  std::vector<float> want(3 * 40), got(want.size());
  ref::linear_fp8(x.data(), 3, w.view, want.data());
  for (kern::Isa isa : isas()) {
    kern::set_isa(isa);
    kern::linear_fp8(x.data(), 3, w.view, got.data());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << kern::isa_name(isa);
  }
}

// An E4M3 NaN code in a weight: the AVX2 layout cannot express it, so such a tensor is not
// repacked, and every path still gives the reference's outputs (NaN where a NaN weight meets the
// row, the exact values elsewhere) for the linear and for wo_a's dequantized form.
TEST(Kernels, Fp8NanCodeWeights) {
  IsaGuard guard;
  std::mt19937 g(8);
  auto w = make_fp8(g, 48, 128, false);
  w.w[size_t(5 * 128 + 17)] = 0x7f;   // +NaN in row 5
  w.w[size_t(40 * 128 + 100)] = 0xff;  // -NaN in row 40
  const auto x = make_activations(g, 2 * 128, false);
  std::vector<float> want(2 * 48), want_dq(want.size());
  ref::linear_fp8(x.data(), 2, w.view, want.data());
  ref::linear_fp8_dequant(x.data(), 2, w.view, want_dq.data());
  for (kern::Isa isa : isas()) {
    kern::set_isa(isa);
    if (isa == kern::Isa::Avx2) {
      EXPECT_EQ(kern::packed_bytes(w.view), 0u) << "a weight holding an E4M3 NaN code must not be repacked";
    }
    for (int64_t m : {1, 2}) {
      std::vector<float> got(size_t(m * 48)), got_dq(got.size());
      kern::linear_fp8(x.data(), m, w.view, got.data());
      kern::linear_fp8_dequant(x.data(), m, w.view, got_dq.data());
      for (size_t i = 0; i < got.size(); ++i) {
        const bool nan_row = i % 48 == 5 || i % 48 == 40;
        EXPECT_EQ(std::isnan(got[i]), nan_row) << kern::isa_name(isa) << " m=" << m << " at " << i;
        EXPECT_EQ(std::isnan(got_dq[i]), nan_row) << kern::isa_name(isa) << " m=" << m << " at " << i;
        if (!nan_row) {
          EXPECT_EQ(bits(got[i]), bits(want[i])) << kern::isa_name(isa) << " m=" << m << " at " << i;
          EXPECT_EQ(bits(got_dq[i]), bits(want_dq[i])) << kern::isa_name(isa) << " m=" << m << " at " << i;
        }
      }
    }
  }
}

namespace {

// fp64-accumulated linears: the sum is exact up to fp64 rounding in another order than the
// reference's, so an fp32 (or bf16) output may move by one ulp when the exact sum sits on a
// rounding boundary to within ~2^-50 relative: assert it is one ulp and rare.
template <class RefFn, class KernFn>
void run_f64_linear(const char* name, bool bf16_out, int64_t m, int64_t n, int64_t k, RefFn ref_fn, KernFn kern_fn,
                    Mismatch& mm, const std::vector<float>& x) {
  IsaGuard guard;
  ThreadPool pool3(3);
  std::vector<float> want(size_t(m * n));
  ref_fn(x.data(), m, want.data());
  for (kern::Isa isa : isas()) {
    kern::set_isa(isa);
    std::vector<float> got(want.size(), -1.f), got3(want.size(), -3.f);
    kern_fn(x.data(), m, got.data(), nullptr);
    kern_fn(x.data(), m, got3.data(), &pool3);
    const std::string what = std::string(name) + " " + kern::isa_name(isa) + " m=" + std::to_string(m) +
                             " n=" + std::to_string(n) + " k=" + std::to_string(k);
    ASSERT_EQ(0, std::memcmp(got.data(), got3.data(), got.size() * 4)) << what << ": thread count";
    {  // the next call on the same threads sees its own x (each thread widens x once per call): 2x exactly
      std::vector<float> x2(x), got2(want.size(), -4.f);
      for (float& v : x2) v *= 2.f;
      kern_fn(x2.data(), m, got2.data(), &pool3);
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(bits(2.f * got3[i]), bits(got2[i])) << what << ": 2x at " << i;
    }
    for (int64_t r = 0; r < m; ++r) {  // each row alone: the same bits as in the batch (rows share weight passes)
      std::vector<float> alone(size_t(n), -2.f);
      kern_fn(x.data() + r * k, 1, alone.data(), nullptr);
      ASSERT_EQ(0, std::memcmp(alone.data(), got.data() + r * n, alone.size() * 4)) << what << ": row " << r << " alone";
    }
    for (size_t i = 0; i < got.size(); ++i) {
      ++mm.total;
      if (bits(got[i]) == bits(want[i])) continue;
      ++mm.differ;
      const uint32_t a = bits(got[i]), b = bits(want[i]);
      ASSERT_EQ(a >> 31, b >> 31) << what << " at " << i;
      ASSERT_EQ(std::max(a, b) - std::min(a, b), bf16_out ? 0x10000u : 1u) << what << " at " << i << ": " << got[i]
                                                                         << " vs " << want[i];
    }
  }
}

std::vector<float> random_floats(std::mt19937& g, int64_t n, bool bf16_valued) {
  std::normal_distribution<float> nd;
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& f : v) f = bf16_valued ? round_bf16(nd(g)) : nd(g);
  return v;
}

const Shape kF64Shapes[] = {{1, 1, 1}, {1, 17, 7}, {2, 33, 64}, {3, 24, 257}, {7, 100, 1000}, {64, 19, 96}, {129, 9, 40}, {13, 37, 1056}, {1, 300, 4096}};

}  // namespace

TEST(Kernels, LinearBf16) {
  std::mt19937 g(11);
  Mismatch mm;
  for (bool round_out : {false, true})
    for (const Shape& s : kF64Shapes) {
      std::vector<uint16_t> w(size_t(s.n * s.k));
      for (auto& v : w) v = f32_to_bf16(std::normal_distribution<float>()(g));
      const ref::Bf16Weight view{w.data(), s.n, s.k};
      const auto x = random_floats(g, s.m * s.k, !round_out);
      run_f64_linear(
          "linear_bf16", round_out, s.m, s.n, s.k,
          [&](const float* xx, int64_t m, float* y) { ref::linear_bf16(xx, m, view, y, round_out); },
          [&](const float* xx, int64_t m, float* y, ThreadPool* p) { kern::linear_bf16(xx, m, view, y, round_out, p); },
          mm, x);
    }
  std::printf("linear_bf16: %lld of %lld outputs differ by one ulp\n", (long long)mm.differ, (long long)mm.total);
  EXPECT_LT(double(mm.differ), 1e-3 * double(mm.total));
}

// The logits head accumulates in fp32 where the ISA has bf16 dot products: within the fp32 error
// bound of the exact sum, bit-identical across thread counts and batch sizes, and exactly the fp64
// path when x is not bf16-valued.
TEST(Kernels, LinearBf16Logits) {
  std::mt19937 g(14);
  IsaGuard guard;
  ThreadPool pool3(3);
  int64_t rounded = 0, total = 0;
  for (const Shape& s : kF64Shapes) {
    std::vector<uint16_t> w(size_t(s.n * s.k));
    for (auto& v : w) v = f32_to_bf16(std::normal_distribution<float>()(g));
    const ref::Bf16Weight view{w.data(), s.n, s.k};
    const auto x = random_floats(g, s.m * s.k, true);
    std::vector<float> exact(size_t(s.m * s.n));
    ref::linear_bf16(x.data(), s.m, view, exact.data(), false);
    for (kern::Isa isa : isas()) {
      kern::set_isa(isa);
      const std::string what = std::string(kern::isa_name(isa)) + " m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) +
                               " k=" + std::to_string(s.k);
      std::vector<float> got(exact.size(), -1.f), got3(exact.size(), -3.f), one(size_t(s.n));
      kern::linear_bf16_logits(x.data(), s.m, view, got.data(), nullptr);
      kern::linear_bf16_logits(x.data(), s.m, view, got3.data(), &pool3);
      ASSERT_EQ(0, std::memcmp(got.data(), got3.data(), got.size() * 4)) << what << ": thread count";
      // Each row alone (one output reduction at a time) gives the same bits as inside the batch
      // (whole row blocks reduced 16 outputs at a time).
      for (int64_t r = 0; r < s.m; ++r) {
        kern::linear_bf16_logits(x.data() + r * s.k, 1, view, one.data(), nullptr);
        ASSERT_EQ(0, std::memcmp(one.data(), got.data() + r * s.n, one.size() * 4)) << what << ": row " << r << " alone";
      }
      for (int64_t i = 0; i < s.m; ++i)
        for (int64_t n = 0; n < s.n; ++n) {
          double mag = 0;
          for (int64_t k = 0; k < s.k; ++k) mag += std::fabs(double(x[size_t(i * s.k + k)]) * bf16_to_f32(w[size_t(n * s.k + k)]));
          const double bound = (double(s.k) / 16 + 8) * std::ldexp(mag, -24) + 1e-30;
          const size_t at = size_t(i * s.n + n);
          ASSERT_LE(std::fabs(double(got[at]) - exact[at]), bound) << what << " at " << at;
          rounded += bits(got[at]) != bits(exact[at]), ++total;
        }
      if (isa == kern::Isa::Scalar || (isa == kern::Isa::Avx2 && s.k % 32)) {
        ASSERT_EQ(0, std::memcmp(got.data(), exact.data(), got.size() * 4)) << what << ": exact path";
      }
      // Not bf16-valued: the exact path, whatever the ISA.
      std::vector<float> xf = x, want(exact.size()), alt(exact.size());
      xf[0] = std::nextafter(xf[0], 10.f);
      kern::linear_bf16(xf.data(), s.m, view, want.data(), false, nullptr);
      kern::linear_bf16_logits(xf.data(), s.m, view, alt.data(), nullptr);
      ASSERT_EQ(0, std::memcmp(want.data(), alt.data(), want.size() * 4)) << what << ": fp32 x";
    }
  }
  std::printf("linear_bf16_logits: %lld of %lld outputs differ from the exact sum (within the fp32 bound)\n",
              (long long)rounded, (long long)total);
}

// Decode-shaped kernels read each thread's chunk as several interleaved weight streams (head
// rows, FP8/FP4 panels): the same outputs in the same places as one stream, for chunk sizes that
// do and do not divide into the streams, 1-3 rows and 1-3 threads; and the reference's values.
TEST(Kernels, InterleavedWeightStreams) {
  IsaGuard guard;
  ThreadPool pool2(2), pool3(3);
  ThreadPool* pools[] = {nullptr, &pool2, &pool3};
  std::mt19937 g(77);
  struct Flag {
    ~Flag() { kern::detail::interleaved_weight_streams = true; }
  } restore;
  auto both = [&](auto&& call, size_t n, const std::string& what) {
    std::vector<float> on(n, -1.f), off(n, -2.f);
    kern::detail::interleaved_weight_streams = true;
    call(on.data());
    kern::detail::interleaved_weight_streams = false;
    call(off.data());
    kern::detail::interleaved_weight_streams = true;
    EXPECT_EQ(0, std::memcmp(on.data(), off.data(), n * 4)) << what;
    return on;
  };
  for (kern::Isa isa : isas()) {
    kern::set_isa(isa);
    for (const int64_t N : {int64_t(32 * 9 + 7), int64_t(32 * 37), int64_t(32 * 70 + 1)})
      for (const int64_t K : {int64_t(64), int64_t(256)}) {
        auto f8 = make_fp8(g, N, K, false);
        auto f4 = make_fp4(g, N, K, false);
        std::vector<uint8_t> buf8(kern::packed_bytes(f8.view) + 64), buf4(kern::packed_bytes(f4.view) + 64);
        auto align = [](std::vector<uint8_t>& b) { return b.data() + (64 - reinterpret_cast<uintptr_t>(b.data()) % 64) % 64; };
        if (!buf8.empty() && kern::packed_bytes(f8.view)) kern::pack_weight(f8.view, align(buf8), &pool2);
        if (!buf4.empty() && kern::packed_bytes(f4.view)) kern::pack_weight(f4.view, align(buf4), &pool2);
        for (int64_t m = 1; m <= 3; ++m) {
          const auto x = make_activations(g, m * K, false);
          std::vector<float> want8(size_t(m * N)), want4(size_t(m * N));
          ref::linear_fp8(x.data(), m, f8.view, want8.data());
          ref::linear_fp4(x.data(), m, f4.view, want4.data());
          for (int t = 0; t < 3; ++t) {
            const std::string what = std::string(kern::isa_name(isa)) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
                                     " m=" + std::to_string(m) + " threads " + std::to_string(t + 1);
            const auto got8 = both([&](float* y) { kern::linear_fp8(x.data(), m, f8.view, y, pools[t]); }, want8.size(), "fp8 " + what);
            const auto got4 = both([&](float* y) { kern::linear_fp4(x.data(), m, f4.view, y, pools[t]); }, want4.size(), "fp4 " + what);
            // FP4 blocks never round in fp32 (see run_quant_linear): exactly the reference. FP8 may
            // differ by a near tie, which run_quant_linear bounds; here only that all were written.
            EXPECT_EQ(0, std::memcmp(got4.data(), want4.data(), want4.size() * 4)) << "fp4 " << what;
            for (size_t i = 0; i < got8.size(); ++i) ASSERT_LE(std::fabs(got8[i] - want8[i]), std::fabs(want8[i]) * 0x1p-7f) << "fp8 " << what;
          }
        }
      }
    for (const int64_t N : {int64_t(4 * 53 + 3), int64_t(4 * 64), int64_t(1000)})
      for (const int64_t K : {int64_t(40), int64_t(256)}) {
        std::vector<uint16_t> w(size_t(N * K));
        for (auto& v : w) v = f32_to_bf16(std::normal_distribution<float>()(g));
        const ref::Bf16Weight view{w.data(), N, K};
        for (const int64_t m : {int64_t(1), int64_t(2), int64_t(7)}) {
          const auto x = random_floats(g, m * K, true);
          for (int t = 0; t < 3; ++t) {
            const auto got = both([&](float* y) { kern::linear_bf16_logits(x.data(), m, view, y, pools[t]); }, size_t(m * N),
                                  std::string("head ") + kern::isa_name(isa) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
                                      " m=" + std::to_string(m) + " threads " + std::to_string(t + 1));
            std::vector<float> row(static_cast<size_t>(N));
            for (int64_t r = 0; r < m; ++r) {  // every output written, and the row's bits alone
              kern::linear_bf16_logits(x.data() + r * K, 1, view, row.data(), nullptr);
              ASSERT_EQ(0, std::memcmp(row.data(), got.data() + r * N, row.size() * 4)) << "head row " << r;
            }
          }
        }
      }
  }
}

TEST(Kernels, LinearF32) {
  std::mt19937 g(12);
  Mismatch mm;
  for (const Shape& s : kF64Shapes) {
    const auto w = random_floats(g, s.n * s.k, false);
    const ref::F32Weight view{w.data(), s.n, s.k};
    const auto x = random_floats(g, s.m * s.k, false);
    run_f64_linear(
        "linear_f32", false, s.m, s.n, s.k, [&](const float* xx, int64_t m, float* y) { ref::linear_f32(xx, m, view, y); },
        [&](const float* xx, int64_t m, float* y, ThreadPool* p) { kern::linear_f32(xx, m, view, y, p); }, mm, x);
  }
  std::printf("linear_f32: %lld of %lld outputs differ by one fp32 ulp\n", (long long)mm.differ, (long long)mm.total);
  EXPECT_LT(double(mm.differ), 1e-3 * double(mm.total));
}

TEST(Kernels, LinearFp8Dequant) {
  std::mt19937 g(13);
  Mismatch mm;
  for (bool extreme : {false, true})
    for (const Shape& s : kF64Shapes) {
      auto w = make_fp8(g, s.n, s.k, extreme);
      const auto x = make_activations(g, s.m * s.k, false);
      run_f64_linear(
          "linear_fp8_dequant", true, s.m, s.n, s.k,
          [&](const float* xx, int64_t m, float* y) { ref::linear_fp8_dequant(xx, m, w.view, y); },
          [&](const float* xx, int64_t m, float* y, ThreadPool* p) { kern::linear_fp8_dequant(xx, m, w.view, y, p); },
          mm, x);
    }
  std::printf("linear_fp8_dequant: %lld of %lld outputs differ by one bf16 ulp\n", (long long)mm.differ,
              (long long)mm.total);
  EXPECT_LT(double(mm.differ), 1e-3 * double(mm.total));
}

// The certified fp32 path of wo_a (AVX-512, bf16-valued x, any m) gives exactly the fp64 path's
// bits: on random and extreme data, on a near tie and on a cancellation that fp32 gets wrong (both
// must be handed to the fp64 path), and on x x scale outside the range the bound covers.
TEST(Kernels, LinearFp8DequantCertified) {
  std::mt19937 g(17);
  IsaGuard guard;
  ThreadPool pool3(3);
  auto exact = [](const float* x, int64_t m, const ref::Fp8Weight& w, float* y) {
    kern::detail::exact_fp8_dequant_only = true;
    kern::linear_fp8_dequant(x, m, w, y, nullptr);
    kern::detail::exact_fp8_dequant_only = false;
  };
  int64_t packed_settled = 0;  // outputs the repacked-layout kernel settled
  auto check = [&](const std::vector<float>& x, int64_t m, const ref::Fp8Weight& w, const std::string& what) {
    std::vector<float> want(size_t(m * w.out)), got(want.size(), -1.f), got3(want.size(), -3.f);
    exact(x.data(), m, w, want.data());
    kern::linear_fp8_dequant(x.data(), m, w, got.data(), nullptr);
    kern::linear_fp8_dequant(x.data(), m, w, got3.data(), &pool3);
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << what;
    ASSERT_EQ(0, std::memcmp(got3.data(), want.data(), got.size() * 4)) << what << " (3 threads)";
    // The load-time repacked layout (as the model keeps wo_a on AVX-512): the same bits, also
    // through a 32-row-aligned sub-view of the rows as the model takes each group.
    if (const size_t bytes = kern::packed_bytes_dequant(w)) {
      std::vector<uint8_t> buf(bytes + 64);
      ref::Fp8Weight wp = w;
      kern::pack_weight_dequant(wp, buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64);
      const int64_t s0 = kern::detail::certified_outputs.load();
      std::fill(got.begin(), got.end(), -1.f);
      std::fill(got3.begin(), got3.end(), -3.f);
      kern::linear_fp8_dequant(x.data(), m, wp, got.data(), nullptr);
      kern::linear_fp8_dequant(x.data(), m, wp, got3.data(), &pool3);
      packed_settled += kern::detail::certified_outputs.load() - s0;
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << what << " (repacked)";
      ASSERT_EQ(0, std::memcmp(got3.data(), want.data(), got.size() * 4)) << what << " (repacked, 3 threads)";
      if (w.out > 32) {
        const int64_t rows = std::min<int64_t>(64, w.out - 32);
        const ref::Fp8Weight sub = kern::fp8_rows(wp, 32, rows), sub_plain = kern::fp8_rows(w, 32, rows);
        EXPECT_EQ(sub.packed != nullptr, true) << what;
        std::vector<float> ws(size_t(m * rows)), gs(ws.size(), -1.f);
        exact(x.data(), m, sub_plain, ws.data());
        kern::linear_fp8_dequant(x.data(), m, sub, gs.data(), nullptr);
        ASSERT_EQ(0, std::memcmp(gs.data(), ws.data(), gs.size() * 4)) << what << " (repacked rows 32..)";
      }
    }
  };
  const int64_t settled0 = kern::detail::certified_outputs.load(), handed0 = kern::detail::certified_fallbacks.load();
  for (kern::Isa isa : isas()) {
    kern::set_isa(isa);
    for (bool extreme : {false, true})
      for (const Shape& s : {Shape{1, 64, 64}, Shape{2, 100, 128}, Shape{3, 33, 2048}, Shape{1, 512, 2048}, Shape{5, 40, 64},
                              Shape{9, 64, 128}, Shape{40, 33, 2048},
                              Shape{1, 39, 128}, Shape{1, 30, 64}, Shape{31, 35, 64},  // 4 + 2 + 1 row passes; m just below 32
                              Shape{26, 200, 2048}, Shape{29, 70, 192},  // the GEMM layout from m = 12: ragged row tiles and groups
                              Shape{11, 40, 256}, Shape{12, 40, 256},  // the two sides of the switch
                              Shape{4, 96, 128}, Shape{6, 130, 256}, Shape{8, 512, 2048}, Shape{16, 70, 128},  // repacked: 4-row
                              Shape{32, 40, 128}, Shape{7, 288, 64},  // blocks, 2 x 2 and 1 x 4 panel passes; its switch
                              Shape{33, 40, 128}}) {  // the GEMM layout: five 6-row tiles and a 3-row one
        auto w = make_fp8(g, s.n, s.k, extreme);
        auto x = make_activations(g, s.m * s.k, extreme);
        for (auto& v : x) v = round_bf16(v);
        check(x, s.m, w.view, std::string(kern::isa_name(isa)) + " m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) +
                                  " k=" + std::to_string(s.k) + (extreme ? " extreme" : ""));
      }
    // The GEMM layout (m >= 24) with a row below the covered range: its hand-overs go to fp64
    // from the original x and weights, the other rows' through the bf16 columns.
    {
      auto w = make_fp8(g, 40, 128, false);
      auto x = make_activations(g, 30 * 128, false);
      for (auto& v : x) v = round_bf16(v);
      for (int k = 0; k < 128; ++k) x[5 * 128 + size_t(k)] = 0x1p-110f * float(k % 3 - 1);
      check(x, 30, w.view, std::string(kern::isa_name(isa)) + " GEMM layout, a row below the covered range");
      check(x, 7, w.view, std::string(kern::isa_name(isa)) + " a row below the covered range, 7 rows");
      x[2 * 128 + 3] = std::numeric_limits<float>::quiet_NaN();  // a NaN row: every output of it recomputed
      check(x, 7, w.view, std::string(kern::isa_name(isa)) + " a NaN row, 7 rows");
    }
    // Weights all 1.0 (E4M3 0x38, scale 2^0), 64 inputs.
    std::vector<uint8_t> ones(64 * 32, 0x38), scale(2, 127);
    const ref::Fp8Weight w1{ones.data(), scale.data(), 32, 64};
    std::vector<float> tie(64, 0.f), cancel(64, 1.f), tiny(64, 0x1p-110f), y(32);
    tie[0] = 1.f, tie[1] = 0x1p-8f;              // exactly between the bf16 values 1 and 1 + 2^-7
    cancel[0] = 0x1p30f, cancel[63] = -0x1p30f;  // fp32 loses the +1 added to 2^30: 60, exact 62
    check(tie, 1, w1, "tie");
    check(cancel, 1, w1, "cancellation");
    check(tiny, 1, w1, "below the covered range");
    // Additions lost to a large partial sum: weights 256, x = 2^8, 2^16, -2^-5, 0, then sixteen
    // 2^-8: the partial sum reaches 2^24 + 2^16 - 8 and each +1 after it rounds away (ties to
    // even), so fp32 ends 16 below the exact 2^24 + 2^16 + 8, on the other side of a bf16
    // midpoint. Only the partial sums' magnitudes in the bound send it to the exact path.
    std::vector<uint8_t> w256(64 * 32, 0x78);
    const ref::Fp8Weight wl{w256.data(), scale.data(), 32, 64};
    std::vector<float> lost(64, 0.f);
    lost[0] = 0x1p8f, lost[1] = 0x1p16f, lost[2] = -0x1p-5f;
    for (int k = 4; k < 20; ++k) lost[size_t(k)] = 0x1p-8f;
    check(lost, 1, wl, "lost additions");
    kern::linear_fp8_dequant(lost.data(), 1, wl, y.data(), nullptr);
    EXPECT_EQ(y[0], 0x1p24f + 0x1p17f);
    // An addition lost inside one vdpbf16ps step: 2^33 added to 2^16 + 2^8 + 2^4 and taken away
    // again by the pair's other product; fp32 keeps 2^16 (below the bf16 midpoint), the exact sum
    // is above it. The partial sums stay small, so only the products' term of the bound sends it
    // to the exact path.
    std::vector<float> inner(64, 0.f);
    inner[0] = 0x1p8f, inner[1] = 0x1p16f, inner[3] = 0x1p4f, inner[4] = -0x1p33f, inner[5] = 0x1p33f;
    check(inner, 1, w1, "addition lost inside a step");
    kern::linear_fp8_dequant(inner.data(), 1, w1, y.data(), nullptr);
    EXPECT_EQ(y[0], 0x1p16f + 0x1p9f);
    kern::linear_fp8_dequant(cancel.data(), 1, w1, y.data(), nullptr);
    EXPECT_EQ(y[0], 62.f);
    kern::linear_fp8_dequant(tie.data(), 1, w1, y.data(), nullptr);
    EXPECT_EQ(y[0], 1.f);
  }
  const int64_t settled = kern::detail::certified_outputs.load() - settled0,
                handed = kern::detail::certified_fallbacks.load() - handed0;
  std::printf("certified wo_a path: %lld outputs settled in fp32, %lld handed to fp64\n", (long long)settled,
              (long long)handed);
  if (kern::isa_supported(kern::Isa::Avx512)) {
    EXPECT_GT(settled, 0);
    EXPECT_GT(packed_settled, 0);
    EXPECT_GE(handed, 3 * 32);  // at least every output of the three crafted cases
  }
}

// mHC collapse / expand: bit-identical to the reference on every path, ragged widths included.
TEST(Kernels, HcCollapseExpand) {
  std::mt19937 g(23);
  IsaGuard guard;
  for (int hc : {1, 2, 4, 5})
    for (int dim : {1, 15, 16, 33, 1024}) {
      const auto X = random_floats(g, int64_t(hc) * dim, true), f = random_floats(g, dim, true);
      const auto pre = random_floats(g, hc, false), post = random_floats(g, hc, false), comb = random_floats(g, hc * hc, false);
      std::vector<float> want_y(static_cast<size_t>(dim)), want_Y(static_cast<size_t>(hc) * dim);
      ref::hc_collapse(X.data(), pre.data(), hc, dim, want_y.data());
      ref::hc_expand(f.data(), X.data(), post.data(), comb.data(), hc, dim, want_Y.data());
      for (kern::Isa isa : isas()) {
        kern::set_isa(isa);
        std::vector<float> y(want_y.size(), -1.f), Y(want_Y.size(), -1.f);
        kern::hc_collapse(X.data(), pre.data(), hc, dim, y.data());
        kern::hc_expand(f.data(), X.data(), post.data(), comb.data(), hc, dim, Y.data());
        const std::string what = std::string(kern::isa_name(isa)) + " hc=" + std::to_string(hc) + " dim=" + std::to_string(dim);
        ASSERT_EQ(0, std::memcmp(y.data(), want_y.data(), y.size() * 4)) << what << ": collapse";
        ASSERT_EQ(0, std::memcmp(Y.data(), want_Y.data(), Y.size() * 4)) << what << ": expand";
      }
    }
}

// rms_scales runs four rows' sums side by side: each row's scale has rms_scale's bits, for row
// counts around the group of four, strides past the row, and rows whose fp64 sums round (values
// spread over 2^+-40, so the order of the sum matters).
TEST(Kernels, RmsScalesMatchRowByRow) {
  std::mt19937 g(31);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> ex(-40, 40);
  for (int64_t rows : {int64_t(1), int64_t(3), int64_t(4), int64_t(9)})
    for (int64_t n : {int64_t(1), int64_t(100), int64_t(4096)}) {
      const int64_t stride = n + 5;
      std::vector<float> x(size_t(rows * stride));
      for (auto& v : x) v = std::ldexp(nd(g), ex(g));
      std::vector<float> got(size_t(rows), -1.f);
      ref::rms_scales(x.data(), stride, rows, n, 1e-20f, got.data());
      for (int64_t r = 0; r < rows; ++r)
        ASSERT_EQ(bits(ref::rms_scale(x.data() + r * stride, n, 1e-20f)), bits(got[size_t(r)])) << "rows " << rows << " n " << n << " row " << r;
    }
  // A row whose result depends on the order: 1 + 2^-24 is an fp32 tie, and the 256 squares of
  // 2^-30 after it vanish one by one in fp64 (the sum stays the tie, rounded to even), while summed
  // first they would add 2^-52 and round it up.
  std::vector<float> tie(258 * 5, 2.f);
  for (int r = 0; r < 5; ++r) {
    float* row = tie.data() + r * 258;
    row[0] = 1.f, row[1] = 0x1p-12f;
    for (int i = 2; i < 258; ++i) row[i] = 0x1p-30f;
  }
  std::vector<float> got(5);
  ref::rms_scales(tie.data(), 258, 5, 258, 1e-20f, got.data());
  std::vector<float> reversed(tie.rbegin() + 4 * 258, tie.rend());
  ASSERT_NE(bits(ref::rms_scale(tie.data(), 258, 1e-20f)), bits(ref::rms_scale(reversed.data(), 258, 1e-20f))) << "order-sensitive row";
  for (int r = 0; r < 5; ++r) ASSERT_EQ(bits(ref::rms_scale(tie.data(), 258, 1e-20f)), bits(got[size_t(r)])) << "tie row " << r;
}

// The MoE's SwiGLU against ref::swiglu: gates and ups across the clamps and the range where expf
// overflows or underflows, zeros, NaN and infinities; ragged rows; with and without routing weights.
TEST(Kernels, Swiglu) {
  std::mt19937 g(37);
  IsaGuard guard;
  std::normal_distribution<float> nd;
  auto value = [&]() -> float {
    switch (g() % 12) {
      case 0: return 0.f;
      case 1: return -0.f;
      case 2: return g() & 1 ? 10.f : -10.f;
      case 3: return -90.f - float(g() % 20);  // expf(-gate) overflows: silu is -0
      case 4: return g() % 50 == 0 ? std::numeric_limits<float>::quiet_NaN() : nd(g) * 30.f;
      case 5: return g() % 50 == 0 ? (g() & 1 ? INFINITY : -INFINITY) : nd(g) * 1e-3f;
      default: return nd(g) * 4.f;
    }
  };
  for (int64_t n : {int64_t(1), int64_t(17), int64_t(384)})
    for (int64_t m : {int64_t(1), int64_t(3)})
      for (bool weighted : {false, true}) {
        std::vector<float> gate(static_cast<size_t>(m * n)), up(static_cast<size_t>(m * n)), w(static_cast<size_t>(m));
        for (auto& v : gate) v = value();
        for (auto& v : up) v = value();
        for (auto& v : w) v = std::fabs(nd(g));
        std::vector<float> want = gate;
        ref::swiglu(want.data(), up.data(), m, n, 10.f, weighted ? w.data() : nullptr);
        for (kern::Isa isa : isas()) {
          kern::set_isa(isa);
          std::vector<float> got = gate;
          kern::swiglu(got.data(), up.data(), m, n, 10.f, weighted ? w.data() : nullptr);
          ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
              << kern::isa_name(isa) << " m=" << m << " n=" << n << " weighted " << weighted;
        }
      }
}

// The indexer's FP4 QDQ (E8M0 scale per 32) and the window KV's FP8 QDQ against
// di::act_qdq_fp4_e8m0 / act_qdq_fp8: random blocks over wide magnitude ranges, every E2M1
// midpoint (ties) times the block's scale, zeros, subnormals, NaN and infinities, ragged lengths
// (the short last block).
TEST(Kernels, ActQdq) {
  std::mt19937 g(29);
  IsaGuard guard;
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> ex(-140, 120);
  for (int64_t n : {int64_t(1), int64_t(31), int64_t(32), int64_t(128), int64_t(4096 + 17)})
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> x(static_cast<size_t>(n));
      for (int64_t b0 = 0; b0 < n; b0 += 32) {
        const float scale = std::ldexp(1.f, ex(g));
        for (int64_t i = b0; i < std::min(n, b0 + 32); ++i) {
          float v = nd(g) * scale;
          switch (g() % 16) {
            case 0: v = 0.f; break;
            case 1: v = -0.f; break;
            case 2: {  // a midpoint between E2M1 values, times a power of two that the block's scale may be
              static constexpr float mids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f};
              v = (g() & 1 ? -1.f : 1.f) * mids[g() % 7] * scale;
              break;
            }
            case 3: v = (g() & 1 ? -1.f : 1.f) * 6.f * scale; break;  // sets the block's scale exactly
            case 4: if (trial % 5 == 0) v = trial % 2 ? std::numeric_limits<float>::quiet_NaN() : bits_f32(0xffc12345u); break;
            case 5: if (trial % 7 == 0) v = g() & 1 ? INFINITY : -INFINITY; break;
            case 6: v = std::ldexp(nd(g), -140); break;  // subnormal
            default: break;
          }
          x[size_t(i)] = v;
        }
      }
      std::vector<float> want = x, want8 = x;
      act_qdq_fp4_e8m0(want.data(), n, 32);
      act_qdq_fp8(want8.data(), n, 32);
      for (kern::Isa isa : isas()) {
        kern::set_isa(isa);
        std::vector<float> got = x, got8 = x;
        kern::act_qdq_fp4_e8m0(got.data(), n);
        kern::act_qdq_fp8(got8.data(), n);
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
            << kern::isa_name(isa) << " n=" << n << " trial " << trial;
        ASSERT_EQ(0, std::memcmp(got8.data(), want8.data(), got8.size() * 4))
            << "fp8 " << kern::isa_name(isa) << " n=" << n << " trial " << trial;
      }
    }
}

TEST(Kernels, SparseAttention) {
  IsaGuard guard;
  std::mt19937 g(21);
  // Which entries are -1: anywhere at random; as in a decode list (a partly filled window, then
  // a few visible compressed entries and whole chunks of -1); none live; the first chunk all -1.
  enum Skips { kRandom, kDecodeList, kAllSkipped, kFirstChunkSkipped };
  struct A {
    int h, d;
    int64_t rows;
    Skips skips = kRandom;
  };
  for (const A& a : {A{1, 8, 1}, A{3, 13, 5}, A{8, 64, 64}, A{9, 32, 65}, A{16, 128, 130}, A{4, 512, 200}, A{2, 16, 0},
                     A{16, 512, 640, kDecodeList}, A{5, 40, 300, kDecodeList}, A{3, 24, 130, kAllSkipped},
                     A{4, 64, 200, kFirstChunkSkipped}}) {
    const auto q = random_floats(g, int64_t(a.h) * a.d, true);
    std::vector<std::vector<float>> store;
    std::vector<const float*> rows(size_t(a.rows));
    for (int64_t j = 0; j < a.rows; ++j) {
      store.push_back(random_floats(g, a.d, true));
      bool skip = g() % 5 == 0;
      if (a.skips == kDecodeList) skip = (j >= 37 && j < 128) || j >= 128 + 45;
      if (a.skips == kAllSkipped) skip = true;
      if (a.skips == kFirstChunkSkipped) skip = j < 64 || g() % 7 == 0;
      rows[size_t(j)] = skip ? nullptr : store.back().data();
    }
    if (a.skips == kRandom && a.rows > 70) std::fill(rows.begin() + 64, rows.begin() + 70, nullptr);
    std::vector<float> sink(size_t(a.h));
    for (auto& s : sink) s = std::normal_distribution<float>()(g);
    const float scale = 1.f / std::sqrt(float(a.d));
    std::vector<float> want(size_t(a.h * a.d));
    ref::sparse_attention(q.data(), a.h, a.d, rows.data(), a.rows, sink.data(), scale, want.data());
    for (kern::Isa isa : isas()) {
      kern::set_isa(isa);
      std::vector<float> got(want.size(), -1.f);
      kern::sparse_attention(q.data(), a.h, a.d, rows.data(), a.rows, sink.data(), scale, got.data());
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
          << kern::isa_name(isa) << " h=" << a.h << " d=" << a.d << " rows=" << a.rows;
    }
  }
}

// The attention's probabilities use a vector copy of glibc's expf: it must give std::exp's bits.
// Every 509th float bit pattern (all signs, exponents and a spread of mantissas), the attention's
// range [-104, 0] densely, and the special cases (NaN, infinities, overflow and underflow edges).
TEST(Kernels, VectorExpfMatchesLibm) {
  if (!kern::isa_supported(kern::Isa::Avx512)) GTEST_SKIP() << "no AVX-512 on this CPU";
  std::vector<float> x;
  for (uint64_t u = 0; u < (uint64_t(1) << 32); u += 509) {
    float f;
    const uint32_t b = uint32_t(u);
    std::memcpy(&f, &b, 4);
    x.push_back(f);
  }
  for (float f = -104.f; f <= 0.f; f += 1.f / 4096) x.push_back(f);
  for (float f : {0.f, -0.f, INFINITY, -INFINITY, NAN, 88.f, 88.72f, 89.f, -87.f, -88.f, -103.f, -103.3f, -103.5f, -104.f,
                  -105.f, 1e-30f, -1e-30f, 1e-45f, -1e-45f, FLT_MAX, -FLT_MAX})
    x.push_back(f);
  std::vector<float> got(x.size());
  kern::avx512::expf_batch(x.data(), int64_t(x.size()), got.data());
  int64_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = std::exp(x[i]);
    if (std::memcmp(&want, &got[i], 4) != 0 && !(std::isnan(want) && std::isnan(got[i]))) {
      if (++bad <= 5) ADD_FAILURE() << "exp(" << x[i] << "): " << got[i] << " vs libm " << want;
    }
  }
  EXPECT_EQ(bad, 0) << "of " << x.size() << " arguments";
}

// Indexer scores: q and k are FP4(E2M1) values times power-of-two block scales, as the model
// passes them, so every fp64 dot is exact and all paths must agree bit for bit.
TEST(Kernels, IndexScores) {
  IsaGuard guard;
  std::mt19937 g(22);
  static const float kE2m1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  auto fp4_row = [&](int n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (int i = 0; i < n; i += 32) {
      const float scale = std::ldexp(1.f, int(g() % 24) - 12);
      for (int j = i; j < std::min(n, i + 32); ++j) v[size_t(j)] = (g() & 8 ? -1.f : 1.f) * kE2m1[g() % 8] * scale;
    }
    return v;
  };
  struct A {
    int h, d;
    int64_t n;
  };
  for (const A& a : {A{1, 8, 1}, A{3, 24, 7}, A{32, 128, 300}, A{5, 64, 0}, A{8, 40, 33}}) {
    const auto q = fp4_row(a.h * a.d);
    std::vector<float> w(size_t(a.h));
    for (auto& v : w) v = round_bf16(std::normal_distribution<float>()(g) * 0.1f);
    std::vector<std::vector<float>> store;
    std::vector<const float*> keys;
    for (int64_t u = 0; u < a.n; ++u) store.push_back(fp4_row(a.d));
    for (auto& k : store) keys.push_back(k.data());
    std::vector<float> want(size_t(a.n) + 1, -7.f);
    ref::index_scores(q.data(), w.data(), a.h, a.d, keys.data(), a.n, want.data());
    int positive = 0;
    for (int64_t u = 0; u < a.n; ++u) positive += want[size_t(u)] != 0.f;
    if (a.n > 30) {
      EXPECT_GT(positive, 0) << "relu left nothing: the test data is degenerate";
    }
    for (kern::Isa isa : isas()) {
      kern::set_isa(isa);
      std::vector<float> got(want.size(), -7.f);
      kern::index_scores(q.data(), w.data(), a.h, a.d, keys.data(), a.n, got.data());
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << kern::isa_name(isa) << " h=" << a.h << " d=" << a.d << " n=" << a.n;
    }
  }
}

// The AVX-512 integer path of index_scores (VNNI block sums): every key it takes must give the
// scalar reference's bits, and what is not 7-bit fixed point per block (wide codes, NaN, too wide
// an exponent spread for an exact fp64 sum, a q it cannot take) must go to the fp64 path. The
// data here stays exact in fp64 in any order, so the reference's bits are the answer either way.
TEST(Kernels, IndexScoresIntegerPath) {
  if (!kern::isa_supported(kern::Isa::Avx512)) GTEST_SKIP() << "no AVX-512 on this CPU";
  IsaGuard guard;
  kern::set_isa(kern::Isa::Avx512);
  std::mt19937 g(23);
  static const float kE2m1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  // Per block: E2M1 values x 2^(lo..hi), or (wide) integers of up to 10 bits, or all zeros.
  auto row = [&](int n, int lo, int hi, int wide_pct, int zero_pct) {
    std::vector<float> v(static_cast<size_t>(n));
    for (int i = 0; i < n; i += 32) {
      const float scale = std::ldexp(1.f, lo + int(g() % unsigned(hi - lo + 1)));
      const bool wide = int(g() % 100) < wide_pct, zero = int(g() % 100) < zero_pct;
      for (int j = i; j < std::min(n, i + 32); ++j) {
        const float c = wide ? float(int(g() % 2001) - 1000) : (g() & 8 ? -1.f : 1.f) * kE2m1[g() % 8];
        v[size_t(j)] = zero ? 0.f : c * scale;
      }
    }
    return v;
  };
  struct Case {
    const char* what;
    int h, d;
    int64_t n;
    int q_lo, q_hi, k_lo, k_hi, k_wide_pct, zero_pct;
    bool q_wide, all_fixed;
  };
  const Case cases[] = {
      {"model-like", 32, 128, 300, -8, 4, -8, 4, 0, 0, false, true},
      {"ragged groups, zero blocks", 5, 64, 37, -6, 6, -6, 6, 0, 20, false, true},
      {"one block per head, many keys", 7, 32, 1000, -3, 3, -3, 3, 0, 5, false, true},
      {"d = 512", 2, 512, 40, -4, 4, -4, 4, 0, 0, false, true},
      {"four keys", 3, 96, 4, -2, 2, -2, 2, 0, 0, false, true},
      {"subnormal scales", 4, 64, 50, -140, -130, 0, 4, 0, 0, false, true},
      {"wide key codes", 8, 64, 90, -4, 4, -4, 4, 10, 0, false, false},
      {"spread over 30 bits", 6, 64, 64, 0, 16, -16, 0, 0, 0, false, false},
      {"q not fixed point", 4, 64, 40, -4, 4, -4, 4, 0, 0, true, false},
  };
  for (const Case& c : cases) {
    std::vector<float> q = row(c.h * c.d, c.q_lo, c.q_hi, 0, c.zero_pct);
    if (c.q_wide) q[5] = 1001.f;
    std::vector<float> w(size_t(c.h));
    for (auto& v : w) v = round_bf16(std::normal_distribution<float>()(g) * 0.1f);
    std::vector<std::vector<float>> store;
    std::vector<const float*> keys;
    for (int64_t u = 0; u < c.n; ++u) store.push_back(row(c.d, c.k_lo, c.k_hi, c.k_wide_pct, c.zero_pct));
    for (auto& k : store) keys.push_back(k.data());
    std::vector<float> want(size_t(c.n) + 1, -7.f), got(want), f64(want);
    ref::index_scores(q.data(), w.data(), c.h, c.d, keys.data(), c.n, want.data());
    int positive = 0;
    for (int64_t u = 0; u < c.n; ++u) positive += want[size_t(u)] > 0.f;
    EXPECT_GT(positive, 0) << c.what << ": relu left nothing, the test data is degenerate";
    const int64_t before = kern::detail::index_fixed_keys.load();
    kern::index_scores(q.data(), w.data(), c.h, c.d, keys.data(), c.n, got.data());
    const int64_t fixed = kern::detail::index_fixed_keys.load() - before;
    kern::detail::index_scores_fp64_only = true;
    kern::index_scores(q.data(), w.data(), c.h, c.d, keys.data(), c.n, f64.data());
    kern::detail::index_scores_fp64_only = false;
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << c.what;
    EXPECT_EQ(0, std::memcmp(f64.data(), want.data(), f64.size() * 4)) << c.what;
    if (c.all_fixed) {
      EXPECT_EQ(fixed, c.n) << c.what << ": keys left to the fp64 path";
    } else if (c.q_wide) {
      EXPECT_EQ(fixed, 0) << c.what;
    } else {
      EXPECT_LT(fixed, c.n) << c.what << ": nothing went to the fp64 path";
    }
  }
  // NaN and inf in keys: those groups go to the fp64 path, which propagates them as the reference.
  {
    const int h = 4, d = 64;
    const int64_t n = 40;
    std::vector<float> q = row(h * d, -2, 2, 0, 0), w(size_t(h), 0.5f);
    std::vector<std::vector<float>> store;
    std::vector<const float*> keys;
    for (int64_t u = 0; u < n; ++u) store.push_back(row(d, -2, 2, 0, 0));
    store[3][7] = NAN;
    store[20][40] = INFINITY;
    for (auto& k : store) keys.push_back(k.data());
    std::vector<float> want(static_cast<size_t>(n)), got(static_cast<size_t>(n));
    ref::index_scores(q.data(), w.data(), h, d, keys.data(), n, want.data());
    const int64_t before = kern::detail::index_fixed_keys.load();
    kern::index_scores(q.data(), w.data(), h, d, keys.data(), n, got.data());
    EXPECT_EQ(kern::detail::index_fixed_keys.load() - before, n - 32) << "the groups of keys 3 and 20 are not fixed point";
    for (int64_t u = 0; u < n; ++u) {
      if (std::isnan(want[size_t(u)])) {
        EXPECT_TRUE(std::isnan(got[size_t(u)])) << "key " << u;
      } else {
        EXPECT_EQ(got[size_t(u)], want[size_t(u)]) << "key " << u;
      }
    }
  }
}

// ---- Fast numerics: every path gives the scalar contract's bits (ref::fast) ----
namespace {

// Runs kern_fn(first row, rows, y, pool) on every ISA with 1, 2 and 3 threads and row by row; each
// must equal want bit for bit.
template <class KernFn>
void expect_fast_bits(const std::string& what, const std::vector<float>& want, int64_t m, int64_t out_stride,
                      KernFn&& kern_fn) {
  IsaGuard guard;
  ThreadPool pool2(2), pool3(3);
  for (kern::Isa isa : isas()) {
    kern::set_isa(isa);
    std::vector<float> got(want.size(), -1.f), got2(want.size(), -2.f), got3(want.size(), -3.f), rows(want.size(), -4.f);
    kern_fn(int64_t(0), m, got.data(), static_cast<ThreadPool*>(nullptr));
    kern_fn(int64_t(0), m, got2.data(), &pool2);
    kern_fn(int64_t(0), m, got3.data(), &pool3);
    for (int64_t r = 0; r < m; ++r) kern_fn(r, int64_t(1), rows.data() + r * out_stride, &pool2);
    const std::string w = what + " " + kern::isa_name(isa);
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4)) << w << ": vs the scalar contract";
    ASSERT_EQ(0, std::memcmp(got2.data(), want.data(), want.size() * 4)) << w << ": 2 threads";
    ASSERT_EQ(0, std::memcmp(got3.data(), want.data(), want.size() * 4)) << w << ": 3 threads";
    ASSERT_EQ(0, std::memcmp(rows.data(), want.data(), want.size() * 4)) << w << ": row by row";
  }
}

// A 64-byte-aligned buffer for w's repacked layout on the active ISA (null: none).
template <class W>
uint8_t* pack_for(W& w, std::vector<uint8_t>& buf) {
  const size_t bytes = kern::packed_bytes(w);
  if (!bytes) return nullptr;
  buf.assign(bytes + 64, 0xAB);
  uint8_t* aligned = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
  return aligned;
}

}  // namespace

TEST(KernelsFast, QuantLinears) {
  std::mt19937 g(77), g_more(78);
  int64_t differ_from_exact = 0, total = 0;
  for (int rep = 0; rep < 2; ++rep)
    for (const Shape* list : {kShapes, kMoreShapes}) {
      const size_t count = list == kShapes ? std::size(kShapes) : std::size(kMoreShapes);
      for (size_t i = 0; i < count; ++i) {
        const Shape& s = list[i];
        std::mt19937& gen = list == kShapes ? g : g_more;
        const bool extreme = rep == 1;
        auto w8 = make_fp8(gen, s.n, s.k, extreme);
        auto w4 = make_fp4(gen, s.n, s.k, extreme);
        const auto x = make_activations(gen, s.m * s.k, extreme);
        const std::string shape = " m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k) +
                                  (extreme ? " extreme" : "");
        std::vector<float> want8(size_t(s.m * s.n)), want4(want8.size()), exact(want8.size());
        ref::fast::linear_fp8(x.data(), s.m, w8.view, want8.data());
        ref::fast::linear_fp4(x.data(), s.m, w4.view, want4.data());
        ref::linear_fp8(x.data(), s.m, w8.view, exact.data());
        for (size_t j = 0; j < exact.size(); ++j) differ_from_exact += bits(exact[j]) != bits(want8[j]);
        total += int64_t(exact.size());
        expect_fast_bits("fp8" + shape, want8, s.m, s.n, [&](int64_t r0, int64_t m, float* y, ThreadPool* p) {
          kern::fast::linear_fp8(x.data() + r0 * s.k, m, w8.view, y, p);
        });
        expect_fast_bits("fp4" + shape, want4, s.m, s.n, [&](int64_t r0, int64_t m, float* y, ThreadPool* p) {
          kern::fast::linear_fp4(x.data() + r0 * s.k, m, w4.view, y, p);
        });
        // Repacked layouts (each ISA its own).
        IsaGuard guard;
        for (kern::Isa isa : isas()) {
          kern::set_isa(isa);
          std::vector<uint8_t> b8, b4;
          auto p8 = w8.view;
          auto p4 = w4.view;
          if (uint8_t* d = pack_for(p8, b8)) kern::pack_weight(p8, d);
          if (uint8_t* d = pack_for(p4, b4)) kern::pack_weight(p4, d);
          std::vector<float> got8(want8.size()), got4(want4.size());
          kern::fast::linear_fp8(x.data(), s.m, p8, got8.data());
          kern::fast::linear_fp4(x.data(), s.m, p4, got4.data());
          ASSERT_EQ(0, std::memcmp(got8.data(), want8.data(), want8.size() * 4)) << "fp8 repacked " << kern::isa_name(isa) << shape;
          ASSERT_EQ(0, std::memcmp(got4.data(), want4.data(), want4.size() * 4)) << "fp4 repacked " << kern::isa_name(isa) << shape;
        }
      }
    }
  std::printf("fast linear_fp8: %lld of %lld outputs differ from the exact block sums\n", (long long)differ_from_exact,
              (long long)total);
  EXPECT_GT(differ_from_exact, 0) << "the wide-range blocks should make some fp32 block sums round";
}

TEST(KernelsFast, LinearFp8Bf16) {
  std::mt19937 g(79);
  int64_t differ_from_exact = 0, total = 0;
  for (int rep = 0; rep < 2; ++rep)
    for (const Shape& s : kShapes) {
      const bool extreme = rep == 1;
      const int64_t n = (s.n + 31) / 32 * 32 * 2;  // whole 32-row groups: the model takes views of them
      auto w = make_fp8(g, n, s.k, extreme);
      auto x = make_activations(g, s.m * s.k, extreme);
      if (extreme) x[0] = 0x1p-120f, x[1] = -3e30f;  // a flushed value; a large block scale
      const std::string shape = " m=" + std::to_string(s.m) + " n=" + std::to_string(n) + " k=" + std::to_string(s.k);
      std::vector<float> want(size_t(s.m * n)), exact(want.size());
      ref::fast::linear_fp8_bf16(x.data(), s.m, w.view, want.data());
      ref::linear_fp8_dequant(x.data(), s.m, w.view, exact.data());
      for (size_t j = 0; j < exact.size(); ++j) differ_from_exact += bits(exact[j]) != bits(want[j]);
      total += int64_t(exact.size());
      expect_fast_bits("fp8_bf16" + shape, want, s.m, n, [&](int64_t r0, int64_t m, float* y, ThreadPool* p) {
        kern::fast::linear_fp8_bf16(x.data() + r0 * s.k, m, w.view, y, p);
      });
      // On the FP8 linears' repacked layout, whole and as the model's views of the second group.
      IsaGuard guard;
      for (kern::Isa isa : isas()) {
        kern::set_isa(isa);
        std::vector<uint8_t> buf;
        auto pw = w.view;
        if (uint8_t* d = pack_for(pw, buf)) kern::pack_weight(pw, d);
        std::vector<float> got(want.size()), half(size_t(s.m * n / 2));
        kern::fast::linear_fp8_bf16(x.data(), s.m, pw, got.data());
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4)) << "repacked " << kern::isa_name(isa) << shape;
        const ref::Fp8Weight view = kern::fp8_rows(pw, n / 2, n / 2);
        EXPECT_EQ(view.packed != nullptr, pw.packed != nullptr);
        kern::fast::linear_fp8_bf16(x.data(), s.m, view, half.data());
        for (int64_t r = 0; r < s.m; ++r)
          ASSERT_EQ(0, std::memcmp(half.data() + r * n / 2, want.data() + r * n + n / 2, size_t(n / 2) * 4))
              << "row view " << kern::isa_name(isa) << shape;
      }
    }
  std::printf("fast linear_fp8_bf16: %lld of %lld outputs differ from the exact wo_a\n", (long long)differ_from_exact,
              (long long)total);
  EXPECT_GT(differ_from_exact, 0);
}

TEST(KernelsFast, LinearBf16AndF32) {
  std::mt19937 g(80);
  const Shape shapes[] = {{1, 1, 32}, {1, 17, 48}, {2, 33, 64}, {3, 24, 256}, {7, 100, 1024}, {64, 19, 96},
                          {129, 9, 64}, {13, 37, 1056}, {1, 300, 2048}, {5, 7, 40}, {4, 9, 7}};
  for (const Shape& s : shapes) {
    std::vector<uint16_t> wb(size_t(s.n * s.k));
    for (auto& v : wb) v = f32_to_bf16(std::normal_distribution<float>()(g) / std::sqrt(float(s.k)));
    const auto wf = random_floats(g, s.n * s.k, false);
    const ref::Bf16Weight bw{wb.data(), s.n, s.k};
    const ref::F32Weight fw{wf.data(), s.n, s.k};
    const auto xb = random_floats(g, s.m * s.k, true), xf = random_floats(g, s.m * s.k, false);
    const std::string shape = " m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k);
    for (bool round_out : {false, true})
      for (const auto* x : {&xb, &xf}) {  // x that is not bf16-valued is rounded first
        std::vector<float> want(size_t(s.m * s.n));
        ref::fast::linear_bf16(x->data(), s.m, bw, want.data(), round_out);
        expect_fast_bits("bf16" + shape, want, s.m, s.n, [&](int64_t r0, int64_t m, float* y, ThreadPool* p) {
          kern::fast::linear_bf16(x->data() + r0 * s.k, m, bw, y, round_out, p);
        });
      }
    std::vector<float> want(size_t(s.m * s.n));
    ref::fast::linear_f32(xf.data(), s.m, fw, want.data());
    expect_fast_bits("f32" + shape, want, s.m, s.n, [&](int64_t r0, int64_t m, float* y, ThreadPool* p) {
      kern::fast::linear_f32(xf.data() + r0 * s.k, m, fw, y, p);
    });
  }
}

// Pair-lane sums treat denormals as vdpbf16ps does (inputs as zero, results flushed): tiny
// operands whose products and sums fall below 2^-126.
TEST(KernelsFast, PairLanesFlushDenormals) {
  std::mt19937 g(81);
  const int64_t n = 40, k = 256;
  std::vector<uint16_t> wb(static_cast<size_t>(n * k));
  std::vector<float> x(static_cast<size_t>(k));
  for (auto& v : wb) v = f32_to_bf16(std::ldexp(std::normal_distribution<float>()(g), -60 - int(g() % 10)));
  for (auto& v : x) v = round_bf16(std::ldexp(std::normal_distribution<float>()(g), -60 - int(g() % 10)));
  for (int i = 0; i < 8; ++i) x[size_t(i)] = bf16_to_f32(uint16_t(1 + g() % 100));  // bf16 denormals
  const ref::Bf16Weight bw{wb.data(), n, k};
  std::vector<float> want(static_cast<size_t>(n));
  ref::fast::linear_bf16(x.data(), 1, bw, want.data(), false);
  int flushed = 0;
  for (int64_t j = 0; j < n; ++j) {
    double exact = 0;
    for (int64_t i = 0; i < k; ++i) exact += double(x[size_t(i)]) * bf16_to_f32(wb[size_t(j * k + i)]);
    flushed += want[size_t(j)] != float(exact);
  }
  EXPECT_GT(flushed, 0) << "the data should produce denormal products";
  expect_fast_bits("bf16 denormals", want, 1, n, [&](int64_t, int64_t m, float* y, ThreadPool* p) {
    kern::fast::linear_bf16(x.data(), m, bw, y, false, p);
  });
}

TEST(KernelsFast, RmsNorm) {
  std::mt19937 g(82);
  for (int64_t n : {16, 64, 100, 1024, 8192}) {
    const auto x = random_floats(g, 3 * n, true);
    std::vector<uint16_t> w(static_cast<size_t>(n));
    for (auto& v : w) v = f32_to_bf16(1 + 0.1f * std::normal_distribution<float>()(g));
    std::vector<float> want(static_cast<size_t>(n)), want_s(3), got(static_cast<size_t>(n)), got_s(3);
    ref::fast::rms_norm(x.data(), w.data(), n, 1e-20f, want.data());
    ref::fast::rms_scales(x.data(), n, 3, n, 1e-6f, want_s.data());
    IsaGuard guard;
    for (kern::Isa isa : isas()) {
      kern::set_isa(isa);
      kern::fast::rms_norm(x.data(), w.data(), n, 1e-20f, got.data());
      kern::fast::rms_scales(x.data(), n, 3, n, 1e-6f, got_s.data());
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4)) << kern::isa_name(isa) << " n=" << n;
      EXPECT_EQ(0, std::memcmp(got_s.data(), want_s.data(), 12)) << kern::isa_name(isa) << " n=" << n;
      EXPECT_NEAR(got_s[0], ref::rms_scale(x.data(), n, 1e-6f), 1e-5f * got_s[0]);
    }
  }
}

TEST(KernelsFast, SparseAttention) {
  IsaGuard guard;
  std::mt19937 g(83);
  struct A {
    int h, d;
    int64_t rows;
    int skips;  // 0 random, 1 decode-like list, 2 none live, 3 first chunk none live
  };
  int64_t differ_from_exact = 0, total = 0;
  for (const A& a : {A{1, 8, 1, 0}, A{3, 13, 5, 0}, A{8, 64, 64, 0}, A{9, 32, 65, 0}, A{16, 128, 130, 0}, A{4, 512, 200, 0},
                     A{2, 16, 0, 0}, A{16, 512, 640, 1}, A{5, 48, 300, 1}, A{3, 32, 130, 2}, A{4, 64, 200, 3}, A{6, 96, 150, 0},
                     A{8, 512, 201, 1}, A{16, 512, 383, 0}, A{64, 512, 129, 3}, A{17, 96, 63, 0}, A{2, 32, 1, 0}, A{12, 64, 0, 0}}) {
    const auto q = random_floats(g, int64_t(a.h) * a.d, true);
    std::vector<std::vector<float>> store;
    std::vector<const float*> rows(size_t(a.rows));
    for (int64_t j = 0; j < a.rows; ++j) {
      store.push_back(random_floats(g, a.d, true));
      bool skip = g() % 5 == 0;
      if (a.skips == 1) skip = (j >= 37 && j < 128) || j >= 128 + 45;
      if (a.skips == 2) skip = true;
      if (a.skips == 3) skip = j < 64 || g() % 7 == 0;
      rows[size_t(j)] = skip ? nullptr : store.back().data();
    }
    std::vector<float> sink(size_t(a.h));
    for (auto& s : sink) s = std::normal_distribution<float>()(g);
    const float scale = 1.f / std::sqrt(float(a.d));
    std::vector<float> want(size_t(a.h * a.d)), exact(want.size());
    ref::fast::sparse_attention(q.data(), a.h, a.d, rows.data(), a.rows, sink.data(), scale, want.data());
    ref::sparse_attention(q.data(), a.h, a.d, rows.data(), a.rows, sink.data(), scale, exact.data());
    for (size_t i = 0; i < want.size(); ++i) {
      differ_from_exact += bits(want[i]) != bits(exact[i]);
      EXPECT_NEAR(want[i], exact[i], 2e-2f * std::fabs(exact[i]) + 1e-3f);
    }
    total += int64_t(want.size());
    for (kern::Isa isa : isas()) {
      kern::set_isa(isa);
      std::vector<float> got(want.size(), -1.f);
      kern::fast::sparse_attention(q.data(), a.h, a.d, rows.data(), a.rows, sink.data(), scale, got.data());
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
          << kern::isa_name(isa) << " h=" << a.h << " d=" << a.d << " rows=" << a.rows;
      // The rows as bf16 (they are bf16-valued here): the same bits.
      std::vector<std::vector<uint16_t>> store16;
      std::vector<const uint16_t*> rows16(size_t(a.rows));
      for (int64_t j = 0; j < a.rows; ++j) {
        if (!rows[size_t(j)]) continue;
        store16.emplace_back(size_t(a.d));
        for (int i = 0; i < a.d; ++i) store16.back()[size_t(i)] = f32_to_bf16(rows[size_t(j)][i]);
        rows16[size_t(j)] = store16.back().data();
      }
      std::fill(got.begin(), got.end(), -1.f);
      kern::fast::sparse_attention_bf16(q.data(), a.h, a.d, rows16.data(), a.rows, sink.data(), scale, got.data());
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
          << "bf16 rows " << kern::isa_name(isa) << " h=" << a.h << " d=" << a.d << " rows=" << a.rows;
    }
  }
  std::printf("fast sparse_attention: %lld of %lld outputs differ from the exact mode's\n", (long long)differ_from_exact,
              (long long)total);
}

#if defined(__x86_64__)
// vdpbf16ps against the contract's scalar step (ref::fast::fma_daz_ftz, odd element first) on
// random, cancelling, tiny and denormal operands. Runs where the CPU has AVX512_BF16.
__attribute__((target("avx512f,avx512bf16"))) static void dpbf16(float* acc, const uint16_t* a, const uint16_t* b) {
  __m512 r = _mm512_dpbf16_ps(_mm512_loadu_ps(acc), (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
  _mm512_storeu_ps(acc, r);
}
TEST(KernelsFast, Vdpbf16psMatchesContract) {
  if (!kern::isa_supported(kern::Isa::Avx512)) GTEST_SKIP() << "no AVX512_BF16 on this CPU";
  std::mt19937 g(84);
  int64_t lanes = 0;
  for (int kind = 0; kind < 4; ++kind)
    for (int it = 0; it < 50000; ++it) {
      uint16_t a[32], b[32];
      float acc[16], want[16];
      auto draw = [&](int k) -> uint16_t {
        if (kind == 3 && g() % 3 == 0) return uint16_t((g() & 0x8000) | (g() & 127));  // denormal
        const int e = kind == 0 ? 127 + int(g() % 40) - 20 : kind == 1 ? 127 + int(g() % 4) : 127 - 63 + int(g() % 6) - 3;
        return uint16_t((g() & 0x8000) | (uint32_t(std::max(e, 0)) << 7) | (g() & 127));
      };
      for (int i = 0; i < 32; ++i) a[i] = draw(0), b[i] = draw(1);
      for (int l = 0; l < 16; ++l) {
        acc[l] = kind == 2 ? std::ldexp(std::normal_distribution<float>()(g), -126) : bf16_to_f32(draw(2)) * 1.25f;
        want[l] = ref::fast::fma_daz_ftz(bf16_to_f32(a[2 * l]), bf16_to_f32(b[2 * l]),
                                          ref::fast::fma_daz_ftz(bf16_to_f32(a[2 * l + 1]), bf16_to_f32(b[2 * l + 1]), acc[l]));
      }
      dpbf16(acc, a, b);
      for (int l = 0; l < 16; ++l, ++lanes)
        ASSERT_EQ(bits(acc[l]), bits(want[l])) << "kind " << kind << " lane " << l << ": " << acc[l] << " vs " << want[l];
    }
  std::printf("vdpbf16ps: %lld lanes equal the contract's step\n", (long long)lanes);
}
#endif
