#include "model/v3/cost.h"

#include <algorithm>
#include <stdexcept>

namespace di::v3 {

namespace {

double bytes_of(const Linear& l) {
  if (!l.valid()) return 0;
  if (l.fp8) return double(l.out) * double(l.in) + 4.0 * double((l.out + l.bo - 1) / l.bo) * double(l.scale_cols());
  return 2.0 * double(l.out) * double(l.in);
}
double params_of(const Linear& l) { return l.valid() ? double(l.out) * double(l.in) : 0; }

struct Sum {
  double bytes = 0, params = 0;
  void add(const Linear& l) { bytes += bytes_of(l), params += params_of(l); }
  void add(const Bf16Vec& v) { bytes += 2.0 * double(v.n); }
  void add(const MlpWeights& m) { add(m.gate), add(m.up), add(m.down); }
};

Sum layer_dense(const LayerWeights& L, int64_t n_experts) {
  Sum s;
  const AttentionWeights& a = L.attn;
  s.add(L.attn_norm), s.add(L.ffn_norm);
  s.add(a.wq), s.add(a.wq_a), s.add(a.wq_b), s.add(a.q_norm), s.add(a.wkv_a), s.add(a.kv_norm), s.add(a.wkv_b), s.add(a.wo);
  if (!L.moe) {
    s.add(L.mlp);
  } else {
    s.add(L.experts.gate);
    if (L.experts.bias) s.bytes += 4.0 * double(n_experts);
    if (L.experts.has_shared) s.add(L.experts.shared);
  }
  return s;
}

}  // namespace

ModelCost model_cost(const V3Config& c, const ModelWeights& w) {
  ModelCost m;
  int64_t total = 0;
  auto count_layer = [&](const LayerWeights& L) {
    Sum d = layer_dense(L, c.n_routed_experts);
    total += int64_t(d.params) + (L.attn_norm.n + L.ffn_norm.n + L.attn.q_norm.n + L.attn.kv_norm.n);
    if (L.moe) {
      total += L.experts.bias ? c.n_routed_experts : 0;
      for (const MlpWeights& e : L.experts.experts) total += int64_t(params_of(e.gate) + params_of(e.up) + params_of(e.down));
    }
    return d;
  };
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& L = w.layers[i];
    const Sum d = count_layer(L);
    LayerCost lc;
    lc.dense_bytes = d.bytes, lc.dense_params = d.params;
    if (L.moe && !L.experts.experts.empty()) {
      Sum e;
      e.add(L.experts.experts[0]);
      lc.expert_bytes = e.bytes, lc.expert_params = e.params;
      lc.top_k = c.n_activated_experts;
    }
    m.layers.push_back(lc);
  }
  for (const MtpWeights& t : w.mtp) {
    count_layer(t.block);
    total += t.enorm.n + t.hnorm.n + t.head_norm.n + int64_t(params_of(t.eh_proj));
    if (t.embed.p != w.embed.p) total += t.embed.n;
    if (t.head.bf16 != w.head.bf16 || t.head.fp8 != w.head.fp8) total += int64_t(params_of(t.head));
  }
  m.embed_row_bytes = 2.0 * c.dim;
  m.final_norm_bytes = 2.0 * double(w.norm.n);
  m.head_bytes = bytes_of(w.head);
  m.head_params = params_of(w.head);
  total += w.embed.n + w.norm.n + int64_t(m.head_params);
  m.total_params = total;
  for (const LayerCost& L : m.layers) m.active_params += L.dense_params + L.top_k * L.expert_params;
  m.active_params += m.head_params;
  return m;
}

QueryCost query_cost(const V3Config& c, int64_t t) {
  QueryCost q;
  const double rows = double(t + 1), width = c.kv_lora_rank + c.qk_rope_head_dim;
  q.kv_bytes = double(c.n_layers) * rows * width * 4;
  q.attn_flops = double(c.n_layers) * rows * c.n_heads * (2.0 * width + 2.0 * c.kv_lora_rank);
  return q;
}

double step_weight_bytes(const ModelCost& m, std::span<const int> distinct, int64_t tokens, int64_t logits_rows) {
  double b = double(tokens) * m.embed_row_bytes + m.final_norm_bytes;
  for (size_t i = 0; i < m.layers.size(); ++i)
    b += m.layers[i].dense_bytes + (i < distinct.size() ? distinct[i] : 0) * m.layers[i].expert_bytes;
  if (logits_rows > 0) b += m.head_bytes;
  return b;
}

namespace {

class V3StepCost final : public ObservedStepCost<Workspace, ForwardObserver> {
 public:
  explicit V3StepCost(const Model& m)
      : ObservedStepCost(std::vector<int>(size_t(m.config().n_layers), m.config().n_routed_experts)),
        cfg_(m.config()), cost_(model_cost(m.config(), m.weights())) {}
  int64_t total_params() const override { return cost_.total_params; }
  double active_params() const override { return cost_.active_params; }
  double head_params() const override { return cost_.head_params; }
  int n_layers() const override { return cfg_.n_layers; }
  std::vector<std::pair<std::string, int64_t>> shape() const override {
    const V3Config& c = cfg_;
    return {{"dim", c.dim},
            {"n_layers", c.n_layers},
            {"n_dense_layers", c.n_dense_layers},
            {"n_heads", c.n_heads},
            {"q_lora_rank", c.q_lora_rank},
            {"kv_lora_rank", c.kv_lora_rank},
            {"moe_inter_dim", c.moe_inter_dim},
            {"n_routed_experts", c.n_routed_experts},
            {"n_activated_experts", c.n_activated_experts},
            {"vocab_size", c.vocab_size}};
  }
  std::vector<LinearShape> linear_shapes(int m) const override {
    const V3Config& c = cfg_;
    std::vector<LinearShape> s;
    if (c.q_lora_rank > 0) {
      s.push_back({m, c.dim, c.q_lora_rank, "q_a_proj"});
      s.push_back({m, c.q_lora_rank, int64_t(c.n_heads) * c.qk_head_dim(), "q_b_proj"});
    }
    s.push_back({m, int64_t(c.n_heads) * c.v_head_dim, c.dim, "o_proj"});
    s.push_back({m, c.dim, c.moe_inter_dim, "experts.gate_proj"});
    s.push_back({512, 2048, 2048, "reference"});
    return s;
  }
  QueryCost query(int64_t t) const override { return query_cost(cfg_, t); }
  double token_linear_flops() const override { return 2.0 * (cost_.active_params - cost_.head_params); }
  double step_weight_bytes(int64_t tokens, int64_t, int64_t logits_rows) const override {
    return v3::step_weight_bytes(cost_, counter_.distinct(), tokens, logits_rows);
  }
 private:
  V3Config cfg_;
  ModelCost cost_;
};

}  // namespace

std::unique_ptr<StepCost> make_step_cost(const Model& model) { return std::make_unique<V3StepCost>(model); }
std::unique_ptr<StepCost> Model::step_cost() const { return make_step_cost(*this); }

}  // namespace di::v3
