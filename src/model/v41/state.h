// Per-sequence state of the V4.1 forward pass: everything a later chunk needs from earlier ones.
//
// - per layer, a window ring of post-RoPE, FP8-QDQ'd window KV (capacity window + rollback);
// - per KV-source layer, the compressor's per-token projections (kv, gate score) for the last
//   ratio + rollback positions, from which an incomplete group's tail is pooled later;
// - per KV-source layer, the growing compressed KV rows and index-key rows (RowCache, in pages);
// - the token history (Engram n-grams and prefix bookkeeping).
//
// The state can be copied (pages are shared copy-on-write) and truncated back by up to
// `max_rollback` positions, which speculative decoding needs. Where its memory lives is hidden
// behind kvcache::RowCache so that a paged cache manager can own the growing part. It implements
// the architecture-neutral di::SequenceState (model/model.h) for the engine.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <vector>

#include "kvcache/page_pool.h"
#include "kvcache/row_cache.h"
#include "model/model.h"
#include "model/v41/config.h"

namespace di::v41 {

using kvcache::CacheExhausted;
using kvcache::PagePool;
using kvcache::PageRef;
using kvcache::PoolReservation;
using kvcache::PrefixPages;
using kvcache::RowCache;

struct LayerState {
  std::vector<float> window;       // [window_cap, head_dim], slot = pos % window_cap
  std::vector<float> comp_inputs;  // kv-source ratio > 1: [comp_cap, 2*head_dim] (kv | score), slot = pos % comp_cap
  RowCache compressed_kv;          // kv sources: [n_entries, head_dim] fp32
  RowCache index_keys;             // kv sources: [n_entries, index_head_dim] fp32
};

// The paged streams, in PrefixPages order: for each KV-source layer, its compressed KV rows, then
// its index-key rows.
class SequenceState final : public di::SequenceState {
 public:
  // Pages hold `page_tokens` tokens' worth of rows in every layer (page_tokens / ratio rows), so
  // token page k of the sequence is page k of every cache. With a pool, pages count against its
  // budget. With a state pool, the fixed per-sequence part (window rings, compressor inputs) is
  // charged against it (a separate budget), and so is every copy.
  SequenceState(const V41Config& cfg, int max_rollback = 64, int page_tokens = 64, PagePool* pool = nullptr,
                PagePool* state_pool = nullptr);

  int64_t pos() const override { return int64_t(tokens_.size()); }  // number of tokens processed
  const std::vector<int32_t>& tokens() const override { return tokens_; }
  int max_rollback() const { return max_rollback_; }

  // Back to position p (p tokens kept), max(pos() - max_rollback(), rollback_floor()) <= p <= pos().
  // Throws otherwise.
  void truncate(int64_t p) override;
  int64_t rollback_floor() const override { return rollback_floor_; }
  int page_tokens() const { return page_tokens_; }
  PagePool* pool() const { return pool_; }
  // Cache bytes that processing `n_tokens` more tokens would allocate.
  size_t bytes_needed(int64_t n_tokens) const override;

  // Prefix sharing: the pages covering the first n_tokens tokens (n_tokens a multiple of
  // page_tokens() and <= pos()), and a state that starts from such pages plus the prefix's tokens.
  // The window rings of the adopted state are empty: Model::rebuild_windows fills them.
  PrefixPages share_prefix(int64_t n_tokens) const override;
  void adopt_prefix(const PrefixPages& pages, std::span<const int32_t> tokens) override;
  // At a page boundary the compressor groups are closed (page_tokens is a multiple of every
  // ratio) and the pages end there, so a snapshot is the window rows the next token attends to:
  // min(pos, window - 1) rows per layer, as bf16 where every value is exactly a bf16 (FP8-QDQ'd
  // rows are), else fp32.
  std::vector<std::byte> snapshot() const override;
  void restore_snapshot(const PrefixPages& pages, std::span<const int32_t> tokens,
                        std::span<const std::byte> snapshot) override;
  // Bytes held (window rings, compressor tails, compressed rows, tokens).
  size_t bytes() const override;
  // Bytes of the fixed part (window rings and compressor inputs): what a state pool is charged.
  size_t fixed_bytes() const override;
  std::unique_ptr<di::SequenceState> clone() const override { return std::make_unique<SequenceState>(*this); }

  // Forward-pass internals.
  int window_cap() const { return window_cap_; }
  int comp_cap() const { return comp_cap_; }
  std::vector<LayerState>& layers() { return layers_; }
  const std::vector<LayerState>& layers() const { return layers_; }
  std::vector<int32_t>& mutable_tokens() { return tokens_; }
  // Reference-quirk mode only: the index-key owner whose cache the shared slot points at.
  int index_k_publisher = -1;

 private:
  int max_rollback_, window_, window_cap_, comp_cap_, page_tokens_, head_dim_;
  PagePool* pool_;
  int64_t rollback_floor_ = 0;
  PoolReservation fixed_;
  std::vector<int32_t> tokens_;
  std::vector<LayerState> layers_;
  std::vector<int> ratios_;
};

}  // namespace di::v41
