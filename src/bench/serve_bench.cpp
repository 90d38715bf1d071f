#include "bench/serve_bench.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <memory>
#include <mutex>
#include <thread>
#include <random>
#include <stdexcept>
#include <unistd.h>

#include "bench/stats.h"
#include "engine/engine.h"

namespace di::bench {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using asio::awaitable;
using asio::use_awaitable;
using Clock = std::chrono::steady_clock;

namespace {

struct Url {
  std::string host, port, prefix;  // prefix: path before the endpoint ("" or "/something")
};

Url parse_url(const std::string& url) {
  const std::string scheme = "http://";
  if (url.rfind("https://", 0) == 0) throw std::invalid_argument("--base-url " + url + ": https is not supported");
  if (url.rfind(scheme, 0) != 0) throw std::invalid_argument("--base-url " + url + ": expected http://HOST[:PORT][/PATH]");
  std::string rest = url.substr(scheme.size());
  Url u;
  const size_t slash = rest.find('/');
  if (slash != std::string::npos) {
    u.prefix = rest.substr(slash);
    rest = rest.substr(0, slash);
    while (!u.prefix.empty() && u.prefix.back() == '/') u.prefix.pop_back();
  }
  if (!rest.empty() && rest.front() == '[') {  // [IPv6]:port
    const size_t close = rest.find(']');
    if (close == std::string::npos) throw std::invalid_argument("--base-url " + url + ": unclosed [");
    u.host = rest.substr(1, close - 1);
    u.port = rest.size() > close + 1 && rest[close + 1] == ':' ? rest.substr(close + 2) : "80";
  } else if (const size_t colon = rest.rfind(':'); colon != std::string::npos) {
    u.host = rest.substr(0, colon);
    u.port = rest.substr(colon + 1);
  } else {
    u.host = rest;
    u.port = "80";
  }
  if (u.host.empty() || u.port.empty() || !std::all_of(u.port.begin(), u.port.end(), ::isdigit))
    throw std::invalid_argument("--base-url " + url + ": bad host or port");
  return u;
}

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// A counting semaphore for coroutines on one single-threaded io_context.
class Semaphore {
 public:
  Semaphore(asio::any_io_executor ex, int n) : ex_(ex), avail_(n) {}
  awaitable<void> acquire() {
    if (avail_ > 0) {
      --avail_;
      co_return;
    }
    auto t = std::make_shared<asio::steady_timer>(ex_, Clock::time_point::max());
    waiters_.push_back(t);
    boost::system::error_code ec;
    co_await t->async_wait(asio::redirect_error(use_awaitable, ec));  // cancelled = our turn
  }
  void release() {
    if (waiters_.empty()) {
      ++avail_;
      return;
    }
    waiters_.front()->cancel();
    waiters_.pop_front();
  }

 private:
  asio::any_io_executor ex_;
  int avail_;
  std::deque<std::shared_ptr<asio::steady_timer>> waiters_;
};

struct Shared {
  Url url;
  tcp::resolver::results_type endpoints;
  Clock::time_point origin;
  double timeout_s = 0;
  bool chat = false;
};

// Streams one request; every failure ends up in RequestOutput::error.
awaitable<RequestOutput> stream_request(const Shared& sh, const std::string& target, std::string body) {
  RequestOutput out;
  beast::tcp_stream stream(co_await asio::this_coro::executor);
  const Clock::time_point st = Clock::now();
  out.start_time = seconds(sh.origin, st);
  try {
    stream.expires_after(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(sh.timeout_s)));
    co_await stream.async_connect(sh.endpoints, use_awaitable);
    http::request<http::string_body> req{http::verb::post, target, 11};
    req.set(http::field::host, sh.url.host + ":" + sh.url.port);
    req.set(http::field::content_type, "application/json");
    req.set(http::field::accept, "text/event-stream");
    req.set(http::field::user_agent, "deepinfer-bench");
    req.body() = std::move(body);
    req.prepare_payload();
    co_await http::async_write(stream, req, use_awaitable);

    beast::flat_buffer buf;
    http::response_parser<http::buffer_body> p;
    p.body_limit(boost::none);
    co_await http::async_read_header(stream, buf, p, use_awaitable);
    const unsigned status = p.get().result_int();
    char chunk[16384];
    std::string pending, err_body;
    bool first = false, done = false;
    int chunks = 0;
    Clock::time_point last = st;
    while (!p.is_done() && !done) {
      p.get().body().data = chunk;
      p.get().body().size = sizeof chunk;
      boost::system::error_code ec;
      co_await http::async_read_some(stream, buf, p, asio::redirect_error(use_awaitable, ec));
      if (ec == http::error::need_buffer) ec = {};
      const size_t n = sizeof chunk - p.get().body().size;
      const Clock::time_point now = Clock::now();
      if (status != 200) {
        if (err_body.size() < 2000) err_body.append(chunk, n);
      } else {
        pending.append(chunk, n);
        // Server-sent events: "data: ..." lines, events separated by a blank line.
        for (size_t eol; (eol = pending.find('\n')) != std::string::npos;) {
          std::string line = pending.substr(0, eol);
          pending.erase(0, eol + 1);
          if (!line.empty() && line.back() == '\r') line.pop_back();
          if (line.rfind("data:", 0) != 0) continue;
          std::string data = line.substr(5);
          if (!data.empty() && data.front() == ' ') data.erase(0, 1);
          if (data == "[DONE]") {
            done = true;
            break;
          }
          nlohmann::json j = nlohmann::json::parse(data, nullptr, false);
          if (j.is_discarded()) throw std::runtime_error("bad SSE data (not JSON): " + data.substr(0, 200));
          if (j.contains("error")) throw std::runtime_error("server error in stream: " + j["error"].dump());
          if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
            if (!first) {
              first = true;
              out.ttft = seconds(st, now);
            } else {
              out.itl.push_back(seconds(last, now));
            }
            last = now;
            ++chunks;
            const auto& c = j["choices"][0];
            if (sh.chat) {
              if (c.contains("delta") && c["delta"].contains("content") && c["delta"]["content"].is_string())
                out.generated_text += c["delta"]["content"].get<std::string>();
            } else if (c.contains("text") && c["text"].is_string()) {
              out.generated_text += c["text"].get<std::string>();
            }
          }
          if (j.contains("usage") && j["usage"].is_object()) {
            const auto& u = j["usage"];
            if (u.contains("completion_tokens") && u["completion_tokens"].is_number_integer())
              out.output_tokens = u["completion_tokens"].get<int>();
            if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer())
              out.prompt_len = u["prompt_tokens"].get<int>();
          }
        }
      }
      if (ec == http::error::end_of_stream || ec == http::error::partial_message || ec == asio::error::eof) break;
      if (ec) throw boost::system::system_error(ec);
    }
    if (status != 200) throw std::runtime_error("HTTP " + std::to_string(status) + ": " + err_body.substr(0, 500));
    if (!first) throw std::runtime_error("the stream ended without a chunk");
    out.latency = seconds(st, last);
    if (out.output_tokens == 0) out.output_tokens = chunks;
    out.success = true;
  } catch (const std::exception& e) {
    out.success = false;
    out.error = e.what();
  }
  boost::system::error_code ignored;
  stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
  co_return out;
}

// GET path on a fresh connection (30 s limit).
awaitable<http::response<http::string_body>> http_get(const Shared& sh, const std::string& path) {
  beast::tcp_stream stream(co_await asio::this_coro::executor);
  stream.expires_after(std::chrono::seconds(30));
  co_await stream.async_connect(sh.endpoints, use_awaitable);
  http::request<http::empty_body> req{http::verb::get, sh.url.prefix + path, 11};
  req.set(http::field::host, sh.url.host + ":" + sh.url.port);
  co_await http::async_write(stream, req, use_awaitable);
  beast::flat_buffer buf;
  http::response<http::string_body> res;
  co_await http::async_read(stream, buf, res, use_awaitable);
  co_return res;
}

// The first model card of GET /v1/models.
awaitable<nlohmann::json> first_model_card(const Shared& sh) {
  const http::response<http::string_body> res = co_await http_get(sh, "/v1/models");
  const auto j = nlohmann::json::parse(res.body(), nullptr, false);
  if (res.result_int() != 200 || j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
      !j["data"][0].is_object())
    throw std::runtime_error("GET /v1/models gave no model card (HTTP " + std::to_string(res.result_int()) + ")");
  co_return j["data"][0];
}

// GET /metrics; the decode counters if the server exposes them (any failure: not available).
awaitable<EngineDecodeStats> engine_decode_counters(const Shared& sh) {
  EngineDecodeStats s;
  try {
    const http::response<http::string_body> res = co_await http_get(sh, "/metrics");
    if (res.result_int() == 200) parse_engine_decode_counters(res.body(), s);
  } catch (const std::exception&) {
    s = EngineDecodeStats{};
  }
  co_return s;
}

}  // namespace

bool parse_engine_decode_counters(const std::string& text, EngineDecodeStats& out) {
  const std::pair<const char*, int> names[] = {{"deepinfer_engine_decode_steps_total", 0},
                                               {"deepinfer_engine_decode_rows_total", 1},
                                               {"deepinfer_engine_decode_seconds_total", 2}};
  double v[3];
  bool seen[3] = {false, false, false};
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const std::string line = text.substr(at, end - at);
    at = end + 1;
    for (const auto& [name, i] : names) {
      const size_t n = std::strlen(name);
      if (line.size() > n && line.compare(0, n, name) == 0 && line[n] == ' ') {
        char* stop = nullptr;
        const double x = std::strtod(line.c_str() + n + 1, &stop);
        if (stop != line.c_str() + n + 1 && std::isfinite(x) && x >= 0) v[i] = x, seen[i] = true;
      }
    }
  }
  if (!(seen[0] && seen[1] && seen[2])) return false;
  out.available = true;
  out.steps = int64_t(v[0]);
  out.rows = int64_t(v[1]);
  out.seconds = v[2];
  return true;
}

namespace {

std::string request_body(const ServeOptions& o, const std::string& model, const ServeRequest& r, bool chat) {
  nlohmann::json b = {{"model", model}, {"temperature", o.temperature}, {"stream", true},
                      {"stream_options", {{"include_usage", true}}}, {"max_tokens", r.output_len}};
  if (chat) {
    b["max_completion_tokens"] = r.output_len;
    if (!r.messages.is_null()) {
      b["messages"] = r.messages;
    } else {
      const std::string text = r.prompt.is_string() ? r.prompt.get<std::string>() : r.prompt.dump();
      b["messages"] = nlohmann::json::array({{{"role", "user"}, {"content", text}}});
    }
  } else {
    b["prompt"] = r.prompt;
  }
  if (o.ignore_eos) b["ignore_eos"] = true;
  for (const auto& [k, v] : o.extra_body.items()) b[k] = v;
  return b.dump();
}

void print_progress(int done, int total, double elapsed) {
  const int width = 30, fill = total ? done * width / total : width;
  std::fprintf(stderr, "\r[%s%s] %d/%d  %.1f s", std::string(size_t(fill), '#').c_str(),
               std::string(size_t(width - fill), '.').c_str(), done, total, elapsed);
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

std::string p_word(double p) {
  if (double(int64_t(p)) == p) return std::to_string(int64_t(p));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", p);
  return buf;
}

// Short common words: mostly one BPE token each (with the leading space), for text prompts.
const char* const kWords[] = {"the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "on",
                              "be", "at", "by", "this", "had", "not", "are", "but", "from", "or", "have", "an",
                              "they", "which", "one", "you", "were", "all", "we", "her", "she", "there", "would",
                              "their", "will", "when", "who", "him", "been", "has", "more", "if", "no", "out", "so"};

}  // namespace

std::map<std::string, double> parse_goodput(const std::vector<std::string>& items) {
  std::map<std::string, double> g;
  for (const auto& it : items) {
    const size_t c = it.find(':');
    if (c == std::string::npos)
      throw std::invalid_argument("--goodput '" + it + "': expected NAME:MILLISECONDS (ttft, tpot or e2el)");
    const std::string name = it.substr(0, c);
    if (name != "ttft" && name != "tpot" && name != "e2el")
      throw std::invalid_argument("--goodput '" + it + "': unknown metric '" + name + "' (expected ttft, tpot or e2el)");
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(it.substr(c + 1), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != it.size() - c - 1 || !(v >= 0))
      throw std::invalid_argument("--goodput '" + it + "': the value must be a number of milliseconds >= 0");
    g[name] = v;
  }
  return g;
}

std::vector<double> arrival_times(int n, double rate, double burstiness, uint64_t seed) {
  std::vector<double> t(size_t(std::max(n, 0)), 0.0);
  if (n <= 0 || std::isinf(rate)) return t;
  if (!(rate > 0)) throw std::invalid_argument("--request-rate must be > 0");
  if (!(burstiness > 0)) throw std::invalid_argument("--burstiness must be > 0");
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  std::gamma_distribution<double> gap(burstiness, 1.0 / (rate * burstiness));
  double acc = 0;
  for (auto& x : t) x = (acc += gap(rng));
  const double scale = (double(n) / rate) / acc;
  for (auto& x : t) x *= scale;
  return t;
}

std::vector<ServeRequest> load_serve_requests(const ServeOptions& o) {
  std::vector<ServeRequest> reqs;
  const bool chat = o.endpoint.find("chat") != std::string::npos;
  if (o.num_prompts < 1) throw std::invalid_argument("--num-prompts must be >= 1");
  if (o.dataset == "random") {
    if (o.input_len < 1 || o.output_len < 1) throw std::invalid_argument("--input-len and --output-len must be >= 1");
    if (!chat && o.vocab_size < 2) throw std::invalid_argument("--vocab-size must be >= 2 (0 asks the server)");
    std::mt19937_64 rng(o.seed);
    std::uniform_int_distribution<int64_t> tok(0, o.vocab_size - 1);
    std::uniform_int_distribution<size_t> word(0, std::size(kWords) - 1);
    for (int i = 0; i < o.num_prompts; ++i) {
      ServeRequest r;
      r.output_len = o.output_len;
      if (chat) {
        std::string text;
        for (int k = 0; k < o.input_len; ++k) text += (k ? " " : "") + std::string(kWords[word(rng)]);
        r.prompt = text;
        r.prompt_len = 0;  // from the server's usage
      } else {
        r.prompt = nlohmann::json::array();
        for (int k = 0; k < o.input_len; ++k) r.prompt.push_back(tok(rng));
        r.prompt_len = o.input_len;
      }
      reqs.push_back(std::move(r));
    }
    return reqs;
  }
  if (o.dataset != "jsonl") throw std::invalid_argument("--dataset '" + o.dataset + "': expected random or jsonl");
  if (o.dataset_path.empty()) throw std::invalid_argument("--dataset jsonl needs --dataset-path");
  std::ifstream f(o.dataset_path);
  if (!f) throw std::invalid_argument(o.dataset_path + ": cannot open");
  std::string line;
  std::vector<ServeRequest> all;
  for (int ln = 1; std::getline(f, line); ++ln) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto j = nlohmann::json::parse(line, nullptr, false);
    const std::string where = o.dataset_path + ":" + std::to_string(ln);
    if (j.is_discarded() || !j.is_object()) throw std::invalid_argument(where + ": not a JSON object");
    ServeRequest r;
    r.output_len = o.output_len;
    for (const char* k : {"output_len", "max_tokens"})
      if (j.contains(k)) {
        if (!j[k].is_number_integer() || j[k].get<int64_t>() < 1) throw std::invalid_argument(where + ": '" + k + "' must be an integer >= 1");
        r.output_len = j[k].get<int>();
      }
    if (j.contains("messages")) {
      if (!chat) throw std::invalid_argument(where + ": 'messages' needs --endpoint /v1/chat/completions");
      if (!j["messages"].is_array()) throw std::invalid_argument(where + ": 'messages' must be an array");
      r.messages = j["messages"];
    } else if (j.contains("prompt")) {
      const auto& p = j["prompt"];
      if (p.is_string()) {
        r.prompt = p;
      } else if (p.is_array() && std::all_of(p.begin(), p.end(), [](const auto& x) { return x.is_number_integer(); })) {
        if (chat) throw std::invalid_argument(where + ": token-id prompts need --endpoint /v1/completions");
        r.prompt = p;
        r.prompt_len = int(p.size());
      } else {
        throw std::invalid_argument(where + ": 'prompt' must be a string or an array of token ids");
      }
    } else {
      throw std::invalid_argument(where + ": no 'prompt' or 'messages'");
    }
    all.push_back(std::move(r));
  }
  if (all.empty()) throw std::invalid_argument(o.dataset_path + ": no prompts");
  // num_prompts requests, cycling through the file.
  for (int i = 0; i < o.num_prompts; ++i) reqs.push_back(all[size_t(i) % all.size()]);
  return reqs;
}

ServeMetrics calculate_serve_metrics(const std::vector<RequestOutput>& outputs, double duration_s,
                                     const std::map<std::string, double>& goodput, const std::vector<double>& percentiles) {
  ServeMetrics m;
  m.duration = duration_s;
  std::vector<double> ttft, tpot, all_tpot, itl, e2el;
  for (const auto& o : outputs) {
    if (!o.success) {
      ++m.failed;
      continue;
    }
    ++m.completed;
    m.total_input += o.prompt_len;
    m.total_output += o.output_tokens;
    double t = 0;
    if (o.output_tokens > 1) {
      t = (o.latency - o.ttft) / (o.output_tokens - 1);
      tpot.push_back(t);
    }
    all_tpot.push_back(t);
    itl.insert(itl.end(), o.itl.begin(), o.itl.end());
    ttft.push_back(o.ttft);
    e2el.push_back(o.latency);
  }
  if (!goodput.empty()) {
    int good = 0;
    for (size_t i = 0; i < ttft.size(); ++i) {
      bool ok = true;
      if (auto it = goodput.find("ttft"); it != goodput.end()) ok &= it->second / 1000 >= ttft[i];
      if (auto it = goodput.find("tpot"); it != goodput.end()) ok &= it->second / 1000 >= all_tpot[i];
      if (auto it = goodput.find("e2el"); it != goodput.end()) ok &= it->second / 1000 >= e2el[i];
      good += ok;
    }
    m.request_goodput = duration_s > 0 ? good / duration_s : 0;
  }
  if (duration_s > 0) {
    m.request_throughput = m.completed / duration_s;
    m.output_throughput = double(m.total_output) / duration_s;
    m.total_token_throughput = double(m.total_input + m.total_output) / duration_s;
  }
  auto add = [&](const std::string& name, const std::vector<double>& v) {
    m.latency_ms["mean_" + name + "_ms"] = mean(v) * 1000;
    m.latency_ms["median_" + name + "_ms"] = median(v) * 1000;
    m.latency_ms["std_" + name + "_ms"] = stddev(v) * 1000;
    for (double p : percentiles) m.latency_ms["p" + p_word(p) + "_" + name + "_ms"] = percentile(v, p) * 1000;
  };
  add("ttft", ttft);
  add("tpot", tpot);
  add("itl", itl);
  add("e2el", e2el);
  // Peak output tokens in any one-second bucket, and the requests active in it.
  double t0 = INFINITY, t1 = 0;
  for (const auto& o : outputs)
    if (o.success) t0 = std::min(t0, o.start_time), t1 = std::max(t1, o.start_time + o.latency);
  if (t1 >= t0 && m.completed > 0) {
    const size_t nb = size_t(std::ceil(t1 - t0)) + 1;
    std::vector<double> toks(nb, 0), conc(nb, 0);
    for (const auto& o : outputs) {
      if (!o.success) continue;
      double t = o.start_time + o.ttft;
      auto put = [&](double at) {
        const int64_t b = int64_t(at - t0);
        if (b >= 0 && size_t(b) < nb) toks[size_t(b)] += 1;
      };
      put(t);
      for (double g : o.itl) put(t += g);
      for (int64_t s = int64_t(o.start_time - t0); s <= int64_t(o.start_time + o.latency - t0) && size_t(s) < nb; ++s) conc[size_t(s)] += 1;
    }
    m.max_output_tokens_per_s = *std::max_element(toks.begin(), toks.end());
    m.max_concurrent_requests = int(*std::max_element(conc.begin(), conc.end()));
  }
  return m;
}

// vLLM's result JSON and report text, from res.outputs and res.metrics.
void fill_report(ServeResult& res, const ServeOptions& o, const std::string& model, const std::string& backend,
                 const std::string& title, const std::string& engine_title) {
  const ServeMetrics& m = res.metrics;
  nlohmann::json& j = res.json;
  j["endpoint_type"] = backend;
  j["backend"] = backend;
  j["label"] = nullptr;
  j["model_id"] = model;
  j["tokenizer_id"] = nullptr;
  j["num_prompts"] = o.num_prompts;
  j["request_rate"] = std::isinf(o.request_rate) ? nlohmann::json("inf") : nlohmann::json(o.request_rate);
  j["burstiness"] = o.burstiness;
  j["max_concurrency"] = o.max_concurrency > 0 ? nlohmann::json(o.max_concurrency) : nlohmann::json(nullptr);
  j["duration"] = m.duration;
  j["completed"] = m.completed;
  j["failed"] = m.failed;
  j["total_input_tokens"] = m.total_input;
  j["total_output_tokens"] = m.total_output;
  j["request_throughput"] = m.request_throughput;
  j["request_goodput"] = o.goodput.empty() ? nlohmann::json(nullptr) : nlohmann::json(m.request_goodput);
  j["output_throughput"] = m.output_throughput;
  j["total_token_throughput"] = m.total_token_throughput;
  j["max_output_tokens_per_s"] = m.max_output_tokens_per_s;
  j["max_concurrent_requests"] = m.max_concurrent_requests;
  for (const auto& [k, v] : m.latency_ms) j[k] = v;
  j["dataset"] = o.dataset;
  j["input_len"] = o.input_len;
  j["output_len"] = o.output_len;
  j["vocab_size"] = o.dataset == "random" && o.vocab_size > 0 ? nlohmann::json(o.vocab_size) : nlohmann::json(nullptr);
  j["seed"] = o.seed;
  j["num_warmups"] = o.num_warmups;
  nlohmann::json errors = nlohmann::json::array();
  for (const auto& out : res.outputs)
    if (!out.success && errors.size() < 10) errors.push_back(out.error);
  j["errors"] = errors;
  // Not in vLLM's result: the engine's own decode steps over the run (deepinfer's /metrics, or the
  // in-process engine's counters).
  const EngineDecodeStats& es = res.engine;
  j["engine_decode_steps"] = es.available ? nlohmann::json(es.steps) : nlohmann::json(nullptr);
  j["engine_mean_decode_batch"] = es.available && es.steps > 0 ? nlohmann::json(es.mean_batch()) : nlohmann::json(nullptr);
  j["engine_mean_decode_step_ms"] = es.available && es.steps > 0 ? nlohmann::json(es.mean_step_ms()) : nlohmann::json(nullptr);

  std::string& t = res.text;
  char buf[256];
  auto line = [&](const char* label, const std::string& v) {
    std::snprintf(buf, sizeof buf, "%-40s %-10s\n", label, v.c_str());
    t += buf;
  };
  auto num = [](double v) {
    char b[64];
    std::snprintf(b, sizeof b, "%.2f", v);
    return std::string(b);
  };
  auto head = [&](const std::string& s, char c) {
    const size_t pad = s.size() < 50 ? 50 - s.size() : 0;
    t += std::string(pad / 2, c) + s + std::string(pad - pad / 2, c) + "\n";
  };
  head(title, '=');
  line("Successful requests:", std::to_string(m.completed));
  line("Failed requests:", std::to_string(m.failed));
  if (o.max_concurrency > 0) line("Maximum request concurrency:", std::to_string(o.max_concurrency));
  if (!std::isinf(o.request_rate)) line("Request rate configured (RPS):", num(o.request_rate));
  line("Benchmark duration (s):", num(m.duration));
  line("Total input tokens:", std::to_string(m.total_input));
  line("Total generated tokens:", std::to_string(m.total_output));
  line("Request throughput (req/s):", num(m.request_throughput));
  if (!o.goodput.empty()) line("Request goodput (req/s):", num(m.request_goodput));
  line("Output token throughput (tok/s):", num(m.output_throughput));
  line("Peak output token throughput (tok/s):", num(m.max_output_tokens_per_s));
  line("Peak concurrent requests:", std::to_string(m.max_concurrent_requests));
  line("Total Token throughput (tok/s):", num(m.total_token_throughput));
  const std::pair<const char*, const char*> sections[] = {{"ttft", "Time to First Token"},
                                                          {"tpot", "Time per Output Token (excl. 1st token)"},
                                                          {"itl", "Inter-token Latency"},
                                                          {"e2el", "End-to-end Latency"}};
  for (const auto& [key, section] : sections) {
    std::string up = key;
    for (auto& ch : up) ch = char(std::toupper(ch));
    head(section, '-');
    line(("Mean " + up + " (ms):").c_str(), num(m.latency_ms.at(std::string("mean_") + key + "_ms")));
    line(("Median " + up + " (ms):").c_str(), num(m.latency_ms.at(std::string("median_") + key + "_ms")));
    for (double p : o.percentiles)
      line(("P" + p_word(p) + " " + up + " (ms):").c_str(), num(m.latency_ms.at("p" + p_word(p) + "_" + key + "_ms")));
  }
  if (res.engine.available && res.engine.steps > 0) {
    head(engine_title, '-');
    line("Decode steps:", std::to_string(res.engine.steps));
    line("Mean sequences per decode step:", num(res.engine.mean_batch()));
    line("Mean decode step (ms):", num(res.engine.mean_step_ms()));
  }
  t += std::string(50, '=') + "\n";
  if (m.failed > 0) t += "first error: " + errors[0].get<std::string>() + "\n";
}

static std::vector<ServeRequest> warmup_requests(const ServeOptions& o) {
  if (o.num_warmups < 0) throw std::invalid_argument("--num-warmups must be >= 0");
  if (o.num_warmups == 0) return {};
  ServeOptions w = o;
  w.num_prompts = o.num_warmups;
  w.seed = o.seed ^ 0x77a3b1f5c2d4e6f8ull;  // other prompts: the run's must not hit the prefix cache
  return load_serve_requests(w);
}

ServeResult run_serve_bench(const ServeOptions& o) {
  if (o.max_concurrency < 0) throw std::invalid_argument("--max-concurrency must be >= 0");
  if (!(o.timeout_s > 0)) throw std::invalid_argument("--timeout must be > 0");
  for (double p : o.percentiles)
    if (!(p >= 0 && p <= 100)) throw std::invalid_argument("--metric-percentiles: " + std::to_string(p) + " is not in [0, 100]");
  const bool chat = o.endpoint == "/v1/chat/completions";
  if (!chat && o.endpoint != "/v1/completions")
    throw std::invalid_argument("--endpoint '" + o.endpoint + "': expected /v1/completions or /v1/chat/completions");
  ServeOptions opts = o;  // vocab_size may come from the server
  std::vector<ServeRequest> reqs;
  const bool needs_vocab = o.dataset == "random" && !chat && o.vocab_size == 0;
  if (!needs_vocab) reqs = load_serve_requests(o);

  ServeResult res;
  Shared sh;
  sh.url = parse_url(o.base_url);
  sh.timeout_s = o.timeout_s;
  sh.chat = chat;
  const std::string target = sh.url.prefix + o.endpoint;
  std::string model = o.model;
  double duration = 0;
  const bool bar = o.progress;
  EngineDecodeStats engine_before;

  asio::io_context io;
  std::exception_ptr failure;
  asio::co_spawn(
      io,
      [&]() -> awaitable<void> {
        auto ex = co_await asio::this_coro::executor;
        tcp::resolver resolver(ex);
        sh.endpoints = co_await resolver.async_resolve(sh.url.host, sh.url.port, use_awaitable);
        if (model.empty() || needs_vocab) {
          const nlohmann::json card = co_await first_model_card(sh);
          if (model.empty()) {
            if (!card.contains("id") || !card["id"].is_string()) throw std::runtime_error("GET /v1/models gave no model id; pass --model");
            model = card["id"].get<std::string>();
          }
          if (needs_vocab) {
            if (!card.contains("vocab_size") || !card["vocab_size"].is_number_integer() || card["vocab_size"].get<int64_t>() < 2)
              throw std::runtime_error("GET /v1/models gave no vocab_size (the token ids the server accepts); pass --vocab-size");
            opts.vocab_size = card["vocab_size"].get<int64_t>();
            reqs = load_serve_requests(opts);
          }
        }
        const std::vector<double> arrivals = arrival_times(int(reqs.size()), o.request_rate, o.burstiness, o.seed);
        res.outputs.resize(reqs.size());
        {  // all at once, so that the run's batch shapes are already met
          const std::vector<ServeRequest> warmups = warmup_requests(opts);
          int left = int(warmups.size());
          std::string warm_error;
          asio::steady_timer warm_done(ex, Clock::time_point::max());
          for (const ServeRequest& w : warmups)
            asio::co_spawn(
                ex,
                [&, body = request_body(o, model, w, chat)]() mutable -> awaitable<void> {
                  const RequestOutput out = co_await stream_request(sh, target, std::move(body));
                  if (!out.success && warm_error.empty()) warm_error = out.error;
                  if (--left == 0) warm_done.cancel();
                },
                asio::detached);
          boost::system::error_code ec;
          if (left > 0) co_await warm_done.async_wait(asio::redirect_error(use_awaitable, ec));
          if (!warm_error.empty()) throw std::runtime_error("warm-up request failed: " + warm_error);
        }
        engine_before = co_await engine_decode_counters(sh);
        Semaphore sem(ex, o.max_concurrency > 0 ? o.max_concurrency : int(reqs.size()));
        int remaining = int(reqs.size()), finished = 0;
        asio::steady_timer all_done(ex, Clock::time_point::max()), pace(ex);
        sh.origin = Clock::now();
        for (size_t i = 0; i < reqs.size(); ++i) {
          const auto due = sh.origin + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(arrivals[i]));
          if (due > Clock::now()) {
            pace.expires_at(due);
            co_await pace.async_wait(use_awaitable);
          }
          asio::co_spawn(
              ex,
              [&, i, body = request_body(o, model, reqs[i], chat)]() mutable -> awaitable<void> {
                co_await sem.acquire();
                RequestOutput out = co_await stream_request(sh, target, std::move(body));
                sem.release();
                if (reqs[i].prompt_len > 0) out.prompt_len = reqs[i].prompt_len;  // known exactly
                res.outputs[i] = std::move(out);
                ++finished;
                if (bar) print_progress(finished, int(reqs.size()), seconds(sh.origin, Clock::now()));
                if (--remaining == 0) all_done.cancel();
              },
              asio::detached);
        }
        boost::system::error_code ec;
        if (remaining > 0) co_await all_done.async_wait(asio::redirect_error(use_awaitable, ec));
        duration = seconds(sh.origin, Clock::now());
        if (engine_before.available) {
          const EngineDecodeStats after = co_await engine_decode_counters(sh);
          if (after.available && after.steps >= engine_before.steps) {
            res.engine.available = true;
            res.engine.steps = after.steps - engine_before.steps;
            res.engine.rows = after.rows - engine_before.rows;
            res.engine.seconds = after.seconds - engine_before.seconds;
          }
        }
      },
      [&](std::exception_ptr e) { failure = e; });
  io.run();
  if (failure) std::rethrow_exception(failure);

  res.metrics = calculate_serve_metrics(res.outputs, duration, o.goodput, o.percentiles);
  fill_report(res, opts, model, chat ? "openai-chat" : "openai", " Serving Benchmark Result ",
              "Engine decode steps (server /metrics)");
  return res;
}

namespace {

// Collects one request's token events (engine thread) the way stream_request reads SSE chunks.
struct BenchSink : engine::RequestSink {
  std::mutex* mu = nullptr;
  std::condition_variable* cv = nullptr;
  int* finished = nullptr;
  Clock::time_point start, last;
  RequestOutput out;
  bool first = false;

  void on_token(const engine::TokenEvent&) override {
    const Clock::time_point now = Clock::now();
    std::lock_guard lk(*mu);
    if (!first) {
      first = true;
      out.ttft = seconds(start, now);
    } else {
      out.itl.push_back(seconds(last, now));
    }
    last = now;
    ++out.output_tokens;
  }
  void on_finish(const engine::FinishEvent& f) override {
    std::lock_guard lk(*mu);
    if (f.reason != engine::FinishReason::Stop && f.reason != engine::FinishReason::Length) {
      out.error = std::string("finished with ") + engine::finish_reason_name(f.reason) + (f.error.empty() ? "" : ": " + f.error);
    } else if (!first) {
      out.error = "finished without a token";
    } else {
      out.latency = seconds(start, last);
      out.success = true;
    }
    ++*finished;
    cv->notify_all();
  }
};

}  // namespace

ServeResult run_engine_bench(engine::Engine& eng, const ServeOptions& o) {
  if (o.max_concurrency < 0) throw std::invalid_argument("--max-concurrency must be >= 0");
  for (double p : o.percentiles)
    if (!(p >= 0 && p <= 100)) throw std::invalid_argument("--metric-percentiles: " + std::to_string(p) + " is not in [0, 100]");
  if (o.endpoint != "/v1/completions") throw std::invalid_argument("in-process engine runs take token-id prompts: use --endpoint /v1/completions");
  if (!o.extra_body.empty()) throw std::invalid_argument("--extra-body applies to HTTP requests only, not to the in-process engine");
  ServeOptions opts = o;
  if (opts.vocab_size == 0) opts.vocab_size = eng.model().info().sampleable_vocab;
  const std::vector<ServeRequest> reqs = load_serve_requests(opts);
  for (const auto& r : reqs)
    if (!r.prompt.is_array()) throw std::invalid_argument("in-process engine runs take token-id prompts, not text");
  const std::vector<double> arrivals = arrival_times(int(reqs.size()), o.request_rate, o.burstiness, o.seed);
  const int limit = o.max_concurrency > 0 ? o.max_concurrency : int(reqs.size());

  std::mutex mu;
  std::condition_variable cv;
  int finished = 0, submitted = 0, accepted = 0;
  std::vector<std::shared_ptr<BenchSink>> sinks(reqs.size());
  const std::vector<ServeRequest> warmups = warmup_requests(opts);
  const int64_t finished_before_warmups = eng.stats().requests_finished;
  {  // all at once, so that the run's batch shapes are already met
    int done = 0;
    std::vector<std::shared_ptr<BenchSink>> wsinks;
    for (const ServeRequest& w : warmups) {
      engine::RequestParams p;
      p.prompt = w.prompt.get<std::vector<int32_t>>();
      p.max_tokens = w.output_len;
      p.ignore_eos = o.ignore_eos;
      p.sampling.temperature = float(o.temperature);
      auto sink = std::make_shared<BenchSink>();
      sink->mu = &mu;
      sink->cv = &cv;
      sink->finished = &done;
      wsinks.push_back(sink);
      const engine::SubmitResult sr = eng.submit(std::move(p), sink);
      if (sr.error != engine::SubmitError::None) throw std::runtime_error("warm-up request refused: " + sr.message);
    }
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return done == int(wsinks.size()); });
    for (const auto& w : wsinks)
      if (!w->out.success) throw std::runtime_error("warm-up request failed: " + w->out.error);
  }
  engine::EngineStats before = eng.stats();
  for (int k = 0; k < 1000 && before.requests_finished - finished_before_warmups < int64_t(warmups.size()); ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    before = eng.stats();
  }
  const Clock::time_point origin = Clock::now();
  int shown = -1;
  auto wait_for = [&](auto done) {  // with the progress bar going while it waits
    std::unique_lock lk(mu);
    while (!cv.wait_for(lk, std::chrono::milliseconds(200), done))
      if (o.progress && finished != shown) print_progress(shown = finished, int(reqs.size()), seconds(origin, Clock::now()));
  };
  for (size_t i = 0; i < reqs.size(); ++i) {
    std::this_thread::sleep_until(origin + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(arrivals[i])));
    wait_for([&] { return submitted - finished < limit; });
    engine::RequestParams p;
    p.prompt = reqs[i].prompt.get<std::vector<int32_t>>();
    p.max_tokens = reqs[i].output_len;
    p.ignore_eos = o.ignore_eos;
    p.sampling.temperature = float(o.temperature);
    auto sink = std::make_shared<BenchSink>();
    sink->mu = &mu;
    sink->cv = &cv;
    sink->finished = &finished;
    sink->start = sink->last = Clock::now();
    sink->out.start_time = seconds(origin, sink->start);
    sink->out.prompt_len = int(p.prompt.size());
    sinks[i] = sink;
    const engine::SubmitResult sr = eng.submit(std::move(p), sink);
    std::lock_guard lk(mu);
    ++submitted;
    if (sr.error == engine::SubmitError::None) ++accepted;
    if (sr.error != engine::SubmitError::None) {
      sink->out.error = "submit refused: " + (sr.message.empty() ? std::string("error ") + std::to_string(int(sr.error)) : sr.message);
      ++finished;
    }
  }
  wait_for([&] { return finished == int(reqs.size()); });
  const double duration = seconds(origin, Clock::now());
  if (o.progress) print_progress(int(reqs.size()), int(reqs.size()), duration);
  // The engine publishes its counters after the step whose events finished the last request.
  engine::EngineStats after = eng.stats();
  for (int k = 0; k < 1000 && after.requests_finished - before.requests_finished < accepted; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    after = eng.stats();
  }

  ServeResult res;
  res.outputs.reserve(reqs.size());
  {
    std::lock_guard lk(mu);
    for (const auto& s : sinks) res.outputs.push_back(s->out);
  }
  res.engine.available = true;
  res.engine.steps = after.decode_steps - before.decode_steps;
  res.engine.rows = after.decode_rows - before.decode_rows;
  res.engine.seconds = after.decode_seconds - before.decode_seconds;
  res.metrics = calculate_serve_metrics(res.outputs, duration, o.goodput, o.percentiles);
  fill_report(res, opts, o.model, "deepinfer-engine", " Engine Benchmark Result (in-process) ", "Engine decode steps");
  return res;
}

nlohmann::json compare_serve_engine(const ServeResult& server, const ServeResult& engine) {
  nlohmann::json c;
  const double s = server.metrics.output_throughput, e = engine.metrics.output_throughput;
  c["server_output_throughput"] = s;
  c["engine_output_throughput"] = e;
  // Server tok/s / engine tok/s: 1 = no overhead; the target is >= 0.9.
  c["server_over_engine_output_throughput"] = e > 0 ? nlohmann::json(s / e) : nlohmann::json(nullptr);
  for (const char* k : {"median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"}) {
    const auto get = [&](const ServeResult& r) {
      const auto it = r.metrics.latency_ms.find(k);
      return it == r.metrics.latency_ms.end() ? nlohmann::json(nullptr) : nlohmann::json(it->second);
    };
    c[std::string("server_") + k] = get(server);
    c[std::string("engine_") + k] = get(engine);
  }
  c["server"] = server.json;
  c["engine"] = engine.json;
  return c;
}

std::string compare_text(const nlohmann::json& c) {
  std::string t;
  char buf[256];
  auto cell = [](const nlohmann::json& v) {
    char b[64];
    if (v.is_number()) std::snprintf(b, sizeof b, "%.2f", v.get<double>());
    else std::snprintf(b, sizeof b, "-");
    return std::string(b);
  };
  t += "============ Server vs in-process engine ============\n";
  std::snprintf(buf, sizeof buf, "%-26s %12s %12s\n", "", "server", "engine");
  t += buf;
  std::snprintf(buf, sizeof buf, "%-26s %12s %12s\n", "Output tok/s", cell(c["server_output_throughput"]).c_str(),
                cell(c["engine_output_throughput"]).c_str());
  t += buf;
  for (const auto& [k, label] : std::vector<std::pair<std::string, std::string>>{{"median_ttft_ms", "Median TTFT (ms)"},
                                                                                  {"p99_ttft_ms", "P99 TTFT (ms)"},
                                                                                  {"median_tpot_ms", "Median TPOT (ms)"},
                                                                                  {"p99_tpot_ms", "P99 TPOT (ms)"}}) {
    std::snprintf(buf, sizeof buf, "%-26s %12s %12s\n", label.c_str(), cell(c["server_" + k]).c_str(), cell(c["engine_" + k]).c_str());
    t += buf;
  }
  std::snprintf(buf, sizeof buf, "%-26s %12s\n", "Server / engine tok/s", cell(c["server_over_engine_output_throughput"]).c_str());
  t += buf;
  t += std::string(53, '=') + "\n";
  return t;
}

}  // namespace di::bench
