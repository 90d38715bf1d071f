// Load: 64 concurrent streaming clients (bench/serve_load.mjs) for a bounded time against
// `deepinfer serve` on a tiny model: no errors, cache back to the prefix-cache level once all finish
// (no page leaked by a request), engine idle, RSS stable between a warm-up run and the measured run
// (allowing for what the prefix cache legitimately keeps).
#include <gtest/gtest.h>

#include "server_process.h"

namespace di::test {
namespace {

TEST(ServerLoad, SixtyFourStreamingClients) {
  const std::string problem = node_problem();
  ASSERT_TRUE(problem.empty()) << problem;
  const std::string model = e2e_model_dir();
  ServerProcess srv({model, "--port", "0", "--served-model-name", "tiny-load", "--max-running", "64", "--cache-mib", "256"});
  ASSERT_TRUE(srv.wait_healthy(120)) << srv.log();
  const std::string load = "node " + std::string(DI_SOURCE_DIR) + "/bench/serve_load.mjs --url " + srv.url() +
                           " --concurrency 64 --max-tokens 8 --prompt-words 24 --endpoint ";

  std::string out;
  ASSERT_EQ(run_command(load + "chat --requests 64", out), 0) << out << srv.log();  // warm-up: allocator pools, caches
  const long rss_warm = srv.rss_kb();
  const double prefix_warm = parse_metrics(fetch(srv.port(), "GET", "/metrics").body)["deepinfer_prefix_cache_bytes"];

  ASSERT_EQ(run_command(load + "completions --duration 20", out), 0) << out << "\n" << srv.log();
  std::cout << out;
  const auto summary = nlohmann::json::parse(out.substr(out.find('{')));
  EXPECT_EQ(summary["errors"], 0) << out;
  EXPECT_GE(summary["requests"].get<int>(), 64) << out;

  // Everything finished: engine idle, every page back in the pool.
  std::map<std::string, double> m;
  for (int i = 0; i < 100; ++i) {
    m = parse_metrics(fetch(srv.port(), "GET", "/metrics").body);
    if (m["deepinfer_num_requests_running"] == 0 && m["deepinfer_cache_bytes_used"] == m["deepinfer_prefix_cache_bytes"]) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(m["deepinfer_num_requests_running"], 0);
  EXPECT_EQ(m["deepinfer_num_requests_waiting"], 0);
  // Only what the prefix cache keeps is still allocated.
  EXPECT_EQ(m["deepinfer_cache_bytes_used"], m["deepinfer_prefix_cache_bytes"]);
  EXPECT_EQ(m["deepinfer_open_streams"], 0);
  EXPECT_EQ(m["deepinfer_request_finished_total{finish_reason=\"error\"}"], 0);

  const long rss_after = srv.rss_kb();
  const long prefix_growth_kb = long((m["deepinfer_prefix_cache_bytes"] - prefix_warm) / 1024);
  std::cout << "server RSS after warm-up " << rss_warm << " kB, after the 20 s run " << rss_after << " kB; prefix cache grew "
            << prefix_growth_kb << " kB\n";
  EXPECT_LT(rss_after, rss_warm + std::max(0L, prefix_growth_kb) + rss_warm / 10 + 16 * 1024)
      << "RSS grew from " << rss_warm << " to " << rss_after << " kB";
  EXPECT_EQ(srv.stop(), 0);
}

}  // namespace
}  // namespace di::test
