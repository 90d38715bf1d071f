// Added tokens of a tokenizer.json ("added_tokens"): found in text before pre-tokenization, with HF's
// leftmost-longest matching and the single_word / lstrip / rstrip rules.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/function_ref.h"

namespace di::tok {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool normalized = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
};

// Matches one set of added tokens (HF keeps two: tokens matched on raw text, and tokens matched on
// normalized text).
class AddedTokenMatcher {
 public:
  // `patterns[i]` is the text to find for `tokens[i]` (the content, normalized for the second set).
  void build(const std::vector<const AddedToken*>& tokens, const std::vector<std::string>& patterns);
  bool empty() const { return tokens_.empty(); }
  // Splits `text` into added-token matches (id >= 0, with any stripped whitespace) and the plain text
  // between them (id == -1). Empty plain pieces are not reported.
  void split(std::string_view text, FunctionRef<void(std::string_view, int32_t)> on_piece) const;

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;
    int32_t token = -1;  // index into tokens_ when a pattern ends here
  };
  // Longest pattern starting at `pos`: returns its token index and sets `len`, or -1.
  int32_t longest_at(std::string_view text, size_t pos, size_t& len) const;

  std::vector<Node> nodes_;
  std::vector<const AddedToken*> tokens_;
  std::array<bool, 256> first_byte_{};
};

}  // namespace di::tok
