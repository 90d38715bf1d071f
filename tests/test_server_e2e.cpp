// End to end: `deepinfer serve` on a generated tiny model, driven by the real `openai` npm client
// (tests/e2e/openai_client.mjs): chat, completions, streaming, include_usage, tools, n>1, logprobs,
// seed reproducibility, stop strings, errors, cancellation by closing the stream.
#include <gtest/gtest.h>

#include <sstream>

#include "server_process.h"

namespace di::test {
namespace {

TEST(ServerE2E, OpenAiClient) {
  const std::string problem = node_problem();
  ASSERT_TRUE(problem.empty()) << problem;
  const std::string model = e2e_model_dir();
  ServerProcess srv({model, "--port", "0", "--served-model-name", "tiny-e2e", "--enable-test-hooks", "--api-key", "e2e-key",
                     "--sse-keepalive", "1", "--io-threads", "2"});
  ASSERT_TRUE(srv.wait_healthy(120)) << srv.log();
  EXPECT_NE(srv.log().find("loading model"), std::string::npos);
  EXPECT_NE(srv.log().find("model loaded in"), std::string::npos);

  std::string out;
  const int rc = run_command("node " + std::string(DI_SOURCE_DIR) + "/tests/e2e/openai_client.mjs " + srv.url() + " tiny-e2e e2e-key", out);
  EXPECT_EQ(rc, 0) << out << "\n--- server log ---\n" << srv.log();
  EXPECT_NE(out.find("checks passed"), std::string::npos) << out;
  std::cout << out;

  // One log line per request, with its token counts and finish reason.
  const std::string log = srv.log();
  size_t request_lines = 0;
  std::istringstream in(log);
  std::string line;
  while (std::getline(in, line))
    if (line.find("status=") != std::string::npos && line.find(" prompt=") != std::string::npos &&
        line.find(" finish=") != std::string::npos)
      ++request_lines;
  EXPECT_GE(request_lines, 18u) << log;  // the client script sends 19 generation requests
  EXPECT_EQ(srv.stop(), 0) << srv.log();
}

}  // namespace
}  // namespace di::test
