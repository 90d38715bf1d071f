#include "model/v41/state.h"

#include <stdexcept>
#include <string>

namespace di::v41 {

float* RowCache::append() {
  const int64_t slot = n_ % rows_per_page_;
  const size_t page = size_t(n_ / rows_per_page_);
  if (page == pages_.size()) {
    pages_.push_back(std::make_shared<std::vector<float>>(size_t(rows_per_page_) * size_t(width_)));
  } else if (pages_[page].use_count() > 1) {
    pages_[page] = std::make_shared<std::vector<float>>(*pages_[page]);  // copy-on-write
  }
  ++n_;
  return pages_[page]->data() + slot * width_;
}

void RowCache::truncate(int64_t n) {
  if (n < 0 || n > n_) throw std::out_of_range("RowCache::truncate: " + std::to_string(n) + " of " + std::to_string(n_));
  n_ = n;
  pages_.resize(size_t((n_ + rows_per_page_ - 1) / rows_per_page_));
}

SequenceState::SequenceState(const V41Config& cfg, int max_rollback, int rows_per_page)
    : max_rollback_(max_rollback),
      window_cap_(cfg.window_size + max_rollback),
      comp_cap_(0) {
  int max_ratio = 1;
  for (int i = 0; i < cfg.n_layers; ++i) max_ratio = std::max(max_ratio, cfg.compress_ratio(i));
  comp_cap_ = max_ratio + max_rollback;
  layers_.resize(size_t(cfg.n_layers));
  for (int i = 0; i < cfg.n_layers; ++i) {
    auto& L = layers_[size_t(i)];
    L.window.assign(size_t(window_cap_) * size_t(cfg.head_dim), 0.f);
    ratios_.push_back(cfg.compress_ratio(i));
    if (cfg.is_kv_source(i)) {
      if (cfg.compress_ratio(i) > 1) L.comp_inputs.assign(size_t(comp_cap_) * 2 * size_t(cfg.head_dim), 0.f);
      L.compressed_kv = RowCache(cfg.head_dim, rows_per_page);
      L.index_keys = RowCache(cfg.index_head_dim, rows_per_page);
    }
  }
}

void SequenceState::truncate(int64_t p) {
  if (p > pos() || p < pos() - max_rollback_ || p < 0)
    throw std::out_of_range("SequenceState::truncate to " + std::to_string(p) + ": position " + std::to_string(pos()) +
                            ", rollback limit " + std::to_string(max_rollback_));
  // The window ring and compressor inputs are indexed by absolute position with room for
  // max_rollback extra positions, so the rows for positions < p are still intact.
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto& L = layers_[i];
    if (L.compressed_kv.width() == 0) continue;
    const int64_t keep = p / ratios_[i];  // groups completed before p
    L.compressed_kv.truncate(keep);
    L.index_keys.truncate(keep);
  }
  tokens_.resize(size_t(p));
  index_k_publisher = -1;
}

size_t SequenceState::bytes() const {
  size_t b = tokens_.size() * sizeof(int32_t);
  for (const auto& L : layers_)
    b += (L.window.size() + L.comp_inputs.size()) * sizeof(float) + L.compressed_kv.bytes() + L.index_keys.bytes();
  return b;
}

}  // namespace di::v41
