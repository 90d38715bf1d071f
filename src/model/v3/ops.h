// The V3 forward pass's numerics: projections whose FP8 E4M3 weights carry one fp32 scale per
// 128x128 block (weight_scale_inv), dequantized tile by tile inside the kernel (the weights stay
// FP8 in memory), and the sums of the three numerics modes.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>

#include "core/numerics.h"

namespace di {
class ThreadPool;
}

namespace di::v3 {

// Fast / Exact: the official bf16 run's rounding points (weights bf16(code x scale), every op's
// output rounded to bf16), with fp32 sums in one fixed order (Fast) or exact fp64 sums rounded
// once (Exact). Fp32: the official fp32 run (weights code x scale in fp32, nothing rounded to
// bf16), with fp64 sums. All three are deterministic and batch-invariant: a row's result depends
// on that row alone.
enum class Mode { Fast, Exact, Fp32 };
const char* mode_name(Mode);
inline Mode mode_of(Numerics n) { return n == Numerics::Exact ? Mode::Exact : Mode::Fast; }

// One projection [out, in]: FP8 codes + fp32 block scales [ceil(out/bo), ceil(in/bi)] (partial
// blocks at the edges), or plain BF16.
struct Linear {
  const uint8_t* fp8 = nullptr;
  const float* scale = nullptr;
  const uint16_t* bf16 = nullptr;
  int64_t out = 0, in = 0;
  int bo = 128, bi = 128;
  int64_t scale_cols() const { return (in + bi - 1) / bi; }
  bool valid() const { return (fp8 && scale) || bf16; }
};

// Rows [r0, r0 + rows) of W as fp32 [rows][in]: code x scale in fp32, then rounded to bf16 when
// `round` (the official weight_dequant cast to bf16); BF16 weights widened exactly.
// On AVX-512 machines (kern::active_isa()) FP8 rows are converted 16 at a time, with the same bits
// as the scalar definition dequant_rows_scalar (NaN codes aside, which no checkpoint holds).
void dequant_rows(const Linear& w, int64_t r0, int64_t rows, bool round, float* out);
void dequant_rows_scalar(const Linear& w, int64_t r0, int64_t rows, bool round, float* out);

// y[m][out] = x[m][in] . W^T in the mode's sums; bf16 output except in Fp32. Fast: FP8 and BF16
// weights alike, each output summed in fp32 in the kernels' pair-lane order (x and the weights
// bf16(code x scale) as bf16 pairs, vdpbf16ps; ref::fast::dot_pair_lanes, kern::fast::linear_bf16).
// `pool` (null: kern::default_pool()) splits the outputs.
void linear(Mode mode, const float* x, int64_t m, const Linear& w, float* y, ThreadPool* pool = nullptr);
// Several FP8 (or Fp32-mode) linears in one pool job, each output tile a task: y = x . W^T per
// job, the same bits as linear() on each. Jobs with m = 0 are skipped.
struct LinearJob {
  const float* x;
  int64_t m;
  const Linear* w;
  float* y;
};
void linear_multi(Mode mode, std::span<const LinearJob> jobs, ThreadPool* pool = nullptr);

// BF16 [out, in] -> FP8 E4M3 codes + one fp32 scale per 128x128 block (partial at the edges):
// scale = absmax / 448 (1 for an all-zero block), code = e4m3(w / scale), as the release quantizes.
void quantize_fp8_blocks(const uint16_t* w, int64_t out, int64_t in, uint8_t* codes, float* scales, ThreadPool* pool);

// a . b in the mode's sums (Fast: fma lanes; else fp64), not rounded to bf16.
float dot(Mode mode, const float* a, const float* b, int64_t n);

// RMSNorm with a bf16 weight: w * (x * rsqrt(mean(x^2) + eps)) in fp32, rounded to bf16 except in
// Fp32 (the sum of squares in the mode's sums).
void rms_norm(Mode mode, const float* x, const uint16_t* weight, int64_t n, float eps, float* y);

// Interleaved-pair RoPE on n values: (a, b) -> (a c - b s, a s + b c), fp32 products, rounded to
// bf16 unless `round` is false. cs: [n/2][cos, sin].
void rope(float* x, int64_t n, const float* cs, bool round);

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace di::v3
