// HugeBuffer (the repacked weights' memory) and release_mapped_pages (dropping the checkpoint
// pages whose codes were repacked): ownership, and that dropped pages leave RSS yet read back
// the file's bytes.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/huge_buffer.h"

namespace di {
namespace {

long resident_pages() {
  std::ifstream f("/proc/self/statm");
  long size = 0, resident = 0;
  f >> size >> resident;
  return resident;
}

TEST(HugeBuffer, OwnsWritableMemoryAndMoves) {
  HugeBuffer a(3 << 20);
  ASSERT_NE(a.data(), nullptr);
  EXPECT_EQ(a.size(), size_t(3) << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 4096, 0u);
  std::memset(a.data(), 0x5a, a.size());
  HugeBuffer b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(b.data()[12345], 0x5a);
  HugeBuffer c;
  c = std::move(b);
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(c.data()[(3 << 20) - 1], 0x5a);
  EXPECT_EQ(HugeBuffer(0).data(), nullptr);
}

TEST(HugeBuffer, ReleasedFilePagesLeaveRssAndReadBack) {
  const long page = sysconf(_SC_PAGESIZE);
  const size_t bytes = size_t(16) << 20;
  const std::string path = (std::filesystem::temp_directory_path() / ("di_release_" + std::to_string(getpid()))).string();
  {
    std::vector<uint8_t> data(bytes);
    for (size_t i = 0; i < bytes; ++i) data[i] = uint8_t(i * 131 + (i >> 12));
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(data.data()), std::streamsize(bytes));
  }
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  auto* p = static_cast<const uint8_t*>(::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0));
  ::close(fd);
  std::filesystem::remove(path);
  ASSERT_NE(p, MAP_FAILED);
  uint64_t sum = 0;
  for (size_t i = 0; i < bytes; i += size_t(page)) sum += p[i];  // fault every page in
  const long before = resident_pages();
  // An unaligned range: only the whole pages inside it go; the partial first and last stay.
  release_mapped_pages(p + 100, bytes - 200);
  const long after = resident_pages();
  EXPECT_GE(before - after, long(bytes / size_t(page)) - 2 - 64) << "resident pages before " << before << ", after " << after;
  for (size_t i = 0; i < bytes; i += 4093) ASSERT_EQ(p[i], uint8_t(i * 131 + (i >> 12))) << "at " << i;
  EXPECT_GT(sum, 0u);
  ::munmap(const_cast<uint8_t*>(p), bytes);
}

}  // namespace
}  // namespace di
