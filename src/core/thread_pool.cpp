#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DI_PAUSE() _mm_pause()
#else
#define DI_PAUSE() ((void)0)
#endif

namespace di {

namespace {
// About 50-100 us of spinning before a worker sleeps: longer than the gap between two kernels of
// one decode step, much shorter than the gap between steps of an idle server.
constexpr int kSpinIters = 1 << 14;
thread_local bool t_inside_pool = false;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

struct ThreadPool::Impl {
  int n_threads = 1;
  std::vector<std::thread> workers;

  // The current job; written by the caller before `generation` is bumped (release), read by
  // workers after they observe the new generation (acquire).
  const RangeFn* fn = nullptr;
  int64_t n = 0, grain = 1, chunks = 1;

  alignas(64) std::atomic<int64_t> next_chunk{0};  // the next unclaimed chunk of the current job

  alignas(64) std::atomic<uint64_t> generation{0};
  alignas(64) std::atomic<int> pending{0};  // workers still running the current job
  alignas(64) std::atomic<int> sleepers{0};
  std::atomic<bool> busy{false};  // a parallel_for is in progress (nested calls run inline)
  // Timing (see ThreadPool::Timing); the caller's fields are written by the caller only.
  std::atomic<bool> timing{false};
  int64_t jobs = 0, caller_run_ns = 0, caller_wait_ns = 0;
  alignas(64) std::atomic<int64_t> worker_run_ns{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::condition_variable cv;

  void worker_main(int t) {
    t_inside_pool = true;
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = generation.load(std::memory_order_acquire);
      for (int i = 0; g == seen && i < kSpinIters; ++i) {
        DI_PAUSE();
        g = generation.load(std::memory_order_acquire);
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lk(mu);
        sleepers.fetch_add(1, std::memory_order_seq_cst);
        while ((g = generation.load(std::memory_order_seq_cst)) == seen && !stop.load()) cv.wait(lk);
        sleepers.fetch_sub(1, std::memory_order_relaxed);
      }
      if (stop.load(std::memory_order_acquire)) return;
      seen = g;
      if (timing.load(std::memory_order_relaxed)) {
        const int64_t t0 = now_ns();
        run_chunks(t);
        worker_run_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
      } else {
        run_chunks(t);
      }
      pending.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  // Claims chunks of the current job until none is left. Chunk c always covers the same range,
  // so which thread runs it changes nothing but the timing.
  void run_chunks(int t) {
    for (int64_t c; (c = next_chunk.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const auto [b, e] = split(n, grain, int(chunks), int(c));
      if (b < e) (*fn)(b, e, t);
    }
  }
};

ThreadPool::ThreadPool(int n_threads) : impl_(new Impl) {
  if (n_threads < 1) {
    delete impl_;
    throw std::invalid_argument("ThreadPool: n_threads must be >= 1, got " + std::to_string(n_threads));
  }
  impl_->n_threads = n_threads;
  impl_->workers.reserve(size_t(n_threads - 1));
  for (int t = 1; t < n_threads; ++t) impl_->workers.emplace_back([this, t] { impl_->worker_main(t); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->stop.store(true);
    impl_->generation.fetch_add(1, std::memory_order_seq_cst);
  }
  impl_->cv.notify_all();
  for (auto& w : impl_->workers) w.join();
  delete impl_;
}

int ThreadPool::default_threads() { return std::max(1, int(std::thread::hardware_concurrency())); }

int ThreadPool::size() const { return impl_->n_threads; }

std::pair<int64_t, int64_t> ThreadPool::split(int64_t n, int64_t grain, int parts, int t) {
  grain = std::max<int64_t>(grain, 1);
  const int64_t units = (n + grain - 1) / grain;
  const int64_t u0 = units * t / parts, u1 = units * (t + 1) / parts;
  return {std::min(n, u0 * grain), std::min(n, u1 * grain)};
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, RangeFn fn, int chunks_per_thread) {
  if (n <= 0) return;
  Impl& p = *impl_;
  const bool single = p.n_threads == 1 || n <= std::max<int64_t>(grain, 1);
  if (single || t_inside_pool || p.busy.exchange(true, std::memory_order_acquire)) {
    fn(0, n, 0);  // nested or concurrent use: run inline
    return;
  }
  p.fn = &fn;
  p.n = n;
  p.grain = grain;
  const int64_t units = (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
  p.chunks = std::min<int64_t>(units, int64_t(p.n_threads) * std::max(chunks_per_thread, 1));
  p.next_chunk.store(0, std::memory_order_relaxed);
  p.pending.store(p.n_threads - 1, std::memory_order_relaxed);
  p.generation.fetch_add(1, std::memory_order_seq_cst);
  if (p.sleepers.load(std::memory_order_seq_cst) > 0) {
    { std::lock_guard<std::mutex> lk(p.mu); }
    p.cv.notify_all();
  }
  const bool timed = p.timing.load(std::memory_order_relaxed);
  const int64_t t0 = timed ? now_ns() : 0;
  t_inside_pool = true;
  p.run_chunks(0);
  t_inside_pool = false;
  const int64_t t1 = timed ? now_ns() : 0;
  // The others are working on this job right now: spin, yielding now and then on an oversubscribed box.
  for (int i = 0; p.pending.load(std::memory_order_acquire) != 0; ++i) {
    if (i < kSpinIters) DI_PAUSE();
    else std::this_thread::yield();
  }
  if (timed) {
    ++p.jobs;
    p.caller_run_ns += t1 - t0;
    p.caller_wait_ns += now_ns() - t1;
  }
  p.busy.store(false, std::memory_order_release);
}

void ThreadPool::set_timing(bool on) { impl_->timing.store(on, std::memory_order_relaxed); }

void ThreadPool::reset_timing() {
  impl_->jobs = impl_->caller_run_ns = impl_->caller_wait_ns = 0;
  impl_->worker_run_ns.store(0, std::memory_order_relaxed);
}

ThreadPool::Timing ThreadPool::timing() const {
  Timing t;
  t.jobs = impl_->jobs;
  t.caller_run_s = double(impl_->caller_run_ns) * 1e-9;
  t.caller_wait_s = double(impl_->caller_wait_ns) * 1e-9;
  t.worker_run_s = double(impl_->worker_run_ns.load(std::memory_order_relaxed)) * 1e-9;
  return t;
}

}  // namespace di
