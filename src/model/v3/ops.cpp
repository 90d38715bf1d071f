#include "model/v3/ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtypes.h"
#include "core/thread_pool.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/ref_ops.h"

namespace di::v3 {

namespace detail {
void dequant_fp8_rows_avx512(const Linear& w, int64_t r0, int64_t rows, bool round, float* out);
float dot_fma_lanes_avx512(const float* a, const float* b, int64_t K);
void linear_fp8_fast_avx512(const float* x, int64_t m, const Linear& w, float* y, int64_t n0, int64_t n1, bool round);
void bf16_bits_avx512(const float* x, int64_t n, uint16_t* out);
}

const char* mode_name(Mode m) { return m == Mode::Fast ? "fast" : m == Mode::Exact ? "exact" : "fp32"; }

void dequant_rows(const Linear& w, int64_t r0, int64_t rows, bool round, float* out) {
  if (w.fp8 && kern::active_isa() == kern::Isa::Avx512) return detail::dequant_fp8_rows_avx512(w, r0, rows, round, out);
  dequant_rows_scalar(w, r0, rows, round, out);
}

void dequant_rows_scalar(const Linear& w, int64_t r0, int64_t rows, bool round, float* out) {
  const int64_t K = w.in;
  if (!w.fp8) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k) out[r * K + k] = bf16_to_f32(w.bf16[(r0 + r) * K + k]);
    return;
  }
  const int64_t sc = w.scale_cols();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = r0 + r;
    const uint8_t* codes = w.fp8 + n * K;
    const float* srow = w.scale + (n / w.bo) * sc;
    float* o = out + r * K;
    for (int64_t kb = 0; kb < sc; ++kb) {
      const float s = srow[kb];
      const int64_t k1 = std::min(K, (kb + 1) * w.bi);
      if (round)
        for (int64_t k = kb * w.bi; k < k1; ++k) o[k] = round_bf16(e4m3_to_f32(codes[k]) * s);
      else
        for (int64_t k = kb * w.bi; k < k1; ++k) o[k] = e4m3_to_f32(codes[k]) * s;
    }
  }
}

namespace {

constexpr int64_t kTile = 16;  // output rows per task (and dequantized at a time)

// Few rows (decode) in the fast mode go straight from the codes, no dequantized tile.
bool direct_fp8(Mode mode, int64_t m, const Linear& w) {
  if (mode != Mode::Fast || m > 8 || !w.fp8 || w.bi % 32 != 0 || kern::active_isa() != kern::Isa::Avx512) return false;
  for (int64_t i = 0, n = ((w.out + w.bo - 1) / w.bo) * w.scale_cols(); i < n; ++i)
    if (!(w.scale[i] < 0x1p120f)) return false;
  return true;
}

// Outputs [t0 * kTile, min(N, t1 * kTile)) of y[m][N] on the calling thread.
void linear_tiles(Mode mode, const float* x, int64_t m, const Linear& w, float* y, int64_t t0, int64_t t1, bool direct) {
  const int64_t K = w.in, N = w.out;
  const int64_t n0 = t0 * kTile, n1 = std::min(N, t1 * kTile);
  if (n0 >= n1) return;
  const bool round = mode != Mode::Fp32;
  if (!w.fp8 && mode != Mode::Fp32) {
    thread_local std::vector<float> yt;
    yt.resize(size_t(m * (n1 - n0)));
    const ref::Bf16Weight bw{w.bf16 + n0 * K, n1 - n0, K};
    if (mode == Mode::Fast) kern::fast::linear_bf16(x, m, bw, yt.data(), true, nullptr);
    else kern::linear_bf16(x, m, bw, yt.data(), true, nullptr);
    for (int64_t i = 0; i < m; ++i)
      std::copy(yt.begin() + i * (n1 - n0), yt.begin() + (i + 1) * (n1 - n0), y + i * N + n0);
    return;
  }
  if (direct) return detail::linear_fp8_fast_avx512(x, m, w, y, n0, n1, round);
  if (mode == Mode::Fast) {
    // bf16 weights bf16(code x scale) in blocks of up to 64 rows, through the bf16 linear (pair lanes).
    constexpr int64_t kRows = 64;
    thread_local std::vector<float> tf, yb;
    thread_local std::vector<uint16_t> tb;
    tf.resize(size_t(kRows * K));
    tb.resize(size_t(kRows * K));
    yb.resize(size_t(m * kRows));
    for (int64_t r0 = n0; r0 < n1; r0 += kRows) {
      const int64_t rows = std::min(kRows, n1 - r0);
      dequant_rows(w, r0, rows, true, tf.data());
      if (kern::active_isa() == kern::Isa::Avx512) detail::bf16_bits_avx512(tf.data(), rows * K, tb.data());
      else
        for (int64_t i = 0; i < rows * K; ++i) tb[size_t(i)] = f32_to_bf16(tf[size_t(i)]);
      kern::fast::linear_bf16(x, m, ref::Bf16Weight{tb.data(), rows, K}, yb.data(), true, nullptr);
      for (int64_t i = 0; i < m; ++i) std::copy(yb.begin() + i * rows, yb.begin() + (i + 1) * rows, y + i * N + r0);
    }
    return;
  }
  thread_local std::vector<float> tile, yt;
  tile.resize(size_t(kTile * K));
  yt.resize(size_t(m * kTile));
  for (int64_t r0 = n0; r0 < n1; r0 += kTile) {
    const int64_t rows = std::min(kTile, n1 - r0);
    dequant_rows(w, r0, rows, round, tile.data());
    const ref::F32Weight fw{tile.data(), rows, K};
    // Inside a pool job the kernels run single-threaded on this thread.
    kern::linear_f32(x, m, fw, yt.data(), nullptr);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t r = 0; r < rows; ++r) {
        const float v = yt[size_t(i * rows + r)];
        y[i * N + r0 + r] = round ? round_bf16(v) : v;
      }
  }
}

}  // namespace

void linear(Mode mode, const float* x, int64_t m, const Linear& w, float* y, ThreadPool* pool) {
  if (m <= 0 || w.out <= 0) return;
  if (!pool) pool = kern::default_pool();
  const int64_t K = w.in, N = w.out;
  if (!w.fp8 && mode != Mode::Fp32) {
    const ref::Bf16Weight bw{w.bf16, N, K};
    if (mode == Mode::Fast) kern::fast::linear_bf16(x, m, bw, y, true, pool);
    else kern::linear_bf16(x, m, bw, y, true, pool);
    return;
  }
  const LinearJob job{x, m, &w, y};
  linear_multi(mode, std::span<const LinearJob>(&job, 1), pool);
}

void linear_multi(Mode mode, std::span<const LinearJob> jobs, ThreadPool* pool) {
  if (!pool) pool = kern::default_pool();
  // Task t of job j: output tile t - first[j].
  thread_local std::vector<int64_t> first;
  thread_local std::vector<uint8_t> direct;
  first.assign(jobs.size() + 1, 0);
  direct.assign(jobs.size(), 0);
  for (size_t j = 0; j < jobs.size(); ++j) {
    const int64_t tiles = jobs[j].m > 0 ? (jobs[j].w->out + kTile - 1) / kTile : 0;
    first[j + 1] = first[j] + tiles;
    direct[j] = direct_fp8(mode, jobs[j].m, *jobs[j].w);
  }
  const int64_t total = first.back();
  if (total == 0) return;
  const int64_t* f = first.data();
  const uint8_t* d = direct.data();
  auto run = [&](int64_t b, int64_t e, int) {
    size_t j = size_t(std::upper_bound(f, f + jobs.size() + 1, b) - f - 1);
    while (b < e) {
      const int64_t end = std::min(e, f[j + 1]);
      const LinearJob& jb = jobs[j];
      linear_tiles(mode, jb.x, jb.m, *jb.w, jb.y, b - f[j], end - f[j], d[j]);
      b = end;
      ++j;
    }
  };
  if (pool && pool->size() > 1 && total > 1) pool->parallel_for(total, 1, run);
  else run(0, total, 0);
}

void quantize_fp8_blocks(const uint16_t* w, int64_t out, int64_t in, uint8_t* codes, float* scales, ThreadPool* pool) {
  const int64_t so = (out + 127) / 128, si = (in + 127) / 128;
  auto run = [&](int64_t b0, int64_t b1, int) {
    for (int64_t bo = b0; bo < b1; ++bo) {
      const int64_t r0 = bo * 128, r1 = std::min(out, r0 + 128);
      for (int64_t bi = 0; bi < si; ++bi) {
        const int64_t k0 = bi * 128, k1 = std::min(in, k0 + 128);
        float amax = 0;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(bf16_to_f32(w[r * in + k])));
        const float s = amax > 0 ? amax / 448.0f : 1.0f;
        scales[bo * si + bi] = s;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t k = k0; k < k1; ++k) codes[r * in + k] = f32_to_e4m3(bf16_to_f32(w[r * in + k]) / s);
      }
    }
  };
  if (pool && pool->size() > 1) pool->parallel_for(so, 1, run);
  else run(0, so, 0);
}

float dot(Mode mode, const float* a, const float* b, int64_t n) {
  if (mode == Mode::Fast)
    return kern::active_isa() == kern::Isa::Avx512 ? detail::dot_fma_lanes_avx512(a, b, n) : ref::fast::dot_fma_lanes(a, b, n);
  double acc = 0;
  for (int64_t k = 0; k < n; ++k) acc += double(a[k]) * double(b[k]);
  return float(acc);
}

void rms_norm(Mode mode, const float* x, const uint16_t* weight, int64_t n, float eps, float* y) {
  switch (mode) {
    case Mode::Fast: return kern::fast::rms_norm(x, weight, n, eps, y);
    case Mode::Exact: return ref::rms_norm(x, weight, n, eps, y);
    case Mode::Fp32: {
      const float r = ref::rms_scale(x, n, eps);
      for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_f32(weight[i]) * (x[i] * r);
      return;
    }
  }
}

void rope(float* x, int64_t n, const float* cs, bool round) {
  for (int64_t i = 0; i < n / 2; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
    const float ac = a * c, bs = b * s, as = a * s, bc = b * c;
    const float u = ac - bs, v = as + bc;
    x[2 * i] = round ? round_bf16(u) : u;
    x[2 * i + 1] = round ? round_bf16(v) : v;
  }
}

}  // namespace di::v3
