// Hostile JSON against a real `deepinfer serve` process: values nested ~21,700 deep (a stack
// overflow once) are a 400 and the server stays up; 4 MB objects with 300k keys parse in linear time
// on the parse workers while /health, polled from another connection, stays fast.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <future>

#include "server_process.h"

namespace di::test {
namespace {

using json = nlohmann::json;

// {"a":{"a":...{}...}} nested `levels` deep (6 bytes a level: 21,700 levels is the reported ~130 KB).
std::string deep_object(int levels) {
  std::string s;
  s.reserve(size_t(levels) * 6);
  for (int i = 0; i < levels; ++i) s += "{\"a\":";
  s += "{}";
  s.append(size_t(levels), '}');
  return s;
}

TEST(ServerAbuseJson, DeepNestingIs400AndTheServerStaysUp) {
  ServerProcess srv({e2e_model_dir(), "--port", "0"});
  ASSERT_TRUE(srv.wait_healthy(120)) << srv.log();
  const std::string deep = deep_object(21700);
  const std::string user = R"({"role":"user","content":"Hi"})";
  const std::vector<std::pair<std::string, std::string>> bodies = {
      {"tools[0].function.parameters",
       R"({"messages":[)" + user + R"(],"tools":[{"type":"function","function":{"name":"f","parameters":)" + deep + "}}]}"},
      {"messages[1].tool_calls[0].function.arguments",
       R"({"messages":[)" + user + R"(,{"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":)" +
           deep + R"(}}]},{"role":"tool","tool_call_id":"c","content":"r"}]})"},
      {"messages[1].tool_calls[0].function.arguments",  // the same value sent as JSON text
       R"({"messages":[)" + user + R"(,{"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":)" +
           json(deep).dump() + R"(}}]},{"role":"tool","tool_call_id":"c","content":"r"}]})"},
  };
  for (const auto& [field, body] : bodies) {
    auto r = fetch(srv.port(), "POST", "/v1/chat/completions", body);
    ASSERT_EQ(r.status, 400) << field << ": " << r.body << "\n" << srv.log();
    auto e = json::parse(r.body)["error"];
    EXPECT_EQ(e["type"], "invalid_request_error");
    EXPECT_EQ(e["param"].get<std::string>().rfind(field, 0), 0u) << r.body;
    EXPECT_NE(e["message"].get<std::string>().find("128 levels"), std::string::npos) << r.body;
  }
  auto r = fetch(srv.port(), "POST", "/v1/completions", R"({"prompt":"x","extra":)" + deep + "}");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(fetch(srv.port(), "GET", "/health").status, 200);
  EXPECT_EQ(fetch(srv.port(), "POST", "/v1/completions", R"({"prompt":"x","max_tokens":2})").status, 200);
  EXPECT_EQ(srv.stop(), 0) << srv.log();
}

// ASan and UBSan slow parsing down several times by design: the wall-clock bounds below (linear-time
// parsing, /health latency) are checked only without them; every other check runs there too.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

// fetch() with room for a sanitized server to parse a 4 MB body.
HttpReply post_slow(uint16_t port, const std::string& path, const std::string& body) {
  RawConn c(port);
  c.send(http_request("POST", path, body));
  return c.read_reply(kSanitized ? 300000 : 20000);
}

std::string many_keys_body(int keys) {
  std::string s = R"({"prompt":"hi","max_tokens":1,"ignored":{)";
  s.reserve(size_t(keys) * 14);
  for (int i = 0; i < keys; ++i) s += (i ? ",\"key" : "\"key") + std::to_string(i) + "\":0";
  return s + "}}";
}

TEST(ServerAbuseJson, ManyKeysParseFastAndHealthStaysResponsive) {
  // The key limit raised so the whole object is parsed (the default refuses it at key 10,001).
  ServerProcess srv({e2e_model_dir(), "--port", "0", "--max-json-keys", "1000000"});
  ASSERT_TRUE(srv.wait_healthy(120)) << srv.log();
  const std::string body = many_keys_body(300000);
  ASSERT_GT(body.size(), size_t(3.5e6));

  std::atomic<bool> stop{false};
  std::atomic<int> polls{0}, failures{0};
  std::atomic<int64_t> worst_us{0};
  std::thread poller([&] {
    RawConn c(srv.port());  // its own keep-alive connection
    while (!stop) {
      const auto t0 = std::chrono::steady_clock::now();
      c.send(http_request("GET", "/health"));
      int status = 0;
      try {
        status = c.read_reply(30000).status;
      } catch (const std::exception&) {  // no reply in 30 s: a failure, and the connection is spent
        ++failures;
        break;
      }
      const int64_t us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
      if (status != 200) ++failures;
      worst_us = std::max<int64_t>(worst_us, us);
      ++polls;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  // Two at once: the report froze /health for 61 s with two such requests.
  auto a = std::async(std::launch::async, [&] { return post_slow(srv.port(), "/v1/completions", body); });
  auto b = std::async(std::launch::async, [&] { return post_slow(srv.port(), "/v1/completions", body); });
  HttpReply ra, rb;
  try {
    ra = a.get();
    rb = b.get();
  } catch (...) {  // a timed-out request fails the test, not the process (a joinable thread would abort it)
    stop = true;
    poller.join();
    throw;
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  stop = true;
  poller.join();
  EXPECT_EQ(ra.status, 200) << ra.body;
  EXPECT_EQ(rb.status, 200) << rb.body;
  if (!kSanitized) EXPECT_LT(took, 15.0);  // quadratic parsing took ~63 s for one
  EXPECT_GT(polls.load(), 0);
  EXPECT_EQ(failures.load(), 0);
  if (!kSanitized) EXPECT_LT(worst_us.load(), 1000000) << "worst /health latency " << worst_us.load() << " us";
  std::printf("two 300k-key bodies (%.1f MB each) answered in %.2f s; /health polled %d times, worst %.1f ms\n",
              double(body.size()) / 1e6, took, polls.load(), double(worst_us.load()) / 1e3);

  // At the default limit the same body is refused at once.
  EXPECT_EQ(srv.stop(), 0) << srv.log();
  ServerProcess dflt({e2e_model_dir(), "--port", "0"});
  ASSERT_TRUE(dflt.wait_healthy(120)) << dflt.log();
  const auto t1 = std::chrono::steady_clock::now();
  auto r = post_slow(dflt.port(), "/v1/completions", body);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "json_too_many_keys");
  EXPECT_EQ(json::parse(r.body)["error"]["param"], "ignored.key10000");
  if (!kSanitized) EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(), 5.0);
  EXPECT_EQ(dflt.stop(), 0) << dflt.log();
}

}  // namespace
}  // namespace di::test
