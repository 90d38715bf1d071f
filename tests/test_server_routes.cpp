// Server routes beyond the completions: /tokenize, /detokenize, /version, HEAD, opt-in CORS,
// parallel_tool_calls, JSON limits through HTTP, and the parse worker pool's bounded queue.
#include <gtest/gtest.h>

#include <future>

#include <spdlog/spdlog.h>

#include "server/server.h"
#include "server/worker_pool.h"
#include "server_test_util.h"

namespace di::test {
namespace {

using json = nlohmann::json;

const bool kQuiet = [] {
  spdlog::set_level(spdlog::level::warn);
  return true;
}();

FakeEngineOptions engine_saying(const std::string& text) {
  FakeEngineOptions fo;
  fo.script = v41_tokenizer()->encode(text, true);
  fo.script.push_back(1);
  return fo;
}

TEST(ServerRoutes, TokenizeDetokenizeVersion) {
  TestServer ts(engine_saying("x"));
  ASSERT_TRUE(ts.srv->ready());
  auto t = fetch(ts.port, "POST", "/tokenize", R"({"model":"tiny-test","prompt":"Hello world"})");
  ASSERT_EQ(t.status, 200) << t.body;
  auto tj = json::parse(t.body);
  EXPECT_EQ(tj["count"], tj["tokens"].size());
  EXPECT_EQ(tj["max_model_len"], 4096);
  auto d = fetch(ts.port, "POST", "/detokenize", json{{"tokens", tj["tokens"]}}.dump());
  ASSERT_EQ(d.status, 200) << d.body;
  EXPECT_EQ(json::parse(d.body)["prompt"], "<｜begin▁of▁sentence｜>Hello world");
  auto bad = fetch(ts.port, "POST", "/detokenize", R"({"tokens":[1,999999999]})");
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(json::parse(bad.body)["error"]["param"], "tokens[1]");
  EXPECT_EQ(fetch(ts.port, "GET", "/tokenize").status, 405);

  auto v = fetch(ts.port, "GET", "/version");
  ASSERT_EQ(v.status, 200);
  EXPECT_EQ(json::parse(v.body)["version"], server::version_string());
  EXPECT_FALSE(std::string(server::version_string()).empty());
}

TEST(ServerRoutes, TokenizeNeedsTheApiKey) {
  TestServer ts(engine_saying("x"), [](server::ServerOptions& o) { o.api_key = "k"; });
  EXPECT_EQ(fetch(ts.port, "POST", "/tokenize", R"({"prompt":"a"})").status, 401);
  EXPECT_EQ(fetch(ts.port, "POST", "/detokenize", R"({"tokens":[1]})").status, 401);
  EXPECT_EQ(fetch(ts.port, "POST", "/tokenize", R"({"prompt":"a"})", "Authorization: Bearer k\r\n").status, 200);
  EXPECT_EQ(fetch(ts.port, "GET", "/version").status, 200);  // like /health: no key
}

TEST(ServerRoutes, HeadAnswersWithoutABody) {
  TestServer ts(engine_saying("x"));
  for (const char* path : {"/health", "/version", "/v1/models"}) {
    RawConn c(ts.port);
    c.send(http_request("HEAD", path));
    auto r = c.read_reply(20000, nullptr, true);
    EXPECT_EQ(r.status, 200) << path;
    // The connection stays usable: nothing stray follows the head.
    c.send(http_request("GET", "/health"));
    EXPECT_EQ(c.read_reply().status, 200) << path;
  }
  EXPECT_EQ(fetch(ts.port, "HEAD", "/v1/chat/completions").status, 405);
}

TEST(ServerRoutes, CorsOnlyForListedOrigins) {
  const std::string origin = "Origin: https://app.example\r\n";
  {
    TestServer off(engine_saying("x"));
    auto r = fetch(off.port, "GET", "/health", "", origin);
    EXPECT_EQ(r.status, 200);
    EXPECT_EQ(r.headers.count("access-control-allow-origin"), 0u);
    EXPECT_EQ(fetch(off.port, "OPTIONS", "/v1/chat/completions", "", origin).status, 405);
  }
  TestServer ts(engine_saying("Hello"), [](server::ServerOptions& o) {
    o.allowed_origins = {"https://app.example", "http://localhost:3000"};
    o.api_key = "k";
  });
  // Preflight: no key needed, methods and headers granted.
  auto pre = fetch(ts.port, "OPTIONS", "/v1/chat/completions", "",
                   origin + "Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\n");
  EXPECT_EQ(pre.status, 204);
  EXPECT_EQ(pre.headers["access-control-allow-origin"], "https://app.example");
  EXPECT_NE(pre.headers["access-control-allow-methods"].find("POST"), std::string::npos);
  EXPECT_NE(pre.headers["access-control-allow-headers"].find("Authorization"), std::string::npos);
  auto other = fetch(ts.port, "OPTIONS", "/v1/chat/completions", "", "Origin: https://evil.example\r\n");
  EXPECT_EQ(other.status, 403);
  EXPECT_EQ(other.headers.count("access-control-allow-origin"), 0u);

  // Every response to a listed origin carries the header: errors, JSON, and streams.
  auto unauth = fetch(ts.port, "POST", "/v1/completions", R"({"prompt":"x"})", origin);
  EXPECT_EQ(unauth.status, 401);
  EXPECT_EQ(unauth.headers["access-control-allow-origin"], "https://app.example");
  const std::string auth = "Authorization: Bearer k\r\n";
  auto plain = fetch(ts.port, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":2})", origin + auth);
  EXPECT_EQ(plain.status, 200) << plain.body;
  EXPECT_EQ(plain.headers["access-control-allow-origin"], "https://app.example");
  auto stream = fetch(ts.port, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":2,"stream":true})", origin + auth);
  EXPECT_EQ(stream.status, 200);
  EXPECT_EQ(stream.headers["transfer-encoding"], "chunked");
  EXPECT_EQ(stream.headers["access-control-allow-origin"], "https://app.example");
  EXPECT_EQ(stream.headers["vary"], "Origin");
  auto unlisted = fetch(ts.port, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":2})", "Origin: https://evil.example\r\n" + auth);
  EXPECT_EQ(unlisted.status, 200);
  EXPECT_EQ(unlisted.headers.count("access-control-allow-origin"), 0u);
}

const std::string kTwoCalls =
    "<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"a\">\n</｜DSML｜ invoke>\n"
    "<｜DSML｜ invoke name=\"b\">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>";

TEST(ServerRoutes, ParallelToolCallsFalseKeepsOneCall) {
  TestServer ts(engine_saying("x"));
  const std::string tools =
      R"("tools":[{"type":"function","function":{"name":"a"}},{"type":"function","function":{"name":"b"}}])";
  const std::string base = R"({"messages":[{"role":"user","content":"go"}],)" + tools + R"(,"test_forced_output":)" +
                           json(kTwoCalls).dump();
  auto both = fetch(ts.port, "POST", "/v1/chat/completions", base + "}");
  ASSERT_EQ(both.status, 200) << both.body;
  EXPECT_EQ(json::parse(both.body)["choices"][0]["message"]["tool_calls"].size(), 2u);
  auto one = fetch(ts.port, "POST", "/v1/chat/completions", base + R"(,"parallel_tool_calls":false})");
  ASSERT_EQ(one.status, 200) << one.body;
  auto choice = json::parse(one.body)["choices"][0];
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u) << one.body;
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["name"], "a");
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
}

TEST(ServerRoutes, JsonLimitsOverHttp) {
  TestServer ts(engine_saying("x"), [](server::ServerOptions& o) { o.json_limits.max_keys = 50; });
  const std::string deep = std::string(21700, '[') + std::string(21700, ']');
  auto r = fetch(ts.port, "POST", "/v1/chat/completions",
                 R"({"messages":[{"role":"user","content":"Hi"}],"tools":[{"type":"function","function":{"name":"f","parameters":)" + deep +
                     "}}]}");
  EXPECT_EQ(r.status, 400);
  auto e = json::parse(r.body)["error"];
  EXPECT_EQ(e["code"], "json_too_deep");
  EXPECT_EQ(e["type"], "invalid_request_error");
  std::string many = R"({"prompt":"x","extra":{)";
  for (int i = 0; i < 51; ++i) many += (i ? ",\"" : "\"") + std::to_string(i) + "\":1";
  r = fetch(ts.port, "POST", "/v1/completions", many + "}}");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "json_too_many_keys");
  EXPECT_EQ(fetch(ts.port, "GET", "/health").status, 200);
}

// With every parse worker busy and the queue full, a request is answered 503 at once, in OpenAI's
// error shape, instead of waiting behind the slow one.
TEST(ServerRoutes, FullParseQueueIs503) {
  TestServer ts(engine_saying("x"), [](server::ServerOptions& o) {
    o.parse_threads = 1;
    o.parse_queue = 0;
    o.json_limits.max_keys = 1000000;
  });
  std::string slow = R"({"prompt":"x","max_tokens":1,"ignored":{)";
  for (int i = 0; i < 400000; ++i) slow += (i ? ",\"" : "\"") + std::to_string(i) + "\":0";
  slow += "}}";
  // A small request may take the only worker just before the big one arrives (then the big one is
  // the refused one): a few attempts.
  HttpReply busy;
  int big_status = 0;
  for (int attempt = 0; attempt < 4 && !(big_status == 200 && busy.status == 503); ++attempt) {
    busy = {};
    auto big = std::async(std::launch::async, [&] { return fetch(ts.port, "POST", "/v1/completions", slow); });
    while (big.wait_for(std::chrono::milliseconds(5)) != std::future_status::ready) {
      auto r = fetch(ts.port, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})");
      if (r.status == 503) {
        busy = r;
        break;
      }
    }
    big_status = big.get().status;
  }
  EXPECT_EQ(big_status, 200);
  ASSERT_EQ(busy.status, 503) << "no request was refused while the only worker parsed 400k keys";
  auto e = json::parse(busy.body)["error"];
  EXPECT_EQ(e["code"], "server_overloaded");
  EXPECT_EQ(e["type"], "server_error");
  EXPECT_EQ(busy.headers["retry-after"], "1");
  EXPECT_EQ(fetch(ts.port, "GET", "/health").status, 200);
}

TEST(WorkerPool, BoundedQueueRefusesWhenFull) {
  server::WorkerPool pool(1, 1);
  std::promise<void> started, release;
  auto gate = release.get_future().share();
  ASSERT_TRUE(pool.try_submit([&] {
    started.set_value();
    gate.wait();
  }));
  started.get_future().wait();
  std::atomic<int> ran{0};
  EXPECT_TRUE(pool.try_submit([&] { ++ran; }));   // waits in the queue
  EXPECT_FALSE(pool.try_submit([&] { ++ran; }));  // the queue is full
  EXPECT_EQ(pool.queued(), 1u);
  release.set_value();
  pool.stop();  // runs what was queued
  EXPECT_EQ(ran.load(), 1);
  EXPECT_FALSE(pool.try_submit([] {}));
}

}  // namespace
}  // namespace di::test
