// Regex -> grammar: full-match agreement with PCRE2 on random and mutated strings, refused
// features, and token masks for a regex on the real vocabulary.
#include <gtest/gtest.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <random>

#include "grammar/compiled_grammar.h"
#include "grammar/regex.h"
#include "test_grammar_util.h"

namespace di::grammar {
namespace {

using test::byte_vocab;
using test::full_match;

class Pcre2 {
 public:
  explicit Pcre2(const std::string& pattern) {
    int err;
    PCRE2_SIZE off;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_ANCHORED | PCRE2_ENDANCHORED, &err, &off, nullptr);
    if (code_ == nullptr) throw std::runtime_error("pcre2 cannot compile " + pattern);
    data_ = pcre2_match_data_create_from_pattern(code_, nullptr);
  }
  ~Pcre2() {
    pcre2_match_data_free(data_);
    pcre2_code_free(code_);
  }
  bool full_match(const std::string& s) const {
    const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0, 0, data_, nullptr);
    // Invalid UTF-8 (edits split characters) matches nothing, as for the grammar.
    if (rc <= PCRE2_ERROR_UTF8_ERR1 && rc >= PCRE2_ERROR_UTF8_ERR21) return false;
    if (rc < -1) throw std::runtime_error("pcre2_match error " + std::to_string(rc));
    return rc >= 0;
  }

 private:
  pcre2_code* code_ = nullptr;
  pcre2_match_data* data_ = nullptr;
};

const std::vector<std::string> kPatterns = {
    "abc",
    "a|b|cd",
    "(ab)*c+d?",
    "[a-z]{2,5}",
    "x{3}y{0,2}z{2,}",
    "\\d+(\\.\\d+)?([eE][-+]?\\d+)?",
    "-?(0|[1-9]\\d*)",
    "[^abc]+",
    "\\w+@\\w+\\.(com|org)",
    "\\s*\\S\\s*",
    "\\W\\D",
    ".*",
    "a.c",
    "(?:foo|foobar)(bar)?",
    "(?<year>\\d{4})-(?P<month>\\d{2})",
    "^[A-Z][a-z]*$",
    "\\A(a|b)*\\z",
    "[[:alpha:]_][[:alnum:]_]*",
    "[[:xdigit:]]{1,4}",
    "[\\x41-\\x43\\x{3b1}-\\x{3c9}]+",
    "[α-ω]+|[一-龥]{1,3}",
    "😀+[🌀-🗿]?",
    "\\x{1F600}|\\x{10FFFF}",
    "[\\-\\]\\\\^]+",
    "[]a]b",
    "a{,3}",
    "(a{2}){3}",
    "(a|ab)(c|bcd)(d*)",
    "(a*)*b",
    "\\t\\n\\r\\f\\v\\e\\a",
    "\\.\\*\\+\\?\\(\\)\\[\\{\\|\\$\\^",
    "a*?b+?c??",
    "[^\\d\\s]",
    "[\\w.-]+",
    "(\\d{1,3}\\.){3}\\d{1,3}",
    "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "()",
    "(|a)b",
    "[^\\n]*\\n",
};

// Characters the random strings draw from: what the patterns use plus a few others.
const std::vector<std::string> kAlphabet = {"a", "b", "c", "d", "x", "y", "z", "A", "Z", "0", "1", "9", ".", "-",
                                            "+", "e", "E", "_", "@", " ", "\t", "\n", "]", "^", "\\", "{", "}",
                                            "α", "ω", "一", "😀", "🌀", "\xF4\x8F\xBF\xBF", "o", "r", "m", "f"};

TEST(GrammarRegex, FullMatchAgreesWithPcre2) {
  std::mt19937_64 rng(1234);
  int positives = 0, total = 0;
  for (const std::string& pat : kPatterns) {
    SCOPED_TRACE(pat);
    const Pcre2 pcre(pat);
    const Grammar g = regex_grammar(pat);
    auto cg = CompiledGrammar::compile(g, byte_vocab());
    std::vector<std::string> cases = {""};
    for (int i = 0; i < 150; ++i) {
      std::string s;
      test::sample_expr(g, g.find("root")->body, rng, s);
      cases.push_back(s);
      // Near misses: one edit of a match.
      std::string t = s;
      const auto& ch = kAlphabet[rng() % kAlphabet.size()];
      const size_t at = t.empty() ? 0 : rng() % (t.size() + 1);
      switch (rng() % 3) {
        case 0: t.insert(at, ch); break;
        case 1: if (at < t.size()) t.erase(at, 1); break;
        default: if (at < t.size()) t.replace(at, 1, ch); break;
      }
      cases.push_back(t);
      std::string r;
      for (size_t n = rng() % 6; n > 0; --n) r += kAlphabet[rng() % kAlphabet.size()];
      cases.push_back(r);
    }
    for (const std::string& s : cases) {
      const bool want = pcre.full_match(s);
      ASSERT_EQ(full_match(cg, s), want) << "string \"" << s << "\"";
      positives += want;
      ++total;
    }
  }
  // The samples must hit both sides often, or the comparison says little.
  EXPECT_GT(positives, total / 3);
  EXPECT_LT(positives, total * 9 / 10);
}

TEST(GrammarRegex, RefusedFeaturesNameThemselves) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"(a)\\1", "backreference"},      {"(?=a)a", "lookaround"},     {"(?<!a)b", "lookaround"},
      {"\\bword", "word boundaries"},   {"a++", "possessive"},        {"(?>a)", "atomic"},
      {"(?i)abc", "inline flags"},      {"\\p{L}", "Unicode properties"}, {"a^b", "'^'"},
      {"a$b", "'$'"},                   {"(ab", "missing ')'"},       {"ab)", "unbalanced"},
      {"[ab", "unterminated"},          {"a**", "repeatable"},          {"*a", "without an operand"}, {"[z-a]", "out of order"},
      {"\\q", "unknown escape"},        {"\\x{D800}", "scalar"},      {"[[:foo:]]", "POSIX"},
      {std::string(300, '(') + "a" + std::string(300, ')'), "nested too deeply"},
  };
  for (const auto& [pat, what] : cases) {
    try {
      regex_to_expr(pat);
      ADD_FAILURE() << pat << " accepted";
    } catch (const GrammarError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << pat << ": " << e.what();
    }
  }
}

TEST(GrammarRegex, JsonStringBodyEscapes) {
  // The regex applies to the decoded string; the grammar writes its JSON escapes.
  RegexOptions o;
  o.json_string_body = true;
  Grammar g;
  g.set_rule("root", seq({lit("\""), regex_to_expr("[\"\\\\\\n\\x01a]+", o), lit("\"")}));
  auto cg = CompiledGrammar::compile(g, byte_vocab());
  EXPECT_TRUE(full_match(cg, R"("a\"\\\n\u0001")"));
  EXPECT_FALSE(full_match(cg, "\"a\"a\""));
  EXPECT_FALSE(full_match(cg, "\"\n\""));
  EXPECT_FALSE(full_match(cg, "\"b\""));
}

TEST(GrammarRegex, MaskEqualsBruteForceOnVocabulary) {
  auto cg = CompiledGrammar::compile(regex_grammar("(\\d{3}-)?\\d{3}-\\d{4}|[A-Za-z ]{1,20}\\.|(\\w+ ){2,4}\\w+\\?"),
                                     test::v3_vocab());
  std::mt19937_64 rng(5);
  std::vector<uint32_t> mask(cg->vocab().mask_words());
  const int32_t n = cg->vocab().mask_size();
  for (int walk = 0; walk < 3; ++walk) {
    GrammarMatcher m(cg);
    for (int step = 0; step < 10 && !m.is_terminated(); ++step) {
      m.fill_mask(mask);
      const auto ids = test::allowed_ids(mask, n);
      ASSERT_EQ(ids, test::allowed_ids(test::brute_force_mask(m), n));
      ASSERT_FALSE(ids.empty());
      ASSERT_TRUE(m.accept_token(ids[rng() % ids.size()]));
    }
  }
}

}  // namespace
}  // namespace di::grammar
