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


// The `fast` numerics mode's contracts (di::Numerics::Fast): the same rounding points as above,
// dot products accumulated in fp32 in one fixed order per output that depends on K alone. These
// scalar versions define the bits; every optimized kernel reproduces them exactly.
//
// Orders used below:
// - pair chain (FP8/FP4 block sums): per 32-wide K block a fresh fp32 sum over the 16 K pairs in
//   order, each pair adding its odd element's product, then its even one's (vdpbf16ps's order).
// - pair lanes (bf16 linears, the head, attention scores): 16 lanes, lane l takes K pair l of
//   every 32-wide chunk in K order (odd element, then even), then the halving tree below.
// - fma lanes (fp32 linears, RMSNorm): 16 lanes, lane l takes elements k = l, l + 16, ... by fused
//   multiply-adds, then the halving tree.
// - halving tree of 16 lanes: v8[i] = v[i] + v[i + 8], v4[i] = v8[i] + v8[i + 4],
//   v2[i] = v4[i] + v4[i + 2], result v2[0] + v2[1].
// Products of bf16-valued operands are exact in fp32. Pair steps are vdpbf16ps's: an FMA that
// reads denormal inputs as zero and flushes a denormal result to zero (the model's operands never
// come near; the optimized paths reproduce it: AVX2 by MXCSR's DAZ/FTZ).
namespace di::ref::fast {

float fma_daz_ftz(float a, float b, float acc);
float halving_sum16(const float* lanes);
// x . w in pair lanes (x, w bf16-valued; elements past K count as zero).
float dot_pair_lanes(const float* x, const uint16_t* w, int64_t K);
// a . b in fma lanes.
float dot_fma_lanes(const float* a, const float* b, int64_t K);

// FP8 / FP4 linears: act_quant as the exact mode; block sums in pair-chain order, then
// total += (block sum x act_scale) x weight_scale over blocks in K order; bf16 out.
void linear_fp8(const float* x, int64_t m, const Fp8Weight& w, float* y);
void linear_fp4(const float* x, int64_t m, const Fp4Weight& w, float* y);
// The activation side of linear_fp8_bf16: per 32-block the power of two s that act_quant would
// use, xq = bf16(x) / s (exact), with |xq| < 2^-100 flushed to zero (so every product and partial
// sum stays a normal fp32 number on every path). xq: [K], s: [ceil(K/32)].
void scale_act_bf16(const float* x, int64_t K, float* xq, float* s);
// wo_a: bf16 x against an FP8 weight (e4m3 x block scale, as the reference dequantizes it), no
// activation quantization: scale_act_bf16, then linear_fp8's block sums, totals and bf16 out.
void linear_fp8_bf16(const float* x, int64_t m, const Fp8Weight& w, float* y);
// bf16 weights (also the head): x rounded to bf16, each output x . w in pair lanes; bf16 out if
// round_out.
void linear_bf16(const float* x, int64_t m, const Bf16Weight& w, float* y, bool round_out);
// fp32 weights (the mHC projections): each output x . w in fma lanes.
void linear_f32(const float* x, int64_t m, const F32Weight& w, float* y);

// RMSNorm with the sum of squares in fma lanes (then / n, + eps, 1 / sqrtf as the exact mode).
float rms_scale(const float* x, int64_t n, float eps);
void rms_scales(const float* x, int64_t stride, int64_t rows, int64_t n, float eps, float* out);
void rms_norm(const float* x, const uint16_t* weight, int64_t n, float eps, float* y);

// The exact mode's online softmax with fp32 arithmetic: q and the kv rows read as bf16 (they are
// bf16-valued in the model: rounding them is a no-op there); scores q . k in pair lanes x scale;
// per 64-entry chunk the probability sum in fp32 in entry order, bf16 probabilities, and P.V per
// channel by pair steps over the entry pairs (2t, 2t + 1) of the chunk in order, a null row or
// the entry past an odd chunk's end counting as probability 0 times a zero row; the rescaling as
// in the exact mode; libm's expf.
void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                      const float* attn_sink, float softmax_scale, float* out);

}  // namespace di::ref::fast
