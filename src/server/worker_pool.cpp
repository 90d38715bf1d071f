#include "server/worker_pool.h"

#include <algorithm>
#include <exception>

#include <spdlog/spdlog.h>

namespace di::server {

WorkerPool::WorkerPool(int threads, size_t max_queued) : max_queued_(max_queued) {
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { loop(); });
}

WorkerPool::~WorkerPool() { stop(); }

bool WorkerPool::try_submit(std::function<void()> job) {
  {
    std::lock_guard lk(mu_);
    // A job an idle worker will take at once does not count against the queue.
    if (stopping_ || jobs_.size() >= max_queued_ + idle_) return false;
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
  return true;
}

void WorkerPool::stop() {
  {
    std::lock_guard lk(mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

size_t WorkerPool::queued() const {
  std::lock_guard lk(mu_);
  return jobs_.size();
}

size_t WorkerPool::pending() const {
  std::lock_guard lk(mu_);
  return jobs_.size() + running_;
}

void WorkerPool::loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lk(mu_);
      ++idle_;
      cv_.wait(lk, [&] { return stopping_ || !jobs_.empty(); });
      --idle_;
      if (jobs_.empty()) return;  // stopping and drained
      job = std::move(jobs_.front());
      jobs_.pop_front();
      ++running_;
    }
    try {
      job();
    } catch (const std::exception& e) {
      spdlog::error("worker job threw: {}", e.what());
    }
    std::lock_guard lk(mu_);
    --running_;
  }
}

}  // namespace di::server
