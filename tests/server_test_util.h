// Test helpers for the HTTP server: a scripted fake engine (same interface as the real one, so the
// HTTP layer is tested without a model) and a blocking raw-HTTP client.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "server/server.h"
#include "test_paths.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/v41_vocab.h"

namespace di::test {

struct FakeEngineOptions {
  std::vector<int32_t> script;  // every choice emits these tokens in turn (cycling)
  int step_ms = 2;
  int prefill_ms = 0;       // delay before a request's first token
  int max_running = 64;
  int max_waiting = 64;
  int cached_tokens = 0;    // reported in StartEvent
  int32_t eos = 1;
  int pages_per_seq = 3;
};

class FakeEngine : public engine::Engine {
 public:
  explicit FakeEngine(FakeEngineOptions o) : o_(std::move(o)) {
    thread_ = std::thread([this] { loop(); });
  }
  ~FakeEngine() override { shutdown(); }

  engine::SubmitResult submit(engine::RequestParams params, std::shared_ptr<engine::RequestSink> sink) override {
    std::lock_guard lk(mu_);
    engine::SubmitResult r;
    if (stop_) {
      r.error = engine::SubmitError::ShuttingDown;
      return r;
    }
    if (int(running_.size() + waiting_.size()) >= o_.max_running + o_.max_waiting) {
      ++stats_.requests_rejected;
      r.error = engine::SubmitError::QueueFull;
      r.message = "queue full";
      r.retry_after_s = 2;
      return r;
    }
    auto q = std::make_shared<Req>();
    q->id = ++next_id_;
    q->params = std::move(params);
    q->sink = std::move(sink);
    q->pos.assign(size_t(q->params.n), 0);
    q->finished.assign(size_t(q->params.n), false);
    waiting_.push_back(q);
    ++stats_.requests_submitted;
    submitted_params_.push_back(q->params);
    r.id = q->id;
    return r;
  }
  void cancel(uint64_t id) override {
    std::lock_guard lk(mu_);
    cancel_calls_.push_back(id);
    cancelled_.insert(id);
  }
  engine::EngineStats stats() const override {
    std::lock_guard lk(mu_);
    return stats_;
  }
  void shutdown() override {
    {
      std::lock_guard lk(mu_);
      if (stop_) return;
      stop_ = true;
    }
    thread_.join();
    // Finish what is left, as the real engine does.
    std::vector<std::shared_ptr<Req>> left(running_.begin(), running_.end());
    left.insert(left.end(), waiting_.begin(), waiting_.end());
    for (auto& q : left)
      for (int c = 0; c < q->params.n; ++c)
        if (!q->finished[size_t(c)]) q->sink->on_finish({c, engine::FinishReason::Cancelled, ""});
    running_.clear();
    waiting_.clear();
  }
  const v41::Model& model() const override { throw std::logic_error("FakeEngine has no model"); }

  std::vector<uint64_t> cancel_calls() const {
    std::lock_guard lk(mu_);
    return cancel_calls_;
  }
  std::vector<engine::RequestParams> submitted() const {
    std::lock_guard lk(mu_);
    return submitted_params_;
  }

 private:
  struct Req {
    uint64_t id = 0;
    engine::RequestParams params;
    std::shared_ptr<engine::RequestSink> sink;
    std::vector<int> pos;
    std::vector<bool> finished;
    std::chrono::steady_clock::time_point started;
  };

  void loop() {
    std::vector<std::function<void()>> calls;
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(o_.step_ms));
      calls.clear();
      {
        std::lock_guard lk(mu_);
        if (stop_) return;
        const auto now = std::chrono::steady_clock::now();
        while (!waiting_.empty() && int(running_.size()) < o_.max_running) {
          auto q = waiting_.front();
          waiting_.pop_front();
          q->started = now;
          running_.push_back(q);
          const int prompt = int(q->params.prompt.size()), cached = std::min(o_.cached_tokens, prompt);
          stats_.prompt_tokens += prompt;
          stats_.cached_prompt_tokens += cached;
          calls.push_back([q, prompt, cached] { q->sink->on_start({prompt, cached}); });
        }
        for (auto it = running_.begin(); it != running_.end();) {
          auto q = *it;
          const bool cancel = cancelled_.count(q->id) > 0;
          bool all = true;
          for (int c = 0; c < q->params.n; ++c) {
            if (q->finished[size_t(c)]) continue;
            if (cancel) {
              q->finished[size_t(c)] = true;
              calls.push_back([q, c] { q->sink->on_finish({c, engine::FinishReason::Cancelled, ""}); });
              continue;
            }
            if (now - q->started < std::chrono::milliseconds(o_.prefill_ms)) {
              all = false;
              continue;
            }
            const int p = q->pos[size_t(c)]++;
            const int32_t tok = o_.script[size_t(p) % o_.script.size()];
            engine::TokenEvent ev;
            ev.choice = c;
            ev.token = tok;
            if (q->params.sampling.logprobs) {
              ev.logprob = -0.25f * float(c + 1);
              for (int k = 0; k < q->params.sampling.top_logprobs; ++k) ev.top.push_back({tok + k, -0.25f * float(k + 1)});
            }
            ++stats_.generated_tokens;
            calls.push_back([q, ev] { q->sink->on_token(ev); });
            engine::FinishReason reason{};
            bool fin = false;
            if (tok == o_.eos && !q->params.ignore_eos) {
              fin = true;
              reason = engine::FinishReason::Stop;
            } else if (p + 1 >= q->params.max_tokens) {
              fin = true;
              reason = engine::FinishReason::Length;
            }
            if (fin) {
              q->finished[size_t(c)] = true;
              calls.push_back([q, c, reason] { q->sink->on_finish({c, reason, ""}); });
            } else {
              all = false;
            }
          }
          if (all) {
            ++stats_.requests_finished;
            it = running_.erase(it);
          } else {
            ++it;
          }
        }
        stats_.running = int(running_.size());
        stats_.waiting = int(waiting_.size());
        stats_.cache_pages_used = int64_t(running_.size()) * o_.pages_per_seq;
        stats_.cache_bytes_used = size_t(stats_.cache_pages_used) * 4096;
        stats_.cache_bytes_budget = size_t(1) << 30;
        ++stats_.steps;
      }
      for (auto& f : calls) f();
    }
  }

  FakeEngineOptions o_;
  mutable std::mutex mu_;
  bool stop_ = false;
  uint64_t next_id_ = 0;
  std::deque<std::shared_ptr<Req>> waiting_;
  std::vector<std::shared_ptr<Req>> running_;
  std::set<uint64_t> cancelled_;
  std::vector<uint64_t> cancel_calls_;
  std::vector<engine::RequestParams> submitted_params_;
  engine::EngineStats stats_;
  std::thread thread_;
};

// The V4.1 tokenizer (derived from the npm V3 one), loaded once.
inline std::shared_ptr<const Tokenizer> v41_tokenizer() {
  static std::shared_ptr<const Tokenizer> tok = [] {
    std::ifstream f(v3_tokenizer_json());
    if (!f) throw std::runtime_error(v3_tokenizer_json() + ": missing (run scripts/setup)");
    const auto v3 = nlohmann::json::parse(f);
    return Tokenizer::from_json_text(derive_v41_tokenizer_json(v3).dump(), "derived v41");
  }();
  return tok;
}

inline void raise_fd_limit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

// ---- raw HTTP client ------------------------------------------------------------------------------

struct HttpReply {
  int status = 0;
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;                            // de-chunked
  bool closed = false;                          // the server closed the connection
};

class RawConn {
 public:
  explicit RawConn(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw std::runtime_error("connect failed");
  }
  ~RawConn() { close(); }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  void send(const std::string& data) {
    size_t off = 0;
    while (off < data.size()) {
      const ssize_t n = ::send(fd_, data.data() + off, data.size() - off, MSG_NOSIGNAL);
      if (n <= 0) throw std::runtime_error("send failed");
      off += size_t(n);
    }
  }
  // Reads more bytes into buf_ (false on EOF/timeout).
  bool fill(int timeout_ms) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return false;
    char tmp[65536];
    const ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
    if (n <= 0) {
      eof_ = true;
      return false;
    }
    buf_.append(tmp, size_t(n));
    return true;
  }
  // Reads one complete response (Content-Length or chunked). `on_chunk` sees stream pieces as they come.
  // `to_head`: the reply to a HEAD request, which has the GET reply's headers and no body.
  HttpReply read_reply(int timeout_ms = 20000, const std::function<bool(const std::string&)>& on_chunk = nullptr,
                       bool to_head = false) {
    HttpReply r;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    auto left = [&] {
      return int(std::max<int64_t>(
          0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count()));
    };
    size_t head_end;
    while ((head_end = buf_.find("\r\n\r\n")) == std::string::npos)
      if (!fill(left())) throw std::runtime_error("no response header (got: " + buf_ + ")");
    const std::string head = buf_.substr(0, head_end);
    buf_.erase(0, head_end + 4);
    r.status = std::stoi(head.substr(9, 3));
    size_t pos = head.find("\r\n");
    while (pos != std::string::npos && pos + 2 < head.size()) {
      const size_t next = head.find("\r\n", pos + 2);
      const std::string line = head.substr(pos + 2, next == std::string::npos ? std::string::npos : next - pos - 2);
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        std::string k = line.substr(0, colon);
        for (auto& ch : k) ch = char(std::tolower(ch));
        size_t vs = colon + 1;
        while (vs < line.size() && line[vs] == ' ') ++vs;
        r.headers[k] = line.substr(vs);
      }
      pos = next;
    }
    if (to_head) return r;
    if (r.headers.count("content-length")) {
      const size_t len = std::stoul(r.headers["content-length"]);
      while (buf_.size() < len)
        if (!fill(left())) throw std::runtime_error("short body");
      r.body = buf_.substr(0, len);
      buf_.erase(0, len);
    } else if (r.headers["transfer-encoding"] == "chunked") {
      for (;;) {
        size_t le;
        while ((le = buf_.find("\r\n")) == std::string::npos)
          if (!fill(left())) throw std::runtime_error("chunk size missing");
        const size_t len = std::stoul(buf_.substr(0, le), nullptr, 16);
        while (buf_.size() < le + 2 + len + 2)
          if (!fill(left())) throw std::runtime_error("short chunk");
        const std::string piece = buf_.substr(le + 2, len);
        buf_.erase(0, le + 2 + len + 2);
        if (len == 0) break;
        r.body += piece;
        if (on_chunk && !on_chunk(r.body)) return r;  // caller stops reading
      }
    } else {
      while (fill(left())) {
      }
      r.body = buf_;
      buf_.clear();
    }
    if (r.headers["connection"] == "close") {
      // The server closes after this reply.
      fill(left() > 2000 ? 2000 : left());
      r.closed = eof_;
    }
    return r;
  }
  bool eof() const { return eof_; }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  std::string buf_;
  bool eof_ = false;
};

inline std::string http_request(const std::string& method, const std::string& path, const std::string& body = "",
                                const std::string& extra_headers = "") {
  std::string r = method + " " + path + " HTTP/1.1\r\nHost: localhost\r\n" + extra_headers;
  if (!body.empty() || method == "POST") r += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  return r + "\r\n" + body;
}

inline HttpReply fetch(uint16_t port, const std::string& method, const std::string& path, const std::string& body = "",
                       const std::string& extra_headers = "") {
  RawConn c(port);
  c.send(http_request(method, path, body, extra_headers));
  return c.read_reply(20000, nullptr, method == "HEAD");
}

// "data: ..." payloads of an SSE body, in order (comments excluded).
inline std::vector<std::string> sse_data(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) end = body.size();
    const std::string ev = body.substr(pos, end - pos);
    if (ev.rfind("data: ", 0) == 0) out.push_back(ev.substr(6));
    pos = end + 2;
  }
  return out;
}

// A Server in this process over a FakeEngine (tiny-test, the V4.1 tokenizer, 4,096-token context).
// With a `gate`, the model "loads" only once the gate opens (call wait_ready() after).
struct TestServer {
  std::shared_ptr<FakeEngine> engine;
  std::unique_ptr<server::Server> srv;
  uint16_t port = 0;

  explicit TestServer(FakeEngineOptions fo, const std::function<void(server::ServerOptions&)>& tweak = {},
                      std::shared_future<void> gate = {}) {
    server::ServerOptions so;
    so.http.port = 0;
    so.served_model_name = "tiny-test";
    so.sse_keepalive_s = 0;
    so.test_hooks = true;
    if (tweak) tweak(so);
    engine = std::make_shared<FakeEngine>(std::move(fo));
    auto eng = engine;
    srv = std::make_unique<server::Server>(so, [eng, gate](const std::atomic<bool>&) {
      if (gate.valid()) gate.wait();
      server::LoadedModel lm;
      lm.engine = eng;
      lm.model.tokenizer = v41_tokenizer();
      lm.model.vocab_size = lm.model.tokenizer->vocab_size();
      lm.model.bos_id = 0;
      lm.model.eos_id = 1;
      lm.model.max_context = 4096;
      return lm;
    });
    srv->start();
    port = srv->port();
    if (!gate.valid()) wait_ready();
  }
  void wait_ready() {
    for (int i = 0; i < 500 && !srv->ready(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_TRUE(srv->ready());
  }
  ~TestServer() { srv->stop(); }
};

}  // namespace di::test
