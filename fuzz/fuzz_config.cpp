// The HF config.json loader (src/io/config.cpp) on untrusted text. Properties: a bad config is a
// LoadError, never a crash or another exception; an accepted config survives to_hf_json() ->
// from_hf_json_text() -> to_hf_json() unchanged (the writer and the reader agree).
#include <cstring>

#include "fuzz_util.h"
#include "model/v41/config.h"
#include "io/safetensors.h"

using namespace di;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::string first;
  try {
    const V41Config c = V41Config::from_hf_json_text(text, "fuzz/config.json");
    first = c.to_hf_json();
  } catch (const LoadError&) {
    return 0;
  } catch (const std::exception& e) {
    FUZZ_CHECK(false, std::string("not a LoadError: ") + e.what() + "\n  input: " + fuzz::show(text));
  }
  try {
    const V41Config again = V41Config::from_hf_json_text(first, "fuzz/written.json");
    const std::string second = again.to_hf_json();
    FUZZ_CHECK(first == second, "to_hf_json is not a fixed point:\n" + fuzz::show(first, 4000) + "\n  vs\n" + fuzz::show(second, 4000));
  } catch (const std::exception& e) {
    FUZZ_CHECK(false, std::string("the written config does not load: ") + e.what() + "\n  written: " + fuzz::show(first, 4000));
  }
  return 0;
}
