// Random checkpoints of each architecture (`deepinfer make-tiny`, the built-in default model, the
// bench's generated models), through one registry so that callers need no architecture header.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace di {

struct GenerateOptions {
  std::string arch = "v41";    // one of generator_archs()
  std::string size = "tiny";   // one of generator_sizes(arch)
  uint64_t seed = 0;
  std::string tokenizer_path;  // the architecture's default when empty
  int threads = 0;             // 0 = all cores
  int64_t shard_bytes = -1;    // max bytes of tensor data per shard; -1 = the size's default, 0 = one file
  bool force = false;          // allow a non-empty out_dir; its model files are replaced
  std::function<void(double)> progress;  // fraction of tensor bytes done, from the calling thread
};

struct GeneratedModel {
  std::string summary;  // one line: the shape of the generated config
  int64_t n_params = 0;
  uint64_t tensor_bytes = 0, file_bytes = 0;
  size_t n_tensors = 0, n_shards = 0;
  double seconds = 0;
};

std::vector<std::string> generator_archs();
// Sizes of an architecture's generator; throws std::invalid_argument for an unknown arch.
std::vector<std::string> generator_sizes(const std::string& arch);
// Every size name of every architecture (for option checks).
std::vector<std::string> all_generator_sizes();
// Writes the model directory (config.json last). Throws as the architecture's generator does.
GeneratedModel generate_model(const GenerateOptions& opts, const std::string& out_dir);

}  // namespace di
