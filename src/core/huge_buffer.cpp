#include "core/huge_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <new>

namespace di {

HugeBuffer::HugeBuffer(size_t bytes) : n_(bytes) {
  if (bytes == 0) return;
  p_ = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p_ == MAP_FAILED) {
    p_ = nullptr;
    n_ = 0;
    throw std::bad_alloc();
  }
  ::madvise(p_, bytes, MADV_HUGEPAGE);  // advisory: ignored where THP is off
}

HugeBuffer::~HugeBuffer() {
  if (p_) ::munmap(p_, n_);
}

HugeBuffer& HugeBuffer::operator=(HugeBuffer&& o) noexcept {
  if (this != &o) {
    if (p_) ::munmap(p_, n_);
    p_ = o.p_, n_ = o.n_;
    o.p_ = nullptr, o.n_ = 0;
  }
  return *this;
}

void release_mapped_pages(const void* p, size_t bytes) {
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) / page * page;
  if (e > b) ::madvise(reinterpret_cast<void*>(b), e - b, MADV_DONTNEED);
}

}  // namespace di
