// The HTTP layer of `deepinfer serve` over raw sockets, with a scripted fake engine: every error path
// (400/401/404/405/413/429/503), health, models, metrics, SSE, stop strings, disconnect -> cancel,
// keep-alive, and 512 concurrent streams.
#include <gtest/gtest.h>

#include <sys/socket.h>

#include <cstring>
#include <future>
#include <regex>
#include <set>
#include <sstream>

#include <spdlog/spdlog.h>

#include "server/server.h"
#include "server_test_util.h"

namespace di::test {
namespace {

using json = nlohmann::json;

// One log line per request is the server's job, but not this test's output.
const bool kQuiet = [] {
  spdlog::set_level(spdlog::level::warn);
  return true;
}();

std::vector<int32_t> script_tokens(const std::string& text, bool with_eos = true) {
  auto ids = v41_tokenizer()->encode(text, false);
  if (with_eos) ids.push_back(1);
  return ids;
}

FakeEngineOptions hello_engine() {
  FakeEngineOptions fo;
  fo.script = script_tokens("Hello world. Bye");
  fo.cached_tokens = 5;
  return fo;
}

json error_of(const HttpReply& r) {
  json j = json::parse(r.body);
  EXPECT_TRUE(j.contains("error")) << r.body;
  const json& e = j["error"];
  EXPECT_TRUE(e.contains("message") && e["message"].is_string()) << r.body;
  EXPECT_TRUE(e.contains("type") && e["type"].is_string()) << r.body;
  EXPECT_TRUE(e.contains("param")) << r.body;
  EXPECT_TRUE(e.contains("code")) << r.body;
  return e;
}

const std::string kChat = R"({"model":"tiny-test","messages":[{"role":"user","content":"Hi"}],"max_tokens":32})";

TEST(ServerHttp, HealthModelsAndUnknownPaths) {
  TestServer ts(hello_engine());
  auto h = fetch(ts.port, "GET", "/health");
  EXPECT_EQ(h.status, 200);
  EXPECT_EQ(json::parse(h.body)["status"], "ok");

  auto m = fetch(ts.port, "GET", "/v1/models");
  ASSERT_EQ(m.status, 200);
  auto mj = json::parse(m.body);
  EXPECT_EQ(mj["object"], "list");
  ASSERT_EQ(mj["data"].size(), 1u);
  EXPECT_EQ(mj["data"][0]["id"], "tiny-test");
  EXPECT_EQ(mj["data"][0]["max_model_len"], 4096);
  EXPECT_EQ(mj["data"][0]["vocab_size"], v41_tokenizer()->vocab_size());  // the token ids prompts may use
  EXPECT_EQ(fetch(ts.port, "GET", "/v1/models/tiny-test").status, 200);
  auto other = fetch(ts.port, "GET", "/v1/models/gpt-9");
  EXPECT_EQ(other.status, 404);
  EXPECT_EQ(error_of(other)["code"], "model_not_found");

  auto nf = fetch(ts.port, "GET", "/v1/nothing");
  EXPECT_EQ(nf.status, 404);
  EXPECT_EQ(error_of(nf)["code"], "unknown_url");
  EXPECT_EQ(fetch(ts.port, "POST", "/", "{}").status, 404);

  auto na = fetch(ts.port, "GET", "/v1/chat/completions");
  EXPECT_EQ(na.status, 405);
  EXPECT_EQ(na.headers["allow"], "POST");
  EXPECT_EQ(error_of(na)["code"], "method_not_allowed");
  EXPECT_EQ(fetch(ts.port, "POST", "/v1/models", "{}").status, 405);
  EXPECT_EQ(fetch(ts.port, "DELETE", "/health").status, 405);
}

TEST(ServerHttp, HealthIs503WhileLoading) {
  std::promise<void> release;
  TestServer ts(hello_engine(), {}, release.get_future().share());
  auto h = fetch(ts.port, "GET", "/health");
  EXPECT_EQ(h.status, 503);
  EXPECT_EQ(json::parse(h.body)["status"], "loading");
  auto c = fetch(ts.port, "POST", "/v1/chat/completions", kChat);
  EXPECT_EQ(c.status, 503);
  EXPECT_EQ(error_of(c)["code"], "model_loading");
  EXPECT_EQ(c.headers["retry-after"], "5");
  // Metrics answer while loading (no engine gauges yet).
  auto m = fetch(ts.port, "GET", "/metrics");
  EXPECT_EQ(m.status, 200);
  EXPECT_NE(m.body.find("deepinfer_model_ready 0"), std::string::npos);
  release.set_value();
  ts.wait_ready();
  EXPECT_EQ(fetch(ts.port, "GET", "/health").status, 200);
}

// A shutdown while the model loads reaches the loader (which gives up), instead of waiting out the
// load and then serving; the server ends stopped, neither ready nor failed.
TEST(ServerHttp, StopWhileLoadingCancelsTheLoad) {
  server::ServerOptions so;
  so.http.port = 0;
  std::atomic<bool> loader_started{false}, saw_cancel{false};
  server::Server srv(so, [&](const std::atomic<bool>& cancel) -> server::LoadedModel {
    loader_started = true;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!cancel && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    saw_cancel = cancel.load();
    throw std::runtime_error("cancelled by the test loader");
  });
  srv.start();
  while (!loader_started) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto t0 = std::chrono::steady_clock::now();
  srv.stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_TRUE(saw_cancel);
  EXPECT_FALSE(srv.ready());
  EXPECT_FALSE(srv.failed());  // a cancelled load is not a load error
}

TEST(ServerHttp, ApiKey) {
  TestServer ts(hello_engine(), [](server::ServerOptions& o) { o.api_key = "sekret-key"; });
  auto none = fetch(ts.port, "GET", "/v1/models");
  EXPECT_EQ(none.status, 401);
  EXPECT_EQ(error_of(none)["code"], "invalid_api_key");
  EXPECT_EQ(fetch(ts.port, "GET", "/v1/models", "", "Authorization: Bearer wrong\r\n").status, 401);
  EXPECT_EQ(fetch(ts.port, "GET", "/v1/models", "", "Authorization: Bearer sekret-key-and-more\r\n").status, 401);
  EXPECT_EQ(fetch(ts.port, "GET", "/v1/models", "", "Authorization: sekret-key\r\n").status, 401);
  EXPECT_EQ(fetch(ts.port, "POST", "/v1/chat/completions", kChat).status, 401);
  EXPECT_EQ(fetch(ts.port, "GET", "/v1/models", "", "Authorization: Bearer sekret-key\r\n").status, 200);
  EXPECT_EQ(fetch(ts.port, "POST", "/v1/chat/completions", kChat, "Authorization: Bearer sekret-key\r\n").status, 200);
  // Health and metrics stay open (load balancers, Prometheus).
  EXPECT_EQ(fetch(ts.port, "GET", "/health").status, 200);
  EXPECT_EQ(fetch(ts.port, "GET", "/metrics").status, 200);
  EXPECT_TRUE(server::constant_time_equal("abc", "abc"));
  EXPECT_FALSE(server::constant_time_equal("abc", "abd"));
  EXPECT_FALSE(server::constant_time_equal("abc", "ab"));
  EXPECT_FALSE(server::constant_time_equal("", "a"));
}

// An empty chunked body whose final chunk arrives in pieces ("0" "\r\n" "\r" "\n") once aborted the
// server on an assertion inside Beast (found by fuzz_http_request). Each piece is its own read.
TEST(ServerHttp, ChunkedBodyWithTheFinalChunkSplitAcrossReads) {
  TestServer ts(hello_engine());
  RawConn c(ts.port);
  c.send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n0");
  for (const char* piece : {"\r\n", "\r", "\n"}) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    c.send(piece);
  }
  EXPECT_EQ(c.read_reply().status, 400);  // parsed: an empty body is not a JSON request
  EXPECT_EQ(fetch(ts.port, "GET", "/health").status, 200);
}

TEST(ServerHttp, BodyLimitIs413) {
  TestServer ts(hello_engine(), [](server::ServerOptions& o) { o.http.max_body_bytes = 1000; });
  // The declared length alone is enough to refuse.
  RawConn c(ts.port);
  c.send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n");
  auto r = c.read_reply();
  EXPECT_EQ(r.status, 413);
  EXPECT_EQ(error_of(r)["code"], "request_too_large");
  EXPECT_EQ(r.headers["connection"], "close");
  // A body that fits is served.
  EXPECT_EQ(fetch(ts.port, "POST", "/v1/chat/completions", kChat).status, 200);
}

void expect_400(uint16_t port, const std::string& path, const std::string& body, const std::string& param,
                const std::string& code = "") {
  auto r = fetch(port, "POST", path, body);
  EXPECT_EQ(r.status, 400) << body << " -> " << r.body;
  if (r.status != 400) return;
  auto e = error_of(r);
  EXPECT_EQ(e["type"], "invalid_request_error");
  if (param.empty()) {
    EXPECT_TRUE(e["param"].is_null()) << r.body;
  } else {
    EXPECT_EQ(e["param"], param) << r.body;
    EXPECT_NE(e["message"].get<std::string>().find(param), std::string::npos) << r.body;
  }
  if (!code.empty()) {
    EXPECT_EQ(e["code"], code) << r.body;
  }
}

TEST(ServerHttp, BadRequestsNameTheField) {
  TestServer ts(hello_engine(), [](server::ServerOptions& o) { o.test_hooks = false; });
  const std::string chat = "/v1/chat/completions", cmpl = "/v1/completions";
  expect_400(ts.port, chat, "{\"messages\": [", "", "invalid_json");
  expect_400(ts.port, chat, "[1,2]", "", "invalid_json");
  expect_400(ts.port, chat, std::string("{\"messages\":[{\"role\":\"user\",\"content\":\"a\xff\"}]}"), "", "invalid_utf8");
  expect_400(ts.port, chat, "{}", "messages");
  expect_400(ts.port, chat, R"({"messages":"hi"})", "messages");
  expect_400(ts.port, chat, R"({"messages":[{"role":"wizard","content":"x"}]})", "messages[0].role");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"temperature":"hot"})", "temperature", "invalid_type");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"temperature":3})", "temperature");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"top_p":1.5})", "top_p");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"n":0})", "n");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"n":1.5})", "n", "invalid_type");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"max_tokens":0})", "max_tokens");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"max_completion_tokens":-3})", "max_completion_tokens");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"stream":"yes"})", "stream", "invalid_type");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}})", "stream_options");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":3})", "top_logprobs");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21})", "top_logprobs");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"logit_bias":{"abc":1}})", "logit_bias.abc");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"logit_bias":{"99999999":1}})", "logit_bias.99999999");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"logit_bias":{"5":500}})", "logit_bias.5");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"seed":"x"})", "seed", "invalid_type");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"presence_penalty":-2.5})", "presence_penalty");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"required"})", "tool_choice");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema"}})",
             "response_format.json_schema");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"stop":[1]})", "stop[0]");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"functions":[]})", "functions");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"test_forced_output":"hi"})", "test_forced_output");
  // Oversized prompt vs the context (256 tokens here).
  std::string big(12000, 'z');
  for (size_t i = 0; i < big.size(); i += 2) big[i] = ' ';
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":")" + big + R"("}]})", "messages", "context_length_exceeded");
  expect_400(ts.port, chat, R"({"messages":[{"role":"user","content":"x"}],"max_tokens":5000})", "max_tokens", "context_length_exceeded");

  expect_400(ts.port, cmpl, R"({"model":"tiny-test"})", "prompt");
  expect_400(ts.port, cmpl, R"({"prompt":5})", "prompt", "invalid_type");
  expect_400(ts.port, cmpl, R"({"prompt":""})", "prompt");
  expect_400(ts.port, cmpl, R"({"prompt":[1,2,-1]})", "prompt[2]");
  expect_400(ts.port, cmpl, R"({"prompt":[[1,2],[3,"x"]]})", "prompt[1][1]", "invalid_type");
  expect_400(ts.port, cmpl, R"({"prompt":"a","suffix":"b"})", "suffix");
  expect_400(ts.port, cmpl, R"({"prompt":"a","echo":true,"logprobs":2})", "echo");
  expect_400(ts.port, cmpl, R"({"prompt":"a","logprobs":true})", "logprobs", "invalid_type");
  expect_400(ts.port, cmpl, R"({"prompt":"a","best_of":3})", "best_of");
  expect_400(ts.port, cmpl, R"({"prompt":"a","stop":""})", "stop");
  expect_400(ts.port, cmpl, R"({"prompt":")" + big + R"("})", "prompt", "context_length_exceeded");

  // Unknown model: 404 naming the field; unknown fields are ignored.
  auto unk = fetch(ts.port, "POST", chat, R"({"model":"gpt-4o","messages":[{"role":"user","content":"x"}]})");
  EXPECT_EQ(unk.status, 404);
  EXPECT_EQ(error_of(unk)["param"], "model");
  EXPECT_EQ(error_of(unk)["code"], "model_not_found");
  EXPECT_EQ(fetch(ts.port, "POST", chat, R"({"messages":[{"role":"user","content":"x"}],"max_tokens":4,"foo":{"bar":1},"user":"u"})").status,
            200);
  // Malformed HTTP itself.
  RawConn c(ts.port);
  c.send("THIS IS NOT HTTP\r\n\r\n");
  EXPECT_EQ(c.read_reply().status, 400);
}

TEST(ServerHttp, QueueFullIs429WithRetryAfter) {
  FakeEngineOptions fo = hello_engine();
  fo.max_running = 1;
  fo.max_waiting = 0;
  fo.step_ms = 20;
  TestServer ts(fo);
  RawConn busy(ts.port);
  busy.send(http_request("POST", "/v1/completions", R"({"prompt":"x","max_tokens":200,"ignore_eos":true,"stream":true})"));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto r = fetch(ts.port, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":2})");
  EXPECT_EQ(r.status, 429);
  EXPECT_EQ(r.headers["retry-after"], "2");
  EXPECT_EQ(error_of(r)["code"], "engine_queue_full");
  busy.close();
}

TEST(ServerHttp, ChatNonStreaming) {
  TestServer ts(hello_engine());
  auto r = fetch(ts.port, "POST", "/v1/chat/completions",
                 R"({"model":"tiny-test","messages":[{"role":"user","content":"Hi"}],"max_tokens":32,"logprobs":true,"top_logprobs":2})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["model"], "tiny-test");
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "Hello world. Bye");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  const auto& lp = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(lp.size(), script_tokens("Hello world. Bye").size());
  EXPECT_EQ(lp[0]["token"], "Hello");
  EXPECT_EQ(lp[0]["top_logprobs"].size(), 2u);
  EXPECT_FLOAT_EQ(lp[0]["logprob"].get<float>(), -0.25f);
  const auto& u = j["usage"];
  const int prompt = u["prompt_tokens"];
  EXPECT_GT(prompt, 3);
  EXPECT_EQ(u["completion_tokens"], int(script_tokens("Hello world. Bye").size()));
  EXPECT_EQ(u["total_tokens"], prompt + u["completion_tokens"].get<int>());
  EXPECT_EQ(u["prompt_tokens_details"]["cached_tokens"], 5);
  // The engine got the chat prompt (BOS ... Assistant header) and the sampling fields.
  auto sub = ts.engine->submitted().back();
  EXPECT_EQ(sub.prompt.front(), 0);
  EXPECT_EQ(sub.max_tokens, 32);
  EXPECT_EQ(sub.sampling.logprobs, 1);
  EXPECT_EQ(sub.sampling.top_logprobs, 2);
}

TEST(ServerHttp, SamplingFieldsReachTheEngine) {
  TestServer ts(hello_engine());
  auto r = fetch(ts.port, "POST", "/v1/completions",
                 R"({"prompt":[5,6,7],"max_tokens":3,"temperature":0.5,"top_p":0.9,"top_k":40,"min_p":0.1,"presence_penalty":0.5,
                     "frequency_penalty":-0.5,"repetition_penalty":1.1,"seed":-7,"logit_bias":{"42":-100,"7":5.5},"n":2,
                     "stop_token_ids":[9],"ignore_eos":true})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto p = ts.engine->submitted().back();
  EXPECT_EQ(p.prompt, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(p.max_tokens, 3);
  EXPECT_EQ(p.n, 2);
  EXPECT_FLOAT_EQ(p.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(p.sampling.top_p, 0.9f);
  EXPECT_EQ(p.sampling.top_k, 40);
  EXPECT_FLOAT_EQ(p.sampling.min_p, 0.1f);
  EXPECT_FLOAT_EQ(p.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(p.sampling.frequency_penalty, -0.5f);
  EXPECT_FLOAT_EQ(p.sampling.repetition_penalty, 1.1f);
  ASSERT_TRUE(p.sampling.seed.has_value());
  EXPECT_EQ(*p.sampling.seed, uint64_t(int64_t(-7)));
  ASSERT_EQ(p.sampling.logit_bias.size(), 2u);
  EXPECT_EQ(p.sampling.logit_bias[0].first, 42);
  EXPECT_FLOAT_EQ(p.sampling.logit_bias[1].second, 5.5f);
  EXPECT_EQ(p.stop_token_ids, (std::vector<int32_t>{9}));
  EXPECT_TRUE(p.ignore_eos);
  auto j = json::parse(r.body);
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][1]["index"], 1);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  // Completion prompts as text get BOS.
  ASSERT_EQ(fetch(ts.port, "POST", "/v1/completions", R"({"prompt":"Hi there","max_tokens":1})").status, 200);
  EXPECT_EQ(ts.engine->submitted().back().prompt.front(), 0);
}

TEST(ServerHttp, ChatStreamingWithUsage) {
  TestServer ts(hello_engine());
  auto r = fetch(ts.port, "POST", "/v1/chat/completions",
                 R"({"messages":[{"role":"user","content":"Hi"}],"max_tokens":32,"stream":true,"stream_options":{"include_usage":true}})");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.headers["content-type"], "text/event-stream");
  auto events = sse_data(r.body);
  ASSERT_GE(events.size(), 4u) << r.body;
  EXPECT_EQ(events.back(), "[DONE]");
  std::string content;
  std::string finish;
  bool role = false;
  for (size_t i = 0; i + 2 < events.size(); ++i) {
    auto j = json::parse(events[i]);
    EXPECT_EQ(j["object"], "chat.completion.chunk");
    const auto& d = j["choices"][0]["delta"];
    if (d.contains("role")) role = true;
    if (d.contains("content")) content += d["content"].get<std::string>();
    if (!j["choices"][0]["finish_reason"].is_null()) finish = j["choices"][0]["finish_reason"];
  }
  EXPECT_TRUE(role);
  EXPECT_EQ(content, "Hello world. Bye");
  EXPECT_EQ(finish, "stop");
  auto usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], int(script_tokens("Hello world. Bye").size()));
  EXPECT_EQ(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 5);
}

TEST(ServerHttp, StopStringCancelsAndNeverLeaks) {
  FakeEngineOptions fo;
  fo.script = script_tokens("Hello world. Bye and more and more", false);
  fo.step_ms = 5;
  TestServer ts(fo);
  auto r = fetch(ts.port, "POST", "/v1/chat/completions",
                 R"({"messages":[{"role":"user","content":"Hi"}],"max_tokens":200,"stop":["d. B"]})");
  ASSERT_EQ(r.status, 200);
  auto j = json::parse(r.body);
  EXPECT_EQ(j["choices"][0]["message"]["content"], "Hello worl");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(ts.engine->cancel_calls().size(), 1u);
  EXPECT_LT(j["usage"]["completion_tokens"].get<int>(), 20);

  // Completions, streamed: no piece of the stop string ever reaches the client.
  auto s = fetch(ts.port, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":200,"stop":"d. B","stream":true})");
  std::string text;
  for (const auto& e : sse_data(s.body)) {
    if (e == "[DONE]") break;
    auto c = json::parse(e);
    text += c["choices"][0]["text"].get<std::string>();
    if (!c["choices"][0]["finish_reason"].is_null()) {
      EXPECT_EQ(c["choices"][0]["finish_reason"], "stop");
    }
  }
  EXPECT_EQ(text, "Hello worl");
  EXPECT_EQ(ts.engine->cancel_calls().size(), 2u);
}

TEST(ServerHttp, CompletionsEchoLogprobsAndBatchPrompts) {
  TestServer ts(hello_engine());
  auto r = fetch(ts.port, "POST", "/v1/completions", R"({"prompt":"Say:","max_tokens":2,"echo":true})");
  ASSERT_EQ(r.status, 200);
  auto j = json::parse(r.body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], "Say:Hello world");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");

  auto l = fetch(ts.port, "POST", "/v1/completions", R"({"prompt":"Say:","max_tokens":2,"logprobs":3})");
  auto lj = json::parse(l.body)["choices"][0]["logprobs"];
  ASSERT_EQ(lj["tokens"].size(), 2u);
  EXPECT_EQ(lj["tokens"][0], "Hello");
  EXPECT_EQ(lj["token_logprobs"].size(), 2u);
  EXPECT_EQ(lj["top_logprobs"][0].size(), 3u);
  EXPECT_EQ(lj["text_offset"][1], 5);

  auto b = fetch(ts.port, "POST", "/v1/completions", R"({"prompt":["a","b"],"max_tokens":2,"n":2})");
  ASSERT_EQ(b.status, 200);
  auto bj = json::parse(b.body);
  ASSERT_EQ(bj["choices"].size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(bj["choices"][i]["index"], i);
  EXPECT_EQ(ts.engine->submitted().size(), 4u);  // 1 + 1 + 2 submissions

  // Forced output ends as if by EOS.
  auto f = fetch(ts.port, "POST", "/v1/completions", R"({"prompt":"x","test_forced_output":"forced text"})");
  ASSERT_EQ(f.status, 200) << f.body;
  EXPECT_EQ(json::parse(f.body)["choices"][0]["text"], "forced text");
  EXPECT_EQ(json::parse(f.body)["choices"][0]["finish_reason"], "stop");
}

TEST(ServerHttp, ToolCallsThroughForcedOutput) {
  TestServer ts(hello_engine());
  const std::string forced =
      "<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter name=\"city\" "
      "string=\"true\">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>";
  json req = {{"messages", {{{"role", "user"}, {"content", "Weather?"}}}},
              {"tools", {{{"type", "function"},
                          {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}}},
              {"test_forced_output", forced}};
  auto r = fetch(ts.port, "POST", "/v1/chat/completions", req.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  const auto& msg = j["choices"][0]["message"];
  ASSERT_EQ(msg["tool_calls"].size(), 1u) << r.body;
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(msg["tool_calls"][0]["function"]["arguments"].get<std::string>()), json({{"city", "Paris"}}));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls");
}

TEST(ServerHttp, DisconnectCancelsTheEngineRequest) {
  FakeEngineOptions fo = hello_engine();
  fo.script = script_tokens("a b c d e f g", false);
  fo.step_ms = 10;
  TestServer ts(fo);
  {
    RawConn c(ts.port);
    c.send(http_request("POST", "/v1/chat/completions",
                        R"({"messages":[{"role":"user","content":"Hi"}],"max_tokens":200,"stream":true})"));
    int chunks = 0;
    c.read_reply(5000, [&](const std::string&) { return ++chunks < 3; });
  }  // closes the socket mid-stream
  for (int i = 0; i < 200 && ts.engine->cancel_calls().empty(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(ts.engine->cancel_calls().size(), 1u);
  for (int i = 0; i < 200 && ts.engine->stats().running > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(ts.engine->stats().running, 0);
  EXPECT_EQ(ts.engine->stats().cache_pages_used, 0);
  std::string m;
  for (int i = 0; i < 100; ++i) {
    m = fetch(ts.port, "GET", "/metrics").body;
    if (m.find("deepinfer_request_finished_total{finish_reason=\"cancelled\"} 1") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_NE(m.find("deepinfer_request_finished_total{finish_reason=\"cancelled\"} 1"), std::string::npos) << m;
  EXPECT_NE(m.find("deepinfer_cache_pages_used 0"), std::string::npos);
  EXPECT_NE(m.find("deepinfer_open_streams 0"), std::string::npos);

  // Also while waiting for a non-streaming reply.
  {
    RawConn c(ts.port);
    c.send(http_request("POST", "/v1/completions", R"({"prompt":"x","max_tokens":200})"));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (int i = 0; i < 200 && ts.engine->cancel_calls().size() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(ts.engine->cancel_calls().size(), 2u);
}

TEST(ServerHttp, KeepAliveCommentsDuringLongPrefill) {
  FakeEngineOptions fo = hello_engine();
  fo.prefill_ms = 700;
  TestServer ts(fo, [](server::ServerOptions& o) { o.sse_keepalive_s = 0.15; });
  auto r = fetch(ts.port, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":3,"stream":true})");
  ASSERT_EQ(r.status, 200);
  EXPECT_NE(r.body.find(": keep-alive\n\n"), std::string::npos) << r.body;
  EXPECT_EQ(sse_data(r.body).back(), "[DONE]");
}

TEST(ServerHttp, KeepAliveConnectionServesSeveralRequests) {
  TestServer ts(hello_engine());
  RawConn c(ts.port);
  for (int i = 0; i < 3; ++i) {
    c.send(http_request("POST", "/v1/completions", R"({"prompt":"x","max_tokens":2,"stream":true})"));
    auto r = c.read_reply();
    ASSERT_EQ(r.status, 200);
    EXPECT_EQ(sse_data(r.body).back(), "[DONE]");
    c.send(http_request("GET", "/health"));
    EXPECT_EQ(c.read_reply().status, 200);
  }
  // Pipelined: two requests in one write.
  c.send(http_request("GET", "/health") + http_request("GET", "/v1/models"));
  EXPECT_EQ(c.read_reply().status, 200);
  auto second = c.read_reply();
  EXPECT_EQ(second.status, 200);
  EXPECT_EQ(json::parse(second.body)["object"], "list");
  c.send(http_request("GET", "/health", "", "Connection: close\r\n"));
  auto last = c.read_reply();
  EXPECT_EQ(last.status, 200);
  EXPECT_TRUE(last.closed);
}

// Stopping closes keep-alive connections that wait for their next request, some of whose clients
// hang up at that moment. A header read that completes (at EOF) after the close still asks the
// request parser whether it got any bytes, so the parser must outlive the read. UBSan saw that race
// once in Holds512ConcurrentStreams; this test takes the same path but does not hit the race reliably.
TEST(ServerHttp, StopClosesIdleKeepAliveConnections) {
  TestServer ts(hello_engine());
  std::vector<std::unique_ptr<RawConn>> conns;
  for (int i = 0; i < 64; ++i) {
    conns.push_back(std::make_unique<RawConn>(ts.port));
    conns.back()->send(http_request("GET", "/health"));
    ASSERT_EQ(conns.back()->read_reply().status, 200);
  }
  for (size_t i = 0; i < conns.size(); i += 2) ::shutdown(conns[i]->fd(), SHUT_WR);  // EOF races the close
  ts.srv->begin_drain();
  ts.srv->stop();
  for (auto& c : conns) {
    while (c->fill(5000)) {
    }
    EXPECT_TRUE(c->eof());
  }
}

TEST(ServerHttp, MetricsFormat) {
  TestServer ts(hello_engine());
  ASSERT_EQ(fetch(ts.port, "POST", "/v1/chat/completions", kChat).status, 200);
  ASSERT_EQ(fetch(ts.port, "POST", "/v1/completions", R"({"prompt":"one two three four five six","max_tokens":3})").status, 200);
  fetch(ts.port, "GET", "/nope");
  auto r = fetch(ts.port, "GET", "/metrics");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.headers["content-type"].rfind("text/plain; version=0.0.4", 0), 0u);
  // Every sample line: name{labels} value, with a TYPE declared before it.
  std::set<std::string> typed;
  std::map<std::string, double> samples;
  const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (-?[0-9.eE+-]+|\+Inf|NaN)$)");
  std::istringstream in(r.body);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("# TYPE ", 0) == 0) {
      typed.insert(line.substr(7, line.find(' ', 7) - 7));
      continue;
    }
    if (line.rfind("# HELP ", 0) == 0) continue;
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, sample)) << line;
    std::string base = m[1];
    for (const char* suf : {"_bucket", "_sum", "_count"})
      if (!typed.count(base) && base.size() > strlen(suf) && base.compare(base.size() - strlen(suf), strlen(suf), suf) == 0)
        base = base.substr(0, base.size() - strlen(suf));
    EXPECT_TRUE(typed.count(base)) << "no TYPE for " << line;
    samples[m[1].str() + m[2].str()] = std::stod(m[3]);
  }
  EXPECT_EQ(samples["deepinfer_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}"], 1);
  EXPECT_EQ(samples["deepinfer_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"}"], 1);
  EXPECT_EQ(samples["deepinfer_http_requests_total{endpoint=\"other\",status=\"404\"}"], 1);
  EXPECT_EQ(samples["deepinfer_request_finished_total{finish_reason=\"stop\"}"], 1);
  EXPECT_EQ(samples["deepinfer_request_finished_total{finish_reason=\"length\"}"], 1);
  EXPECT_EQ(samples["deepinfer_generation_tokens_total"], double(script_tokens("Hello world. Bye").size() + 3));
  EXPECT_EQ(samples["deepinfer_cached_prompt_tokens_total"], 10);
  EXPECT_EQ(samples["deepinfer_time_to_first_token_seconds_count"], 2);
  EXPECT_EQ(samples["deepinfer_time_to_first_token_seconds_bucket{le=\"+Inf\"}"], 2);
  EXPECT_EQ(samples["deepinfer_time_per_output_token_seconds_count"], 2);
  EXPECT_TRUE(samples.count("deepinfer_num_requests_waiting"));
  EXPECT_TRUE(samples.count("deepinfer_num_requests_running"));
  EXPECT_TRUE(samples.count("deepinfer_cache_pages_used"));
  EXPECT_TRUE(samples.count("deepinfer_cache_bytes_used"));
  EXPECT_TRUE(samples.count("deepinfer_prefix_cache_hit_rate"));
  for (const char* n : {"deepinfer_engine_decode_steps_total", "deepinfer_engine_decode_rows_total", "deepinfer_engine_decode_seconds_total"})
    EXPECT_TRUE(samples.count(n)) << n;  // read by `deepinfer bench serve`
  EXPECT_EQ(samples["deepinfer_model_ready"], 1);
  // Buckets are cumulative.
  std::vector<double> buckets;
  std::istringstream in2(r.body);
  while (std::getline(in2, line))
    if (line.rfind("deepinfer_e2e_request_latency_seconds_bucket", 0) == 0) buckets.push_back(std::stod(line.substr(line.rfind(' ') + 1)));
  ASSERT_GT(buckets.size(), 3u);
  for (size_t i = 1; i < buckets.size(); ++i) EXPECT_LE(buckets[i - 1], buckets[i]);
}

TEST(ServerHttp, Holds512ConcurrentStreams) {
  raise_fd_limit();
  FakeEngineOptions fo = hello_engine();
  fo.script = script_tokens("tick tock", false);
  fo.max_running = 600;
  fo.step_ms = 20;
  TestServer ts(fo, [](server::ServerOptions& o) { o.http.io_threads = 2; });
  constexpr int kConns = 512;
  std::vector<std::unique_ptr<RawConn>> conns;
  for (int i = 0; i < kConns; ++i) {
    conns.push_back(std::make_unique<RawConn>(ts.port));
    conns.back()->send(http_request("POST", "/v1/completions", R"({"prompt":"x","max_tokens":40,"stream":true})"));
  }
  // All of them are streaming at the same time.
  int running = 0;
  for (int i = 0; i < 300 && running < kConns; ++i) {
    running = ts.engine->stats().running;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(running, kConns);
  int done = 0;
  for (auto& c : conns) {
    auto r = c->read_reply(60000);
    auto ev = sse_data(r.body);
    if (r.status == 200 && !ev.empty() && ev.back() == "[DONE]" && ev.size() == 42) ++done;
  }
  EXPECT_EQ(done, kConns);
}

}  // namespace
}  // namespace di::test

// ---- limits for untrusted clients and protocol corners (issue 28 items 3, 5, 6) -------------------

namespace di::test {
namespace {

std::string post_head(const std::string& path, size_t content_length, const std::string& extra = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra +
         "Content-Length: " + std::to_string(content_length) + "\r\n\r\n";
}

// kChat padded with trailing spaces to exactly n bytes (still valid JSON).
std::string padded_chat(size_t n) {
  std::string s = kChat;
  s.resize(std::max(n, s.size()), ' ');
  return s;
}

TEST(ServerHttpLimits, MissingKeyIs401BeforeTheBodyIsRead) {
  TestServer ts(hello_engine(), [](server::ServerOptions& o) { o.api_key = "sekret-key"; });
  // Only the header is sent: the answer must not wait for the body.
  {
    RawConn c(ts.port);
    c.send(post_head("/v1/chat/completions", 100000));
    auto r = c.read_reply(5000);
    EXPECT_EQ(r.status, 401);
    EXPECT_EQ(error_of(r)["code"], "invalid_api_key");
    EXPECT_EQ(r.headers["connection"], "close");
    EXPECT_TRUE(r.closed);
  }
  {
    RawConn c(ts.port);
    c.send(post_head("/v1/completions", 100000, "Authorization: Bearer wrong\r\n"));
    EXPECT_EQ(c.read_reply(5000).status, 401);
  }
  // With Expect: 100-continue the client never has to send the body at all.
  {
    RawConn c(ts.port);
    c.send(post_head("/v1/chat/completions", 100000, "Expect: 100-continue\r\n"));
    EXPECT_EQ(c.read_reply(5000).status, 401);
  }
  // A client that keeps sending its body after the refusal still reads the 401 (no reset while it sends).
  {
    RawConn c(ts.port);
    const std::string body(4 << 20, ' ');
    c.send(post_head("/v1/chat/completions", body.size()));
    std::thread sender([&] {
      try {
        c.send(body);
      } catch (const std::exception&) {
      }
    });
    auto r = c.read_reply(10000);
    sender.join();
    EXPECT_EQ(r.status, 401);
  }
  // The right key: the body is read and served.
  {
    RawConn c(ts.port);
    c.send(post_head("/v1/chat/completions", kChat.size(), "Authorization: Bearer sekret-key\r\n"));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    c.send(kChat);
    EXPECT_EQ(c.read_reply(5000).status, 200);
  }
  EXPECT_EQ(fetch(ts.port, "GET", "/health").status, 200);
  // Refused at the header stage, still counted.
  const std::string m = fetch(ts.port, "GET", "/metrics").body;
  EXPECT_NE(m.find("deepinfer_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"401\"} 3\n"), std::string::npos) << m;
}

TEST(ServerHttpLimits, InflightBodyBudgetIs503) {
  TestServer ts(hello_engine(), [](server::ServerOptions& o) {
    o.http.max_body_bytes = 4 << 20;
    o.http.max_inflight_body_bytes = 1 << 20;
  });
  const size_t len = 700000;
  // A holds 700 kB of the 1 MiB budget while its body trickles in.
  RawConn a(ts.port);
  a.send(post_head("/v1/chat/completions", len));
  a.send(std::string(kChat));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  {
    RawConn b(ts.port);
    b.send(post_head("/v1/chat/completions", len));
    auto r = b.read_reply(5000);
    EXPECT_EQ(r.status, 503);
    EXPECT_EQ(error_of(r)["code"], "server_busy");
    EXPECT_EQ(r.headers["retry-after"], "1");
  }
  // Small bodies still fit beside it.
  EXPECT_EQ(fetch(ts.port, "POST", "/v1/chat/completions", kChat).status, 200);
  a.send(padded_chat(len).substr(kChat.size()));
  EXPECT_EQ(a.read_reply(5000).status, 200);
  // Released once A's request is done: the same size is accepted again.
  EXPECT_EQ(fetch(ts.port, "POST", "/v1/chat/completions", padded_chat(len)).status, 200);

  // A chunked body has no declared length: it is charged as it grows.
  RawConn c(ts.port);
  c.send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n");
  const std::string piece(256 * 1024, ' ');
  HttpReply r;
  for (int i = 0; i < 8; ++i) {
    char len_line[32];
    std::snprintf(len_line, sizeof len_line, "%zx\r\n", piece.size());
    try {
      c.send(len_line + piece + "\r\n");
    } catch (const std::exception&) {
      break;  // refused and closed
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  r = c.read_reply(5000);
  EXPECT_EQ(r.status, 503);
}

TEST(ServerHttpLimits, ConnectionCap) {
  TestServer ts(hello_engine(), [](server::ServerOptions& o) { o.http.max_connections = 3; });
  std::vector<std::unique_ptr<RawConn>> idle;
  for (int i = 0; i < 3; ++i) idle.push_back(std::make_unique<RawConn>(ts.port));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  {
    RawConn over(ts.port);
    auto r = over.read_reply(5000);
    EXPECT_EQ(r.status, 503);
    EXPECT_EQ(error_of(r)["code"], "server_busy");
    EXPECT_TRUE(r.closed);
  }
  // The held connections work; once one closes, a new one is accepted.
  idle[0]->send(http_request("GET", "/health"));
  EXPECT_EQ(idle[0]->read_reply(5000).status, 200);
  idle[1].reset();
  int status = 0;
  for (int i = 0; i < 100 && status != 200; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    status = fetch(ts.port, "GET", "/health").status;
  }
  EXPECT_EQ(status, 200);
}

TEST(ServerHttpLimits, HeaderSizeLimitIs431) {
  TestServer ts(hello_engine(), [](server::ServerOptions& o) { o.http.max_header_bytes = 16 * 1024; });
  EXPECT_EQ(fetch(ts.port, "GET", "/health", "", "X-Pad: " + std::string(12000, 'a') + "\r\n").status, 200);
  RawConn c(ts.port);
  c.send("GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + std::string(20000, 'a') + "\r\n\r\n");
  auto r = c.read_reply(5000);
  EXPECT_EQ(r.status, 431);
  EXPECT_EQ(error_of(r)["code"], "headers_too_large");
}

TEST(ServerHttpProtocol, TransferCodingsOtherThanChunkedAre501) {
  TestServer ts(hello_engine());
  for (const char* te : {"gzip, chunked", "deflate,chunked", "x-custom ,  Chunked"}) {
    RawConn c(ts.port);
    c.send(std::string("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: ") +
           te + "\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
    auto r = c.read_reply(5000);
    EXPECT_EQ(r.status, 501) << te;
    EXPECT_EQ(error_of(r)["code"], "unsupported_transfer_encoding") << te;
  }
  // Chunked not last, or beside Content-Length: the body length is ambiguous (smuggling) -> 400.
  for (const char* fields : {"Transfer-Encoding: chunked, gzip\r\n", "Transfer-Encoding: gzip\r\n",
                             "Transfer-Encoding: chunked, chunked\r\n", "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n"}) {
    RawConn c(ts.port);
    c.send(std::string("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n") + fields +
           "\r\n5\r\nhello\r\n0\r\n\r\n");
    EXPECT_EQ(c.read_reply(5000).status, 400) << fields;
  }
  // Plain chunked is served.
  RawConn c(ts.port);
  char len_line[32];
  std::snprintf(len_line, sizeof len_line, "%zx\r\n", kChat.size());
  c.send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" +
         std::string(len_line) + kChat + "\r\n0\r\n\r\n");
  EXPECT_EQ(c.read_reply(5000).status, 200);
}

TEST(ServerHttpProtocol, AbsoluteFormTargetsAreRoutedByPath) {
  TestServer ts(hello_engine());
  auto r = fetch(ts.port, "POST", "http://localhost:8000/v1/chat/completions", kChat);
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["object"], "chat.completion");
  EXPECT_EQ(fetch(ts.port, "GET", "http://example.com/health?probe=1").status, 200);
  EXPECT_EQ(fetch(ts.port, "GET", "HTTP://EXAMPLE.COM/v1/models").status, 200);
  EXPECT_EQ(fetch(ts.port, "GET", "http://example.com").status, 404);  // path "/"
  EXPECT_EQ(fetch(ts.port, "GET", "x?u=http://a/health").status, 404);  // not a scheme: not absolute-form
}

// Reads one response head from `c` (status line + fields, up to the blank line), raw.
std::string read_head(RawConn& c, std::string& rest, int timeout_ms = 5000) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::string buf = rest;
  size_t end;
  while ((end = buf.find("\r\n\r\n")) == std::string::npos) {
    pollfd p{c.fd(), POLLIN, 0};
    const int left = int(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
    if (left <= 0 || ::poll(&p, 1, left) <= 0) throw std::runtime_error("no response head (got: " + buf + ")");
    char tmp[4096];
    const ssize_t n = ::recv(c.fd(), tmp, sizeof tmp, 0);
    if (n <= 0) throw std::runtime_error("closed (got: " + buf + ")");
    buf.append(tmp, size_t(n));
  }
  rest = buf.substr(end + 4);
  return buf.substr(0, end + 4);
}

TEST(ServerHttpProtocol, HeadIsGetWithoutTheBody) {
  TestServer ts(hello_engine());
  const auto get = fetch(ts.port, "GET", "/health");
  ASSERT_EQ(get.status, 200);
  for (const char* path : {"/health", "/v1/models", "/metrics"}) {
    // HEAD then GET pipelined: the GET reply must follow the HEAD reply's header directly.
    RawConn c(ts.port);
    c.send(std::string("HEAD ") + path + " HTTP/1.1\r\nHost: x\r\n\r\n" + http_request("GET", "/health"));
    std::string rest;
    const std::string head = read_head(c, rest);
    EXPECT_EQ(head.rfind("HTTP/1.1 200 ", 0), 0u) << head;
    EXPECT_NE(head.find("Content-Length: "), std::string::npos) << head;
    if (std::string(path) == "/health") {
      EXPECT_NE(head.find("Content-Length: " + std::to_string(get.body.size()) + "\r\n"), std::string::npos) << head;
    }
    const std::string next = read_head(c, rest);
    EXPECT_EQ(next.rfind("HTTP/1.1 200 ", 0), 0u) << "HEAD reply carried a body: " << next;
  }
  // A POST-only route: 405 naming the allowed method, still without a body.
  RawConn c(ts.port);
  c.send("HEAD /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n" + http_request("GET", "/health"));
  std::string rest;
  const std::string head = read_head(c, rest);
  EXPECT_EQ(head.rfind("HTTP/1.1 405 ", 0), 0u) << head;
  EXPECT_NE(head.find("Allow: POST\r\n"), std::string::npos) << head;
  EXPECT_EQ(read_head(c, rest).rfind("HTTP/1.1 200 ", 0), 0u);
}

TEST(ServerHttpProtocol, Http10StreamIsCloseDelimited) {
  TestServer ts(hello_engine());
  const std::string body = R"({"prompt":"x","max_tokens":4,"stream":true})";
  RawConn c(ts.port);
  c.send("POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\n\r\n" + body);
  auto r = c.read_reply(10000);  // neither Content-Length nor chunked: reads to EOF
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.headers.count("content-length"), 0u);
  EXPECT_EQ(r.headers["transfer-encoding"], "");
  EXPECT_EQ(r.headers["connection"], "close");
  EXPECT_EQ(r.body.rfind("data: ", 0), 0u) << "chunk framing in a 1.0 body: " << r.body;
  auto ev = sse_data(r.body);
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.back(), "[DONE]");
  EXPECT_TRUE(c.eof());
  // Non-streaming 1.0 replies keep their Content-Length.
  RawConn d(ts.port);
  d.send("POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(kChat.size()) +
         "\r\n\r\n" + kChat);
  auto n = d.read_reply(5000);
  EXPECT_EQ(n.status, 200);
  EXPECT_EQ(n.headers["content-length"], std::to_string(n.body.size()));
}

// The bare HTTP layer: a handler that streams until the client is gone.
struct StreamingHttp {
  std::atomic<bool> gone_fired{false};
  std::atomic<int> exchanges{0};
  std::vector<std::thread> writers;
  std::unique_ptr<server::HttpServer> http;
  std::function<void(std::shared_ptr<server::HttpExchange>)> body;

  explicit StreamingHttp(double write_timeout_s, std::function<void(std::shared_ptr<server::HttpExchange>)> b) : body(std::move(b)) {
    server::HttpOptions o;
    o.port = 0;
    o.write_timeout_s = write_timeout_s;
    http = std::make_unique<server::HttpServer>(o, [this](server::HttpRequest&&, std::shared_ptr<server::HttpExchange> ex) {
      ++exchanges;
      ex->on_client_gone([this] { gone_fired = true; });
      ex->start_stream("text/plain");
      writers.emplace_back([this, ex] { body(ex); });
    });
    http->start();
  }
  ~StreamingHttp() {
    http->stop();
    for (auto& t : writers) t.join();
  }
};

TEST(ServerHttpLimits, WriteTimeoutClosesAClientThatDoesNotRead) {
  StreamingHttp s(0.5, [](std::shared_ptr<server::HttpExchange> ex) {
    const std::string block(64 * 1024, 'x');
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    // Back-pressure as a producer would apply it: stop queueing while 1 MiB waits for the socket.
    while (!ex->client_gone() && std::chrono::steady_clock::now() < give_up) {
      if (ex->pending_bytes() > (1u << 20)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      ex->write(block);
    }
  });
  // The client shrinks its receive window and never reads.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  int small = 4096;
  ASSERT_EQ(::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small), 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(s.http->port());
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  const std::string req = "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), ssize_t(req.size()));

  const auto t0 = std::chrono::steady_clock::now();
  while (!s.gone_fired && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(s.gone_fired) << "on_client_gone did not fire for a client that never reads";
  EXPECT_GE(waited, 0.4);  // not before the timeout
  for (int i = 0; i < 200 && s.http->open_connections() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(s.http->open_connections(), 0) << "the connection stayed open";
  // The server closed its side: draining the socket ends in EOF or a reset.
  char buf[65536];
  ssize_t n;
  const auto t1 = std::chrono::steady_clock::now();
  while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0 && std::chrono::steady_clock::now() - t1 < std::chrono::seconds(10)) {
  }
  EXPECT_LE(n, 0);
  ::close(fd);
}

TEST(ServerHttpLimits, PendingBytesGrowWhileTheClientDoesNotRead) {
  std::atomic<size_t> max_pending{0};
  std::atomic<bool> stop{false};
  StreamingHttp s(0, [&](std::shared_ptr<server::HttpExchange> ex) {
    const std::string block(64 * 1024, 'x');
    while (!ex->client_gone() && !stop) {
      const size_t p = ex->pending_bytes();
      if (p > max_pending) max_pending = p;
      if (p > (4u << 20)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      ex->write(block);
    }
  });
  RawConn c(s.http->port());
  int small = 4096;
  ::setsockopt(c.fd(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  c.send("GET /s HTTP/1.1\r\nHost: x\r\n\r\n");
  for (int i = 0; i < 500 && max_pending < (4u << 20); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_GT(max_pending.load(), size_t(4) << 20) << "queued bytes not reported";
  // With the write timeout off, a stalled client is not dropped.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(s.gone_fired);
  stop = true;
  c.close();
}

TEST(ServerHttpLimits, WriteTimeoutDoesNotCutSlowButReadStreams) {
  // Gaps between writes longer than the write timeout are fine: only undrained output counts.
  StreamingHttp s(0.3, [](std::shared_ptr<server::HttpExchange> ex) {
    ex->write("one ");
    std::this_thread::sleep_for(std::chrono::milliseconds(900));
    ex->write("two");
    ex->end_stream();
  });
  RawConn c(s.http->port());
  c.send("GET /s HTTP/1.1\r\nHost: x\r\n\r\n");
  auto r = c.read_reply(10000);
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "one two");
  EXPECT_FALSE(s.gone_fired);
  // The connection is still usable.
  c.send("GET /s HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(c.read_reply(10000).body, "one two");
}

TEST(ServerHttpLimits, LoopbackAddresses) {
  EXPECT_TRUE(server::is_loopback_address("127.0.0.1"));
  EXPECT_TRUE(server::is_loopback_address("127.1.2.3"));
  EXPECT_TRUE(server::is_loopback_address("::1"));
  EXPECT_FALSE(server::is_loopback_address("0.0.0.0"));
  EXPECT_FALSE(server::is_loopback_address("::"));
  EXPECT_FALSE(server::is_loopback_address("192.168.1.5"));
  EXPECT_FALSE(server::is_loopback_address("localhost"));  // not an address: --host refuses it anyway
}

}  // namespace
}  // namespace di::test

namespace di::test {
namespace {

// Through the server: a stream whose client stops reading is cancelled in the engine after --write-timeout.
TEST(ServerHttpLimits, WriteTimeoutCancelsTheGeneration) {
  FakeEngineOptions fo = hello_engine();
  fo.script = script_tokens("a b c d e f g", false);
  fo.step_ms = 1;
  TestServer ts(fo, [](server::ServerOptions& o) { o.http.write_timeout_s = 0.5; });
  RawConn c(ts.port);
  int small = 4096;
  ::setsockopt(c.fd(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  // Eight choices with 20 top logprobs each: several kB per engine step, far more than the socket buffers hold.
  c.send(http_request("POST", "/v1/completions",
                      R"({"prompt":"x","max_tokens":3000,"n":8,"logprobs":20,"ignore_eos":true,"stream":true})"));
  for (int i = 0; i < 1000 && ts.engine->cancel_calls().empty(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(ts.engine->cancel_calls().size(), 1u) << "the engine kept generating for a client that does not read";
  for (int i = 0; i < 200 && ts.engine->stats().running > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(ts.engine->stats().running, 0);
  EXPECT_EQ(fetch(ts.port, "GET", "/health").status, 200);
}

}  // namespace
}  // namespace di::test
