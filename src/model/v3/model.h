// The DeepSeek-V3 / R1 / V3.1 forward pass (DeepseekV3ForCausalLM): MLA in the absorbed form
// (the cache holds the normalized latent and the rotated k_pe of each token and layer), dense first
// layers, then MoE with group-limited sigmoid routing. The MTP module is loaded, not run.
//
// One call runs chunks of tokens of many sequences; any chunking and any batch give every row the
// same bits as running it alone (each quantity is a function of the row and its sequence's cache).
// The numerics follow the official inference code (model.py, attn_impl "absorb"): Fast and Exact
// reproduce its bf16 run's rounding points, Fp32 its fp32 run (ops.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/numerics.h"
#include "core/thread_pool.h"
#include "model/model.h"
#include "io/safetensors.h"
#include "model/v3/config.h"
#include "model/v3/ops.h"
#include "model/v3/state.h"
#include "model/v3/weights.h"

namespace di::v3 {

struct LoadOptions {
  Numerics numerics = Numerics::Fast;
  // Full fp32 (the official fp32 run: weights code x scale in fp32, no bf16 rounding, fp64 sums);
  // overrides `numerics`. For verification against the fp32 golden.
  bool fp32 = false;
  int threads = 0;  // > 0: the model's own kernel pool of that many threads; 0: the caller's default pool
  // The BF16 lm_head quantized at load to FP8 E4M3 with one fp32 scale per 128x128 block (absmax /
  // 448, as the release quantizes its projections): half the bytes a decode step streams for the
  // head, at FP8's precision. Off by default (the release and the official code use the BF16 head).
  bool head_fp8 = false;
  const std::atomic<bool>* cancel = nullptr;  // set: the load stops with LoadCancelled
};

class ForwardObserver {
 public:
  virtual ~ForwardObserver() = default;
  // Routed experts of the rows of one sequence in MoE layer `layer` ([S][k] ids, top-k order, and
  // their weights after normalization and routed_scaling_factor).
  virtual void on_experts(int layer, int64_t start_pos, int S, int k, const int32_t* ids, const float* w) {}
  // The final RMSNorm output of the rows whose logits are computed ([rows][dim]).
  virtual void on_final_hidden(int64_t start_pos, int rows, const float* hidden) {}
};

struct ForwardOptions {
  bool all_logits = false;
  ForwardObserver* observer = nullptr;
};

struct BatchItem {
  SequenceState* state = nullptr;
  std::span<const int32_t> tokens;
  bool all_logits = false;               // logits of every position, else the last
  std::vector<float>* logits = nullptr;  // out: [1 or n][vocab]
};

// Scratch reused across calls.
struct Workspace final : di::Workspace {
  std::vector<BatchItem> items;  // the interface's batch as this model's items
  ForwardObserver* observer = nullptr;  // taps the interface's forward_batch (StepCost::attach)
  std::vector<float> x, xn, qa, q, kv, q_abs, attn, tmp, logits_rows;
  std::vector<float> gate, h1, h3, expert_out, moe_y, shared, expert_w;
  std::vector<int32_t> expert_ids, gather_rows, expert_count;
  std::vector<LinearJob> linear_jobs;
  std::vector<const float*> cache_rows;  // attention: each item's cache rows of the layer
  std::vector<int64_t> cache_rows0;
  std::vector<float> gathered, cs;
  std::vector<int64_t> row_pos;
  std::vector<int32_t> row_item;
};

// The interface (di::Model) is implemented on top of the concrete API, which adds the observer and
// the fp32 mode for tests and tools.
class Model final : public di::Model {
 public:
  // MODEL_DIR: config.json + safetensors (one file or shards with an index). Throws LoadError.
  static std::unique_ptr<Model> load(const std::string& model_dir, const LoadOptions& opts = {});

  const V3Config& config() const { return cfg_; }
  const ModelWeights& weights() const { return w_; }
  Mode mode() const { return mode_; }
  std::unique_ptr<SequenceState> new_state(int max_rollback = 64, int page_tokens = 64, PagePool* pool = nullptr) const {
    return std::make_unique<SequenceState>(cfg_, max_rollback, page_tokens, pool);
  }
  // Bytes of one cache page (one layer's rows of page_tokens tokens) and of all layers' pages.
  size_t page_bytes(int page_tokens) const;
  ThreadPool* thread_pool() const override { return pool_.get(); }
  std::unique_ptr<StepCost> step_cost() const override;  // model/v3/cost.cpp

  // di::Model. One stream per layer, "layer<i>.latent_rope": kv_lora_rank + qk_rope_head_dim fp32.
  const ModelInfo& info() const override { return info_; }
  std::vector<kvcache::StreamLayout> cache_layout(int page_tokens) const override;
  std::unique_ptr<di::SequenceState> new_state(const StateOptions& opts) const override;
  std::unique_ptr<di::Workspace> new_workspace() const override { return std::make_unique<Workspace>(); }
  void forward_batch(std::span<di::BatchItem> items, di::Workspace& ws) const override;
  // Nothing to rebuild after adopt_prefix: the pages hold the whole state.
  int64_t resume_tokens() const override { return 0; }
  void resume(di::SequenceState& state, di::Workspace& ws) const override;

  void forward(SequenceState& state, std::span<const int32_t> tokens, std::vector<float>& logits,
               const ForwardOptions& opts, Workspace& ws) const;
  // One step over many sequences (distinct states): the projections run once over all rows,
  // attention per sequence. Throws std::invalid_argument before touching any state when an item is
  // invalid or the pages it needs do not fit (CacheExhausted); should a page allocation still fail
  // inside (another thread drew from the same pool), every state is restored.
  void forward_batch(std::span<BatchItem> items, const ForwardOptions& opts, Workspace& ws) const;

 private:
  Model() = default;
  struct Ctx;
  void attention(int layer, Ctx& c) const;
  void ffn(int layer, Ctx& c) const;
  void mlp(const MlpWeights& w, const float* x, int64_t m, int64_t inter, float* out, Workspace& ws) const;
  struct MlpJob {
    const MlpWeights* w;
    const float* x;
    int64_t m, inter;
    float* out;  // [m][dim]
  };
  void mlps(std::span<const MlpJob> jobs, Workspace& ws) const;
  void moe(int layer, Ctx& c) const;
  float rd(float v) const { return mode_ == Mode::Fp32 ? v : round_bf16_(v); }
  static float round_bf16_(float v);

  V3Config cfg_;
  std::unique_ptr<ThreadPool> pool_;  // LoadOptions::threads > 0
  std::unique_ptr<Checkpoint> ckpt_;
  ModelWeights w_;
  ModelInfo info_;
  Mode mode_ = Mode::Fast;
  struct Absorbed {
    std::vector<float> wkv_b;  // [heads * (nope + v)][kv_lora], dequantized (bf16 values unless fp32)
    std::vector<float> uk_t;   // [heads][kv_lora][nope]: W_UK transposed (exact / fp32 modes)
    std::vector<float> uv_t;   // [heads][kv_lora][v]: W_UV transposed (fast mode)
  };
  std::vector<Absorbed> absorbed_;  // per layer
  std::vector<uint8_t> head_codes_;  // LoadOptions::head_fp8
  std::vector<float> head_scales_;
  std::vector<float> freqs_;
  float softmax_scale_ = 0;
};

// load_model's entry for V3 (model/model.cpp): LoadOptions::threads 0 = all cores.
std::unique_ptr<di::Model> load_as_model(const std::string& model_dir, const di::LoadOptions& opts);

}  // namespace di::v3
