// The V3 step costs (model/v3/cost.*) that `deepinfer bench` turns into rooflines: a hand count on
// the golden v3-tiny checkpoint, every bound tensor in the total, and the expert counter seeing
// exactly top-k experts per MoE layer for one token.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/model.h"
#include "model/v3/cost.h"
#include "model/v3/model.h"
#include "test_v3_paths.h"

using namespace di;

TEST(V3Cost, HandCountOnTheGoldenTiny) {
  auto m = v3::Model::load(test::v3_golden_model_dir());
  const v3::ModelCost c = v3::model_cost(m->config(), m->weights());
  // dim 64, 4 layers (1 dense), 4 heads, q_lora 32, kv_lora 32, nope / rope / v 16, inter 128,
  // moe_inter 32, 16 experts top-4 + 1 shared; every FP8 scale tensor is one fp32 [1, 1] block.
  const double attn = 2048 + 4096 + 3072 + 4096 + 4096 + 5 * 4, norms = 2 * (64 + 64 + 32 + 32);
  ASSERT_EQ(c.layers.size(), 4u);
  EXPECT_EQ(c.layers[0].dense_bytes, attn + norms + 3 * 128 * 64 + 3 * 4);
  EXPECT_EQ(c.layers[0].dense_params, 17408 + 3 * 128 * 64);
  EXPECT_EQ(c.layers[1].dense_bytes, attn + norms + 2 * 16 * 64 + 4 * 16 + 3 * 32 * 64 + 3 * 4);
  EXPECT_EQ(c.layers[1].dense_params, 17408 + 16 * 64 + 3 * 32 * 64);
  EXPECT_EQ(c.layers[1].expert_bytes, 3 * 32 * 64 + 3 * 4);
  EXPECT_EQ(c.layers[1].top_k, 4);
  EXPECT_EQ(c.head_bytes, 2.0 * 129280 * 64);
  EXPECT_EQ(c.active_params, 17408 + 3 * 128 * 64 + 3 * (17408 + 16 * 64 + 3 * 32 * 64 + 4 * 3 * 32 * 64) + 129280.0 * 64);
  const std::vector<int> distinct = {0, 4, 4, 4};
  EXPECT_EQ(v3::step_weight_bytes(c, distinct, 1, 1), 128 + 128 + 42400 + 3 * (26080 + 4 * 6156) + 2.0 * 129280 * 64);
  EXPECT_EQ(v3::step_weight_bytes(c, distinct, 1, 0), 128 + 128 + 42400 + 3 * (26080 + 4 * 6156));
  // The total counts every tensor of the checkpoint (MTP included), scales not.
  const Checkpoint ck = Checkpoint::open(test::v3_golden_model_dir());
  int64_t values = 0;
  for (const auto& [name, t] : ck.tensors())
    if (name.find("_scale_inv") == std::string::npos) values += t.numel();
  EXPECT_EQ(c.total_params, values);
  // One query at position 9: 10 rows of kv_lora + rope fp32 per layer.
  const QueryCost q = v3::query_cost(m->config(), 9);
  EXPECT_EQ(q.kv_bytes, 4.0 * 10 * 48 * 4);
  EXPECT_EQ(q.attn_flops, 4.0 * 10 * 4 * (2 * 48 + 2 * 32));
}

TEST(V3Cost, StepCostCountsTheExpertsOfAStep) {
  auto model = load_model(test::v3_golden_model_dir());
  auto ws = model->new_workspace();  // outlives the cost attached to it
  auto cost = model->step_cost();
  ASSERT_NE(cost, nullptr);
  cost->attach(*ws);
  auto st = model->new_state({});
  std::vector<float> logits;
  const std::vector<int32_t> one = {100};
  BatchItem it{st.get(), one, false, &logits};
  cost->begin_step();
  model->forward_batch(std::span<BatchItem>(&it, 1), *ws);
  EXPECT_EQ(cost->distinct_experts(), 3 * 4);
  EXPECT_GT(cost->step_weight_bytes(1, 1, 1), cost->step_weight_bytes(1, 1, 0));
  EXPECT_EQ(cost->n_layers(), 4);
}
