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
#include <span>
#include <stdexcept>
#include <vector>

#include "io/config.h"

namespace di::v41 {

using Page = std::shared_ptr<std::vector<float>>;

// Thrown when a cache page is needed and the pool's byte budget is spent. The engine checks
// SequenceState::bytes_needed first, so a forward pass never fails half-way.
struct CacheExhausted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Pages for the growing caches of all sequences, drawn from one byte budget. A page returns its
// bytes to the pool when its last owner (a sequence or the prefix cache) releases it.
class PagePool {
 public:
  explicit PagePool(size_t budget_bytes);
  Page allocate(size_t floats);  // throws CacheExhausted
  // Charges `bytes` without allocating (memory owned elsewhere); released with the returned handle.
  std::shared_ptr<void> reserve(size_t bytes);  // throws CacheExhausted
  size_t used_bytes() const;
  size_t budget_bytes() const { return budget_; }
  size_t free_bytes() const;
  int64_t pages_in_use() const;

 private:
  struct Counters;
  size_t budget_;
  std::shared_ptr<Counters> counters_;  // shared with page deleters, which may outlive the pool
};

// A growing array of fixed-width float rows stored in pages of `rows_per_page` rows. Copies share
// pages; a shared page is cloned before it is written (copy-on-write).
class RowCache {
 public:
  RowCache() = default;
  RowCache(int width, int rows_per_page, PagePool* pool = nullptr)
      : width_(width), rows_per_page_(rows_per_page), pool_(pool) {}

  int width() const { return width_; }
  int64_t size() const { return n_; }
  const float* row(int64_t j) const {
    return pages_[size_t(j / rows_per_page_)]->data() + (j % rows_per_page_) * width_;
  }
  // Pointer to a new row at index size(); the caller fills it.
  float* append();
  void truncate(int64_t n);
  size_t bytes() const { return pages_.size() * page_bytes(); }
  size_t page_bytes() const { return size_t(rows_per_page_) * size_t(width_) * sizeof(float); }
  int rows_per_page() const { return rows_per_page_; }
  // Bytes that appending `rows` more rows would allocate (new pages, or a copy of a shared page).
  size_t bytes_needed(int64_t rows) const;
  // The first n_pages full pages, shared (for the prefix cache), and the reverse.
  std::vector<Page> share_pages(size_t n_pages) const;
  void adopt(std::vector<Page> pages, int64_t rows);

 private:
  Page new_page() const;
  int width_ = 0, rows_per_page_ = 64;
  PagePool* pool_ = nullptr;
  int64_t n_ = 0;
  std::vector<Page> pages_;
};

struct LayerState {
  std::vector<float> window;       // [window_cap, head_dim], slot = pos % window_cap
  std::vector<float> comp_inputs;  // kv-source ratio > 1: [comp_cap, 2*head_dim] (kv | score), slot = pos % comp_cap
  RowCache compressed_kv;          // kv sources: [n_entries, head_dim]
  RowCache index_keys;             // kv sources: [n_entries, index_head_dim]
};

// A charge against a pool for memory a sequence owns directly (its fixed state). Copying the owner
// charges the pool again (and throws CacheExhausted when it cannot), so copies are accounted too.
class PoolReservation {
 public:
  PoolReservation() = default;
  PoolReservation(PagePool* pool, size_t bytes) : pool_(pool), bytes_(bytes), hold_(pool ? pool->reserve(bytes) : nullptr) {}
  PoolReservation(const PoolReservation& o) : PoolReservation(o.pool_, o.bytes_) {}
  PoolReservation& operator=(const PoolReservation& o) {
    if (this != &o) *this = PoolReservation(o.pool_, o.bytes_);
    return *this;
  }
  PoolReservation(PoolReservation&&) noexcept = default;
  PoolReservation& operator=(PoolReservation&&) noexcept = default;
  size_t bytes() const { return hold_ ? bytes_ : 0; }

 private:
  PagePool* pool_ = nullptr;
  size_t bytes_ = 0;
  std::shared_ptr<void> hold_;
};

// The compressed KV and index-key pages of a prefix of `n_tokens` tokens (a multiple of the page
// size), per layer; empty for layers that are not KV sources.
struct PrefixPages {
  int64_t n_tokens = 0;
  std::vector<std::vector<Page>> compressed_kv, index_keys;
};

class SequenceState {
 public:
  // Pages hold `page_tokens` tokens' worth of rows in every layer (page_tokens / ratio rows), so
  // token page k of the sequence is page k of every cache. With a pool, pages count against its
  // budget. With a state pool, the fixed per-sequence part (window rings, compressor inputs) is
  // charged against it (a separate budget), and so is every copy.
  SequenceState(const V41Config& cfg, int max_rollback = 64, int page_tokens = 64, PagePool* pool = nullptr,
                PagePool* state_pool = nullptr);

  int64_t pos() const { return int64_t(tokens_.size()); }  // number of tokens processed
  const std::vector<int32_t>& tokens() const { return tokens_; }
  int max_rollback() const { return max_rollback_; }

  // Back to position p (p tokens kept), max(pos() - max_rollback(), rollback_floor()) <= p <= pos().
  // Throws otherwise.
  void truncate(int64_t p);
  int64_t rollback_floor() const { return rollback_floor_; }
  int page_tokens() const { return page_tokens_; }
  PagePool* pool() const { return pool_; }
  // Cache bytes that processing `n_tokens` more tokens would allocate.
  size_t bytes_needed(int64_t n_tokens) const;

  // Prefix sharing: the pages covering the first n_tokens tokens (n_tokens a multiple of
  // page_tokens() and <= pos()), and a state that starts from such pages plus the prefix's tokens.
  // The window rings of the adopted state are empty: Model::rebuild_windows fills them.
  PrefixPages share_prefix(int64_t n_tokens) const;
  void adopt_prefix(const PrefixPages& pages, std::span<const int32_t> tokens);
  // Bytes held (window rings, compressor tails, compressed rows, tokens).
  size_t bytes() const;
  // Bytes of the fixed part (window rings and compressor inputs): what a state pool is charged.
  size_t fixed_bytes() const;

  // Forward-pass internals.
  int window_cap() const { return window_cap_; }
  int comp_cap() const { return comp_cap_; }
  std::vector<LayerState>& layers() { return layers_; }
  const std::vector<LayerState>& layers() const { return layers_; }
  std::vector<int32_t>& mutable_tokens() { return tokens_; }
  // Reference-quirk mode only: the index-key owner whose cache the shared slot points at.
  int index_k_publisher = -1;

 private:
  int max_rollback_, window_cap_, comp_cap_, page_tokens_;
  PagePool* pool_;
  int64_t rollback_floor_ = 0;
  PoolReservation fixed_;
  std::vector<int32_t> tokens_;
  std::vector<LayerState> layers_;
  std::vector<int> ratios_;
};

}  // namespace di::v41
