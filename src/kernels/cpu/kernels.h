// The CPU kernels the model calls, dispatched at run time to the best implementation the machine
// supports (AVX-512, AVX2, or the scalar reference in ref_ops.h). DEEPINFER_ISA=scalar|avx2|avx512
// (or set_isa) forces one, for testing. Every implementation is tested op by op against the scalar
// reference (tests/test_kernels.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/ref_ops.h"

namespace di {
class ThreadPool;
}

namespace di::kern {

enum class Isa { Scalar, Avx2, Avx512 };
const char* isa_name(Isa);
Isa best_isa();    // what this CPU supports
Isa active_isa();  // what the kernels use now (DEEPINFER_ISA, else best_isa())
void set_isa(Isa);  // throws std::invalid_argument if the CPU lacks it
bool isa_supported(Isa);

// The pool the kernels use when their `pool` argument is null, for the calling thread only
// (initially none: single-threaded). Each engine or CLI thread sets its own, sized by --threads;
// kernels called from inside a pool worker run single-threaded on that worker.
void set_default_pool(ThreadPool*);
ThreadPool* default_pool();

// Installs `pool` (when not null) as the calling thread's default pool for its lifetime: a model's
// own pool while one of its forward calls runs.
class ScopedDefaultPool {
 public:
  explicit ScopedDefaultPool(ThreadPool* pool) : set_(pool != nullptr), previous_(default_pool()) {
    if (set_) set_default_pool(pool);
  }
  ~ScopedDefaultPool() {
    if (set_) set_default_pool(previous_);
  }
  ScopedDefaultPool(const ScopedDefaultPool&) = delete;
  ScopedDefaultPool& operator=(const ScopedDefaultPool&) = delete;

 private:
  bool set_;
  ThreadPool* previous_;
};

// Same contracts as the ref:: functions; `pool` (null: default_pool()) splits the output columns.
// Results do not depend on the pool, on m (rows are independent) or on how rows are batched.
void linear_fp8(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool = nullptr);
void linear_fp4(const float* x, int64_t m, const ref::Fp4Weight& w, float* y, ThreadPool* pool = nullptr);
void linear_bf16(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out, ThreadPool* pool = nullptr);
void linear_f32(const float* x, int64_t m, const ref::F32Weight& w, float* y, ThreadPool* pool = nullptr);
// The logits head: linear_bf16(round_out = false) for x holding bf16 values, accumulated in fp32
// (as torch's fp32 F.linear) where the ISA has bf16 dot products, else exactly; the two differ by
// fp32 rounding only (|error| <= (K/16 + 8) * 2^-24 * sum |w x|). Never feeds the residual stream.
void linear_bf16_logits(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, ThreadPool* pool = nullptr);
void linear_fp8_dequant(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool = nullptr);
void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                      const float* attn_sink, float softmax_scale, float* out);

// mHC collapse / expand of one row (contracts: ref::hc_collapse, ref::hc_expand); single-threaded.
void hc_collapse(const float* X, const float* pre, int hc, int dim, float* y);
void hc_expand(const float* f, const float* X, const float* post, const float* comb, int hc, int dim, float* Y);

// The MoE's clamped SwiGLU in place (contract: ref::swiglu); single-threaded.
void swiglu(float* g, const float* u, int64_t m, int64_t n, float limit, const float* weight);
// FP8 QDQ per 32 (contract: di::act_qdq_fp8 with block 32), in place.
void act_qdq_fp8(float* x, int64_t n);
// FP4 QDQ with an E8M0 scale per 32 (contract: di::act_qdq_fp4_e8m0 with block 32), in place.
void act_qdq_fp4_e8m0(float* x, int64_t n);

// Indexer scores of one query row against n keys (contract: ref::index_scores); single-threaded,
// the model splits query rows over its pool.
void index_scores(const float* q, const float* w, int n_heads, int d, const float* const* keys, int64_t n, float* out);

// The `fast` numerics mode (contracts: ref::fast::*, bit for bit on every ISA). FP8/FP4 linears run
// the same optimized kernels as above (their block sums are already fp32); the others replace the
// exact fp64 sums by fp32 ones. Results do not depend on the pool, on m or on the batching.
namespace fast {
void linear_fp8(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool = nullptr);
void linear_fp4(const float* x, int64_t m, const ref::Fp4Weight& w, float* y, ThreadPool* pool = nullptr);
// wo_a (bf16 x, FP8 weight, no activation quantization). Reads the FP8 linears' repacked layout.
void linear_fp8_bf16(const float* x, int64_t m, const ref::Fp8Weight& w, float* y, ThreadPool* pool = nullptr);
// bf16 weights, the head included (round_out = false).
void linear_bf16(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out, ThreadPool* pool = nullptr);
void linear_f32(const float* x, int64_t m, const ref::F32Weight& w, float* y, ThreadPool* pool = nullptr);
void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                      const float* attn_sink, float softmax_scale, float* out);  // single-threaded
// The same with the rows as bf16 (the contract reads them as bf16): callers whose queries share
// rows convert each row once instead of once per call.
void sparse_attention_bf16(const float* q, int n_heads, int d, const uint16_t* const* kv_rows, int64_t n_rows,
                           const float* attn_sink, float softmax_scale, float* out);
float rms_scale(const float* x, int64_t n, float eps);
void rms_scales(const float* x, int64_t stride, int64_t rows, int64_t n, float eps, float* out);
void rms_norm(const float* x, const uint16_t* weight, int64_t n, float eps, float* y);
}  // namespace fast

// Load-time repacking (like llama.cpp's CPU "repack" buffers): the same E4M3/E2M1 codes and E8M0
// scales, reordered so that the active ISA's kernels stream them without transposing. packed_bytes
// is 0 when the active ISA reads the checkpoint layout directly. pack_weight writes the layout to
// dst and points w.packed at it (w.packed_layout = the active ISA); the kernels use it only on
// that ISA, and results are bit-identical either way.
size_t packed_bytes(const ref::Fp8Weight& w);
size_t packed_bytes(const ref::Fp4Weight& w);
void pack_weight(ref::Fp8Weight& w, uint8_t* dst, ThreadPool* pool = nullptr);  // dst: 64-byte aligned
void pack_weight(ref::Fp4Weight& w, uint8_t* dst, ThreadPool* pool = nullptr);
// linear_fp8_dequant (wo_a) has a repacked layout of its own where its certified path uses one
// (AVX-512: the FP8 panels plus per-block column maxima); it still reads w.w for the outputs it
// recomputes exactly, so keep both. packed_bytes_dequant is 0 where it is unused.
size_t packed_bytes_dequant(const ref::Fp8Weight& w);
void pack_weight_dequant(ref::Fp8Weight& w, uint8_t* dst, ThreadPool* pool = nullptr);  // dst: 64-byte aligned
// Rows [row0, row0 + rows) of an FP8 weight (row0 a multiple of 32), with its repacked layout (either
// pack_weight's or pack_weight_dequant's) when it has one.
ref::Fp8Weight fp8_rows(const ref::Fp8Weight& w, int64_t row0, int64_t rows);

}  // namespace di::kern
