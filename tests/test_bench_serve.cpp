// deepinfer bench serve against a fake OpenAI-compatible streaming server with known delays: the
// measured TTFT, ITL, TPOT, E2EL, throughput, concurrency and goodput are checked numerically.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include "bench/serve_bench.h"
#include "engine/engine.h"
#include "model/model.h"
#include "server_process.h"

using namespace di::bench;
using nlohmann::json;

namespace {

// A thread-per-connection HTTP/1.1 server: POST /v1/completions or /v1/chat/completions answers
// with `chunks` SSE events (chunked transfer encoding), the first after `first_ms`, then one every
// `gap_ms`, then a usage event and [DONE].
class FakeServer {
 public:
  int first_ms = 100, gap_ms = 20, chunks = 5;
  bool send_usage = true, fail = false;
  int vocab_size = 1000;        // the /v1/models card's vocab_size; 0 = no such field
  bool engine_metrics = false;  // GET /metrics with deepinfer's decode counters: per finished
                                // request 10 decode steps of 2 rows, 5 ms each; else 404

  FakeServer() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd_, 64) != 0) std::abort();
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] {
      for (;;) {
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) return;
        std::lock_guard<std::mutex> g(mu_);
        if (stop_) {
          ::close(c);
          return;
        }
        workers_.emplace_back([this, c] { serve(c); });
      }
    });
  }
  ~FakeServer() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    acceptor_.join();
    for (auto& w : workers_) w.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::vector<json> bodies() {
    std::lock_guard<std::mutex> g(mu_);
    return bodies_;
  }
  std::vector<std::string> targets() {
    std::lock_guard<std::mutex> g(mu_);
    return targets_;
  }
  int max_in_flight() const { return max_in_flight_; }

 private:
  static void send_all(int c, const std::string& s) {
    size_t off = 0;
    while (off < s.size()) {
      const ssize_t n = ::send(c, s.data() + off, s.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return;
      off += size_t(n);
    }
  }
  static void send_chunk(int c, const std::string& s) {
    char hex[32];
    std::snprintf(hex, sizeof hex, "%zx\r\n", s.size());
    send_all(c, hex + s + "\r\n");
  }
  void serve(int c) {
    std::string req;
    char buf[4096];
    size_t header_end = std::string::npos;
    while ((header_end = req.find("\r\n\r\n")) == std::string::npos) {
      const ssize_t n = ::recv(c, buf, sizeof buf, 0);
      if (n <= 0) return (void)::close(c);
      req.append(buf, size_t(n));
    }
    size_t len = 0;
    const size_t cl = req.find("Content-Length: ");
    if (cl != std::string::npos) len = std::stoul(req.substr(cl + 16));
    while (req.size() < header_end + 4 + len) {
      const ssize_t n = ::recv(c, buf, sizeof buf, 0);
      if (n <= 0) return (void)::close(c);
      req.append(buf, size_t(n));
    }
    const std::string target = req.substr(req.find(' ') + 1, req.find(' ', req.find(' ') + 1) - req.find(' ') - 1);
    if (target == "/metrics") {
      const int done = finished_;
      const std::string body = "# HELP deepinfer_engine_decode_steps_total x\n# TYPE deepinfer_engine_decode_steps_total counter\n"
                               "deepinfer_engine_decode_steps_total " + std::to_string(10 * done) + "\n" +
                               "deepinfer_engine_decode_rows_total " + std::to_string(20 * done) + "\n" +
                               "deepinfer_engine_decode_seconds_total " + std::to_string(0.05 * done) + "\n";
      send_all(c, std::string(engine_metrics ? "HTTP/1.1 200 OK" : "HTTP/1.1 404 Not Found") +
                      "\r\nContent-Type: text/plain\r\nContent-Length: " + std::to_string(engine_metrics ? body.size() : 0) +
                      "\r\nConnection: close\r\n\r\n" + (engine_metrics ? body : ""));
      return (void)::close(c);
    }
    if (target == "/v1/models") {
      json card = {{"id", "fake-model"}, {"object", "model"}};
      if (vocab_size > 0) card["vocab_size"] = vocab_size;
      const std::string body = json{{"object", "list"}, {"data", json::array({card})}}.dump();
      send_all(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                      "\r\nConnection: close\r\n\r\n" + body);
      return (void)::close(c);
    }
    const json body = json::parse(req.substr(header_end + 4, len), nullptr, false);
    const int now = ++in_flight_;
    for (int m = max_in_flight_; now > m && !max_in_flight_.compare_exchange_weak(m, now);) {}
    {
      std::lock_guard<std::mutex> g(mu_);
      bodies_.push_back(body);
      targets_.push_back(target);
    }
    const bool chat = target == "/v1/chat/completions";
    // The request leaves the in-flight count before its last bytes go out: once the client has
    // them it may send its next request, and a count dropped only after the send could be seen
    // one too high by that request (seen on a loaded CI machine).
    if (fail) {
      --in_flight_;
      const std::string msg = R"({"error":{"message":"boom"}})";
      send_all(c, "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: " +
                      std::to_string(msg.size()) + "\r\nConnection: close\r\n\r\n" + msg);
    } else {
      send_all(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
      for (int i = 0; i < chunks; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(i == 0 ? first_ms : gap_ms));
        json ev = chat ? json{{"choices", {{{"index", 0}, {"delta", {{"content", "t" + std::to_string(i)}}}}}}}
                       : json{{"choices", {{{"index", 0}, {"text", "t" + std::to_string(i)}}}}};
        send_chunk(c, "data: " + ev.dump() + "\n\n");
      }
      --in_flight_;
      if (send_usage) send_chunk(c, "data: " + json{{"choices", json::array()}, {"usage", {{"prompt_tokens", 7}, {"completion_tokens", chunks}}}}.dump() + "\n\n");
      ++finished_;  // before the client can see the end of the stream
      send_chunk(c, "data: [DONE]\n\n");
      send_all(c, "0\r\n\r\n");
    }
    ::close(c);
  }

  int fd_ = -1, port_ = 0;
  std::thread acceptor_;
  std::mutex mu_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
  std::vector<json> bodies_;
  std::vector<std::string> targets_;
  std::atomic<int> in_flight_{0}, max_in_flight_{0}, finished_{0};
};

ServeOptions quick(const FakeServer& s, int n) {
  ServeOptions o;
  o.base_url = s.url();
  o.model = "m";
  o.num_prompts = n;
  o.input_len = 16;
  o.output_len = 5;
  o.progress = false;
  o.seed = 3;
  return o;
}

}  // namespace

TEST(BenchServe, SequentialLatenciesMatchTheServer) {
  FakeServer srv;  // first chunk at 120 ms, then 4 more 30 ms apart
  srv.first_ms = 120;
  srv.gap_ms = 30;
  ServeOptions o = quick(srv, 4);
  o.max_concurrency = 1;
  const ServeResult r = run_serve_bench(o);
  const auto& m = r.metrics;
  EXPECT_EQ(m.completed, 4);
  EXPECT_EQ(m.failed, 0);
  EXPECT_EQ(m.total_input, 64);   // 16 token ids each, known exactly
  EXPECT_EQ(m.total_output, 20);  // usage.completion_tokens
  // Lower bounds are the fake server's delays; upper bounds leave room for a busy shared machine
  // (CTest runs two tests at once on two cores), while TTFT must still end well before E2E.
  const auto& L = m.latency_ms;
  EXPECT_GE(L.at("median_ttft_ms"), 118);
  EXPECT_LT(L.at("median_ttft_ms"), 400);
  EXPECT_GE(L.at("mean_itl_ms"), 28);
  EXPECT_LT(L.at("mean_itl_ms"), 150);
  EXPECT_GE(L.at("mean_tpot_ms"), 28);
  EXPECT_LT(L.at("mean_tpot_ms"), 150);
  EXPECT_GE(L.at("median_e2el_ms"), 238);
  EXPECT_LT(L.at("median_e2el_ms"), 800);
  EXPECT_GE(L.at("median_e2el_ms") - L.at("median_ttft_ms"), 4 * 28) << "TTFT is taken at the first chunk";
  EXPECT_GE(L.at("p99_ttft_ms"), L.at("median_ttft_ms"));
  EXPECT_GE(L.at("p90_e2el_ms"), L.at("median_e2el_ms"));
  // One at a time: the run lasts at least 4 requests.
  EXPECT_GE(m.duration, 4 * 0.238);
  EXPECT_NEAR(m.request_throughput, 4 / m.duration, 1e-9);
  EXPECT_NEAR(m.output_throughput, 20 / m.duration, 1e-9);
  EXPECT_NEAR(m.total_token_throughput, 84 / m.duration, 1e-9);
  EXPECT_EQ(srv.max_in_flight(), 1);
  for (const auto& out : r.outputs) {
    EXPECT_EQ(out.itl.size(), 4u);
    EXPECT_EQ(out.generated_text, "t0t1t2t3t4");
  }
  // What the server was asked.
  const auto bodies = srv.bodies();
  ASSERT_EQ(bodies.size(), 4u);
  for (const auto& b : bodies) {
    EXPECT_EQ(b["model"], "m");
    EXPECT_EQ(b["stream"], true);
    EXPECT_EQ(b["max_tokens"], 5);
    EXPECT_EQ(b["ignore_eos"], true);
    EXPECT_EQ(b["stream_options"]["include_usage"], true);
    ASSERT_TRUE(b["prompt"].is_array());
    EXPECT_EQ(b["prompt"].size(), 16u);
  }
  EXPECT_NE(bodies[0]["prompt"], bodies[1]["prompt"]);
}

TEST(BenchServe, ConcurrentStreamsOverlap) {
  FakeServer srv;
  srv.first_ms = 150;
  srv.gap_ms = 10;
  const ServeResult all = run_serve_bench(quick(srv, 8));  // unlimited: all 8 at once
  EXPECT_EQ(all.metrics.completed, 8);
  EXPECT_LT(all.metrics.duration, 1.2);  // ~0.19 s when the streams overlap, 1.5 s if serialized (busy machine: slack)
  EXPECT_EQ(srv.max_in_flight(), 8);
  EXPECT_GE(all.metrics.max_concurrent_requests, 8);

  FakeServer srv2;
  srv2.first_ms = 150;
  srv2.gap_ms = 10;
  ServeOptions o = quick(srv2, 8);
  o.max_concurrency = 2;
  const ServeResult two = run_serve_bench(o);
  EXPECT_EQ(two.metrics.completed, 8);
  EXPECT_EQ(srv2.max_in_flight(), 2);
  EXPECT_GE(two.metrics.duration, 4 * 0.19);
  // Client-side queueing is not part of TTFT (as in vLLM): each request's clock starts when it is sent.
  EXPECT_LT(two.metrics.latency_ms.at("p99_ttft_ms"), 600);
}

TEST(BenchServe, PoissonArrivals) {
  const auto t = arrival_times(50, 20, 1.0, 7);
  ASSERT_EQ(t.size(), 50u);
  EXPECT_NEAR(t.back(), 50 / 20.0, 1e-9);  // rescaled: the last arrival at n / rate
  for (size_t i = 1; i < t.size(); ++i) EXPECT_GE(t[i], t[i - 1]);
  EXPECT_NE(arrival_times(50, 20, 1.0, 8), t);
  EXPECT_EQ(arrival_times(50, 20, 1.0, 7), t);
  for (double x : arrival_times(5, std::numeric_limits<double>::infinity(), 1, 0)) EXPECT_EQ(x, 0);
  EXPECT_THROW(arrival_times(5, -1, 1, 0), std::invalid_argument);

  FakeServer srv;
  srv.first_ms = 20;
  srv.gap_ms = 5;
  ServeOptions o = quick(srv, 6);
  o.request_rate = 10;  // the last request leaves at 0.6 s
  const ServeResult r = run_serve_bench(o);
  EXPECT_EQ(r.metrics.completed, 6);
  EXPECT_GE(r.metrics.duration, 0.6 + 0.04);
  EXPECT_LT(r.metrics.duration, 1.2);
  EXPECT_EQ(r.json["request_rate"], 10.0);
}

TEST(BenchServe, GoodputUnderSlos) {
  FakeServer srv;
  srv.first_ms = 120;
  srv.gap_ms = 10;
  ServeOptions o = quick(srv, 3);
  o.goodput = parse_goodput({"ttft:60"});
  EXPECT_DOUBLE_EQ(run_serve_bench(o).metrics.request_goodput, 0);  // every TTFT is ~120 ms
  o.goodput = parse_goodput({"ttft:1000", "e2el:2000"});
  const ServeResult r = run_serve_bench(o);
  EXPECT_NEAR(r.metrics.request_goodput, r.metrics.request_throughput, 1e-9);
  o.goodput = parse_goodput({"tpot:2"});  // TPOT is ~10 ms
  EXPECT_DOUBLE_EQ(run_serve_bench(o).metrics.request_goodput, 0);
  EXPECT_THROW(parse_goodput({"ttft"}), std::invalid_argument);
  EXPECT_THROW(parse_goodput({"speed:3"}), std::invalid_argument);
  EXPECT_THROW(parse_goodput({"ttft:-1"}), std::invalid_argument);
  EXPECT_THROW(parse_goodput({"ttft:abc"}), std::invalid_argument);
}

TEST(BenchServe, FailuresAndMissingUsage) {
  FakeServer bad;
  bad.fail = true;
  const ServeResult r = run_serve_bench(quick(bad, 3));
  EXPECT_EQ(r.metrics.completed, 0);
  EXPECT_EQ(r.metrics.failed, 3);
  ASSERT_FALSE(r.json["errors"].empty());
  EXPECT_NE(r.json["errors"][0].get<std::string>().find("HTTP 500"), std::string::npos);

  FakeServer nousage;
  nousage.send_usage = false;
  nousage.chunks = 3;
  nousage.first_ms = 10;
  const ServeResult u = run_serve_bench(quick(nousage, 2));
  EXPECT_EQ(u.metrics.completed, 2);
  EXPECT_EQ(u.metrics.total_output, 6);  // counted chunks

  ServeOptions o = quick(nousage, 1);
  o.base_url = "http://127.0.0.1:1";  // nothing listens there
  o.vocab_size = 1000;                // else asking /v1/models for it fails first
  const ServeResult refused = run_serve_bench(o);
  EXPECT_EQ(refused.metrics.failed, 1);
  o.base_url = "https://x";
  EXPECT_THROW(run_serve_bench(o), std::invalid_argument);
}

TEST(BenchServe, ChatEndpointAndModelDiscovery) {
  FakeServer srv;
  srv.first_ms = 30;
  srv.gap_ms = 5;
  ServeOptions o = quick(srv, 2);
  o.endpoint = "/v1/chat/completions";
  o.model.clear();  // asks GET /v1/models
  const ServeResult r = run_serve_bench(o);
  EXPECT_EQ(r.metrics.completed, 2);
  EXPECT_EQ(r.json["model_id"], "fake-model");
  EXPECT_EQ(r.json["backend"], "openai-chat");
  EXPECT_EQ(r.outputs[0].generated_text, "t0t1t2t3t4");
  EXPECT_EQ(r.metrics.total_input, 14);  // from usage.prompt_tokens (text prompts)
  const auto bodies = srv.bodies();
  ASSERT_EQ(bodies.size(), 2u);
  EXPECT_EQ(bodies[0]["messages"][0]["role"], "user");
  EXPECT_TRUE(bodies[0]["messages"][0]["content"].is_string());
  EXPECT_EQ(bodies[0]["max_completion_tokens"], 5);
}

TEST(BenchServe, JsonUsesVllmFieldNames) {
  FakeServer srv;
  srv.first_ms = 10;
  srv.gap_ms = 2;
  ServeOptions o = quick(srv, 2);
  o.goodput = parse_goodput({"ttft:500"});
  const ServeResult r = run_serve_bench(o);
  for (const char* k :
       {"date" /* added by the CLI */, "completed", "failed", "total_input_tokens", "total_output_tokens", "duration",
        "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
        "max_concurrent_requests", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
        "std_itl_ms", "p90_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p90_e2el_ms",
        "p99_e2el_ms", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency", "backend"}) {
    if (std::string(k) == "date") continue;
    EXPECT_TRUE(r.json.contains(k)) << k;
  }
  EXPECT_EQ(r.json["request_rate"], "inf");
  EXPECT_TRUE(r.json["max_concurrency"].is_null());
  EXPECT_NE(r.text.find("Mean TTFT (ms):"), std::string::npos);
  EXPECT_NE(r.text.find("P99 ITL (ms):"), std::string::npos);
}

TEST(BenchServe, MetricsMath) {
  // Two requests with known timings (seconds).
  RequestOutput a, b, c;
  a.success = b.success = true;
  a.prompt_len = 10, a.output_tokens = 3, a.ttft = 0.1, a.itl = {0.02, 0.04}, a.latency = 0.16, a.start_time = 0;
  b.prompt_len = 20, b.output_tokens = 1, b.ttft = 0.3, b.latency = 0.3, b.start_time = 0.5;
  c.success = false;
  const ServeMetrics m = calculate_serve_metrics({a, b, c}, 2.0, {{"ttft", 200}}, {50, 99});
  EXPECT_EQ(m.completed, 2);
  EXPECT_EQ(m.failed, 1);
  EXPECT_EQ(m.total_input, 30);
  EXPECT_EQ(m.total_output, 4);
  EXPECT_DOUBLE_EQ(m.request_throughput, 1.0);
  EXPECT_DOUBLE_EQ(m.output_throughput, 2.0);
  EXPECT_DOUBLE_EQ(m.total_token_throughput, 17.0);
  EXPECT_DOUBLE_EQ(m.request_goodput, 0.5);  // only a meets ttft <= 200 ms
  EXPECT_NEAR(m.latency_ms.at("mean_ttft_ms"), 200, 1e-9);
  EXPECT_NEAR(m.latency_ms.at("std_ttft_ms"), 100, 1e-9);
  EXPECT_NEAR(m.latency_ms.at("p99_ttft_ms"), 298, 1e-9);
  EXPECT_NEAR(m.latency_ms.at("mean_tpot_ms"), 30, 1e-9);  // (0.16 - 0.1) / 2; b has one token: no TPOT
  EXPECT_NEAR(m.latency_ms.at("mean_itl_ms"), 30, 1e-9);
  EXPECT_NEAR(m.latency_ms.at("median_e2el_ms"), 230, 1e-9);
  EXPECT_DOUBLE_EQ(m.max_output_tokens_per_s, 4);
}

TEST(BenchServe, JsonlDataset) {
  const std::string path = std::string(DI_BINARY_DIR) + "/bench_serve_prompts.jsonl";
  {
    std::ofstream f(path);
    f << R"({"prompt": "hello there", "max_tokens": 3})" << "\n\n" << R"({"prompt": [1, 2, 3]})" << "\n";
  }
  ServeOptions o;
  o.dataset = "jsonl";
  o.dataset_path = path;
  o.num_prompts = 3;
  o.output_len = 9;
  const auto reqs = load_serve_requests(o);
  ASSERT_EQ(reqs.size(), 3u);
  EXPECT_EQ(reqs[0].output_len, 3);
  EXPECT_EQ(reqs[1].output_len, 9);
  EXPECT_EQ(reqs[1].prompt_len, 3);
  EXPECT_EQ(reqs[2].prompt, reqs[0].prompt);  // cycles through the file
  {
    std::ofstream f(path);
    f << R"({"prompt": "ok"})" << "\n" << R"({"prompt": {"x": 1}})" << "\n";
  }
  try {
    load_serve_requests(o);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("bench_serve_prompts.jsonl:2"), std::string::npos) << e.what();
  }
}

// deepinfer's /metrics decode counters, read before and after the run: the server's own decode
// step time and batch size over exactly the run; absent (null) for servers without them.
TEST(BenchServe, EngineDecodeStepsFromMetrics) {
  FakeServer srv;
  srv.first_ms = 10;
  srv.gap_ms = 5;
  srv.engine_metrics = true;
  ServeOptions o = quick(srv, 6);
  const ServeResult r = run_serve_bench(o);
  ASSERT_EQ(r.metrics.completed, 6);
  ASSERT_TRUE(r.engine.available);
  EXPECT_EQ(r.engine.steps, 60);
  EXPECT_EQ(r.engine.rows, 120);
  EXPECT_NEAR(r.engine.mean_step_ms(), 5.0, 1e-9);
  EXPECT_EQ(r.json["engine_decode_steps"], 60);
  EXPECT_DOUBLE_EQ(r.json["engine_mean_decode_batch"].get<double>(), 2.0);
  EXPECT_NEAR(r.json["engine_mean_decode_step_ms"].get<double>(), 5.0, 1e-9);
  EXPECT_NE(r.text.find("Mean decode step (ms):"), std::string::npos);

  FakeServer plain;  // /metrics answers 404
  plain.first_ms = 10;
  plain.gap_ms = 5;
  const ServeResult p = run_serve_bench(quick(plain, 2));
  EXPECT_EQ(p.metrics.completed, 2);
  EXPECT_FALSE(p.engine.available);
  EXPECT_TRUE(p.json["engine_decode_steps"].is_null());
  EXPECT_TRUE(p.json["engine_mean_decode_step_ms"].is_null());
  EXPECT_EQ(p.text.find("Mean decode step"), std::string::npos);
}

TEST(BenchServe, ParseEngineDecodeCounters) {
  EngineDecodeStats s;
  EXPECT_TRUE(parse_engine_decode_counters("# HELP deepinfer_engine_decode_steps_total 9\n"
                                           "deepinfer_engine_decode_steps_total 12\n"
                                           "deepinfer_engine_decode_steps_total_other 99\n"
                                           "deepinfer_engine_decode_rows_total 96\n"
                                           "deepinfer_engine_decode_seconds_total 0.6000000000000001\n",
                                           s));
  EXPECT_EQ(s.steps, 12);
  EXPECT_EQ(s.rows, 96);
  EXPECT_DOUBLE_EQ(s.mean_batch(), 8.0);
  EXPECT_NEAR(s.mean_step_ms(), 50.0, 1e-9);
  EngineDecodeStats t;
  EXPECT_FALSE(parse_engine_decode_counters("deepinfer_engine_decode_steps_total 12\ndeepinfer_engine_decode_rows_total 96\n", t));
  EXPECT_FALSE(t.available);
  EXPECT_FALSE(parse_engine_decode_counters("deepinfer_engine_decode_steps_total x\ndeepinfer_engine_decode_rows_total 1\n"
                                            "deepinfer_engine_decode_seconds_total 1\n", t));
  EXPECT_FALSE(parse_engine_decode_counters("", t));
}

TEST(BenchServe, RandomIdsStayBelowTheServersVocab) {
  FakeServer srv;
  srv.first_ms = 5;
  srv.gap_ms = 1;
  srv.vocab_size = 300;
  ServeOptions o = quick(srv, 4);
  o.input_len = 200;
  ASSERT_EQ(o.vocab_size, 0);  // the default asks the server
  const ServeResult r = run_serve_bench(o);
  EXPECT_EQ(r.metrics.completed, 4);
  EXPECT_EQ(r.json["vocab_size"], 300);
  const auto bodies = srv.bodies();
  ASSERT_EQ(bodies.size(), 4u);
  int64_t top = 0;
  for (const auto& b : bodies)
    for (const auto& id : b["prompt"]) top = std::max(top, id.get<int64_t>());
  EXPECT_LT(top, 300);
  EXPECT_GT(top, 250);  // 800 draws from [0, 300) reach the top of the range

  FakeServer silent;  // a card without vocab_size: the client cannot guess the range
  silent.vocab_size = 0;
  ServeOptions q = quick(silent, 1);
  EXPECT_THROW(run_serve_bench(q), std::runtime_error);
  q.vocab_size = 50;  // an explicit range needs no card
  const ServeResult given = run_serve_bench(q);
  EXPECT_EQ(given.metrics.completed, 1);
  for (const auto& id : silent.bodies().at(0)["prompt"]) EXPECT_LT(id.get<int64_t>(), 50);
}

TEST(BenchServe, InProcessEngineOnTinyModel) {
  const std::string dir = di::test::e2e_model_dir();
  di::LoadOptions lo;
  lo.threads = 1;
  std::shared_ptr<const di::Model> model = di::load_model(dir, lo);
  di::engine::EngineOptions eo;
  auto eng = di::engine::Engine::create(model, eo);
  ServeOptions o;
  o.num_prompts = 4;
  o.input_len = 12;
  o.output_len = 5;
  o.max_concurrency = 1;
  o.progress = false;
  o.model = "tiny";
  const ServeResult r = run_engine_bench(*eng, o);
  EXPECT_EQ(r.metrics.completed, 4) << r.json["errors"].dump();
  EXPECT_EQ(r.metrics.failed, 0);
  EXPECT_EQ(r.metrics.total_input, 4 * 12);
  EXPECT_EQ(r.metrics.total_output, 4 * 5);  // ignore_eos: every request runs to max_tokens
  EXPECT_GT(r.metrics.output_throughput, 0);
  EXPECT_EQ(r.json["backend"], "deepinfer-engine");
  EXPECT_EQ(r.json["vocab_size"], model->info().sampleable_vocab);
  EXPECT_GT(r.json["median_ttft_ms"].get<double>(), 0);
  EXPECT_GT(r.json["median_tpot_ms"].get<double>(), 0);
  EXPECT_TRUE(r.json.contains("p99_ttft_ms") && r.json.contains("p99_tpot_ms"));
  EXPECT_GE(r.engine.steps, 4 * 4);  // decode steps after each first token
  ASSERT_EQ(r.outputs.size(), 4u);
  for (size_t i = 0; i < r.outputs.size(); ++i) {
    EXPECT_EQ(r.outputs[i].itl.size(), 4u);
    EXPECT_GE(r.outputs[i].latency, r.outputs[i].ttft);
    // Concurrency 1: a request starts only after the one before has finished.
    if (i > 0) {
      EXPECT_GE(r.outputs[i].start_time, r.outputs[i - 1].start_time + r.outputs[i - 1].latency);
    }
  }
  EXPECT_EQ(eng->stats().requests_submitted, 4);
  o.num_warmups = 2;  // untimed, before the run: submitted, but not in the results
  const ServeResult w = run_engine_bench(*eng, o);
  EXPECT_EQ(w.outputs.size(), 4u);
  EXPECT_EQ(w.metrics.total_output, 4 * 5);
  EXPECT_EQ(w.json["num_warmups"], 2);
  EXPECT_EQ(eng->stats().requests_submitted, 4 + 2 + 4);
  o.endpoint = "/v1/chat/completions";  // text prompts: the engine takes token ids only
  EXPECT_THROW(run_engine_bench(*eng, o), std::invalid_argument);
  eng->shutdown();
}

TEST(BenchServe, CliComparesServerAndInProcessEngine) {
  const std::string dir = di::test::e2e_model_dir();
  const std::string out = ::testing::TempDir() + "/bench_compare.json";
  std::remove(out.c_str());
  std::string log;
  const int rc = di::test::run_command(std::string(DI_BINARY_DIR) + "/deepinfer bench serve --in-process " + dir +
                                           " --compare --threads 1 --num-prompts 3 --input-len 16 --output-len 4"
                                           " --max-concurrency 2 --no-progress --json " + out,
                                       log);
  ASSERT_EQ(rc, 0) << log;
  EXPECT_NE(log.find("Server / engine tok/s"), std::string::npos) << log;
  std::ifstream f(out);
  ASSERT_TRUE(f.good());
  const json j = json::parse(f);
  // The server run drew its ids from the server's /v1/models vocab_size: none refused.
  EXPECT_EQ(j["server"]["completed"], 3) << j["server"]["errors"].dump();
  EXPECT_EQ(j["server"]["failed"], 0);
  EXPECT_EQ(j["engine"]["completed"], 3);
  EXPECT_EQ(j["server"]["vocab_size"], j["engine"]["vocab_size"]);
  EXPECT_EQ(j["server"]["num_warmups"], 2);  // default with --in-process: --max-concurrency
  EXPECT_EQ(j["engine"]["num_warmups"], 2);
  EXPECT_EQ(j["server"]["total_output_tokens"], 12);
  EXPECT_EQ(j["engine"]["total_output_tokens"], 12);
  const double ratio = j["server_over_engine_output_throughput"].get<double>();
  EXPECT_NEAR(ratio, j["server_output_throughput"].get<double>() / j["engine_output_throughput"].get<double>(), 1e-9);
  EXPECT_GT(ratio, 0);
}

TEST(BenchServe, WarmupsComeFirstAndAreNotCounted) {
  FakeServer srv;
  srv.first_ms = 5;
  srv.gap_ms = 1;
  ServeOptions o = quick(srv, 3);
  o.num_warmups = 2;
  const ServeResult r = run_serve_bench(o);
  EXPECT_EQ(r.metrics.completed, 3);
  EXPECT_EQ(r.outputs.size(), 3u);
  EXPECT_EQ(r.metrics.total_output, 3 * 5);
  const auto bodies = srv.bodies();
  ASSERT_EQ(bodies.size(), 5u);
  o.num_warmups = 0;
  const std::vector<ServeRequest> run = load_serve_requests([&] {
    ServeOptions q = o;
    q.vocab_size = 1000;  // what the fake server's card says
    return q;
  }());
  // The two warm-ups went first, with prompts of their own (no prefix-cache hits for the run).
  for (int k = 0; k < 2; ++k)
    for (const auto& req : run) EXPECT_NE(bodies[size_t(k)]["prompt"], req.prompt);
  int matched = 0;
  for (size_t k = 2; k < bodies.size(); ++k)
    for (const auto& req : run) matched += bodies[k]["prompt"] == req.prompt;
  EXPECT_EQ(matched, 3);
  o.num_warmups = -1;
  EXPECT_THROW(run_serve_bench(o), std::invalid_argument);
}
