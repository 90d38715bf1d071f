#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "core/thread_pool.h"

using namespace di;

TEST(ThreadPool, CoversRangeOnceInGrainMultiples) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t n : {1, 2, 7, 64, 1000, 1001})
      for (int64_t grain : {1, 4, 32}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::atomic<int> calls{0};
        pool.parallel_for(n, grain, [&](int64_t b, int64_t e, int t) {
          EXPECT_LT(b, e);
          EXPECT_GE(t, 0);
          EXPECT_LT(t, threads);
          EXPECT_EQ(b % grain, 0);
          if (e != n) {
            EXPECT_EQ(e % grain, 0);
          }
          for (int64_t i = b; i < e; ++i) hits[size_t(i)]++;
          calls++;
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << "n=" << n << " i=" << i;
        EXPECT_LE(calls.load(), ThreadPool::kChunksPerThread * threads);
      }
  }
}

// A job may ask for more (finer) chunks: the range is still covered once, in grain multiples,
// by exactly min(units, chunks_per_thread x threads) calls.
TEST(ThreadPool, ChunksPerThreadSetsTheChunkCount) {
  ThreadPool pool(2);
  for (int cpt : {1, 4, 16})
    for (int64_t n : {5, 100, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      std::atomic<int> calls{0};
      pool.parallel_for(
          n, 2,
          [&](int64_t b, int64_t e, int) {
            EXPECT_EQ(b % 2, 0);
            for (int64_t i = b; i < e; ++i) hits[size_t(i)]++;
            calls++;
          },
          cpt);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << "n=" << n << " i=" << i;
      EXPECT_EQ(calls.load(), std::min<int64_t>((n + 1) / 2, 2 * cpt)) << "n=" << n << " chunks per thread " << cpt;
    }
}

// Chunks are claimed dynamically: when every chunk takes a while, every thread gets some, and the
// ranges are the same fixed chunks on every call (only their owners vary).
TEST(ThreadPool, UsesAllThreadsOnFixedChunks) {
  ThreadPool pool(3);
  std::vector<std::pair<int64_t, int64_t>> first_ranges;
  for (int call = 0; call < 3; ++call) {
    std::mutex mu;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    std::vector<int> used(3, 0);
    pool.parallel_for(300, 1, [&](int64_t b, int64_t e, int t) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::lock_guard<std::mutex> lk(mu);
      ranges.emplace_back(b, e);
      used[size_t(t)] = 1;
    });
    std::sort(ranges.begin(), ranges.end());
    EXPECT_EQ(ranges.size(), 12u);  // 4 chunks per thread
    EXPECT_EQ(used, std::vector<int>({1, 1, 1}));
    if (call == 0) first_ranges = ranges;
    EXPECT_EQ(ranges, first_ranges);
  }
}

TEST(ThreadPool, NestedCallsRunInline) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  pool.parallel_for(4, 1, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i)
      pool.parallel_for(10, 1, [&](int64_t b2, int64_t e2, int t2) {
        EXPECT_EQ(t2, 0);
        for (int64_t j = b2; j < e2; ++j) sum += i * 10 + j;
      });
  });
  int64_t want = 0;
  for (int i = 0; i < 40; ++i) want += i;
  EXPECT_EQ(sum.load(), want);
}

TEST(ThreadPool, ManyCallsAndSleepWake) {
  ThreadPool pool(2);
  int64_t total = 0;
  for (int rep = 0; rep < 20000; ++rep) {
    std::atomic<int64_t> s{0};
    pool.parallel_for(16, 1, [&](int64_t b, int64_t e, int) { s += e - b; });
    total += s.load();
    if (rep % 5000 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));  // workers fall asleep
  }
  EXPECT_EQ(total, 16 * 20000);
}

TEST(ThreadPool, ConcurrentCallersBothComplete) {
  ThreadPool pool(2);
  std::atomic<int64_t> s{0};
  auto caller = [&] {
    for (int rep = 0; rep < 2000; ++rep) pool.parallel_for(8, 1, [&](int64_t b, int64_t e, int) { s += e - b; });
  };
  std::thread a(caller), b(caller);
  a.join();
  b.join();
  EXPECT_EQ(s.load(), 2 * 2000 * 8);
}

TEST(ThreadPool, RejectsBadSize) {
  EXPECT_THROW(ThreadPool(0), std::invalid_argument);
  EXPECT_GE(ThreadPool::default_threads(), 1);
}

// The time accounting: off by default; on, it counts pool jobs (not inline ones) and splits the
// caller's time into running and waiting, while the workers' running time is summed.
TEST(ThreadPool, TimingAccountsForJobs) {
  ThreadPool pool(2);
  auto sleepy = [](int64_t, int64_t, int) { std::this_thread::sleep_for(std::chrono::milliseconds(5)); };
  pool.parallel_for(8, 1, sleepy);
  EXPECT_EQ(pool.timing().jobs, 0);  // off
  pool.set_timing(true);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) pool.parallel_for(8, 1, sleepy);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  pool.parallel_for(1, 1, sleepy);  // one unit runs inline: not a job
  pool.set_timing(false);
  pool.parallel_for(8, 1, sleepy);
  const ThreadPool::Timing t = pool.timing();
  EXPECT_EQ(t.jobs, 3);
  // 3 jobs x 8 chunks x 5 ms on two threads: at least 120 ms of running in all, shared by both.
  EXPECT_GE(t.caller_run_s + t.worker_run_s, 0.120);
  EXPECT_GT(t.worker_run_s, 0.004);
  EXPECT_GT(t.caller_run_s, 0.004);
  EXPECT_LE(t.caller_run_s + t.caller_wait_s, wall + 1e-3);
  EXPECT_LE(t.worker_run_s, wall + 1e-3);
  pool.reset_timing();
  const ThreadPool::Timing z = pool.timing();
  EXPECT_EQ(z.jobs, 0);
  EXPECT_EQ(z.caller_run_s + z.caller_wait_s + z.worker_run_s, 0.0);
}
