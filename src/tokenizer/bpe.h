// Byte-level BPE model: merges applied by rank to the bytes of one pre-tokenized word, with a
// bounded, thread-safe per-word cache.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace di::tok {

// GPT-2's reversible byte <-> printable-char map used by the ByteLevel pre-tokenizer and decoder.
const std::array<char32_t, 256>& byte_to_char();
// Inverse of byte_to_char: -1 for code points that are not in the map.
int char_to_byte(char32_t cp);

class BpeModel {
 public:
  // `model` is the tokenizer.json "model" object (type BPE).
  explicit BpeModel(const nlohmann::json& model);
  ~BpeModel();

  // Appends the ids of one word (raw bytes, before the byte-to-char map).
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  const std::unordered_map<std::string, int32_t>& vocab() const { return vocab_; }
  size_t cache_entries() const;  // for tests of the bound

 private:
  struct MergeEntry {
    uint64_t key;  // (left id << 32) | right id; kEmptyKey when unused
    uint32_t rank;
    int32_t merged;
  };
  static constexpr uint64_t kEmptyKey = ~uint64_t{0};
  static constexpr uint32_t kNoRank = ~uint32_t{0};

  const MergeEntry* find_merge(int32_t left, int32_t right) const {
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
    size_t slot = static_cast<size_t>((key * 0x9E3779B97F4A7C15ULL) >> merge_shift_);
    while (true) {
      const MergeEntry& e = merges_[slot];
      if (e.key == key) return &e;
      if (e.key == kEmptyKey) return nullptr;
      slot = (slot + 1) & merge_mask_;
    }
  }
  void merge_short(const uint8_t* bytes, size_t n, std::vector<int32_t>& out) const;
  void merge_long(const uint8_t* bytes, size_t n, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::array<int32_t, 256> byte_symbol_{};
  std::vector<MergeEntry> merges_;
  size_t merge_mask_ = 0;
  int merge_shift_ = 64;
  bool ignore_merges_ = false;
  std::unordered_map<std::string, int32_t> raw_vocab_;  // raw bytes -> id, only for ignore_merges

  struct CacheShard;
  std::unique_ptr<CacheShard[]> cache_;
};

}  // namespace di::tok
