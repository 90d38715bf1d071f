// Kernels of DeepSeek-V3's absorbed MLA attention (src/model/v3): one query's attention over the
// latent cache rows. Each has a scalar definition (ref_*) whose bits every ISA path reproduces
// (tests/test_mla_kernels.cpp).
#pragma once

#include <cstdint>

namespace di::kern::mla {

// P.V over the latent: o[c] = sum over t ascending of p[t] * rows[t][c], each product rounded to
// fp32, then added to the fp32 sum (no fused multiply-add), starting from 0; c < width.
void pv_f32(const float* p, const float* const* rows, int64_t n, int64_t width, float* o);
void ref_pv_f32(const float* p, const float* const* rows, int64_t n, int64_t width, float* o);

// The same in fp64: o[c] = sum over t of double(p[t]) * double(rows[t][c]) (exact products, fp64 sums
// in t order), returned in fp64.
void pv_f64(const float* p, const float* const* rows, int64_t n, int64_t width, double* o);
void ref_pv_f64(const float* p, const float* const* rows, int64_t n, int64_t width, double* o);

// N dot products against the columns of a row-major [K][ldw] matrix: y[j] = sum over k of x[k] *
// w[k * ldw + j], each in the fast mode's fma-lane order (ref::fast::dot_fma_lanes: lane k mod 16,
// fused multiply-adds in k order, then the halving tree). The absorbed MLA's q_nope . W_UK and
// o . W_UV^T read their weights this way.
void dot_fma_lanes_cols(const float* x, const float* w, int64_t K, int64_t N, int64_t ldw, float* y);
void ref_dot_fma_lanes_cols(const float* x, const float* w, int64_t K, int64_t N, int64_t ldw, float* y);

// Scores of one query against n cache rows: s[t] = dot(q, rows[t] + offset, K) in the fast mode's
// fma-lane order (ref::fast::dot_fma_lanes), for t < n.
void dot_fma_lanes_rows(const float* q, const float* const* rows, int64_t offset, int64_t K, int64_t n, float* s);
void ref_dot_fma_lanes_rows(const float* q, const float* const* rows, int64_t offset, int64_t K, int64_t n, float* s);

}  // namespace di::kern::mla
