// The machine's matmul throughput as a tuned library reaches it: oneDNN matmul with bf16 inputs
// and fp32 accumulation/output, and all-fp32, on M x K x N shapes of the model's linears. Weights
// take oneDNN's preferred (pre-packed) layout, reordered once outside the timing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/stats.h"

namespace di::bench {

struct MatmulShape {
  int64_t m = 512, k = 0, n = 0;
  std::string name;  // which linear it stands for
};

struct MatmulResult {
  MatmulShape shape;
  std::string dtype;  // "bf16" (bf16 x bf16 -> f32) or "f32"
  Summary gflops;     // GFLOP/s, 2*M*K*N per run
};

struct MatmulPeak {
  int threads = 0;
  std::string dnnl_isa;  // what oneDNN dispatched to (e.g. avx512_core_bf16)
  std::string dnnl_version;
  std::vector<MatmulResult> results;
  double bf16_gflops = 0, f32_gflops = 0;  // best median over the shapes (bf16: 0 where unsupported)
  // oneDNN has no bf16 matmul on CPUs without AVX512_BF16/AMX/AVX-NE-CONVERT support in its build
  // (e.g. AVX2-only Zen 2); then only f32 is timed and bf16_unsupported says why.
  bool bf16_supported = false;
  std::string bf16_unsupported;
  // The compute peak a roofline uses: bf16 where the machine has it, else f32 (the kernels then
  // compute in fp32 too).
  double peak_gflops() const { return bf16_supported ? bf16_gflops : f32_gflops; }
  const char* peak_dtype() const { return bf16_supported ? "bf16" : "f32"; }
};

// Times every shape in both dtypes (bf16 only where oneDNN supports it): `reps` samples, each at least `min_seconds` of back-to-back runs.
MatmulPeak measure_matmul_peak(const std::vector<MatmulShape>& shapes, int threads, int reps = 5,
                               double min_seconds = 0.2);

}  // namespace di::bench
