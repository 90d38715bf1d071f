// The DeepSeek-V4.1 tokenizer derived from the DeepSeek-V3 one: V4.1 adds control tokens (system turn,
// thinking, DSML tool calls, latest reminder) that V3 lacks. See docs/tokenizer.md for the table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace di {

struct V41AddedToken {
  const char* content;
  int32_t id;          // the id in the V4.1 release tokenizer
  const char* source;  // where the id comes from
};

// The V4.1 added tokens that the V3 tokenizer lacks, in id order.
const std::vector<V41AddedToken>& v41_added_tokens();

// Returns `v3_tokenizer_json` with the V4.1 tokens added at their V4.1 ids. The V3 placeholder at an
// id V4.1 uses is replaced; ids stay contiguous so that Hugging Face (which assigns added-token ids
// by list position) gives every token the id written in the file. Throws std::runtime_error when
// the input is not a V3-layout tokenizer (a target id holds something other than a placeholder, or a
// V4.1 token already exists at another id).
nlohmann::json derive_v41_tokenizer_json(const nlohmann::json& v3_tokenizer_json);

}  // namespace di
