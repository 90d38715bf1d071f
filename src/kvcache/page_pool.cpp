#include "kvcache/page_pool.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>

namespace di::kvcache {

namespace {
size_t storage_bytes(size_t bytes) { return std::max(kPageAlign, (bytes + kPageAlign - 1) / kPageAlign * kPageAlign); }
}  // namespace

Page::Page(size_t bytes)
    : data_(static_cast<std::byte*>(::operator new(storage_bytes(bytes), std::align_val_t(kPageAlign)))), size_(bytes) {
  std::memset(data_, 0, storage_bytes(bytes));
}

Page::~Page() { ::operator delete(data_, std::align_val_t(kPageAlign)); }

PageRef make_page(size_t bytes) { return std::make_shared<Page>(bytes); }

const char* element_type_name(ElementType t) {
  switch (t) {
    case ElementType::F32: return "f32";
    case ElementType::Bf16: return "bf16";
    case ElementType::Fp8E4m3: return "fp8_e4m3";
    case ElementType::Bytes: return "bytes";
  }
  return "unknown";
}

struct PagePool::Counters {
  std::atomic<size_t> used{0};
  std::atomic<int64_t> pages{0};
};

PagePool::PagePool(size_t budget_bytes) : budget_(budget_bytes), counters_(std::make_shared<Counters>()) {}

PageRef PagePool::allocate(size_t bytes) {
  size_t used = counters_->used.load();
  do {
    if (used + bytes > budget_)
      throw CacheExhausted("KV cache pool exhausted: " + std::to_string(used) + " of " + std::to_string(budget_) +
                           " bytes in use, " + std::to_string(bytes) + " more needed");
  } while (!counters_->used.compare_exchange_weak(used, used + bytes));
  Page* page;
  try {
    page = new Page(bytes);
  } catch (...) {
    counters_->used.fetch_sub(bytes);
    throw;
  }
  counters_->pages.fetch_add(1);
  auto c = counters_;
  return PageRef(page, [c, bytes](Page* p) {
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

}  // namespace di::kvcache
