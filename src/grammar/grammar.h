// Grammar: the EBNF-style grammar language (docs/structured-output.md) and its syntax tree.
//
// Everything that constrains decoding — EBNF text, JSON Schema, regex, tool-call formats — becomes
// a di::grammar::Grammar. The automaton compiler (automaton.h) turns it into one automaton per
// rule; the matcher runs a pushdown automaton over those.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace di::grammar {

// Every grammar, schema or regex problem the user can cause (the server answers it with a 400).
class GrammarError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Inclusive code point range.
struct CodeRange {
  uint32_t lo = 0, hi = 0;
  bool operator==(const CodeRange&) const = default;
};

struct Expr {
  enum class Kind : uint8_t {
    kEmpty,   // matches ""
    kBytes,   // the literal bytes in `text` (UTF-8 of the grammar's string)
    kClass,   // one code point out of `ranges` (sorted, disjoint), matched as its UTF-8 bytes
    kRef,     // the rule named `text`
    kSeq,     // items in order
    kAlt,     // one of items
    kRepeat,  // items[0] repeated min..max times (max == kUnbounded: no limit)
  };
  static constexpr int kUnbounded = -1;

  Kind kind = Kind::kEmpty;
  std::string text;
  std::vector<CodeRange> ranges;
  std::vector<Expr> items;
  int min = 0, max = 0;
};

// Builders. Seq/Alt flatten nested sequences/alternatives and drop empties where that keeps the
// meaning, so generated grammars stay small.
Expr empty();
Expr lit(std::string_view bytes);
Expr cls(std::vector<CodeRange> ranges, bool negated = false);  // normalizes (sorts, merges)
Expr rule_ref(std::string_view rule);
Expr seq(std::vector<Expr> items);
Expr alt(std::vector<Expr> items);
Expr repeat(Expr e, int min, int max);
inline Expr star(Expr e) { return repeat(std::move(e), 0, Expr::kUnbounded); }
inline Expr plus(Expr e) { return repeat(std::move(e), 1, Expr::kUnbounded); }
inline Expr opt(Expr e) { return repeat(std::move(e), 0, 1); }

// All Unicode scalar values (no surrogates).
inline constexpr uint32_t kMaxCodePoint = 0x10FFFF;
// Sorted, merged ranges; with `negated`, the complement within the scalar values.
std::vector<CodeRange> normalize_ranges(std::vector<CodeRange> ranges, bool negated);

struct Rule {
  std::string name;
  Expr body;
};

class Grammar {
 public:
  Grammar() = default;
  Grammar(std::vector<Rule> rules, std::string root) : rules_(std::move(rules)), root_(std::move(root)) {}

  // Adds or replaces a rule.
  void set_rule(std::string name, Expr body);
  const Rule* find(std::string_view name) const;
  const std::vector<Rule>& rules() const { return rules_; }
  const std::string& root() const { return root_; }
  void set_root(std::string root) { root_ = std::move(root); }
  // Rule name not used yet, starting with `base`.
  std::string fresh_name(std::string_view base) const;

  // EBNF text that parse_ebnf reads back to the same grammar.
  std::string to_ebnf() const;

 private:
  std::vector<Rule> rules_;
  std::string root_ = "root";
};

// Parses the grammar language. Throws GrammarError with line:column on bad syntax, an undefined
// rule or a missing root. Left recursion and empty languages are found by the automaton compiler.
Grammar parse_ebnf(std::string_view text, std::string_view root = "root");

// Appends the UTF-8 bytes of code point `cp`.
void append_utf8(std::string& out, uint32_t cp);
// Quotes bytes as a grammar string literal (escapes ", \, controls; invalid UTF-8 as \xHH bytes).
std::string quote_literal(std::string_view bytes);

}  // namespace di::grammar
