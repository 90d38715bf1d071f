// Plain scalar reference kernels: the numerics of the official V4.1 kernels, one op at a time.
//
// Activations are carried as fp32 arrays. Wherever the reference produces a bf16 tensor the value
// is rounded to bf16 (and stays exactly representable); fp32 intermediates stay fp32. Block dot
// products of low-precision operands are summed exactly (in double) and rounded once to fp32, as
// the golden data's kernels do; optimized kernels are tested against these.
#pragma once

#include <cstdint>

namespace di::ref {

// Quantized weight views (packed, as in the checkpoint).
// `packed`: optional copy of the same codes and scales reordered for one ISA's kernels
// (kern::pack_weight sets it and `packed_layout`, that ISA's kern::Isa value); the reference
// kernels always read `w` and `scale`, other ISAs ignore a layout that is not theirs.
struct Fp8Weight {      // E4M3 [out, in] + E8M0 scale [ceil(out/32), ceil(in/32)]
  const uint8_t* w = nullptr;
  const uint8_t* scale = nullptr;
  int64_t out = 0, in = 0;
  const uint8_t* packed = nullptr;
  int packed_layout = 0;
};
struct Fp4Weight {      // E2M1 packed [out, in/2] (even element in the low nibble) + E8M0 [out, in/32]
  const uint8_t* w = nullptr;
  const uint8_t* scale = nullptr;
  int64_t out = 0, in = 0;
  const uint8_t* packed = nullptr;
  int packed_layout = 0;
};
struct Bf16Weight {     // bf16 [out, in]
  const uint16_t* w = nullptr;
  int64_t out = 0, in = 0;
};
struct F32Weight {      // fp32 [out, in]
  const float* w = nullptr;
  int64_t out = 0, in = 0;
};

// y[m, out] = bf16(act_quant(x[m, in]) . W^T), the reference fp8_gemm / fp4_gemm.
void linear_fp8(const float* x, int64_t m, const Fp8Weight& w, float* y);
void linear_fp4(const float* x, int64_t m, const Fp4Weight& w, float* y);
// y = x . W^T with fp32 accumulation. round_out: round the result to bf16 (a bf16 F.linear),
// otherwise keep fp32 (an fp32 F.linear on bf16-valued weights, e.g. the gate or head).
void linear_bf16(const float* x, int64_t m, const Bf16Weight& w, float* y, bool round_out);
void linear_f32(const float* x, int64_t m, const F32Weight& w, float* y);

// RMSNorm over n values: bf16(w * (x * rsqrt(mean(x^2) + eps))), weight bf16.
void rms_norm(const float* x, const uint16_t* weight, int64_t n, float eps, float* y);
// Weightless part only: x * rsqrt(mean(x^2) + eps) in fp32 (no rounding).
float rms_scale(const float* x, int64_t n, float eps);
// rms_scale of `rows` rows (x + r * stride), four at a time: each row's sum in its own order, so
// the same bits, with four independent add chains instead of one (the chain's latency bounds it).
void rms_scales(const float* x, int64_t stride, int64_t rows, int64_t n, float eps, float* out);

// Interleaved-pair rotary embedding on `n` values (n even) at angle table (cos, sin per pair);
// result rounded to bf16. inverse conjugates the rotation.
void rope_apply(float* x, int64_t n, const float* cos_sin, bool inverse);

// Online-softmax sparse attention of one query row over a list of kv rows (nullptr = index -1),
// in chunks of 64 list entries, bf16-rounded probabilities, sink in the denominator only.
// q: [n_heads, d], out: [n_heads, d] (bf16 values).
void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                      const float* attn_sink, float softmax_scale, float* out);

// Indexer scores of one query row against n keys (the reference indexer, per key u):
// out[u] = bf16(sum over heads h ascending, in fp32, of bf16(relu(bf16(fp32(q_h . k_u))) * w_h)),
// each q_h . k_u summed in fp64 over d (exact for the FP4-quantized q and k the model passes).
// q: [n_heads, d], w: [n_heads] (already bf16-rounded), keys: n pointers to d floats.
void index_scores(const float* q, const float* w, int n_heads, int d, const float* const* keys, int64_t n, float* out);

// mHC collapse (hc_pre): y[d] = bf16(sum over k ascending of pre[k] * X[k][d]), fp32. X: [hc][dim].
void hc_collapse(const float* X, const float* pre, int hc, int dim, float* y);
// mHC expand (hc_post): Y[j][d] = bf16(post[j] * f[d] + sum over i ascending of comb[i][j] * X[i][d]),
// fp32. X, Y: [hc][dim]; comb: [hc][hc] (row i, column j).
void hc_expand(const float* f, const float* X, const float* post, const float* comb, int hc, int dim, float* Y);

// hc_split_sinkhorn: mixes[(2+hc)*hc] -> pre[hc], post[hc], comb[hc*hc] (row i, column j).
void hc_split_sinkhorn(const float* mixes, const float* scale3, const float* base, int hc, int iters,
                       float eps, float* pre, float* post, float* comb);

float silu(float x);
// The MoE's SwiGLU with the training clamps, in place over m rows of n: g = bf16(w_r x (silu(min(g,
// limit)) x clamp(u, -limit, limit))), fp32, w_r = weight[r] (no factor when weight is null).
void swiglu(float* g, const float* u, int64_t m, int64_t n, float limit, const float* weight);
float sigmoid(float x);
float softplus(float x);  // torch's default (beta 1, threshold 20)

}  // namespace di::ref

namespace di::ref {
// bf16 linear whose weight is stored FP8 (value x block scale, exact in bf16) without activation
// quantization: the reference dequantizes attn.wo_a to bf16 at conversion time.
void linear_fp8_dequant(const float* x, int64_t m, const Fp8Weight& w, float* y);
}  // namespace di::ref

