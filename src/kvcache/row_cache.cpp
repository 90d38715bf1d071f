#include "kvcache/row_cache.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace di::kvcache {

PageRef RowCache::new_page() const { return pool_ ? pool_->allocate(page_bytes()) : make_page(page_bytes()); }

std::byte* RowCache::append_bytes() {
  const int64_t slot = n_ % rows_per_page_;
  const size_t page = size_t(n_ / rows_per_page_);
  if (page == pages_.size()) {
    pages_.push_back(new_page());
  } else if (pages_[page].use_count() > 1) {
    PageRef copy = new_page();  // copy-on-write
    std::memcpy(copy->data(), pages_[page]->data(), page_bytes());
    pages_[page] = std::move(copy);
  }
  ++n_;
  return pages_[page]->data() + size_t(slot) * row_bytes_;
}

size_t RowCache::bytes_needed(int64_t rows) const {
  if (row_bytes_ == 0 || rows <= 0) return 0;
  const int64_t have = int64_t(pages_.size()) * rows_per_page_;
  int64_t pages = std::max<int64_t>(0, (n_ + rows - have + rows_per_page_ - 1) / rows_per_page_);
  // Writing into a partly filled page that another owner shares first copies it.
  if (n_ % rows_per_page_ != 0 && pages_.back().use_count() > 1) ++pages;
  return size_t(pages) * page_bytes();
}

std::vector<PageRef> RowCache::share_pages(size_t n_pages) const {
  if (n_pages > pages_.size() || int64_t(n_pages) * rows_per_page_ > n_)
    throw std::out_of_range("RowCache::share_pages: " + std::to_string(n_pages) + " full pages requested, " +
                            std::to_string(n_ / rows_per_page_) + " available");
  return std::vector<PageRef>(pages_.begin(), pages_.begin() + std::ptrdiff_t(n_pages));
}

void RowCache::adopt(std::vector<PageRef> pages, int64_t rows) {
  if (rows > int64_t(pages.size()) * rows_per_page_) throw std::invalid_argument("RowCache::adopt: too few pages");
  for (const auto& p : pages)
    if (!p || p->size() != page_bytes()) throw std::invalid_argument("RowCache::adopt: page size mismatch");
  pages_ = std::move(pages);
  n_ = rows;
}

void RowCache::truncate(int64_t n) {
  if (n < 0 || n > n_) throw std::out_of_range("RowCache::truncate: " + std::to_string(n) + " of " + std::to_string(n_));
  n_ = n;
  pages_.resize(size_t((n_ + rows_per_page_ - 1) / rows_per_page_));
}

}  // namespace di::kvcache
