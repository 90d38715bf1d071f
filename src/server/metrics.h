// Server metrics in the Prometheus text exposition format (version 0.0.4).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace di::server {

// Cumulative-bucket histogram (`le` upper bounds, +Inf implied).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  // Appends the _bucket/_sum/_count lines of `name`.
  void render(const std::string& name, std::string& out) const;
  uint64_t count() const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, non-cumulative; last = +Inf
  double sum_ = 0;
  uint64_t n_ = 0;
};

class Metrics {
 public:
  Metrics();
  void count_request(const std::string& endpoint, int status);
  void count_finish(const std::string& reason);  // "stop", "length", "tool_calls", "cancelled", "error", ...
  void add_tokens(int64_t prompt, int64_t cached, int64_t generated);
  void observe_ttft(double seconds) { ttft_.observe(seconds); }
  void observe_tpot(double seconds) { tpot_.observe(seconds); }
  void observe_e2e(double seconds) { e2e_.observe(seconds); }
  void stream_opened() { add_gauge(streams_, 1); }
  void stream_closed() { add_gauge(streams_, -1); }
  // A stream's client fell behind: its request is paused / resumed.
  void stream_paused(bool paused) {
    add_gauge(paused_streams_, paused ? 1 : -1);
    if (paused) add_gauge(pauses_, 1);
  }

  // `engine` is empty while the model loads.
  std::string render(const std::optional<engine::EngineStats>& engine, int open_connections, bool ready) const;

 private:
  void add_gauge(int64_t& g, int64_t d);
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, int64_t> requests_;
  std::map<std::string, int64_t> finishes_;
  int64_t prompt_tokens_ = 0, cached_tokens_ = 0, generated_tokens_ = 0, streams_ = 0;
  int64_t paused_streams_ = 0, pauses_ = 0;
  Histogram ttft_, tpot_, e2e_;
};

}  // namespace di::server
