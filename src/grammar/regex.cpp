#include "grammar/regex.h"

#include <algorithm>
#include <cctype>
#include <cstdio>

namespace di::grammar {

namespace {

std::vector<CodeRange> digit_ranges() { return {{'0', '9'}}; }
std::vector<CodeRange> word_ranges() { return {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}; }
std::vector<CodeRange> space_ranges() { return {{'\t', '\r'}, {' ', ' '}}; }  // \t \n \v \f \r and space

// The JSON encoding of one decoded code point class: plain characters as themselves, the rest as
// escapes (as are the `escaped` code points).
Expr json_class(const std::vector<CodeRange>& class_ranges, const std::vector<uint32_t>& escaped) {
  std::vector<CodeRange> plain;
  std::vector<Expr> alts;
  std::vector<CodeRange> ranges = class_ranges;
  for (uint32_t e : escaped) {
    std::vector<CodeRange> without;
    for (CodeRange r : ranges) {
      if (e < r.lo || e > r.hi) {
        without.push_back(r);
        continue;
      }
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", e);
      alts.push_back(lit(buf));
      if (e > r.lo) without.push_back({r.lo, e - 1});
      if (e < r.hi) without.push_back({e + 1, r.hi});
    }
    ranges = std::move(without);
  }
  for (CodeRange r : ranges) {
    for (uint32_t c = r.lo; c <= r.hi && c < 0x20; ++c) {
      static const char* kShort[] = {"b", "t", "n", nullptr, "f", "r"};
      if (c >= 8 && c <= 13 && kShort[c - 8] != nullptr) {
        alts.push_back(lit(std::string("\\") + kShort[c - 8]));
      } else {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        alts.push_back(lit(buf));
      }
    }
    auto add_plain = [&](uint32_t lo, uint32_t hi) {
      lo = std::max<uint32_t>(lo, 0x20);
      if (lo <= hi) plain.push_back({lo, hi});
    };
    // Split around " and \.
    uint32_t lo = r.lo;
    for (uint32_t special : {static_cast<uint32_t>('"'), static_cast<uint32_t>('\\')}) {
      if (special >= lo && special <= r.hi) {
        if (special > lo) add_plain(lo, special - 1);
        alts.push_back(lit(special == '"' ? "\\\"" : "\\\\"));
        lo = special + 1;
      }
    }
    if (lo <= r.hi) add_plain(lo, r.hi);
  }
  if (!plain.empty()) alts.insert(alts.begin(), cls(plain));
  return alt(std::move(alts));
}

class RegexParser {
 public:
  RegexParser(std::string_view p, const RegexOptions& opt) : s_(p), opt_(opt) {}

  Expr parse() {
    if (pos_ < s_.size() && s_[pos_] == '^') ++pos_;
    else if (s_.substr(pos_, 2) == "\\A") pos_ += 2;
    Expr e = parse_alt(0);
    if (pos_ != s_.size()) fail("unbalanced ')'");
    return e;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw GrammarError("regex at offset " + std::to_string(pos_) + ": " + what);
  }

  bool at_end_anchor() const {
    // $ \z \Z end the pattern, or close a group at its very end.
    std::string_view rest = s_.substr(pos_);
    size_t n = rest.size() >= 2 && (rest.substr(0, 2) == "\\z" || rest.substr(0, 2) == "\\Z") ? 2
               : !rest.empty() && rest[0] == '$'                                               ? 1
                                                                                               : 0;
    if (n == 0) return false;
    for (char c : rest.substr(n)) {
      if (c != ')') return false;
    }
    return true;
  }

  Expr char_expr(std::vector<CodeRange> ranges, bool negated = false) {
    Expr c = cls(std::move(ranges), negated);
    if (c.ranges.empty()) fail("character class matches nothing");
    return opt_.json_string_body ? json_class(c.ranges, opt_.escaped_code_points) : c;
  }

  Expr parse_alt(int depth) {
    std::vector<Expr> alts;
    alts.push_back(parse_seq(depth));
    while (pos_ < s_.size() && s_[pos_] == '|') {
      ++pos_;
      alts.push_back(parse_seq(depth));
    }
    return alts.size() == 1 ? std::move(alts[0]) : alt(std::move(alts));
  }

  Expr parse_seq(int depth) {
    std::vector<Expr> items;
    while (pos_ < s_.size() && s_[pos_] != '|' && !(s_[pos_] == ')' && depth > 0)) {
      if (s_[pos_] == ')') break;
      if (at_end_anchor()) {
        pos_ += s_[pos_] == '$' ? 1 : 2;
        continue;
      }
      items.push_back(parse_quantified(depth));
    }
    return seq(std::move(items));
  }

  bool parse_count(int& out) {
    const size_t b = pos_;
    long v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      v = v * 10 + (s_[pos_] - '0');
      if (v > 100000) fail("repetition count too large (at most 100000)");
      ++pos_;
    }
    out = static_cast<int>(v);
    return pos_ > b;
  }

  // {n}, {n,}, {n,m}; anything else is a literal '{' (as PCRE reads it).
  bool parse_braces(int& lo, int& hi) {
    const size_t save = pos_;
    ++pos_;
    if (!parse_count(lo)) {
      pos_ = save;
      return false;
    }
    hi = lo;
    if (pos_ < s_.size() && s_[pos_] == ',') {
      ++pos_;
      if (!parse_count(hi)) hi = Expr::kUnbounded;
    }
    if (pos_ >= s_.size() || s_[pos_] != '}') {
      pos_ = save;
      return false;
    }
    ++pos_;
    if (hi != Expr::kUnbounded && hi < lo) fail("repetition {n,m} with m < n");
    return true;
  }

  Expr parse_quantified(int depth) {
    Expr e = parse_atom(depth);
    int lo, hi;
    if (!parse_quantifier(lo, hi)) return e;
    if (pos_ < s_.size() && s_[pos_] == '+') fail("possessive quantifiers are not supported");
    if (pos_ < s_.size() && s_[pos_] == '?') ++pos_;  // lazy: same language under full match
    int lo2, hi2;
    if (parse_quantifier(lo2, hi2)) fail("quantifier does not follow a repeatable item");
    return repeat(std::move(e), lo, hi);
  }

  bool parse_quantifier(int& lo, int& hi) {
    if (pos_ >= s_.size()) return false;
    switch (s_[pos_]) {
      case '*': lo = 0, hi = Expr::kUnbounded, ++pos_; return true;
      case '+': lo = 1, hi = Expr::kUnbounded, ++pos_; return true;
      case '?': lo = 0, hi = 1, ++pos_; return true;
      case '{': return parse_braces(lo, hi);
      default: return false;
    }
  }

  uint32_t parse_hex_digits(size_t min_digits, size_t max_digits) {
    uint32_t v = 0;
    size_t n = 0;
    while (n < max_digits && pos_ < s_.size() && std::isxdigit(static_cast<unsigned char>(s_[pos_]))) {
      const char c = s_[pos_++];
      v = v * 16 + static_cast<uint32_t>(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
      if (v > kMaxCodePoint) fail("code point out of range");
      ++n;
    }
    if (n < min_digits) fail("bad hex escape");
    return v;
  }

  void check_scalar(uint32_t cp) {
    if (cp > kMaxCodePoint || (cp >= 0xD800 && cp <= 0xDFFF)) fail("escape is not a Unicode scalar value");
  }

  // After '\': a class shorthand (ranges, returns true) or one code point (returns false).
  bool parse_escape(std::vector<CodeRange>& ranges, bool& negated, uint32_t& cp, bool in_class) {
    if (pos_ >= s_.size()) fail("trailing backslash");
    const char c = s_[pos_++];
    negated = false;
    switch (c) {
      case 'd': ranges = digit_ranges(); return true;
      case 'D': ranges = digit_ranges(); negated = true; return true;
      case 'w': ranges = word_ranges(); return true;
      case 'W': ranges = word_ranges(); negated = true; return true;
      case 's': ranges = space_ranges(); return true;
      case 'S': ranges = space_ranges(); negated = true; return true;
      case 'n': cp = '\n'; return false;
      case 'r': cp = '\r'; return false;
      case 't': cp = '\t'; return false;
      case 'f': cp = '\f'; return false;
      case 'v': cp = '\v'; return false;
      case 'a': cp = 7; return false;
      case 'e': cp = 27; return false;
      case '0': cp = 0; return false;
      case 'x':
        if (pos_ < s_.size() && s_[pos_] == '{') {
          ++pos_;
          cp = parse_hex_digits(1, 8);
          if (pos_ >= s_.size() || s_[pos_] != '}') fail("bad \\x{...} escape");
          ++pos_;
        } else {
          cp = parse_hex_digits(0, 2);
        }
        check_scalar(cp);
        return false;
      case 'u':
        cp = parse_hex_digits(4, 4);
        check_scalar(cp);
        return false;
      case 'b':
        if (in_class) {
          cp = 8;
          return false;
        }
        fail("word boundaries (\\b) are not supported");
      case 'B': fail("word boundaries (\\B) are not supported");
      case 'p': case 'P': fail("Unicode properties (\\p{...}) are not supported");
      case 'k': case 'g': fail("backreferences are not supported");
      default: break;
    }
    if (c >= '1' && c <= '9') fail("backreferences are not supported");
    if (std::isalnum(static_cast<unsigned char>(c))) fail(std::string("unknown escape \\") + c);
    cp = static_cast<uint8_t>(c);
    if (cp >= 0x80) fail("escaped non-ASCII byte");
    return false;
  }

  uint32_t parse_utf8_char() {
    const uint8_t c = static_cast<uint8_t>(s_[pos_]);
    const int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || pos_ + len > s_.size()) fail("invalid UTF-8");
    uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
    for (int i = 1; i < len; ++i) {
      const uint8_t cc = static_cast<uint8_t>(s_[pos_ + i]);
      if ((cc & 0xC0) != 0x80) fail("invalid UTF-8");
      cp = (cp << 6) | (cc & 0x3F);
    }
    pos_ += len;
    check_scalar(cp);
    return cp;
  }

  bool parse_posix(std::vector<CodeRange>& out) {
    if (s_.substr(pos_, 2) != "[:") return false;
    const size_t end = s_.find(":]", pos_ + 2);
    if (end == std::string_view::npos) return false;
    std::string_view name = s_.substr(pos_ + 2, end - pos_ - 2);
    bool negate = false;
    if (!name.empty() && name[0] == '^') {
      negate = true;
      name.remove_prefix(1);
    }
    std::vector<CodeRange> r;
    if (name == "alpha") r = {{'A', 'Z'}, {'a', 'z'}};
    else if (name == "digit") r = digit_ranges();
    else if (name == "alnum") r = {{'0', '9'}, {'A', 'Z'}, {'a', 'z'}};
    else if (name == "upper") r = {{'A', 'Z'}};
    else if (name == "lower") r = {{'a', 'z'}};
    else if (name == "space") r = space_ranges();
    else if (name == "xdigit") r = {{'0', '9'}, {'A', 'F'}, {'a', 'f'}};
    else if (name == "word") r = word_ranges();
    else if (name == "punct") r = {{'!', '/'}, {':', '@'}, {'[', '`'}, {'{', '~'}};
    else fail("unknown POSIX class [:" + std::string(name) + ":]");
    if (negate) r = normalize_ranges(r, true);
    out.insert(out.end(), r.begin(), r.end());
    pos_ = end + 2;
    return true;
  }

  Expr parse_class() {
    ++pos_;  // [
    bool negated = false;
    if (pos_ < s_.size() && s_[pos_] == '^') {
      negated = true;
      ++pos_;
    }
    std::vector<CodeRange> ranges;
    bool first = true;
    for (;;) {
      if (pos_ >= s_.size()) fail("unterminated character class");
      if (s_[pos_] == ']' && !first) {
        ++pos_;
        break;
      }
      first = false;
      if (parse_posix(ranges)) continue;
      uint32_t lo;
      if (s_[pos_] == '\\') {
        ++pos_;
        std::vector<CodeRange> sh;
        bool neg;
        if (parse_escape(sh, neg, lo, true)) {
          if (neg) sh = normalize_ranges(sh, true);
          ranges.insert(ranges.end(), sh.begin(), sh.end());
          continue;
        }
      } else {
        lo = parse_utf8_char();
      }
      uint32_t hi = lo;
      if (pos_ + 1 < s_.size() && s_[pos_] == '-' && s_[pos_ + 1] != ']') {
        ++pos_;
        if (s_[pos_] == '\\') {
          ++pos_;
          std::vector<CodeRange> sh;
          bool neg;
          if (parse_escape(sh, neg, hi, true)) fail("class shorthand as a range end");
        } else {
          hi = parse_utf8_char();
        }
        if (hi < lo) fail("character class range out of order");
      }
      ranges.push_back({lo, hi});
    }
    return char_expr(std::move(ranges), negated);
  }

  Expr parse_atom(int depth) {
    const char c = s_[pos_];
    switch (c) {
      case '(': {
        ++pos_;
        if (s_.substr(pos_, 2) == "?:") {
          pos_ += 2;
        } else if (s_.substr(pos_, 2) == "?<" && pos_ + 2 < s_.size() && s_[pos_ + 2] != '=' && s_[pos_ + 2] != '!') {
          pos_ = s_.find('>', pos_);
          if (pos_ == std::string_view::npos) fail("unterminated group name");
          ++pos_;
        } else if (s_.substr(pos_, 3) == "?P<") {
          pos_ = s_.find('>', pos_);
          if (pos_ == std::string_view::npos) fail("unterminated group name");
          ++pos_;
        } else if (pos_ < s_.size() && s_[pos_] == '?') {
          const std::string_view kind = s_.substr(pos_, 3);
          if (kind.substr(0, 2) == "?=" || kind.substr(0, 2) == "?!" || kind == "?<=" || kind == "?<!") {
            fail("lookaround assertions are not supported");
          }
          if (kind.substr(0, 2) == "?>") fail("atomic groups are not supported");
          fail("inline flags and other (?...) groups are not supported");
        }
        if (depth + 1 > 200) fail("groups nested too deeply");  // bounds the recursion on untrusted input
        Expr e = parse_alt(depth + 1);
        if (pos_ >= s_.size() || s_[pos_] != ')') fail("missing ')'");
        ++pos_;
        return e;
      }
      case '[': return parse_class();
      case '.': ++pos_; return char_expr({{'\n', '\n'}}, true);
      case '^': fail("'^' is only supported at the start of the pattern");
      case '$': fail("'$' is only supported at the end of the pattern");
      case '*': case '+': case '?': fail("quantifier without an operand");
      case '\\': {
        ++pos_;
        if (s_.substr(pos_, 1) == "A") fail("\\A is only supported at the start of the pattern");
        if (s_.substr(pos_, 1) == "z" || s_.substr(pos_, 1) == "Z") fail("\\z / \\Z are only supported at the end");
        std::vector<CodeRange> ranges;
        bool negated;
        uint32_t cp;
        if (parse_escape(ranges, negated, cp, false)) return char_expr(std::move(ranges), negated);
        return code_point(cp);
      }
      default: {
        return code_point(parse_utf8_char());
      }
    }
  }

  Expr code_point(uint32_t cp) {
    if (opt_.json_string_body) return json_class({{cp, cp}}, opt_.escaped_code_points);
    std::string b;
    append_utf8(b, cp);
    return lit(b);
  }

  std::string_view s_;
  RegexOptions opt_;
  size_t pos_ = 0;
};

}  // namespace

Expr regex_to_expr(std::string_view pattern, const RegexOptions& opt) { return RegexParser(pattern, opt).parse(); }

Grammar regex_grammar(std::string_view pattern) {
  Grammar g;
  g.set_rule("root", regex_to_expr(pattern));
  return g;
}

}  // namespace di::grammar
