// Per-ISA entry points behind the dispatch in kernels.cpp. Each ISA lives in its own file, compiled
// for that ISA with `#pragma GCC target` placed after all includes, so that no inline function of a
// shared header is emitted with wider instructions than the baseline (the linker could otherwise
// keep that copy for the whole program).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/ref_ops.h"

namespace di {
class ThreadPool;
}

namespace di::kern::detail {

// ref::Fp8Weight/Fp4Weight::packed_layout of each ISA's repacked layout (= its kern::Isa value).
constexpr int kLayoutAvx2 = 1, kLayoutAvx512 = 2;
// The certified wo_a kernel's layout (AVX-512): per 32-row panel the FP8 panel layout's codes, then
// per K block the largest |E4M3 code| of each of the 32 rows (a tighter product bound than 448).
constexpr int kLayoutAvx512Dequant = 3;

// E8M0 code -> fp32 (2^(code-127); 255 = NaN), a table shared by all ISAs.
const float* e8m0_table();

// Test hook: when set, linear_fp8/fp4 of the AVX2/AVX-512 paths write their fp32 totals without
// the final bf16 rounding, so tests can compare summation orders bit for bit (a wrong order
// rarely changes a bf16 output). Never set outside tests.
extern bool unrounded_quant_output;

// The certified fp32 path of linear_fp8_dequant (AVX-512, bf16-valued x): outputs it
// settled, and outputs it handed to the exact fp64 path (bound too wide). Tests set
// exact_fp8_dequant_only to get the fp64 path's bits for comparison.
extern bool exact_fp8_dequant_only;
extern std::atomic<int64_t> certified_outputs, certified_fallbacks;

// index_scores (AVX-512): keys scored by the integer block path and by the fp64 path; tests set
// index_scores_fp64_only to get the fp64 path's bits for comparison.
extern bool index_scores_fp64_only;
extern std::atomic<int64_t> index_fixed_keys, index_fp64_keys;

// Decode-shaped weight streaming (AVX-512 head and FP8/FP4 at m = 1): each thread reads its
// chunk as several interleaved memory streams. Tests and A/B benchmarks clear it to get one
// stream per thread (the same bits, by construction).
extern bool interleaved_weight_streams;

}  // namespace di::kern::detail

#define DI_KERN_DECLARE_ISA(ns)                                                                                   \
  namespace di::kern::ns {                                                                                        \
  void linear_fp8(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool);               \
  void linear_fp4(const float* x, int64_t m, const ref::Fp4Weight& w, float* y, ThreadPool* pool);               \
  void linear_bf16(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out, ThreadPool* pool); \
  void linear_f32(const float* x, int64_t m, const ref::F32Weight& w, float* y, ThreadPool* pool);               \
  void linear_fp8_dequant(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool);       \
  void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,         \
                        const float* attn_sink, float softmax_scale, float* out);                                \
  }

DI_KERN_DECLARE_ISA(avx512)

namespace di::kern::avx512 {
size_t packed_bytes_fp8(const ref::Fp8Weight& w);
size_t packed_bytes_fp4(const ref::Fp4Weight& w);
void pack_weight_fp8(const ref::Fp8Weight& w, uint8_t* dst, ThreadPool* pool);
void pack_weight_fp4(const ref::Fp4Weight& w, uint8_t* dst, ThreadPool* pool);
int64_t dequant_panel_bytes(const ref::Fp8Weight& w);  // kLayoutAvx512Dequant: bytes per 32-row panel
size_t packed_bytes_fp8_dequant(const ref::Fp8Weight& w);
void pack_weight_fp8_dequant(const ref::Fp8Weight& w, uint8_t* dst, ThreadPool* pool);
void linear_bf16_logits(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, ThreadPool* pool);
void index_scores(const float* q, const float* w, int n_heads, int d, const float* const* keys, int64_t n, float* out);
void hc_collapse(const float* X, const float* pre, int hc, int dim, float* y);
void hc_expand(const float* f, const float* X, const float* post, const float* comb, int hc, int dim, float* Y);
// std::exp of each float, by the attention's vector copy of glibc's expf (for tests).
void expf_batch(const float* x, int64_t n, float* out);
void act_qdq_fp4_e8m0(float* x, int64_t n);  // block 32
void act_qdq_fp8(float* x, int64_t n);        // block 32
void swiglu(float* g, const float* u, int64_t m, int64_t n, float limit, const float* weight);
int64_t fp8_panel_bytes(const ref::Fp8Weight& w);  // kLayoutAvx512: bytes per 32-row panel
// Fast numerics (contracts: ref::fast::linear_fp8_bf16, ref::fast::linear_bf16).
void linear_fp8_bf16(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool);
void linear_bf16_fast(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out, ThreadPool* pool);
// ref::fast::sparse_attention, d % 32 == 0; the _bf16 variant takes the rows as bf16.
void sparse_attention_fast(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                           const float* attn_sink, float softmax_scale, float* out);
void sparse_attention_fast_bf16(const float* q, int n_heads, int d, const uint16_t* const* kv_rows, int64_t n_rows,
                                const float* attn_sink, float softmax_scale, float* out);
}  // namespace di::kern::avx512
DI_KERN_DECLARE_ISA(avx2)

namespace di::kern::avx2 {
size_t packed_bytes_fp8(const ref::Fp8Weight& w);  // 0: not repacked (K % 32 != 0, or E4M3 NaN codes)
size_t packed_bytes_fp4(const ref::Fp4Weight& w);
void pack_weight_fp8(const ref::Fp8Weight& w, uint8_t* dst, ThreadPool* pool);
void pack_weight_fp4(const ref::Fp4Weight& w, uint8_t* dst, ThreadPool* pool);
void linear_bf16_logits(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, ThreadPool* pool);
void hc_collapse(const float* X, const float* pre, int hc, int dim, float* y);
void hc_expand(const float* f, const float* X, const float* post, const float* comb, int hc, int dim, float* Y);
void index_scores(const float* q, const float* w, int n_heads, int d, const float* const* keys, int64_t n, float* out);
int64_t fp8_panel_bytes(const ref::Fp8Weight& w);  // kLayoutAvx2: bytes per 16-row panel
// Fast numerics (contracts: ref::fast::*). K % 32 == 0 (linear_fp8_bf16, linear_bf16_fast,
// sparse_attention_fast's d), K % 16 == 0 (linear_f32_fast, rms_scale_fast). Every CPU with AVX-512
// also runs linear_f32_fast and rms_scale_fast (their fp32 FMA order is the contract's).
void linear_fp8_bf16(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool);
void linear_bf16_fast(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out, ThreadPool* pool);
void linear_f32_fast(const float* x, int64_t m, const ref::F32Weight& w, float* y, ThreadPool* pool);
float rms_scale_fast(const float* x, int64_t n, float eps);
void sparse_attention_fast(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                           const float* attn_sink, float softmax_scale, float* out);
}  // namespace di::kern::avx2
