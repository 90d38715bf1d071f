#include "bench/membw.h"

#include <immintrin.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "bench/machine.h"

namespace di::bench {

namespace {

// AVX2 bodies (any x86-64 this project targets has AVX2); the plain loops below are the fallback.
// Four sequential streams at once (the quarters of the slice): one stream per thread is held back
// by the hardware prefetcher on some CPUs (on a Zen 2, ~17 GB/s per thread against 24 with four),
// and the kernels stream several rows or panels at once, so a single stream would understate the
// bandwidth they can reach and overstate their efficiency.
__attribute__((target("avx2"))) uint64_t read_sum_avx2(const uint64_t* p, size_t n) {
  const size_t q = n / 4 / 4 * 4;  // words per stream, whole 32-byte loads
  const uint64_t* s[4] = {p, p + q, p + 2 * q, p + 3 * q};
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < q; i += 4) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s[0] + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s[1] + i)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s[2] + i)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s[3] + i)));
  }
  const __m256i v = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  uint64_t sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (size_t i = 4 * q; i < n; ++i) sum += p[i];
  return sum;
}

__attribute__((target("avx2"))) void triad_avx2(float* a, const float* b, const float* c, float s, size_t n) {
  const __m256 vs = _mm256_set1_ps(s);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_store_ps(a + i, _mm256_add_ps(_mm256_load_ps(b + i), _mm256_mul_ps(vs, _mm256_load_ps(c + i))));
    _mm256_store_ps(a + i + 8, _mm256_add_ps(_mm256_load_ps(b + i + 8), _mm256_mul_ps(vs, _mm256_load_ps(c + i + 8))));
  }
  for (; i < n; ++i) a[i] = b[i] + s * c[i];
}

uint64_t read_sum(const uint64_t* p, size_t n) {
  if (__builtin_cpu_supports("avx2")) return read_sum_avx2(p, n);
  uint64_t s0 = 0, s1 = 0;
  size_t i = 0;
  for (; i + 2 <= n; i += 2) s0 += p[i], s1 += p[i + 1];
  for (; i < n; ++i) s0 += p[i];
  return s0 + s1;
}

void triad(float* a, const float* b, const float* c, float s, size_t n) {
  if (__builtin_cpu_supports("avx2")) return triad_avx2(a, b, c, s, n);
  for (size_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

struct FreeDeleter { void operator()(void* p) const { std::free(p); } };

// Runs work(thread_index) on `threads` threads at once and returns the time from the first
// thread's start to the last thread's end. The threads take their own timestamps: a caller
// preempted between the barriers (2 workers + the caller on 2 cores) must not shorten the pass.
class Team {
 public:
  explicit Team(int threads) : n_(threads), start_(threads + 1), done_(threads + 1), begin_(size_t(threads)), end_(size_t(threads)) {
    for (int t = 0; t < n_; ++t)
      workers_.emplace_back([this, t] {
        for (;;) {
          start_.arrive_and_wait();
          if (quit_) return;
          begin_[size_t(t)] = std::chrono::steady_clock::now();
          work_(t);
          end_[size_t(t)] = std::chrono::steady_clock::now();
          done_.arrive_and_wait();
        }
      });
  }
  ~Team() {
    quit_ = true;
    start_.arrive_and_wait();
    for (auto& w : workers_) w.join();
  }
  double run(const std::function<void(int)>& work) {
    work_ = work;
    start_.arrive_and_wait();
    done_.arrive_and_wait();
    const auto first = *std::min_element(begin_.begin(), begin_.end());
    const auto last = *std::max_element(end_.begin(), end_.end());
    return std::chrono::duration<double>(last - first).count();
  }

 private:
  int n_;
  std::barrier<> start_, done_;
  std::function<void(int)> work_;
  bool quit_ = false;
  std::vector<std::chrono::steady_clock::time_point> begin_, end_;
  std::vector<std::jthread> workers_;
};

}  // namespace

int64_t default_bandwidth_bytes() {
  const MachineInfo m = machine_info();
  int64_t b = std::max<int64_t>(4 * m.l3_bytes, int64_t(1) << 30);
  if (m.mem_total_bytes > 0) b = std::min(b, m.mem_total_bytes / 4);
  return b;
}

BandwidthResult measure_bandwidth(const BandwidthOptions& opts) {
  if (opts.threads < 1) throw std::invalid_argument("bandwidth: threads must be >= 1");
  if (opts.passes < 1) throw std::invalid_argument("bandwidth: passes must be >= 1");
  BandwidthResult r;
  r.threads = opts.threads;
  const int T = opts.threads;
  // Each thread's slice is a multiple of 4 KiB so that every slice stays 32-byte aligned.
  const int64_t want = opts.bytes > 0 ? opts.bytes : default_bandwidth_bytes();
  const int64_t unit = int64_t(T) * 3 * 4096;
  const int64_t bytes = std::max<int64_t>(unit, want / unit * unit);
  r.bytes = bytes;
  std::unique_ptr<char, FreeDeleter> buf(static_cast<char*>(std::aligned_alloc(4096, size_t(bytes))));
  if (!buf) throw std::runtime_error("bandwidth: cannot allocate " + std::to_string(bytes) + " bytes");
  Team team(T);
  // First touch by the thread that will read each slice (NUMA placement); non-zero contents.
  const int64_t slice = bytes / T;
  team.run([&](int t) {
    float* p = reinterpret_cast<float*>(buf.get() + slice * t);
    for (int64_t i = 0; i < slice / 4; ++i) p[i] = float(i & 1023) * 0.5f;
  });

  std::vector<uint64_t> sink(size_t(T) * 8);
  auto read_pass = [&](int t) {
    sink[size_t(t) * 8] += read_sum(reinterpret_cast<const uint64_t*>(buf.get() + slice * t), size_t(slice / 8));
  };
  // Triad over three arrays of bytes/3: thread t works on the t-th part of each array.
  const int64_t array = bytes / 3, part = array / T;
  auto triad_pass = [&](int t) {
    float* a = reinterpret_cast<float*>(buf.get() + part * t);
    const float* b = reinterpret_cast<const float*>(buf.get() + array + part * t);
    const float* c = reinterpret_cast<const float*>(buf.get() + 2 * array + part * t);
    triad(a, b, c, 0.5f, size_t(part / 4));
  };
  std::vector<double> rd, tr;
  team.run(read_pass);
  for (int p = 0; p < opts.passes; ++p) rd.push_back(double(slice * T) / team.run(read_pass) / 1e9);
  team.run(triad_pass);
  for (int p = 0; p < opts.passes; ++p) tr.push_back(double(part * T * 3) / team.run(triad_pass) / 1e9);
  volatile uint64_t keep = 0;
  for (uint64_t s : sink) keep = keep + s;
  r.read_gbs = summarize(std::move(rd));
  r.triad_gbs = summarize(std::move(tr));
  return r;
}

}  // namespace di::bench
