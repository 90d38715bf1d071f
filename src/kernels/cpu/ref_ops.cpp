#include "kernels/cpu/ref_ops.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "core/dtypes.h"

namespace di::ref {
namespace {

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> a{};
    for (int i = 0; i < 256; ++i) a[size_t(i)] = e4m3_to_f32(uint8_t(i));
    return a;
  }();
  return t;
}

// Per-row activation quantization into values (e4m3 as float) and per-32 scales.
void quantize_row(const float* x, int64_t k, std::vector<float>& q, std::vector<float>& s) {
  const int64_t nb = (k + 31) / 32;
  q.resize(size_t(k));
  s.resize(size_t(nb));
  thread_local std::vector<uint8_t> codes;
  codes.resize(size_t(k));
  act_quant_fp8(x, k, codes.data(), s.data(), 32);
  const auto& t = e4m3_table();
  for (int64_t i = 0; i < k; ++i) q[size_t(i)] = t[codes[size_t(i)]];
}

}  // namespace

void linear_fp8(const float* x, int64_t m, const Fp8Weight& w, float* y) {
  const auto& t = e4m3_table();
  const int64_t K = w.in, N = w.out, nkb = (K + 31) / 32;
  thread_local std::vector<float> q, s;
  for (int64_t r = 0; r < m; ++r) {
    quantize_row(x + r * K, K, q, s);
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* wr = w.w + n * K;
      const uint8_t* sr = w.scale + (n / 32) * nkb;
      float acc = 0.f;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        double part = 0;
        for (int64_t k = kb * 32; k < std::min(K, kb * 32 + 32); ++k) part += double(q[size_t(k)]) * t[wr[k]];
        acc += float(part) * s[size_t(kb)] * e8m0_to_f32(sr[kb]);
      }
      y[r * N + n] = round_bf16(acc);
    }
  }
}

void linear_fp4(const float* x, int64_t m, const Fp4Weight& w, float* y) {
  const int64_t K = w.in, N = w.out, nkb = K / 32;
  thread_local std::vector<float> q, s;
  for (int64_t r = 0; r < m; ++r) {
    quantize_row(x + r * K, K, q, s);
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* wr = w.w + n * (K / 2);
      const uint8_t* sr = w.scale + n * nkb;
      float acc = 0.f;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        double part = 0;
        for (int64_t k = kb * 32; k < kb * 32 + 32; ++k) part += double(q[size_t(k)]) * e2m1_to_f32(fp4_get(wr, k));
        acc += float(part) * s[size_t(kb)] * e8m0_to_f32(sr[kb]);
      }
      y[r * N + n] = round_bf16(acc);
    }
  }
}

void linear_bf16(const float* x, int64_t m, const Bf16Weight& w, float* y, bool round_out) {
  const int64_t K = w.in, N = w.out;
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * K;
    for (int64_t n = 0; n < N; ++n) {
      const uint16_t* wr = w.w + n * K;
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += double(xr[k]) * double(bf16_to_f32(wr[k]));
      const float v = float(acc);
      y[r * N + n] = round_out ? round_bf16(v) : v;
    }
  }
}

void linear_f32(const float* x, int64_t m, const F32Weight& w, float* y) {
  const int64_t K = w.in, N = w.out;
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * K;
    for (int64_t n = 0; n < N; ++n) {
      const float* wr = w.w + n * K;
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += double(xr[k]) * double(wr[k]);
      y[r * N + n] = float(acc);
    }
  }
}

float rms_scale(const float* x, int64_t n, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i] * x[i]);
  const float var = float(ss) / float(n);
  return 1.0f / std::sqrt(var + eps);
}

void rms_scales(const float* x, int64_t stride, int64_t rows, int64_t n, float eps, float* out) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    const float* x0 = x + r * stride;
    double ss[4] = {0, 0, 0, 0};
    for (int64_t i = 0; i < n; ++i)
      for (int j = 0; j < 4; ++j) ss[j] += double(x0[j * stride + i] * x0[j * stride + i]);
    for (int j = 0; j < 4; ++j) out[r + j] = 1.0f / std::sqrt(float(ss[j]) / float(n) + eps);
  }
  for (; r < rows; ++r) out[r] = rms_scale(x + r * stride, n, eps);
}

void rms_norm(const float* x, const uint16_t* weight, int64_t n, float eps, float* y) {
  const float r = rms_scale(x, n, eps);
  for (int64_t i = 0; i < n; ++i) y[i] = round_bf16(bf16_to_f32(weight[i]) * (x[i] * r));
}

void rope_apply(float* x, int64_t n, const float* cos_sin, bool inverse) {
  for (int64_t i = 0; i < n / 2; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1];
    const float c = cos_sin[2 * i], s = inverse ? -cos_sin[2 * i + 1] : cos_sin[2 * i + 1];
    const float ac = a * c, bs = b * s, as = a * s, bc = b * c;
    x[2 * i] = round_bf16(ac - bs);
    x[2 * i + 1] = round_bf16(as + bc);
  }
}

void index_scores(const float* q, const float* w, int n_heads, int d, const float* const* keys, int64_t n, float* out) {
  for (int64_t u = 0; u < n; ++u) {
    const float* k = keys[u];
    float acc = 0.f;
    for (int h = 0; h < n_heads; ++h) {
      const float* qh = q + size_t(h) * d;
      double dot = 0;
      for (int i = 0; i < d; ++i) dot += double(qh[i]) * k[i];
      const float v = std::max(round_bf16(float(dot)), 0.f);
      acc += round_bf16(v * w[h]);
    }
    out[u] = round_bf16(acc);
  }
}

void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                      const float* attn_sink, float softmax_scale, float* out) {
  constexpr int64_t kChunk = 64;
  thread_local std::vector<float> score, acc;
  thread_local std::vector<double> part;
  score.resize(kChunk);
  acc.resize(size_t(d));
  part.resize(size_t(d));
  for (int h = 0; h < n_heads; ++h) {
    const float* qh = q + int64_t(h) * d;
    float running_max = -1e30f, denom = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t c0 = 0; c0 < n_rows; c0 += kChunk) {
      const int64_t c1 = std::min(n_rows, c0 + kChunk);
      float chunk_max = -INFINITY;
      for (int64_t j = c0; j < c1; ++j) {
        float s = -INFINITY;
        if (kv_rows[j]) {
          double dot = 0;
          for (int i = 0; i < d; ++i) dot += double(qh[i]) * kv_rows[j][i];
          s = float(dot) * softmax_scale;
        }
        score[size_t(j - c0)] = s;
        chunk_max = std::max(chunk_max, s);
      }
      const float new_max = std::max(running_max, chunk_max);
      const float rescale = std::exp(running_max - new_max);
      double psum = 0;
      std::fill(part.begin(), part.end(), 0.0);
      for (int64_t j = c0; j < c1; ++j) {
        const float p = std::exp(score[size_t(j - c0)] - new_max);
        psum += p;
        if (!kv_rows[j]) continue;
        const double pb = round_bf16(p);
        for (int i = 0; i < d; ++i) part[size_t(i)] += pb * kv_rows[j][i];
      }
      denom = denom * rescale + float(psum);
      for (int i = 0; i < d; ++i) acc[size_t(i)] = acc[size_t(i)] * rescale + float(part[size_t(i)]);
      running_max = new_max;
    }
    denom += std::exp(attn_sink[h] - running_max);
    for (int i = 0; i < d; ++i) out[int64_t(h) * d + i] = round_bf16(acc[size_t(i)] / denom);
  }
}

void hc_collapse(const float* X, const float* pre, int hc, int dim, float* y) {
  for (int d = 0; d < dim; ++d) {
    float acc = 0.f;
    for (int k = 0; k < hc; ++k) acc += pre[k] * X[size_t(k) * dim + d];
    y[d] = round_bf16(acc);
  }
}

void hc_expand(const float* f, const float* X, const float* post, const float* comb, int hc, int dim, float* Y) {
  for (int j = 0; j < hc; ++j)
    for (int d = 0; d < dim; ++d) {
      float acc = 0.f;
      for (int i = 0; i < hc; ++i) acc += comb[i * hc + j] * X[size_t(i) * dim + d];
      Y[size_t(j) * dim + d] = round_bf16(post[j] * f[d] + acc);
    }
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
float silu(float x) { return x / (1.0f + std::exp(-x)); }
void swiglu(float* g, const float* u, int64_t m, int64_t n, float limit, const float* weight) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = r * n + i;
      const float up = std::clamp(u[at], -limit, limit), gate = std::min(g[at], limit);
      float h = silu(gate) * up;
      if (weight) h = weight[r] * h;
      g[at] = round_bf16(h);
    }
}
float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

void hc_split_sinkhorn(const float* m, const float* scale3, const float* base, int hc, int iters, float eps,
                       float* pre, float* post, float* comb) {
  for (int k = 0; k < hc; ++k) {
    pre[k] = sigmoid(m[k] * scale3[0] + base[k]) + eps;
    post[k] = 2.f * sigmoid(m[hc + k] * scale3[1] + base[hc + k]);
  }
  const int off = 2 * hc;
  for (int i = 0; i < hc; ++i) {
    float mx = -INFINITY;
    for (int j = 0; j < hc; ++j) {
      comb[i * hc + j] = m[off + i * hc + j] * scale3[2] + base[off + i * hc + j];
      mx = std::max(mx, comb[i * hc + j]);
    }
    float sum = 0.f;
    for (int j = 0; j < hc; ++j) sum += (comb[i * hc + j] = std::exp(comb[i * hc + j] - mx));
    for (int j = 0; j < hc; ++j) comb[i * hc + j] = comb[i * hc + j] / sum + eps;
  }
  auto normalize_cols = [&] {
    for (int j = 0; j < hc; ++j) {
      float sum = 0.f;
      for (int i = 0; i < hc; ++i) sum += comb[i * hc + j];
      for (int i = 0; i < hc; ++i) comb[i * hc + j] /= (sum + eps);
    }
  };
  auto normalize_rows = [&] {
    for (int i = 0; i < hc; ++i) {
      float sum = 0.f;
      for (int j = 0; j < hc; ++j) sum += comb[i * hc + j];
      for (int j = 0; j < hc; ++j) comb[i * hc + j] /= (sum + eps);
    }
  };
  normalize_cols();
  for (int it = 1; it < iters; ++it) {
    normalize_rows();
    normalize_cols();
  }
}

}  // namespace di::ref

namespace di::ref {
void linear_fp8_dequant(const float* x, int64_t m, const Fp8Weight& w, float* y) {
  const auto& t = e4m3_table();
  const int64_t K = w.in, N = w.out, nkb = (K + 31) / 32;
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * K;
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* wr = w.w + n * K;
      const uint8_t* sr = w.scale + (n / 32) * nkb;
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += double(xr[k]) * double(t[wr[k]] * e8m0_to_f32(sr[k / 32]));
      y[r * N + n] = round_bf16(float(acc));
    }
  }
}
}  // namespace di::ref

namespace di::ref::fast {
namespace {
constexpr float kMinNormal = 0x1p-126f;
inline float flush(float v) { return std::fabs(v) < kMinNormal ? std::copysign(0.f, v) : v; }
}  // namespace

float fma_daz_ftz(float a, float b, float acc) { return flush(std::fma(flush(a), flush(b), flush(acc))); }

float halving_sum16(const float* v) {
  float v8[8], v4[4];
  for (int i = 0; i < 8; ++i) v8[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) v4[i] = v8[i] + v8[i + 4];
  return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}

float dot_pair_lanes(const float* x, const uint16_t* w, int64_t K) {
  float lane[16] = {};
  for (int64_t c = 0; c < K; c += 32)
    for (int l = 0; l < 16; ++l)
      for (int64_t k : {c + 2 * l + 1, c + 2 * l})
        if (k < K) lane[l] = fma_daz_ftz(x[k], bf16_to_f32(w[k]), lane[l]);
  return halving_sum16(lane);
}

float dot_fma_lanes(const float* a, const float* b, int64_t K) {
  float lane[16] = {};
  for (int64_t k = 0; k < K; ++k) lane[k % 16] = std::fma(a[k], b[k], lane[k % 16]);
  return halving_sum16(lane);
}

namespace {
// total += (pair-chain block sum of xq . wv) x sa x sw for every block; wv(k) = weight element k.
template <class Wv, class Sw>
float block_chain_total(const float* xq, const float* sa, int64_t K, Wv&& wv, Sw&& sw) {
  float total = 0.f;
  for (int64_t kb = 0; kb * 32 < K; ++kb) {
    float c = 0.f;
    for (int64_t j = kb * 32; j < std::min(K, kb * 32 + 32); j += 2)
      for (int64_t k : {j + 1, j})
        if (k < K) c = fma_daz_ftz(xq[k], wv(k), c);
    total += c * sa[kb] * sw(kb);
  }
  return total;
}
void fp8_rows_fast(const float* xq, const float* sa, int64_t r, const Fp8Weight& w, float* y) {
  const auto& t = e4m3_table();
  const int64_t K = w.in, N = w.out, nkb = (K + 31) / 32;
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* wr = w.w + n * K;
    const uint8_t* sr = w.scale + (n / 32) * nkb;
    y[r * N + n] = round_bf16(block_chain_total(xq, sa, K, [&](int64_t k) { return t[wr[k]]; },
                                                [&](int64_t kb) { return e8m0_to_f32(sr[kb]); }));
  }
}
}  // namespace

void linear_fp8(const float* x, int64_t m, const Fp8Weight& w, float* y) {
  thread_local std::vector<float> q, s;
  for (int64_t r = 0; r < m; ++r) {
    quantize_row(x + r * w.in, w.in, q, s);
    fp8_rows_fast(q.data(), s.data(), r, w, y);
  }
}

void linear_fp4(const float* x, int64_t m, const Fp4Weight& w, float* y) {
  const int64_t K = w.in, N = w.out, nkb = K / 32;
  thread_local std::vector<float> q, s;
  for (int64_t r = 0; r < m; ++r) {
    quantize_row(x + r * K, K, q, s);
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* wr = w.w + n * (K / 2);
      const uint8_t* sr = w.scale + n * nkb;
      y[r * N + n] = round_bf16(block_chain_total(q.data(), s.data(), K, [&](int64_t k) { return e2m1_to_f32(fp4_get(wr, k)); },
                                                  [&](int64_t kb) { return e8m0_to_f32(sr[kb]); }));
    }
  }
}

void scale_act_bf16(const float* x, int64_t K, float* xq, float* s) {
  for (int64_t b0 = 0, bi = 0; b0 < K; b0 += 32, ++bi) {
    const int64_t b1 = std::min<int64_t>(K, b0 + 32);
    float amax = 1e-4f;
    for (int64_t i = b0; i < b1; ++i) amax = std::max(amax, std::fabs(x[i]));
    s[bi] = pow2_ceil(amax * (1.0f / 448.0f));
    for (int64_t i = b0; i < b1; ++i) {
      const float v = round_bf16(x[i]) / s[bi];
      xq[i] = std::fabs(v) < 0x1p-100f ? std::copysign(0.f, v) : v;
    }
  }
}

void linear_fp8_bf16(const float* x, int64_t m, const Fp8Weight& w, float* y) {
  thread_local std::vector<float> q, s;
  q.resize(size_t(w.in));
  s.resize(size_t((w.in + 31) / 32));
  for (int64_t r = 0; r < m; ++r) {
    scale_act_bf16(x + r * w.in, w.in, q.data(), s.data());
    fp8_rows_fast(q.data(), s.data(), r, w, y);
  }
}

void linear_bf16(const float* x, int64_t m, const Bf16Weight& w, float* y, bool round_out) {
  const int64_t K = w.in, N = w.out;
  thread_local std::vector<float> xb;
  xb.resize(size_t(K));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t k = 0; k < K; ++k) xb[size_t(k)] = round_bf16(x[r * K + k]);
    for (int64_t n = 0; n < N; ++n) {
      const float v = dot_pair_lanes(xb.data(), w.w + n * K, K);
      y[r * N + n] = round_out ? round_bf16(v) : v;
    }
  }
}

void linear_f32(const float* x, int64_t m, const F32Weight& w, float* y) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t n = 0; n < w.out; ++n) y[r * w.out + n] = dot_fma_lanes(x + r * w.in, w.w + n * w.in, w.in);
}

float rms_scale(const float* x, int64_t n, float eps) {
  const float ss = dot_fma_lanes(x, x, n);
  return 1.0f / std::sqrt(ss / float(n) + eps);
}
void rms_scales(const float* x, int64_t stride, int64_t rows, int64_t n, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = rms_scale(x + r * stride, n, eps);
}
void rms_norm(const float* x, const uint16_t* weight, int64_t n, float eps, float* y) {
  const float r = rms_scale(x, n, eps);
  for (int64_t i = 0; i < n; ++i) y[i] = round_bf16(bf16_to_f32(weight[i]) * (x[i] * r));
}

void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                      const float* attn_sink, float softmax_scale, float* out) {
  constexpr int64_t kChunk = 64;
  thread_local std::vector<float> score, acc, part;
  thread_local std::vector<uint16_t> qb, kb;
  score.resize(kChunk);
  acc.resize(size_t(d));
  part.resize(size_t(d));
  qb.resize(size_t(d));
  // Rows as bf16 (null rows: zeros, probability 0), so P.V can read row pairs past a null or the end.
  kb.assign(size_t(n_rows + 1) * size_t(d), 0);
  for (int64_t j = 0; j < n_rows; ++j)
    if (kv_rows[j])
      for (int i = 0; i < d; ++i) kb[size_t(j) * size_t(d) + size_t(i)] = f32_to_bf16(kv_rows[j][i]);
  auto row = [&](int64_t j) { return kb.data() + size_t(j) * size_t(d); };
  for (int h = 0; h < n_heads; ++h) {
    const float* qh = q + int64_t(h) * d;
    for (int i = 0; i < d; ++i) qb[size_t(i)] = f32_to_bf16(qh[i]);
    float running_max = -1e30f, denom = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t c0 = 0; c0 < n_rows; c0 += kChunk) {
      const int64_t c1 = std::min(n_rows, c0 + kChunk);
      float chunk_max = -INFINITY;
      for (int64_t j = c0; j < c1; ++j) {
        float s = -INFINITY;
        if (kv_rows[j]) {
          float lane[16] = {};
          for (int c = 0; c < d; c += 32)
            for (int l = 0; l < 16; ++l)
              for (int k : {c + 2 * l + 1, c + 2 * l})
                if (k < d) lane[l] = fma_daz_ftz(bf16_to_f32(qb[size_t(k)]), bf16_to_f32(row(j)[k]), lane[l]);
          s = halving_sum16(lane) * softmax_scale;
        }
        score[size_t(j - c0)] = s;
        chunk_max = std::max(chunk_max, s);
      }
      const float new_max = std::max(running_max, chunk_max);
      const float rescale = std::exp(running_max - new_max);
      float psum = 0.f;
      std::fill(part.begin(), part.end(), 0.f);
      float pb[2];
      for (int64_t j = c0; j < c1; ++j) {
        const float p = std::exp(score[size_t(j - c0)] - new_max);
        psum += p;
        pb[(j - c0) & 1] = round_bf16(p);
        if (((j - c0) & 1) == 0 && j + 1 < c1) continue;
        // The pair (j0, j0 + 1), the second one first (vdpbf16ps's order); past the chunk: zeros.
        const int64_t j0 = j - ((j - c0) & 1);
        const float p1 = j0 + 1 < c1 ? pb[1] : 0.f;
        for (int i = 0; i < d; ++i) {
          const float v1 = j0 + 1 < c1 ? bf16_to_f32(row(j0 + 1)[i]) : 0.f;
          part[size_t(i)] = fma_daz_ftz(pb[0], bf16_to_f32(row(j0)[i]), fma_daz_ftz(p1, v1, part[size_t(i)]));
        }
      }
      denom = denom * rescale + psum;
      for (int i = 0; i < d; ++i) acc[size_t(i)] = acc[size_t(i)] * rescale + part[size_t(i)];
      running_max = new_max;
    }
    denom += std::exp(attn_sink[h] - running_max);
    for (int i = 0; i < d; ++i) out[int64_t(h) * d + i] = round_bf16(acc[size_t(i)] / denom);
  }
}

}  // namespace di::ref::fast
