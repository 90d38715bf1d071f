// GrammarMatcher: masks equal to a brute-force check of every token, rollback, termination,
// forced bytes, on the real DeepSeek vocabulary.
#include <gtest/gtest.h>

#include <random>

#include "grammar/compiled_grammar.h"
#include "grammar/grammar.h"
#include "grammar/matcher.h"
#include "test_grammar_util.h"

namespace di::grammar {
namespace {

using test::allowed_ids;
using test::brute_force_mask;
using test::v3_vocab;

std::shared_ptr<const CompiledGrammar> compile_text(const std::string& text, bool inline_rules = true) {
  CompileOptions o;
  o.threads = 2;
  if (!inline_rules) o.automaton.inline_max_nodes = 0;
  return CompiledGrammar::compile(parse_ebnf(text), v3_vocab(), o);
}

// Random walks under the mask; at each step the mask must equal the brute force.
void check_exact(const std::string& grammar_text, int walks, int steps, uint64_t seed, bool inline_rules = true) {
  auto g = compile_text(grammar_text, inline_rules);
  ASSERT_GT(g->num_uncertain_tokens(), 0u) << "the walks would not exercise run-time checks";
  std::mt19937_64 rng(seed);
  const int32_t n = g->vocab().mask_size();
  std::vector<uint32_t> mask(g->vocab().mask_words());
  for (int w = 0; w < walks; ++w) {
    GrammarMatcher m(g);
    for (int s = 0; s < steps; ++s) {
      m.fill_mask(mask);
      const std::vector<uint32_t> brute = brute_force_mask(m);
      ASSERT_EQ(allowed_ids(mask, n), allowed_ids(brute, n)) << "walk " << w << " step " << s;
      const std::vector<int32_t> ids = allowed_ids(mask, n);
      if (ids.empty()) break;
      const int32_t id = ids[std::uniform_int_distribution<size_t>(0, ids.size() - 1)(rng)];
      ASSERT_TRUE(m.accept_token(id));
      if (m.is_terminated()) break;
    }
  }
}

const char* kJsonGrammar = R"G(
root   ::= value
value  ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( string ws ":" ws value ws ( "," ws string ws ":" ws value ws )* )? "}"
array  ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string ::= "\"" ( [^"\\\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
ws     ::= [ \t\n]*
)G";

TEST(GrammarMatcher, MaskEqualsBruteForceJson) { check_exact(kJsonGrammar, 3, 12, 1); }

// Every rule its own stack frame: most tokens that end a string, number or object are uncertain
// ahead of time and checked against the real stack.
TEST(GrammarMatcher, MaskEqualsBruteForceJsonNoInlining) {
  check_exact(kJsonGrammar, 4, 16, 11, false);
  check_exact(R"G(
root ::= "[" item ( "," item )* "]"
item ::= str | num | root
str ::= "\"" [a-z ]* "\""
num ::= [0-9]+ ( "." [0-9]+ )?
)G", 6, 20, 12, false);
}

TEST(GrammarMatcher, MaskEqualsBruteForceArithmetic) {
  check_exact(R"G(
root ::= expr
expr ::= term ( ( "+" | "-" ) term )*
term ::= factor ( ( "*" | "/" ) factor )*
factor ::= [0-9]+ | "(" expr ")" | "-" factor
)G", 3, 12, 2);
}

TEST(GrammarMatcher, MaskEqualsBruteForceUnicodeAndAmbiguity) {
  // Overlapping alternatives (several stacks at once) and multi-byte classes.
  check_exact(R"G(
root ::= ( a | b )+ "!"?
a ::= [α-ω]+ " "?
b ::= [α-γ一-龥]+ ( "x" | "xy" )
)G", 3, 10, 3, false);
}

// Counted repeats: states far from the bound share one classification for short tokens (their
// class representative's) and walk long tokens on their own.
TEST(GrammarMatcher, MaskEqualsBruteForceCountedRepeats) {
  auto g = CompiledGrammar::compile(parse_ebnf(R"G(
root ::= "\"" [^"\\]{0,60} "\"" | [a-z ]{3,50} "." | "-"{20,30}
)G"), v3_vocab());
  std::mt19937_64 rng(21);
  const int32_t n = g->vocab().mask_size();
  std::vector<uint32_t> mask(g->vocab().mask_words());
  for (int w = 0; w < 4; ++w) {
    GrammarMatcher m(g);
    for (int s = 0; s < 12 && !m.is_terminated(); ++s) {
      m.fill_mask(mask);
      const auto ids = allowed_ids(mask, n);
      ASSERT_EQ(ids, allowed_ids(brute_force_mask(m), n)) << "walk " << w << " step " << s;
      // Short tokens keep walks inside the bounds for longer.
      int32_t id = ids[rng() % ids.size()];
      for (int tries = 0; tries < 20 && g->vocab().token_bytes(id).size() > 2; ++tries) id = ids[rng() % ids.size()];
      ASSERT_TRUE(m.accept_token(id));
    }
  }
}

TEST(GrammarMatcher, AcceptRollbackRestoresMasks) {
  auto g = compile_text(kJsonGrammar);
  GrammarMatcher m(g);
  std::mt19937_64 rng(7);
  const int32_t n = g->vocab().mask_size();
  std::vector<uint32_t> mask(g->vocab().mask_words());
  std::vector<std::vector<int32_t>> masks;
  std::vector<int32_t> taken;
  for (int s = 0; s < 30; ++s) {
    m.fill_mask(mask);
    masks.push_back(allowed_ids(mask, n));
    const auto& ids = masks.back();
    const int32_t id = ids[std::uniform_int_distribution<size_t>(0, ids.size() - 1)(rng)];
    ASSERT_TRUE(m.accept_token(id));
    if (m.is_terminated()) break;
    taken.push_back(id);
  }
  // Roll back by varying amounts and check the masks come back.
  while (m.num_steps() > 0) {
    const int k = std::min(m.num_steps(), 1 + static_cast<int>(rng() % 4));
    m.rollback(k);
    m.fill_mask(mask);
    EXPECT_EQ(allowed_ids(mask, n), masks[m.num_steps()]) << "after rollback to " << m.num_steps();
  }
}

TEST(GrammarMatcher, TerminationStopTokensAndForcedBytes) {
  auto g = compile_text(R"G(root ::= "{\"name\": \"" [a-z]+ "\"}")G");
  GrammarMatcher m(g);
  EXPECT_EQ(m.forced_bytes(), "{\"name\": \"");
  const int32_t eos = g->vocab().stop_ids().at(0);
  EXPECT_FALSE(m.can_end());
  EXPECT_FALSE(m.accept_token(eos));
  ASSERT_TRUE(m.accept_bytes("{\"name\": \"abc"));
  EXPECT_EQ(m.forced_bytes(), "");  // a letter or the closing quote
  ASSERT_TRUE(m.accept_bytes("\""));
  EXPECT_EQ(m.forced_bytes(), "}");
  EXPECT_FALSE(m.accept_bytes("}x"));
  ASSERT_TRUE(m.accept_bytes("}"));
  EXPECT_TRUE(m.can_end());
  EXPECT_TRUE(m.must_end());
  std::vector<uint32_t> mask(g->vocab().mask_words());
  m.fill_mask(mask);
  EXPECT_EQ(allowed_ids(mask, g->vocab().mask_size()), std::vector<int32_t>{eos});
  ASSERT_TRUE(m.accept_token(eos));
  EXPECT_TRUE(m.is_terminated());
  EXPECT_FALSE(m.accept_token(eos));
  m.rollback(1);
  EXPECT_FALSE(m.is_terminated());
  EXPECT_TRUE(m.can_end());
}

TEST(GrammarMatcher, AddedTokensExcludedUnlessText) {
  auto tok = test::v3_tokenizer();
  const int32_t sep = *tok->token_to_id("<｜tool▁sep｜>");
  const std::string g_text = "root ::= \"a\" \"<｜tool▁sep｜>\" \"b\"";
  {
    auto g = compile_text(g_text);
    GrammarMatcher m(g);
    ASSERT_TRUE(m.accept_bytes("a"));
    EXPECT_FALSE(m.accept_token(sep));
  }
  VocabularyOptions o;
  o.mask_size = 129280;
  o.text_added_ids = {sep};
  auto g = CompiledGrammar::compile(parse_ebnf(g_text), Vocabulary::from_tokenizer(*tok, o));
  GrammarMatcher m(g);
  ASSERT_TRUE(m.accept_bytes("a"));
  std::vector<uint32_t> mask(g->vocab().mask_words());
  m.fill_mask(mask);
  EXPECT_TRUE(test::bit(mask, sep));
  EXPECT_TRUE(m.accept_token(sep));
}

}  // namespace
}  // namespace di::grammar
