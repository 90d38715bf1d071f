// The compiler settings the numerics rely on: IEEE float semantics with no reassociation, no
// contraction, and no miscompiled reduction chains (see CMakeLists.txt).
#include <gtest/gtest.h>

// External linkage and run-time sizes: an internal function would be specialized for its call
// sites, which hides the miscompilation.
namespace di::compiler_check {

// The reduction order of vdpbf16ps (odd element of each pair, then the even one). GCC 12 -O2 with
// its loop vectorizer adds x[k+1]*w[k+1] twice here.
__attribute__((noinline)) float pair_dot_odd_first(const float* x, const float* w, int K) {
  float acc = 0;
  for (int k = 0; k < K; k += 2) {
    acc += x[k + 1] * w[k + 1];
    acc += x[k] * w[k];
  }
  return acc;
}

__attribute__((noinline)) float sum_with_contraction_hazard(float a, float b, float c) { return a * b + c; }

}  // namespace di::compiler_check

using di::compiler_check::pair_dot_odd_first;
using di::compiler_check::sum_with_contraction_hazard;

namespace {
volatile int two = 2, four = 4;
}  // namespace

TEST(Compiler, ReductionChainOutOfMemoryOrder) {
  const float x[4] = {1, 2, 4, 8}, w[4] = {1, 1, 1, 1};
  EXPECT_EQ(pair_dot_odd_first(x, w, two), 3.0f);
  EXPECT_EQ(pair_dot_odd_first(x, w, four), 15.0f);
  // Non-associative values: the sum must follow the written order exactly.
  const float y[4] = {1e8f, 1.0f, -1e8f, 1.0f}, v[4] = {1, 1, 1, 1};
  float expect = 0;
  expect += y[1] * v[1];
  expect += y[0] * v[0];
  expect += y[3] * v[3];
  expect += y[2] * v[2];
  EXPECT_EQ(pair_dot_odd_first(y, v, four), expect);
}

TEST(Compiler, NoFusedMultiplyAdd) {
  // With contraction a*b+c would be one rounding: (1+2^-12)^2 - 1 keeps the 2^-24 term.
  const float a = 1.0f + 1.0f / 4096, c = -1.0f;
  const float product = a * a;  // rounded on its own
  EXPECT_EQ(sum_with_contraction_hazard(a, a, c), product + c);
}
