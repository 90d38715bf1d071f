// Per-sequence state of the V3 forward pass: the token history and, per layer, the MLA cache of the
// absorbed form: one row per token holding the normalized latent (kv_lora_rank) and the rotated
// k_pe (qk_rope_head_dim). There is no sliding window and nothing else per sequence, so truncating
// to any earlier position is exact and a shared prefix needs no replay.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "model/v3/config.h"
#include "model/v41/state.h"  // PagePool, RowCache (paged, copy-on-write)

namespace di::v3 {

using PagePool = v41::PagePool;
using Page = v41::Page;
using v41::CacheExhausted;

// The cache pages of a prefix of n_tokens tokens (a multiple of the page size): one stream per layer.
struct PrefixPages {
  int64_t n_tokens = 0;
  std::vector<std::vector<Page>> streams;
};

class SequenceState {
 public:
  // Pages hold `page_tokens` rows of every layer's cache (token page k is page k of every stream);
  // with a pool they count against its budget. max_rollback is kept for the interface: any
  // truncation is exact here.
  SequenceState(const V3Config& cfg, int max_rollback = 64, int page_tokens = 64, PagePool* pool = nullptr);

  int64_t pos() const { return int64_t(tokens_.size()); }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  int max_rollback() const { return max_rollback_; }
  int page_tokens() const { return page_tokens_; }
  PagePool* pool() const { return pool_; }
  int64_t rollback_floor() const { return 0; }
  // Back to position p (0 <= p <= pos()); throws std::out_of_range otherwise.
  void truncate(int64_t p);
  size_t bytes_needed(int64_t n_tokens) const;
  PrefixPages share_prefix(int64_t n_tokens) const;
  // Starts from shared pages plus the prefix's tokens; the state must be empty.
  void adopt_prefix(const PrefixPages& pages, std::span<const int32_t> tokens);
  size_t bytes() const;
  size_t fixed_bytes() const { return 0; }
  std::unique_ptr<SequenceState> clone() const { return std::make_unique<SequenceState>(*this); }

  // Forward-pass internals: the cache of each layer, row width kv_lora_rank + qk_rope_head_dim.
  std::vector<v41::RowCache>& caches() { return caches_; }
  const std::vector<v41::RowCache>& caches() const { return caches_; }
  std::vector<int32_t>& mutable_tokens() { return tokens_; }

 private:
  int max_rollback_, page_tokens_;
  PagePool* pool_;
  std::vector<int32_t> tokens_;
  std::vector<v41::RowCache> caches_;
};

}  // namespace di::v3
