#include "kvcache/disk_format.h"

#include <bit>
#include <cstring>
#include <new>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

namespace di::kvcache::disk {

static_assert(std::endian::native == std::endian::little, "the entry header is written in host order");

namespace {

constexpr char kHex[] = "0123456789abcdef";

template <class T>
T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
void store(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;  // upper case is not a name this tier writes
}

constexpr size_t kOffVersion = 8, kOffHeaderBytes = 12, kOffKey = 16, kOffPayloadBytes = 48, kOffPayloadHash = 56,
                 kOffCreated = 64, kOffFormatLen = 72, kOffHeaderHash = 88;

uint64_t header_hash(std::span<const std::byte> h) {
  // The checksum field counts as zero.
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  XXH3_64bits_update(&st, h.data(), kOffHeaderHash);
  const uint64_t zero = 0;
  XXH3_64bits_update(&st, &zero, sizeof zero);
  XXH3_64bits_update(&st, h.data() + kOffHeaderHash + 8, h.size() - kOffHeaderHash - 8);
  return XXH3_64bits_digest(&st);
}

}  // namespace

std::string key_hex(const EntryKey& key) {
  std::string s(64, '0');
  for (size_t i = 0; i < key.size(); ++i) {
    s[2 * i] = kHex[key[i] >> 4];
    s[2 * i + 1] = kHex[key[i] & 15];
  }
  return s;
}

int subdir_index(const EntryKey& key) { return key[0]; }

std::string subdir_name(int index) { return {kHex[(index >> 4) & 15], kHex[index & 15]}; }

std::string entry_relpath(const EntryKey& key) {
  return subdir_name(subdir_index(key)) + "/" + key_hex(key) + std::string(kEntrySuffix);
}

bool parse_entry_name(std::string_view name, EntryKey* key) {
  if (name.size() != 64 + kEntrySuffix.size() || name.substr(64) != kEntrySuffix) return false;
  for (size_t i = 0; i < 32; ++i) {
    const int hi = hex_value(name[2 * i]), lo = hex_value(name[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    (*key)[i] = uint8_t(hi << 4 | lo);
  }
  return true;
}

bool is_temp_name(std::string_view name) { return name.starts_with(kTempPrefix); }

size_t header_bytes(std::string_view format_id) { return kFixedHeaderBytes + (format_id.size() + 7) / 8 * 8; }

PayloadHash::PayloadHash() : state_(XXH3_createState()) {
  if (!state_) throw std::bad_alloc();
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}
PayloadHash::~PayloadHash() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void PayloadHash::update(std::span<const std::byte> b) {
  if (!b.empty()) XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), b.data(), b.size());
}
uint64_t PayloadHash::digest() const { return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_)); }

uint64_t payload_hash(std::span<const std::byte> b) { return XXH3_64bits(b.data(), b.size()); }

void encode_header(std::span<std::byte> out, const EntryKey& key, std::string_view format_id, uint64_t payload_bytes,
                   uint64_t payload_xxh3, uint64_t created_unix_ms) {
  std::memset(out.data(), 0, out.size());
  std::byte* h = out.data();
  std::memcpy(h, kMagic, sizeof kMagic);
  store<uint32_t>(h + kOffVersion, kVersion);
  store<uint32_t>(h + kOffHeaderBytes, uint32_t(out.size()));
  std::memcpy(h + kOffKey, key.data(), key.size());
  store<uint64_t>(h + kOffPayloadBytes, payload_bytes);
  store<uint64_t>(h + kOffPayloadHash, payload_xxh3);
  store<uint64_t>(h + kOffCreated, created_unix_ms);
  store<uint32_t>(h + kOffFormatLen, uint32_t(format_id.size()));
  std::memcpy(h + kFixedHeaderBytes, format_id.data(), format_id.size());
  store<uint64_t>(h + kOffHeaderHash, header_hash(out));
}

const char* header_check_name(HeaderCheck c) {
  switch (c) {
    case HeaderCheck::Ok: return "ok";
    case HeaderCheck::Corrupt: return "corrupt";
    case HeaderCheck::Foreign: return "foreign format";
    case HeaderCheck::WrongKey: return "wrong key";
    case HeaderCheck::WrongSize: return "wrong size";
  }
  return "?";
}

HeaderCheck check_header(std::span<const std::byte> hdr, const EntryKey& key, std::string_view format_id,
                         uint64_t payload_bytes, uint64_t* payload_xxh3) {
  const std::byte* h = hdr.data();
  if (hdr.size() < kFixedHeaderBytes || std::memcmp(h, kMagic, sizeof kMagic) != 0) return HeaderCheck::Corrupt;
  // Another layout version, or a format id of another length: not ours to interpret.
  if (load<uint32_t>(h + kOffVersion) != kVersion || load<uint32_t>(h + kOffHeaderBytes) != hdr.size())
    return HeaderCheck::Foreign;
  if (load<uint64_t>(h + kOffHeaderHash) != header_hash(hdr)) return HeaderCheck::Corrupt;
  const uint32_t flen = load<uint32_t>(h + kOffFormatLen);
  if (flen != format_id.size() || std::memcmp(h + kFixedHeaderBytes, format_id.data(), flen) != 0)
    return HeaderCheck::Foreign;
  if (std::memcmp(h + kOffKey, key.data(), key.size()) != 0) return HeaderCheck::WrongKey;
  if (load<uint64_t>(h + kOffPayloadBytes) != payload_bytes) return HeaderCheck::WrongSize;
  *payload_xxh3 = load<uint64_t>(h + kOffPayloadHash);
  return HeaderCheck::Ok;
}

}  // namespace di::kvcache::disk
