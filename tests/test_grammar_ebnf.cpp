// The grammar language: syntax, escapes, Unicode classes, errors with positions, left recursion
// and empty languages refused, the empty grammar, printing and re-parsing.
#include <gtest/gtest.h>

#include <random>

#include "grammar/automaton.h"
#include "grammar/compiled_grammar.h"
#include "grammar/grammar.h"
#include "test_grammar_util.h"

namespace di::grammar {
namespace {

using test::byte_vocab;
using test::full_match;

std::shared_ptr<const CompiledGrammar> compile_bytes(const std::string& text) {
  return CompiledGrammar::compile(parse_ebnf(text), byte_vocab());
}

std::string error_of(const std::string& text) {
  try {
    CompiledGrammar::compile(parse_ebnf(text), byte_vocab());
  } catch (const GrammarError& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(GrammarEbnf, SyntaxAndEscapes) {
  auto g = compile_bytes(R"G(
# comments run to the end of the line
root ::= greeting ( " " name )+   # several names
         | 'single \'quoted\''
greeting ::= "h\x69" | "\u00e9t\U0001F600" | "tab\there\n"
name ::= [A-Z] [a-z]{1,3} | [^\x00-\x7F]{2} | "q"{2,} | "."
)G");
  EXPECT_TRUE(full_match(g, "hi Bob"));
  EXPECT_TRUE(full_match(g, "hi Bob Al Zyxw"));
  EXPECT_FALSE(full_match(g, "hi Bobby"));
  EXPECT_TRUE(full_match(g, "ét😀 éü"));
  EXPECT_TRUE(full_match(g, "tab\there\n qqqq"));
  EXPECT_FALSE(full_match(g, "hi q"));
  EXPECT_TRUE(full_match(g, "hi ."));
  EXPECT_TRUE(full_match(g, "single 'quoted'"));
  EXPECT_FALSE(full_match(g, "hi"));
}

TEST(GrammarEbnf, AnyCharAndClassesAreUtf8) {
  auto g = compile_bytes(R"(root ::= .)");
  for (uint32_t cp : {0u, 0x41u, 0x7Fu, 0x80u, 0x7FFu, 0x800u, 0xD7FFu, 0xE000u, 0xFFFFu, 0x10000u, 0x10FFFFu}) {
    std::string s;
    append_utf8(s, cp);
    EXPECT_TRUE(full_match(g, s)) << std::hex << cp;
  }
  EXPECT_FALSE(full_match(g, "\xED\xA0\x80"));      // a surrogate
  EXPECT_FALSE(full_match(g, "\xC0\x80"));          // overlong
  EXPECT_FALSE(full_match(g, "\xF4\x90\x80\x80"));  // above U+10FFFF
  EXPECT_FALSE(full_match(g, "\x80"));
  EXPECT_FALSE(full_match(g, "ab"));

  // A class across the 1/2/3/4-byte boundaries: check every code point near each boundary.
  auto c = compile_bytes(R"(root ::= [\x7E-\u0801\uFFFE-\U00010001])");
  for (uint32_t cp = 0x70; cp < 0x10010; cp = cp == 0x900 ? 0xFFF0 : cp + 1) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    std::string s;
    append_utf8(s, cp);
    const bool in = (cp >= 0x7E && cp <= 0x801) || (cp >= 0xFFFE && cp <= 0x10001);
    ASSERT_EQ(full_match(c, s), in) << std::hex << cp;
  }
  auto neg = compile_bytes(R"(root ::= [^a-zé]+)");
  EXPECT_TRUE(full_match(neg, "ABC😀ü"));
  EXPECT_FALSE(full_match(neg, "AéB"));
}

TEST(GrammarEbnf, EmptyGrammarAcceptsOnlyTheEmptyString) {
  auto g = compile_bytes(R"(root ::= "")");
  GrammarMatcher m(g);
  EXPECT_TRUE(m.can_end());
  EXPECT_TRUE(m.must_end());
  std::vector<uint32_t> mask(g->vocab().mask_words());
  m.fill_mask(mask);
  EXPECT_EQ(test::allowed_ids(mask, g->vocab().mask_size()), std::vector<int32_t>{256});
  EXPECT_FALSE(m.accept_bytes("a"));
  EXPECT_TRUE(m.accept_token(256));
  EXPECT_TRUE(m.is_terminated());
}

TEST(GrammarEbnf, NullableLoopsTerminate) {
  auto g = compile_bytes(R"(
root ::= a* "x" b*
a ::= "y"?
b ::= c c
c ::= "z"* | ""
)");
  EXPECT_TRUE(full_match(g, "x"));
  EXPECT_TRUE(full_match(g, "yyyx"));
  EXPECT_TRUE(full_match(g, "xzzz"));
  EXPECT_FALSE(full_match(g, "xy"));
}

TEST(GrammarEbnf, LeftRecursionRefusedWithTheCycle) {
  EXPECT_NE(error_of(R"(root ::= root "x" | "y")").find("left recursion: root -> root"), std::string::npos);
  const std::string indirect = error_of(R"(
root ::= a
a ::= b "x" | "z"
b ::= a "y"
)");
  EXPECT_NE(indirect.find("left recursion: a -> b -> a"), std::string::npos) << indirect;
  // Through a nullable prefix.
  const std::string nullable = error_of(R"(
root ::= opt root "x" | "y"
opt ::= "q"?
)");
  EXPECT_NE(nullable.find("left recursion"), std::string::npos) << nullable;
  // Right recursion and recursion after a byte are fine.
  EXPECT_EQ(error_of(R"(root ::= "x" root | "y")"), "(accepted)");
  EXPECT_EQ(error_of(R"G(root ::= "(" root ")" root | "")G"), "(accepted)");
}

TEST(GrammarEbnf, ErrorsNamePositions) {
  struct E {
    std::string text, what;
  };
  const std::vector<E> cases = {
      {"root ::= foo", "1:10: undefined rule 'foo'"},
      {"rot ::= \"a\"", "no rule 'root'"},
      {"root ::= \"a\"\nroot ::= \"b\"", "2:1: rule 'root' defined twice"},
      {"root ::= \"abc", "unterminated string"},
      {"root ::= \"\\q\"", "unknown escape"},
      {"root ::= \"a\"{3,1}", "n < m"},
      {"root ::= [^\\x00-\\U0010FFFF]", "matches nothing"},
      {"root ::= [z-a]", "out of order"},
      {"root ::= ( \"a\"", "expected ')'"},
      {"root ::= \"\\uD800\"", "scalar value"},
      {"root ::=\n\n  \"a\" ]", "3:7: unexpected character"},
      {"root ::= a\na ::= \"x\" a", "matches no string"},
      {"root ::= \"a\"{100001}", "too large"},
      {"root ::= " + std::string(300, '(') + "\"a\"" + std::string(300, ')'), "nested too deeply"},
      {"root ::= [a-z]{30000}", "too large"},
  };
  for (const E& e : cases) {
    const std::string err = error_of(e.text);
    EXPECT_NE(err.find(e.what), std::string::npos) << e.text << " -> " << err;
  }
}

TEST(GrammarEbnf, PrintedGrammarParsesToTheSameLanguage) {
  const std::string text = R"G(
root ::= item ( ", " item ){0,3} ws?
item ::= [a-c\-\]]+ | "\"q\"\\" | ( "x" | "y" )* "z" | [\u00e0-\u00ff]{2} | "\x01\t\n"
ws ::= [ \t]+
)G";
  const Grammar g1 = parse_ebnf(text);
  const std::string printed = g1.to_ebnf();
  const Grammar g2 = parse_ebnf(printed);
  EXPECT_EQ(g2.to_ebnf(), printed);
  auto c1 = CompiledGrammar::compile(g1, byte_vocab());
  auto c2 = CompiledGrammar::compile(g2, byte_vocab());
  std::mt19937_64 rng(9);
  for (int i = 0; i < 300; ++i) {
    std::string s;
    test::sample_expr(g1, g1.find("root")->body, rng, s);
    EXPECT_TRUE(full_match(c1, s)) << s;
    EXPECT_TRUE(full_match(c2, s)) << s;
    if (!s.empty()) s.erase(rng() % s.size(), 1);
    EXPECT_EQ(full_match(c1, s), full_match(c2, s)) << s;
  }
}

TEST(GrammarEbnf, ForcedBytesFollowTheOnlyPath) {
  auto g = compile_bytes(R"(
root ::= "{\"name\": " value "}"
value ::= "\"" [a-z]+ "\"" | "null"
)");
  GrammarMatcher m(g);
  EXPECT_EQ(m.forced_bytes(), "{\"name\": ");
  ASSERT_TRUE(m.accept_bytes("{\"name\": n"));
  EXPECT_EQ(m.forced_bytes(), "ull}");
}

}  // namespace
}  // namespace di::grammar
