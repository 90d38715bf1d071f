// What one V3 forward step moves and computes (the bench's rooflines, Model::step_cost), from the
// bound checkpoint tensors: FP8 projections 1 B per weight + fp32 block scales, BF16 2 B. Weights
// are counted as the checkpoint holds them, whatever copies the forward pass keeps. KV rows are
// counted as SequenceState stores them: kv_lora + rope fp32 values per token and layer.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "model/cost.h"
#include "model/v3/model.h"

namespace di::v3 {

struct LayerCost {
  double dense_bytes = 0, dense_params = 0;    // attention, norms, router, dense MLP or shared experts
  double expert_bytes = 0, expert_params = 0;  // one routed expert (gate, up, down with scales)
  int top_k = 0;
};

struct ModelCost {
  std::vector<LayerCost> layers;
  double embed_row_bytes = 0, final_norm_bytes = 0;
  double head_bytes = 0, head_params = 0;
  int64_t total_params = 0;  // every tensor bound (MTP included), scales not counted
  double active_params = 0;  // per token: dense + top_k experts + one logits row of the head
};

ModelCost model_cost(const V3Config& c, const ModelWeights& w);

// One query at absolute position t (absorbed MLA): every layer reads t + 1 cache rows and spends
// 2 H (kv_lora + rope) FLOPs per row on scores and 2 H kv_lora on P.V.
QueryCost query_cost(const V3Config& c, int64_t t);

// Weights one step touches: every dense weight once, the distinct routed experts it ran per
// layer, one embedding row per token, the head once if any logits row is computed.
double step_weight_bytes(const ModelCost& m, std::span<const int> distinct_experts_per_layer, int64_t tokens,
                         int64_t logits_rows);

std::unique_ptr<StepCost> make_step_cost(const Model& model);

}  // namespace di::v3
