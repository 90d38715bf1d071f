#include "grammar/json_schema.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "grammar/regex.h"

namespace di::grammar {

namespace {

using json = nlohmann::ordered_json;

Expr ws_expr(const JsonSchemaOptions& opt) {
  return opt.any_whitespace ? star(cls({{' ', ' '}, {'\t', '\t'}, {'\n', '\n'}, {'\r', '\r'}})) : empty();
}

// One character of a JSON string: unescaped (not one of `escaped`), or an escape (\uXXXX only
// for non-surrogates, so every string is valid Unicode and its length in code points is its
// number of characters).
Expr json_char(const std::vector<uint32_t>& escaped) {
  const Expr hex = cls({{'0', '9'}, {'A', 'F'}, {'a', 'f'}});
  const Expr u_escape = alt({seq({cls({{'0', '9'}, {'A', 'C'}, {'a', 'c'}, {'E', 'F'}, {'e', 'f'}}), hex, hex, hex}),
                             seq({cls({{'D', 'D'}, {'d', 'd'}}), cls({{'0', '7'}}), hex, hex})});
  std::vector<CodeRange> not_plain = {{'"', '"'}, {'\\', '\\'}, {0, 0x1F}};
  for (uint32_t c : escaped) not_plain.push_back({c, c});
  return alt({cls(not_plain, true),
              seq({lit("\\"), alt({cls({{'"', '"'}, {'\\', '\\'}, {'/', '/'}, {'b', 'b'}, {'f', 'f'}, {'n', 'n'},
                                        {'r', 'r'}, {'t', 't'}}),
                                   seq({lit("u"), u_escape})})})});
}

Expr digits(int min, int max = Expr::kUnbounded) { return repeat(cls({{'0', '9'}}), min, max); }
Expr int_body() { return alt({lit("0"), seq({cls({{'1', '9'}}), digits(0)})}); }

void add_rule_once(Grammar& g, const std::string& name, const std::function<Expr()>& body) {
  if (g.find(name) == nullptr) g.set_rule(name, body());
}

// ---- integer ranges as digit patterns -------------------------------------------------------------

// Decimal strings of equal length from lo to hi (lo <= hi).
Expr fixed_len_range(const std::string& lo, const std::string& hi) {
  if (lo.empty()) return empty();
  if (lo == hi) return lit(lo);
  const size_t n = lo.size();
  if (lo[0] == hi[0]) return seq({lit(lo.substr(0, 1)), fixed_len_range(lo.substr(1), hi.substr(1))});
  const bool lo_rest_zero = lo.find_first_not_of('0', 1) == std::string::npos;
  const bool hi_rest_nine = hi.find_first_not_of('9', 1) == std::string::npos;
  std::vector<Expr> alts;
  char mid_lo = lo[0], mid_hi = hi[0];
  if (!lo_rest_zero) {
    alts.push_back(seq({lit(lo.substr(0, 1)), fixed_len_range(lo.substr(1), std::string(n - 1, '9'))}));
    ++mid_lo;
  }
  if (!hi_rest_nine) --mid_hi;
  if (mid_lo <= mid_hi) alts.push_back(seq({cls({{static_cast<uint32_t>(mid_lo), static_cast<uint32_t>(mid_hi)}}), digits(static_cast<int>(n - 1), static_cast<int>(n - 1))}));
  if (!hi_rest_nine) alts.push_back(seq({lit(hi.substr(0, 1)), fixed_len_range(std::string(n - 1, '0'), hi.substr(1))}));
  return alt(std::move(alts));
}

uint64_t pow10_or_max(size_t n) {
  uint64_t p = 1;
  for (size_t i = 0; i < n; ++i) {
    if (p > std::numeric_limits<uint64_t>::max() / 10) return std::numeric_limits<uint64_t>::max();
    p *= 10;
  }
  return p;
}

// Non-negative integers in [lo, hi] (hi empty: no upper bound), without leading zeros.
Expr nonneg_int_range(uint64_t lo, std::optional<uint64_t> hi) {
  const size_t lo_len = std::to_string(lo).size();
  const size_t hi_len = hi ? std::to_string(*hi).size() : lo_len;
  std::vector<Expr> alts;
  for (size_t len = lo_len; len <= hi_len; ++len) {
    const uint64_t len_lo = len == 1 ? 0 : pow10_or_max(len - 1);
    const uint64_t len_max = pow10_or_max(len);
    const uint64_t len_hi = len_max == std::numeric_limits<uint64_t>::max() ? len_max : len_max - 1;
    const uint64_t a = std::max(lo, len_lo);
    const uint64_t b = hi ? std::min(*hi, len_hi) : len_hi;
    if (a <= b) alts.push_back(fixed_len_range(std::to_string(a), std::to_string(b)));
  }
  if (!hi) alts.push_back(seq({cls({{'1', '9'}}), digits(static_cast<int>(lo_len))}));  // longer than lo
  return alt(std::move(alts));
}

// Integers in [lo, hi], either side open.
Expr int_range(std::optional<int64_t> lo, std::optional<int64_t> hi) {
  if (lo && hi && *lo > *hi) throw GrammarError("integer range is empty");
  std::vector<Expr> alts;
  if (!hi || *hi >= 0) {
    const uint64_t a = lo && *lo > 0 ? static_cast<uint64_t>(*lo) : 0;
    alts.push_back(nonneg_int_range(a, hi ? std::optional<uint64_t>(static_cast<uint64_t>(*hi)) : std::nullopt));
  }
  if (!lo || *lo < 0) {
    // Negative values: magnitudes from max(1, -hi) to -lo.
    const uint64_t mlo = hi && *hi < 0 ? static_cast<uint64_t>(-(*hi + 1)) + 1 : 1;
    std::optional<uint64_t> mhi;
    if (lo) mhi = static_cast<uint64_t>(-(*lo + 1)) + 1;
    alts.push_back(seq({lit("-"), nonneg_int_range(mlo, mhi)}));
  }
  return alt(std::move(alts));
}

// ---- the compiler ---------------------------------------------------------------------------------

const std::set<std::string>& annotation_keywords() {
  static const std::set<std::string> k = {"$schema", "$id", "$comment", "title", "description", "default", "examples",
                                          "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
                                          "contentEncoding", "contentMediaType", "$anchor"};
  return k;
}

const std::set<std::string>& supported_keywords() {
  static const std::set<std::string> k = {
      "type",          "enum",          "const",    "anyOf",     "oneOf",     "allOf",
      "$ref",          "properties",    "required", "additionalProperties", "items", "prefixItems",
      "additionalItems", "minItems",    "maxItems", "minLength", "maxLength", "pattern",
      "format",        "minimum",       "maximum",  "exclusiveMinimum", "exclusiveMaximum", "uniqueItems"};
  return k;
}

std::string sanitize(std::string_view s) {
  std::string out;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
    out += ok ? c : '-';
  }
  return out;
}

class SchemaCompiler {
 public:
  SchemaCompiler(Grammar& g, const json& root, const JsonSchemaOptions& opt, std::string prefix)
      : g_(g), root_(root), opt_(opt), prefix_(std::move(prefix)) {}

  // Defines a rule for the root schema; returns its name.
  std::string compile(const std::string& name) {
    refs_["#"] = name;
    g_.set_rule(name, empty());
    g_.set_rule(name, gen(root_, ""));
    return name;
  }

 private:
  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw GrammarError("JSON schema at '" + (path.empty() ? std::string("#") : "#" + path) + "': " + what);
  }

  std::string new_rule_name(const std::string& base) { return g_.fresh_name(prefix_ + sanitize(base)); }

  Expr ws() const { return ws_expr(opt_); }

  // Compact JSON text of a literal value; all non-ASCII escaped when some code points must be.
  std::string dump(const json& v) const { return v.dump(-1, ' ', !opt_.escaped_code_points.empty()); }

  Expr any_value() {
    add_json_rules(g_, opt_);
    return rule_ref("json-value");
  }

  const json& resolve(const std::string& ref, const std::string& path) {
    if (ref.empty() || ref[0] != '#') fail(path, "only local $refs (\"#...\") are supported, not '" + ref + "'");
    if (ref == "#") return root_;
    if (ref[1] != '/') fail(path, "$ref anchors are not supported ('" + ref + "')");
    const json* cur = &root_;
    size_t pos = 2;
    while (pos <= ref.size()) {
      size_t end = ref.find('/', pos);
      if (end == std::string::npos) end = ref.size();
      std::string token = ref.substr(pos, end - pos);
      for (size_t i; (i = token.find("~1")) != std::string::npos;) token.replace(i, 2, "/");
      for (size_t i; (i = token.find("~0")) != std::string::npos;) token.replace(i, 2, "~");
      if (cur->is_object() && cur->contains(token)) {
        cur = &(*cur)[token];
      } else if (cur->is_array() && !token.empty() && token.find_first_not_of("0123456789") == std::string::npos &&
                 std::stoul(token) < cur->size()) {
        cur = &(*cur)[std::stoul(token)];
      } else {
        fail(path, "$ref '" + ref + "' does not resolve");
      }
      pos = end + 1;
    }
    return *cur;
  }

  Expr gen_ref(const std::string& ref, const std::string& path) {
    if (auto it = refs_.find(ref); it != refs_.end()) return rule_ref(it->second);
    const json& target = resolve(ref, path);
    const std::string name = new_rule_name(ref.size() > 2 ? ref.substr(2) : "root");
    refs_[ref] = name;
    g_.set_rule(name, empty());  // reserve the name; recursion refers to it
    g_.set_rule(name, gen(target, ref.substr(1)));
    return rule_ref(name);
  }

  static bool has_only(const json& s, std::initializer_list<const char*> allowed) {
    for (const auto& [k, v] : s.items()) {
      if (annotation_keywords().count(k)) continue;
      bool ok = false;
      for (const char* a : allowed) ok |= k == a;
      if (!ok) return false;
    }
    return true;
  }

  Expr gen(const json& s, const std::string& path) {
    // Bounds the recursion on untrusted schemas ($ref cycles end at rules, not here).
    struct Depth {
      int& d;
      explicit Depth(int& v) : d(++v) {}
      ~Depth() { --d; }
    } guard(depth_);
    if (depth_ > 100) fail(path, "schema nested too deeply (more than 100 levels)");
    if (s.is_boolean()) {
      if (!s.get<bool>()) fail(path, "the schema 'false' allows no value");
      return any_value();
    }
    if (!s.is_object()) fail(path, "a schema must be an object or a boolean");
    for (const auto& [k, v] : s.items()) {
      if (!annotation_keywords().count(k) && !supported_keywords().count(k)) fail(path, "unsupported keyword '" + k + "'");
    }
    if (s.contains("$ref")) {
      if (!has_only(s, {"$ref"})) fail(path, "$ref next to other constraining keywords is not supported");
      if (!s["$ref"].is_string()) fail(path, "$ref must be a string");
      return gen_ref(s["$ref"].get<std::string>(), path);
    }
    if (s.contains("const")) return lit(dump(s["const"]));
    if (s.contains("enum")) {
      if (!s["enum"].is_array() || s["enum"].empty()) fail(path, "enum must be a non-empty array");
      std::vector<Expr> alts;
      for (const json& v : s["enum"]) alts.push_back(lit(dump(v)));
      return alt(std::move(alts));
    }
    for (const char* comb : {"anyOf", "oneOf"}) {
      if (!s.contains(comb)) continue;
      if (!has_only(s, {comb})) fail(path, std::string(comb) + " next to other constraining keywords is not supported");
      const json& list = s[comb];
      if (!list.is_array() || list.empty()) fail(path, std::string(comb) + " must be a non-empty array");
      std::vector<Expr> alts;
      for (size_t i = 0; i < list.size(); ++i) alts.push_back(gen(list[i], path + "/" + comb + "/" + std::to_string(i)));
      return alt(std::move(alts));
    }
    if (s.contains("allOf")) {
      const json& list = s["allOf"];
      if (!list.is_array() || list.size() != 1 || !has_only(s, {"allOf"})) {
        fail(path, "allOf is supported only with a single schema and no other constraining keywords");
      }
      return gen(list[0], path + "/allOf/0");
    }

    std::vector<std::string> types;
    if (s.contains("type")) {
      if (s["type"].is_string()) {
        types.push_back(s["type"].get<std::string>());
      } else if (s["type"].is_array()) {
        for (const json& t : s["type"]) types.push_back(t.get<std::string>());
      } else {
        fail(path, "type must be a string or an array");
      }
    } else {
      // Generate only the types the keywords are about (a subset of what validates).
      auto any_of = [&](std::initializer_list<const char*> keys) {
        for (const char* k : keys) {
          if (s.contains(k)) return true;
        }
        return false;
      };
      if (any_of({"properties", "required", "additionalProperties"})) types.push_back("object");
      if (any_of({"items", "prefixItems", "additionalItems", "minItems", "maxItems"})) types.push_back("array");
      if (any_of({"minLength", "maxLength", "pattern", "format"})) types.push_back("string");
      if (any_of({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})) types.push_back("number");
      if (types.empty()) return any_value();
    }
    std::vector<Expr> alts;
    for (const std::string& t : types) alts.push_back(gen_type(s, t, path));
    return alt(std::move(alts));
  }

  Expr gen_type(const json& s, const std::string& t, const std::string& path) {
    if (t == "null") return lit("null");
    if (t == "boolean") return alt({lit("true"), lit("false")});
    if (t == "integer") return gen_integer(s, path);
    if (t == "number") return gen_number(s, path);
    if (t == "string") return gen_string(s, path);
    if (t == "array") return gen_array(s, path);
    if (t == "object") return gen_object(s, path);
    fail(path, "unknown type '" + t + "'");
  }

  // Numeric bounds: (value, exclusive). Draft-4 boolean exclusiveMinimum/Maximum modify minimum.
  struct Bound {
    double value;
    bool exclusive;
  };
  std::optional<Bound> bound(const json& s, const char* inclusive, const char* exclusive, const std::string& path) {
    std::optional<Bound> b;
    if (s.contains(inclusive)) {
      if (!s[inclusive].is_number()) fail(path, std::string(inclusive) + " must be a number");
      b = Bound{s[inclusive].get<double>(), false};
    }
    if (s.contains(exclusive)) {
      const json& e = s[exclusive];
      if (e.is_boolean()) {
        if (e.get<bool>() && b) b->exclusive = true;
      } else if (e.is_number()) {
        const double v = e.get<double>();
        const bool tighter = !b || (std::string(inclusive) == "minimum" ? v >= b->value : v <= b->value);
        if (tighter) b = Bound{v, true};
      } else {
        fail(path, std::string(exclusive) + " must be a number");
      }
    }
    return b;
  }

  static constexpr double kMaxExactInt = 9007199254740991.0;  // 2^53 - 1

  Expr gen_integer(const json& s, const std::string& path) {
    auto lo = bound(s, "minimum", "exclusiveMinimum", path);
    auto hi = bound(s, "maximum", "exclusiveMaximum", path);
    if (!lo && !hi) {
      add_json_rules(g_, opt_);
      return rule_ref("json-integer");
    }
    std::optional<int64_t> ilo, ihi;
    if (lo) {
      if (std::fabs(lo->value) > kMaxExactInt) fail(path, "integer bounds beyond 2^53 are not supported");
      ilo = static_cast<int64_t>(lo->exclusive ? std::floor(lo->value) + 1 : std::ceil(lo->value));
    }
    if (hi) {
      if (std::fabs(hi->value) > kMaxExactInt) fail(path, "integer bounds beyond 2^53 are not supported");
      ihi = static_cast<int64_t>(hi->exclusive ? std::ceil(hi->value) - 1 : std::floor(hi->value));
    }
    if (ilo && ihi && *ilo > *ihi) fail(path, "the integer range is empty");
    const std::string name = prefix_ + "int-" + (ilo ? std::to_string(*ilo) : "inf") + "-" + (ihi ? std::to_string(*ihi) : "inf");
    add_rule_once(g_, sanitize(name), [&] { return int_range(ilo, ihi); });
    return rule_ref(sanitize(name));
  }

  // Non-negative magnitudes m with lo <= m <= hi (integer bounds; hi empty: none), exclusive flags
  // as given, written as an integer part with an optional fraction.
  Expr magnitude_range(uint64_t lo, bool lo_excl, std::optional<uint64_t> hi, bool hi_excl) {
    const Expr frac_any = opt(seq({lit("."), digits(1)}));
    const Expr frac_zero = opt(seq({lit("."), plus(lit("0"))}));
    const Expr frac_nonzero = seq({lit("."), digits(0), cls({{'1', '9'}}), digits(0)});
    std::vector<Expr> alts;
    // Integer part strictly inside: any fraction.
    const uint64_t ilo = lo_excl ? lo + 1 : lo;
    if (!hi) {
      alts.push_back(seq({nonneg_int_range(ilo, std::nullopt), frac_any}));
    } else if (*hi >= 1 && ilo <= *hi - 1) {
      alts.push_back(seq({nonneg_int_range(ilo, *hi - 1), frac_any}));
    }
    if (lo_excl && (!hi || lo < *hi)) alts.push_back(seq({lit(std::to_string(lo)), frac_nonzero}));
    if (hi && !hi_excl && (*hi > lo || (!lo_excl && *hi == lo))) alts.push_back(seq({lit(std::to_string(*hi)), frac_zero}));
    if (alts.empty()) throw GrammarError("number range is empty");
    return alt(std::move(alts));
  }

  Expr gen_number(const json& s, const std::string& path) {
    auto lo = bound(s, "minimum", "exclusiveMinimum", path);
    auto hi = bound(s, "maximum", "exclusiveMaximum", path);
    if (!lo && !hi) {
      add_json_rules(g_, opt_);
      return rule_ref("json-number");
    }
    for (const auto& b : {lo, hi}) {
      if (b && (b->value != std::floor(b->value) || std::fabs(b->value) > kMaxExactInt)) {
        fail(path, "number bounds must be integers (up to 2^53) to be enforced; got " + json(b->value).dump());
      }
    }
    if (lo && hi && (lo->value > hi->value || (lo->value == hi->value && (lo->exclusive || hi->exclusive)))) {
      fail(path, "the number range is empty");
    }
    std::vector<Expr> alts;
    // x >= 0 part.
    if (!hi || hi->value >= 0) {
      const bool lo_pos = lo && lo->value >= 0;
      const uint64_t mlo = lo_pos ? static_cast<uint64_t>(lo->value) : 0;
      std::optional<uint64_t> mhi;
      if (hi) mhi = static_cast<uint64_t>(hi->value);
      if (!(mhi && *mhi == 0 && hi->exclusive)) {
        alts.push_back(magnitude_range(mlo, lo_pos && lo->exclusive, mhi, hi && hi->exclusive));
      }
    }
    // x < 0 part: magnitudes in (max(0, -hi), -lo].
    if (!lo || lo->value < 0) {
      const bool hi_neg = hi && hi->value < 0;
      const uint64_t mlo = hi_neg ? static_cast<uint64_t>(-hi->value) : 0;
      std::optional<uint64_t> mhi;
      if (lo) mhi = static_cast<uint64_t>(-lo->value);
      alts.push_back(seq({lit("-"), magnitude_range(mlo, hi_neg ? hi->exclusive : true, mhi, lo && lo->exclusive)}));
    }
    const std::string name = sanitize(new_rule_name("number" + path));
    g_.set_rule(name, alt(std::move(alts)));
    return rule_ref(name);
  }

  Expr format_expr(const std::string& fmt, const std::string& path) {
    const char* date = "[0-9]{4}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)|(?:0[13578]|1[02])-31)";
    const char* time = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])";
    std::string re;
    if (fmt == "date") re = date;
    else if (fmt == "time") re = time;
    else if (fmt == "date-time") re = std::string(date) + "T" + time;
    else if (fmt == "uuid") re = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}";
    else if (fmt == "ipv4") re = "(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])";
    else if (fmt == "email") re = "[A-Za-z0-9_+-]+(?:\\.[A-Za-z0-9_+-]+)*@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\\.)+[A-Za-z]{2,}";
    else fail(path, "unsupported string format '" + fmt + "' (supported: date-time, date, time, uuid, ipv4, email)");
    return regex_to_expr(re);
  }

  Expr gen_string(const json& s, const std::string& path) {
    const bool has_len = s.contains("minLength") || s.contains("maxLength");
    const int n_kinds = (s.contains("format") ? 1 : 0) + (s.contains("pattern") ? 1 : 0) + (has_len ? 1 : 0);
    if (n_kinds > 1) fail(path, "combining format, pattern and minLength/maxLength is not supported");
    if (s.contains("format")) {
      const std::string name = prefix_ + "format-" + sanitize(s["format"].get<std::string>());
      add_rule_once(g_, name, [&] { return seq({lit("\""), format_expr(s["format"].get<std::string>(), path), lit("\"")}); });
      return rule_ref(name);
    }
    if (s.contains("pattern")) {
      if (!s["pattern"].is_string()) fail(path, "pattern must be a string");
      std::string p = s["pattern"].get<std::string>();
      // JSON Schema patterns search; anchor them as full matches with free ends.
      const bool anchored_start = !p.empty() && p[0] == '^';
      const bool anchored_end = p.size() > 1 && p.back() == '$' && p[p.size() - 2] != '\\';
      if (anchored_start) p.erase(0, 1);
      if (anchored_end) p.pop_back();
      std::string full = (anchored_start ? "" : "[\\s\\S]*") + std::string("(?:") + p + ")" + (anchored_end ? "" : "[\\s\\S]*");
      RegexOptions ro;
      ro.json_string_body = true;
      ro.escaped_code_points = opt_.escaped_code_points;
      Expr body;
      try {
        body = regex_to_expr(full, ro);
      } catch (const GrammarError& e) {
        fail(path, std::string("pattern: ") + e.what());
      }
      const std::string name = new_rule_name("pattern" + path);
      g_.set_rule(name, seq({lit("\""), std::move(body), lit("\"")}));
      return rule_ref(name);
    }
    if (has_len) {
      const int lo = s.value("minLength", 0);
      const int hi = s.contains("maxLength") ? s["maxLength"].get<int>() : Expr::kUnbounded;
      if (lo < 0 || (hi != Expr::kUnbounded && hi < lo)) fail(path, "bad minLength/maxLength");
      const std::string name = prefix_ + "string-" + std::to_string(lo) + "-" + (hi < 0 ? "inf" : std::to_string(hi));
      add_rule_once(g_, name, [&] { return seq({lit("\""), repeat(json_char(opt_.escaped_code_points), lo, hi), lit("\"")}); });
      return rule_ref(name);
    }
    add_json_rules(g_, opt_);
    return rule_ref("json-string");
  }

  Expr gen_array(const json& s, const std::string& path) {
    if (s.contains("uniqueItems") && s["uniqueItems"].is_boolean() && s["uniqueItems"].get<bool>()) {
      fail(path, "unsupported keyword 'uniqueItems' (true)");
    }
    const int min = s.value("minItems", 0);
    const int max = s.contains("maxItems") ? s["maxItems"].get<int>() : Expr::kUnbounded;
    if (min < 0 || (max != Expr::kUnbounded && max < min)) fail(path, "bad minItems/maxItems");
    std::vector<Expr> prefix;
    std::optional<Expr> rest;  // schema of the items after the prefix; empty: none allowed
    const json* prefix_list = nullptr;
    const json* rest_schema = nullptr;
    std::string rest_path;
    if (s.contains("prefixItems")) {
      prefix_list = &s["prefixItems"];
      if (s.contains("items")) rest_schema = &s["items"], rest_path = "/items";
    } else if (s.contains("items") && s["items"].is_array()) {
      prefix_list = &s["items"];
      if (s.contains("additionalItems")) rest_schema = &s["additionalItems"], rest_path = "/additionalItems";
    } else if (s.contains("items")) {
      rest_schema = &s["items"], rest_path = "/items";
    }
    if (prefix_list) {
      for (size_t i = 0; i < prefix_list->size(); ++i) prefix.push_back(gen((*prefix_list)[i], path + "/prefixItems/" + std::to_string(i)));
    }
    if (rest_schema == nullptr) {
      rest = any_value();
    } else if (!(rest_schema->is_boolean() && !rest_schema->get<bool>())) {
      rest = gen(*rest_schema, path + rest_path);
    }
    const int k = static_cast<int>(prefix.size());
    const int cap = rest ? max : (max == Expr::kUnbounded ? k : std::min(max, k));
    if (min > cap && cap != Expr::kUnbounded) fail(path, "minItems cannot be met");
    const Expr sep = seq({ws(), lit(","), ws()});
    // Elements from index i on, element i - 1 present.
    std::function<Expr(int)> tail = [&](int i) -> Expr {
      if (cap != Expr::kUnbounded && i >= cap) return empty();
      if (i >= k) {
        const int lo = std::max(min - i, 0);
        const int hi = cap == Expr::kUnbounded ? Expr::kUnbounded : cap - i;
        return repeat(seq({sep, *rest}), lo, hi);
      }
      Expr part = seq({sep, prefix[i], tail(i + 1)});
      return i < min ? part : opt(std::move(part));
    };
    Expr first;
    if (cap == 0) {
      first = empty();
    } else {
      Expr elem0 = k > 0 ? prefix[0] : *rest;
      Expr body = seq({std::move(elem0), tail(1)});
      first = min >= 1 ? std::move(body) : opt(std::move(body));
    }
    const std::string name = new_rule_name("array" + path);
    g_.set_rule(name, seq({lit("["), ws(), std::move(first), ws(), lit("]")}));
    return rule_ref(name);
  }

  Expr gen_object(const json& s, const std::string& path) {
    std::vector<std::string> names;
    std::vector<Expr> values;
    std::vector<bool> required;
    std::set<std::string> req;
    if (s.contains("required")) {
      for (const json& r : s["required"]) req.insert(r.get<std::string>());
    }
    if (s.contains("properties")) {
      if (!s["properties"].is_object()) fail(path, "properties must be an object");
      for (const auto& [k, v] : s["properties"].items()) {
        names.push_back(k);
        values.push_back(gen(v, path + "/properties/" + k));
        required.push_back(req.count(k) > 0);
      }
    }
    for (const std::string& r : req) {
      if (std::find(names.begin(), names.end(), r) == names.end()) {
        fail(path, "required property '" + r + "' has no schema in properties");
      }
    }
    std::optional<Expr> extra;  // schema of additional properties' values
    if (s.contains("additionalProperties")) {
      const json& ap = s["additionalProperties"];
      if (!(ap.is_boolean() && !ap.get<bool>())) extra = gen(ap, path + "/additionalProperties");
    } else if (opt_.additional_properties_default) {
      extra = any_value();
    }
    const Expr sep = seq({ws(), lit(","), ws()});
    auto member = [&](size_t i) { return seq({lit(dump(json(names[i]))), ws(), lit(":"), ws(), values[i]}); };
    std::optional<Expr> extra_member;
    if (extra) extra_member = seq({key_excluding(names), ws(), lit(":"), ws(), *extra});
    const size_t n = names.size();
    // rest(i): members from i on after at least one member; first(i): no member written yet.
    std::vector<Expr> rest(n + 1), first(n + 1);
    rest[n] = extra_member ? star(seq({sep, *extra_member})) : empty();
    first[n] = extra_member ? opt(seq({*extra_member, star(seq({sep, *extra_member}))})) : empty();
    for (size_t i = n; i-- > 0;) {
      Expr with = seq({sep, member(i), rest[i + 1]});
      rest[i] = required[i] ? std::move(with) : alt({std::move(with), rest[i + 1]});
      Expr here = seq({member(i), rest[i + 1]});
      first[i] = required[i] ? std::move(here) : alt({std::move(here), first[i + 1]});
    }
    const std::string name = new_rule_name("object" + path);
    g_.set_rule(name, seq({lit("{"), ws(), std::move(first[0]), ws(), lit("}")}));
    return rule_ref(name);
  }

  // A quoted key that is none of `names`, written without escapes (so equal keys are equal text).
  Expr key_excluding(const std::vector<std::string>& names) {
    std::vector<CodeRange> plain = {{'"', '"'}, {'\\', '\\'}, {0, 0x1F}};  // what key characters exclude
    for (uint32_t c : opt_.escaped_code_points) plain.push_back({c, c});
    struct Node {
      std::map<uint32_t, Node> children;
      bool terminal = false;
    };
    Node trie;
    for (const std::string& name : names) {
      Node* cur = &trie;
      for (size_t i = 0; i < name.size();) {
        // Decode one code point.
        const uint8_t c = static_cast<uint8_t>(name[i]);
        const int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
        uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
        for (int j = 1; j < len && i + j < name.size(); ++j) cp = (cp << 6) | (static_cast<uint8_t>(name[i + j]) & 0x3F);
        cur = &cur->children[cp];
        i += len;
      }
      cur->terminal = true;
    }
    const Expr any_chars = star(cls(plain, true));
    std::function<Expr(const Node&)> build = [&](const Node& node) -> Expr {
      std::vector<Expr> alts;
      if (!node.terminal) alts.push_back(empty());
      std::vector<CodeRange> excluded = plain;
      for (const auto& [cp, child] : node.children) {
        excluded.push_back({cp, cp});
        std::string b;
        append_utf8(b, cp);
        alts.push_back(seq({lit(b), build(child)}));
      }
      alts.push_back(seq({cls(excluded, true), any_chars}));
      return alt(std::move(alts));
    };
    return seq({lit("\""), build(trie), lit("\"")});
  }

  Grammar& g_;
  const json& root_;
  JsonSchemaOptions opt_;
  std::string prefix_;
  std::map<std::string, std::string> refs_;
  int depth_ = 0;
};

}  // namespace

void add_json_rules(Grammar& g, const JsonSchemaOptions& options) {
  if (g.find("json-value") != nullptr) return;
  const Expr ws = ws_expr(options);
  const Expr sep = seq({ws, lit(","), ws});
  g.set_rule("json-value", alt({rule_ref("json-object"), rule_ref("json-array"), rule_ref("json-string"),
                                rule_ref("json-number"), lit("true"), lit("false"), lit("null")}));
  const Expr member = seq({rule_ref("json-string"), ws, lit(":"), ws, rule_ref("json-value")});
  g.set_rule("json-object", seq({lit("{"), ws, opt(seq({member, star(seq({sep, member}))})), ws, lit("}")}));
  g.set_rule("json-array",
             seq({lit("["), ws, opt(seq({rule_ref("json-value"), star(seq({sep, rule_ref("json-value")}))})), ws, lit("]")}));
  g.set_rule("json-string", seq({lit("\""), star(json_char(options.escaped_code_points)), lit("\"")}));
  g.set_rule("json-integer", seq({opt(lit("-")), int_body()}));
  g.set_rule("json-number", seq({opt(lit("-")), int_body(), opt(seq({lit("."), digits(1)})),
                                 opt(seq({cls({{'e', 'e'}, {'E', 'E'}}), opt(cls({{'+', '+'}, {'-', '-'}})), digits(1)}))}));
}

std::string add_json_schema_rule(Grammar& g, const nlohmann::ordered_json& schema, std::string_view name_base,
                                 const JsonSchemaOptions& options) {
  const std::string name = g.fresh_name(sanitize(name_base));
  SchemaCompiler c(g, schema, options, name + "-");
  return c.compile(name);
}

Grammar json_schema_grammar(const nlohmann::ordered_json& schema, const JsonSchemaOptions& options) {
  Grammar g;
  SchemaCompiler c(g, schema, options, "");
  c.compile("root");
  return g;
}

Grammar json_schema_grammar(std::string_view schema_text, const JsonSchemaOptions& options) {
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(schema_text);
  } catch (const nlohmann::json::exception& e) {
    throw GrammarError(std::string("JSON schema is not valid JSON: ") + e.what());
  }
  return json_schema_grammar(j, options);
}

Grammar json_object_grammar(const JsonSchemaOptions& options) {
  Grammar g;
  g.set_rule("root", rule_ref("json-object"));
  add_json_rules(g, options);
  return g;
}

Grammar json_value_grammar(const JsonSchemaOptions& options) {
  Grammar g;
  g.set_rule("root", rule_ref("json-value"));
  add_json_rules(g, options);
  return g;
}

}  // namespace di::grammar
