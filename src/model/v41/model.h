// The DeepSeek-V4.1-Flash forward pass (backbone; the DSpark draft head is separate).
//
// One call runs a chunk of tokens at positions state.pos() .. state.pos()+n-1 of one sequence and
// extends its state. Any chunking (one-shot prefill, chunks of any size, single-token decode,
// multi-token verification) gives the same results: every per-query quantity is defined by the
// query's absolute position alone. docs/forward-pass.md maps each step to the official reference.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/numerics.h"
#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "model/v41/config.h"
#include "model/v41/engram_hash.h"
#include "model/v41/state.h"
#include "model/v41/weights.h"

namespace di::v41 {

// Which index keys a ratio-2 index source scores against on a step where its own group is
// incomplete. PerSource is correct; Reference reproduces the official code's stale shared slot.
enum class IndexKeyPolicy { PerSource, Reference };

struct LoadOptions {
  std::string tokenizer_path;  // tokenizer.json for the Engram token map; default MODEL_DIR/tokenizer.json
  IndexKeyPolicy index_key_policy = IndexKeyPolicy::PerSource;
  Numerics numerics = Numerics::Fast;  // docs/forward-pass.md: the two modes side by side
  // Set from another thread to stop a load early (a server shut down while loading): checked
  // between the load's stages and between weights, then LoadCancelled is thrown.
  const std::atomic<bool>* cancel = nullptr;
  // Kernel threads of the model's own pool, used by every forward call (and by the load's
  // repacking); 0 = no pool of its own: calls use the calling thread's kern default pool.
  int threads = 0;
};

// Optional taps into the forward pass (tests, debugging). Stream arguments are [S][hc][dim]
// (bf16 values in fp32) and may be modified by the before_* hooks; pre_mix is [S][hc].
class ForwardObserver {
 public:
  virtual ~ForwardObserver() = default;
  virtual void before_engram(int layer, int64_t start_pos, int S, float* stream) {}
  virtual void after_engram(int layer, int64_t start_pos, int S, const float* stream) {}
  virtual void before_block(int layer, int64_t start_pos, int S, float* stream, float* pre_mix) {}
  virtual void after_block(int layer, int64_t start_pos, int S, const float* stream, const float* pre_mix) {}
  // Selected compressed entries per query ([S][k], -1 = unused) and the index scores they were
  // chosen by ([S][width], -inf = not visible or masked), for index-source layers.
  virtual void on_index_topk(int layer, int64_t start_pos, int S, int k, const int32_t* idx, const float* scores,
                             int64_t width) {}
  // Routed experts per token ([S][k] ids in top-k order and their weights).
  virtual void on_experts(int layer, int64_t start_pos, int S, int k, const int32_t* ids, const float* w) {}
  virtual void on_engram_hash(int64_t start_pos, int S, int cols_per_token, const int32_t* ids) {}
  // Final norm output for the rows whose logits are computed ([rows][dim]).
  virtual void on_final_hidden(int64_t start_pos, int rows, const float* hidden) {}
};

struct ForwardOptions {
  bool all_logits = false;  // logits of every position of the chunk, else only the last
  ForwardObserver* observer = nullptr;
};

// One sequence's part of a batched step: a chunk of its tokens (a prefill chunk, one decode
// token, or several tokens to verify).
struct BatchItem {
  SequenceState* state = nullptr;
  std::span<const int32_t> tokens;
  bool all_logits = false;            // logits of every position, else only the last
  std::vector<float>* logits = nullptr;  // out: [1 or n][vocab]
};

namespace detail {
// One sequence's rows within a batched step, and what its layers hand to later layers of the same
// step (the reference's shared slots).
struct Segment {
  SequenceState* st = nullptr;
  int64_t start = 0;  // position of the first row
  int S = 0;          // rows
  int row0 = 0;       // first row in the batch
  int kv_source = -1;      // most recent KV-source layer
  int index_k_owner = -1;  // most recent index-key owner (PerSource policy)
  int topk_k = 0;          // entries per query of the most recent index source
  size_t topk_off = 0;     // its [S][topk_k] block in Workspace::topk
  int64_t candidate_width = -1;
  size_t candidate_off = 0;  // [S][candidate_width] block in Workspace::candidate_mask
  int new_entries = 0;       // compressed entries the current KV source produced in this step
  bool replay = false;       // rebuilding window rings: the compressed caches are already complete
};
}  // namespace detail

// Scratch memory reused across calls, so a warm forward pass does not allocate.
struct Workspace final : di::Workspace {
  std::vector<BatchItem> items;  // the interface's batch, as this model's items
  ForwardObserver* observer = nullptr;  // taps the interface's forward_batch (StepCost::attach)
  std::vector<float> stream, stream2, pre_mix, x, f, y, tmp, mix, qr, q, kv, attn_out, logits_rows, head_out;
  std::vector<float> coef_pre, coef_post, coef_comb, next_pre;
  std::vector<int32_t> comp_tokens, history, hash_ids, topk, expert_ids, order, top_blocks, slots;
  std::vector<int64_t> row_pos;      // absolute position of each row of the step
  std::vector<float> rope_cs;        // [row][rope_head_dim]: cos/sin of each row's position, this layer
  std::vector<int32_t> row_segment;  // index in Ctx::segs of each row of the step
  std::vector<float> comp_proj, comp_lat, comp_key;  // compressor: projections, new latents, their index keys
  std::vector<float> expert_w, iq, iw, scores, block_scores, moe_gate, moe_up, moe_out, moe_acc;
  std::vector<uint8_t> candidate_mask;
  std::vector<int> out_rows;
  std::vector<const float*> key_rows;
  // Fast prefill: bf16 copies of the rows a segment's queries attend to, their sources, and each
  // segment's offset in them (SIZE_MAX: the segment passes fp32 rows).
  std::vector<uint16_t> rows16;
  std::vector<const float*> rows16_src;
  std::vector<size_t> rows16_off;
  size_t topk_used = 0, candidate_mask_used = 0;  // per-step bump allocation in topk / candidate_mask
  std::vector<detail::Segment> segments;
  std::vector<std::span<const int32_t>> token_spans;
};

// The interface (di::Model) is implemented on top of the concrete API below, which keeps what only
// V4.1 has (observers, the index-key policy, the Engram token map) for its own tests and tools.
class Model final : public di::Model {
 public:
  // Loads MODEL_DIR (config.json + safetensors). Validates config and tensors; throws LoadError
  // (LoadCancelled when opts.cancel was set).
  static std::unique_ptr<Model> load(const std::string& model_dir, const LoadOptions& opts = {});

  const V41Config& config() const { return cfg_; }
  const EngramTokenMap& engram_token_map() const { return token_map_; }
  // Ids a sampler may produce: those the tokenizer defines when Engram needs them (the head covers
  // vocab_size rows, but an id outside the tokenizer has no Engram n-gram entry), else vocab_size.
  int64_t sampleable_vocab() const {
    return token_map_.compressed.empty() ? cfg_.vocab_size
                                         : std::min<int64_t>(cfg_.vocab_size, int64_t(token_map_.compressed.size()));
  }
  IndexKeyPolicy index_key_policy() const { return policy_; }
  Numerics numerics() const { return numerics_; }
  void set_index_key_policy(IndexKeyPolicy p);
  ThreadPool* thread_pool() const override { return pool_.get(); }
  SequenceState new_state(int max_rollback = 64, int page_tokens = 64, PagePool* pool = nullptr,
                          PagePool* state_pool = nullptr) const {
    return SequenceState(cfg_, max_rollback, page_tokens, pool, state_pool);
  }

  // Runs `tokens` on `state`; writes fp32 logits ([1 or n][vocab]) to `logits`.
  void forward(SequenceState& state, std::span<const int32_t> tokens, std::vector<float>& logits,
               const ForwardOptions& opts, Workspace& ws) const;
  // One step over many sequences: every linear layer runs once over all rows of the batch, while
  // attention and the caches stay per sequence. Each item's results are identical to running it
  // alone (batch invariance). Throws before touching any state if an item is invalid.
  void forward_batch(std::span<BatchItem> items, const ForwardOptions& opts, Workspace& ws) const;

  // After SequenceState::adopt_prefix: fills the window rings by re-running the last
  // replay_tokens() tokens of the prefix with the (complete, shared) compressed caches. Layer L's
  // output at position t depends on inputs back to t - (L+1)(window-1) only, so this bounded
  // replay reproduces the rings of an uncached run exactly.
  void rebuild_windows(SequenceState& state, Workspace& ws) const;
  int64_t replay_tokens() const { return int64_t(cfg_.n_layers) * (cfg_.window_size - 1) + cfg_.window_size; }

  // di::Model. Streams: per KV-source layer, "layer<i>.compressed_kv" then "layer<i>.index_keys".
  const ModelInfo& info() const override { return info_; }
  std::vector<kvcache::StreamLayout> cache_layout(int page_tokens) const override;
  std::unique_ptr<di::SequenceState> new_state(const StateOptions& opts) const override;
  std::unique_ptr<di::Workspace> new_workspace() const override { return std::make_unique<Workspace>(); }
  void forward_batch(std::span<di::BatchItem> items, di::Workspace& ws) const override;
  int64_t resume_tokens() const override { return replay_tokens(); }
  bool has_snapshots() const override { return true; }
  void resume(di::SequenceState& state, di::Workspace& ws) const override;
  std::unique_ptr<StepCost> step_cost() const override;  // model/v41/cost.cpp

 private:
  Model() = default;
  struct Ctx;
  void engram(int layer, Ctx& c) const;
  void block(int layer, Ctx& c) const;
  using Segment = detail::Segment;
  void attention(int layer, Ctx& c, const float* x, float* out) const;
  // kv_new/gate_new: the segment's compressor projections (gate_new null at ratio 1).
  void compress(int layer, Ctx& c, Segment& g, float* kv_new, float* gate_new) const;
  // iq/iw: the segment's index queries (rotated, FP4-QDQ'd) and head weights.
  void index_select(int layer, Ctx& c, Segment& g, const float* iq, const float* iw) const;
  void moe(int layer, Ctx& c, const float* x, float* out) const;
  void run_layers(Ctx& c, std::span<const std::span<const int32_t>> tokens) const;
  void hc_mixes(const HcWeights& w, const float* stream, int S, float* pre, float* post, float* comb, Workspace& ws) const;
  const float* rope_table(int layer, int64_t pos, float* buf) const;
  // The kernels of the model's numerics mode (kern:: for exact, kern::fast:: for fast).
  void linear(const float* x, int64_t m, const ref::Fp8Weight& w, float* y) const;
  void linear(const float* x, int64_t m, const ref::Fp4Weight& w, float* y) const;
  void linear(const float* x, int64_t m, const ref::Bf16Weight& w, float* y, bool round_out) const;
  void linear(const float* x, int64_t m, const ref::F32Weight& w, float* y) const;
  void linear_wo_a(const float* x, int64_t m, const ref::Fp8Weight& w, float* y) const;
  void head(const float* x, int64_t m, float* y) const;
  void rms_norm(const float* x, const Bf16Vec& w, int64_t n, float* y) const;
  float rms_scale(const float* x, int64_t n) const;
  void sparse_attention(const float* q, int n_heads, int d, const float* const* kv_rows, int64_t n_rows,
                        const float* attn_sink, float softmax_scale, float* out) const;

  V41Config cfg_;
  ModelInfo info_;
  std::unique_ptr<ThreadPool> pool_;  // LoadOptions::threads > 0
  std::unique_ptr<Checkpoint> ckpt_;
  ModelWeights w_;
  HugeBuffer packed_;  // repacked FP8/FP4 weights (repack_weights), when the kernels use them
  EngramTokenMap token_map_;
  EngramConstants engram_;
  IndexKeyPolicy policy_ = IndexKeyPolicy::PerSource;
  Numerics numerics_ = Numerics::Fast;
  std::vector<float> freqs_base_, freqs_yarn_;  // rope_head_dim/2 frequencies of the two RoPE kinds
  std::vector<float> wqk_;                      // per engram layer: q_weight * k_weight, fp32 [hc*dim]
};

// load_model's entry for V4.1 (model/model.cpp): LoadOptions::threads 0 = all cores.
std::unique_ptr<di::Model> load_as_model(const std::string& model_dir, const di::LoadOptions& opts);

// The cache-format id of ModelInfo: names the page layout and numerics.
std::string cache_format(const V41Config& cfg, Numerics numerics);

}  // namespace di::v41
