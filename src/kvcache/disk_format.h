// The on-disk layout of a disk-tier entry (docs/kv-cache.md, "Disk tier"): a header, then the
// payload. All integers little-endian.
//
//   0  magic "DIKVCACH"          8
//   8  version (1)               u32
//  12  header bytes              u32   96 + format id padded to 8
//  16  key                       32 bytes
//  48  payload bytes             u64
//  56  payload XXH3-64           u64
//  64  created, Unix ms          u64   informational
//  72  format id bytes           u32
//  76  reserved (0)              u32 + u64
//  88  header XXH3-64            u64   of the header bytes with this field zero
//  96  format id, zero padded to a multiple of 8
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "kvcache/disk_tier.h"

namespace di::kvcache::disk {

inline constexpr char kMagic[8] = {'D', 'I', 'K', 'V', 'C', 'A', 'C', 'H'};
inline constexpr uint32_t kVersion = 1;
inline constexpr size_t kFixedHeaderBytes = 96;
inline constexpr size_t kMaxFormatIdBytes = 1024;
inline constexpr std::string_view kEntrySuffix = ".kv";
inline constexpr std::string_view kTempPrefix = ".tmp-";

std::string key_hex(const EntryKey&);
// "ab/ab…(64 hex).kv" relative to the tier's directory.
std::string entry_relpath(const EntryKey&);
// Index (0..255) of the key's subdirectory, and that directory's name ("00".."ff").
int subdir_index(const EntryKey&);
std::string subdir_name(int index);
// True for "<64 lower-case hex>.kv", filling *key.
bool parse_entry_name(std::string_view name, EntryKey* key);
bool is_temp_name(std::string_view name);

size_t header_bytes(std::string_view format_id);

// Streaming XXH3-64 over payload parts.
class PayloadHash {
 public:
  PayloadHash();
  ~PayloadHash();
  void update(std::span<const std::byte>);
  uint64_t digest() const;

 private:
  void* state_;
};
uint64_t payload_hash(std::span<const std::byte>);

// Writes the header (header_bytes(format_id) bytes) into `out`.
void encode_header(std::span<std::byte> out, const EntryKey&, std::string_view format_id, uint64_t payload_bytes,
                   uint64_t payload_xxh3, uint64_t created_unix_ms);

enum class HeaderCheck { Ok, Corrupt, Foreign, WrongKey, WrongSize };
const char* header_check_name(HeaderCheck);
// Checks a header read from a file against what the reader expects; on Ok fills *payload_xxh3.
HeaderCheck check_header(std::span<const std::byte> header, const EntryKey&, std::string_view format_id,
                         uint64_t payload_bytes, uint64_t* payload_xxh3);

}  // namespace di::kvcache::disk
