// What forward steps move and compute, as an architecture declares it: the bench's rooflines
// (bench/model_bench) read it through Model::step_cost() and need no architecture header.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace di {

class Workspace;

// KV bytes read and attention FLOPs of one query.
struct QueryCost {
  double kv_bytes = 0, attn_flops = 0;
};

// A linear layer's matmul at m rows (m x k times k x n).
struct LinearShape {
  int64_t m = 0, k = 0, n = 0;
  std::string name;
};

class StepCost {
 public:
  virtual ~StepCost() = default;
  virtual int64_t total_params() const = 0;  // values of every checkpoint tensor
  virtual double active_params() const = 0;  // per token, including one logits row of the head
  virtual double head_params() const = 0;
  virtual int n_layers() const = 0;
  // The config's main sizes, named as in the architecture's config (for reports).
  virtual std::vector<std::pair<std::string, int64_t>> shape() const = 0;
  virtual std::vector<LinearShape> linear_shapes(int m) const = 0;  // the big linears, for the matmul peak
  virtual QueryCost query(int64_t t) const = 0;                      // one query at absolute position t
  virtual double token_linear_flops() const = 0;  // matmul FLOPs of one token, without attention and head
  // Observes the forward passes run with `ws` (a workspace of the same model) from now on; a step
  // is what runs between begin_step() calls. `ws` must outlive this object (it detaches on
  // destruction).
  virtual void attach(Workspace& ws) = 0;
  virtual void begin_step() = 0;
  // Weight bytes the observed step touched; `tokens_per_seq` sets shares of weights that run once
  // per several tokens of a sequence.
  virtual double step_weight_bytes(int64_t tokens, int64_t tokens_per_seq, int64_t logits_rows) const = 0;
  virtual double distinct_experts() const = 0;  // routed experts the observed step ran, summed over layers
};

// Distinct routed experts each layer ran since begin_step(). `Observer` is the architecture's
// forward observer; its on_experts reports the [S][k] expert ids a MoE layer chose.
template <class Observer>
class ExpertCounter final : public Observer {
 public:
  // experts_per_layer[l]: routed experts of layer l (ids outside [0, that) are not counted).
  explicit ExpertCounter(const std::vector<int>& experts_per_layer) : distinct_(experts_per_layer.size(), 0) {
    for (int n : experts_per_layer) seen_.emplace_back(size_t(n > 0 ? n : 0), uint8_t(0));
  }
  void begin_step() {
    for (auto& s : seen_) std::fill(s.begin(), s.end(), uint8_t(0));
    std::fill(distinct_.begin(), distinct_.end(), 0);
  }
  void on_experts(int layer, int64_t, int S, int k, const int32_t* ids, const float*) override {
    if (layer < 0 || size_t(layer) >= seen_.size()) return;
    std::vector<uint8_t>& seen = seen_[size_t(layer)];
    for (int64_t i = 0; i < int64_t(S) * k; ++i) {
      const int32_t e = ids[i];
      if (e >= 0 && size_t(e) < seen.size() && !seen[size_t(e)]) {
        seen[size_t(e)] = 1;
        ++distinct_[size_t(layer)];
      }
    }
  }
  const std::vector<int>& distinct() const { return distinct_; }

 private:
  std::vector<std::vector<uint8_t>> seen_;
  std::vector<int> distinct_;
};

// The StepCost plumbing every architecture shares: an ExpertCounter on the architecture's
// `Observer`, which the workspace `ModelWorkspace` calls through its `observer` pointer once
// attached.
template <class ModelWorkspace, class Observer>
class ObservedStepCost : public StepCost {
 public:
  ~ObservedStepCost() override {
    if (ws_ && ws_->observer == &counter_) ws_->observer = nullptr;
  }
  void attach(Workspace& ws) override {
    auto* w = dynamic_cast<ModelWorkspace*>(&ws);
    if (!w) throw std::invalid_argument("StepCost::attach: a workspace of another model");
    ws_ = w;
    w->observer = &counter_;
  }
  void begin_step() override { counter_.begin_step(); }
  double distinct_experts() const override {
    double d = 0;
    for (int x : counter_.distinct()) d += x;
    return d;
  }

 protected:
  explicit ObservedStepCost(const std::vector<int>& experts_per_layer) : counter_(experts_per_layer) {}
  ExpertCounter<Observer> counter_;

 private:
  ModelWorkspace* ws_ = nullptr;
};

}  // namespace di
