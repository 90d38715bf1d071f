// Kernel microbenchmarks: FP8/FP4 linears (checkpoint layout and load-time repacked), the bf16
// logits head and the FP8-dequant (wo_a) linear at decode shapes (weight GB/s vs a read bandwidth
// measured in the same process, on buffers far larger than the caches) and at m = 512 (GFLOP/s vs
// a measured vdpbf16ps / fp32 FMA peak). Weights rotate through arenas of 0.5-1 GiB so every
// decode iteration streams from DRAM, not from the 260 MB L3.
//   bench_kernels [--benchmark_filter=...]   (DEEPINFER_ISA selects the kernel path)
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "core/thread_pool.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/kernels_internal.h"

using namespace di;

namespace {

constexpr size_t kArena = size_t(1) << 30;
uint8_t* g_arena = nullptr;
// A second arena holding repacked copies of the first one's slices (kern::pack_weight), and one
// of bf16 weights with sane exponents (no denormals or NaNs), for the head.
constexpr size_t kPackedArena = size_t(1) << 29, kBf16Arena = size_t(1) << 31;
uint8_t* g_packed_arena = nullptr;
uint16_t* g_bf16_arena = nullptr;
double g_bw[3] = {0, 0, 0};           // read GB/s with 1 and 2 threads
double g_bf16_peak[3], g_fp32_peak[3];  // GFLOP/s with 1 and 2 threads
std::unique_ptr<ThreadPool> g_pool[3];

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Four sequential streams at once (the range's quarters), as `deepinfer bench` measures: one
// stream per thread understates what the kernels reach on some CPUs (src/bench/membw.cpp).
uint64_t read_range(const uint8_t* p, size_t n) {
  const size_t words = n / 8 / 4;
  const uint64_t* q[4];
  for (int s = 0; s < 4; ++s) q[s] = reinterpret_cast<const uint64_t*>(p) + s * words;
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (size_t i = 0; i < words; ++i) a ^= q[0][i], b ^= q[1][i], c ^= q[2][i], d ^= q[3][i];
  return a ^ b ^ c ^ d;
}

double measure_bandwidth(ThreadPool& pool) {
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    std::atomic<uint64_t> sink{0};
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(int64_t(kArena), 1 << 20, [&](int64_t b, int64_t e, int) { sink ^= read_range(g_arena + b, size_t(e - b)); });
    best = std::max(best, double(kArena) / seconds_since(t0) / 1e9);
    benchmark::DoNotOptimize(sink.load());
  }
  return best;
}

// 16 independent chains, fully unrolled so that they stay in registers (a plain loop over the
// array kept it on the stack: a load-op-store chain that measured 2.5x below oneDNN's bf16 peak).
__attribute__((target("avx512f,avx512bf16"))) double bf16_peak_thread(int64_t iters) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(float(i));
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  float s = 0;
  for (int i = 0; i < 16; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}

__attribute__((target("avx512f,fma"))) double fp32_peak_thread(int64_t iters) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(float(i));
  const __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-9f);
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  float s = 0;
  for (int i = 0; i < 16; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}

// GFLOP/s of `flops_per_iter * iters` per thread, best of 3.
template <class F>
double measure_peak(ThreadPool& pool, double flops_per_iter, F f) {
  const int64_t iters = 20'000'000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::atomic<double> sink{0};
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(pool.size(), 1, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) sink = sink + f(iters);
    });
    best = std::max(best, flops_per_iter * double(iters) * pool.size() / seconds_since(t0) / 1e9);
  }
  return best;
}

void init_globals() {
  g_arena = static_cast<uint8_t*>(std::aligned_alloc(64, kArena));
  g_packed_arena = static_cast<uint8_t*>(std::aligned_alloc(64, kPackedArena));
  g_bf16_arena = static_cast<uint16_t*>(std::aligned_alloc(64, kBf16Arena));
  {
    std::mt19937_64 g(2);  // sign, mantissa and an exponent in [2^-2, 2^1]: no denormals or NaNs
    for (size_t i = 0; i < kBf16Arena / 2; i += 4) {
      const uint64_t v = g();
      for (size_t b = 0; b < 4; ++b) g_bf16_arena[i + b] = uint16_t(((v >> (16 * b)) & 0x81ff) | 0x3e00);
    }
  }
  std::mt19937_64 g(1);
  for (size_t i = 0; i < kArena; i += 8) {
    uint64_t v = g();
    // Realistic codes: no E4M3 NaN (0x7f / 0xff) and no E8M0 NaN (0xff) anywhere.
    for (int b = 0; b < 8; ++b) {
      uint8_t c = uint8_t(v >> (8 * b));
      if ((c & 0x7f) == 0x7f) c = uint8_t(c - 1);
      g_arena[i + size_t(b)] = c;
    }
  }
  for (int t = 1; t <= 2; ++t) {
    g_pool[t] = std::make_unique<ThreadPool>(t);
    g_bw[t] = measure_bandwidth(*g_pool[t]);
    const bool bf16 = kern::isa_supported(kern::Isa::Avx512);
    g_bf16_peak[t] = bf16 ? measure_peak(*g_pool[t], 16.0 * 64, bf16_peak_thread) : 0;
    g_fp32_peak[t] = bf16 ? measure_peak(*g_pool[t], 16.0 * 32, fp32_peak_thread) : 0;
    std::printf("threads %d: read bandwidth %.1f GB/s, bf16 dot peak %.0f GFLOP/s, fp32 FMA peak %.0f GFLOP/s\n", t,
                g_bw[t], g_bf16_peak[t], g_fp32_peak[t]);
  }
  std::printf("kernel path: %s\n", kern::isa_name(kern::active_isa()));
}

// Scale codes near 2^0 so the outputs stay finite.
uint8_t* scales_region(size_t bytes) {
  static std::vector<uint8_t> s;
  if (s.size() < bytes) {
    s.resize(bytes);
    for (size_t i = 0; i < bytes; ++i) s[i] = uint8_t(120 + i % 8);
  }
  return s.data();
}

std::vector<float> activations(int64_t n) {
  std::mt19937 g(3);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = round_bf16(nd(g));
  return x;
}


// Fp8Bf16Packed: the fast numerics' wo_a (bf16 activations, no activation quantization).
enum class Kind { Fp8, Fp4, Fp8Packed, Fp4Packed, Logits, Fp8Dequant, Fp8Bf16Packed };
constexpr bool is_fp4(Kind k) { return k == Kind::Fp4 || k == Kind::Fp4Packed; }
constexpr bool is_packed(Kind k) { return k == Kind::Fp8Packed || k == Kind::Fp4Packed || k == Kind::Fp8Bf16Packed; }

template <Kind kind>
void BM_linear(benchmark::State& state) {
  const int64_t m = state.range(0), N = state.range(1), K = state.range(2);
  const int threads = int(state.range(3));
  constexpr bool fp4 = is_fp4(kind);
  const size_t wbytes = size_t(kind == Kind::Logits ? N * K * 2 : fp4 ? N * K / 2 : N * K);
  const size_t sbytes = size_t(kind == Kind::Logits ? 0 : fp4 ? N * (K / 32) : ((N + 31) / 32) * (K / 32));
  const uint8_t* sc = scales_region(sbytes);
  const auto x = activations(m * K);
  std::vector<float> y(static_cast<size_t>(m * N));
  size_t slots = std::getenv("BENCH_HOT") ? 1 : std::max<size_t>(1, (kind == Kind::Logits ? kBf16Arena : kArena) / wbytes);
  size_t packed_stride = 0;
  if constexpr (is_packed(kind)) {
    const ref::Fp8Weight probe8{g_arena, sc, N, K};
    const ref::Fp4Weight probe4{g_arena, sc, N, K};
    const size_t pb = fp4 ? kern::packed_bytes(probe4) : kern::packed_bytes(probe8);
    if (pb == 0) {
      state.SkipWithError("no repacked layout on this kernel path");
      return;
    }
    packed_stride = (pb + 63) / 64 * 64;
    slots = std::min(slots, std::max<size_t>(1, kPackedArena / packed_stride));
    for (size_t i = 0; i < slots; ++i) {  // untimed
      if constexpr (fp4) {
        ref::Fp4Weight w4{g_arena + i * wbytes, sc, N, K};
        kern::pack_weight(w4, g_packed_arena + i * packed_stride, g_pool[2].get());
      } else {
        ref::Fp8Weight w8{g_arena + i * wbytes, sc, N, K};
        kern::pack_weight(w8, g_packed_arena + i * packed_stride, g_pool[2].get());
      }
    }
  }
  size_t slot = 0;
  ThreadPool* pool = g_pool[threads].get();
  const int64_t settled0 = kern::detail::certified_outputs.load(), handed0 = kern::detail::certified_fallbacks.load();
  for (auto _ : state) {
    const size_t i = slot++ % slots;  // a fresh slice every iteration
    const uint8_t* w = g_arena + i * wbytes;
    const uint8_t* packed = is_packed(kind) ? g_packed_arena + i * packed_stride : nullptr;
    const int layout = packed ? int(kern::active_isa()) : 0;
    switch (kind) {
      case Kind::Fp8: case Kind::Fp8Packed: kern::linear_fp8(x.data(), m, {w, sc, N, K, packed, layout}, y.data(), pool); break;
      case Kind::Fp4: case Kind::Fp4Packed: kern::linear_fp4(x.data(), m, {w, sc, N, K, packed, layout}, y.data(), pool); break;
      case Kind::Fp8Dequant: kern::linear_fp8_dequant(x.data(), m, {w, sc, N, K}, y.data(), pool); break;
      case Kind::Fp8Bf16Packed: kern::fast::linear_fp8_bf16(x.data(), m, {w, sc, N, K, packed, layout}, y.data(), pool); break;
      case Kind::Logits: kern::linear_bf16_logits(x.data(), m, {g_bf16_arena + i * size_t(N * K), N, K}, y.data(), pool); break;
    }
    benchmark::ClobberMemory();
  }
  if (kind == Kind::Fp8Dequant) {  // share of outputs the certified fp32 path handed to fp64
    const int64_t settled = kern::detail::certified_outputs.load() - settled0,
                  handed = kern::detail::certified_fallbacks.load() - handed0;
    if (settled + handed > 0) state.counters["to_fp64"] = double(handed) / double(settled + handed);
  }
  const double bytes = double(wbytes + sbytes);
  const double flops = 2.0 * double(m) * double(N) * double(K);
  state.counters["wGB/s"] = benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  // Fraction of the roofline: memory for decode, the bf16 dot peak for prefill.
  if (m <= 8) {
    state.counters["of_bw"] = benchmark::Counter(bytes / (g_bw[threads] * 1e9), benchmark::Counter::kIsIterationInvariantRate);
  } else if (g_bf16_peak[threads] > 0) {
    state.counters["of_bf16_peak"] =
        benchmark::Counter(flops / (g_bf16_peak[threads] * 1e9), benchmark::Counter::kIsIterationInvariantRate);
    state.counters["of_fp32_peak"] =
        benchmark::Counter(flops / (g_fp32_peak[threads] * 1e9), benchmark::Counter::kIsIterationInvariantRate);
  }
  state.SetLabel(kern::isa_name(kern::active_isa()));
}

void decode_shapes(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2})
    for (auto [n, k] : {std::pair{2304, 5120}, {5120, 2304}, {32768, 1280}, {512, 5120}}) {
      b->Args({1, n, k, threads});
      if (threads == 2) b->Args({8, n, k, threads});
    }
}
void prefill_shapes(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) b->Args({512, 2304, 5120, threads});
  b->Args({512, 5120, 2304, 2});
  b->Args({512, 512, 2048, 2});
}

// The head (vocab x dim) and wo_a (one output group: 512 rows over 2048 inputs) of the medium
// model, at decode (m = 1, 8) and prefill (m = 512).
void head_shapes(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) b->Args({1, 129280, 2048, threads});
  b->Args({8, 129280, 2048, 2});
}
void wo_a_shapes(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) b->Args({1, 512, 2048, threads});
  b->Args({8, 512, 2048, 2});
  b->Args({512, 512, 2048, 2});
}

// One query row's sparse attention (one thread): heads x rows of bf16-valued q and kv (d = 512),
// the fast or exact numerics' kernel. FLOPs: scores and P.V, 4 x heads x rows x d.
void BM_sparse_attention(benchmark::State& state) {
  const int H = int(state.range(0)), d = 512;
  const int64_t n = state.range(1);
  const bool fast = state.range(2) != 0;
  std::mt19937 g(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(static_cast<size_t>(H) * d), kv(static_cast<size_t>(n) * d), sink(static_cast<size_t>(H)),
      out(static_cast<size_t>(H) * d);
  for (auto& v : q) v = round_bf16(nd(g));
  for (auto& v : kv) v = round_bf16(nd(g));
  for (auto& v : sink) v = nd(g);
  std::vector<const float*> rows(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) rows[size_t(j)] = kv.data() + size_t(j) * d;
  const float scale = 1.f / std::sqrt(float(d));
  for (auto _ : state) {
    if (fast) kern::fast::sparse_attention(q.data(), H, d, rows.data(), n, sink.data(), scale, out.data());
    else kern::sparse_attention(q.data(), H, d, rows.data(), n, sink.data(), scale, out.data());
    benchmark::ClobberMemory();
  }
  const double flops = 4.0 * H * double(n) * d;
  state.counters["GFLOP/s"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  if (g_bf16_peak[1] > 0)
    state.counters["of_bf16_peak"] = benchmark::Counter(flops / (g_bf16_peak[1] * 1e9), benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(kern::isa_name(kern::active_isa())) + (fast ? " fast" : " exact"));
}

}  // namespace

BENCHMARK(BM_linear<Kind::Fp8>)->Name("linear_fp8")->Apply(decode_shapes)->UseRealTime()->MinTime(0.5);
BENCHMARK(BM_linear<Kind::Fp8Packed>)->Name("linear_fp8_packed")->Apply(decode_shapes)->UseRealTime()->MinTime(0.5);
BENCHMARK(BM_linear<Kind::Fp4>)->Name("linear_fp4")->Apply(decode_shapes)->UseRealTime()->MinTime(0.5);
BENCHMARK(BM_linear<Kind::Fp4Packed>)->Name("linear_fp4_packed")->Apply(decode_shapes)->UseRealTime()->MinTime(0.5);
BENCHMARK(BM_linear<Kind::Fp8>)->Name("linear_fp8")->Apply(prefill_shapes)->UseRealTime()->Iterations(2);
BENCHMARK(BM_linear<Kind::Fp8Packed>)->Name("linear_fp8_packed")->Apply(prefill_shapes)->UseRealTime()->Iterations(2);
BENCHMARK(BM_linear<Kind::Fp4>)->Name("linear_fp4")->Apply(prefill_shapes)->UseRealTime()->Iterations(2);
BENCHMARK(BM_linear<Kind::Fp4Packed>)->Name("linear_fp4_packed")->Apply(prefill_shapes)->UseRealTime()->Iterations(2);
BENCHMARK(BM_linear<Kind::Logits>)->Name("linear_bf16_logits")->Apply(head_shapes)->UseRealTime()->MinTime(0.5);
BENCHMARK(BM_linear<Kind::Fp8Dequant>)->Name("linear_fp8_dequant")->Apply(wo_a_shapes)->UseRealTime()->MinTime(0.5);
BENCHMARK(BM_linear<Kind::Fp8Bf16Packed>)->Name("linear_fp8_bf16_packed")->Apply(wo_a_shapes)->UseRealTime()->MinTime(0.5);
BENCHMARK(BM_sparse_attention)->Name("sparse_attention")->ArgsProduct({{8, 16, 64}, {128, 384, 640}, {1, 0}})->MinTime(0.3);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  init_globals();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
