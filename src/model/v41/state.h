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
// behind RowCache so that a paged cache manager can own the growing part.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "io/config.h"

namespace di::v41 {

// A growing array of fixed-width float rows stored in pages of `rows_per_page` rows. Copies share
// pages; a shared page is cloned before it is written (copy-on-write).
class RowCache {
 public:
  RowCache() = default;
  RowCache(int width, int rows_per_page) : width_(width), rows_per_page_(rows_per_page) {}

  int width() const { return width_; }
  int64_t size() const { return n_; }
  const float* row(int64_t j) const {
    return pages_[size_t(j / rows_per_page_)]->data() + (j % rows_per_page_) * width_;
  }
  // Pointer to a new row at index size(); the caller fills it.
  float* append();
  void truncate(int64_t n);
  size_t bytes() const { return pages_.size() * size_t(rows_per_page_) * size_t(width_) * sizeof(float); }

 private:
  int width_ = 0, rows_per_page_ = 64;
  int64_t n_ = 0;
  std::vector<std::shared_ptr<std::vector<float>>> pages_;
};

struct LayerState {
  std::vector<float> window;       // [window_cap, head_dim], slot = pos % window_cap
  std::vector<float> comp_inputs;  // kv-source ratio > 1: [comp_cap, 2*head_dim] (kv | score), slot = pos % comp_cap
  RowCache compressed_kv;          // kv sources: [n_entries, head_dim]
  RowCache index_keys;             // kv sources: [n_entries, index_head_dim]
};

class SequenceState {
 public:
  SequenceState(const V41Config& cfg, int max_rollback = 64, int rows_per_page = 64);

  int64_t pos() const { return int64_t(tokens_.size()); }  // number of tokens processed
  const std::vector<int32_t>& tokens() const { return tokens_; }
  int max_rollback() const { return max_rollback_; }

  // Back to position p (p tokens kept), pos() - max_rollback() <= p <= pos(). Throws otherwise.
  void truncate(int64_t p);
  // Bytes held (window rings, compressor tails, compressed rows, tokens).
  size_t bytes() const;

  // Forward-pass internals.
  int window_cap() const { return window_cap_; }
  int comp_cap() const { return comp_cap_; }
  std::vector<LayerState>& layers() { return layers_; }
  const std::vector<LayerState>& layers() const { return layers_; }
  std::vector<int32_t>& mutable_tokens() { return tokens_; }
  // Reference-quirk mode only: the index-key owner whose cache the shared slot points at.
  int index_k_publisher = -1;

 private:
  int max_rollback_, window_cap_, comp_cap_;
  std::vector<int32_t> tokens_;
  std::vector<LayerState> layers_;
  std::vector<int> ratios_;
};

}  // namespace di::v41
