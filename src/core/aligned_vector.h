// std::vector whose storage starts on a cache line. glibc's malloc guarantees 16 bytes, so a
// 64-byte vector load from a heap buffer spans two cache lines three times in four; the kernels'
// scratch rows (x, widened x, keys) are read that way in their inner loops.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace di {

inline constexpr size_t kCacheLine = 64;

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(kCacheLine))); }
  void deallocate(T* p, size_t) noexcept { ::operator delete(p, std::align_val_t(kCacheLine)); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept { return true; }
};

template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace di
