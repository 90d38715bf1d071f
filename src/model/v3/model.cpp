#include "model/v3/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <stdexcept>

#include "core/dtypes.h"
#include "core/phase_profile.h"
#include "core/thread_pool.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/mla.h"

namespace di::v3 {

float Model::round_bf16_(float v) { return round_bf16(v); }

std::unique_ptr<Model> Model::load(const std::string& model_dir, const LoadOptions& opts) {
  auto cancelled = [&] {
    if (opts.cancel && opts.cancel->load()) throw LoadCancelled(model_dir + ": model loading cancelled");
  };
  std::unique_ptr<Model> m(new Model());
  m->cfg_ = V3Config::from_hf_file(model_dir + "/config.json");
  cancelled();
  m->ckpt_ = std::make_unique<Checkpoint>(Checkpoint::open(model_dir));
  cancelled();
  m->w_ = bind_weights(*m->ckpt_, m->cfg_);
  m->mode_ = opts.fp32 ? Mode::Fp32 : mode_of(opts.numerics);
  if (opts.threads > 0) m->pool_ = std::make_unique<ThreadPool>(opts.threads);
  if (opts.head_fp8 && m->w_.head.bf16) {
    Linear& h = m->w_.head;
    m->head_codes_.resize(size_t(h.out * h.in));
    m->head_scales_.resize(size_t(((h.out + 127) / 128) * ((h.in + 127) / 128)));
    quantize_fp8_blocks(h.bf16, h.out, h.in, m->head_codes_.data(), m->head_scales_.data(), m->pool_.get());
    h.fp8 = m->head_codes_.data();
    h.scale = m->head_scales_.data();
    h.bf16 = nullptr;
    h.bo = h.bi = 128;
  }
  // kv_b dequantized once in the mode's precision (the official absorb path dequantizes it to the
  // default dtype on every call): W_UK transposed per head for q_nope' and W_UV as stored.
  {
    const V3Config& c = m->cfg_;
    const int64_t H = c.n_heads, nope = c.qk_nope_head_dim, kvl = c.kv_lora_rank, per_head = nope + c.v_head_dim;
    for (const auto& L : m->w_.layers) {
      Absorbed a;
      a.wkv_b.resize(size_t(H * per_head * kvl));
      dequant_rows(L.attn.wkv_b, 0, H * per_head, m->mode_ != Mode::Fp32, a.wkv_b.data());
      const int64_t vd = c.v_head_dim;
      if (m->mode_ == Mode::Fast) {  // the fast mode reads W_UK as stored and W_UV transposed
        a.uv_t.resize(size_t(H * kvl * vd));
        for (int64_t h = 0; h < H; ++h)
          for (int64_t v = 0; v < vd; ++v)
            for (int64_t cc = 0; cc < kvl; ++cc)
              a.uv_t[size_t((h * kvl + cc) * vd + v)] = a.wkv_b[size_t((h * per_head + nope + v) * kvl + cc)];
      } else {
        a.uk_t.resize(size_t(H * kvl * nope));
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < nope; ++d)
            for (int64_t cc = 0; cc < kvl; ++cc)
              a.uk_t[size_t((h * kvl + cc) * nope + d)] = a.wkv_b[size_t((h * per_head + d) * kvl + cc)];
      }
      m->absorbed_.push_back(std::move(a));
      cancelled();
    }
  }
  m->freqs_.resize(size_t(m->cfg_.qk_rope_head_dim / 2));
  m->cfg_.rope_freqs(m->freqs_.data());
  // The official code multiplies by the Python float, i.e. by its fp32 value.
  m->softmax_scale_ = float(m->cfg_.softmax_scale());
  ModelInfo& i = m->info_;
  const V3Config& c = m->cfg_;
  i.vocab_size = i.sampleable_vocab = c.vocab_size;
  i.max_context = c.max_position_embeddings;
  i.bos_id = int32_t(c.bos_token_id);
  i.eos_id = int32_t(c.eos_token_id);
  // V3.1 is the release with ue8m0 scales; V3 and R1 share the rest of the format.
  i.chat_format = c.scale_fmt == "ue8m0" ? "deepseek-v3.1" : "deepseek-v3";
  i.numerics = opts.numerics;
  i.arch = "deepseek_v3";
  i.cache_format = "v3;fp32-rows;" + std::string(mode_name(m->mode_)) + ";vocab=" + std::to_string(c.vocab_size) +
                   ";dim=" + std::to_string(c.dim) + ";layers=" + std::to_string(c.n_layers) +
                   ";kv_lora=" + std::to_string(c.kv_lora_rank) + ";rope=" + std::to_string(c.qk_rope_head_dim) +
                   (opts.head_fp8 ? ";head=fp8" : "");
  return m;
}

std::unique_ptr<di::Model> load_as_model(const std::string& model_dir, const di::LoadOptions& opts) {
  LoadOptions lo;
  lo.numerics = opts.numerics;
  lo.cancel = opts.cancel;
  lo.threads = opts.threads > 0 ? opts.threads : ThreadPool::default_threads();
  for (const auto& [key, value] : opts.arch_options) {
    if (key == "head" && (value == "bf16" || value == "fp8")) {
      lo.head_fp8 = value == "fp8";
    } else {
      throw LoadError(model_dir + ": unknown DeepSeek-V3 load option " + key + "=" + value + " (known: head=bf16|fp8)");
    }
  }
  return Model::load(model_dir, lo);
}

std::vector<kvcache::StreamLayout> Model::cache_layout(int page_tokens) const {
  std::vector<kvcache::StreamLayout> out;
  for (int i = 0; i < cfg_.n_layers; ++i)
    out.push_back({"layer" + std::to_string(i) + ".latent_rope", page_tokens,
                   size_t(cfg_.kv_lora_rank + cfg_.qk_rope_head_dim) * sizeof(float), kvcache::ElementType::F32});
  return out;
}

std::unique_ptr<di::SequenceState> Model::new_state(const StateOptions& o) const {
  return std::make_unique<SequenceState>(cfg_, o.max_rollback, o.page_tokens, o.pool);
}

namespace {
SequenceState& own_state(di::SequenceState* s) { return own_object<SequenceState>(*s); }
Workspace& own_workspace(di::Workspace& ws) { return own_object<Workspace>(ws); }
}  // namespace

void Model::forward_batch(std::span<di::BatchItem> items, di::Workspace& ws) const {
  Workspace& w = own_workspace(ws);
  w.items.clear();
  for (const auto& it : items) {
    if (!it.state) throw std::invalid_argument("forward: batch item without a state");
    w.items.push_back({&own_state(it.state), it.tokens, it.all_logits, it.logits});
  }
  forward_batch(w.items, ForwardOptions{false, w.observer}, w);
}

void Model::resume(di::SequenceState& state, di::Workspace& ws) const {
  own_state(&state);
  own_workspace(ws);
}

size_t Model::page_bytes(int page_tokens) const {
  return size_t(page_tokens) * size_t(cfg_.kv_lora_rank + cfg_.qk_rope_head_dim) * sizeof(float) * size_t(cfg_.n_layers);
}

struct Model::Ctx {
  std::span<BatchItem> items;
  const ForwardOptions* opts;
  Workspace* ws;
  int64_t R = 0;  // rows of the step
  std::vector<int64_t> start, row0;  // per item: first position, first row
};

void Model::forward(SequenceState& state, std::span<const int32_t> tokens, std::vector<float>& logits,
                    const ForwardOptions& opts, Workspace& ws) const {
  BatchItem it{&state, tokens, opts.all_logits, &logits};
  forward_batch(std::span<BatchItem>(&it, 1), opts, ws);
}

void Model::forward_batch(std::span<BatchItem> items, const ForwardOptions& opts, Workspace& ws) const {
  kern::ScopedDefaultPool pool_scope(pool_.get());
  const V3Config& c = cfg_;
  std::set<const SequenceState*> seen;
  int64_t R = 0;
  for (const BatchItem& it : items) {
    if (!it.state) throw std::invalid_argument("forward_batch: item without a state");
    if (!seen.insert(it.state).second) throw std::invalid_argument("forward_batch: a state appears twice");
    if (it.tokens.empty()) throw std::invalid_argument("forward_batch: item without tokens");
    if (!it.logits) throw std::invalid_argument("forward_batch: item without a logits output");
    if (int64_t(it.state->caches().size()) != c.n_layers)
      throw std::invalid_argument("forward_batch: state of another model");
    for (int32_t t : it.tokens)
      if (t < 0 || t >= c.vocab_size)
        throw std::invalid_argument("forward_batch: token id " + std::to_string(t) + " outside the vocabulary");
    if (it.state->pos() + int64_t(it.tokens.size()) > c.max_position_embeddings)
      throw std::invalid_argument("forward_batch: " + std::to_string(it.state->pos() + int64_t(it.tokens.size())) +
                                  " positions exceed max_position_embeddings " +
                                  std::to_string(c.max_position_embeddings));
    R += int64_t(it.tokens.size());
  }
  if (items.empty()) return;
  // Pages for every item, checked per pool before any state changes.
  std::vector<std::pair<PagePool*, size_t>> need;
  for (const BatchItem& it : items) {
    PagePool* p = it.state->pool();
    if (!p) continue;
    auto n = std::find_if(need.begin(), need.end(), [&](const auto& e) { return e.first == p; });
    if (n == need.end()) need.push_back({p, 0}), n = need.end() - 1;
    n->second += it.state->bytes_needed(int64_t(it.tokens.size()));
  }
  for (const auto& [p, bytes] : need)
    if (bytes > p->free_bytes())
      throw CacheExhausted("KV cache pool exhausted: the step needs " + std::to_string(bytes) + " bytes, " +
                           std::to_string(p->free_bytes()) + " free");

  phase::Scope timer(DI_PHASE_ID("embed, rope tables"));
  Ctx cx;
  cx.items = items;
  cx.opts = &opts;
  cx.ws = &ws;
  cx.R = R;
  ws.row_pos.resize(size_t(R));
  ws.row_item.resize(size_t(R));
  const int half = c.qk_rope_head_dim / 2;
  ws.cs.resize(size_t(R) * size_t(c.qk_rope_head_dim));
  ws.x.resize(size_t(R) * size_t(c.dim));
  int64_t r = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    cx.start.push_back(items[i].state->pos());
    cx.row0.push_back(r);
    for (size_t j = 0; j < items[i].tokens.size(); ++j, ++r) {
      const int64_t p = items[i].state->pos() + int64_t(j);
      ws.row_pos[size_t(r)] = p;
      ws.row_item[size_t(r)] = int32_t(i);
      for (int k = 0; k < half; ++k) {
        const float angle = float(p) * freqs_[size_t(k)];  // torch.outer(t, freqs) in fp32
        ws.cs[size_t(r * c.qk_rope_head_dim + 2 * k)] = std::cos(angle);
        ws.cs[size_t(r * c.qk_rope_head_dim + 2 * k + 1)] = std::sin(angle);
      }
      const uint16_t* e = w_.embed.p + int64_t(items[i].tokens[j]) * c.dim;
      for (int d = 0; d < c.dim; ++d) ws.x[size_t(r * c.dim + d)] = bf16_to_f32(e[d]);
    }
  }

  timer.end();
  try {
    for (int L = 0; L < c.n_layers; ++L) {
      attention(L, cx);
      ffn(L, cx);
    }
  } catch (...) {
    for (size_t i = 0; i < items.size(); ++i)
      for (auto& cache : items[i].state->caches()) cache.truncate(std::min(cache.size(), cx.start[i]));
    throw;
  }

  // Final norm and head on the rows whose logits are wanted.
  DI_PHASE("head");
  std::vector<int64_t> out_rows;
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t n = int64_t(items[i].tokens.size());
    const bool all = items[i].all_logits || opts.all_logits;
    for (int64_t j = all ? 0 : n - 1; j < n; ++j) out_rows.push_back(cx.row0[i] + j);
  }
  const int64_t O = int64_t(out_rows.size());
  ws.xn.resize(size_t(O) * size_t(c.dim));
  for (int64_t o = 0; o < O; ++o)
    rms_norm(mode_, ws.x.data() + out_rows[size_t(o)] * c.dim, w_.norm.p, c.dim, c.rms_norm_eps,
             ws.xn.data() + o * c.dim);
  ws.logits_rows.resize(size_t(O) * size_t(c.vocab_size));
  linear(mode_, ws.xn.data(), O, w_.head, ws.logits_rows.data());
  int64_t o = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    BatchItem& it = items[i];
    const int64_t n = int64_t(it.tokens.size());
    const int64_t rows = (it.all_logits || opts.all_logits) ? n : 1;
    if (opts.observer) opts.observer->on_final_hidden(cx.start[i] + n - rows, int(rows), ws.xn.data() + o * c.dim);
    it.logits->assign(ws.logits_rows.begin() + o * c.vocab_size, ws.logits_rows.begin() + (o + rows) * c.vocab_size);
    o += rows;
    auto& toks = it.state->mutable_tokens();
    toks.insert(toks.end(), it.tokens.begin(), it.tokens.end());
  }
}

void Model::attention(int layer, Ctx& cx) const {
  const V3Config& c = cfg_;
  const AttentionWeights& a = w_.layers[size_t(layer)].attn;
  Workspace& ws = *cx.ws;
  const int64_t R = cx.R, H = c.n_heads, nope = c.qk_nope_head_dim, rope_d = c.qk_rope_head_dim, qk = c.qk_head_dim(),
                kvl = c.kv_lora_rank, vd = c.v_head_dim, width = kvl + rope_d;
  phase::Scope timer(DI_PHASE_ID("attn.projections"));
  ws.xn.resize(size_t(R * c.dim));
  for (int64_t r = 0; r < R; ++r)
    rms_norm(mode_, ws.x.data() + r * c.dim, w_.layers[size_t(layer)].attn_norm.p, c.dim, c.rms_norm_eps,
             ws.xn.data() + r * c.dim);
  ws.q.resize(size_t(R * H * qk));
  ws.kv.resize(size_t(R * width));
  if (c.q_lora_rank > 0) {
    ws.qa.resize(size_t(R * c.q_lora_rank));
    ws.tmp.resize(size_t(R * c.q_lora_rank));
    const LinearJob jobs[2] = {{ws.xn.data(), R, &a.wq_a, ws.tmp.data()}, {ws.xn.data(), R, &a.wkv_a, ws.kv.data()}};
    linear_multi(mode_, jobs);
    for (int64_t r = 0; r < R; ++r)
      rms_norm(mode_, ws.tmp.data() + r * c.q_lora_rank, a.q_norm.p, c.q_lora_rank, c.rms_norm_eps,
               ws.qa.data() + r * c.q_lora_rank);
    linear(mode_, ws.qa.data(), R, a.wq_b, ws.q.data());
  } else {
    const LinearJob jobs[2] = {{ws.xn.data(), R, &a.wq, ws.q.data()}, {ws.xn.data(), R, &a.wkv_a, ws.kv.data()}};
    linear_multi(mode_, jobs);
  }
  const bool round = mode_ != Mode::Fp32;
  timer.next(DI_PHASE_ID("attn.rope, cache"));
  // RoPE on q_pe; the cache rows: kv_norm(latent) and rope(k_pe).
  for (size_t i = 0; i < cx.items.size(); ++i) {
    kvcache::RowCache& cache = cx.items[i].state->caches()[size_t(layer)];
    if (cache.size() != cx.start[i]) throw std::logic_error("v3 forward: cache out of step with the tokens");
    const int64_t n = int64_t(cx.items[i].tokens.size());
    for (int64_t j = 0; j < n; ++j) {
      const int64_t r = cx.row0[i] + j;
      const float* cs = ws.cs.data() + r * rope_d;
      for (int64_t h = 0; h < H; ++h) rope(ws.q.data() + (r * H + h) * qk + nope, rope_d, cs, round);
      float* row = cache.append<float>();
      const float* kv = ws.kv.data() + r * width;
      rms_norm(mode_, kv, a.kv_norm.p, kvl, c.rms_norm_eps, row);
      std::memcpy(row + kvl, kv + kvl, size_t(rope_d) * sizeof(float));
      rope(row + kvl, rope_d, cs, round);
    }
  }
  const int64_t per_head = nope + vd;
  const float* uk_t = absorbed_[size_t(layer)].uk_t.data();
  const float* wkv_b = absorbed_[size_t(layer)].wkv_b.data();
  const float* uv_t = absorbed_[size_t(layer)].uv_t.data();
  timer.next(DI_PHASE_ID("attn.core"));
  ws.q_abs.resize(size_t(R * H * kvl));
  ws.attn.resize(size_t(R * H * vd));
  // Each item's cache rows, by position.
  std::vector<const float*>& rows = ws.cache_rows;
  std::vector<int64_t>& rows0 = ws.cache_rows0;
  rows.clear();
  rows0.clear();
  for (size_t i = 0; i < cx.items.size(); ++i) {
    const kvcache::RowCache& cache = cx.items[i].state->caches()[size_t(layer)];
    rows0.push_back(int64_t(rows.size()));
    for (int64_t t = 0; t < cache.size(); ++t) rows.push_back(cache.row<float>(t));
  }
  ThreadPool* pool = kern::default_pool();
  auto run = [&](int64_t b, int64_t e, int) {
    thread_local std::vector<float> scores, s_pe, o;
    thread_local std::vector<double> od;
    o.resize(size_t(kvl));
    od.resize(size_t(kvl));
    for (int64_t rh = b; rh < e; ++rh) {
      const int64_t r = rh / H, h = rh % H;
      const float* const* crow = rows.data() + rows0[size_t(ws.row_item[size_t(r)])];
      const float* qn = ws.q.data() + (r * H + h) * qk;
      const float* qpe = qn + nope;
      float* qa = ws.q_abs.data() + (r * H + h) * kvl;
      if (mode_ == Mode::Fast) {
        kern::mla::dot_fma_lanes_cols(qn, wkv_b + h * per_head * kvl, nope, kvl, kvl, qa);
        for (int64_t cc = 0; cc < kvl; ++cc) qa[cc] = rd(qa[cc]);
      } else {
        const float* ukt = uk_t + h * kvl * nope;
        for (int64_t cc = 0; cc < kvl; ++cc) qa[cc] = rd(dot(mode_, qn, ukt + cc * nope, nope));
      }
      const int64_t n_ctx = ws.row_pos[size_t(r)] + 1;
      scores.resize(size_t(n_ctx));
      float mx = -INFINITY;
      if (mode_ == Mode::Fast) {
        s_pe.resize(size_t(n_ctx));
        kern::mla::dot_fma_lanes_rows(qa, crow, 0, kvl, n_ctx, scores.data());
        kern::mla::dot_fma_lanes_rows(qpe, crow, kvl, rope_d, n_ctx, s_pe.data());
        for (int64_t t = 0; t < n_ctx; ++t) {
          const float s = rd(rd(rd(scores[size_t(t)]) + rd(s_pe[size_t(t)])) * softmax_scale_);
          scores[size_t(t)] = s;
          mx = std::max(mx, s);
        }
      } else {
        for (int64_t t = 0; t < n_ctx; ++t) {
          const float* row = crow[t];
          const float s1 = rd(dot(mode_, qa, row, kvl)), s2 = rd(dot(mode_, qpe, row + kvl, rope_d));
          const float s = rd(rd(s1 + s2) * softmax_scale_);
          scores[size_t(t)] = s;
          mx = std::max(mx, s);
        }
      }
      float* out = ws.attn.data() + (r * H + h) * vd;
      if (mode_ == Mode::Fast) {
        float sum = 0;
        for (int64_t t = 0; t < n_ctx; ++t) sum += (scores[size_t(t)] = std::exp(scores[size_t(t)] - mx));
        for (int64_t t = 0; t < n_ctx; ++t) scores[size_t(t)] = rd(scores[size_t(t)] / sum);
        kern::mla::pv_f32(scores.data(), crow, n_ctx, kvl, o.data());
        for (int64_t cc = 0; cc < kvl; ++cc) o[size_t(cc)] = rd(o[size_t(cc)]);
      } else {
        double sum = 0;
        for (int64_t t = 0; t < n_ctx; ++t) sum += (scores[size_t(t)] = std::exp(scores[size_t(t)] - mx));
        const float fsum = float(sum);
        for (int64_t t = 0; t < n_ctx; ++t) scores[size_t(t)] = rd(scores[size_t(t)] / fsum);
        kern::mla::pv_f64(scores.data(), crow, n_ctx, kvl, od.data());
        for (int64_t cc = 0; cc < kvl; ++cc) o[size_t(cc)] = rd(float(od[size_t(cc)]));
      }
      if (mode_ == Mode::Fast) {
        kern::mla::dot_fma_lanes_cols(o.data(), uv_t + h * kvl * vd, kvl, vd, vd, out);
        for (int64_t v = 0; v < vd; ++v) out[v] = rd(out[v]);
      } else {
        const float* uv = wkv_b + (h * per_head + nope) * kvl;
        for (int64_t v = 0; v < vd; ++v) out[v] = rd(dot(mode_, o.data(), uv + v * kvl, kvl));
      }
    }
  };
  if (pool && pool->size() > 1 && R * H > 1) pool->parallel_for(R * H, 1, run);
  else run(0, R * H, 0);
  timer.next(DI_PHASE_ID("attn.o_proj"));
  ws.tmp.resize(size_t(R * c.dim));
  linear(mode_, ws.attn.data(), R, a.wo, ws.tmp.data());
  for (int64_t i = 0; i < R * c.dim; ++i) ws.x[size_t(i)] = rd(ws.x[size_t(i)] + ws.tmp[size_t(i)]);
}

void Model::mlp(const MlpWeights& w, const float* x, int64_t m, int64_t inter, float* out, Workspace& ws) const {
  const MlpJob job{&w, x, m, inter, out};
  mlps(std::span<const MlpJob>(&job, 1), ws);
}

// gate and up of every job in one pool job, SwiGLU, then every down in another.
void Model::mlps(std::span<const MlpJob> jobs, Workspace& ws) const {
  int64_t total = 0;
  for (const MlpJob& j : jobs) total += j.m * j.inter;
  ws.h1.resize(size_t(total));
  ws.h3.resize(size_t(total));
  std::vector<LinearJob>& lj = ws.linear_jobs;
  lj.clear();
  int64_t off = 0;
  for (const MlpJob& j : jobs) {
    lj.push_back({j.x, j.m, &j.w->gate, ws.h1.data() + off});
    lj.push_back({j.x, j.m, &j.w->up, ws.h3.data() + off});
    off += j.m * j.inter;
  }
  linear_multi(mode_, lj);
  for (int64_t i = 0; i < total; ++i) ws.h1[size_t(i)] = rd(rd(silu(ws.h1[size_t(i)])) * ws.h3[size_t(i)]);
  lj.clear();
  off = 0;
  for (const MlpJob& j : jobs) {
    lj.push_back({ws.h1.data() + off, j.m, &j.w->down, j.out});
    off += j.m * j.inter;
  }
  linear_multi(mode_, lj);
}

void Model::ffn(int layer, Ctx& cx) const {
  const V3Config& c = cfg_;
  const LayerWeights& L = w_.layers[size_t(layer)];
  Workspace& ws = *cx.ws;
  const int64_t R = cx.R;
  for (int64_t r = 0; r < R; ++r)
    rms_norm(mode_, ws.x.data() + r * c.dim, L.ffn_norm.p, c.dim, c.rms_norm_eps, ws.xn.data() + r * c.dim);
  ws.tmp.resize(size_t(R * c.dim));
  if (L.moe) {
    moe(layer, cx);
  } else {
    DI_PHASE("dense mlp");
    mlp(L.mlp, ws.xn.data(), R, c.inter_dim, ws.tmp.data(), ws);
  }
  for (int64_t i = 0; i < R * c.dim; ++i) ws.x[size_t(i)] = rd(ws.x[size_t(i)] + ws.tmp[size_t(i)]);
}

void Model::moe(int layer, Ctx& cx) const {
  const V3Config& c = cfg_;
  const MoeWeights& m = w_.layers[size_t(layer)].experts;
  Workspace& ws = *cx.ws;
  const int64_t R = cx.R, E = c.n_routed_experts, K = c.n_activated_experts, G = c.n_group, per_group = E / G;
  phase::Scope timer(DI_PHASE_ID("moe.router"));
  ws.gate.resize(size_t(R * E));
  linear(mode_, ws.xn.data(), R, m.gate, ws.gate.data());
  ws.expert_ids.resize(size_t(R * K));
  ws.expert_w.resize(size_t(R * K));
  std::vector<float> scores(static_cast<size_t>(E)), biased(static_cast<size_t>(E)), gscore(static_cast<size_t>(G));
  std::vector<int> order(static_cast<size_t>(std::max(E, G)));
  // Descending by value, ties to the lower index.
  auto top = [&](const std::vector<float>& v, int64_t n, int64_t k) {
    std::iota(order.begin(), order.begin() + n, 0);
    std::partial_sort(order.begin(), order.begin() + k, order.begin() + n,
                      [&](int a, int b) { return v[size_t(a)] > v[size_t(b)] || (v[size_t(a)] == v[size_t(b)] && a < b); });
  };
  for (int64_t r = 0; r < R; ++r) {
    const float* lg = ws.gate.data() + r * E;
    if (c.scoring_func == "sigmoid") {
      for (int64_t e = 0; e < E; ++e) scores[size_t(e)] = rd(1.0f / (1.0f + std::exp(-lg[e])));
    } else {  // softmax in fp32 (dtype=float32), not rounded
      float mx = -INFINITY;
      for (int64_t e = 0; e < E; ++e) mx = std::max(mx, lg[e]);
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += (scores[size_t(e)] = std::exp(lg[e] - mx));
      for (int64_t e = 0; e < E; ++e) scores[size_t(e)] /= float(sum);
    }
    for (int64_t e = 0; e < E; ++e) biased[size_t(e)] = m.bias ? scores[size_t(e)] + m.bias[e] : scores[size_t(e)];
    if (G > 1) {
      for (int64_t g = 0; g < G; ++g) {
        const float* s = biased.data() + g * per_group;
        if (m.bias) {  // sum of the group's two highest biased scores
          float a = -INFINITY, b = -INFINITY;
          for (int64_t j = 0; j < per_group; ++j) {
            if (s[j] > a) b = a, a = s[j];
            else if (s[j] > b) b = s[j];
          }
          gscore[size_t(g)] = a + b;
        } else {
          gscore[size_t(g)] = *std::max_element(s, s + per_group);
        }
      }
      top(gscore, G, c.topk_group);
      std::vector<bool> keep(size_t(G), false);
      for (int64_t j = 0; j < c.topk_group; ++j) keep[size_t(order[size_t(j)])] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[size_t(e / per_group)]) biased[size_t(e)] = -INFINITY;
    }
    top(biased, E, K);
    int32_t* ids = ws.expert_ids.data() + r * K;
    float* w = ws.expert_w.data() + r * K;
    for (int64_t k = 0; k < K; ++k) ids[k] = order[size_t(k)], w[k] = scores[size_t(order[size_t(k)])];
    const bool normalize = c.scoring_func == "sigmoid" || c.norm_topk_prob;
    if (normalize) {
      float sum = 0;
      if (mode_ == Mode::Exact) {
        double d = 0;
        for (int64_t k = 0; k < K; ++k) d += w[k];
        sum = float(d);
      } else {
        for (int64_t k = 0; k < K; ++k) sum += w[k];
      }
      sum = rd(sum);
      for (int64_t k = 0; k < K; ++k) w[k] = rd(w[k] / sum);
    }
    for (int64_t k = 0; k < K; ++k) w[k] = rd(w[k] * c.routed_scaling_factor);
  }
  if (cx.opts->observer)
    for (size_t i = 0; i < cx.items.size(); ++i)
      cx.opts->observer->on_experts(layer, cx.start[i], int(cx.items[i].tokens.size()), int(K),
                                    ws.expert_ids.data() + cx.row0[i] * K, ws.expert_w.data() + cx.row0[i] * K);
  // Each expert once over the rows that chose it (rows grouped by expert, ascending), the shared
  // experts over all rows, in the same two pool jobs.
  timer.next(DI_PHASE_ID("moe.experts"));
  const int64_t dim = c.dim;
  std::vector<int32_t>& count = ws.expert_count;
  count.assign(size_t(E + 1), 0);
  for (int64_t i = 0; i < R * K; ++i) ++count[size_t(ws.expert_ids[size_t(i)]) + 1];
  for (int64_t e = 0; e < E; ++e) count[size_t(e + 1)] += count[size_t(e)];
  ws.gather_rows.resize(size_t(R * K));
  {
    std::vector<int32_t> next(count.begin(), count.end() - 1);
    for (int64_t i = 0; i < R * K; ++i) ws.gather_rows[size_t(next[size_t(ws.expert_ids[size_t(i)])]++)] = int32_t(i);
  }
  ws.gathered.resize(size_t(R * K * dim));
  ws.expert_out.resize(size_t(R * K * dim));
  for (int64_t j = 0; j < R * K; ++j)
    std::memcpy(ws.gathered.data() + j * dim, ws.xn.data() + (ws.gather_rows[size_t(j)] / K) * dim, size_t(dim) * 4);
  ws.shared.resize(size_t(R * dim));
  ws.moe_y.resize(size_t(R * K * dim));
  std::vector<MlpJob> jobs;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t b = count[size_t(e)], n = count[size_t(e + 1)] - b;
    if (n > 0)
      jobs.push_back({&m.experts[size_t(e)], ws.gathered.data() + b * dim, n, c.moe_inter_dim, ws.moe_y.data() + b * dim});
  }
  if (m.has_shared) jobs.push_back({&m.shared, ws.xn.data(), R, int64_t(c.moe_inter_dim) * c.n_shared_experts, ws.shared.data()});
  mlps(jobs, ws);
  for (int64_t j = 0; j < R * K; ++j)
    std::memcpy(ws.expert_out.data() + int64_t(ws.gather_rows[size_t(j)]) * dim, ws.moe_y.data() + j * dim, size_t(dim) * 4);
  timer.next(DI_PHASE_ID("moe.combine"));
  std::vector<int> slot(static_cast<size_t>(K));
  for (int64_t r = 0; r < R; ++r) {
    const int32_t* ids = ws.expert_ids.data() + r * K;
    const float* w = ws.expert_w.data() + r * K;
    std::iota(slot.begin(), slot.end(), 0);
    std::sort(slot.begin(), slot.end(), [&](int a, int b) { return ids[a] < ids[b]; });  // ascending expert id
    float* y = ws.tmp.data() + r * dim;
    std::fill(y, y + dim, 0.0f);
    for (int k : slot) {
      const float* eo = ws.expert_out.data() + (r * K + k) * dim;
      for (int64_t d = 0; d < dim; ++d) y[d] = rd(y[d] + rd(eo[d] * w[k]));
    }
    if (m.has_shared)
      for (int64_t d = 0; d < dim; ++d) y[d] = rd(y[d] + ws.shared[size_t(r * dim + d)]);
  }
}

}  // namespace di::v3
