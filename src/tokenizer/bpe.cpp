#include "tokenizer/bpe.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <stdexcept>

#include "tokenizer/text_utf8.h"

namespace di::tok {
namespace {

constexpr size_t kShortWord = 64;        // below this, a linear scan beats a heap
constexpr size_t kCacheShards = 64;      // shards keep lock contention low between threads
constexpr size_t kCacheShardCapacity = 4096;  // bound: 64 * 4096 words
constexpr size_t kMaxCachedWordBytes = 96;

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

std::string utf8_of(char32_t cp) {
  std::string s;
  utf8::append_code_point(s, cp);
  return s;
}

// Byte-level string (e.g. "Ġthe") -> raw bytes (" the"); nullopt-like false when a char is not mapped.
bool byte_level_to_raw(const std::string& token, std::string& raw) {
  raw.clear();
  size_t pos = 0;
  while (pos < token.size()) {
    size_t len = 0;
    if (utf8::first_invalid_byte(std::string_view(token).substr(pos, 4)) == pos) return false;
    const char32_t cp = utf8::decode_at(token, pos, len);
    const int b = char_to_byte(cp);
    if (b < 0) return false;
    raw.push_back(static_cast<char>(b));
    pos += len;
  }
  return true;
}

}  // namespace

const std::array<char32_t, 256>& byte_to_char() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? static_cast<char32_t>(b) : next++;
    }
    return t;
  }();
  return table;
}

int char_to_byte(char32_t cp) {
  static const std::vector<int16_t> inverse = [] {
    std::vector<int16_t> inv(324, -1);
    const auto& fwd = byte_to_char();
    for (int b = 0; b < 256; ++b) inv[fwd[b]] = static_cast<int16_t>(b);
    return inv;
  }();
  return cp < inverse.size() ? inverse[cp] : -1;
}

struct BpeModel::CacheShard {
  std::mutex mu;
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> words;
};

BpeModel::BpeModel(const nlohmann::json& model) : cache_(new CacheShard[kCacheShards]) {
  if (!model.is_object()) throw std::runtime_error("model: expected an object");
  const std::string type = model.value("type", std::string("BPE"));
  if (type != "BPE") throw std::runtime_error("model: unsupported type \"" + type + "\" (only BPE)");
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0) {
    throw std::runtime_error("model: BPE dropout is not supported (it makes encoding random)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null() && !model[key].get<std::string>().empty()) {
      throw std::runtime_error(std::string("model: BPE \"") + key + "\" is not supported for byte-level BPE");
    }
  }
  ignore_merges_ = model.contains("ignore_merges") && model["ignore_merges"].is_boolean() &&
                   model["ignore_merges"].get<bool>();

  if (!model.contains("vocab") || !model["vocab"].is_object()) throw std::runtime_error("model: missing object \"vocab\"");
  vocab_.reserve(model["vocab"].size());
  for (const auto& [token, id] : model["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
      throw std::runtime_error("model.vocab[\"" + token + "\"]: id must be a non-negative integer");
    }
    vocab_.emplace(token, id.get<int32_t>());
  }
  const auto& chars = byte_to_char();
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(utf8_of(chars[b]));
    if (it == vocab_.end()) {
      throw std::runtime_error("model.vocab: missing the byte-level token for byte " + std::to_string(b) +
                               " (not a byte-level BPE vocabulary)");
    }
    byte_symbol_[b] = it->second;
  }
  if (ignore_merges_) {
    std::string raw;
    for (const auto& [token, id] : vocab_) {
      if (byte_level_to_raw(token, raw)) raw_vocab_.emplace(raw, id);
    }
  }

  if (!model.contains("merges") || !model["merges"].is_array()) throw std::runtime_error("model: missing array \"merges\"");
  const auto& merges = model["merges"];
  size_t capacity = 16;
  while (capacity < merges.size() * 2) capacity <<= 1;
  merges_.assign(capacity, MergeEntry{kEmptyKey, 0, 0});
  merge_mask_ = capacity - 1;
  merge_shift_ = 64 - __builtin_ctzll(capacity);
  std::string left, right;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& m = merges[rank];
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        throw std::runtime_error("model.merges[" + std::to_string(rank) + "]: expected \"A B\", got \"" + s + "\"");
      }
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      throw std::runtime_error("model.merges[" + std::to_string(rank) + "]: expected \"A B\" or [\"A\", \"B\"]");
    }
    auto l = vocab_.find(left), r = vocab_.find(right), merged = vocab_.find(left + right);
    if (l == vocab_.end() || r == vocab_.end() || merged == vocab_.end()) {
      throw std::runtime_error("model.merges[" + std::to_string(rank) + "]: \"" + left + "\" + \"" + right +
                               "\": a token of the merge is not in the vocab");
    }
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(l->second)) << 32) |
                         static_cast<uint32_t>(r->second);
    size_t slot = static_cast<size_t>((key * 0x9E3779B97F4A7C15ULL) >> merge_shift_);
    while (merges_[slot].key != kEmptyKey && merges_[slot].key != key) slot = (slot + 1) & merge_mask_;
    // A repeated merge takes its last rank: HF collects merges into a map, later entries overwriting.
    merges_[slot] = MergeEntry{key, static_cast<uint32_t>(rank), merged->second};
  }
}

BpeModel::~BpeModel() = default;

size_t BpeModel::cache_entries() const {
  size_t total = 0;
  for (size_t i = 0; i < kCacheShards; ++i) {
    std::lock_guard<std::mutex> lock(cache_[i].mu);
    total += cache_[i].words.size();
  }
  return total;
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  const auto* bytes = reinterpret_cast<const uint8_t*>(word.data());
  const size_t n = word.size();
  if (n == 0) return;
  if (n == 1) {
    out.push_back(byte_symbol_[bytes[0]]);
    return;
  }
  if (ignore_merges_) {
    auto it = raw_vocab_.find(std::string(word));
    if (it != raw_vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (n > kMaxCachedWordBytes) {
    merge_long(bytes, n, out);
    return;
  }
  const size_t hash = StringHash{}(word);
  CacheShard& shard = cache_[hash % kCacheShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    auto it = shard.words.find(word);
    if (it != shard.words.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  if (n <= kShortWord) merge_short(bytes, n, out);
  else merge_long(bytes, n, out);
  std::lock_guard<std::mutex> lock(shard.mu);
  // Bounded: a full shard starts over rather than growing without limit on adversarial text.
  if (shard.words.size() >= kCacheShardCapacity) shard.words.clear();
  shard.words.emplace(std::string(word), std::vector<int32_t>(out.begin() + first, out.end()));
}

// Repeatedly merges the lowest-rank adjacent pair (leftmost on ties), keeping the pair ranks in an array.
void BpeModel::merge_short(const uint8_t* bytes, size_t n, std::vector<int32_t>& out) const {
  int32_t symbols[kShortWord];
  uint32_t ranks[kShortWord];
  int32_t merged[kShortWord];
  for (size_t i = 0; i < n; ++i) symbols[i] = byte_symbol_[bytes[i]];
  auto refresh = [&](size_t i) {
    const MergeEntry* e = find_merge(symbols[i], symbols[i + 1]);
    ranks[i] = e ? e->rank : kNoRank;
    merged[i] = e ? e->merged : -1;
  };
  size_t count = n;
  for (size_t i = 0; i + 1 < count; ++i) refresh(i);
  while (count > 1) {
    size_t best = 0;
    uint32_t best_rank = kNoRank;
    for (size_t i = 0; i + 1 < count; ++i) {
      if (ranks[i] < best_rank) {
        best_rank = ranks[i];
        best = i;
      }
    }
    if (best_rank == kNoRank) break;
    symbols[best] = merged[best];
    // Remove symbol best+1 and pair best+1; pairs after it shift down by one.
    const size_t symbol_tail = count - best - 2;
    const size_t pair_tail = count >= best + 3 ? count - best - 3 : 0;
    std::memmove(&symbols[best + 1], &symbols[best + 2], symbol_tail * sizeof(int32_t));
    std::memmove(&ranks[best + 1], &ranks[best + 2], pair_tail * sizeof(uint32_t));
    std::memmove(&merged[best + 1], &merged[best + 2], pair_tail * sizeof(int32_t));
    --count;
    if (best + 1 < count) refresh(best);
    if (best > 0) refresh(best - 1);
  }
  out.insert(out.end(), symbols, symbols + count);
}

// Linked list of symbols plus a min-heap of candidate merges (stale entries skipped), O(n log n).
void BpeModel::merge_long(const uint8_t* bytes, size_t n, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev, next;
  };
  struct Candidate {
    uint32_t rank;
    uint32_t pos;
    int32_t merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<Symbol> symbols(n);
  for (size_t i = 0; i < n; ++i) {
    symbols[i] = {byte_symbol_[bytes[i]], static_cast<int32_t>(i) - 1, i + 1 < n ? static_cast<int32_t>(i + 1) : -1};
  }
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto push = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    if (const MergeEntry* e = find_merge(symbols[pos].id, symbols[next].id)) {
      heap.push({e->rank, static_cast<uint32_t>(pos), e->merged});
    }
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    Symbol& left = symbols[top.pos];
    if (left.id < 0 || left.next < 0) continue;  // removed, or no right neighbour any more
    Symbol& right = symbols[left.next];
    const MergeEntry* e = find_merge(left.id, right.id);
    if (!e || e->merged != top.merged || e->rank != top.rank) continue;  // stale
    left.id = top.merged;
    const int32_t after = right.next;
    right.id = -1;
    left.next = after;
    if (after >= 0) symbols[after].prev = static_cast<int32_t>(top.pos);
    if (left.prev >= 0) push(left.prev);
    push(static_cast<int32_t>(top.pos));
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
}

}  // namespace di::tok
