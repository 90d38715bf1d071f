// GrammarCompiler: cache by source, one compile for concurrent requests, errors not cached,
// eviction; one CompiledGrammar used by matchers on several threads gives the same masks.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "grammar/grammar_compiler.h"
#include "test_grammar_util.h"

namespace di::grammar {
namespace {

TEST(GrammarCompiler, CachesBySourceAndCompilesOnce) {
  GrammarCompiler c(test::byte_vocab());
  auto a = c.json_schema(R"({"type":"integer"})");
  auto b = c.json_schema(R"({"type":"integer"})");
  EXPECT_EQ(a.get(), b.get());
  EXPECT_NE(c.json_schema(R"({"type":"string"})").get(), a.get());
  JsonSchemaOptions compact;
  compact.any_whitespace = false;
  EXPECT_NE(c.json_object(compact).get(), c.json_object().get());
  EXPECT_EQ(c.regex("a+").get(), c.regex("a+").get());
  EXPECT_EQ(c.ebnf("root ::= \"x\"").get(), c.ebnf("root ::= \"x\"").get());
  EXPECT_EQ(c.compiles(), 6u);

  // Concurrent requests for a new key: one compile, one object.
  std::vector<std::thread> threads;
  std::vector<const CompiledGrammar*> got(8);
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] { got[i] = c.json_schema(R"({"type":"array","items":{"type":"number"}})").get(); });
  }
  for (auto& t : threads) t.join();
  for (const auto* p : got) EXPECT_EQ(p, got[0]);
  EXPECT_EQ(c.compiles(), 7u);
}

TEST(GrammarCompiler, ErrorsAreNotCached) {
  GrammarCompiler c(test::byte_vocab());
  EXPECT_THROW(c.json_schema(R"({"type":"object","minProperties":1})"), GrammarError);
  EXPECT_THROW(c.json_schema(R"({"type":"object","minProperties":1})"), GrammarError);
  EXPECT_EQ(c.compiles(), 2u);
  EXPECT_EQ(c.size(), 0u);
  EXPECT_THROW(c.regex("(?=x)"), GrammarError);
  EXPECT_THROW(c.ebnf("root ::= root \"a\" | \"b\""), GrammarError);
}

TEST(GrammarCompiler, EvictsLeastRecentlyUsed) {
  GrammarCompiler c(test::byte_vocab(), {}, 2);
  auto a = c.regex("a");
  c.regex("b");
  c.regex("a");  // a is now the most recent
  c.regex("c");  // evicts b
  EXPECT_EQ(c.size(), 2u);
  EXPECT_EQ(c.regex("a").get(), a.get());
  const uint64_t before = c.compiles();
  c.regex("b");
  EXPECT_EQ(c.compiles(), before + 1);
}

TEST(GrammarCompiler, SharedGrammarAcrossThreads) {
  GrammarCompiler c(test::v3_vocab());
  auto g = c.json_schema(R"({"type":"object","properties":{"a":{"type":"string"},"b":{"type":"array","items":{"type":"integer"}}},"required":["a","b"]})");
  // Reference masks along one token path, single-threaded.
  std::mt19937_64 rng(1);
  GrammarMatcher ref(g);
  std::vector<int32_t> path;
  std::vector<std::vector<int32_t>> masks;
  std::vector<uint32_t> mask(g->vocab().mask_words());
  for (int i = 0; i < 40 && !ref.is_terminated(); ++i) {
    ref.fill_mask(mask);
    masks.push_back(test::allowed_ids(mask, g->vocab().mask_size()));
    const int32_t id = masks.back()[rng() % masks.back().size()];
    path.push_back(id);
    ASSERT_TRUE(ref.accept_token(id));
  }
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      GrammarMatcher m(g);
      std::vector<uint32_t> local(g->vocab().mask_words());
      for (size_t i = 0; i < masks.size(); ++i) {
        m.fill_mask(local);
        if (test::allowed_ids(local, g->vocab().mask_size()) != masks[i]) ++mismatches;
        m.accept_token(path[i]);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

}  // namespace
}  // namespace di::grammar
