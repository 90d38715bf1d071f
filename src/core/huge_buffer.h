// Anonymous page-aligned memory for large, long-lived arrays (repacked weights), backed by
// transparent huge pages where the kernel allows: streaming gigabytes through 4 KiB pages costs
// a TLB miss every 4 KiB.
#pragma once

#include <cstddef>
#include <cstdint>

namespace di {

class HugeBuffer {
 public:
  HugeBuffer() = default;
  explicit HugeBuffer(size_t bytes);  // throws std::bad_alloc
  ~HugeBuffer();
  HugeBuffer(HugeBuffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  HugeBuffer& operator=(HugeBuffer&& o) noexcept;
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;

  uint8_t* data() const { return static_cast<uint8_t*>(p_); }
  size_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// Drops the resident pages of a read-only file mapping inside [p, p + bytes) (whole pages only);
// a later access faults them in again from the file. For views whose data now lives elsewhere.
void release_mapped_pages(const void* p, size_t bytes);

}  // namespace di
