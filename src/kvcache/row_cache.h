// A growing array of fixed-size rows stored in pages of `rows_per_page` rows (one cache stream of
// one sequence). Copies share pages; a shared page is cloned before it is written (copy-on-write).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvcache/page_pool.h"

namespace di::kvcache {

class RowCache {
 public:
  RowCache() = default;
  // Without a pool, pages are allocated outside any budget.
  RowCache(size_t row_bytes, int rows_per_page, PagePool* pool = nullptr)
      : row_bytes_(row_bytes), rows_per_page_(rows_per_page), pool_(pool) {}

  bool empty_layout() const { return row_bytes_ == 0; }  // a stream this sequence does not have
  size_t row_bytes() const { return row_bytes_; }
  int64_t size() const { return n_; }
  template <class T = std::byte>
  const T* row(int64_t j) const {
    return reinterpret_cast<const T*>(pages_[size_t(j / rows_per_page_)]->data() + size_t(j % rows_per_page_) * row_bytes_);
  }
  // Pointer to a new row at index size(); the caller fills it.
  template <class T = std::byte>
  T* append() { return reinterpret_cast<T*>(append_bytes()); }
  void truncate(int64_t n);
  size_t bytes() const { return pages_.size() * page_bytes(); }
  size_t page_bytes() const { return size_t(rows_per_page_) * row_bytes_; }
  int rows_per_page() const { return rows_per_page_; }
  // Bytes that appending `rows` more rows would allocate (new pages, or a copy of a shared page).
  size_t bytes_needed(int64_t rows) const;
  // The first n_pages full pages, shared (for the prefix cache), and the reverse.
  std::vector<PageRef> share_pages(size_t n_pages) const;
  void adopt(std::vector<PageRef> pages, int64_t rows);

 private:
  std::byte* append_bytes();
  PageRef new_page() const;
  size_t row_bytes_ = 0;
  int rows_per_page_ = 64;
  PagePool* pool_ = nullptr;
  int64_t n_ = 0;
  std::vector<PageRef> pages_;
};

}  // namespace di::kvcache
