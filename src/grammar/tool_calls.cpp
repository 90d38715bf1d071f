#include "grammar/tool_calls.h"

#include <optional>
#include <set>

namespace di::grammar {

namespace {

using json = nlohmann::ordered_json;

constexpr const char* kDsml = "｜DSML｜";

// Raw text that does not contain `stop`, whose first character occurs in it only once (so it has
// no self-overlap). As an automaton: free, or inside a partial match of `stop`; '<' (stop[0])
// always restarts the match. Text may end inside a partial match: the closing tag that follows
// starts with stop[0], so stop's first occurrence is still the closing tag.
Expr text_without(const std::u32string& stop) {
  auto not_cps = [](std::initializer_list<uint32_t> excluded) {
    std::vector<CodeRange> r;
    for (uint32_t c : excluded) r.push_back({c, c});
    return cls(r, true);
  };
  auto cp_lit = [](uint32_t c) {
    std::string b;
    append_utf8(b, c);
    return lit(b);
  };
  const size_t n = stop.size();
  // partial: stop[1..k] for k = 0..n-2 (nested optionals).
  Expr partial = empty();
  for (size_t k = n - 1; k-- > 1;) partial = opt(seq({cp_lit(stop[k]), std::move(partial)}));
  // leave: stop[1..k] then a character that is neither stop[k+1] nor stop[0] (back to free text).
  Expr leave = not_cps({stop[0], stop[n - 1]});
  for (size_t k = n - 2; k-- > 0;) leave = alt({seq({cp_lit(stop[k + 1]), std::move(leave)}), not_cps({stop[0], stop[k + 1]})});
  const Expr open = seq({cp_lit(stop[0]), star(seq({partial, cp_lit(stop[0])}))});  // '<', partial matches cut by '<'
  return seq({star(alt({not_cps({stop[0]}), seq({open, leave})})), opt(seq({open, partial}))});
}

// The raw (string="true") form of a parameter whose values are strings: any text without the
// closing tag, one of the enum/const strings, or a bounded number of characters other than '<'.
// Other string constraints (pattern, format) use the JSON form.
std::optional<Expr> raw_string_value(const json& s, const Expr& any_text) {
  if (!s.is_object()) return std::nullopt;
  static const std::set<std::string> ignored = {"type", "title", "description", "default", "examples", "$comment",
                                                "deprecated", "readOnly", "writeOnly", "minLength", "maxLength"};
  auto only_strings = [](const json& values) {
    for (const json& v : values) {
      if (!v.is_string()) return false;
    }
    return true;
  };
  if (s.contains("enum") && s["enum"].is_array() && !s["enum"].empty() && only_strings(s["enum"])) {
    std::vector<Expr> alts;
    for (const json& v : s["enum"]) alts.push_back(lit(v.get<std::string>()));
    return alt(std::move(alts));
  }
  if (s.contains("const") && s["const"].is_string()) return lit(s["const"].get<std::string>());
  if (!s.contains("type") || s["type"] != "string") return std::nullopt;
  for (const auto& [k, v] : s.items()) {
    if (!ignored.count(k)) return std::nullopt;
  }
  if (!s.contains("minLength") && !s.contains("maxLength")) return any_text;
  const int lo = s.value("minLength", 0);
  const int hi = s.contains("maxLength") ? s["maxLength"].get<int>() : Expr::kUnbounded;
  return repeat(cls({{'<', '<'}}, true), lo, hi);
}

// The members of a parameter list in schema order: required ones always, optional ones maybe,
// joined by `sep`.
Expr ordered_members(const std::vector<Expr>& members, const std::vector<bool>& required, const Expr& sep) {
  const size_t n = members.size();
  std::vector<Expr> rest(n + 1), first(n + 1);
  for (size_t i = n; i-- > 0;) {
    Expr with = seq({sep, members[i], rest[i + 1]});
    rest[i] = required[i] ? std::move(with) : alt({std::move(with), rest[i + 1]});
    Expr here = seq({members[i], rest[i + 1]});
    first[i] = required[i] ? std::move(here) : alt({std::move(here), first[i + 1]});
  }
  return first[0];
}

Expr dsml_invoke(Grammar& g, const ToolSpec& tool, const ToolCallGrammarOptions& opt, const std::string& invoke_tag,
                 const std::string& param_tag) {
  const std::string d = kDsml;
  const Expr raw_text = text_without(U"</｜DSML｜");
  std::vector<Expr> members;
  std::vector<bool> required;
  const json& params = tool.parameters;
  if (params.is_object() && params.contains("properties")) {
    std::set<std::string> req;
    if (params.contains("required")) {
      for (const json& r : params["required"]) req.insert(r.get<std::string>());
    }
    for (const auto& [key, schema] : params["properties"].items()) {
      const std::string open = "<" + d + param_tag + " name=\"" + key + "\" string=\"";
      const std::string close = "</" + d + param_tag + ">";
      if (auto raw = raw_string_value(schema, raw_text)) {
        members.push_back(seq({lit(open + "true\">"), std::move(*raw), lit(close)}));
      } else {
        const std::string rule = add_json_schema_rule(g, schema, tool.name + "-" + key, opt.json);
        members.push_back(seq({lit(open + "false\">"), rule_ref(rule), lit(close)}));
      }
      required.push_back(req.count(key) > 0);
    }
  }
  return seq({lit("<" + d + invoke_tag + " name=\"" + tool.name + "\">\n"), ordered_members(members, required, lit("\n")),
              lit("\n</" + d + invoke_tag + ">")});
}

}  // namespace

ToolCallGrammar tool_call_grammar(const std::vector<ToolSpec>& tools, const ToolCallGrammarOptions& options) {
  if (tools.empty()) throw GrammarError("a tool-call grammar needs at least one tool");
  // Control-token text inside a JSON value would end the call early for the output parser; every
  // DeepSeek control token contains U+FF5C, which JSON strings then write as \uff5c.
  ToolCallGrammarOptions opt = options;
  opt.json.escaped_code_points.push_back(0xFF5C);
  ToolCallGrammar out;
  Grammar& g = out.grammar;
  std::vector<Expr> calls;
  const bool dsml = opt.format == ToolCallFormat::kDsmlV41 || opt.format == ToolCallFormat::kDsmlV4;
  if (dsml) {
    const bool v41 = opt.format == ToolCallFormat::kDsmlV41;
    const std::string block = v41 ? " calls" : "tool_calls", invoke = v41 ? " invoke" : "invoke",
                      param = v41 ? " parameter" : "parameter";
    for (const ToolSpec& t : tools) calls.push_back(dsml_invoke(g, t, opt, invoke, param));
    g.set_rule("tool-call", alt(std::move(calls)));
    const Expr more = opt.parallel ? star(seq({lit("\n"), rule_ref("tool-call")})) : empty();
    const std::string d = kDsml;
    g.set_rule("root", seq({opt.opener_in_prompt ? empty() : lit("<" + d + block + ">\n"), rule_ref("tool-call"), more,
                            lit("\n</" + d + block + ">")}));
    out.control_tokens = {kDsml};
  } else {
    const bool v3 = opt.format == ToolCallFormat::kV3;
    for (const ToolSpec& t : tools) {
      const json schema = t.parameters.is_null() ? json{{"type", "object"}} : t.parameters;
      const std::string args = add_json_schema_rule(g, schema, t.name + "-args", opt.json);
      if (v3) {
        calls.push_back(seq({lit("<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + t.name + "\n```json\n"), rule_ref(args),
                             lit("\n```<｜tool▁call▁end｜>")}));
      } else {
        calls.push_back(seq({lit("<｜tool▁call▁begin｜>" + t.name + "<｜tool▁sep｜>"), rule_ref(args), lit("<｜tool▁call▁end｜>")}));
      }
    }
    g.set_rule("tool-call", alt(std::move(calls)));
    const Expr more = opt.parallel ? star(seq({v3 ? lit("\n") : empty(), rule_ref("tool-call")})) : empty();
    g.set_rule("root", seq({lit("<｜tool▁calls▁begin｜>"), rule_ref("tool-call"), more, lit("<｜tool▁calls▁end｜>")}));
    out.control_tokens = {"<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                          "<｜tool▁calls▁end｜>"};
  }
  g.set_root("root");
  return out;
}

}  // namespace di::grammar
