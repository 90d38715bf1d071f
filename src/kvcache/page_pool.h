// Paged cache memory, independent of any model architecture: fixed-size byte pages drawn from a
// byte budget, charges for memory held elsewhere, and the layout a model declares for its pages.
//
// A sequence's paged caches are "streams" (e.g. one per layer and kind of cached row). Token page
// k of a sequence is page k of every stream, so a prefix of whole token pages is one page per
// stream per token page. Pages are opaque bytes, so a later tier (disk, another process, device
// memory) can hold them without knowing what the rows mean.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace di::kvcache {

// Thrown when a page is needed and the pool's byte budget is spent. Engines check
// SequenceState::bytes_needed first, so a forward pass never fails half-way.
struct CacheExhausted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline constexpr size_t kPageAlign = 64;  // cache line: rows read by vector loads start aligned

// A fixed-size block of bytes, 64-byte aligned, zero-filled when created.
class Page {
 public:
  explicit Page(size_t bytes);
  ~Page();
  Page(const Page&) = delete;
  Page& operator=(const Page&) = delete;

  size_t size() const { return size_; }
  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  template <class T>
  T* as() { return reinterpret_cast<T*>(data_); }
  template <class T>
  const T* as() const { return reinterpret_cast<const T*>(data_); }

 private:
  std::byte* data_;
  size_t size_;
};

// Shared ownership: a sequence, its copies and the prefix cache may all hold a page; the last
// owner gone returns its bytes to the pool.
using PageRef = std::shared_ptr<Page>;

// A page outside any pool (nothing is charged).
PageRef make_page(size_t bytes);

// Pages for the caches of all sequences, drawn from one byte budget.
class PagePool {
 public:
  explicit PagePool(size_t budget_bytes);
  PageRef allocate(size_t bytes);  // throws CacheExhausted
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

// Element type of a stream's rows, for tiers that convert or inspect pages.
enum class ElementType { F32, Bf16, Fp8E4m3, Bytes };
const char* element_type_name(ElementType);

// How one stream lays out its pages: `rows_per_page` rows of `row_bytes` bytes each.
struct StreamLayout {
  std::string name;  // e.g. "layer3.compressed_kv"
  int rows_per_page = 0;
  size_t row_bytes = 0;
  ElementType dtype = ElementType::F32;
  size_t page_bytes() const { return size_t(rows_per_page) * row_bytes; }
};

// The pages of a prefix of `n_tokens` tokens (whole token pages): streams[s][k] is token page k
// of stream s, in the order of the model's cache layout.
struct PrefixPages {
  int64_t n_tokens = 0;
  std::vector<std::vector<PageRef>> streams;
};

}  // namespace di::kvcache
