// Engine: the thread around the Scheduler. Submissions, cancellations and stop requests go
// through a mutex-protected inbox; the engine thread drains it between steps, runs steps while
// there is work and sleeps on a condition variable otherwise.
#include "engine/engine.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "engine/request.h"
#include "engine/scheduler.h"

namespace di::engine {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
    case FinishReason::Deadline: return "deadline";
    case FinishReason::Error: return "error";
  }
  return "unknown";
}

namespace {

void check_options(const EngineOptions& o) {
  auto bad = [](const std::string& m) { throw std::invalid_argument("EngineOptions: " + m); };
  if (o.page_tokens <= 0) bad("page_tokens must be positive");
  if (o.max_batch_tokens <= 0) bad("max_batch_tokens must be positive");
  if (o.max_running <= 0) bad("max_running must be positive");
  if (o.max_waiting < 0) bad("max_waiting must be >= 0");
  if (o.max_context < 0) bad("max_context must be >= 0");
  if (o.max_rollback < 0) bad("max_rollback must be >= 0");
  if (o.cache_budget_bytes == 0) bad("cache_budget_bytes must be positive");
}

class EngineImpl final : public Engine {
 public:
  EngineImpl(std::shared_ptr<const Model> model, const EngineOptions& opts)
      : model_(std::move(model)),
        opts_(opts),
        sched_(*model_, opts_),
        rng_(std::random_device{}()) {
    stats_.cache_bytes_budget = opts_.cache_budget_bytes;
    stats_.state_bytes_budget = opts_.state_budget_bytes;
    thread_ = std::thread([this] { loop(); });
  }
  ~EngineImpl() override { shutdown(); }

  SubmitResult submit(RequestParams params, std::shared_ptr<RequestSink> sink) override {
    SubmitResult r = validate_request(params, model_->info(), opts_,
                                      [this](int64_t n) { return sched_.sequence_bytes(n); });
    std::lock_guard lk(mu_);
    if (r.error == SubmitError::None && stopping_) {
      r.error = SubmitError::ShuttingDown;
      r.message = "the engine is shutting down";
    }
    // Inbox entries move into the scheduler under mu_, so this count is exact.
    if (r.error == SubmitError::None && sched_.waiting_requests() + int(inbox_.size()) >= opts_.max_waiting) {
      r.error = SubmitError::QueueFull;
      r.message = "the waiting queue is full (" + std::to_string(opts_.max_waiting) + " requests)";
      r.retry_after_s = retry_after_locked(int64_t(params.prompt.size()));
    }
    if (r.error != SubmitError::None) {
      ++stats_.requests_rejected;
      return r;
    }
    r.id = next_id_++;
    Pending p;
    p.id = r.id;
    p.seed = params.sampling.seed ? *params.sampling.seed : rng_();
    p.params = std::move(params);
    p.sink = std::move(sink);
    p.submitted = Clock::now();
    inbox_tokens_ += int64_t(p.params.prompt.size());
    inbox_.push_back(std::move(p));
    ++stats_.requests_submitted;
    cv_.notify_one();
    return r;
  }

  void cancel(uint64_t id) override {
    std::lock_guard lk(mu_);
    cancels_.push_back(id);
    cv_.notify_one();
  }

  void stop_choice(uint64_t id, int choice) override {
    std::lock_guard lk(mu_);
    stops_.emplace_back(id, choice);
    cv_.notify_one();
  }

  void set_paused(uint64_t id, bool paused) override {
    std::lock_guard lk(mu_);
    pauses_.emplace_back(id, paused);
    cv_.notify_one();
  }

  EngineStats stats() const override {
    std::lock_guard lk(mu_);
    EngineStats s = stats_;
    s.waiting += int(inbox_.size());
    // The disk tier's threads go on between steps (and while the engine idles): read it live.
    if (const DiskCache* d = sched_.disk()) s.disk_stats = d->tier().stats();
    return s;
  }

  void shutdown() override {
    {
      std::lock_guard lk(mu_);
      stopping_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  }

  const Model& model() const override { return *model_; }

  uint64_t flush_cache() override {
    std::promise<uint64_t> done;
    std::future<uint64_t> result = done.get_future();
    {
      std::lock_guard lk(mu_);
      if (stopping_) return 0;
      flushes_.push_back(std::move(done));
      cv_.notify_one();
    }
    return result.get();
  }

 private:
  struct Pending {
    uint64_t id = 0, seed = 0;
    RequestParams params;
    std::shared_ptr<RequestSink> sink;
    Clock::time_point submitted;
  };

  // Seconds until the queue ahead of a new request has drained, at the recent token rate.
  int retry_after_locked(int64_t own_tokens) const {
    const double tokens = double(sched_.waiting_prompt_tokens() + inbox_tokens_ + own_tokens);
    const double rate = tokens_per_s_ > 1.0 ? tokens_per_s_ : 1.0;
    return int(std::clamp(std::ceil(tokens / rate), 1.0, 600.0));
  }

  void loop() {
    std::vector<uint64_t> cancels;
    std::vector<std::pair<uint64_t, int>> stops;
    std::vector<std::pair<uint64_t, bool>> pauses;
    std::vector<std::promise<uint64_t>> flushes;
    bool busy = false;
    for (;;) {
      bool stop = false;
      {
        std::unique_lock lk(mu_);
        if (!busy)
          cv_.wait(lk, [&] {
            return stopping_ || !inbox_.empty() || !cancels_.empty() || !stops_.empty() || !pauses_.empty() ||
                   !flushes_.empty();
          });
        for (auto& p : inbox_) sched_.add(p.id, std::move(p.params), std::move(p.sink), p.seed, p.submitted);
        inbox_.clear();
        inbox_tokens_ = 0;
        cancels.swap(cancels_);
        stops.swap(stops_);
        pauses.swap(pauses_);
        flushes.swap(flushes_);
        stop = stopping_;
      }
      for (auto& f : flushes) f.set_value(sched_.flush_cache());
      flushes.clear();
      for (uint64_t id : cancels) sched_.cancel(id);
      cancels.clear();
      for (auto [id, c] : stops) sched_.stop_choice(id, c);
      stops.clear();
      for (auto [id, p] : pauses) sched_.set_paused(id, p);
      pauses.clear();
      if (stop) {
        sched_.cancel_all(FinishReason::Cancelled);
        publish(0.0, 0);
        return;
      }
      const auto t0 = Clock::now();
      const int64_t tokens_before = sched_.counters().step_tokens;
      try {
        busy = sched_.step();
      } catch (const std::exception& e) {
        // A fault outside the forward pass (which the scheduler handles itself): fail everything
        // rather than leave clients hanging.
        spdlog::error("engine: step failed: {}", e.what());
        sched_.cancel_all(FinishReason::Error);
        busy = false;
      }
      publish(std::chrono::duration<double>(Clock::now() - t0).count(), sched_.counters().step_tokens - tokens_before);
    }
  }

  void publish(double step_s, int64_t step_tokens) {
    const auto& c = sched_.counters();
    std::lock_guard lk(mu_);
    if (step_tokens > 0 && step_s > 0) {
      const double rate = double(step_tokens) / step_s;
      tokens_per_s_ = tokens_per_s_ > 0 ? 0.9 * tokens_per_s_ + 0.1 * rate : rate;
    }
    stats_.requests_finished = c.requests_finished;
    stats_.prompt_tokens = c.prompt_tokens;
    stats_.cached_prompt_tokens = c.cached_prompt_tokens;
    stats_.generated_tokens = c.generated_tokens;
    stats_.waiting = sched_.waiting_choices();
    stats_.running = sched_.running_choices();
    stats_.cache_pages_used = sched_.pool().pages_in_use();
    stats_.cache_bytes_used = sched_.pool().used_bytes();
    stats_.state_bytes_used = sched_.state_pool().used_bytes();
    stats_.prefix_lookups = c.prefix_lookups;
    stats_.prefix_hit_tokens = c.prefix_hit_tokens;
    stats_.prefix_lookup_tokens = c.prefix_lookup_tokens;
    stats_.preemptions = c.preemptions;
    stats_.nonfinite_logits = c.nonfinite_logits;
    stats_.steps = c.steps;
    stats_.decode_steps = c.decode_steps;
    stats_.decode_rows = c.decode_rows;
    stats_.decode_seconds = c.decode_seconds;
    stats_.prefix_cache_bytes = sched_.prefix_cache().bytes();
    stats_.prefix_cache_entries = int64_t(sched_.prefix_cache().entries());
    stats_.prefix_cache_evictions = sched_.prefix_cache().evictions();
    stats_.snapshots = int64_t(sched_.prefix_cache().snapshots());
    stats_.snapshot_bytes = sched_.prefix_cache().snapshot_bytes();
    stats_.snapshot_evictions = sched_.prefix_cache().snapshot_evictions();
    stats_.snapshots_taken = c.snapshots_taken;
    stats_.snapshot_hits = c.snapshot_hits;
    stats_.replayed_tokens = c.replayed_tokens;
    if (const DiskCache* d = sched_.disk()) {
      stats_.disk = true;  // disk_stats are read live in stats()
      stats_.disk_pages_read = d->pages_read();
      stats_.disk_snapshots_read = d->snapshots_read();
    }
  }

  std::shared_ptr<const Model> model_;
  EngineOptions opts_;
  Scheduler sched_;  // engine thread only (sequence_bytes is const and safe from any thread)

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Pending> inbox_;
  std::vector<uint64_t> cancels_;
  std::vector<std::pair<uint64_t, int>> stops_;
  std::vector<std::pair<uint64_t, bool>> pauses_;
  std::vector<std::promise<uint64_t>> flushes_;
  bool stopping_ = false;
  uint64_t next_id_ = 1;
  std::mt19937_64 rng_;  // seeds for requests without one
  int64_t inbox_tokens_ = 0;
  double tokens_per_s_ = 0;
  EngineStats stats_;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<Engine> Engine::create(std::shared_ptr<const Model> model, const EngineOptions& opts) {
  if (!model) throw std::invalid_argument("Engine::create: no model");
  check_options(opts);
  return std::make_unique<EngineImpl>(std::move(model), opts);
}

}  // namespace di::engine
