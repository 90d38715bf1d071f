// The HF config.json loaders of every architecture (src/model/*/config.cpp) on untrusted text.
// Properties: a bad config is a LoadError, never a crash or another exception; an accepted config
// survives to_hf_json() -> from_hf_json_text() -> to_hf_json() unchanged (writer and reader agree).
#include <cstring>

#include "fuzz_util.h"
#include "io/safetensors.h"
#include "model/v3/config.h"
#include "model/v41/config.h"

using namespace di;

namespace {

template <class Config>
void check_config(const std::string& text) {
  std::string first;
  try {
    const Config c = Config::from_hf_json_text(text, "fuzz/config.json");
    first = c.to_hf_json();
  } catch (const LoadError&) {
    return;
  } catch (const std::exception& e) {
    FUZZ_CHECK(false, std::string("not a LoadError: ") + e.what() + "\n  input: " + fuzz::show(text));
  }
  try {
    const Config again = Config::from_hf_json_text(first, "fuzz/written.json");
    const std::string second = again.to_hf_json();
    FUZZ_CHECK(first == second, "to_hf_json is not a fixed point:\n" + fuzz::show(first, 4000) + "\n  vs\n" + fuzz::show(second, 4000));
  } catch (const std::exception& e) {
    FUZZ_CHECK(false, std::string("the written config does not load: ") + e.what() + "\n  written: " + fuzz::show(first, 4000));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  check_config<V41Config>(text);
  check_config<v3::V3Config>(text);
  return 0;
}
