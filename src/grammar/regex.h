// Regular expressions (a PCRE subset, full-match semantics) as grammar expressions.
//
// Supported: literals and escapes (\n \r \t \f \v \a \e \0 \xHH \x{H...} \uHHHH, escaped
// punctuation), . (any code point but \n), classes [...] with ranges, negation, \d \w \s \D \W \S
// (ASCII meanings, as PCRE2 without UCP) and POSIX [:name:], groups ( ), (?: ), (?<name> ),
// (?P<name> ), alternation, quantifiers * + ? {n} {n,} {n,m} and their lazy forms, ^ / \A at the
// start and $ / \z / \Z at the end. Anything else (backreferences, lookaround, \b, possessive or
// atomic groups, inline flags, \p{...}) is refused with a GrammarError naming it.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "grammar/grammar.h"

namespace di::grammar {

struct RegexOptions {
  // Match the regex against the decoded value of a JSON string: the expression then produces the
  // string's JSON-escaped body (", \ and control characters as escapes), without the quotes.
  bool json_string_body = false;
  // With json_string_body: code points written only as \uXXXX escapes.
  std::vector<uint32_t> escaped_code_points;
};

Expr regex_to_expr(std::string_view pattern, const RegexOptions& opt = {});
// root ::= the regex.
Grammar regex_grammar(std::string_view pattern);

}  // namespace di::grammar
