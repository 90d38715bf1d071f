// Live checks against Hugging Face's Rust tokenizer (npm tokenizers@0.23.2): regenerates the frozen
// oracle files with node and compares them and our ids. Skipped, with a message, when node or the
// npm module is missing; the frozen-file tests in test_tokenizer.cpp always run.
#include <gtest/gtest.h>

#include "test_tokenizer_util.h"

namespace di {
namespace {

using nlohmann::json;
using test::check_variants;
using test::expect_rows_match;
using test::kCorpus;
using test::kVariants;
using test::read_jsonl;
using test::v3_tokenizer;

TEST(TokenizerExactness, LiveNodeOracleRegeneratesCorpus) {
  if (!test::node_oracle_available()) GTEST_SKIP() << "node or npm tokenizers missing: live oracle not run";
  const std::string out = ::testing::TempDir() + "/corpus_live.jsonl";
  test::run_command("node " DI_SOURCE_DIR "/tests/oracle/gen_tokenizer_corpus.js --out " + out + " 2>/dev/null");
  const auto live = read_jsonl(out);
  const auto frozen = read_jsonl(kCorpus);
  ASSERT_EQ(live.size(), frozen.size());
  for (size_t i = 0; i < live.size(); ++i) ASSERT_EQ(live[i], frozen[i]) << "frozen corpus is stale at line " << i + 1;
  expect_rows_match(*v3_tokenizer(), live, "live corpus");
}

TEST(TokenizerExactness, LiveNodeOracleFeatureVariants) {
  if (!test::node_oracle_available()) GTEST_SKIP() << "node or npm tokenizers missing: live oracle not run";
  const std::string out = ::testing::TempDir() + "/variants_live.json";
  test::run_command("node " DI_SOURCE_DIR "/tests/oracle/tokenizer_variants.js --out " + out + " 2>/dev/null");
  const json live = json::parse(test::read_file(out));
  EXPECT_EQ(live, json::parse(test::read_file(kVariants))) << "frozen variants file is stale";
  check_variants(live, "live");
}

}  // namespace
}  // namespace di
