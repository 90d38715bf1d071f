// The V4.1 tokenizer derived from the V3 one: each control token is one id, at the V4.1 id;
// everything else encodes as before; Hugging Face gives the same ids to the derived file.
#include <gtest/gtest.h>

#include <fstream>

#include "test_tokenizer_util.h"
#include "tokenizer/v41_vocab.h"

namespace di {
namespace {

using nlohmann::json;

const json& v3_json() {
  static const json j = json::parse(test::read_file(test::v3_tokenizer_path()));
  return j;
}

std::shared_ptr<const Tokenizer> v41_tokenizer() {
  static auto tok = Tokenizer::from_json_text(derive_v41_tokenizer_json(v3_json()).dump(), "derived v4.1");
  return tok;
}

TEST(V41Tokenizer, ControlTokensAreSingleIdsAtV41Ids) {
  auto tok = v41_tokenizer();
  ASSERT_FALSE(v41_added_tokens().empty());
  for (const auto& t : v41_added_tokens()) {
    SCOPED_TRACE(t.content);
    EXPECT_EQ(tok->encode(t.content, true), std::vector<int32_t>{t.id});
    EXPECT_EQ(tok->token_to_id(t.content), t.id);
    EXPECT_EQ(tok->decode({t.id}), t.content);
    const auto plain = tok->encode(t.content, false);
    EXPECT_GT(plain.size(), 1u);
    for (int32_t id : plain) EXPECT_LT(id, 128000);
    EXPECT_FALSE(tok->is_special(t.id));
  }
  // The ids the chat format relies on.
  EXPECT_EQ(tok->token_to_id("<｜System｜>"), 128799);
  EXPECT_EQ(tok->token_to_id("<think>"), 128821);
  EXPECT_EQ(tok->token_to_id("</think>"), 128822);
  EXPECT_EQ(tok->token_to_id("｜DSML｜"), 128825);
  EXPECT_EQ(tok->token_to_id("<｜latest_reminder｜>"), 128828);
  EXPECT_EQ(tok->token_to_id("<｜User｜>"), 128803);
  EXPECT_EQ(tok->token_to_id("<｜Assistant｜>"), 128804);
  EXPECT_EQ(tok->token_to_id("<｜begin▁of▁sentence｜>"), 0);
  EXPECT_EQ(tok->token_to_id("<｜end▁of▁sentence｜>"), 1);
  EXPECT_FALSE(tok->token_to_id("<｜place▁holder▁no▁799｜>").has_value());
  EXPECT_EQ(tok->vocab_size(), 128829);
}

TEST(V41Tokenizer, TemplateTextUsesControlTokens) {
  auto tok = v41_tokenizer();
  const std::string prompt = "<｜begin▁of▁sentence｜><｜System｜>sys<｜User｜>hi<｜Assistant｜><think>r</think>ok";
  const auto ids = tok->encode(prompt);
  EXPECT_EQ(ids.front(), 0);
  EXPECT_EQ(ids[1], 128799);
  EXPECT_EQ(tok->decode(ids), prompt);
  // DSML tags are '<' + the marker token + ordinary text.
  const auto dsml = tok->encode("<｜DSML｜ calls>\n</｜DSML｜ calls>");
  EXPECT_EQ(std::count(dsml.begin(), dsml.end(), 128825), 2);
  EXPECT_EQ(tok->decode(dsml), "<｜DSML｜ calls>\n</｜DSML｜ calls>");
  EXPECT_EQ(tok->encode("<think>", false).size(), 3u);  // typed as content: plain BPE
}

TEST(V41Tokenizer, OrdinaryTextEncodesAsWithV3) {
  auto v41 = v41_tokenizer();
  size_t compared = 0;
  for (const auto& row : test::read_jsonl(test::kCorpus)) {
    const std::string text = row["text"];
    const auto v3_plain = row.contains("ids_plain") ? row["ids_plain"] : row["ids"];
    ASSERT_EQ(v41->encode(text, false), v3_plain.get<std::vector<int32_t>>()) << json(text).dump().substr(0, 200);
    bool has_v41_token = text.find("<｜place▁holder▁no▁799｜>") != std::string::npos;
    for (const auto& t : v41_added_tokens()) has_v41_token = has_v41_token || text.find(t.content) != std::string::npos;
    if (has_v41_token) continue;
    ASSERT_EQ(v41->encode(text, true), row["ids"].get<std::vector<int32_t>>()) << json(text).dump().substr(0, 200);
    ++compared;
  }
  EXPECT_GT(compared, 3000u);
}

TEST(V41Tokenizer, DerivationIsIdempotentAndChecksInput) {
  const json once = derive_v41_tokenizer_json(v3_json());
  EXPECT_EQ(derive_v41_tokenizer_json(once), once);
  // Contiguous ids: HF numbers added tokens by position, so the written ids must be 128000.. in order.
  int64_t previous = -1;
  for (const auto& t : once["added_tokens"]) {
    const int64_t id = t["id"];
    if (id >= 128000) {
      if (previous >= 128000) EXPECT_EQ(id, previous + 1) << t["content"];
      previous = id;
    }
  }
  json v31_like = v3_json();
  for (auto& t : v31_like["added_tokens"]) {
    if (t["id"] == 128798) t["content"] = "<think>";
  }
  try {
    derive_v41_tokenizer_json(v31_like);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("<think> is already at id 128798"), std::string::npos) << e.what();
  }
  EXPECT_THROW(derive_v41_tokenizer_json(json::object()), std::runtime_error);
}

TEST(V41Tokenizer, HuggingFaceAgreesOnDerivedFile) {
  if (!test::node_oracle_available()) GTEST_SKIP() << "node or npm tokenizers missing: live oracle not run";
  const std::string dir = ::testing::TempDir();
  const std::string tokenizer_path = dir + "/v41_tokenizer.json";
  const std::string texts_path = dir + "/v41_texts.jsonl";
  std::ofstream(tokenizer_path) << derive_v41_tokenizer_json(v3_json()).dump();
  std::vector<std::string> texts = {"<｜begin▁of▁sentence｜><｜System｜>You are helpful.<｜User｜>Hi<｜Assistant｜><think>",
                                    "<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
                                    "<｜latest_reminder｜>Be brief.</think>answer<｜end▁of▁sentence｜>",
                                    "plain text 123 你好 <｜place▁holder▁no▁799｜>"};
  for (const auto& t : v41_added_tokens()) texts.push_back(std::string("x") + t.content + " y");
  {
    std::ofstream out(texts_path);
    for (const auto& t : texts) out << json{{"text", t}}.dump() << "\n";
  }
  const std::string output = test::run_command("node " DI_SOURCE_DIR "/tests/oracle/tokenizer_encode.js " + tokenizer_path +
                                                " < " + texts_path);
  std::vector<json> rows;
  size_t start = 0;
  while (start < output.size()) {
    const size_t end = output.find('\n', start);
    rows.push_back(json::parse(output.substr(start, end - start)));
    start = end == std::string::npos ? output.size() : end + 1;
  }
  ASSERT_EQ(rows.size(), texts.size());
  for (const auto& t : v41_added_tokens()) EXPECT_EQ(rows[0]["tokens"][t.content], t.id) << t.content;
  auto tok = v41_tokenizer();
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(tok->encode(texts[i]), rows[i]["ids"].get<std::vector<int32_t>>()) << texts[i];
  }
}

}  // namespace
}  // namespace di
