// Engram (V4.1 n-gram hashed memory), integer side: the compressed token map built from the
// tokenizer, the hash constants (primes, offsets, NumPy-PCG64 multipliers) and the per-position
// hash ids (table rows). Semantics follow the official inference/engram.py; see docs/engram.md.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "model/v41/config.h"

namespace di::v41 {

// Compressed id of a token that takes no part in any n-gram (image spans).
inline constexpr int32_t kEngramDead = -1;

// ---------------------------------------------------------------------------------------------
// Compressed token map

struct EngramTokenMap {
  std::vector<int32_t> compressed;  // token id -> compressed id
  int32_t size = 0;                 // number of distinct compressed ids
};

// Builds the map from a parsed HF tokenizer.json (model.vocab + added_tokens, ByteLevel decoder).
// `origin` names the source in error messages. Throws di::LoadError on malformed input.
EngramTokenMap build_engram_token_map(const nlohmann::json& tokenizer_json,
                                      const std::string& origin = "tokenizer.json");
EngramTokenMap build_engram_token_map_from_file(const std::string& tokenizer_json_path);

// The pieces of the map, exposed for tests.
// ByteLevel decoding of one token string: GPT-2 byte table when every char is in it, else the
// token's own UTF-8 bytes. The result may be invalid UTF-8.
std::string engram_bytelevel_decode(std::string_view token);
// The official normalizer chain on valid UTF-8 text (NFKC, NFD, StripAccents, Lowercase,
// whitespace collapse, single-space sentinel, Strip). Throws std::invalid_argument on invalid UTF-8.
std::string engram_normalize(std::string_view utf8_text);

// ---------------------------------------------------------------------------------------------
// NumPy random stream (SeedSequence -> PCG64 -> Generator.integers), reproduced bit-exactly.

// SeedSequence(entropy words, pool_size 4, no spawn key).generate_state(n_words, uint32).
std::vector<uint32_t> numpy_seed_sequence_state(std::span<const uint32_t> entropy, size_t n_words);
// Python int -> SeedSequence entropy words (little-endian 32-bit words; 0 -> [0]).
std::vector<uint32_t> numpy_entropy_words(uint64_t seed);

class NumpyPCG64 {
 public:
  // numpy.random.PCG64(seed): state and increment from SeedSequence(seed).generate_state(4, uint64).
  explicit NumpyPCG64(uint64_t seed);
  uint64_t next_u64();

 private:
  unsigned __int128 state_ = 0, inc_ = 0;
  void step();
};

// Generator.integers(low, high, size=n, dtype=np.int64) with endpoint=False (Lemire rejection).
// Supports ranges wider than 2^32 (the only kind Engram uses); throws otherwise.
std::vector<int64_t> numpy_integers_int64(NumpyPCG64& rng, int64_t low, int64_t high, size_t n);

// Deterministic primality for 64-bit values (sympy.isprime on this range).
bool is_prime_u64(uint64_t n);

// ---------------------------------------------------------------------------------------------
// Hash constants

struct EngramConstants {
  int max_ngram = 0;                // n-gram sizes 2..max_ngram
  int n_heads = 0;
  std::vector<int> layer_ids;       // model layers carrying an Engram, in config order
  int64_t pad = 0;                  // compressed id used for out-of-range / blocked look-backs
  // [engram layer][max_ngram]: odd multipliers for look-back 0..max_ngram-1.
  std::vector<std::vector<int64_t>> multipliers;
  // [engram layer][(max_ngram-1) * n_heads], n-gram size major then head (the hash-id column order).
  std::vector<std::vector<int64_t>> primes, offsets;
  std::vector<int64_t> num_embeddings;  // table rows per engram layer (= sum of its primes)

  int n_layers() const { return int(layer_ids.size()); }
  int hash_cols() const { return (max_ngram - 1) * n_heads; }
};

// Primes/offsets from cfg (engram_layer_ids, engram_max_ngram_size, engram_n_heads,
// engram_vocab_size); multipliers from compressed_vocab_size. Throws di::LoadError when
// cfg.engram_num_embeddings is non-empty and disagrees with the prime sums, or on bad sizes.
EngramConstants make_engram_constants(const V41Config& cfg, int32_t compressed_vocab_size,
                                      int64_t pad_compressed_id);
// Same, from the map: asserts cfg.engram_compressed_vocab_size == map.size (every multiplier
// depends on it) and takes pad = map[cfg.engram_pad_id].
EngramConstants make_engram_constants(const V41Config& cfg, const EngramTokenMap& map);

// ---------------------------------------------------------------------------------------------
// Hash ids

// Per-sequence token history: the last compressed ids before the next chunk. Survives across
// prefill and decode calls; after a rollback, restore it with assign().
class EngramHistory {
 public:
  static constexpr int kCapacity = 7;  // look-backs kept: enough for max_ngram <= 8

  int64_t n_tokens() const { return n_tokens_; }  // = start_pos of the next chunk
  // Compressed id at position n_tokens()-1-k (kEngramDead for image tokens).
  int32_t back(int k) const { return recent_[size_t(k)]; }
  int available() const { return n_tokens_ < kCapacity ? int(n_tokens_) : kCapacity; }

  void clear() { n_tokens_ = 0; }
  // Appends a chunk of compressed ids (after hashing it).
  void append(std::span<const int32_t> compressed);
  // Restores the state of a sequence of `n_tokens` tokens whose last compressed ids are `tail`
  // (oldest first; must hold min(n_tokens, kCapacity) ids).
  void assign(int64_t n_tokens, std::span<const int32_t> tail);

 private:
  int64_t n_tokens_ = 0;
  std::array<int32_t, kCapacity> recent_{};  // recent_[k] = id at n_tokens_-1-k
};

// Token ids -> compressed ids. `dead` (empty, or one flag per token) marks image tokens, which
// become kEngramDead. Throws std::out_of_range naming the id when a live id is outside the map.
void engram_compress_tokens(const EngramTokenMap& map, std::span<const int32_t> token_ids,
                            std::span<const uint8_t> dead, int32_t* out);

// Hash ids of the chunk at positions history.n_tokens() .. +S-1 (S = compressed_chunk.size())
// for engram layer `layer_index` (index into layer_ids). out: [S][hash_cols()].
void engram_hash_ids(const EngramConstants& c, int layer_index, const EngramHistory& history,
                     std::span<const int32_t> compressed_chunk, int32_t* out);
// All engram layers at once. out: [S][n_layers()][hash_cols()] (the golden `engram_hash` layout).
void engram_hash_ids_all_layers(const EngramConstants& c, const EngramHistory& history,
                                std::span<const int32_t> compressed_chunk, int32_t* out);

}  // namespace di::v41
