// Per-sequence state of the V3 forward pass: the token history and, per layer, the MLA cache of the
// absorbed form: one row per token holding the normalized latent (kv_lora_rank) and the rotated
// k_pe (qk_rope_head_dim), fp32 values. There is no sliding window and nothing else per sequence,
// so a truncation is exact, the fixed part is empty and a shared prefix needs no replay.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvcache/page_pool.h"
#include "kvcache/row_cache.h"
#include "model/model.h"
#include "model/v3/config.h"

namespace di::v3 {

using kvcache::CacheExhausted;
using kvcache::PagePool;
using kvcache::PrefixPages;

class SequenceState final : public di::SequenceState {
 public:
  // Pages hold `page_tokens` rows of every layer's cache (token page k is page k of every stream,
  // one stream per layer); with a pool they count against its budget.
  SequenceState(const V3Config& cfg, int max_rollback = 64, int page_tokens = 64, PagePool* pool = nullptr);

  int64_t pos() const override { return int64_t(tokens_.size()); }
  const std::vector<int32_t>& tokens() const override { return tokens_; }
  // Back to p, max(pos() - max_rollback(), 0) <= p <= pos(); throws std::out_of_range otherwise.
  void truncate(int64_t p) override;
  int64_t rollback_floor() const override { return 0; }
  size_t bytes_needed(int64_t n_tokens) const override;
  PrefixPages share_prefix(int64_t n_tokens) const override;
  // Starts from shared pages plus the prefix's tokens; the state must be empty.
  void adopt_prefix(const PrefixPages& pages, std::span<const int32_t> tokens) override;
  size_t bytes() const override;
  size_t fixed_bytes() const override { return 0; }
  std::unique_ptr<di::SequenceState> clone() const override { return std::make_unique<SequenceState>(*this); }

  int max_rollback() const { return max_rollback_; }
  int page_tokens() const { return page_tokens_; }
  PagePool* pool() const { return pool_; }
  // Forward-pass internals: the cache of each layer, rows of kv_lora_rank + qk_rope_head_dim floats.
  int row_width() const { return width_; }
  std::vector<kvcache::RowCache>& caches() { return caches_; }
  const std::vector<kvcache::RowCache>& caches() const { return caches_; }
  std::vector<int32_t>& mutable_tokens() { return tokens_; }

 private:
  int max_rollback_, page_tokens_, width_;
  PagePool* pool_;
  std::vector<int32_t> tokens_;
  std::vector<kvcache::RowCache> caches_;
};

}  // namespace di::v3
