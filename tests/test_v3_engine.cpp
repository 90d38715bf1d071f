// The serving engine's scheduler on the V3 golden model through the model interface: batched
// requests, chunked prefill and the prefix cache (V3 pages hold the whole state: no replay) all
// reproduce the official bf16 greedy tokens.
#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/scheduler.h"
#include "model/model.h"
#include "test_engine_util.h"
#include "test_v3_paths.h"

namespace {

struct Prompt {
  std::vector<int32_t> ids, greedy;
};

std::vector<Prompt> golden_prompts() {
  std::ifstream f(di::test::v3_golden_dir() + "/expected/prompts.json");
  const nlohmann::json j = nlohmann::json::parse(f);
  std::vector<Prompt> out;
  for (const auto& p : j) {
    Prompt q{p.at("ids").get<std::vector<int32_t>>(), p.at("bf16_greedy").get<std::vector<int32_t>>()};
    q.greedy.resize(16);
    out.push_back(q);
  }
  return out;
}

const di::Model& model() {
  static std::unique_ptr<di::Model> m = [] {
    di::LoadOptions o;
    o.numerics = di::numerics_from_env(di::Numerics::Fast);
    o.threads = 1;
    return di::load_model(di::test::v3_golden_model_dir(), o);
  }();
  return *m;
}

}  // namespace

TEST(V3Engine, BatchedRequestsAndPrefixCacheGiveOfficialGreedy) {
  const auto prompts = golden_prompts();
  ASSERT_EQ(model().info().arch, "deepseek_v3");
  di::engine::EngineOptions o = di::test::small_options();  // 16-token pages, 48-token steps
  di::engine::Scheduler s(model(), o);
  // All four at once: chunked prefill beside decoding.
  std::vector<std::shared_ptr<di::test::Recorder>> rec;
  for (size_t i = 0; i < prompts.size(); ++i) {
    rec.push_back(std::make_shared<di::test::Recorder>());
    s.add(i + 1, di::test::greedy_request(prompts[i].ids, 16), rec.back(), 0);
  }
  di::test::run_all(s);
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(rec[i]->tokens[0], prompts[i].greedy) << "prompt " << i;
  // Again: the 70-token prompt now starts from 64 cached tokens (4 pages) and resumes with no replay.
  const int64_t hits = s.counters().prefix_hit_tokens;
  auto again = std::make_shared<di::test::Recorder>();
  s.add(100, di::test::greedy_request(prompts[3].ids, 16), again, 0);
  di::test::run_all(s);
  EXPECT_EQ(again->tokens[0], prompts[3].greedy);
  EXPECT_GE(s.counters().prefix_hit_tokens - hits, 64);
}
