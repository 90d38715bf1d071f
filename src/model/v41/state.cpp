#include "model/v41/state.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>

namespace di::v41 {

struct PagePool::Counters {
  std::atomic<size_t> used{0};
  std::atomic<int64_t> pages{0};
};

PagePool::PagePool(size_t budget_bytes) : budget_(budget_bytes), counters_(std::make_shared<Counters>()) {}

Page PagePool::allocate(size_t floats) {
  const size_t bytes = floats * sizeof(float);
  size_t used = counters_->used.load();
  do {
    if (used + bytes > budget_)
      throw CacheExhausted("KV cache pool exhausted: " + std::to_string(used) + " of " + std::to_string(budget_) +
                           " bytes in use, " + std::to_string(bytes) + " more needed");
  } while (!counters_->used.compare_exchange_weak(used, used + bytes));
  counters_->pages.fetch_add(1);
  auto c = counters_;
  return Page(new std::vector<float>(floats), [c, bytes](std::vector<float>* p) {
    c->used.fetch_sub(bytes);
    c->pages.fetch_sub(1);
    delete p;
  });
}

std::shared_ptr<void> PagePool::reserve(size_t bytes) {
  size_t used = counters_->used.load();
  do {
    if (used + bytes > budget_)
      throw CacheExhausted("state pool exhausted: " + std::to_string(used) + " of " + std::to_string(budget_) +
                           " bytes in use, " + std::to_string(bytes) + " more needed");
  } while (!counters_->used.compare_exchange_weak(used, used + bytes));
  auto c = counters_;
  return std::shared_ptr<void>(nullptr, [c, bytes](void*) { c->used.fetch_sub(bytes); });
}

size_t PagePool::used_bytes() const { return counters_->used.load(); }
size_t PagePool::free_bytes() const { return budget_ - std::min(budget_, used_bytes()); }
int64_t PagePool::pages_in_use() const { return counters_->pages.load(); }

Page RowCache::new_page() const {
  const size_t floats = size_t(rows_per_page_) * size_t(width_);
  return pool_ ? pool_->allocate(floats) : std::make_shared<std::vector<float>>(floats);
}

float* RowCache::append() {
  const int64_t slot = n_ % rows_per_page_;
  const size_t page = size_t(n_ / rows_per_page_);
  if (page == pages_.size()) {
    pages_.push_back(new_page());
  } else if (pages_[page].use_count() > 1) {
    Page copy = new_page();  // copy-on-write
    std::copy(pages_[page]->begin(), pages_[page]->end(), copy->begin());
    pages_[page] = std::move(copy);
  }
  ++n_;
  return pages_[page]->data() + slot * width_;
}

size_t RowCache::bytes_needed(int64_t rows) const {
  if (width_ == 0 || rows <= 0) return 0;
  const int64_t have = int64_t(pages_.size()) * rows_per_page_;
  int64_t pages = std::max<int64_t>(0, (n_ + rows - have + rows_per_page_ - 1) / rows_per_page_);
  // Writing into a partly filled page that another owner shares first copies it.
  if (n_ % rows_per_page_ != 0 && pages_.back().use_count() > 1) ++pages;
  return size_t(pages) * page_bytes();
}

std::vector<Page> RowCache::share_pages(size_t n_pages) const {
  if (n_pages > pages_.size() || int64_t(n_pages) * rows_per_page_ > n_)
    throw std::out_of_range("RowCache::share_pages: " + std::to_string(n_pages) + " full pages requested, " +
                            std::to_string(n_ / rows_per_page_) + " available");
  return std::vector<Page>(pages_.begin(), pages_.begin() + std::ptrdiff_t(n_pages));
}

void RowCache::adopt(std::vector<Page> pages, int64_t rows) {
  if (rows > int64_t(pages.size()) * rows_per_page_) throw std::invalid_argument("RowCache::adopt: too few pages");
  for (const auto& p : pages)
    if (!p || p->size() != size_t(rows_per_page_) * size_t(width_)) throw std::invalid_argument("RowCache::adopt: page size mismatch");
  pages_ = std::move(pages);
  n_ = rows;
}

void RowCache::truncate(int64_t n) {
  if (n < 0 || n > n_) throw std::out_of_range("RowCache::truncate: " + std::to_string(n) + " of " + std::to_string(n_));
  n_ = n;
  pages_.resize(size_t((n_ + rows_per_page_ - 1) / rows_per_page_));
}

SequenceState::SequenceState(const V41Config& cfg, int max_rollback, int page_tokens, PagePool* pool, PagePool* state_pool)
    : max_rollback_(max_rollback),
      window_cap_(cfg.window_size + max_rollback),
      comp_cap_(0),
      page_tokens_(page_tokens),
      pool_(pool) {
  int max_ratio = 1;
  for (int i = 0; i < cfg.n_layers; ++i) {
    max_ratio = std::max(max_ratio, cfg.compress_ratio(i));
    if (cfg.compress_ratio(i) > 0 && page_tokens % cfg.compress_ratio(i) != 0)
      throw std::invalid_argument("page size " + std::to_string(page_tokens) + " is not a multiple of compress ratio " +
                                  std::to_string(cfg.compress_ratio(i)));
  }
  comp_cap_ = max_ratio + max_rollback;
  layers_.resize(size_t(cfg.n_layers));
  for (int i = 0; i < cfg.n_layers; ++i) {
    auto& L = layers_[size_t(i)];
    L.window.assign(size_t(window_cap_) * size_t(cfg.head_dim), 0.f);
    ratios_.push_back(cfg.compress_ratio(i));
    if (cfg.is_kv_source(i)) {
      if (cfg.compress_ratio(i) > 1) L.comp_inputs.assign(size_t(comp_cap_) * 2 * size_t(cfg.head_dim), 0.f);
      const int rows_per_page = page_tokens / cfg.compress_ratio(i);
      L.compressed_kv = RowCache(cfg.head_dim, rows_per_page, pool);
      L.index_keys = RowCache(cfg.index_head_dim, rows_per_page, pool);
    }
  }
  fixed_ = PoolReservation(state_pool, fixed_bytes());
}

void SequenceState::truncate(int64_t p) {
  if (p > pos() || p < pos() - max_rollback_ || p < rollback_floor_)
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

size_t SequenceState::bytes_needed(int64_t n_tokens) const {
  size_t b = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& L = layers_[i];
    if (L.compressed_kv.width() == 0) continue;
    const int64_t rows = (pos() + n_tokens) / ratios_[i] - pos() / ratios_[i];
    b += L.compressed_kv.bytes_needed(rows) + L.index_keys.bytes_needed(rows);
  }
  return b;
}

PrefixPages SequenceState::share_prefix(int64_t n_tokens) const {
  if (n_tokens % page_tokens_ != 0 || n_tokens > pos())
    throw std::invalid_argument("share_prefix: " + std::to_string(n_tokens) + " tokens is not a whole number of " +
                                std::to_string(page_tokens_) + "-token pages within " + std::to_string(pos()));
  PrefixPages p;
  p.n_tokens = n_tokens;
  p.compressed_kv.resize(layers_.size());
  p.index_keys.resize(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i].compressed_kv.width() == 0) continue;
    const size_t n_pages = size_t(n_tokens / page_tokens_);
    p.compressed_kv[i] = layers_[i].compressed_kv.share_pages(n_pages);
    p.index_keys[i] = layers_[i].index_keys.share_pages(n_pages);
  }
  return p;
}

void SequenceState::adopt_prefix(const PrefixPages& pages, std::span<const int32_t> tokens) {
  if (pos() != 0) throw std::logic_error("adopt_prefix: the state is not empty");
  if (int64_t(tokens.size()) != pages.n_tokens || pages.compressed_kv.size() != layers_.size())
    throw std::invalid_argument("adopt_prefix: pages do not match the tokens or the model");
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i].compressed_kv.width() == 0) continue;
    const int64_t rows = pages.n_tokens / ratios_[i];
    layers_[i].compressed_kv.adopt(pages.compressed_kv[i], rows);
    layers_[i].index_keys.adopt(pages.index_keys[i], rows);
  }
  tokens_.assign(tokens.begin(), tokens.end());
  rollback_floor_ = pages.n_tokens;  // the window rings only get the prefix's last window back
}

size_t SequenceState::fixed_bytes() const {
  size_t b = 0;
  for (const auto& L : layers_) b += (L.window.size() + L.comp_inputs.size()) * sizeof(float);
  return b;
}

size_t SequenceState::bytes() const {
  size_t b = tokens_.size() * sizeof(int32_t);
  for (const auto& L : layers_)
    b += (L.window.size() + L.comp_inputs.size()) * sizeof(float) + L.compressed_kv.bytes() + L.index_keys.bytes();
  return b;
}

}  // namespace di::v41
