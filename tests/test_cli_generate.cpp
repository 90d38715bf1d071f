// `deepinfer generate` end to end, through the built binary: JSON output, logit dump, reference
// quirk switch, and error handling.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <unistd.h>

#include "io/safetensors.h"
#include "test_paths.h"

using namespace di;

namespace {

struct RunResult {
  int status;
  std::string out;
};

RunResult run(const std::string& args) {
  const std::string cmd = std::string(DI_BINARY_DIR) + "/deepinfer " + args + " 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p.get())) > 0) out.append(buf.data(), n);
  const int st = pclose(p.release());
  return {WEXITSTATUS(st), out};
}

std::string ids_csv(const TensorView& t) {
  std::string s;
  for (int64_t i = 0; i < t.numel(); ++i) s += (i ? "," : "") + std::to_string(t.as<int32_t>()[i]);
  return s;
}

TEST(CliGenerate, GoldenPromptJsonAndLogitDump) {
  // official.p3 is bit-exact to the reference end to end, so free-running greedy reproduces the
  // golden tokens and the dumped logits equal the golden ones.
  Checkpoint g = Checkpoint::open(test::golden_expected());
  const std::string dump = (std::filesystem::temp_directory_path() / ("di_generate_logits_" + std::to_string(::getpid()) + ".safetensors")).string();
  const auto r = run("generate --model " + test::golden_model_dir() + " --tokenizer " + test::v3_tokenizer_json() +
                     " --prompt-ids " + ids_csv(g.get("prompts.p3.tokens")) +
                     " --max-tokens 17 --ignore-eos --reference-quirk --json --dump-logits " + dump);
  ASSERT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  const auto& greedy = g.get("official.p3.greedy");
  std::vector<int32_t> expect(greedy.as<int32_t>(), greedy.as<int32_t>() + 17);
  EXPECT_EQ(j["generated_ids"].get<std::vector<int32_t>>(), expect);
  EXPECT_GT(j["timings"]["decode_tokens_per_s"].get<double>(), 0.0);

  Checkpoint d = Checkpoint::open(dump);
  const auto& l = d.get("logits");
  ASSERT_EQ(l.shape, (std::vector<int64_t>{17, 129280}));
  const auto& gl = g.get("official.p3.logits");
  for (int64_t i = 0; i < 2 * 129280; ++i) ASSERT_NEAR(l.as<float>()[i], gl.as<float>()[i], 1e-5) << i;
  std::filesystem::remove(dump);
}

TEST(CliGenerate, ClearErrors) {
  auto r = run("generate --model /nonexistent/dir --prompt-ids 1,2");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("/nonexistent/dir"), std::string::npos) << r.out;
  r = run("generate --model " + test::golden_model_dir() + " --tokenizer " + test::v3_tokenizer_json() + " --prompt-ids 1,x");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--prompt-ids"), std::string::npos) << r.out;
  r = run("generate --model " + test::golden_model_dir() + " --tokenizer " + test::v3_tokenizer_json() + " --prompt-ids 999999");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("vocab"), std::string::npos) << r.out;
}

}  // namespace
