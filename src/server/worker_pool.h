// A small fixed pool of threads with a bounded queue, for request work that must not run on the
// HTTP io threads (JSON parsing, prompt rendering, tokenization): a slow request then delays other
// requests' parsing at most, never /health or the connections themselves.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace di::server {

class WorkerPool {
 public:
  // threads >= 1; besides the jobs running, up to max_queued may wait.
  WorkerPool(int threads, size_t max_queued);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `job`; false (job dropped) when the queue is full or the pool stopped.
  bool try_submit(std::function<void()> job);
  // Runs what is queued, then joins the threads. Later submissions are refused.
  void stop();
  size_t queued() const;
  // Jobs queued or running.
  size_t pending() const;

 private:
  void loop();

  const size_t max_queued_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  size_t idle_ = 0;     // workers waiting for a job
  size_t running_ = 0;  // jobs being run
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace di::server
