// `deepinfer generate` end to end, through the built binary: JSON output, logit dump, reference
// quirk switch, text streaming, sampling options, and error handling.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <unistd.h>

#include "io/safetensors.h"
#include "test_paths.h"
#include "tokenizer/tokenizer.h"

using namespace di;

namespace {

struct RunResult {
  int status;
  std::string out;
};

// stdout, with stderr where `stderr_to` sends it (default: merged).
RunResult run(const std::string& args, const std::string& stderr_to = "&1") {
  const std::string cmd = std::string(DI_BINARY_DIR) + "/deepinfer " + args + " 2>" + stderr_to;
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

std::string golden_args() {
  return "generate --model " + test::golden_model_dir() + " --tokenizer " + test::v3_tokenizer_json() + " --threads 2";
}

std::string p3_ids() { return ids_csv(Checkpoint::open(test::golden_expected()).get("prompts.p3.tokens")); }

std::vector<int32_t> generated_ids(const std::string& out) {
  return nlohmann::json::parse(out.substr(out.find('{')))["generated_ids"].get<std::vector<int32_t>>();
}

TEST(CliGenerate, GoldenPromptJsonAndLogitDump) {
  // official.p3 is bit-exact to the reference end to end, so free-running greedy reproduces the
  // golden tokens and the dumped logits equal the golden ones, in both numerics modes.
  Checkpoint g = Checkpoint::open(test::golden_expected());
  const auto& greedy = g.get("official.p3.greedy");
  const std::vector<int32_t> expect(greedy.as<int32_t>(), greedy.as<int32_t>() + 17);
  const auto& gl = g.get("official.p3.logits");
  for (const char* numerics : {"fast", "exact"}) {
    SCOPED_TRACE(numerics);
    const std::string dump = (std::filesystem::temp_directory_path() /
                              ("di_generate_logits_" + std::to_string(::getpid()) + ".safetensors")).string();
    const auto r = run(golden_args() + " --prompt-ids " + p3_ids() + " --numerics " + numerics +
                       " --max-tokens 17 --ignore-eos --reference-quirk --json --dump-logits " + dump);
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
    EXPECT_EQ(j["generated_ids"].get<std::vector<int32_t>>(), expect);
    EXPECT_EQ(j["finish_reason"], "length");
    EXPECT_EQ(j["timings"]["decode_steps"], 16);
    EXPECT_GT(j["timings"]["prefill_tokens_per_s"].get<double>(), 0.0);
    EXPECT_GT(j["timings"]["decode_tokens_per_s"].get<double>(), 0.0);

    Checkpoint d = Checkpoint::open(dump);
    const auto& l = d.get("logits");
    ASSERT_EQ(l.shape, (std::vector<int64_t>{17, 129280}));
    for (int64_t i = 0; i < 2 * 129280; ++i) ASSERT_NEAR(l.as<float>()[i], gl.as<float>()[i], 1e-5) << i;
    std::filesystem::remove(dump);
  }
}

// Text mode streams the prompt and then the decoded completion to stdout, and the timing line to
// stderr; the completion is the text of the tokens --json reports.
TEST(CliGenerate, TextModeStreamsTheCompletionAndTimings) {
  const std::string err = (std::filesystem::temp_directory_path() / ("di_generate_err_" + std::to_string(::getpid()))).string();
  const auto text = run(golden_args() + " --prompt Hello -n 8 --ignore-eos", err);
  ASSERT_EQ(text.status, 0) << text.out;
  const auto js = run(golden_args() + " --prompt Hello -n 8 --ignore-eos --json");
  ASSERT_EQ(js.status, 0) << js.out;
  const auto ids = generated_ids(js.out);
  ASSERT_EQ(ids.size(), 8u);
  const auto tok = Tokenizer::from_file(test::v3_tokenizer_json());
  EXPECT_EQ(text.out, "Hello" + tok->decode(ids) + "\n");
  std::ifstream f(err);
  const std::string timings((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::filesystem::remove(err);
  EXPECT_NE(timings.find("tok/s prefill"), std::string::npos) << timings;
  EXPECT_NE(timings.find("8 generated"), std::string::npos) << timings;
  EXPECT_NE(timings.find("tok/s decode | finish: length]"), std::string::npos) << timings;
}

// Sampling goes through the engine's TokenSampler: a seed fixes the tokens, another seed gives
// others, and top-k 1 or a tiny top-p leave only the greedy token at any temperature.
TEST(CliGenerate, SamplingOptionsReachTheEngineSampler) {
  const std::string base = golden_args() + " --prompt-ids " + p3_ids() + " -n 12 --ignore-eos --json";
  const auto greedy = generated_ids(run(base).out);
  ASSERT_EQ(greedy.size(), 12u);
  const auto a = generated_ids(run(base + " -t 1.5 --seed 7").out);
  EXPECT_EQ(generated_ids(run(base + " -t 1.5 --seed 7").out), a);
  EXPECT_NE(generated_ids(run(base + " -t 1.5 --seed 8").out), a);
  EXPECT_NE(a, greedy);
  EXPECT_EQ(generated_ids(run(base + " -t 1.5 --seed 7 --top-k 1").out), greedy);
  EXPECT_EQ(generated_ids(run(base + " -t 1.5 --seed 7 --top-p 1e-6").out), greedy);
  const auto bad = run(base + " --top-p 0");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("top_p"), std::string::npos) << bad.out;
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
  r = run("generate --model " + test::golden_model_dir() + " --tokenizer " + test::v3_tokenizer_json() + " --prompt-ids 1,2 -n 0");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--max-tokens"), std::string::npos) << r.out;
}

}  // namespace
