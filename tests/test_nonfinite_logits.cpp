// A checkpoint whose head holds NaN must fail requests with a clear error (engine, metrics counter,
// `deepinfer generate` exit status) instead of sampling garbage tokens.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/numerics.h"
#include "server_process.h"
#include "test_engine_util.h"

using namespace di;
namespace fs = std::filesystem;

namespace {

// A copy of the golden tiny model with every head.weight value set to bf16 NaN.
std::string poisoned_model_dir() {
  static const std::string dir = [] {
    const fs::path d = fs::temp_directory_path() / ("di_nan_head_" + std::to_string(::getpid()));
    fs::remove_all(d);
    fs::copy(test::golden_model_dir(), d, fs::copy_options::recursive);
    const fs::path file = d / "model.safetensors";
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    uint64_t header_len = 0;
    f.read(reinterpret_cast<char*>(&header_len), 8);
    std::string header(header_len, '\0');
    f.read(header.data(), std::streamsize(header_len));
    const auto h = nlohmann::json::parse(header);
    const auto off = h.at("head.weight").at("data_offsets");
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    std::string nan_bytes(end - begin, '\0');
    for (size_t i = 0; i + 1 < nan_bytes.size(); i += 2) nan_bytes[i] = '\xC0', nan_bytes[i + 1] = '\x7F';  // 0x7FC0
    f.seekp(std::streamoff(8 + header_len + begin));
    f.write(nan_bytes.data(), std::streamsize(nan_bytes.size()));
    return d.string();
  }();
  return dir;
}

TEST(NonFiniteLogits, AllFiniteDetectsEveryPosition) {
  std::vector<float> v(1000, 1.5f);
  EXPECT_TRUE(all_finite(v.data(), int64_t(v.size())));
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    for (size_t at : {size_t(0), size_t(7), size_t(8), size_t(998), size_t(999)}) {
      auto w = v;
      w[at] = bad;
      EXPECT_FALSE(all_finite(w.data(), int64_t(w.size()))) << bad << " at " << at;
    }
  }
  v[3] = std::numeric_limits<float>::max();  // large but finite
  EXPECT_TRUE(all_finite(v.data(), int64_t(v.size())));
}

TEST(NonFiniteLogits, EngineFailsTheRequestAndCountsIt) {
  v41::LoadOptions o;
  o.tokenizer_path = test::v3_tokenizer_json();
  std::shared_ptr<const v41::Model> model(v41::Model::load(poisoned_model_dir(), o));
  auto engine = engine::Engine::create(model, engine::EngineOptions{});
  auto rec = std::make_shared<test::Recorder>(2);
  engine::RequestParams p;
  p.prompt = test::slice(test::corpus(), 0, 20);
  p.max_tokens = 8;
  p.n = 2;
  ASSERT_EQ(engine->submit(p, rec).error, engine::SubmitError::None);
  rec->wait();
  for (int c = 0; c < 2; ++c) {
    ASSERT_TRUE(rec->finish[size_t(c)].has_value());
    EXPECT_EQ(rec->finish[size_t(c)]->reason, engine::FinishReason::Error);
    EXPECT_NE(rec->finish[size_t(c)]->error.find("non-finite"), std::string::npos) << rec->finish[size_t(c)]->error;
    EXPECT_TRUE(rec->tokens[size_t(c)].empty());
  }
  // The statistics are published after the step whose events the recorder saw.
  engine::EngineStats st = engine->stats();
  for (int i = 0; i < 500 && st.nonfinite_logits == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    st = engine->stats();
  }
  EXPECT_EQ(st.nonfinite_logits, 1);
  EXPECT_EQ(st.cache_pages_used, 0);
}

TEST(NonFiniteLogits, GenerateExitsNonZero) {
  std::string out;
  const int status = test::run_command(std::string(DI_BINARY_DIR) + "/deepinfer generate --model " + poisoned_model_dir() +
                                           " --tokenizer " + test::v3_tokenizer_json() + " --prompt-ids 0,100,200 --max-tokens 4",
                                       out);
  EXPECT_NE(status, 0) << out;
  EXPECT_NE(out.find("non-finite"), std::string::npos) << out;
}

}  // namespace
