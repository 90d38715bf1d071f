#include "tokenizer/v41_vocab.h"

#include <map>
#include <stdexcept>

namespace di {

namespace {
constexpr const char* kKnownIds =
    "V4.1 release tokenizer ids as listed by public ports (see docs/tokenizer.md)";
}

const std::vector<V41AddedToken>& v41_added_tokens() {
  // Ids 128815-128828 are contiguous in V4.1; the tokens between the ones the chat format needs are
  // included so that the list has no gap (HF numbers added tokens by position).
  static const std::vector<V41AddedToken> tokens = {
      {"<｜System｜>", 128799, kKnownIds},
      {"<｜begin▁of▁repo▁name｜>", 128815, kKnownIds},
      {"<｜end▁of▁repo▁name｜>", 128816, kKnownIds},
      {"<｜begin▁of▁file▁name｜>", 128817, kKnownIds},
      {"<｜end▁of▁file▁name｜>", 128818, kKnownIds},
      {"<｜begin▁of▁file｜>", 128819, kKnownIds},
      {"<｜end▁of▁file｜>", 128820, kKnownIds},
      {"<think>", 128821, kKnownIds},
      {"</think>", 128822, kKnownIds},
      {"<｜place▁holder▁for▁copy｜>", 128823, kKnownIds},
      {"<｜place▁holder▁for▁pointer▁replace｜>", 128824, kKnownIds},
      {"｜DSML｜", 128825, kKnownIds},
      {"<｜begin▁sys｜>", 128826, kKnownIds},
      {"<｜end▁sys｜>", 128827, kKnownIds},
      {"<｜latest_reminder｜>", 128828, kKnownIds},
  };
  return tokens;
}

nlohmann::json derive_v41_tokenizer_json(const nlohmann::json& v3) {
  if (!v3.is_object() || !v3.contains("added_tokens") || !v3["added_tokens"].is_array()) {
    throw std::runtime_error("derive_v41_tokenizer_json: input has no \"added_tokens\" array");
  }
  nlohmann::json out = v3;
  auto& list = out["added_tokens"];
  std::map<int64_t, size_t> index_by_id;
  std::map<std::string, int64_t> id_by_content;
  int64_t largest = -1;
  for (size_t i = 0; i < list.size(); ++i) {
    const auto& t = list[i];
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
        !t["content"].is_string()) {
      throw std::runtime_error("derive_v41_tokenizer_json: added_tokens[" + std::to_string(i) + "] is malformed");
    }
    index_by_id[t["id"].get<int64_t>()] = i;
    id_by_content[t["content"].get<std::string>()] = t["id"].get<int64_t>();
    largest = std::max(largest, t["id"].get<int64_t>());
  }
  // Flags as V3 gives its non-special turn tokens such as <｜User｜>.
  auto make = [](const V41AddedToken& token) {
    return nlohmann::json{{"id", token.id},          {"content", token.content}, {"single_word", false},
                          {"lstrip", false},         {"rstrip", false},          {"normalized", true},
                          {"special", false}};
  };
  for (const V41AddedToken& token : v41_added_tokens()) {
    if (auto it = id_by_content.find(token.content); it != id_by_content.end()) {
      if (it->second == token.id) continue;  // already there (input is already V4.1-like)
      throw std::runtime_error(std::string("derive_v41_tokenizer_json: ") + token.content + " is already at id " +
                               std::to_string(it->second) + ", V4.1 puts it at " + std::to_string(token.id));
    }
    if (auto it = index_by_id.find(token.id); it != index_by_id.end()) {
      const std::string existing = list[it->second]["content"].get<std::string>();
      if (existing.rfind("<｜place▁holder▁no▁", 0) != 0) {
        throw std::runtime_error("derive_v41_tokenizer_json: id " + std::to_string(token.id) + " holds " + existing +
                                 ", not a placeholder; cannot place " + token.content);
      }
      list[it->second] = make(token);  // same list position keeps HF's positional id
      continue;
    }
    if (token.id != largest + 1) {
      throw std::runtime_error("derive_v41_tokenizer_json: adding " + std::string(token.content) + " at id " +
                               std::to_string(token.id) + " would leave a gap after id " + std::to_string(largest));
    }
    list.push_back(make(token));
    largest = token.id;
  }
  return out;
}

}  // namespace di
