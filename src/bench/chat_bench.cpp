#include "bench/chat_bench.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "engine/engine.h"

namespace di::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Turn {
  int conversation = 0, turn = 0;
  int prompt_tokens = 0, cached_tokens = 0;
  double ttft_s = 0, e2el_s = 0;
};

// Collects one turn's reply and hands the finished turn to the driver.
class TurnSink final : public engine::RequestSink {
 public:
  TurnSink(std::mutex& mu, std::condition_variable& cv, std::deque<int>& done, int conversation)
      : mu_(mu), cv_(cv), done_(done), conversation_(conversation), start_(Clock::now()) {}
  void on_start(const engine::StartEvent& e) override {
    std::lock_guard lk(mu_);
    cached = e.cached_tokens;
  }
  void on_token(const engine::TokenEvent& e) override {
    std::lock_guard lk(mu_);
    if (reply.empty()) ttft_s = std::chrono::duration<double>(Clock::now() - start_).count();
    reply.push_back(e.token);
  }
  void on_finish(const engine::FinishEvent& e) override {
    std::lock_guard lk(mu_);
    e2el_s = std::chrono::duration<double>(Clock::now() - start_).count();
    error = e.error;
    done_.push_back(conversation_);
    cv_.notify_all();
  }
  std::vector<int32_t> reply;
  int cached = 0;
  double ttft_s = 0, e2el_s = 0;
  std::string error;

 private:
  std::mutex& mu_;
  std::condition_variable& cv_;
  std::deque<int>& done_;
  int conversation_;
  Clock::time_point start_;
};

double mean(const std::vector<double>& v) { return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / double(v.size()); }
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

ChatResult run_chat_bench(engine::Engine& eng, const ChatWorkload& w) {
  if (w.conversations <= 0 || w.turns <= 0 || w.system_len < 0 || w.turn_len <= 0 || w.output_len <= 0)
    throw std::invalid_argument("multiturn: conversations, turns, turn and output lengths must be positive");
  const int64_t vocab = eng.model().info().sampleable_vocab;
  std::mt19937_64 rng(w.seed);
  auto ids = [&](int n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& t : v) t = int32_t(rng() % uint64_t(vocab));
    return v;
  };
  const std::vector<int32_t> system = ids(w.system_len);
  std::vector<std::vector<int32_t>> history(size_t(w.conversations), system);
  std::vector<std::vector<std::vector<int32_t>>> user(size_t(w.conversations));
  for (auto& u : user)
    for (int t = 0; t < w.turns; ++t) u.push_back(ids(w.turn_len));

  std::mutex mu;
  std::condition_variable cv;
  std::deque<int> done;
  std::vector<std::shared_ptr<TurnSink>> live(size_t(w.conversations));
  std::vector<int> next_turn(size_t(w.conversations), 0);
  std::vector<Turn> turns;
  const engine::EngineStats before = eng.stats();
  const Clock::time_point t0 = Clock::now();

  auto submit = [&](int c) {
    auto& h = history[size_t(c)];
    const auto& u = user[size_t(c)][size_t(next_turn[size_t(c)])];
    h.insert(h.end(), u.begin(), u.end());
    engine::RequestParams p;
    p.prompt = h;
    p.max_tokens = w.output_len;
    p.ignore_eos = true;
    p.sampling.temperature = 0;
    auto sink = std::make_shared<TurnSink>(mu, cv, done, c);
    live[size_t(c)] = sink;
    const auto r = eng.submit(std::move(p), sink);
    if (r.error != engine::SubmitError::None) throw std::runtime_error("multiturn: submit refused: " + r.message);
  };
  const int limit = w.max_concurrency > 0 ? std::min(w.max_concurrency, w.conversations) : w.conversations;
  int started = 0;
  for (; started < limit; ++started) submit(started);
  const int total = w.conversations * w.turns;
  while (int(turns.size()) < total) {
    int c;
    {
      std::unique_lock lk(mu);
      cv.wait(lk, [&] { return !done.empty(); });
      c = done.front();
      done.pop_front();
    }
    std::shared_ptr<TurnSink> s = live[size_t(c)];
    if (!s->error.empty()) throw std::runtime_error("multiturn: request failed: " + s->error);
    auto& h = history[size_t(c)];
    turns.push_back({c, next_turn[size_t(c)], int(h.size()), s->cached, s->ttft_s, s->e2el_s});
    h.insert(h.end(), s->reply.begin(), s->reply.end());
    if (++next_turn[size_t(c)] < w.turns) {
      submit(c);
    } else if (started < w.conversations) {
      submit(started++);
    }
    if (w.progress) std::fprintf(stderr, "\rmultiturn: %d/%d turns", int(turns.size()), total);
  }
  if (w.progress) std::fprintf(stderr, "\n");
  const double duration = std::chrono::duration<double>(Clock::now() - t0).count();
  const engine::EngineStats after = eng.stats();

  int64_t prompt = 0, cached = 0;
  std::vector<double> ttft, first_ttft, later_ttft, e2el;
  std::vector<std::vector<double>> by_turn(size_t(w.turns));
  for (const Turn& t : turns) {
    prompt += t.prompt_tokens;
    cached += t.cached_tokens;
    ttft.push_back(t.ttft_s * 1e3);
    e2el.push_back(t.e2el_s * 1e3);
    (t.turn == 0 ? first_ttft : later_ttft).push_back(t.ttft_s * 1e3);
    by_turn[size_t(t.turn)].push_back(t.ttft_s * 1e3);
  }
  nlohmann::json j;
  j["conversations"] = w.conversations;
  j["turns"] = w.turns;
  j["system_len"] = w.system_len;
  j["turn_len"] = w.turn_len;
  j["output_len"] = w.output_len;
  j["max_concurrency"] = limit;
  j["requests"] = turns.size();
  j["duration_s"] = duration;
  j["prompt_tokens"] = prompt;
  j["cached_prompt_tokens"] = cached;
  j["prefix_hit_rate"] = prompt > 0 ? double(cached) / double(prompt) : 0.0;
  j["mean_ttft_ms"] = mean(ttft);
  j["median_ttft_ms"] = median(ttft);
  j["mean_ttft_first_turn_ms"] = mean(first_ttft);
  j["mean_ttft_later_turns_ms"] = mean(later_ttft);
  j["mean_e2el_ms"] = mean(e2el);
  nlohmann::json per_turn = nlohmann::json::array();
  for (const auto& v : by_turn) per_turn.push_back(mean(v));
  j["mean_ttft_by_turn_ms"] = per_turn;
  j["output_throughput"] = double(int64_t(turns.size()) * w.output_len) / duration;
  j["snapshot_hits"] = after.snapshot_hits - before.snapshot_hits;
  j["replayed_tokens"] = after.replayed_tokens - before.replayed_tokens;
  j["preemptions"] = after.preemptions - before.preemptions;
  if (after.disk) {
    j["disk_pages_read"] = after.disk_pages_read - before.disk_pages_read;
    j["disk_snapshots_read"] = after.disk_snapshots_read - before.disk_snapshots_read;
    j["disk_writes"] = after.disk_stats.writes - before.disk_stats.writes;
    j["disk_writes_dropped"] = after.disk_stats.writes_dropped - before.disk_stats.writes_dropped;
  }
  char buf[768];
  std::snprintf(buf, sizeof buf,
                "multiturn: %d conversations x %d turns (system %d, user %d, reply %d tokens), %.1f s\n"
                "  prefix hit rate   %.3f  (%lld of %lld prompt tokens cached)\n"
                "  TTFT mean %.1f ms, median %.1f ms; first turns %.1f ms, later turns %.1f ms; E2E latency mean %.1f ms\n"
                "  snapshot hits %lld, replayed tokens %lld, preemptions %lld\n",
                w.conversations, w.turns, w.system_len, w.turn_len, w.output_len, duration,
                j["prefix_hit_rate"].get<double>(), (long long)cached, (long long)prompt, mean(ttft), median(ttft),
                mean(first_ttft), mean(later_ttft), mean(e2el), (long long)j["snapshot_hits"].get<int64_t>(),
                (long long)j["replayed_tokens"].get<int64_t>(), (long long)j["preemptions"].get<int64_t>());
  return {j, buf};
}

}  // namespace di::bench
