#include "kernels/cpu/mla.h"

#include <vector>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/ref_ops.h"

namespace di::kern::mla {

namespace detail {
void pv_f32_avx512(const float* p, const float* const* rows, int64_t n, int64_t width, float* o);
void pv_f64_avx512(const float* p, const float* const* rows, int64_t n, int64_t width, double* o);
void dot_fma_lanes_cols_avx512(const float* x, const float* w, int64_t K, int64_t N, int64_t ldw, float* y);
void dot_fma_lanes_rows_avx512(const float* q, const float* const* rows, int64_t offset, int64_t K, int64_t n, float* s);
}  // namespace detail

void ref_pv_f32(const float* p, const float* const* rows, int64_t n, int64_t width, float* o) {
  for (int64_t c = 0; c < width; ++c) o[c] = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    const float pt = p[t], *row = rows[t];
    for (int64_t c = 0; c < width; ++c) {
      const float prod = pt * row[c];
      o[c] = o[c] + prod;
    }
  }
}

void ref_pv_f64(const float* p, const float* const* rows, int64_t n, int64_t width, double* o) {
  for (int64_t c = 0; c < width; ++c) o[c] = 0.0;
  for (int64_t t = 0; t < n; ++t) {
    const double pt = p[t];
    const float* row = rows[t];
    for (int64_t c = 0; c < width; ++c) o[c] += pt * double(row[c]);
  }
}

void pv_f32(const float* p, const float* const* rows, int64_t n, int64_t width, float* o) {
  if (active_isa() == Isa::Avx512) return detail::pv_f32_avx512(p, rows, n, width, o);
  ref_pv_f32(p, rows, n, width, o);
}

void pv_f64(const float* p, const float* const* rows, int64_t n, int64_t width, double* o) {
  if (active_isa() == Isa::Avx512) return detail::pv_f64_avx512(p, rows, n, width, o);
  ref_pv_f64(p, rows, n, width, o);
}

void ref_dot_fma_lanes_cols(const float* x, const float* w, int64_t K, int64_t N, int64_t ldw, float* y) {
  std::vector<float> col(static_cast<size_t>(K));
  for (int64_t j = 0; j < N; ++j) {
    for (int64_t k = 0; k < K; ++k) col[size_t(k)] = w[k * ldw + j];
    y[j] = ref::fast::dot_fma_lanes(x, col.data(), K);
  }
}

void dot_fma_lanes_cols(const float* x, const float* w, int64_t K, int64_t N, int64_t ldw, float* y) {
  if (active_isa() == Isa::Avx512) return detail::dot_fma_lanes_cols_avx512(x, w, K, N, ldw, y);
  ref_dot_fma_lanes_cols(x, w, K, N, ldw, y);
}

void ref_dot_fma_lanes_rows(const float* q, const float* const* rows, int64_t offset, int64_t K, int64_t n, float* s) {
  for (int64_t t = 0; t < n; ++t) s[t] = ref::fast::dot_fma_lanes(q, rows[t] + offset, K);
}

void dot_fma_lanes_rows(const float* q, const float* const* rows, int64_t offset, int64_t K, int64_t n, float* s) {
  if (active_isa() == Isa::Avx512) return detail::dot_fma_lanes_rows_avx512(q, rows, offset, K, n, s);
  ref_dot_fma_lanes_rows(q, rows, offset, K, n, s);
}

}  // namespace di::kern::mla
