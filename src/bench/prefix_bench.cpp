#include "bench/prefix_bench.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>

namespace di::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Waits for one request's first token and end.
class FirstToken final : public engine::RequestSink {
 public:
  void on_start(const engine::StartEvent& e) override {
    std::lock_guard lk(mu_);
    cached_ = e.cached_tokens;
  }
  void on_token(const engine::TokenEvent&) override {
    std::lock_guard lk(mu_);
    if (!first_) first_ = Clock::now();
  }
  void on_finish(const engine::FinishEvent& e) override {
    std::lock_guard lk(mu_);
    done_ = true;
    error_ = e.error;
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return done_; });
    if (!error_.empty()) throw std::runtime_error("bench prefix: request failed: " + error_);
  }
  std::optional<Clock::time_point> first() const { return first_; }
  int cached() const { return cached_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  std::optional<Clock::time_point> first_;
  int cached_ = 0;
};

struct Measured {
  double ttft_s = 0;
  int cached = 0;
  engine::EngineStats stats;  // after the request
};

Measured run_one(engine::Engine& e, const std::vector<int32_t>& prompt) {
  engine::RequestParams p;
  p.prompt = prompt;
  p.max_tokens = 1;
  p.ignore_eos = true;
  p.sampling.temperature = 0;
  auto sink = std::make_shared<FirstToken>();
  const auto t0 = Clock::now();
  const auto r = e.submit(std::move(p), sink);
  if (r.error != engine::SubmitError::None) throw std::runtime_error("bench prefix: submit: " + r.message);
  sink->wait();
  Measured m;
  m.ttft_s = std::chrono::duration<double>(*sink->first() - t0).count();
  m.cached = sink->cached();
  m.stats = e.stats();
  return m;
}

void wait_for_disk_writes(engine::Engine& e) {
  for (;;) {
    const auto s = e.stats();
    if (!s.disk || (s.disk_stats.queued_writes == 0)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Drops the entry files from the page cache, so the next reads come from the device.
uint64_t drop_cached_files(const std::string& dir) {
  uint64_t bytes = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir)) {
    if (!f.is_regular_file()) continue;
    const int fd = ::open(f.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
    bytes += f.file_size();
  }
  return bytes;
}

}  // namespace

PrefixBenchResult run_prefix_bench(std::shared_ptr<const Model> model, const PrefixBenchOptions& o) {
  if (o.cache_dir.empty()) throw std::invalid_argument("bench prefix: a cache directory is needed");
  std::filesystem::remove_all(o.cache_dir);
  const int64_t vocab = model->info().sampleable_vocab;
  std::mt19937_64 rng(o.seed);
  auto random_ids = [&](int64_t n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& t : v) t = int32_t(rng() % uint64_t(vocab));
    return v;
  };
  const std::vector<int32_t> base = random_ids(o.prompt_len);
  std::vector<int32_t> follow = base;
  const std::vector<int32_t> more = random_ids(int64_t(double(o.prompt_len) * o.extend));
  follow.insert(follow.end(), more.begin(), more.end());
  std::vector<int32_t> partial(base.begin(), base.begin() + std::ptrdiff_t(double(o.prompt_len) * o.partial));
  const std::vector<int32_t> tail = random_ids(int64_t(follow.size() - partial.size()));
  partial.insert(partial.end(), tail.begin(), tail.end());
  auto say = [&](const char* what) {
    if (!o.quiet) std::fprintf(stderr, "bench prefix: %s\n", what);
  };

  nlohmann::json j;
  j["prompt_tokens"] = o.prompt_len;
  j["follow_up_tokens"] = follow.size();
  j["partial_shared_tokens"] = int64_t(double(o.prompt_len) * o.partial);
  j["page_tokens"] = o.engine.page_tokens;
  j["snapshot_interval"] = o.engine.snapshot_interval;
  j["max_batch_tokens"] = o.engine.max_batch_tokens;

  Measured cold;
  {
    say("cold follow-up (prefix cache off)");
    engine::EngineOptions eo = o.engine;
    eo.prefix_cache = false;
    auto e = engine::Engine::create(model, eo);
    cold = run_one(*e, follow);
  }
  engine::EngineOptions eo = o.engine;
  eo.cache_dir = o.cache_dir;
  Measured warm_base, disk, ram, part;
  {
    say("base prompt (fills the RAM and disk tiers)");
    auto e = engine::Engine::create(model, eo);
    warm_base = run_one(*e, base);
    wait_for_disk_writes(*e);
    e->shutdown();
  }
  const uint64_t dropped_bytes = drop_cached_files(o.cache_dir);
  {
    // A restart: a new engine, nothing in RAM, the files out of the page cache.
    auto e = engine::Engine::create(model, eo);
    say("follow-up from disk after a restart");
    disk = run_one(*e, follow);
    // The base prompt's entries are in RAM now; another turn on it, and a partial hit.
    std::vector<int32_t> follow2 = base;
    const std::vector<int32_t> other = random_ids(int64_t(more.size()));
    follow2.insert(follow2.end(), other.begin(), other.end());
    say("another follow-up from RAM");
    ram = run_one(*e, follow2);
    say("partial hit from RAM");
    part = run_one(*e, partial);
    e->shutdown();
  }
  auto row = [](const Measured& m, const Measured* before) {
    nlohmann::json r = {{"ttft_s", m.ttft_s}, {"cached_tokens", m.cached}};
    const int64_t replayed = m.stats.replayed_tokens - (before ? before->stats.replayed_tokens : 0);
    const int64_t snap_hits = m.stats.snapshot_hits - (before ? before->stats.snapshot_hits : 0);
    r["replayed_tokens"] = replayed;
    r["snapshot_hit"] = snap_hits > 0;
    if (m.stats.disk && !before) {
      r["disk_pages_read"] = m.stats.disk_pages_read;
      r["disk_snapshots_read"] = m.stats.disk_snapshots_read;
      r["disk_hit_bytes"] = m.stats.disk_stats.hit_bytes;
      r["disk_read_seconds"] = m.stats.disk_stats.read_seconds;
    }
    return r;
  };
  j["cold"] = row(cold, nullptr);
  j["base"] = row(warm_base, nullptr);
  j["disk_after_restart"] = row(disk, nullptr);
  j["ram"] = row(ram, &disk);
  j["partial_ram"] = row(part, &ram);
  j["disk_bytes_dropped_from_page_cache"] = dropped_bytes;
  j["snapshot_bytes"] = warm_base.stats.snapshots > 0 ? warm_base.stats.snapshot_bytes / uint64_t(warm_base.stats.snapshots) : 0;
  j["speedup_ram"] = cold.ttft_s / ram.ttft_s;
  j["speedup_disk"] = cold.ttft_s / disk.ttft_s;
  j["speedup_partial_ram"] = cold.ttft_s / part.ttft_s;

  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "prefix cache, %lld-token prompt, follow-up %zu tokens (page %d, snapshot every %lld)\n"
                "  cold           TTFT %8.3f s\n"
                "  RAM hit        TTFT %8.3f s  cached %6d  replayed %5lld  %6.1fx\n"
                "  partial (%.0f%%) TTFT %8.3f s  cached %6d  replayed %5lld  %6.1fx\n"
                "  disk, restart  TTFT %8.3f s  cached %6d  replayed %5lld  %6.1fx  (%lld pages, %lld snapshots read)\n",
                (long long)o.prompt_len, follow.size(), o.engine.page_tokens, (long long)o.engine.snapshot_interval,
                cold.ttft_s, ram.ttft_s, ram.cached, (long long)j["ram"]["replayed_tokens"].get<int64_t>(),
                cold.ttft_s / ram.ttft_s, o.partial * 100, part.ttft_s, part.cached,
                (long long)j["partial_ram"]["replayed_tokens"].get<int64_t>(), cold.ttft_s / part.ttft_s, disk.ttft_s,
                disk.cached, (long long)j["disk_after_restart"]["replayed_tokens"].get<int64_t>(), cold.ttft_s / disk.ttft_s,
                (long long)disk.stats.disk_pages_read, (long long)disk.stats.disk_snapshots_read);
  return {j, buf};
}

}  // namespace di::bench
