// The KV-cache tiers seen from outside: `deepinfer serve` processes sharing one --cache-dir serve
// each other's prefixes, a restarted server serves hits from the directory, usage reports the
// cached tokens, /metrics shows the disk tier, and POST /cache/flush (API-key protected) empties it.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "server_process.h"

using namespace di::test;
namespace fs = std::filesystem;

namespace {

std::string ids_prompt(int n, int from) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) s += (i ? "," : "") + std::to_string(100 + (from + i * 37) % 5000);
  return s + "]";
}

// POST /v1/completions with token ids; returns usage.prompt_tokens_details.cached_tokens.
int cached_tokens(uint16_t port, const std::string& prompt, const std::string& key = "") {
  const std::string auth = key.empty() ? "" : "Authorization: Bearer " + key + "\r\n";
  auto r = fetch(port, "POST", "/v1/completions", R"({"prompt":)" + prompt + R"(,"max_tokens":2,"temperature":0})", auth);
  EXPECT_EQ(r.status, 200) << r.body;
  if (r.status != 200) return -1;
  return nlohmann::json::parse(r.body)["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
}

// Waits until the server's disk writes are published (none queued, at least `min` written).
::testing::AssertionResult writes_settled(uint16_t port, double min) {
  std::map<std::string, double> m;
  for (int i = 0; i < 200; ++i) {
    m = parse_metrics(fetch(port, "GET", "/metrics").body);
    if (m["deepinfer_disk_cache_writes_total"] >= min && m["deepinfer_disk_cache_queued_writes"] == 0)
      return ::testing::AssertionSuccess();
    usleep(50000);
  }
  return ::testing::AssertionFailure() << "disk writes " << m["deepinfer_disk_cache_writes_total"] << ", queued "
                                       << m["deepinfer_disk_cache_queued_writes"];
}

class ServerKvCache : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("di-server-kv-" + std::to_string(::getpid()))).string();
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

TEST_F(ServerKvCache, ServersSharingADirectoryServeEachOthersPrefixesAndSurviveRestarts) {
  const std::string model = e2e_model_dir();
  const std::vector<std::string> common = {model, "--port", "0", "--cache-dir", dir_, "--page-tokens", "32"};
  ServerProcess a(common), b(common);
  ASSERT_TRUE(a.wait_healthy(120)) << a.log();
  ASSERT_TRUE(b.wait_healthy(120)) << b.log();
  const std::string p = ids_prompt(200, 1);
  EXPECT_EQ(cached_tokens(a.port(), p), 0);
  ASSERT_TRUE(writes_settled(a.port(), 6)) << a.log();
  // The other process, whose RAM tier never saw the prompt, reads it from the directory.
  const std::string longer = ids_prompt(200, 1).substr(0, ids_prompt(200, 1).size() - 1) + ",7,8,9,10]";
  EXPECT_GE(cached_tokens(b.port(), longer), 192) << b.log();
  auto mb = parse_metrics(fetch(b.port(), "GET", "/metrics").body);
  EXPECT_GE(mb["deepinfer_disk_cache_pages_read_total"], 6);
  EXPECT_GE(mb["deepinfer_disk_cache_snapshots_read_total"], 1);
  EXPECT_EQ(a.stop(), 0) << a.log();
  EXPECT_EQ(b.stop(), 0) << b.log();

  // A restarted server serves the hit at once.
  ServerProcess c(common);
  ASSERT_TRUE(c.wait_healthy(120)) << c.log();
  EXPECT_GE(cached_tokens(c.port(), longer), 192) << c.log();
  EXPECT_EQ(c.stop(), 0) << c.log();
}

TEST_F(ServerKvCache, FlushNeedsTheKeyAndEmptiesTheTiers) {
  const std::string model = e2e_model_dir();
  ServerProcess s({model, "--port", "0", "--cache-dir", dir_, "--page-tokens", "32", "--api-key", "k1"});
  ASSERT_TRUE(s.wait_healthy(120)) << s.log();
  const std::string p = ids_prompt(100, 2);
  EXPECT_EQ(cached_tokens(s.port(), p, "k1"), 0);
  ASSERT_TRUE(writes_settled(s.port(), 3)) << s.log();
  EXPECT_GT(cached_tokens(s.port(), p, "k1"), 0);
  EXPECT_EQ(fetch(s.port(), "POST", "/cache/flush", "{}").status, 401);
  auto r = fetch(s.port(), "POST", "/cache/flush", "{}", "Authorization: Bearer k1\r\n");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_GT(nlohmann::json::parse(r.body)["entries_removed"].get<int>(), 0);
  size_t files = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir_)) files += e.is_regular_file() && e.path().extension() == ".kv";
  EXPECT_EQ(files, 0u);
  EXPECT_EQ(cached_tokens(s.port(), p, "k1"), 0);
  EXPECT_EQ(s.stop(), 0) << s.log();
}

}  // namespace
