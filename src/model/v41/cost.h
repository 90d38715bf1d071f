// What one forward step must move and compute, from the config and the checkpoint's dtypes alone
// (the tensor list of v41_tensor_specs: FP8 = 1 B + E8M0 block scales, FP4 = 0.5 B + scales,
// bf16 = 2 B, fp32 = 4 B), and the roofline time that follows from measured bandwidth and matmul
// throughput. KV rows are counted as SequenceState stores them (fp32).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/cost.h"
#include "model/v41/config.h"
#include "model/v41/model.h"

namespace di::v41 {

struct LayerCost {
  double dense_bytes = 0;   // read every step: attention projections, norms, sinks, mHC, gate, shared
                            // expert, compressor, indexer wq_b/weights_proj, Engram wkv and q/k weights
  double dense_params = 0;  // multiply-adds per token of those linears
  double wk_bytes = 0, wk_params = 0;  // indexer wk (key owners): runs once per new compressed entry
  int ratio = 0;                       // compress ratio (wk runs on 1 token in `ratio`)
  double expert_bytes = 0, expert_params = 0;  // one routed expert (w1, w2, w3 with scales)
  int n_experts = 0, top_k = 0;
  int engram_rows = 0;           // Engram table rows read per token ((max_ngram-1) x heads)
  double engram_row_bytes = 0;   // E4M3 row + its E8M0 scales
};

struct ModelCost {
  std::vector<LayerCost> layers;  // backbone layers (the DSpark stages do not run in forward)
  double embed_row_bytes = 0;     // one embedding row (bf16)
  double head_bytes = 0, head_params = 0;  // the whole head (every row: vocab x dim)
  double final_norm_bytes = 0;
  int64_t total_params = 0;   // every tensor in the checkpoint (FP4 counted per value, scales not)
  double total_bytes = 0;     // tensor data in the checkpoint
  double active_params = 0;   // per token: dense + top_k experts + wk share + head (one logits row)
};

ModelCost model_cost(const V41Config& c);

// KV bytes read and attention FLOPs of one query at absolute position t, as the forward pass
// runs it: the window rows min(t+1, W), the selected compressed entries min(index_topk, (t+1)/r)
// of the latest index source, and the index keys scanned ((t+1)/r per index source).
QueryCost query_cost(const V41Config& c, int64_t t);

// Weight bytes one step touches: every dense weight once, the distinct routed experts it ran per
// layer, Engram and embedding rows per token, the head once if any logits row is computed.
// `tokens_per_seq` sets the indexer-wk share (min(1, tokens/ratio)).
double step_weight_bytes(const ModelCost& m, std::span<const int> distinct_experts_per_layer, int64_t tokens,
                         int64_t tokens_per_seq, int64_t logits_rows);
// Matmul FLOPs of one token (dense + top_k experts + wk share), without attention and head.
double token_linear_flops(const ModelCost& m);

// Routed experts of each backbone layer (the ExpertCounter's sizes).
std::vector<int> routed_experts_per_layer(const V41Config& c);

// The big linears at m rows, for the matmul peak.
std::vector<LinearShape> model_matmul_shapes(const V41Config& c, int m);

// StepCost of a loaded model (Model::step_cost).
std::unique_ptr<StepCost> make_step_cost(const Model& model);

}  // namespace di::v41
