// The model's vocabulary as the grammar engine sees it: each token's bytes, sorted so that tokens
// sharing a prefix are checked together, plus the rules for tokens that are not text.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace di {
class Tokenizer;
}

namespace di::grammar {

struct VocabularyOptions {
  // Width of the mask in tokens (the model's logit count, may exceed the tokenizer's ids);
  // 0: the tokenizer's vocab_size.
  int32_t mask_size = 0;
  // Tokens that end generation (EOS, <|EOT|>): allowed exactly when the grammar may end, never
  // as text.
  // Empty: the tokenizer's <｜end▁of▁sentence｜>.
  std::vector<int32_t> stop_ids;
  // Added (control) tokens are never generated under a grammar, except these, which count as
  // their text: e.g. ｜DSML｜ or <｜tool▁sep｜> for a tool-call grammar that spells them.
  std::vector<int32_t> text_added_ids;
};

class Vocabulary {
 public:
  static std::shared_ptr<const Vocabulary> from_tokenizer(const Tokenizer& tok, const VocabularyOptions& opt = {});
  // Tokens given as byte strings: token id i has bytes tokens[i] (empty: never allowed).
  Vocabulary(const std::vector<std::string>& tokens, int32_t mask_size, std::vector<int32_t> stop_ids);

  int32_t mask_size() const { return mask_size_; }
  int32_t mask_words() const { return (mask_size_ + 31) / 32; }
  const std::vector<int32_t>& stop_ids() const { return stop_ids_; }

  // Text tokens in byte order: index k has id sorted_id(k) and bytes sorted_bytes(k).
  int32_t num_sorted() const { return static_cast<int32_t>(sorted_ids_.size()); }
  int32_t sorted_id(int32_t k) const { return sorted_ids_[k]; }
  std::string_view sorted_bytes(int32_t k) const {
    return std::string_view(bytes_).substr(offsets_[k], offsets_[k + 1] - offsets_[k]);
  }
  // Bytes of a token id (empty if it is not a text token).
  std::string_view token_bytes(int32_t id) const;
  bool is_stop(int32_t id) const;

 private:
  Vocabulary() = default;
  void build(const std::vector<std::pair<std::string, int32_t>>& tokens);

  int32_t mask_size_ = 0;
  std::vector<int32_t> stop_ids_;
  std::vector<int32_t> sorted_ids_;
  std::vector<uint32_t> offsets_;
  std::vector<int32_t> sorted_index_of_id_;  // -1 for non-text ids
  std::string bytes_;
};

}  // namespace di::grammar
