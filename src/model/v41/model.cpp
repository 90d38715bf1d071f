#include "model/v41/model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <stdexcept>

#include "core/dtypes.h"
#include "core/phase_profile.h"
#include "core/thread_pool.h"
#include "kernels/cpu/kernels.h"
#include "model/v41/tensor_specs.h"

namespace di::v41 {

namespace {

// Frequencies exactly as the reference computes them in fp32 (precompute_freqs_cis).
std::vector<float> rope_frequencies(int rd, double base, int64_t original_seq_len, double factor, double beta_fast,
                                    double beta_slow) {
  std::vector<float> f(size_t(rd / 2));
  for (int i = 0; i < rd / 2; ++i) f[size_t(i)] = 1.0f / std::pow(float(base), float(2 * i) / float(rd));
  if (original_seq_len > 0) {
    auto corrected_dim = [&](double rotations) {
      return rd * std::log(double(original_seq_len) / (rotations * 2 * M_PI)) / (2 * std::log(base));
    };
    const double low = std::max(std::floor(corrected_dim(beta_fast)), 0.0);
    const double high = std::min(std::ceil(corrected_dim(beta_slow)), double(rd - 1));
    const float denom = float(std::max(high - low, 1e-3));
    for (int i = 0; i < rd / 2; ++i) {
      const float ramp = std::clamp((float(i) - float(low)) / denom, 0.f, 1.f);
      const float smooth = 1.f - ramp;
      const float fi = f[size_t(i)];
      f[size_t(i)] = fi / float(factor) * (1.f - smooth) + fi * smooth;
    }
  }
  return f;
}

// Top-k by descending score; at equal scores the lower index wins (the golden data's rule).
void topk_desc(const float* score, int n, int k, int32_t* out, std::vector<int32_t>& order) {
  order.resize(size_t(n));
  std::iota(order.begin(), order.end(), 0);
  auto better = [score](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  std::partial_sort(order.begin(), order.begin() + k, order.end(), better);
  std::copy(order.begin(), order.begin() + k, out);
}

// The same k indices as topk_desc, in ascending index order: a linear-time selection (the rule is
// a strict total order, so the set is unique) where the caller needs the set, not the ranking.
void topk_set(const float* score, int n, int k, int32_t* out, std::vector<int32_t>& order) {
  order.resize(size_t(n));
  std::iota(order.begin(), order.end(), 0);
  auto better = [score](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  if (k < n) std::nth_element(order.begin(), order.begin() + k, order.end(), better);
  std::copy(order.begin(), order.begin() + k, out);
  std::sort(out, out + k);
}

// Runs fn(begin, end) over [0, n) on the kernels' pool (inline without one). Used for per-query
// work (attention, index scoring) whose results do not depend on the split.
template <class F>
void for_rows(int64_t n, F&& fn, int chunks_per_thread = ThreadPool::kChunksPerThread) {
  ThreadPool* pool = kern::default_pool();
  if (!pool || pool->size() == 1 || n < 2) {
    fn(int64_t(0), n);
    return;
  }
  pool->parallel_for(n, 1, [&](int64_t b, int64_t e, int) { fn(b, e); }, chunks_per_thread);
}
// Per-query work that grows along the prompt (a later query sees more entries): small chunks, so
// the last one claimed, which the other threads wait for, is short.
constexpr int kGrowingWorkChunks = 16;

// Independent linears of a step with few rows (decode) run as concurrent tasks, each on one
// thread: a matrix of a few hundred KB split over both threads costs more in the split than it
// saves, while two of them streamed side by side use both cores' bandwidth. With more rows each
// task is a GEMM worth splitting, and they run one after the other. The kernels give the same
// bits on any number of threads, so either way the results are identical.
constexpr int kTaskParallelRows = 8;
template <class F>
void for_tasks(int64_t rows, int n, F&& task) {
  if (rows > kTaskParallelRows) {
    for (int i = 0; i < n; ++i) task(i);
    return;
  }
  for_rows(n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) task(int(i));
  });
}

// How many parts to cut each of S rows into so that every thread of the pool gets work: the
// pool size when the rows alone are too few (decode), else 1.
int64_t row_parts(int64_t S) {
  const ThreadPool* pool = kern::default_pool();
  const int64_t threads = pool ? pool->size() : 1;
  return S < 2 * threads ? threads : 1;
}

template <class T>
T* sized(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

}  // namespace

struct Model::Ctx {
  Workspace& ws;
  const ForwardOptions& opts;
  std::vector<Segment>& segs;
  int R;           // rows in the batch
  float* stream;   // [R][hc][dim]
  float* pre_mix;  // [R][hc]
};

std::unique_ptr<Model> Model::load(const std::string& model_dir, const LoadOptions& opts) {
  namespace fs = std::filesystem;
  auto check_cancel = [&] { throw_if_cancelled(opts.cancel, model_dir); };
  std::unique_ptr<Model> m(new Model());
  const std::string config_path = (fs::path(model_dir) / "config.json").string();
  if (!fs::exists(config_path)) throw LoadError(model_dir + ": no config.json (not a model directory)");
  m->cfg_ = V41Config::from_hf_file(config_path);
  m->cfg_.validate(config_path);
  check_cancel();
  m->ckpt_ = std::make_unique<Checkpoint>(Checkpoint::open(model_dir));
  check_cancel();
  validate_v41_checkpoint(*m->ckpt_, m->cfg_);
  m->w_ = bind_weights(*m->ckpt_, m->cfg_);
  if (opts.threads > 0) m->pool_ = std::make_unique<ThreadPool>(opts.threads);
  if (m->pool_) {
    m->packed_ = repack_weights(m->w_, m->pool_.get(), opts.cancel, opts.numerics);
  } else {
    ThreadPool pool(ThreadPool::default_threads());
    m->packed_ = repack_weights(m->w_, &pool, opts.cancel, opts.numerics);
  }
  check_cancel();
  m->policy_ = opts.index_key_policy;
  m->numerics_ = opts.numerics;
  const auto& c = m->cfg_;
  if (!c.engram_layer_ids.empty()) {
    const std::string tok = opts.tokenizer_path.empty() ? (fs::path(model_dir) / "tokenizer.json").string() : opts.tokenizer_path;
    if (!fs::exists(tok))
      throw LoadError(tok + ": tokenizer.json not found (the Engram token map is built from it; pass --tokenizer)");
    m->token_map_ = build_engram_token_map_from_file(tok);
    m->engram_ = make_engram_constants(c, m->token_map_);
    for (const auto& L : m->w_.layers) {
      if (!L.has_engram) continue;
      for (int64_t i = 0; i < L.engram.q_weight.n; ++i)
        m->wqk_.push_back(bf16_to_f32(L.engram.q_weight.p[i]) * bf16_to_f32(L.engram.k_weight.p[i]));
    }
  }
  m->freqs_base_ = rope_frequencies(c.rope_head_dim, c.rope_theta, 0, c.rope_factor, c.beta_fast, c.beta_slow);
  m->freqs_yarn_ = rope_frequencies(c.rope_head_dim, c.compress_rope_theta, c.original_seq_len, c.rope_factor,
                                    c.beta_fast, c.beta_slow);
  ModelInfo& info = m->info_;
  info.arch = "deepseek_v4.1";
  info.vocab_size = c.vocab_size;
  info.sampleable_vocab = m->sampleable_vocab();
  info.max_context = c.max_position_embeddings;
  info.bos_id = int32_t(c.bos_token_id);
  info.eos_id = int32_t(c.eos_token_id);
  info.chat_format = "deepseek-v4.1";
  info.numerics = m->numerics_;
  info.cache_format = cache_format(c, m->numerics_) + (m->policy_ == IndexKeyPolicy::Reference ? ";index-keys=reference" : "");
  return m;
}

void Model::set_index_key_policy(IndexKeyPolicy p) {
  policy_ = p;
  // The policy changes what later layers compute, so it names a different cache format.
  info_.cache_format = cache_format(cfg_, numerics_) + (p == IndexKeyPolicy::Reference ? ";index-keys=reference" : "");
}

std::string cache_format(const V41Config& c, Numerics numerics) {
  std::string s = "v41;fp32-rows;" + std::string(numerics_name(numerics)) + ";vocab=" + std::to_string(c.vocab_size) +
                  ";dim=" + std::to_string(c.dim) + ";layers=" + std::to_string(c.n_layers) +
                  ";head=" + std::to_string(c.head_dim) + ";index=" + std::to_string(c.index_head_dim) +
                  ";window=" + std::to_string(c.window_size) + ";ratios=";
  for (int r : c.compress_ratios) s += std::to_string(r) + ",";
  s += ";kv=";
  for (int r : c.kv_source_layers) s += std::to_string(r) + ",";
  return s;
}

std::unique_ptr<di::Model> load_as_model(const std::string& model_dir, const di::LoadOptions& opts) {
  LoadOptions lo;
  lo.tokenizer_path = opts.tokenizer_path;
  lo.numerics = opts.numerics;
  lo.cancel = opts.cancel;
  lo.threads = opts.threads > 0 ? opts.threads : ThreadPool::default_threads();
  for (const auto& [key, value] : opts.arch_options) {
    if (key == "index_key_policy" && (value == "per_source" || value == "reference")) {
      lo.index_key_policy = value == "reference" ? IndexKeyPolicy::Reference : IndexKeyPolicy::PerSource;
    } else {
      throw LoadError(model_dir + ": unknown DeepSeek-V4.1 load option " + key + "=" + value +
                      " (known: index_key_policy=per_source|reference)");
    }
  }
  return Model::load(model_dir, lo);
}

std::vector<kvcache::StreamLayout> Model::cache_layout(int page_tokens) const {
  std::vector<kvcache::StreamLayout> out;
  for (int i = 0; i < cfg_.n_layers; ++i) {
    if (!cfg_.is_kv_source(i)) continue;
    const int rows = page_tokens / cfg_.compress_ratio(i);
    const std::string layer = "layer" + std::to_string(i);
    out.push_back({layer + ".compressed_kv", rows, size_t(cfg_.head_dim) * sizeof(float), kvcache::ElementType::F32});
    out.push_back({layer + ".index_keys", rows, size_t(cfg_.index_head_dim) * sizeof(float), kvcache::ElementType::F32});
  }
  return out;
}

std::unique_ptr<di::SequenceState> Model::new_state(const StateOptions& o) const {
  return std::make_unique<SequenceState>(cfg_, o.max_rollback, o.page_tokens, o.pool, o.state_pool);
}

namespace {
SequenceState& own_state(di::SequenceState* s) { return own_object<SequenceState>(*s); }
Workspace& own_workspace(di::Workspace& ws) { return own_object<Workspace>(ws); }
}  // namespace

void Model::forward_batch(std::span<di::BatchItem> items, di::Workspace& ws) const {
  Workspace& w = own_workspace(ws);
  w.items.clear();  // the concrete forward_batch does not use w.items itself
  for (const auto& it : items) {
    if (!it.state) throw std::invalid_argument("forward: batch item without a state");
    w.items.push_back({&own_state(it.state), it.tokens, it.all_logits, it.logits});
  }
  forward_batch(w.items, ForwardOptions{false, w.observer}, w);
}

void Model::resume(di::SequenceState& state, di::Workspace& ws) const { rebuild_windows(own_state(&state), own_workspace(ws)); }

void Model::linear(const float* x, int64_t m, const ref::Fp8Weight& w, float* y) const {
  numerics_ == Numerics::Fast ? kern::fast::linear_fp8(x, m, w, y) : kern::linear_fp8(x, m, w, y);
}
void Model::linear(const float* x, int64_t m, const ref::Fp4Weight& w, float* y) const {
  numerics_ == Numerics::Fast ? kern::fast::linear_fp4(x, m, w, y) : kern::linear_fp4(x, m, w, y);
}
void Model::linear(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out) const {
  numerics_ == Numerics::Fast ? kern::fast::linear_bf16(x, m, w, y, round_out) : kern::linear_bf16(x, m, w, y, round_out);
}
void Model::linear(const float* x, int64_t m, const ref::F32Weight& w, float* y) const {
  numerics_ == Numerics::Fast ? kern::fast::linear_f32(x, m, w, y) : kern::linear_f32(x, m, w, y);
}
void Model::linear_wo_a(const float* x, int64_t m, const ref::Fp8Weight& w, float* y) const {
  numerics_ == Numerics::Fast ? kern::fast::linear_fp8_bf16(x, m, w, y) : kern::linear_fp8_dequant(x, m, w, y);
}
void Model::head(const float* x, int64_t m, float* y) const {
  numerics_ == Numerics::Fast ? kern::fast::linear_bf16(x, m, w_.head, y, false) : kern::linear_bf16_logits(x, m, w_.head, y);
}
void Model::rms_norm(const float* x, const Bf16Vec& w, int64_t n, float* y) const {
  numerics_ == Numerics::Fast ? kern::fast::rms_norm(x, w.p, n, cfg_.norm_eps, y) : ref::rms_norm(x, w.p, n, cfg_.norm_eps, y);
}
float Model::rms_scale(const float* x, int64_t n) const {
  return numerics_ == Numerics::Fast ? kern::fast::rms_scale(x, n, cfg_.norm_eps) : ref::rms_scale(x, n, cfg_.norm_eps);
}
void Model::sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                             const float* attn_sink, float softmax_scale, float* out) const {
  if (numerics_ == Numerics::Fast) kern::fast::sparse_attention(q, n_heads, d, kv_rows, n_rows, attn_sink, softmax_scale, out);
  else kern::sparse_attention(q, n_heads, d, kv_rows, n_rows, attn_sink, softmax_scale, out);
}

const float* Model::rope_table(int layer, int64_t pos, float* buf) const {
  const auto& f = cfg_.compress_ratio(layer) ? freqs_yarn_ : freqs_base_;
  for (size_t i = 0; i < f.size(); ++i) {
    const float angle = float(pos) * f[i];
    buf[2 * i] = std::cos(angle);
    buf[2 * i + 1] = std::sin(angle);
  }
  return buf;
}

void Model::hc_mixes(const HcWeights& w, const float* stream, int S, float* pre, float* post, float* comb,
                     Workspace& ws) const {
  const int hc = cfg_.hc_mult, flat = hc * cfg_.dim, nmix = (2 + hc) * hc;
  float* mixes = sized(ws.mix, size_t(S) * nmix);
  linear(stream, S, w.fn, mixes);  // one pass over the weight for all rows (rows are independent)
  for_rows(S, [&](int64_t s0, int64_t s1) {
    thread_local std::vector<float> scales;
    scales.resize(size_t(s1 - s0));
    if (numerics_ == Numerics::Fast) kern::fast::rms_scales(stream + size_t(s0) * flat, flat, s1 - s0, flat, cfg_.norm_eps, scales.data());
    else ref::rms_scales(stream + size_t(s0) * flat, flat, s1 - s0, flat, cfg_.norm_eps, scales.data());
    for (int64_t s = s0; s < s1; ++s) {
      const float r = scales[size_t(s - s0)];
      float* mix = mixes + size_t(s) * nmix;
      for (int k = 0; k < nmix; ++k) mix[k] *= r;
      ref::hc_split_sinkhorn(mix, w.scale.p, w.base.p, hc, cfg_.hc_sinkhorn_iters, cfg_.hc_eps, pre + s * hc,
                             post + s * hc, comb + s * hc * hc);
    }
  });
}

void Model::engram(int layer, Ctx& c) const {
  DI_PHASE("engram");
  const auto& E = w_.layers[size_t(layer)].engram;
  const int hc = cfg_.hc_mult, dim = cfg_.dim, hd = cfg_.engram_head_dim;
  const int cols = engram_.hash_cols(), nl = engram_.n_layers();
  int li = 0;
  while (engram_.layer_ids[size_t(li)] != layer) ++li;
  const float* wqk = wqk_.data() + size_t(li) * hc * dim;
  const size_t emb_n = size_t(cols) * hd, kv_n = size_t(hc + 1) * dim;
  float* embs = sized(c.ws.tmp, size_t(c.R) * emb_n);
  float* kvs = sized(c.ws.y, size_t(c.R) * kv_n);
  const float dim_scale = float(std::pow(double(dim), -0.5));
  // Gather every row's embeddings, then one projection over all rows (the weight streams once).
  // The gathered (row, column) embeddings, and each row's hc gates, are independent: both loops
  // run over the pool (per embedding, not per row, so that a single decode row is split too).
  for_rows(int64_t(c.R) * cols, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / cols;
      const int j = int(i % cols);
      const int32_t id = c.ws.hash_ids[(size_t(s) * nl + li) * cols + size_t(j)];
      float* emb = embs + size_t(s) * emb_n + size_t(j) * hd;
      const uint8_t* row = E.table + int64_t(id) * hd;
      const uint8_t* sc = E.table_scale + int64_t(id) * (hd / 32);
      for (int b = 0; b < hd / 32; ++b) {
        const float scale = e8m0_to_f32(sc[b]);
        for (int d = b * 32; d < b * 32 + 32; ++d) emb[d] = e4m3_to_f32(row[d]) * scale;
      }
    }
  });
  linear(embs, c.R, E.wkv, kvs);
  for_rows(int64_t(c.R) * hc, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / hc;
      const int k = int(i % hc);
      const float* kv = kvs + size_t(s) * kv_n;
      const float* value = kv + size_t(hc) * dim;
      float* X = c.stream + (size_t(s) * hc + k) * dim;
      const float* key = kv + size_t(k) * dim;
      const float rstd = rms_scale(X, dim) * rms_scale(key, dim);
      float dot;
      if (numerics_ == Numerics::Fast) {
        thread_local std::vector<float> xw;
        xw.resize(size_t(dim));
        for (int d = 0; d < dim; ++d) xw[size_t(d)] = X[d] * wqk[k * dim + d];
        dot = ref::fast::dot_fma_lanes(xw.data(), key, dim);
      } else {
        double exact = 0;
        for (int d = 0; d < dim; ++d) exact += (X[d] * wqk[k * dim + d]) * key[d];
        dot = float(exact);
      }
      const float g = dot * rstd * dim_scale;
      const float gate = ref::sigmoid(std::copysign(std::sqrt(std::max(std::fabs(g), 1e-6f)), g));
      for (int d = 0; d < dim; ++d) X[d] = round_bf16(X[d] + gate * value[d]);
    }
  });
}

void Model::compress(int layer, Ctx& c, Segment& g, float* kv_new, float* gate_new) const {
  const auto& A = w_.layers[size_t(layer)].attn;
  auto& Ls = g.st->layers()[size_t(layer)];
  auto& ws = c.ws;
  const int D = cfg_.head_dim, ID = cfg_.index_head_dim, rd = cfg_.rope_head_dim, r = cfg_.compress_ratio(layer);
  const int cap = g.st->comp_cap();
  const int64_t end = g.start + g.S;
  // Entries this call completes: j with its last token j * r + r - 1 in [start, end).
  const int64_t first = g.start / r, count = end / r - first;
  float* lat = kv_new;  // ratio 1: each row's (bf16-rounded) projection is its entry's latent
  if (r > 1) {
    // Ratio > 1: fp32 projections of every token are kept in a ring; a group is pooled (per-channel
    // softmax over its r tokens) when its last token arrives, whichever call that happens in. This
    // call's projections (kv_new, gate_new: its rows') come from one pass over the batch; older
    // tokens from the ring.
    lat = sized(ws.comp_lat, size_t(std::max<int64_t>(count, 1)) * D);
    // Token t's projection (kv; its score D floats further on in a ring slot, S x D further here).
    auto kv_of = [&](int64_t t) {
      return t >= g.start ? kv_new + size_t(t - g.start) * D : Ls.comp_inputs.data() + size_t(t % cap) * 2 * D;
    };
    auto gate_of = [&](int64_t t) { return t >= g.start ? gate_new + size_t(t - g.start) * D : kv_of(t) + D; };
    for_rows(count, [&](int64_t e0, int64_t e1) {
      for (int64_t e = e0; e < e1; ++e) {
        const int64_t j = first + e;
        float* latent = lat + size_t(e) * D;
        for (int d = 0; d < D; ++d) {
          float mx = -INFINITY;
          for (int q = 0; q < r; ++q) mx = std::max(mx, gate_of(j * r + q)[d]);
          float sum = 0.f;
          for (int q = 0; q < r; ++q) sum += std::exp(gate_of(j * r + q)[d] - mx);
          float acc = 0.f;
          for (int q = 0; q < r; ++q) acc += kv_of(j * r + q)[d] * (std::exp(gate_of(j * r + q)[d] - mx) / sum);
          latent[d] = round_bf16(acc);
        }
      }
    });
    for (int64_t t = std::max<int64_t>(g.start, end - cap); t < end; ++t) {
      float* slot = Ls.comp_inputs.data() + size_t(t % cap) * 2 * D;
      std::copy(kv_of(t), kv_of(t) + D, slot);
      std::copy(gate_of(t), gate_of(t) + D, slot + D);
    }
  }
  g.new_entries = int(count);
  if (count == 0) return;
  for_rows(count, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) rms_norm(lat + size_t(e) * D, A.compressor.norm, D, lat + size_t(e) * D);
  });
  // Index keys come from the pre-RoPE latents, then the latents themselves are rotated and FP4-QDQ'd.
  float* key = sized(ws.comp_key, size_t(count) * ID);
  linear(lat, count, A.indexer.wk, key, true);
  for_rows(count, [&](int64_t e0, int64_t e1) {
    thread_local std::vector<float> cs_buf;
    float* cs = sized(cs_buf, size_t(rd));
    for (int64_t e = e0; e < e1; ++e) {
      float* k = key + size_t(e) * ID;
      float* l = lat + size_t(e) * D;
      rms_norm(k, A.indexer.k_norm, ID, k);
      ref::rope_apply(k + ID - rd, rd, rope_table(layer, (first + e) * r, cs), false);
      kern::act_qdq_fp4_e8m0(k, ID);
      ref::rope_apply(l + D - rd, rd, cs, false);
      act_qdq_fp4_e4m3(l, D, 16);
    }
  });
  for (int64_t e = 0; e < count; ++e) {
    std::copy(key + size_t(e) * ID, key + size_t(e + 1) * ID, Ls.index_keys.append<float>());
    std::copy(lat + size_t(e) * D, lat + size_t(e + 1) * D, Ls.compressed_kv.append<float>());
  }
}

void Model::index_select(int layer, Ctx& c, Segment& g, const float* iq, const float* iw) const {
  const int r = cfg_.compress_ratio(layer), IH = cfg_.index_n_heads, ID = cfg_.index_head_dim;
  const int64_t end = g.start + g.S, width = end / r;
  auto& ws = c.ws;
  if (width == 0) {
    g.topk_k = 0;
    return;
  }
  // Whose index keys to score against.
  const bool owner = cfg_.is_kv_source(layer);
  int keys_layer;
  if (policy_ == IndexKeyPolicy::PerSource) {
    if (owner) g.index_k_owner = layer;
    keys_layer = g.index_k_owner;
  } else {
    if (owner && g.new_entries > 0) g.st->index_k_publisher = layer;
    keys_layer = g.st->index_k_publisher >= 0 ? g.st->index_k_publisher : layer;
  }
  const RowCache& keys = g.st->layers()[size_t(keys_layer)].index_keys;

  float* score = sized(ws.scores, size_t(g.S) * width);
  const int64_t n_keys = std::min<int64_t>(width, keys.size());
  const float** key_rows = sized(ws.key_rows, size_t(n_keys));
  for (int64_t u = 0; u < n_keys; ++u) key_rows[u] = keys.row<float>(u);
  // Work items: (row, slice of the keys); decode has one row, so its keys are split instead.
  const int64_t parts = row_parts(g.S), slice = (width + parts - 1) / parts;
  for_rows(g.S * parts, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / parts, u0 = std::min(width, i % parts * slice), u1 = std::min(width, u0 + slice);
      const int64_t visible = std::clamp<int64_t>(std::min<int64_t>((g.start + s + 1) / r, n_keys), u0, u1);
      float* out = score + size_t(s) * width;
      kern::index_scores(iq + size_t(s) * IH * ID, iw + size_t(s) * IH, IH, ID, key_rows + u0, visible - u0, out + u0);
      std::fill(out + visible, out + u1, -INFINITY);
    }
  }, kGrowingWorkChunks);
  // Candidate pre-filter: the source keeps its best blocks (plus the newest one) per query; later
  // index sources mask everything outside them.
  const int cand = cfg_.candidate_source_layer;
  if (layer == cand) {
    const int bs = cfg_.candidate_block_size;
    const int64_t nb = (width + bs - 1) / bs;
    const int keep_n = int(std::min<int64_t>(cfg_.candidate_topk_blocks, nb));
    // Each segment's mask lives at its own offset: later index sources of every segment read it.
    g.candidate_off = ws.candidate_mask_used;
    ws.candidate_mask_used += size_t(g.S) * width;
    uint8_t* mask = sized(ws.candidate_mask, ws.candidate_mask_used) + g.candidate_off;
    float* bscore = sized(ws.block_scores, size_t(nb));
    int32_t* top = sized(ws.top_blocks, size_t(keep_n));
    for (int s = 0; s < g.S; ++s) {
      const float* sc = score + size_t(s) * width;
      const int64_t visible = (g.start + s + 1) / r;
      const int64_t last = visible >= 1 ? (visible - 1) / bs : -1;
      for (int64_t b = 0; b < nb; ++b) {
        float mx = -INFINITY;
        for (int64_t u = b * bs; u < std::min(width, (b + 1) * bs); ++u) mx = std::max(mx, sc[u]);
        bscore[b] = b == last ? INFINITY : mx;
      }
      topk_set(bscore, int(nb), keep_n, top, ws.order);
      std::fill(mask + size_t(s) * width, mask + size_t(s + 1) * width, uint8_t(0));
      for (int t = 0; t < keep_n; ++t) {
        if (!(bscore[top[t]] > -INFINITY)) continue;
        const int64_t b = top[t];
        for (int64_t u = b * bs; u < std::min(width, (b + 1) * bs); ++u) mask[size_t(s) * width + u] = 1;
      }
    }
    g.candidate_width = width;
  } else if (cand >= 0 && cand < layer && g.candidate_width >= 0) {
    if (g.candidate_width != width)
      throw std::logic_error("candidate mask width " + std::to_string(g.candidate_width) + " != index width " +
                             std::to_string(width) + " at layer " + std::to_string(layer));
    const uint8_t* mask = ws.candidate_mask.data() + g.candidate_off;
    for (size_t i = 0; i < size_t(g.S) * width; ++i)
      if (!mask[i]) score[i] = -INFINITY;
  }
  // Top-k in position order; entries the query cannot see yet become -1.
  const int k = int(std::min<int64_t>(cfg_.index_topk, width));
  g.topk_off = ws.topk_used;
  ws.topk_used += size_t(g.S) * k;
  int32_t* topk = sized(ws.topk, ws.topk_used) + g.topk_off;
  for_rows(g.S, [&](int64_t s0, int64_t s1) {
    thread_local std::vector<int32_t> order;
    for (int64_t s = s0; s < s1; ++s) {
      int32_t* row = topk + size_t(s) * k;
      topk_set(score + size_t(s) * width, int(width), k, row, order);
      const int64_t visible = (g.start + s + 1) / r;
      for (int t = 0; t < k; ++t)
        if (row[t] >= visible) row[t] = -1;
    }
  });
  g.topk_k = k;
  if (c.opts.observer) c.opts.observer->on_index_topk(layer, g.start, g.S, k, topk, score, width);
}

void Model::attention(int layer, Ctx& c, const float* x, float* out) const {
  const auto& A = w_.layers[size_t(layer)].attn;
  auto& ws = c.ws;
  const int H = cfg_.n_heads, D = cfg_.head_dim, rd = cfg_.rope_head_dim, W = cfg_.window_size;
  const int G = cfg_.o_groups, R = cfg_.o_lora_rank, ratio = cfg_.compress_ratio(layer), QL = cfg_.q_lora_rank;
  const int N = c.R;

  // Row-wise projections over the whole batch.
  float* qr = sized(ws.qr, size_t(N) * QL);
  float* q = sized(ws.q, size_t(N) * H * D);
  float* kv = sized(ws.kv, size_t(N) * D);
  phase::Scope timer(DI_PHASE_ID("attn.projections"));
  for_tasks(N, 2, [&](int i) { linear(x, N, i == 0 ? A.wq_a : A.wkv, i == 0 ? qr : kv); });
  for_rows(N, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) rms_norm(qr + size_t(s) * QL, A.q_norm, QL, qr + size_t(s) * QL);
  });
  linear(qr, N, A.wq_b, q);
  // The indexer's queries and head weights, over all rows of the batch (one weight pass).
  const bool indexed = ratio && A.has_indexer;
  const int IH = cfg_.index_n_heads, ID = cfg_.index_head_dim;
  float* iq = indexed ? sized(ws.iq, size_t(N) * IH * ID) : nullptr;
  float* iw = indexed ? sized(ws.iw, size_t(N) * IH) : nullptr;
  if (indexed) {
    linear(qr, N, A.indexer.wq_b, iq);
    linear(x, N, A.indexer.weights_proj, iw, true);
  }
  // Per row, one RoPE table (kept for the output's inverse rotation below): q rotated; the window
  // KV (one latent per token, K = V) normed, rotated, then FP8-QDQ'd over all of head_dim; the
  // index queries rotated and FP4-QDQ'd, their head weights scaled.
  float* cs_rows = sized(ws.rope_cs, size_t(N) * rd);
  const float wscale = float(std::pow(double(ID), -0.5) * std::pow(double(IH), -0.5));
  timer.next(DI_PHASE_ID("attn.rope, qdq"));
  for_rows(N, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const float* cs = rope_table(layer, ws.row_pos[size_t(row)], cs_rows + size_t(row) * rd);
      for (int h = 0; h < H; ++h) ref::rope_apply(q + (size_t(row) * H + h) * D + D - rd, rd, cs, false);
      float* kr = kv + size_t(row) * D;
      rms_norm(kr, A.kv_norm, D, kr);
      ref::rope_apply(kr + D - rd, rd, cs, false);
      kern::act_qdq_fp8(kr, D);
      for (int h = 0; indexed && h < IH; ++h) {
        float* qh = iq + (size_t(row) * IH + h) * ID;
        ref::rope_apply(qh + ID - rd, rd, cs, false);
        kern::act_qdq_fp4_e8m0(qh, ID);
        iw[row * IH + h] = round_bf16(iw[row * IH + h] * wscale);
      }
    }
  });

  float* o = sized(ws.attn_out, size_t(N) * H * D);
  const float scale = float(std::pow(double(D), -0.5));
  // Compressed KV and index selections of every sequence first, so the attention below is one
  // parallel loop over the whole batch (one pool job per layer, not one per sequence). The
  // compressor's projections, like the indexer's, run once over all rows.
  float *comp_kv = nullptr, *comp_gate = nullptr;
  timer.next(DI_PHASE_ID("attn.compress, index"));
  if (ratio && A.has_compressor) {
    comp_kv = sized(ws.comp_proj, size_t(N) * (ratio > 1 ? 2 : 1) * D);
    linear(x, N, A.compressor.wkv, comp_kv, ratio == 1);
    if (ratio > 1) linear(x, N, A.compressor.wgate, comp_gate = comp_kv + size_t(N) * D, false);
  }
  if (ratio)
    for (Segment& g : c.segs) {
      if (A.has_compressor) {
        if (!g.replay) compress(layer, c, g, comp_kv + size_t(g.row0) * D, comp_gate ? comp_gate + size_t(g.row0) * D : nullptr);
        g.kv_source = layer;
      }
      if (indexed) index_select(layer, c, g, iq + size_t(g.row0) * IH * ID, iw + size_t(g.row0) * IH);
    }
  int32_t* seg_of_row = sized(ws.row_segment, size_t(N));
  for (size_t gi = 0; gi < c.segs.size(); ++gi)
    std::fill(seg_of_row + c.segs[gi].row0, seg_of_row + c.segs[gi].row0 + c.segs[gi].S, int32_t(gi));
  auto compressed_of = [&](const Segment& g) -> const RowCache* {
    return (ratio && g.kv_source >= 0) ? &g.st->layers()[size_t(g.kv_source)].compressed_kv : nullptr;
  };
  // The fast kernels read the rows as bf16. A prompt chunk's queries attend to mostly the same
  // rows, so such a segment converts each once here ([window rows before the chunk][the chunk's
  // rows][compressed entries]) instead of once per query; decode rows pass the fp32 rows.
  constexpr int kRows16MinRows = 16;
  size_t* off16 = sized(ws.rows16_off, c.segs.size());
  size_t slots16 = 0;
  for (size_t gi = 0; gi < c.segs.size(); ++gi) {
    const Segment& g = c.segs[gi];
    off16[gi] = SIZE_MAX;
    if (numerics_ != Numerics::Fast || D % 32 || g.S < kRows16MinRows) continue;
    const RowCache* ckv = compressed_of(g);
    const int64_t w0 = std::max<int64_t>(0, g.start - W + 1);
    const int64_t ncomp = ckv ? std::min<int64_t>(ckv->size(), (g.start + g.S) / ratio) : 0;
    const float** src = sized(ws.rows16_src, slots16 + size_t(g.start - w0 + g.S + ncomp)) + slots16;
    const auto& Ls = g.st->layers()[size_t(layer)];
    for (int64_t p = w0; p < g.start; ++p) *src++ = Ls.window.data() + size_t(p % g.st->window_cap()) * D;
    for (int64_t s = 0; s < g.S; ++s) *src++ = kv + size_t(g.row0 + s) * D;
    for (int64_t e = 0; e < ncomp; ++e) *src++ = ckv->row<float>(e);
    off16[gi] = slots16;
    slots16 += size_t(g.start - w0 + g.S + ncomp);
  }
  uint16_t* rows16 = sized(ws.rows16, slots16 * size_t(D));
  if (slots16)
    for_rows(int64_t(slots16), [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i)
        for (int d = 0; d < D; ++d) rows16[size_t(i) * D + d] = f32_to_bf16(ws.rows16_src[size_t(i)][d]);
    });
  // Work items: (row, group of heads); with fewer rows than threads (decode of one sequence) the
  // heads are split too (heads are independent: the same bits for any split).
  const int64_t parts = row_parts(N);
  timer.next(DI_PHASE_ID("attn.core"));
  for_rows(N * parts, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<const float*> rows;
    thread_local std::vector<const uint16_t*> rows_b;
    for (int64_t i = i0; i < i1; ++i) {
      const size_t gi = size_t(seg_of_row[i / parts]);
      const Segment& g = c.segs[gi];
      const int64_t s = i / parts - g.row0;
      const int h0 = int(i % parts * H / parts), h1 = int((i % parts + 1) * H / parts);
      const int64_t t = g.start + s;
      const float* gkv = kv + size_t(g.row0) * D;
      const auto& Ls = g.st->layers()[size_t(layer)];
      const int cap = g.st->window_cap();
      const RowCache* ckv = compressed_of(g);
      const int k = ratio ? g.topk_k : 0;
      const int32_t* topk = ws.topk.data() + g.topk_off;
      float* os = o + size_t(g.row0 + s) * H * D;
      const float* qs = q + (size_t(g.row0 + s) * H + h0) * D;
      // Canonical list for position t: window positions ascending, padded to `window` with -1,
      // then the selected compressed entries. It depends on t only, so chunking cannot change it.
      auto fill = [&](auto& list, auto window_row, auto compressed_row) {
        list.resize(size_t(W + k));
        int n = 0;
        for (int64_t p = std::max<int64_t>(0, t - W + 1); p <= t; ++p) list[size_t(n++)] = window_row(p);
        while (n < W) list[size_t(n++)] = nullptr;
        for (int j = 0; j < k; ++j) {
          const int32_t e = topk[size_t(s) * k + size_t(j)];
          list[size_t(n++)] = e >= 0 ? compressed_row(e) : nullptr;
        }
        return n;
      };
      if (off16[gi] != SIZE_MAX) {
        const int64_t w0 = std::max<int64_t>(0, g.start - W + 1);
        const uint16_t* base = rows16 + off16[gi] * D;
        const int n = fill(
            rows_b, [&](int64_t p) { return base + size_t(p - w0) * D; },
            [&](int32_t e) { return base + size_t(g.start - w0 + g.S + e) * D; });
        kern::fast::sparse_attention_bf16(qs, h1 - h0, D, rows_b.data(), n, A.attn_sink.p + h0, scale, os + size_t(h0) * D);
      } else {
        const int n = fill(
            rows,
            [&](int64_t p) {
              return p >= g.start ? gkv + size_t(p - g.start) * D : Ls.window.data() + size_t(p % cap) * D;
            },
            [&](int32_t e) { return ckv->row<float>(e); });
        sparse_attention(qs, h1 - h0, D, rows.data(), n, A.attn_sink.p + h0, scale, os + size_t(h0) * D);
      }
      const float* cs = cs_rows + size_t(g.row0 + s) * rd;
      for (int h = h0; h < h1; ++h) ref::rope_apply(os + size_t(h) * D + D - rd, rd, cs, true);
    }
  }, kGrowingWorkChunks);
  for (Segment& g : c.segs) {
    const float* gkv = kv + size_t(g.row0) * D;
    auto& Ls = g.st->layers()[size_t(layer)];
    const int cap = g.st->window_cap();
    for (int64_t p = std::max<int64_t>(g.start, g.start + g.S - cap); p < g.start + g.S; ++p)
      std::copy(gkv + size_t(p - g.start) * D, gkv + size_t(p - g.start + 1) * D, Ls.window.data() + size_t(p % cap) * D);
  }

  // Grouped low-rank output: group g projects only its own heads (block-diagonal wo_a).
  const int gin = H * D / G;
  float* z = sized(ws.y, size_t(N) * G * R);
  float* gxs = sized(ws.tmp, size_t(G) * N * gin);
  float* gzs = sized(ws.mix, size_t(G) * N * R);
  // The copies run over the pool's rows when the groups run one after the other (many rows),
  // inline inside a group's task when the groups are concurrent tasks (decode).
  timer.next(DI_PHASE_ID("attn.wo_a"));
  for_tasks(N, G, [&](int gi) {
    float* gx = gxs + size_t(gi) * N * gin;
    float* gz = gzs + size_t(gi) * N * R;
    for_rows(N, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s)
        std::copy(o + size_t(s) * H * D + size_t(gi) * gin, o + size_t(s) * H * D + size_t(gi + 1) * gin, gx + size_t(s) * gin);
    });
    const ref::Fp8Weight wg = kern::fp8_rows(A.wo_a, int64_t(gi) * R, R);
    linear_wo_a(gx, N, wg, gz);
    for_rows(N, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) std::copy(gz + size_t(s) * R, gz + size_t(s + 1) * R, z + size_t(s) * G * R + size_t(gi) * R);
    });
  });
  timer.next(DI_PHASE_ID("attn.wo_b"));
  linear(z, N, A.wo_b, out);
}

void Model::moe(int layer, Ctx& c, const float* x, float* out) const {
  const auto& F = w_.layers[size_t(layer)].moe;
  auto& ws = c.ws;
  const int E = cfg_.n_routed_experts, K = cfg_.n_activated_experts, dim = cfg_.dim, I = cfg_.moe_inter_dim;
  const int N = c.R;
  const float L = cfg_.swiglu_limit;
  // Router over all rows: fp32 sqrt(softplus) scores; the bias picks, the raw scores weigh.
  float* scores = sized(ws.scores, size_t(N) * E);
  int32_t* ids = sized(ws.expert_ids, size_t(N) * K);
  float* wts = sized(ws.expert_w, size_t(N) * K);
  phase::Scope timer(DI_PHASE_ID("moe.router"));
  linear(x, N, F.gate, scores, false);
  for_rows(N, [&](int64_t s0, int64_t s1) {
    thread_local std::vector<float> biased;
    thread_local std::vector<int32_t> order;
    biased.resize(size_t(E));
    for (int64_t s = s0; s < s1; ++s) {
      float* sc = scores + size_t(s) * E;
      for (int e = 0; e < E; ++e) {
        sc[e] = std::sqrt(ref::softplus(sc[e]));
        biased[size_t(e)] = sc[e] + F.gate_bias.p[e];
      }
      int32_t* sel = ids + size_t(s) * K;
      float* w = wts + size_t(s) * K;
      topk_desc(biased.data(), E, K, sel, order);
      float sum = 0.f;
      for (int k = 0; k < K; ++k) sum += (w[k] = sc[sel[k]]);
      for (int k = 0; k < K; ++k) {
        if (cfg_.norm_topk_prob && K > 1) w[k] /= (sum + 1e-20f);
        w[k] *= cfg_.route_scale;
      }
    }
  });
  if (c.opts.observer)
    for (const Segment& g : c.segs)
      c.opts.observer->on_experts(layer, g.start, g.S, K, ids + size_t(g.row0) * K, wts + size_t(g.row0) * K);

  // SwiGLU with the training clamps (up both sides, gate from above) in fp32, times the routing
  // weight, one bf16 rounding before w2.
  auto swiglu = [&](float* g, const float* u, int m, const float* weight) { kern::swiglu(g, u, m, I, L, weight); };
  // Routed experts: each expert runs once over the rows that chose it. The active experts are
  // spread over the pool (one dispatch per layer, each expert single-threaded on one core, both
  // cores streaming different experts); then the rows accumulate their experts' outputs in fp32
  // in expert-id order, so the result does not depend on the split.
  float* acc = sized(ws.moe_acc, size_t(N) * dim);
  std::fill(acc, acc + size_t(N) * dim, 0.f);
  const size_t slots = size_t(N) * K;
  int32_t* rows = sized(ws.slots, slots);  // expert-major: the rows of each active expert
  float* rw = sized(ws.block_scores, slots);
  float* gx = sized(ws.tmp, slots * dim);
  // Slots [0, slots) are the routed experts' rows, [slots, slots + N) the shared expert's.
  float* g = sized(ws.moe_gate, (slots + N) * I);
  float* u = sized(ws.moe_up, (slots + N) * I);
  float* eo = sized(ws.moe_out, (slots + N) * dim);
  int32_t* active = sized(ws.order, size_t(E) + 1);  // ids of the active experts
  int32_t* first = sized(ws.top_blocks, size_t(E) + 1);  // their first slot (and the end)
  int n_active = 0, m_total = 0;
  for (int e = 0; e < E; ++e) {
    const int m0 = m_total;
    for (int s = 0; s < N; ++s)
      for (int k = 0; k < K; ++k)
        if (ids[size_t(s) * K + k] == e) {
          rows[m_total] = s;
          rw[m_total] = wts[size_t(s) * K + k];
          ++m_total;
        }
    if (m_total > m0) active[n_active] = e, first[n_active++] = m0;
  }
  first[n_active] = m_total;
  // Decode (few rows): each expert's task gathers its own input rows (a separate pool job would
  // cost more than the copy; on the caller, the copy was serial) and the shared expert is one
  // more task of the experts' job (see for_tasks).
  const bool decode = N <= kTaskParallelRows;
  auto gather = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::copy(x + size_t(rows[r]) * dim, x + size_t(rows[r] + 1) * dim, gx + size_t(r) * dim);
  };
  timer.next(DI_PHASE_ID("moe.experts"));
  if (!decode) for_rows(m_total, gather);
  // Shared expert over every row (its output added once, after the routed ones).
  float* gs = g + slots * I;
  float* us = u + slots * I;
  float* eos = eo + slots * dim;
  auto shared_expert = [&] {
    linear(x, N, F.shared.w1, gs);
    linear(x, N, F.shared.w3, us);
    for_rows(N, [&](int64_t s0, int64_t s1) { swiglu(gs + s0 * I, us + s0 * I, int(s1 - s0), nullptr); });
    linear(gs, N, F.shared.w2, eos);
  };
  // As a task the shared expert goes first: it is the largest (FP8, about twice a routed
  // expert's bytes), and the pool hands tasks out in order, so placed last it ran alone on one
  // thread while the other waited.
  for_rows(n_active + decode, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t a = decode ? (i == 0 ? n_active : i - 1) : i;
      if (a == n_active) {
        shared_expert();
        continue;
      }
      const auto& X = F.experts[size_t(active[a])];
      const int m0 = first[a], m = first[a + 1] - m0;
      float* ga = g + size_t(m0) * I;
      float* ua = u + size_t(m0) * I;
      if (decode) gather(m0, m0 + m);
      linear(gx + size_t(m0) * dim, m, X.w1, ga);
      linear(gx + size_t(m0) * dim, m, X.w3, ua);
      swiglu(ga, ua, m, rw + m0);
      linear(ga, m, X.w2, eo + size_t(m0) * dim);
    }
  });
  if (!decode) {
    timer.next(DI_PHASE_ID("moe.shared expert"));
    shared_expert();
  }
  timer.next(DI_PHASE_ID("moe.combine"));
  // Each row adds its experts' outputs in slot (= expert-id) order, whichever thread owns the row,
  // then the shared expert's, with one bf16 rounding.
  for_rows(N, [&](int64_t s0, int64_t s1) {
    for (int r = 0; r < m_total; ++r)
      if (rows[r] >= s0 && rows[r] < s1)
        for (int d = 0; d < dim; ++d) acc[size_t(rows[r]) * dim + d] += eo[size_t(r) * dim + d];
    for (size_t i = size_t(s0) * dim; i < size_t(s1) * dim; ++i) out[i] = round_bf16(acc[i] + eos[i]);
  });
}

void Model::block(int layer, Ctx& c) const {
  const auto& L = w_.layers[size_t(layer)];
  auto& ws = c.ws;
  const int S = c.R, hc = cfg_.hc_mult, dim = cfg_.dim;
  float* attn_pre = sized(ws.coef_pre, size_t(S) * hc);
  float* ffn_pre = sized(ws.next_pre, size_t(S) * hc);
  float* post = sized(ws.coef_post, size_t(S) * hc);
  float* comb = sized(ws.coef_comb, size_t(S) * hc * hc);
  float* x = sized(ws.x, size_t(S) * dim);
  float* f = sized(ws.f, size_t(S) * dim);
  float* next = sized(ws.stream2, size_t(S) * hc * dim);
  const size_t n_stream = size_t(S) * hc * dim;

  // Attention: collapses with the incoming pre_mix; its own `pre` is used by the FFN.
  // Per-row steps run over the pool's rows (each row's bits are its own).
  auto collapse_norm = [&](const float* mix, const Bf16Vec& norm) {
    for_rows(S, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        kern::hc_collapse(c.stream + size_t(s) * hc * dim, mix + s * hc, hc, dim, x + size_t(s) * dim);
        rms_norm(x + size_t(s) * dim, norm, dim, x + size_t(s) * dim);
      }
    });
  };
  auto expand = [&] {
    for_rows(S, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s)
        kern::hc_expand(f + size_t(s) * dim, c.stream + size_t(s) * hc * dim, post + s * hc, comb + s * hc * hc, hc, dim,
                        next + size_t(s) * hc * dim);
    });
    // The new streams become the current ones by swapping buffers (a copy was a serial pass over
    // S x hc x dim floats, twice per layer).
    std::swap(ws.stream, ws.stream2);
    c.stream = ws.stream.data();
    next = sized(ws.stream2, n_stream);
  };
  // mHC phases (attention and MoE time their own).
  const int mhc_mix = DI_PHASE_ID("mhc.coefficients"), mhc_collapse = DI_PHASE_ID("mhc.collapse, norm"),
            mhc_expand = DI_PHASE_ID("mhc.expand");
  phase::Scope timer(mhc_mix);
  hc_mixes(L.hc_attn, c.stream, S, attn_pre, post, comb, ws);
  timer.next(mhc_collapse);
  collapse_norm(c.pre_mix, L.attn_norm);
  attention(layer, c, x, f);
  timer.next(mhc_expand);
  expand();

  // FFN: collapses with the attention's pre; its own pre goes to the next block.
  timer.next(mhc_mix);
  hc_mixes(L.hc_ffn, c.stream, S, ffn_pre, post, comb, ws);
  timer.next(mhc_collapse);
  collapse_norm(attn_pre, L.ffn_norm);
  moe(layer, c, x, f);
  timer.next(mhc_expand);
  expand();
  std::copy(ffn_pre, ffn_pre + size_t(S) * hc, c.pre_mix);
}

void Model::run_layers(Ctx& c, std::span<const std::span<const int32_t>> tokens) const {
  const auto& cf = cfg_;
  auto& ws = c.ws;
  auto& segs = c.segs;
  const auto& opts = c.opts;
  const int R = c.R, hc = cf.hc_mult, dim = cf.dim;
  ws.topk_used = ws.candidate_mask_used = 0;
  phase::Scope timer(DI_PHASE_ID("embed, engram hashes"));
  float* stream = sized(ws.stream, size_t(R) * hc * dim);
  float* pre_mix = sized(ws.pre_mix, size_t(R) * hc);
  int64_t* row_pos = sized(ws.row_pos, size_t(R));
  for (const Segment& g : segs)
    for (int s = 0; s < g.S; ++s) row_pos[g.row0 + s] = g.start + s;

  if (engram_.n_layers() > 0) {
    // Hash ids depend on token ids only: compute them for every Engram layer up front.
    const int per_tok = engram_.n_layers() * engram_.hash_cols();
    int32_t* hid = sized(ws.hash_ids, size_t(R) * per_tok);
    int32_t* comp = sized(ws.comp_tokens, size_t(R));
    for (size_t b = 0; b < segs.size(); ++b) {
      const Segment& g = segs[b];
      const auto& hist_tokens = g.st->tokens();
      const int nh = int(std::min<int64_t>(g.start, EngramHistory::kCapacity));
      int32_t* tail = sized(ws.history, size_t(nh) + 1);
      engram_compress_tokens(token_map_, std::span(hist_tokens).subspan(size_t(g.start - nh), size_t(nh)), {}, tail);
      EngramHistory hist;
      hist.assign(g.start, std::span<const int32_t>(tail, size_t(nh)));
      engram_compress_tokens(token_map_, tokens[b], {}, comp + g.row0);
      engram_hash_ids_all_layers(engram_, hist, std::span<const int32_t>(comp + g.row0, size_t(g.S)),
                                 hid + size_t(g.row0) * per_tok);
      if (opts.observer) opts.observer->on_engram_hash(g.start, g.S, per_tok, hid + size_t(g.row0) * per_tok);
    }
  }
  for (size_t b = 0; b < segs.size(); ++b)
    for (int s = 0; s < segs[b].S; ++s) {
      const size_t row = size_t(segs[b].row0 + s);
      const uint16_t* e = w_.embed.p + int64_t(tokens[b][size_t(s)]) * dim;
      for (int k = 0; k < hc; ++k)
        for (int d = 0; d < dim; ++d) stream[(row * hc + k) * dim + d] = bf16_to_f32(e[d]);
      for (int k = 0; k < hc; ++k) pre_mix[row * hc + k] = k == 0 ? 1.f : 0.f;
    }
  c.stream = stream;
  c.pre_mix = pre_mix;
  timer.end();
  ForwardObserver* ob = opts.observer;
  auto seg_stream = [&](const Segment& g) { return c.stream + size_t(g.row0) * hc * dim; };
  auto seg_pre = [&](const Segment& g) { return pre_mix + size_t(g.row0) * hc; };
  for (int i = 0; i < cf.n_layers; ++i) {
    if (w_.layers[size_t(i)].has_engram) {
      if (ob) for (const auto& g : segs) ob->before_engram(i, g.start, g.S, seg_stream(g));
      engram(i, c);
      if (ob) for (const auto& g : segs) ob->after_engram(i, g.start, g.S, seg_stream(g));
    }
    if (ob) for (const auto& g : segs) ob->before_block(i, g.start, g.S, seg_stream(g), seg_pre(g));
    block(i, c);
    if (ob) for (const auto& g : segs) ob->after_block(i, g.start, g.S, seg_stream(g), seg_pre(g));
  }
}

void Model::rebuild_windows(SequenceState& st, Workspace& ws) const {
  kern::ScopedDefaultPool pool_scope(pool_.get());
  const int64_t n = st.pos();
  if (n == 0) return;
  const int64_t s0 = std::max<int64_t>(0, n - replay_tokens());
  std::vector<detail::Segment>& segs = ws.segments;
  segs.assign(1, detail::Segment{});
  segs[0].st = &st;
  segs[0].start = s0;
  segs[0].S = int(n - s0);
  segs[0].replay = true;
  const std::span<const int32_t> toks = std::span(st.tokens()).subspan(size_t(s0));
  ForwardOptions none;
  Ctx c{ws, none, segs, int(n - s0), nullptr, nullptr};
  run_layers(c, std::span(&toks, 1));
}

void Model::forward(SequenceState& st, std::span<const int32_t> tokens, std::vector<float>& logits,
                    const ForwardOptions& opts, Workspace& ws) const {
  BatchItem item{&st, tokens, opts.all_logits, &logits};
  forward_batch(std::span(&item, 1), opts, ws);
}

void Model::forward_batch(std::span<BatchItem> items, const ForwardOptions& opts, Workspace& ws) const {
  kern::ScopedDefaultPool pool_scope(pool_.get());
  const auto& cf = cfg_;
  // Validate everything before any state changes.
  if (items.empty()) throw std::invalid_argument("forward: empty batch");
  int R = 0;
  for (size_t b = 0; b < items.size(); ++b) {
    const auto& it = items[b];
    if (!it.state || !it.logits) throw std::invalid_argument("forward: batch item " + std::to_string(b) + " has no state or output");
    if (it.tokens.empty()) throw std::invalid_argument("forward: empty chunk (batch item " + std::to_string(b) + ")");
    const int64_t limit = sampleable_vocab();
    for (size_t s = 0; s < it.tokens.size(); ++s)
      if (it.tokens[s] < 0 || it.tokens[s] >= limit)
        throw std::out_of_range("forward: token id " + std::to_string(it.tokens[s]) + " at chunk position " +
                                std::to_string(s) + " is outside the vocabulary [0, " + std::to_string(limit) +
                                ")" + (limit < cf.vocab_size ? " (ids the tokenizer does not define)" : ""));
    for (size_t o = 0; o < b; ++o)
      if (items[o].state == it.state) throw std::invalid_argument("forward: a sequence appears twice in one batch");
    R += int(it.tokens.size());
  }
  std::vector<Segment>& segs = ws.segments;
  segs.assign(items.size(), Segment{});
  for (size_t b = 0, row = 0; b < items.size(); ++b) {
    segs[b].st = items[b].state;
    segs[b].start = items[b].state->pos();
    segs[b].S = int(items[b].tokens.size());
    segs[b].row0 = int(row);
    row += items[b].tokens.size();
  }
  // The pool must hold every page this step allocates: check before any state changes.
  for (size_t b = 0; b < items.size(); ++b) {
    PagePool* pool = items[b].state->pool();
    if (!pool) continue;
    bool first = true;  // sum each pool's needs once, at its first item
    for (size_t o = 0; o < b; ++o) first &= items[o].state->pool() != pool;
    if (!first) continue;
    size_t bytes = 0;
    for (size_t o = b; o < items.size(); ++o)
      if (items[o].state->pool() == pool) bytes += items[o].state->bytes_needed(int64_t(items[o].tokens.size()));
    if (bytes > pool->free_bytes())
      throw CacheExhausted("forward: step needs " + std::to_string(bytes) + " cache bytes, " +
                           std::to_string(pool->free_bytes()) + " free");
  }
  std::vector<std::span<const int32_t>>& spans = ws.token_spans;
  spans.clear();
  for (const auto& it : items) spans.push_back(it.tokens);
  Ctx c{ws, opts, segs, R, nullptr, nullptr};
  run_layers(c, spans);
  const int hc = cf.hc_mult, dim = cf.dim;
  float* stream = c.stream;
  float* pre_mix = c.pre_mix;
  ForwardObserver* ob = opts.observer;
  // Final collapse, norm and head for the rows whose logits are wanted.
  DI_PHASE("head");
  std::vector<int>& out_rows = ws.out_rows;
  out_rows.clear();
  for (size_t b = 0; b < items.size(); ++b)
    for (int s = items[b].all_logits ? 0 : segs[b].S - 1; s < segs[b].S; ++s) out_rows.push_back(segs[b].row0 + s);
  const int rows = int(out_rows.size());
  float* hidden = sized(ws.logits_rows, size_t(rows) * dim);
  for (int r = 0; r < rows; ++r) {
    const int s = out_rows[size_t(r)];
    kern::hc_collapse(stream + size_t(s) * hc * dim, pre_mix + size_t(s) * hc, hc, dim, hidden + size_t(r) * dim);
    rms_norm(hidden + size_t(r) * dim, w_.norm, dim, hidden + size_t(r) * dim);
  }
  const size_t V = size_t(cf.vocab_size);
  // One head pass for all rows of the batch: the head is the largest weight, read once per step.
  float* all_logits = items.size() == 1 ? (items[0].logits->resize(size_t(rows) * V), items[0].logits->data())
                                        : sized(ws.head_out, size_t(rows) * V);
  head(hidden, rows, all_logits);
  for (size_t b = 0, r = 0; b < items.size(); ++b) {
    const int n = items[b].all_logits ? segs[b].S : 1;
    if (ob) ob->on_final_hidden(segs[b].start + segs[b].S - n, n, hidden + r * dim);
    if (items.size() > 1) items[b].logits->assign(all_logits + r * V, all_logits + (r + size_t(n)) * V);
    r += size_t(n);
    auto& toks = items[b].state->mutable_tokens();
    toks.insert(toks.end(), items[b].tokens.begin(), items[b].tokens.end());
  }
}

}  // namespace di::v41
