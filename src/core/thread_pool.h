// A fixed pool of worker threads for the forward pass. parallel_for splits [0, n) into contiguous
// ranges, one per thread (the caller runs one of them). Workers spin briefly, then sleep, so a
// decode step pays no syscall while the pool is busy; nothing is allocated per call.
#pragma once

#include <cstdint>
#include <functional>

namespace di {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);  // n_threads >= 1 (1 = run everything on the caller)
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const;
  // fn(begin, end, thread_index) for disjoint ranges covering [0, n); ranges are multiples of
  // `grain` except the last. Returns when all ranges are done. Not reentrant.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t, int)>& fn);

 private:
  struct Impl;
  Impl* impl_;
};

}  // namespace di
