#include <gtest/gtest.h>

#include "test_tokenizer_util.h"

namespace di {
namespace {

using test::read_jsonl;
using test::v3_tokenizer;

TEST(TokenizerVectors, MatchesHuggingFaceOnSharedVectors) {
  auto tok = v3_tokenizer();
  const auto rows = read_jsonl(DI_SOURCE_DIR "/tests/data/tokenizer/deepseek_v3_vectors.jsonl");
  ASSERT_GE(rows.size(), 1500u);
  size_t failures = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::string text = rows[i]["text"];
    const auto expected = rows[i]["ids"].get<std::vector<int32_t>>();
    const auto got = tok->encode(text);
    if (got != expected && failures++ < 10) {
      ADD_FAILURE() << "line " << i + 1 << ": " << nlohmann::json(text).dump() << "\n  expected "
                    << nlohmann::json(expected).dump() << "\n  got      " << nlohmann::json(got).dump();
    }
  }
  EXPECT_EQ(failures, 0u);
}

}  // namespace
}  // namespace di
