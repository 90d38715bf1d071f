// The serving sampler: processing order, truncation sets, frequencies, logprobs, and the
// counter-based random streams.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include "engine/sampler.h"

using namespace di;
using namespace di::engine;

namespace {

std::vector<float> log_probs(std::vector<double> p) {
  std::vector<float> z;
  for (double v : p) z.push_back(float(std::log(v)));
  return z;
}

// Token frequencies over `draws` independent steps of one stream.
std::vector<double> frequencies(TokenSampler& s, const std::vector<float>& logits, const SamplingParams& p, int draws,
                                uint64_t seed = 7) {
  std::vector<double> f(logits.size(), 0.0);
  SampleInput in;
  in.params = &p;
  in.stream_key = choice_stream_key(seed, 0);
  for (int i = 0; i < draws; ++i) {
    in.step = i;
    f[size_t(s.sample(logits.data(), in, nullptr).token)] += 1.0 / draws;
  }
  return f;
}

std::vector<double> softmax(const std::vector<float>& z, double t = 1.0) {
  double m = *std::max_element(z.begin(), z.end()), sum = 0;
  std::vector<double> p;
  for (float v : z) p.push_back(std::exp((v - m) / t)), sum += p.back();
  for (double& v : p) v /= sum;
  return p;
}

TEST(Sampler, GreedyIsArgmaxWithLowestIndexOnTies) {
  TokenSampler s(6);
  const std::vector<float> z{0.5f, 3.0f, -1.0f, 3.0f, 2.9f, 0.0f};
  SamplingParams p;
  p.temperature = 0;
  SampleInput in;
  in.params = &p;
  EXPECT_EQ(s.sample(z.data(), in, nullptr).token, 1);
}

TEST(Sampler, FrequenciesFollowTheTemperedSoftmax) {
  TokenSampler s(4);
  const std::vector<float> z{0.0f, 1.0f, 2.0f, 0.5f};
  for (float t : {1.0f, 0.5f, 2.0f}) {
    SamplingParams p;
    p.temperature = t;
    const auto f = frequencies(s, z, p, 40000);
    const auto want = softmax(z, t);
    for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(f[i], want[i], 0.012) << "T=" << t << " token " << i;
  }
}

TEST(Sampler, TopKKeepsTheKBestRenormalised) {
  TokenSampler s(5);
  const std::vector<float> z{1.0f, 3.0f, 0.0f, 2.0f, 2.5f};
  SamplingParams p;
  p.top_k = 2;
  const auto f = frequencies(s, z, p, 20000);
  const double a = std::exp(3.0), b = std::exp(2.5);
  EXPECT_NEAR(f[1], a / (a + b), 0.015);
  EXPECT_NEAR(f[4], b / (a + b), 0.015);
  EXPECT_EQ(f[0] + f[2] + f[3], 0.0);
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingTheMass) {
  TokenSampler s(4);
  const auto z = log_probs({0.15, 0.5, 0.05, 0.3});
  SamplingParams p;
  p.top_p = 0.7f;  // 0.5 < 0.7, then 0.8 >= 0.7: tokens 1 and 3
  auto f = frequencies(s, z, p, 20000);
  EXPECT_NEAR(f[1], 0.5 / 0.8, 0.015);
  EXPECT_NEAR(f[3], 0.3 / 0.8, 0.015);
  EXPECT_EQ(f[0] + f[2], 0.0);
  p.top_p = 0.5f;  // the best token alone reaches 0.5
  f = frequencies(s, z, p, 2000);
  EXPECT_EQ(f[0] + f[2] + f[3], 0.0);
}

TEST(Sampler, TopPOverALargeFlatVocabularyGrowsTheSortedSet) {
  // 5000 tokens of nearly equal weight: the kept set is far beyond the first sorted block.
  const int V = 5000;
  TokenSampler s(V);
  std::vector<float> z(V);
  for (int i = 0; i < V; ++i) z[size_t(i)] = float(i % 97) * 1e-3f;
  SamplingParams p;
  p.top_p = 0.9f;
  const auto prob = softmax(z);
  std::vector<int> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return z[size_t(a)] > z[size_t(b)]; });
  std::set<int> allowed;
  double acc = 0;
  for (int t : order) {
    if (acc >= 0.9) break;
    acc += prob[size_t(t)];
    allowed.insert(t);
  }
  ASSERT_GT(allowed.size(), 1000u);
  SampleInput in;
  in.params = &p;
  in.stream_key = choice_stream_key(3, 0);
  std::set<int> seen;
  for (int i = 0; i < 1500; ++i) {
    in.step = i;
    const int t = s.sample(z.data(), in, nullptr).token;
    EXPECT_TRUE(allowed.count(t)) << t;
    seen.insert(t);
  }
  EXPECT_GT(seen.size(), 400u);
}

TEST(Sampler, MinPDropsTokensBelowAFractionOfTheBest) {
  TokenSampler s(4);
  const auto z = log_probs({0.5, 0.3, 0.15, 0.05});
  SamplingParams p;
  p.min_p = 0.5f;  // keeps p >= 0.25
  const auto f = frequencies(s, z, p, 20000);
  EXPECT_NEAR(f[0], 0.5 / 0.8, 0.015);
  EXPECT_NEAR(f[1], 0.3 / 0.8, 0.015);
  EXPECT_EQ(f[2] + f[3], 0.0);
}

TEST(Sampler, LogprobsAreTheFullProcessedDistribution) {
  const int V = 8;
  TokenSampler s(V);
  const std::vector<float> z{0.1f, 1.7f, -2.0f, 0.9f, 0.9f, 3.0f, -0.5f, 1.2f};
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_k = 2;  // truncation does not change logprobs
  p.logprobs = 1;
  p.top_logprobs = 8;
  SampleInput in;
  in.params = &p;
  in.top_logprobs = 8;
  std::vector<TokenLogprob> top;
  const SampleResult r = s.sample(z.data(), in, &top);
  ASSERT_EQ(top.size(), size_t(V));
  double sum = 0;
  const auto want = softmax(z, 0.7);
  for (size_t i = 0; i < top.size(); ++i) {
    sum += std::exp(double(top[i].logprob));
    EXPECT_NEAR(top[i].logprob, std::log(want[size_t(top[i].token)]), 1e-5);
    if (i > 0) {
      EXPECT_GE(top[i - 1].logprob, top[i].logprob);
      if (top[i - 1].logprob == top[i].logprob) EXPECT_LT(top[i - 1].token, top[i].token);
    }
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);
  EXPECT_EQ(top[0].token, 5);
  EXPECT_TRUE(r.token == 5 || r.token == 1) << "top_k = 2";
  EXPECT_NEAR(r.logprob, std::log(want[size_t(r.token)]), 1e-5);
  // Greedy: the untempered processed distribution.
  p.temperature = 0;
  const SampleResult g = s.sample(z.data(), in, &top);
  EXPECT_EQ(g.token, 5);
  EXPECT_NEAR(g.logprob, std::log(softmax(z)[5]), 1e-5);
  in.top_logprobs = 3;
  s.sample(z.data(), in, &top);
  ASSERT_EQ(top.size(), 3u);
  EXPECT_EQ(top[0].token, 5);
  EXPECT_EQ(top[1].token, 1);
  EXPECT_EQ(top[2].token, 7);
}

// Logprob differences expose exactly what the penalties did to the logits.
TEST(Sampler, PenaltiesAndBiasShiftTheLogitsAsSpecified) {
  const int V = 6;
  TokenSampler s(V);
  const std::vector<float> z{2.0f, -2.0f, 0.0f, 0.0f, 1.0f, 0.5f};
  const std::vector<int32_t> prompt{0, 1}, output{3, 3, 3, 4};
  SamplingParams p;
  p.temperature = 0;
  p.logprobs = 1;
  SampleInput in;
  in.params = &p;
  in.prompt = prompt;
  in.output = output;
  in.top_logprobs = V;
  std::vector<TokenLogprob> top;
  auto shifted = [&](int tok) {  // processed logit of tok minus that of token 2 (never penalised)
    s.sample(z.data(), in, &top);
    float a = 0, b = 0;
    for (auto& t : top) {
      if (t.token == tok) a = t.logprob;
      if (t.token == 2) b = t.logprob;
    }
    return a - b;
  };
  p.frequency_penalty = 0.5f;
  EXPECT_NEAR(shifted(3), 0.0f - 3 * 0.5f, 1e-5);
  EXPECT_NEAR(shifted(4), 1.0f - 0.5f, 1e-5);
  p.frequency_penalty = 0;
  p.presence_penalty = 1.5f;
  EXPECT_NEAR(shifted(3), -1.5f, 1e-5);
  EXPECT_NEAR(shifted(4), 1.0f - 1.5f, 1e-5);
  EXPECT_NEAR(shifted(5), 0.5f, 1e-5) << "tokens not in the output are untouched";
  p.presence_penalty = 0;
  p.repetition_penalty = 2.0f;  // prompt and output tokens: positive / 2, negative * 2
  EXPECT_NEAR(shifted(0), 1.0f, 1e-5);
  EXPECT_NEAR(shifted(1), -4.0f, 1e-5);
  EXPECT_NEAR(shifted(4), 0.5f, 1e-5);
  EXPECT_NEAR(shifted(5), 0.5f, 1e-5);
  p.repetition_penalty = 1.0f;
  p.logit_bias = {{1, 10.0f}};
  EXPECT_NEAR(shifted(1), 8.0f, 1e-5);
  EXPECT_EQ(s.sample(z.data(), in, nullptr).token, 1) << "bias makes token 1 the argmax";
  p.logit_bias = {{0, -100.0f}};
  EXPECT_EQ(s.sample(z.data(), in, nullptr).token, 4);
}

TEST(Sampler, StreamsAreReproducibleAndIndependent) {
  const int V = 1000;
  TokenSampler s(V);
  std::vector<float> z(V, 0.0f);  // uniform: any correlation between streams would show
  SamplingParams p;
  SampleInput in;
  in.params = &p;
  auto run = [&](uint64_t seed, int choice) {
    std::vector<int32_t> out;
    in.stream_key = choice_stream_key(seed, choice);
    for (int i = 0; i < 50; ++i) {
      in.step = i;
      out.push_back(s.sample(z.data(), in, nullptr).token);
    }
    return out;
  };
  const auto a = run(42, 0);
  EXPECT_EQ(a, run(42, 0));
  EXPECT_NE(a, run(42, 1));
  EXPECT_NE(a, run(43, 0));
  // Step t of a stream does not depend on what was drawn before it.
  in.stream_key = choice_stream_key(42, 0);
  in.step = 17;
  EXPECT_EQ(s.sample(z.data(), in, nullptr).token, a[17]);
  double mean = 0;
  for (int i = 0; i < 100000; ++i) mean += stream_uniform(choice_stream_key(9, 2), i) / 100000;
  EXPECT_NEAR(mean, 0.5, 0.005);
}

}  // namespace
