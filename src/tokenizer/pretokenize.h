// Normalizer and pre-tokenizer stages of a Hugging Face tokenizer.json, for byte-level BPE.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tokenizer/function_ref.h"

namespace di::tok {

// A compiled PCRE2 pattern (UTF + UCP, JIT when available), written in Oniguruma syntax as HF uses it.
class Regex {
 public:
  // `literal`: match the text exactly (HF's `{"String": ...}` pattern).
  Regex(const std::string& pattern, bool literal, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Calls on_match(begin, end) for every non-overlapping match in `subject` (valid UTF-8), left to right.
  void for_each_match(std::string_view subject, FunctionRef<void(size_t, size_t)> on_match) const;
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

// Rewrites the Oniguruma-isms of HF's patterns into PCRE2 syntax: Oniguruma's Unicode \s also
// matches U+0085 (NEL), PCRE2's does not. Throws std::runtime_error for constructs whose meaning
// differs and that are not translated.
std::string translate_oniguruma_pattern(const std::string& pattern, const std::string& where);

class Normalizer {
 public:
  // `spec` is the tokenizer.json "normalizer" value (null allowed).
  explicit Normalizer(const nlohmann::json& spec);
  bool is_identity() const { return steps_.empty(); }
  std::string apply(std::string_view text) const;

 private:
  enum class Step { kNfc, kNfd, kNfkc, kNfkd };
  std::vector<Step> steps_;
};

class PreTokenizer {
 public:
  // `spec` is the tokenizer.json "pre_tokenizer" value. Requires a final ByteLevel step.
  explicit PreTokenizer(const nlohmann::json& spec);
  ~PreTokenizer();
  // Splits `text` into words and calls on_word with each word's raw bytes (before the byte-to-char map).
  void split(std::string_view text, FunctionRef<void(std::string_view)> on_word) const;

 private:
  enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
  struct SplitStep {
    std::unique_ptr<Regex> regex;
    Behavior behavior;
    bool invert;
  };
  void add_step(const nlohmann::json& step, bool last, const std::string& where);
  void run_from(size_t step, std::string_view piece, FunctionRef<void(std::string_view)> on_word) const;
  void byte_level(std::string_view piece, FunctionRef<void(std::string_view)> on_word) const;

  std::vector<SplitStep> steps_;
  bool has_byte_level_ = false;
  bool add_prefix_space_ = false;
  std::unique_ptr<Regex> byte_level_regex_;  // set when ByteLevel.use_regex
};

}  // namespace di::tok
