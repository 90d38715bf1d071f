#include "model/v41/engram_hash.h"

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include "io/safetensors.h"  // di::LoadError

namespace di::v41 {

namespace {

// ---------------------------------------------------------------------------------------------
// UTF-8

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

// Strict decoding with Rust's rules (no overlongs, no surrogates, <= U+10FFFF). Returns false on
// the first invalid sequence, which is where String::from_utf8_lossy would insert U+FFFD.
bool decode_utf8(std::string_view s, std::vector<char32_t>& out) {
  out.clear();
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned b0 = p[i];
    if (b0 < 0x80) {
      out.push_back(b0);
      ++i;
      continue;
    }
    int len;
    char32_t cp;
    unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      len = 2, cp = b0 & 0x1F;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      len = 3, cp = b0 & 0x0F;
      if (b0 == 0xE0) lo = 0xA0;
      if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      len = 4, cp = b0 & 0x07;
      if (b0 == 0xF0) lo = 0x90;
      if (b0 == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (i + size_t(len) > n) return false;
    for (int k = 1; k < len; ++k) {
      const unsigned b = p[i + size_t(k)];
      if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return false;
      cp = (cp << 6) | (b & 0x3F);
    }
    out.push_back(cp);
    i += size_t(len);
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// GPT-2 ByteLevel table: printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100.. in byte order. Inverse: code point -> byte, or -1.

struct ByteLevelTable {
  std::array<int16_t, 0x144> byte_of{};
  ByteLevelTable() {
    byte_of.fill(-1);
    auto printable = [](int b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
    int next = 0x100;
    for (int b = 0; b < 256; ++b) byte_of[size_t(printable(b) ? b : next++)] = int16_t(b);
  }
};
const ByteLevelTable& byte_level_table() {
  static const ByteLevelTable t;
  return t;
}

// ---------------------------------------------------------------------------------------------
// Normalizer pieces

// Rust's char::is_whitespace (Unicode White_Space), used by the Strip normalizer.
bool is_rust_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// The Rust normalizers (HF tokenizers, checked against npm tokenizers@0.23.2) use Unicode tables
// of different ages than utf8proc 2.8 (Unicode 15.0): NFKC/NFD and StripAccents come from the
// unicode-normalization-alignments crate (older than Unicode 12), Lowercase from Rust's std
// (Unicode 17). The tables below are the complete per-code-point differences found by comparing
// every code point with the Rust normalizers (tests/oracle/engram_normalize_sweep.js).
struct CodeRange {
  char32_t first, last;
};
bool in_ranges(const CodeRange* r, size_t n, char32_t c) {
  const CodeRange* end = r + n;
  const CodeRange* it = std::upper_bound(r, end, c, [](char32_t v, const CodeRange& x) { return v < x.first; });
  return it != r && c <= (it - 1)->last;
}

// Compatibility decompositions added after the crate's Unicode version: left as they are.
constexpr CodeRange kRustUndecomposed[] = {
    {0x32FF, 0x32FF},   {0xA7F2, 0xA7F4},   {0xAB69, 0xAB69},   {0x10781, 0x10785}, {0x10787, 0x107B0},
    {0x107B2, 0x107BA}, {0x11938, 0x11938}, {0x1E030, 0x1E06D}, {0x1F16C, 0x1F16C}, {0x1FBF0, 0x1FBF9}};

// Marks (Mn/Mc) added after the crate's Unicode version: StripAccents keeps them.
constexpr CodeRange kRustUnknownMarks[] = {
    {0x7FD, 0x7FD},     {0x898, 0x89F},     {0x8CA, 0x8D3},     {0x9FE, 0x9FE},     {0xAFA, 0xAFF},
    {0xB55, 0xB55},     {0xC04, 0xC04},     {0xC3C, 0xC3C},     {0xCF3, 0xCF3},     {0xD00, 0xD00},
    {0xD3B, 0xD3C},     {0xD81, 0xD81},     {0xEBA, 0xEBA},     {0xECE, 0xECE},     {0x1715, 0x1715},
    {0x180F, 0x180F},   {0x1ABF, 0x1ACE},   {0x1CF7, 0x1CF7},   {0x1DF6, 0x1DFA},   {0xA82C, 0xA82C},
    {0xA8FF, 0xA8FF},   {0x10D24, 0x10D27}, {0x10EAB, 0x10EAC}, {0x10EFD, 0x10EFF}, {0x10F46, 0x10F50},
    {0x10F82, 0x10F85}, {0x11070, 0x11070}, {0x11073, 0x11074}, {0x110C2, 0x110C2}, {0x11145, 0x11146},
    {0x111C9, 0x111C9}, {0x111CE, 0x111CF}, {0x11241, 0x11241}, {0x1133B, 0x1133B}, {0x1145E, 0x1145E},
    {0x1182C, 0x1183A}, {0x11930, 0x11935}, {0x11937, 0x11938}, {0x1193B, 0x1193E}, {0x11940, 0x11940},
    {0x11942, 0x11943}, {0x119D1, 0x119D7}, {0x119DA, 0x119E0}, {0x119E4, 0x119E4}, {0x11A01, 0x11A0A},
    {0x11A33, 0x11A39}, {0x11A3B, 0x11A3E}, {0x11A47, 0x11A47}, {0x11A51, 0x11A5B}, {0x11A8A, 0x11A99},
    {0x11D31, 0x11D36}, {0x11D3A, 0x11D3A}, {0x11D3C, 0x11D3D}, {0x11D3F, 0x11D45}, {0x11D47, 0x11D47},
    {0x11D8A, 0x11D8E}, {0x11D90, 0x11D91}, {0x11D93, 0x11D97}, {0x11EF3, 0x11EF6}, {0x11F00, 0x11F01},
    {0x11F03, 0x11F03}, {0x11F34, 0x11F3A}, {0x11F3E, 0x11F42}, {0x13440, 0x13440}, {0x13447, 0x13455},
    {0x16F4F, 0x16F4F}, {0x16F7F, 0x16F87}, {0x16FE4, 0x16FE4}, {0x16FF0, 0x16FF1}, {0x1CF00, 0x1CF2D},
    {0x1CF30, 0x1CF46}, {0x1E08F, 0x1E08F}, {0x1E130, 0x1E136}, {0x1E2AE, 0x1E2AE}, {0x1E2EC, 0x1E2EF},
    {0x1E4EC, 0x1E4EF}};

// Vedic signs that were Mc in the crate's Unicode version (Lo since 13.0): StripAccents removes them.
constexpr CodeRange kRustExtraMarks[] = {{0x1CF2, 0x1CF3}};

// Lowercase mappings of Unicode 16-17 letters that utf8proc 2.8 does not know: lower = c + delta.
struct LowerRun {
  char32_t first, last;
  int32_t delta;
};
constexpr LowerRun kRustExtraLower[] = {
    {0x1C89, 0x1C89, 1},      {0xA7CB, 0xA7CB, -42343}, {0xA7CC, 0xA7CC, 1},     {0xA7CE, 0xA7CE, 1},
    {0xA7D2, 0xA7D2, 1},      {0xA7D4, 0xA7D4, 1},      {0xA7DA, 0xA7DA, 1},     {0xA7DC, 0xA7DC, -42561},
    {0x10D50, 0x10D65, 32},   {0x16EA0, 0x16EB8, 27}};

template <size_t N>
bool in_ranges(const CodeRange (&r)[N], char32_t c) {
  return in_ranges(r, N, c);
}

// StripAccents: Unicode general category M (Mn, Mc, Me) as the crate knows it.
bool is_rust_mark(char32_t c) {
  const auto cat = utf8proc_category(utf8proc_int32_t(c));
  const bool mark = cat == UTF8PROC_CATEGORY_MN || cat == UTF8PROC_CATEGORY_MC || cat == UTF8PROC_CATEGORY_ME;
  return mark ? !in_ranges(kRustUnknownMarks, c) : in_ranges(kRustExtraMarks, c);
}

// Rust char::to_lowercase. It is context free (no final-sigma rule); besides the newer letters
// above it differs from utf8proc's simple mapping only for U+0130, which gives "i" + U+0307.
void append_lowercase(std::vector<char32_t>& out, char32_t c) {
  if (c == 0x130) {
    out.push_back(0x69);
    out.push_back(0x307);
    return;
  }
  for (const auto& run : kRustExtraLower)
    if (c >= run.first && c <= run.last) {
      out.push_back(char32_t(int32_t(c) + run.delta));
      return;
    }
  out.push_back(char32_t(utf8proc_tolower(utf8proc_int32_t(c))));
}

// NFKC then NFD, as the crate computes them, is the full compatibility decomposition of each code
// point. Canonical reordering is skipped: it only moves code points with a non-zero combining
// class, which are all marks that StripAccents removes next (marks the crate does not know have
// class 0 there and never move).
void append_nfkd(std::vector<char32_t>& out, char32_t c) {
  if (in_ranges(kRustUndecomposed, c)) {
    out.push_back(c);
    return;
  }
  utf8proc_int32_t buf[32];
  int boundclass = 0;
  const auto n = utf8proc_decompose_char(utf8proc_int32_t(c), buf, 32,
                                         utf8proc_option_t(UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT), &boundclass);
  if (n < 0 || n > 32) throw std::invalid_argument("engram_normalize: cannot decompose U+" + std::to_string(uint32_t(c)));
  for (utf8proc_ssize_t i = 0; i < n; ++i) out.push_back(char32_t(buf[i]));
}

constexpr char32_t kSentinel = 0xE000;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Token map

std::string engram_bytelevel_decode(std::string_view token) {
  std::vector<char32_t> cps;
  if (!decode_utf8(token, cps)) return std::string(token);
  const auto& table = byte_level_table();
  std::string bytes;
  bytes.reserve(cps.size());
  for (char32_t c : cps) {
    if (c >= table.byte_of.size() || table.byte_of[c] < 0) return std::string(token);  // not a byte-level token
    bytes.push_back(char(table.byte_of[c]));
  }
  return bytes;
}

std::string engram_normalize(std::string_view utf8_text) {
  std::vector<char32_t> cps;
  if (!decode_utf8(utf8_text, cps)) throw std::invalid_argument("engram_normalize: input is not valid UTF-8");

  std::vector<char32_t> decomposed;
  decomposed.reserve(cps.size() * 2);
  for (char32_t c : cps) append_nfkd(decomposed, c);

  // StripAccents, then Lowercase.
  std::vector<char32_t> lowered;
  lowered.reserve(decomposed.size());
  for (char32_t c : decomposed)
    if (!is_rust_mark(c)) append_lowercase(lowered, c);

  // Replace [ \t\r\n]+ by one space.
  std::vector<char32_t> collapsed;
  collapsed.reserve(lowered.size());
  bool in_run = false;
  for (char32_t c : lowered) {
    const bool ws = c == ' ' || c == '\t' || c == '\r' || c == '\n';
    if (!ws || !in_run) collapsed.push_back(ws ? U' ' : c);
    in_run = ws;
  }

  // "^ $" -> sentinel: the whole text is exactly one space (no '\n' is left for ^/$ to match).
  if (collapsed.size() == 1 && collapsed[0] == ' ') collapsed[0] = kSentinel;

  // Strip (White_Space both ends), then every sentinel char back to a space.
  size_t b = 0, e = collapsed.size();
  while (b < e && is_rust_whitespace(collapsed[b])) ++b;
  while (e > b && is_rust_whitespace(collapsed[e - 1])) --e;
  std::string out;
  out.reserve(e - b);
  for (size_t i = b; i < e; ++i) append_utf8(out, collapsed[i] == kSentinel ? U' ' : collapsed[i]);
  return out;
}

EngramTokenMap build_engram_token_map(const nlohmann::json& tj, const std::string& origin) {
  auto fail = [&](const std::string& what) { throw LoadError(origin + ": " + what); };
  if (!tj.is_object()) fail("not a JSON object");

  // The decode semantics below are those of the ByteLevel decoder.
  if (!tj.contains("decoder") || !tj["decoder"].is_object() || tj["decoder"].value("type", "") != "ByteLevel")
    fail("decoder: expected {\"type\": \"ByteLevel\"}, the only decoder the Engram token map supports");
  if (!tj.contains("model") || !tj["model"].is_object() || !tj["model"].contains("vocab") ||
      !tj["model"]["vocab"].is_object())
    fail("model.vocab: missing or not an object");

  constexpr int64_t kMaxId = (int64_t(1) << 31) - 2;
  std::vector<std::string> tokens;
  std::vector<uint8_t> present;
  auto put = [&](int64_t id, const std::string& content, bool added, const std::string& where) {
    if (id < 0 || id > kMaxId) fail(where + ": id " + std::to_string(id) + " out of range");
    if (size_t(id) >= tokens.size()) {
      tokens.resize(size_t(id) + 1);
      present.resize(size_t(id) + 1, 0);
    }
    if (present[size_t(id)] && !added && tokens[size_t(id)] != content)
      fail(where + ": id " + std::to_string(id) + " is given to two tokens");
    // Added tokens win over the model vocab (id_to_token checks the added vocabulary first).
    tokens[size_t(id)] = content;
    present[size_t(id)] = 1;
  };
  for (const auto& [content, id] : tj["model"]["vocab"].items()) {
    if (!id.is_number_integer()) fail("model.vocab[\"" + content + "\"]: id is not an integer");
    put(id.get<int64_t>(), content, false, "model.vocab[\"" + content + "\"]");
  }
  if (tj.contains("added_tokens")) {
    const auto& added = tj["added_tokens"];
    if (!added.is_array()) fail("added_tokens: not an array");
    std::set<int64_t> seen;
    for (size_t i = 0; i < added.size(); ++i) {
      const auto& t = added[i];
      const std::string where = "added_tokens[" + std::to_string(i) + "]";
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
          !t["content"].is_string())
        fail(where + ": expected an object with integer \"id\" and string \"content\"");
      const int64_t id = t["id"].get<int64_t>();
      if (!seen.insert(id).second) fail(where + ": id " + std::to_string(id) + " appears twice");
      put(id, t["content"].get<std::string>(), true, where);
    }
  }
  if (tokens.empty()) fail("no tokens");

  EngramTokenMap map;
  map.compressed.resize(tokens.size());
  std::unordered_map<std::string, int32_t> key_to_new;
  key_to_new.reserve(tokens.size());
  std::vector<char32_t> scratch;
  for (size_t id = 0; id < tokens.size(); ++id) {
    // An id without a token decodes to "" (as the Rust tokenizer does), whose key is "".
    const std::string text = present[id] ? engram_bytelevel_decode(tokens[id]) : std::string();
    std::string key;
    // Invalid UTF-8 is where from_utf8_lossy inserts U+FFFD; a literal U+FFFD counts the same.
    if (!decode_utf8(text, scratch) || std::find(scratch.begin(), scratch.end(), U'\uFFFD') != scratch.end()) {
      key = tokens[id];
    } else {
      key = engram_normalize(text);
      if (key.empty()) key = text;
    }
    const auto [it, inserted] = key_to_new.emplace(std::move(key), int32_t(key_to_new.size()));
    map.compressed[id] = it->second;
  }
  map.size = int32_t(key_to_new.size());
  return map;
}

EngramTokenMap build_engram_token_map_from_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw LoadError(path + ": cannot open tokenizer file");
  std::stringstream ss;
  ss << f.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    throw LoadError(path + ": invalid JSON: " + e.what());
  }
  return build_engram_token_map(j, path);
}

// ---------------------------------------------------------------------------------------------
// NumPy SeedSequence / PCG64 / integers

namespace {
constexpr uint32_t kInitA = 0x43b0d7e5, kMultA = 0x931e8875, kInitB = 0x8b51f9dd, kMultB = 0x58f38ded;
constexpr uint32_t kMixMultL = 0xca01f9dd, kMixMultR = 0x4973f715;
constexpr int kPoolSize = 4;

uint32_t hashmix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> 16;
  return value;
}
uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t r = kMixMultL * x - kMixMultR * y;
  r ^= r >> 16;
  return r;
}
}  // namespace

std::vector<uint32_t> numpy_entropy_words(uint64_t seed) {
  std::vector<uint32_t> w;
  if (seed == 0) w.push_back(0);
  for (; seed != 0; seed >>= 32) w.push_back(uint32_t(seed));
  return w;
}

std::vector<uint32_t> numpy_seed_sequence_state(std::span<const uint32_t> entropy, size_t n_words) {
  std::array<uint32_t, kPoolSize> pool{};
  uint32_t hc = kInitA;
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = hashmix(i < entropy.size() ? entropy[i] : 0u, hc);
  for (size_t src = 0; src < pool.size(); ++src)
    for (size_t dst = 0; dst < pool.size(); ++dst)
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src], hc));
  for (size_t src = pool.size(); src < entropy.size(); ++src)
    for (size_t dst = 0; dst < pool.size(); ++dst) pool[dst] = mix(pool[dst], hashmix(entropy[src], hc));

  std::vector<uint32_t> state(n_words);
  uint32_t hb = kInitB;
  for (size_t i = 0; i < n_words; ++i) {
    uint32_t v = pool[i % pool.size()];
    v ^= hb;
    hb *= kMultB;
    v *= hb;
    v ^= v >> 16;
    state[i] = v;
  }
  return state;
}

namespace {
constexpr unsigned __int128 kPcgMult =
    (static_cast<unsigned __int128>(2549297995355413924ULL) << 64) | 4865540595714422341ULL;
}

void NumpyPCG64::step() { state_ = state_ * kPcgMult + inc_; }

NumpyPCG64::NumpyPCG64(uint64_t seed) {
  const auto entropy = numpy_entropy_words(seed);
  const auto w = numpy_seed_sequence_state(entropy, 8);
  // generate_state(4, uint64): little-endian word pairs; (state, inc) = (v0:v1, v2:v3), high first.
  uint64_t v[4];
  for (int i = 0; i < 4; ++i) v[i] = uint64_t(w[size_t(2 * i)]) | (uint64_t(w[size_t(2 * i + 1)]) << 32);
  const unsigned __int128 init_state = (static_cast<unsigned __int128>(v[0]) << 64) | v[1];
  const unsigned __int128 init_seq = (static_cast<unsigned __int128>(v[2]) << 64) | v[3];
  state_ = 0;
  inc_ = (init_seq << 1) | 1;
  step();
  state_ += init_state;
  step();
}

uint64_t NumpyPCG64::next_u64() {
  step();
  // XSL-RR output.
  const uint64_t x = uint64_t(state_ >> 64) ^ uint64_t(state_);
  const unsigned rot = unsigned(state_ >> 122);
  return (x >> rot) | (x << ((64 - rot) & 63));
}

std::vector<int64_t> numpy_integers_int64(NumpyPCG64& rng, int64_t low, int64_t high, size_t n) {
  if (high <= low) throw std::invalid_argument("numpy_integers_int64: high must exceed low");
  const uint64_t range = uint64_t(high) - uint64_t(low) - 1;  // inclusive width, as numpy's `rng`
  // NumPy switches to a buffered 32-bit Lemire draw at or below 2^32-1; Engram never gets there.
  if (range <= 0xFFFFFFFFULL)
    throw std::invalid_argument("numpy_integers_int64: ranges narrower than 2^32 are not supported");
  const uint64_t range_excl = range + 1;
  std::vector<int64_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    // Lemire's multiply-shift with rejection (numpy bounded_lemire_uint64, use_masked=False).
    unsigned __int128 m = static_cast<unsigned __int128>(rng.next_u64()) * range_excl;
    uint64_t leftover = uint64_t(m);
    if (leftover < range_excl) {
      const uint64_t threshold = (UINT64_MAX - range) % range_excl;
      while (leftover < threshold) {
        m = static_cast<unsigned __int128>(rng.next_u64()) * range_excl;
        leftover = uint64_t(m);
      }
    }
    out[i] = int64_t(uint64_t(low) + uint64_t(m >> 64));
  }
  return out;
}

bool is_prime_u64(uint64_t n) {
  if (n < 2) return false;
  for (uint64_t p : {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37}) {
    if (n % p == 0) return n == p;
  }
  auto mulmod = [](uint64_t a, uint64_t b, uint64_t m) {
    return uint64_t(static_cast<unsigned __int128>(a) * b % m);
  };
  auto powmod = [&](uint64_t a, uint64_t e, uint64_t m) {
    uint64_t r = 1;
    for (; e; e >>= 1, a = mulmod(a, a, m))
      if (e & 1) r = mulmod(r, a, m);
    return r;
  };
  uint64_t d = n - 1;
  int s = 0;
  while ((d & 1) == 0) d >>= 1, ++s;
  // These 12 bases make Miller-Rabin deterministic below 3.3e24.
  for (uint64_t a : {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37}) {
    uint64_t x = powmod(a, d, n);
    if (x == 1 || x == n - 1) continue;
    bool composite = true;
    for (int r = 1; r < s && composite; ++r) {
      x = mulmod(x, x, n);
      if (x == n - 1) composite = false;
    }
    if (composite) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Constants

EngramConstants make_engram_constants(const V41Config& cfg, int32_t compressed_vocab_size,
                                      int64_t pad_compressed_id) {
  auto fail = [](const std::string& what) { throw LoadError("engram config: " + what); };
  if (cfg.engram_layer_ids.empty()) fail("engram_layer_ids is empty");
  if (cfg.engram_max_ngram_size < 2 || cfg.engram_max_ngram_size > EngramHistory::kCapacity + 1)
    fail("engram_max_ngram_size " + std::to_string(cfg.engram_max_ngram_size) + " outside [2, " +
         std::to_string(EngramHistory::kCapacity + 1) + "]");
  if (cfg.engram_n_heads < 1) fail("engram_n_heads must be positive");
  if (cfg.engram_vocab_size < 1) fail("engram_vocab_size must be positive");
  if (compressed_vocab_size < 1) fail("compressed vocab size must be positive");
  if (pad_compressed_id < 0 || pad_compressed_id >= compressed_vocab_size)
    fail("pad compressed id " + std::to_string(pad_compressed_id) + " outside the compressed vocab");
  if (!cfg.engram_num_embeddings.empty() && cfg.engram_num_embeddings.size() != cfg.engram_layer_ids.size())
    fail("engram_num_embeddings has " + std::to_string(cfg.engram_num_embeddings.size()) + " entries for " +
         std::to_string(cfg.engram_layer_ids.size()) + " engram layers");

  EngramConstants c;
  c.max_ngram = cfg.engram_max_ngram_size;
  c.n_heads = cfg.engram_n_heads;
  c.layer_ids = cfg.engram_layer_ids;
  c.pad = pad_compressed_id;

  // Primes: per layer and n-gram size the search restarts at vocab-1; a prime is never reused.
  std::set<uint64_t> seen;
  for (size_t l = 0; l < c.layer_ids.size(); ++l) {
    std::vector<int64_t> primes, offsets;
    int64_t sum = 0;
    for (int n = 2; n <= c.max_ngram; ++n) {
      uint64_t current = uint64_t(cfg.engram_vocab_size - 1);
      for (int h = 0; h < c.n_heads; ++h) {
        uint64_t cand = current + 1;
        while (!is_prime_u64(cand) || seen.count(cand)) ++cand;
        seen.insert(cand);
        current = cand;
        offsets.push_back(sum);
        primes.push_back(int64_t(cand));
        sum += int64_t(cand);
      }
    }
    // Hash ids are int32 table rows.
    if (sum > INT32_MAX) fail("engram layer " + std::to_string(c.layer_ids[l]) + " has " + std::to_string(sum) + " rows, beyond int32 ids");
    if (!cfg.engram_num_embeddings.empty() && cfg.engram_num_embeddings[l] != sum)
      fail("engram_num_embeddings[" + std::to_string(l) + "] = " + std::to_string(cfg.engram_num_embeddings[l]) +
           " but the primes of layer " + std::to_string(c.layer_ids[l]) + " sum to " + std::to_string(sum));
    c.primes.push_back(std::move(primes));
    c.offsets.push_back(std::move(offsets));
    c.num_embeddings.push_back(sum);
  }

  // Multipliers: odd, bounded so that compressed id * multiplier cannot overflow int64.
  const int64_t bound = std::max<int64_t>(1, (INT64_MAX / compressed_vocab_size) / 2);
  for (int layer_id : c.layer_ids) {
    if (layer_id < 0) fail("negative engram layer id");
    NumpyPCG64 rng(uint64_t(10007) * uint64_t(layer_id));
    auto v = numpy_integers_int64(rng, 0, bound, size_t(c.max_ngram));
    for (auto& x : v) x = 2 * x + 1;
    c.multipliers.push_back(std::move(v));
  }
  return c;
}

EngramConstants make_engram_constants(const V41Config& cfg, const EngramTokenMap& map) {
  if (cfg.engram_compressed_vocab_size != map.size)
    throw LoadError("engram config: engram_compressed_vocab_size is " + std::to_string(cfg.engram_compressed_vocab_size) +
                    " but the tokenizer's compressed token map has " + std::to_string(map.size) +
                    " entries (every hash multiplier depends on it)");
  if (cfg.engram_pad_id < 0 || cfg.engram_pad_id >= int64_t(map.compressed.size()))
    throw LoadError("engram config: engram_pad_id " + std::to_string(cfg.engram_pad_id) + " is not a token id");
  return make_engram_constants(cfg, map.size, map.compressed[size_t(cfg.engram_pad_id)]);
}

// ---------------------------------------------------------------------------------------------
// History and hashing

void EngramHistory::append(std::span<const int32_t> compressed) {
  const size_t s = compressed.size();
  if (s >= size_t(kCapacity)) {
    for (int k = 0; k < kCapacity; ++k) recent_[size_t(k)] = compressed[s - 1 - size_t(k)];
  } else {
    // Shift the kept ids back by s, then put the chunk in front (newest at index 0).
    for (int k = kCapacity - 1; k >= int(s); --k) recent_[size_t(k)] = recent_[size_t(k) - s];
    for (size_t k = 0; k < s; ++k) recent_[k] = compressed[s - 1 - k];
  }
  n_tokens_ += int64_t(s);
}

void EngramHistory::assign(int64_t n_tokens, std::span<const int32_t> tail) {
  if (n_tokens < 0) throw std::invalid_argument("EngramHistory::assign: negative n_tokens");
  const size_t need = size_t(std::min<int64_t>(n_tokens, kCapacity));
  if (tail.size() != need)
    throw std::invalid_argument("EngramHistory::assign: tail holds " + std::to_string(tail.size()) +
                                " ids, expected " + std::to_string(need));
  for (size_t k = 0; k < need; ++k) recent_[k] = tail[need - 1 - k];
  n_tokens_ = n_tokens;
}

void engram_compress_tokens(const EngramTokenMap& map, std::span<const int32_t> token_ids,
                            std::span<const uint8_t> dead, int32_t* out) {
  if (!dead.empty() && dead.size() != token_ids.size())
    throw std::invalid_argument("engram_compress_tokens: dead mask has " + std::to_string(dead.size()) +
                                " flags for " + std::to_string(token_ids.size()) + " tokens");
  for (size_t i = 0; i < token_ids.size(); ++i) {
    if (!dead.empty() && dead[i]) {
      out[i] = kEngramDead;
      continue;
    }
    const int32_t id = token_ids[i];
    if (id < 0 || size_t(id) >= map.compressed.size())
      throw std::out_of_range("engram_compress_tokens: token id " + std::to_string(id) + " at index " +
                              std::to_string(i) + " is outside the Engram token map (" +
                              std::to_string(map.compressed.size()) + " ids)");
    out[i] = map.compressed[size_t(id)];
  }
}

namespace {
void check_constants(const EngramConstants& c) {
  if (c.max_ngram < 2 || c.max_ngram - 1 > EngramHistory::kCapacity || c.n_heads < 1 ||
      c.multipliers.size() != c.layer_ids.size() || c.primes.size() != c.layer_ids.size() ||
      c.offsets.size() != c.layer_ids.size())
    throw std::invalid_argument("engram_hash_ids: EngramConstants not built by make_engram_constants");
}

// The look-back ids of chunk position i (pad once the sequence start or a dead token is met),
// multiplied and XOR-rolled; writes the hash ids of one layer.
inline void hash_position(const EngramConstants& c, int layer, const int64_t* tok, int32_t* out) {
  const int64_t* mult = c.multipliers[size_t(layer)].data();
  const int64_t* primes = c.primes[size_t(layer)].data();
  const int64_t* offsets = c.offsets[size_t(layer)].data();
  // int64 products wrap like torch's; they cannot overflow given the multiplier bound.
  uint64_t rolling = uint64_t(tok[0]) * uint64_t(mult[0]);
  int col = 0;
  for (int s = 1; s < c.max_ngram; ++s) {
    rolling ^= uint64_t(tok[s]) * uint64_t(mult[s]);
    const int64_t r = int64_t(rolling);
    for (int h = 0; h < c.n_heads; ++h, ++col) {
      int64_t m = r % primes[col];
      if (m < 0) m += primes[col];  // floored modulo, as torch/numpy `%`
      out[col] = int32_t(m + offsets[col]);
    }
  }
}

// Fills tok[0..max_ngram) for chunk index i.
inline void gather_lookback(const EngramConstants& c, const EngramHistory& history, std::span<const int32_t> chunk,
                            size_t i, int64_t* tok) {
  bool blocked = false;
  for (int s = 0; s < c.max_ngram; ++s) {
    int64_t id;
    if (!blocked) {
      if (size_t(s) <= i) {
        id = chunk[i - size_t(s)];
      } else {
        const int k = s - int(i) - 1;  // how far back into the history
        // k < max_ngram-1 <= kCapacity, so a position that exists is always kept.
        id = k < history.available() ? history.back(k) : kEngramDead;
      }
      if (id == kEngramDead) blocked = true;  // also covers t-s < 0 (nothing in history)
    }
    tok[s] = blocked ? c.pad : id;
  }
}
}  // namespace

void engram_hash_ids(const EngramConstants& c, int layer_index, const EngramHistory& history,
                     std::span<const int32_t> compressed_chunk, int32_t* out) {
  check_constants(c);
  if (layer_index < 0 || layer_index >= c.n_layers())
    throw std::out_of_range("engram_hash_ids: layer index " + std::to_string(layer_index) + " out of range");
  std::array<int64_t, EngramHistory::kCapacity + 1> tok{};
  const int cols = c.hash_cols();
  for (size_t i = 0; i < compressed_chunk.size(); ++i) {
    gather_lookback(c, history, compressed_chunk, i, tok.data());
    hash_position(c, layer_index, tok.data(), out + i * size_t(cols));
  }
}

void engram_hash_ids_all_layers(const EngramConstants& c, const EngramHistory& history,
                                std::span<const int32_t> compressed_chunk, int32_t* out) {
  check_constants(c);
  std::array<int64_t, EngramHistory::kCapacity + 1> tok{};
  const int cols = c.hash_cols();
  const size_t row = size_t(c.n_layers()) * size_t(cols);
  for (size_t i = 0; i < compressed_chunk.size(); ++i) {
    gather_lookback(c, history, compressed_chunk, i, tok.data());
    for (int l = 0; l < c.n_layers(); ++l) hash_position(c, l, tok.data(), out + i * row + size_t(l) * size_t(cols));
  }
}

}  // namespace di::v41
