#include "tokenizer/added_vocab.h"

#include "tokenizer/text_utf8.h"

namespace di::tok {

void AddedTokenMatcher::build(const std::vector<const AddedToken*>& tokens,
                              const std::vector<std::string>& patterns) {
  nodes_.assign(1, Node{});
  tokens_ = tokens;
  first_byte_.fill(false);
  for (size_t t = 0; t < tokens.size(); ++t) {
    const std::string& pattern = patterns[t];
    if (pattern.empty()) continue;  // HF never matches an empty token
    first_byte_[static_cast<uint8_t>(pattern[0])] = true;
    int32_t node = 0;
    for (char ch : pattern) {
      const auto byte = static_cast<uint8_t>(ch);
      int32_t child = -1;
      for (const auto& [b, index] : nodes_[node].children) {
        if (b == byte) { child = index; break; }
      }
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_[node].children.emplace_back(byte, child);
        nodes_.push_back(Node{});
      }
      node = child;
    }
    if (nodes_[node].token < 0) nodes_[node].token = static_cast<int32_t>(t);  // first of equal patterns wins
  }
}

int32_t AddedTokenMatcher::longest_at(std::string_view text, size_t pos, size_t& len) const {
  int32_t node = 0, best = -1;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto byte = static_cast<uint8_t>(text[i]);
    int32_t child = -1;
    for (const auto& [b, index] : nodes_[node].children) {
      if (b == byte) { child = index; break; }
    }
    if (child < 0) break;
    node = child;
    if (nodes_[node].token >= 0) {
      best = nodes_[node].token;
      len = i + 1 - pos;
    }
  }
  return best;
}

namespace {
bool ends_with_word(std::string_view s) {
  if (s.empty()) return false;
  size_t len = 0;
  return utf8::is_word_char(utf8::decode_at(s, s.size() - utf8::last_char_len(s), len));
}
bool starts_with_word(std::string_view s) {
  if (s.empty()) return false;
  size_t len = 0;
  return utf8::is_word_char(utf8::decode_at(s, 0, len));
}
// Start of the run of whitespace that ends `s`.
size_t whitespace_run_start(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    const size_t clen = utf8::last_char_len(s.substr(0, end));
    size_t len = 0;
    if (!utf8::is_white_space(utf8::decode_at(s, end - clen, len))) break;
    end -= clen;
  }
  return end;
}
// Length of the run of whitespace that starts `s`.
size_t whitespace_run_length(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    size_t len = 0;
    if (!utf8::is_white_space(utf8::decode_at(s, pos, len))) break;
    pos += len;
  }
  return pos;
}
}  // namespace

void AddedTokenMatcher::split(std::string_view text, FunctionRef<void(std::string_view, int32_t)> on_piece) const {
  size_t emitted = 0;  // end of what has been reported
  size_t pos = 0;
  while (pos < text.size()) {
    if (!first_byte_[static_cast<uint8_t>(text[pos])]) { ++pos; continue; }
    size_t len = 0;
    const int32_t t = longest_at(text, pos, len);
    if (t < 0) { ++pos; continue; }
    const AddedToken& token = *tokens_[t];
    size_t start = pos, stop = pos + len;
    pos = stop;  // like aho-corasick's non-overlapping iterator, a rejected match is not searched again
    if (token.single_word && (ends_with_word(text.substr(0, start)) || starts_with_word(text.substr(stop)))) {
      continue;
    }
    if (start < emitted) continue;  // overlaps whitespace a previous rstrip token consumed
    if (token.lstrip) start = std::max(whitespace_run_start(text.substr(0, start)), emitted);
    if (token.rstrip) stop += whitespace_run_length(text.substr(stop));
    if (start > emitted) on_piece(text.substr(emitted, start - emitted), -1);
    on_piece(text.substr(start, stop - start), token.id);
    emitted = stop;
    pos = stop;
  }
  if (emitted < text.size()) on_piece(text.substr(emitted), -1);
}

}  // namespace di::tok
