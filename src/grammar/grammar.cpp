#include "grammar/grammar.h"

#include <algorithm>
#include <cstdio>

namespace di::grammar {

Expr empty() { return Expr{}; }

Expr lit(std::string_view bytes) {
  if (bytes.empty()) return empty();
  Expr e;
  e.kind = Expr::Kind::kBytes;
  e.text = std::string(bytes);
  return e;
}

std::vector<CodeRange> normalize_ranges(std::vector<CodeRange> ranges, bool negated) {
  std::vector<CodeRange> clipped;
  // Surrogates are not scalar values: they have no UTF-8 encoding.
  for (CodeRange r : ranges) {
    r.hi = std::min(r.hi, kMaxCodePoint);
    if (r.lo > r.hi) continue;
    if (r.lo < 0xD800 && r.hi >= 0xD800) {
      if (r.hi > 0xDFFF) clipped.push_back({0xE000, r.hi});
      r.hi = 0xD7FF;
    } else if (r.lo >= 0xD800 && r.lo <= 0xDFFF) {
      if (r.hi <= 0xDFFF) continue;
      r.lo = 0xE000;
    }
    clipped.push_back(r);
  }
  std::sort(clipped.begin(), clipped.end(), [](CodeRange a, CodeRange b) { return a.lo < b.lo; });
  std::vector<CodeRange> merged;
  for (CodeRange r : clipped) {
    if (!merged.empty() && r.lo <= merged.back().hi + 1) {
      merged.back().hi = std::max(merged.back().hi, r.hi);
    } else {
      merged.push_back(r);
    }
  }
  if (!negated) return merged;
  std::vector<CodeRange> out;
  uint32_t next = 0;
  for (CodeRange r : merged) {
    if (r.lo > next) out.push_back({next, r.lo - 1});
    next = r.hi + 1;
  }
  if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
  return normalize_ranges(std::move(out), false);
}

Expr cls(std::vector<CodeRange> ranges, bool negated) {
  Expr e;
  e.kind = Expr::Kind::kClass;
  e.ranges = normalize_ranges(std::move(ranges), negated);
  return e;
}

Expr rule_ref(std::string_view rule) {
  Expr e;
  e.kind = Expr::Kind::kRef;
  e.text = std::string(rule);
  return e;
}

Expr seq(std::vector<Expr> items) {
  Expr e;
  e.kind = Expr::Kind::kSeq;
  for (Expr& it : items) {
    if (it.kind == Expr::Kind::kEmpty) continue;
    if (it.kind == Expr::Kind::kSeq) {
      for (Expr& sub : it.items) e.items.push_back(std::move(sub));
    } else if (it.kind == Expr::Kind::kBytes && !e.items.empty() && e.items.back().kind == Expr::Kind::kBytes) {
      e.items.back().text += it.text;
    } else {
      e.items.push_back(std::move(it));
    }
  }
  if (e.items.empty()) return empty();
  if (e.items.size() == 1) return std::move(e.items[0]);
  return e;
}

Expr alt(std::vector<Expr> items) {
  Expr e;
  e.kind = Expr::Kind::kAlt;
  for (Expr& it : items) {
    if (it.kind == Expr::Kind::kAlt) {
      for (Expr& sub : it.items) e.items.push_back(std::move(sub));
    } else {
      e.items.push_back(std::move(it));
    }
  }
  if (e.items.empty()) throw GrammarError("empty alternation");
  if (e.items.size() == 1) return std::move(e.items[0]);
  return e;
}

Expr repeat(Expr inner, int min, int max) {
  if (min < 0 || (max != Expr::kUnbounded && max < min)) {
    throw GrammarError("bad repetition bounds {" + std::to_string(min) + "," + std::to_string(max) + "}");
  }
  if (max == 0 || inner.kind == Expr::Kind::kEmpty) return empty();
  if (min == 1 && max == 1) return inner;
  Expr e;
  e.kind = Expr::Kind::kRepeat;
  e.min = min;
  e.max = max;
  e.items.push_back(std::move(inner));
  return e;
}

void Grammar::set_rule(std::string name, Expr body) {
  for (Rule& r : rules_) {
    if (r.name == name) {
      r.body = std::move(body);
      return;
    }
  }
  rules_.push_back({std::move(name), std::move(body)});
}

const Rule* Grammar::find(std::string_view name) const {
  for (const Rule& r : rules_) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

std::string Grammar::fresh_name(std::string_view base) const {
  std::string name(base);
  for (int i = 1; find(name) != nullptr; ++i) name = std::string(base) + "-" + std::to_string(i);
  return name;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

namespace {

// ASCII that needs an escape is escaped; other bytes are written as they are (the parser copies
// raw bytes, so any byte string round-trips).
void append_escaped(std::string& out, uint8_t c, std::string_view specials) {
  switch (c) {
    case '\n': out += "\\n"; return;
    case '\r': out += "\\r"; return;
    case '\t': out += "\\t"; return;
    default: break;
  }
  if (c < 0x20 || c == 0x7F) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "\\x%02X", c);
    out += buf;
  } else {
    if (c == '\\' || specials.find(static_cast<char>(c)) != std::string_view::npos) out += '\\';
    out += static_cast<char>(c);
  }
}

void append_class_cp(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    append_escaped(out, static_cast<uint8_t>(cp), "]^-[");
  } else {
    char buf[16];
    std::snprintf(buf, sizeof buf, cp <= 0xFFFF ? "\\u%04X" : "\\U%08X", cp);
    out += buf;
  }
}

void print(const Expr& e, std::string& out, bool in_seq) {
  using K = Expr::Kind;
  switch (e.kind) {
    case K::kEmpty: out += "\"\""; break;
    case K::kBytes: out += quote_literal(e.text); break;
    case K::kClass:
      out += '[';
      for (CodeRange r : e.ranges) {
        append_class_cp(out, r.lo);
        if (r.hi != r.lo) {
          out += '-';
          append_class_cp(out, r.hi);
        }
      }
      out += ']';
      break;
    case K::kRef: out += e.text; break;
    case K::kSeq:
    case K::kAlt: {
      const bool paren = e.kind == K::kAlt ? in_seq : false;
      if (paren) out += "( ";
      for (size_t i = 0; i < e.items.size(); ++i) {
        if (i) out += e.kind == K::kAlt ? " | " : " ";
        const bool child_paren = e.kind == K::kSeq && e.items[i].kind == K::kSeq;
        if (child_paren) out += "( ";
        print(e.items[i], out, true);
        if (child_paren) out += " )";
      }
      if (paren) out += " )";
      break;
    }
    case K::kRepeat: {
      const Expr& in = e.items[0];
      const bool paren = in.kind == K::kSeq || in.kind == K::kAlt || in.kind == K::kRepeat;
      if (paren) out += "( ";
      print(in, out, false);
      if (paren) out += " )";
      if (e.min == 0 && e.max == Expr::kUnbounded) {
        out += '*';
      } else if (e.min == 1 && e.max == Expr::kUnbounded) {
        out += '+';
      } else if (e.min == 0 && e.max == 1) {
        out += '?';
      } else {
        out += '{' + std::to_string(e.min);
        if (e.max != e.min) out += ',' + (e.max == Expr::kUnbounded ? std::string() : std::to_string(e.max));
        out += '}';
      }
      break;
    }
  }
}

}  // namespace

std::string quote_literal(std::string_view bytes) {
  std::string out = "\"";
  for (char c : bytes) append_escaped(out, static_cast<uint8_t>(c), "\"");
  out += '"';
  return out;
}

std::string Grammar::to_ebnf() const {
  std::string out;
  for (const Rule& r : rules_) {
    out += r.name + " ::= ";
    print(r.body, out, false);
    out += '\n';
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Parser

namespace {

class Parser {
 public:
  explicit Parser(std::string_view text) : s_(text) {}

  Grammar parse(std::string_view root) {
    std::vector<Rule> rules;
    skip_space();
    while (pos_ < s_.size()) {
      const size_t at = pos_;
      std::string name = parse_name();
      if (name.empty()) fail("expected a rule name");
      skip_space();
      if (s_.substr(pos_, 3) != "::=") fail("expected '::=' after rule name '" + name + "'");
      pos_ += 3;
      for (const Rule& r : rules) {
        if (r.name == name) {
          pos_ = at;
          fail("rule '" + name + "' defined twice");
        }
      }
      Expr body = parse_alt();
      rules.push_back({std::move(name), std::move(body)});
      skip_space();
    }
    Grammar g(std::move(rules), std::string(root));
    if (g.find(root) == nullptr) throw GrammarError("grammar has no rule '" + std::string(root) + "' (the root)");
    for (const auto& [name, offset] : refs_) {
      if (g.find(name) == nullptr) {
        pos_ = offset;
        fail("undefined rule '" + name + "'");
      }
    }
    return g;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    int line = 1, col = 1;
    for (size_t i = 0; i < pos_ && i < s_.size(); ++i) {
      if (s_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    throw GrammarError("grammar " + std::to_string(line) + ":" + std::to_string(col) + ": " + what);
  }

  static bool name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  }

  void skip_space() {
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++pos_;
      } else if (c == '#') {
        while (pos_ < s_.size() && s_[pos_] != '\n') ++pos_;
      } else {
        break;
      }
    }
  }

  std::string parse_name() {
    const size_t b = pos_;
    while (pos_ < s_.size() && name_char(s_[pos_])) ++pos_;
    return std::string(s_.substr(b, pos_ - b));
  }

  // A name followed by '::=' starts the next rule.
  bool at_rule_start() {
    const size_t save = pos_;
    const std::string name = parse_name();
    skip_space();
    const bool yes = !name.empty() && s_.substr(pos_, 3) == "::=";
    pos_ = save;
    return yes;
  }

  Expr parse_alt() {
    std::vector<Expr> alts;
    alts.push_back(parse_seq());
    for (;;) {
      skip_space();
      if (pos_ < s_.size() && s_[pos_] == '|') {
        ++pos_;
        alts.push_back(parse_seq());
      } else {
        break;
      }
    }
    return alts.size() == 1 ? std::move(alts[0]) : alt(std::move(alts));
  }

  Expr parse_seq() {
    std::vector<Expr> items;
    for (;;) {
      skip_space();
      if (pos_ >= s_.size()) break;
      const char c = s_[pos_];
      if (c == '|' || c == ')') break;
      if (name_char(c) && at_rule_start()) break;
      items.push_back(parse_postfix());
    }
    return seq(std::move(items));
  }

  int parse_int() {
    const size_t b = pos_;
    long v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      v = v * 10 + (s_[pos_] - '0');
      if (v > 100000) fail("repetition count too large (at most 100000)");
      ++pos_;
    }
    if (pos_ == b) fail("expected a number");
    return static_cast<int>(v);
  }

  Expr parse_postfix() {
    Expr e = parse_atom();
    for (;;) {
      if (pos_ >= s_.size()) break;
      const char c = s_[pos_];
      if (c == '*') {
        ++pos_;
        e = star(std::move(e));
      } else if (c == '+') {
        ++pos_;
        e = plus(std::move(e));
      } else if (c == '?') {
        ++pos_;
        e = opt(std::move(e));
      } else if (c == '{') {
        ++pos_;
        skip_space();
        const int lo = parse_int();
        int hi = lo;
        skip_space();
        if (pos_ < s_.size() && s_[pos_] == ',') {
          ++pos_;
          skip_space();
          hi = pos_ < s_.size() && s_[pos_] == '}' ? Expr::kUnbounded : parse_int();
          skip_space();
        }
        if (pos_ >= s_.size() || s_[pos_] != '}') fail("expected '}'");
        ++pos_;
        if (hi != Expr::kUnbounded && hi < lo) fail("repetition {m,n} with n < m");
        e = repeat(std::move(e), lo, hi);
      } else {
        break;
      }
    }
    return e;
  }

  uint32_t parse_hex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      if (pos_ >= s_.size()) fail("truncated escape");
      const char c = s_[pos_++];
      int d;
      if (c >= '0' && c <= '9') {
        d = c - '0';
      } else if (c >= 'a' && c <= 'f') {
        d = c - 'a' + 10;
      } else if (c >= 'A' && c <= 'F') {
        d = c - 'A' + 10;
      } else {
        --pos_;
        fail("bad hex digit in escape");
      }
      v = v * 16 + d;
    }
    return v;
  }

  // After a backslash: the escaped code point.
  uint32_t parse_escape() {
    if (pos_ >= s_.size()) fail("truncated escape");
    const char c = s_[pos_++];
    switch (c) {
      case 'n': return '\n';
      case 'r': return '\r';
      case 't': return '\t';
      case '0': return 0;
      case 'x': return parse_hex(2);
      case 'u': return parse_hex(4);
      case 'U': return parse_hex(8);
      case '\\': case '"': case '\'': case '[': case ']': case '-': case '^': return static_cast<uint8_t>(c);
      default: --pos_; fail(std::string("unknown escape '\\") + c + "'");
    }
  }

  void check_scalar(uint32_t cp) {
    if (cp > kMaxCodePoint || (cp >= 0xD800 && cp <= 0xDFFF)) fail("escape is not a Unicode scalar value");
  }

  // One code point of a character class: an escape or one UTF-8 character.
  uint32_t parse_class_char() {
    const uint8_t c = static_cast<uint8_t>(s_[pos_]);
    if (c == '\\') {
      ++pos_;
      const uint32_t cp = parse_escape();
      check_scalar(cp);
      return cp;
    }
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || pos_ + len > s_.size()) fail("invalid UTF-8 in character class");
    uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
    for (int i = 1; i < len; ++i) {
      const uint8_t cc = static_cast<uint8_t>(s_[pos_ + i]);
      if ((cc & 0xC0) != 0x80) fail("invalid UTF-8 in character class");
      cp = (cp << 6) | (cc & 0x3F);
    }
    pos_ += len;
    check_scalar(cp);
    return cp;
  }

  Expr parse_atom() {
    const char c = s_[pos_];
    if (c == '"' || c == '\'') {
      const char quote = c;
      ++pos_;
      std::string bytes;
      for (;;) {
        if (pos_ >= s_.size()) fail("unterminated string literal");
        const char d = s_[pos_];
        if (d == quote) {
          ++pos_;
          break;
        }
        if (d == '\\') {
          ++pos_;
          const uint32_t cp = parse_escape();
          check_scalar(cp);
          append_utf8(bytes, cp);
        } else {
          bytes += d;
          ++pos_;
        }
      }
      return lit(bytes);
    }
    if (c == '[') {
      ++pos_;
      bool negated = false;
      if (pos_ < s_.size() && s_[pos_] == '^') {
        negated = true;
        ++pos_;
      }
      std::vector<CodeRange> ranges;
      for (;;) {
        if (pos_ >= s_.size()) fail("unterminated character class");
        if (s_[pos_] == ']') {
          ++pos_;
          break;
        }
        const uint32_t lo = parse_class_char();
        uint32_t hi = lo;
        if (pos_ + 1 < s_.size() && s_[pos_] == '-' && s_[pos_ + 1] != ']') {
          ++pos_;
          hi = parse_class_char();
          if (hi < lo) fail("character class range out of order");
        }
        ranges.push_back({lo, hi});
      }
      Expr e = cls(std::move(ranges), negated);
      if (e.ranges.empty()) fail("character class matches nothing");
      return e;
    }
    if (c == '.') {
      ++pos_;
      return cls({{0, kMaxCodePoint}});
    }
    if (c == '(') {
      ++pos_;
      if (++depth_ > kMaxNesting) fail("groups nested too deeply");
      Expr e = parse_alt();
      --depth_;
      skip_space();
      if (pos_ >= s_.size() || s_[pos_] != ')') fail("expected ')'");
      ++pos_;
      return e;
    }
    if (name_char(c)) {
      const size_t at = pos_;
      std::string name = parse_name();
      refs_.push_back({name, at});
      return rule_ref(name);
    }
    fail(std::string("unexpected character '") + c + "'");
  }

  static constexpr int kMaxNesting = 200;  // bounds the parser's recursion on untrusted input

  std::string_view s_;
  size_t pos_ = 0;
  int depth_ = 0;
  std::vector<std::pair<std::string, size_t>> refs_;
};

}  // namespace

Grammar parse_ebnf(std::string_view text, std::string_view root) { return Parser(text).parse(root); }

}  // namespace di::grammar
