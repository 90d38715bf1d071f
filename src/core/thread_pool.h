// A fixed pool of worker threads for the forward pass. parallel_for cuts [0, n) into a few
// contiguous chunks per thread, which the threads (the caller included) claim in order until none
// is left. Workers spin briefly, then sleep, so a decode step pays no syscall while the pool is
// busy; nothing is allocated per call.
//
// The chunks depend only on n, grain and the pool size, never on timing, and kernels give every
// output element to exactly one call, so results are the same bits for any thread count. A
// parallel_for issued from inside a worker (or while the pool is busy) runs inline on the calling
// thread: nested parallelism is allowed but serial.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

namespace di {

class ThreadPool {
 public:
  // Non-owning reference to fn(begin, end, thread_index): no heap allocation, unlike std::function.
  class RangeFn {
   public:
    template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, RangeFn>>>
    RangeFn(F&& f)  // NOLINT(google-explicit-constructor)
        : obj_(const_cast<void*>(static_cast<const void*>(&f))), call_([](void* o, int64_t b, int64_t e, int t) {
            (*static_cast<std::remove_reference_t<F>*>(o))(b, e, t);
          }) {}
    void operator()(int64_t b, int64_t e, int t) const { call_(obj_, b, e, t); }

   private:
    void* obj_;
    void (*call_)(void*, int64_t, int64_t, int);
  };

  explicit ThreadPool(int n_threads);  // n_threads >= 1 (1 = run everything on the caller)
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // std::thread::hardware_concurrency(), at least 1: the default for --threads.
  static int default_threads();

  int size() const;
  // Chunks per thread of each job, claimed dynamically: a thread that finishes early (its memory
  // traffic served faster, or the other one preempted on a shared machine) takes more chunks
  // instead of waiting. Few enough that claiming (one shared atomic) costs nothing measurable.
  static constexpr int kChunksPerThread = 4;

  // fn(begin, end, thread_index) for disjoint ranges covering [0, n); ranges are multiples of
  // `grain` except the last; thread_index < size(); at most chunks_per_thread x size() calls.
  // Empty ranges are not called. Returns when all ranges are done. Exceptions thrown by fn
  // terminate (kernels do not throw). Long jobs ask for more chunks: the last one claimed is
  // what the other threads wait for.
  void parallel_for(int64_t n, int64_t grain, RangeFn fn, int chunks_per_thread = kChunksPerThread);

  // Range of part t when [0, n) is split in units of `grain` into `parts` contiguous parts.
  static std::pair<int64_t, int64_t> split(int64_t n, int64_t grain, int parts, int t);

  // Where the time of the threads goes, for benchmarks: off by default (on, each job reads the
  // clock twice per thread). Totals since the last reset_timing(); jobs run inline are not jobs.
  struct Timing {
    int64_t jobs = 0;
    double caller_run_s = 0;   // the caller running chunks of jobs
    double caller_wait_s = 0;  // the caller done with its chunks, waiting for the workers
    double worker_run_s = 0;   // all workers together, running chunks
  };
  void set_timing(bool on);
  void reset_timing();
  Timing timing() const;

 private:
  struct Impl;
  Impl* impl_;
};

}  // namespace di
