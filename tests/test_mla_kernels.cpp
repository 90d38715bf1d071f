// The MLA attention kernels (kernels/cpu/mla.h): every ISA path gives its scalar definition's bits,
// for row counts and widths around the vector blocks, with rows scattered in memory as cache pages
// hold them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtypes.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/mla.h"
#include "kernels/cpu/ref_ops.h"
#include "kernel_test_util.h"

using namespace di;
using di::test::IsaGuard;
using di::test::isas;

namespace {

struct Rows {
  std::vector<std::vector<float>> store;
  std::vector<const float*> ptrs;
  std::vector<float> p;
};

// n rows of `width` values (not bf16-valued, so that products round), p from a softmax-like range.
Rows make_rows(int64_t n, int64_t width, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0, 1);
  std::uniform_real_distribution<float> ud(0, 1);
  Rows r;
  for (int64_t t = 0; t < n; ++t) {
    r.store.emplace_back(size_t(width + 3));
    for (auto& v : r.store.back()) v = nd(g);
    r.p.push_back(ud(g) / float(n));
  }
  for (int64_t t = n - 1; t >= 0; --t) r.ptrs.push_back(r.store[size_t(t)].data() + (t % 3));  // any order, misaligned
  return r;
}

}  // namespace

TEST(MlaKernels, PvMatchesDefinitionOnEveryIsa) {
  IsaGuard guard;
  int checked = 0;
  for (int64_t n : {1, 2, 7, 70})
    for (int64_t width : {1, 15, 16, 17, 127, 128, 129, 200, 512, 576}) {
      const Rows r = make_rows(n, width, uint32_t(n * 1000 + width));
      std::vector<float> want(static_cast<size_t>(width)), got(static_cast<size_t>(width), -1.0f);
      std::vector<double> want64(static_cast<size_t>(width)), got64(static_cast<size_t>(width), -1.0);
      kern::mla::ref_pv_f32(r.p.data(), r.ptrs.data(), n, width, want.data());
      kern::mla::ref_pv_f64(r.p.data(), r.ptrs.data(), n, width, want64.data());
      // The definition is the plain recurrence.
      for (int64_t c = 0; c < width; ++c) {
        float s = 0;
        double d = 0;
        for (int64_t t = 0; t < n; ++t) {
          const float prod = r.p[size_t(t)] * r.ptrs[size_t(t)][c];
          s = s + prod;
          d += double(r.p[size_t(t)]) * double(r.ptrs[size_t(t)][c]);
        }
        ASSERT_EQ(want[size_t(c)], s);
        ASSERT_EQ(want64[size_t(c)], d);
      }
      for (kern::Isa isa : isas()) {
        kern::set_isa(isa);
        kern::mla::pv_f32(r.p.data(), r.ptrs.data(), n, width, got.data());
        kern::mla::pv_f64(r.p.data(), r.ptrs.data(), n, width, got64.data());
        EXPECT_EQ(std::memcmp(want.data(), got.data(), size_t(width) * 4), 0) << kern::isa_name(isa) << " n " << n << " w " << width;
        EXPECT_EQ(std::memcmp(want64.data(), got64.data(), size_t(width) * 8), 0) << kern::isa_name(isa) << " n " << n << " w " << width;
        ++checked;
      }
    }
  EXPECT_GE(checked, 40);
}

// A product that rounds: the kernel must not fuse it with the sum.
TEST(MlaKernels, PvRoundsEachProductBeforeTheSum) {
  const float a = 1.0f + 0x1p-23f, b = 1.0f - 0x1p-23f;  // a * b = 1 - 2^-46: rounds to 1
  std::vector<float> row0(16, a), row1(16, -1.0f);
  const float* rows[2] = {row0.data(), row1.data()};
  const float p[2] = {b, 1.0f};
  IsaGuard guard;
  for (kern::Isa isa : isas()) {
    kern::set_isa(isa);
    std::vector<float> o(16, 7.0f);
    kern::mla::pv_f32(p, rows, 2, 16, o.data());
    for (float v : o) EXPECT_EQ(v, 0.0f) << kern::isa_name(isa);  // fused would give -2^-46
  }
}

// Column dot products: each output is ref::fast::dot_fma_lanes of x with one column, on every ISA,
// for K and N around the 16-wide blocks (partial lanes, partial column blocks, a row stride > N).
TEST(MlaKernels, ColumnDotsMatchFmaLanesOnEveryIsa) {
  std::mt19937 g(5);
  std::normal_distribution<float> nd(0, 1);
  IsaGuard guard;
  for (int64_t K : {1, 15, 16, 17, 128, 130})
    for (int64_t N : {1, 16, 17, 128, 130}) {
      const int64_t ldw = N + 3;
      std::vector<float> x(static_cast<size_t>(K)), w(static_cast<size_t>(K * ldw)), col(static_cast<size_t>(K));
      for (auto& v : x) v = nd(g);
      for (auto& v : w) v = nd(g);
      std::vector<float> want(static_cast<size_t>(N)), got(static_cast<size_t>(N));
      for (int64_t j = 0; j < N; ++j) {
        for (int64_t k = 0; k < K; ++k) col[size_t(k)] = w[size_t(k * ldw + j)];
        want[size_t(j)] = ref::fast::dot_fma_lanes(x.data(), col.data(), K);
      }
      for (kern::Isa isa : isas()) {
        kern::set_isa(isa);
        std::fill(got.begin(), got.end(), -1.0f);
        kern::mla::dot_fma_lanes_cols(x.data(), w.data(), K, N, ldw, got.data());
        EXPECT_EQ(std::memcmp(want.data(), got.data(), size_t(N) * 4), 0) << kern::isa_name(isa) << " K " << K << " N " << N;
      }
    }
}

// Scores against scattered rows: each is ref::fast::dot_fma_lanes, on every ISA, for row counts
// around the 16-row blocks and K with partial lanes (the rope part starts at an offset).
TEST(MlaKernels, RowDotsMatchFmaLanesOnEveryIsa) {
  std::mt19937 g(6);
  std::normal_distribution<float> nd(0, 1);
  IsaGuard guard;
  for (int64_t n : {1, 5, 16, 17, 33, 70})
    for (int64_t K : {1, 15, 16, 17, 64, 512, 520}) {
      const int64_t offset = 7;
      std::vector<std::vector<float>> store;
      std::vector<const float*> rows;
      for (int64_t t = 0; t < n; ++t) {
        store.emplace_back(static_cast<size_t>(K + offset));
        for (auto& v : store.back()) v = nd(g);
      }
      for (int64_t t = 0; t < n; ++t) rows.push_back(store[size_t((t * 7) % n)].data());
      std::vector<float> q(static_cast<size_t>(K)), want(static_cast<size_t>(n)), got(static_cast<size_t>(n));
      for (auto& v : q) v = nd(g);
      for (int64_t t = 0; t < n; ++t) want[size_t(t)] = ref::fast::dot_fma_lanes(q.data(), rows[size_t(t)] + offset, K);
      for (kern::Isa isa : isas()) {
        kern::set_isa(isa);
        std::fill(got.begin(), got.end(), -1.0f);
        kern::mla::dot_fma_lanes_rows(q.data(), rows.data(), offset, K, n, got.data());
        EXPECT_EQ(std::memcmp(want.data(), got.data(), size_t(n) * 4), 0) << kern::isa_name(isa) << " n " << n << " K " << K;
      }
    }
}
