// DeepSeek-V3 load switches (LoadOptions::arch_options): head=fp8 quantizes the BF16 lm_head at
// load (ops.h quantize_fp8_blocks); unknown keys and values are load errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtypes.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "model/v3/model.h"
#include "model/v3/ops.h"
#include "test_v3_paths.h"

using namespace di;

TEST(V3LoadOptions, QuantizeFp8BlocksIsTheReleaseRule) {
  const int64_t out = 130, in = 200;  // partial blocks at both edges
  std::vector<uint16_t> w(size_t(out * in));
  for (int64_t i = 0; i < out * in; ++i) w[size_t(i)] = f32_to_bf16(std::sin(0.37f * float(i)) * (1.0f + float(i % 7)));
  for (int64_t r = 128; r < 130; ++r)  // an all-zero edge block
    for (int64_t k = 128; k < in; ++k) w[size_t(r * in + k)] = 0;
  std::vector<uint8_t> codes(w.size());
  std::vector<float> scales(4);
  v3::quantize_fp8_blocks(w.data(), out, in, codes.data(), scales.data(), nullptr);
  for (int64_t bo = 0; bo < 2; ++bo)
    for (int64_t bi = 0; bi < 2; ++bi) {
      float amax = 0;
      for (int64_t r = bo * 128; r < std::min(out, bo * 128 + 128); ++r)
        for (int64_t k = bi * 128; k < std::min(in, bi * 128 + 128); ++k) amax = std::max(amax, std::fabs(bf16_to_f32(w[size_t(r * in + k)])));
      const float s = amax > 0 ? amax / 448.0f : 1.0f;
      if (bo == 1 && bi == 1) {
        EXPECT_EQ(amax, 0.0f);
      }
      ASSERT_EQ(scales[size_t(bo * 2 + bi)], s);
      for (int64_t r = bo * 128; r < std::min(out, bo * 128 + 128); ++r)
        for (int64_t k = bi * 128; k < std::min(in, bi * 128 + 128); ++k)
          ASSERT_EQ(codes[size_t(r * in + k)], f32_to_e4m3(bf16_to_f32(w[size_t(r * in + k)]) / s)) << r << "," << k;
    }
}

TEST(V3LoadOptions, Fp8HeadIsCloseToTheBf16Head) {
  LoadOptions lo;
  auto ref = load_model(test::v3_golden_model_dir(), lo);
  lo.arch_options["head"] = "fp8";
  auto q = load_model(test::v3_golden_model_dir(), lo);
  EXPECT_NE(ref->info().cache_format, q->info().cache_format);
  const std::vector<int32_t> prompt = {0, 1000, 2000, 3000, 4000};
  auto run = [&](const Model& m) {
    auto st = m.new_state({});
    auto ws = m.new_workspace();
    std::vector<float> logits;
    BatchItem it{st.get(), prompt, false, &logits};
    m.forward_batch(std::span<BatchItem>(&it, 1), *ws);
    return logits;
  };
  const auto a = run(*ref), b = run(*q);
  ASSERT_EQ(a.size(), b.size());
  double amax = 0, dmax = 0;
  int differ = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    amax = std::max(amax, double(std::fabs(a[i])));
    dmax = std::max(dmax, double(std::fabs(a[i] - b[i])));
    differ += a[i] != b[i];
  }
  EXPECT_GT(differ, int(a.size() / 2)) << "the head was not quantized";
  EXPECT_LT(dmax, 0.1 * amax) << "FP8 (3 mantissa bits) errors are a few percent of a logit";
  EXPECT_EQ(std::max_element(a.begin(), a.end()) - a.begin(), std::max_element(b.begin(), b.end()) - b.begin());
}

TEST(V3LoadOptions, UnknownOptionsAreLoadErrors) {
  LoadOptions lo;
  lo.arch_options["head"] = "fp4";
  EXPECT_THROW(load_model(test::v3_golden_model_dir(), lo), LoadError);
  lo.arch_options.clear();
  lo.arch_options["index_key_policy"] = "reference";  // a V4.1 switch
  EXPECT_THROW(load_model(test::v3_golden_model_dir(), lo), LoadError);
}
