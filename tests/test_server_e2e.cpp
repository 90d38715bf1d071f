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

// SIGTERM drains: requests that fit in --shutdown-timeout finish, the rest end with OpenAI errors
// (tests/e2e/shutdown_drain.mjs sends the signal and checks what the `openai` client sees).
TEST(ServerE2E, SigtermDrainsThroughOpenAiClient) {
  const std::string problem = node_problem();
  ASSERT_TRUE(problem.empty()) << problem;
  ServerProcess srv({e2e_model_dir(), "--port", "0", "--served-model-name", "tiny-e2e", "--shutdown-timeout", "5"});
  ASSERT_TRUE(srv.wait_healthy(120)) << srv.log();
  std::string out;
  const int rc = run_command("node " + std::string(DI_SOURCE_DIR) + "/tests/e2e/shutdown_drain.mjs " + srv.url() + " tiny-e2e " +
                                 std::to_string(srv.pid()) + " 5",
                             out);
  EXPECT_EQ(rc, 0) << out << "\n--- server log ---\n" << srv.log();
  std::cout << out;
  EXPECT_EQ(srv.stop(), 0) << srv.log();
  EXPECT_NE(srv.log().find("draining"), std::string::npos) << srv.log();
}

// A client that stops reading its stream: the server pauses that request's generation instead of
// buffering its output, and resumes it when the client reads again.
TEST(ServerE2E, NonReadingStreamIsPausedNotBuffered) {
  ServerProcess srv({e2e_model_dir(), "--port", "0"});
  ASSERT_TRUE(srv.wait_healthy(120)) << srv.log();
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const int small = 4096;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);  // before connect: a small window
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(srv.port());
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  // Top-20 logprobs make each chunk a few KB, so the socket buffers fill after some hundred tokens.
  const std::string req = http_request("POST", "/v1/chat/completions",
                                       R"({"messages":[{"role":"user","content":"go"}],"max_tokens":100000,"ignore_eos":true,)"
                                       R"("stream":true,"logprobs":true,"top_logprobs":20})");
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), ssize_t(req.size()));
  auto metrics = [&] { return parse_metrics(fetch(srv.port(), "GET", "/metrics").body); };
  std::map<std::string, double> m;
  for (int i = 0; i < 600 && m["deepinfer_paused_streams"] != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    m = metrics();
  }
  ASSERT_EQ(m["deepinfer_paused_streams"], 1) << "tokens " << m["deepinfer_engine_generation_tokens_total"] << " streams " << m["deepinfer_open_streams"] << "\n" << srv.log().substr(srv.log().size() > 3000 ? srv.log().size() - 3000 : 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the engine takes the pause at its next step
  const long rss_paused = srv.rss_kb();
  const double tokens = metrics()["deepinfer_engine_generation_tokens_total"];
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  m = metrics();
  EXPECT_EQ(m["deepinfer_engine_generation_tokens_total"], tokens) << "generation went on while paused";
  EXPECT_LT(srv.rss_kb() - rss_paused, 16 * 1024) << "output piled up in memory";
  EXPECT_LT(tokens, 20000);
  // Reading resumes generation.
  char buf[65536];
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) > 0) ASSERT_GT(::recv(fd, buf, sizeof buf, 0), 0);
    m = metrics();
    if (m["deepinfer_engine_generation_tokens_total"] > tokens + 50) break;
  }
  EXPECT_GT(m["deepinfer_engine_generation_tokens_total"], tokens + 50);
  EXPECT_GE(m["deepinfer_stream_pauses_total"], 1);
  ::close(fd);
  EXPECT_EQ(srv.stop(), 0) << srv.log();
}

// Prompt token ids above what the tokenizer defines (the config's vocab is padded) are a 400 at
// the door, not an engine error after the request was accepted.
TEST(ServerE2E, TokenIdsOutsideTheTokenizerAre400) {
  const std::string model = e2e_model_dir();
  ServerProcess srv({model, "--port", "0"});
  ASSERT_TRUE(srv.wait_healthy(120)) << srv.log();
  auto ok = fetch(srv.port(), "POST", "/v1/completions", R"({"prompt":[0, 5, 100],"max_tokens":2})");
  EXPECT_EQ(ok.status, 200) << ok.body;
  auto r = fetch(srv.port(), "POST", "/v1/completions", R"({"prompt":[0, 5, 129200],"max_tokens":2,"stream":true})");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("129200"), std::string::npos) << r.body;
  EXPECT_EQ(srv.stop(), 0) << srv.log();
}

// The real engine's bounded queue: one running, one waiting, the third request gets 429 with
// Retry-After; closing the two streams cancels them and the cache returns to the prefix-cache level.
TEST(ServerE2E, QueueFullIs429AndDisconnectsFreeTheCache) {
  const std::string model = e2e_model_dir();
  ServerProcess srv({model, "--port", "0", "--max-running", "1", "--max-waiting", "1", "--sse-keepalive", "0.2"});
  ASSERT_TRUE(srv.wait_healthy(120)) << srv.log();
  const std::string body = R"({"prompt":"one two three","max_tokens":100000,"ignore_eos":true,"stream":true})";
  std::map<std::string, double> m;
  auto a = std::make_unique<RawConn>(srv.port());
  a->send(http_request("POST", "/v1/completions", body));
  for (int i = 0; i < 200 && m["deepinfer_num_requests_running"] != 1; ++i) {
    m = parse_metrics(fetch(srv.port(), "GET", "/metrics").body);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto b = std::make_unique<RawConn>(srv.port());
  b->send(http_request("POST", "/v1/completions", body));
  for (int i = 0; i < 200; ++i) {
    m = parse_metrics(fetch(srv.port(), "GET", "/metrics").body);
    if (m["deepinfer_num_requests_running"] == 1 && m["deepinfer_num_requests_waiting"] == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(m["deepinfer_num_requests_running"], 1);
  ASSERT_EQ(m["deepinfer_num_requests_waiting"], 1);
  auto r = fetch(srv.port(), "POST", "/v1/completions", R"({"prompt":"x","max_tokens":2})");
  EXPECT_EQ(r.status, 429) << r.body;
  EXPECT_GE(std::stoi(r.headers["retry-after"]), 1);
  EXPECT_EQ(nlohmann::json::parse(r.body)["error"]["code"], "engine_queue_full");
  // The waiting stream already has its headers and gets keep-alive comments while it waits.
  std::string waited;
  b->read_reply(3000, [&](const std::string& body_so_far) {
    waited = body_so_far;
    return false;
  });
  EXPECT_EQ(waited.rfind(": keep-alive\n\n", 0), 0u) << waited;
  a.reset();
  b.reset();
  for (int i = 0; i < 200; ++i) {
    m = parse_metrics(fetch(srv.port(), "GET", "/metrics").body);
    if (m["deepinfer_num_requests_running"] == 0 && m["deepinfer_num_requests_waiting"] == 0 &&
        m["deepinfer_request_finished_total{finish_reason=\"cancelled\"}"] == 2)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(m["deepinfer_request_finished_total{finish_reason=\"cancelled\"}"], 2);
  EXPECT_EQ(m["deepinfer_num_requests_running"], 0);
  EXPECT_EQ(m["deepinfer_cache_bytes_used"], m["deepinfer_prefix_cache_bytes"]);
  EXPECT_EQ(m["deepinfer_http_requests_total{endpoint=\"/v1/completions\",status=\"429\"}"], 1);
  EXPECT_EQ(m["deepinfer_http_requests_total{endpoint=\"/v1/completions\",status=\"499\"}"], 2);
  EXPECT_EQ(srv.stop(), 0);
}

}  // namespace
}  // namespace di::test
