#include "kernels/cpu/mla.h"

#include "kernels/cpu/kernels.h"

namespace di::kern::mla {

namespace detail {
void pv_f32_avx512(const float* p, const float* const* rows, int64_t n, int64_t width, float* o);
void pv_f64_avx512(const float* p, const float* const* rows, int64_t n, int64_t width, double* o);
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

}  // namespace di::kern::mla
