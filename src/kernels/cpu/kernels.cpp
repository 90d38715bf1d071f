#include "kernels/cpu/kernels.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace di::kern {

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
  }
  return "?";
}

Isa best_isa() { return Isa::Scalar; }

namespace {
Isa& current() {
  static Isa isa = [] {
    if (const char* e = std::getenv("DEEPINFER_ISA"); e && *e) {
      const std::string s(e);
      if (s == "scalar") return Isa::Scalar;
      throw std::invalid_argument("DEEPINFER_ISA=" + s + ": not available on this build/CPU");
    }
    return best_isa();
  }();
  return isa;
}
}  // namespace

Isa active_isa() { return current(); }
void set_isa(Isa i) {
  if (i != Isa::Scalar) throw std::invalid_argument(std::string("ISA ") + isa_name(i) + " is not available");
  current() = i;
}

void linear_fp8(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool*) { ref::linear_fp8(x, m, w, y); }
void linear_fp4(const float* x, int64_t m, const ref::Fp4Weight& w, float* y, ThreadPool*) { ref::linear_fp4(x, m, w, y); }
void linear_bf16(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out, ThreadPool*) {
  ref::linear_bf16(x, m, w, y, round_out);
}
void linear_f32(const float* x, int64_t m, const ref::F32Weight& w, float* y, ThreadPool*) { ref::linear_f32(x, m, w, y); }
void linear_fp8_dequant(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool*) {
  ref::linear_fp8_dequant(x, m, w, y);
}
void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                      const float* attn_sink, float softmax_scale, float* out) {
  ref::sparse_attention(q, n_heads, d, kv_rows, n_rows, attn_sink, softmax_scale, out);
}

}  // namespace di::kern
