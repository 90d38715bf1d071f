#include "model/v41/cost.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "model/v41/tensor_specs.h"

namespace di::v41 {

namespace {

bool has(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }
bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

double tensor_bytes(const TensorSpec& t) {
  double n = double(dtype_size(t.dtype));
  for (int64_t d : t.shape) n *= double(d);
  return n;
}
// Values a tensor holds (I8 tensors are packed FP4: two values a byte); scales hold none.
int64_t tensor_values(const TensorSpec& t) {
  if (t.dtype == DType::F8_E8M0) return 0;
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  return t.dtype == DType::I8 ? 2 * n : n;
}
// A matmul weight: 2-D, not a scale, not a lookup table or elementwise vector.
bool is_linear(const TensorSpec& t) {
  return t.shape.size() == 2 && t.dtype != DType::F8_E8M0 && !has(t.name, "embed.") && !has(t.name, "q_weight") &&
         !has(t.name, "k_weight");
}

}  // namespace

ModelCost model_cost(const V41Config& c) {
  ModelCost m;
  m.layers.resize(size_t(c.n_layers));
  for (int i = 0; i < c.n_layers; ++i) {
    LayerCost& L = m.layers[size_t(i)];
    L.ratio = c.compress_ratio(i);
    L.n_experts = c.n_routed_experts_of(i);
    L.top_k = c.n_activated_experts_of(i);
    if (c.is_engram_layer(i)) {
      L.engram_rows = (c.engram_max_ngram_size - 1) * c.engram_n_heads;
      L.engram_row_bytes = double(c.engram_head_dim) + double(c.engram_head_dim) / 32;
    }
  }
  for (const TensorSpec& t : v41_tensor_specs(c)) {
    const double bytes = tensor_bytes(t);
    m.total_params += tensor_values(t);
    m.total_bytes += bytes;
    if (t.name == "embed.weight") { m.embed_row_bytes = double(c.dim) * 2; continue; }
    if (t.name == "head.weight") { m.head_bytes = bytes; m.head_params = double(tensor_values(t)); continue; }
    if (t.name == "norm.weight") { m.final_norm_bytes = bytes; continue; }
    if (t.name.rfind("layers.", 0) != 0) continue;  // DSpark stages, vision
    const size_t dot = t.name.find('.', 7);
    LayerCost& L = m.layers[size_t(std::stoi(t.name.substr(7, dot - 7)))];
    const std::string rest = t.name.substr(dot + 1);
    const double params = is_linear(t) ? double(tensor_values(t)) : 0;
    if (rest.rfind("ffn.experts.", 0) == 0) {
      if (rest.rfind("ffn.experts.0.", 0) == 0) { L.expert_bytes += bytes; L.expert_params += params; }
    } else if (rest.rfind("engram.embed.", 0) == 0 || ends_with(rest, "bias_vl")) {
      // table rows are counted per token; the vision gate bias is not used by text
    } else if (rest == "attn.indexer.wk.weight") {
      L.wk_bytes += bytes;
      L.wk_params += params;
    } else {
      L.dense_bytes += bytes;
      L.dense_params += params;
    }
  }
  for (const LayerCost& L : m.layers)
    m.active_params += L.dense_params + L.top_k * L.expert_params + (L.ratio ? L.wk_params / L.ratio : 0);
  m.active_params += m.head_params;
  return m;
}

QueryCost query_cost(const V41Config& c, int64_t t) {
  QueryCost q;
  const double D = c.head_dim, H = c.n_heads, row = D * 4, key_row = double(c.index_head_dim) * 4;
  int64_t selected = 0;  // the latest index source's selection, reused until the next source
  for (int i = 0; i < c.n_layers; ++i) {
    const int r = c.compress_ratio(i);
    int64_t rows = std::min<int64_t>(t + 1, c.window_size);
    if (r > 0) {
      if (c.is_index_source(i)) {
        const int64_t width = (t + 1) / r;
        selected = std::min<int64_t>(c.index_topk, width);
        q.kv_bytes += double(width) * key_row;
        q.attn_flops += 2.0 * double(width) * c.index_n_heads * c.index_head_dim;
      }
      rows += selected;
    }
    q.kv_bytes += double(rows) * row;
    q.attn_flops += 4.0 * double(rows) * H * D;  // QK and PV, 2 FLOPs per multiply-add
  }
  return q;
}

double step_weight_bytes(const ModelCost& m, std::span<const int> distinct, int64_t tokens, int64_t tokens_per_seq,
                         int64_t logits_rows) {
  double b = double(tokens) * m.embed_row_bytes + m.final_norm_bytes;
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const LayerCost& L = m.layers[i];
    b += L.dense_bytes + double(tokens) * L.engram_rows * L.engram_row_bytes;
    if (L.ratio) b += L.wk_bytes * std::min(1.0, double(tokens_per_seq) / L.ratio);
    b += (i < distinct.size() ? distinct[i] : 0) * L.expert_bytes;
  }
  if (logits_rows > 0) b += m.head_bytes;
  return b;
}

double token_linear_flops(const ModelCost& m) { return 2.0 * (m.active_params - m.head_params); }

std::vector<int> routed_experts_per_layer(const V41Config& c) {
  std::vector<int> n;
  for (int i = 0; i < c.n_layers; ++i) n.push_back(c.n_routed_experts_of(i));
  return n;
}

std::vector<LinearShape> model_matmul_shapes(const V41Config& c, int m) {
  return {
      {m, c.dim, c.q_lora_rank, "attn.wq_a"},
      {m, c.q_lora_rank, int64_t(c.n_heads) * c.head_dim, "attn.wq_b"},
      {m, int64_t(c.o_groups) * c.o_lora_rank, c.dim, "attn.wo_b"},
      {m, c.dim, c.moe_inter_dim, "ffn.shared_experts.w1"},
      // A size-independent reference, so that a small model's thin shapes do not understate the machine.
      {512, 2048, 2048, "reference"},
  };
}

namespace {

class V41StepCost final : public ObservedStepCost<Workspace, ForwardObserver> {
 public:
  explicit V41StepCost(const V41Config& c) : ObservedStepCost(routed_experts_per_layer(c)), cfg_(c), cost_(model_cost(c)) {}
  int64_t total_params() const override { return cost_.total_params; }
  double active_params() const override { return cost_.active_params; }
  double head_params() const override { return cost_.head_params; }
  int n_layers() const override { return cfg_.n_layers; }
  std::vector<std::pair<std::string, int64_t>> shape() const override {
    const V41Config& c = cfg_;
    return {{"dim", c.dim},
            {"n_layers", c.n_layers},
            {"n_heads", c.n_heads},
            {"head_dim", c.head_dim},
            {"moe_inter_dim", c.moe_inter_dim},
            {"n_routed_experts", c.n_routed_experts},
            {"n_activated_experts", c.n_activated_experts},
            {"vocab_size", c.vocab_size},
            {"window_size", c.window_size},
            {"index_topk", c.index_topk}};
  }
  std::vector<LinearShape> linear_shapes(int m) const override { return model_matmul_shapes(cfg_, m); }
  QueryCost query(int64_t t) const override { return query_cost(cfg_, t); }
  double token_linear_flops() const override { return v41::token_linear_flops(cost_); }
  double step_weight_bytes(int64_t tokens, int64_t tokens_per_seq, int64_t logits_rows) const override {
    return v41::step_weight_bytes(cost_, counter_.distinct(), tokens, tokens_per_seq, logits_rows);
  }
 private:
  V41Config cfg_;
  ModelCost cost_;
};

}  // namespace

std::unique_ptr<StepCost> make_step_cost(const Model& model) { return std::make_unique<V41StepCost>(model.config()); }
std::unique_ptr<StepCost> Model::step_cost() const { return make_step_cost(*this); }

}  // namespace di::v41
