// JSON Schema -> grammar: random token sequences sampled under the mask validate against their
// schema (checked by Ajv, tests/oracle/validate_json_schema.js); numeric ranges exactly;
// unsupported keywords refused; masks exact for a nested schema.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "grammar/compiled_grammar.h"
#include "grammar/json_schema.h"
#include "test_grammar_util.h"

namespace di::grammar {
namespace {

using ojson = nlohmann::ordered_json;

std::string run_oracle(const std::string& input_jsonl) {
  const std::string dir = ::testing::TempDir();
  const std::string in = dir + "/grammar_oracle_in.jsonl", out = dir + "/grammar_oracle_out.jsonl";
  std::ofstream(in) << input_jsonl;
  const std::string cmd = "node " + std::string(DI_SOURCE_DIR) + "/tests/oracle/validate_json_schema.js < " + in + " > " + out;
  if (std::system(cmd.c_str()) != 0) {
    ADD_FAILURE() << "the Ajv oracle failed to run (node and npm ajv from scripts/setup are needed): " << cmd;
    return {};
  }
  std::stringstream ss;
  ss << std::ifstream(out).rdbuf();
  return ss.str();
}

struct Case {
  std::string name;
  ojson schema;
  std::string text;
};

// Validates all cases with Ajv; returns one verdict per case.
std::vector<nlohmann::json> validate(const std::vector<Case>& cases) {
  std::string input;
  for (const Case& c : cases) input += nlohmann::json{{"schema", c.schema}, {"text", c.text}}.dump() + "\n";
  std::stringstream out(run_oracle(input));
  std::vector<nlohmann::json> verdicts;
  for (std::string line; std::getline(out, line);) {
    if (!line.empty()) verdicts.push_back(nlohmann::json::parse(line));
  }
  return verdicts;
}

std::vector<std::pair<std::string, ojson>> load_schemas() {
  std::ifstream f(std::string(DI_SOURCE_DIR) + "/tests/data/grammar/json_schemas.json");
  EXPECT_TRUE(f.good());
  std::vector<std::pair<std::string, ojson>> out;
  for (const ojson& e : ojson::parse(f)) out.push_back({e["name"].get<std::string>(), e["schema"]});
  return out;
}

std::shared_ptr<const CompiledGrammar> compile(const Grammar& g) {
  CompileOptions o;
  o.threads = 2;
  return CompiledGrammar::compile(g, test::v3_vocab(), o);
}

TEST(GrammarJsonSchema, SampledOutputsValidateWithAjv) {
  const auto schemas = load_schemas();
  ASSERT_GE(schemas.size(), 50u);
  constexpr int kSeeds = 6;
  std::vector<Case> cases;
  for (const auto& [name, schema] : schemas) {
    SCOPED_TRACE(name);
    auto g = compile(json_schema_grammar(schema));
    std::printf("%-26s states %5zu uncertain %7zu compile %6.3f s\n", name.c_str(), g->num_classified_states(),
                g->num_uncertain_tokens(), g->compile_seconds());
    for (int seed = 0; seed < kSeeds; ++seed) {
      std::mt19937_64 rng(seed * 7919 + cases.size());
      GrammarMatcher m(g);
      bool completed = false;
      const std::string text = test::sample_until_end(m, rng, 4000, completed);
      ASSERT_TRUE(completed) << "seed " << seed << " did not finish: " << text.substr(0, 400);
      cases.push_back({name, schema, text});
    }
  }
  // The oracle must also reject: broken variants of the outputs.
  std::vector<Case> broken;
  for (size_t i = 0; i < cases.size(); i += kSeeds) {
    broken.push_back({cases[i].name + " (truncated)", cases[i].schema, cases[i].text.substr(0, cases[i].text.size() / 2)});
  }
  broken.push_back({"wrong type", ojson{{"type", "integer"}}, "\"x\""});
  broken.push_back({"out of range", ojson{{"type", "integer"}, {"maximum", 3}}, "4"});
  std::vector<Case> all = cases;
  all.insert(all.end(), broken.begin(), broken.end());
  const auto verdicts = validate(all);
  ASSERT_EQ(verdicts.size(), all.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_TRUE(verdicts[i]["valid"].get<bool>()) << cases[i].name << ": " << cases[i].text << "\n" << verdicts[i].dump();
  }
  EXPECT_FALSE(verdicts[all.size() - 1]["valid"].get<bool>());
  EXPECT_FALSE(verdicts[all.size() - 2]["valid"].get<bool>());
  int rejected = 0;
  for (size_t i = cases.size(); i < all.size() - 2; ++i) rejected += !verdicts[i]["valid"].get<bool>();
  // Half of a scalar like 12 is still valid; most truncations are not.
  EXPECT_GT(rejected, static_cast<int>(broken.size()) / 2);
}

TEST(GrammarJsonSchema, JsonObjectBuiltinParses) {
  auto g = compile(json_object_grammar());
  std::vector<Case> cases;
  for (int seed = 0; seed < 12; ++seed) {
    std::mt19937_64 rng(seed);
    GrammarMatcher m(g);
    bool completed = false;
    const std::string text = test::sample_until_end(m, rng, 4000, completed);
    ASSERT_TRUE(completed) << text.substr(0, 400);
    ASSERT_EQ(text.front(), '{');
    cases.push_back({"json_object", ojson{{"type", "object"}}, text});
  }
  const auto verdicts = validate(cases);
  ASSERT_EQ(verdicts.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_TRUE(verdicts[i]["valid"].get<bool>()) << cases[i].text;
}

// Integer and number ranges against arithmetic, over every integer in a window and fractions.
TEST(GrammarJsonSchema, NumericRangesExact) {
  struct R {
    ojson schema;
    double lo, hi;
    bool lo_excl, hi_excl;
  };
  const double inf = 1e300;
  const std::vector<R> ranges = {
      {{{"type", "integer"}, {"minimum", 3}, {"maximum", 17}}, 3, 17, false, false},
      {{{"type", "integer"}, {"minimum", -250}, {"maximum", 1999}}, -250, 1999, false, false},
      {{{"type", "integer"}, {"exclusiveMinimum", -5}, {"exclusiveMaximum", 100}}, -5, 100, true, true},
      {{{"type", "integer"}, {"minimum", 42}}, 42, inf, false, false},
      {{{"type", "integer"}, {"maximum", -7}}, -inf, -7, false, false},
      {{{"type", "integer"}, {"minimum", 0}, {"maximum", 0}}, 0, 0, false, false},
      {{{"type", "integer"}, {"minimum", 99}, {"maximum", 1000}}, 99, 1000, false, false},
      {{{"type", "number"}, {"minimum", -10}, {"maximum", 10}}, -10, 10, false, false},
      {{{"type", "number"}, {"exclusiveMinimum", 0}, {"exclusiveMaximum", 1}}, 0, 1, true, true},
      {{{"type", "number"}, {"minimum", 0}}, 0, inf, false, false},
      {{{"type", "number"}, {"exclusiveMaximum", -3}}, -inf, -3, false, true},
      {{{"type", "number"}, {"minimum", 5}, {"exclusiveMaximum", 12}}, 5, 12, false, true},
  };
  for (const R& r : ranges) {
    SCOPED_TRACE(r.schema.dump());
    auto g = CompiledGrammar::compile(json_schema_grammar(r.schema), test::byte_vocab());
    const bool is_int = r.schema["type"] == "integer";
    auto inside = [&](double v) {
      return (r.lo_excl ? v > r.lo : v >= r.lo) && (r.hi_excl ? v < r.hi : v <= r.hi);
    };
    for (int i = -1100; i <= 2100; ++i) {
      const std::string s = std::to_string(i);
      ASSERT_EQ(test::full_match(g, s), inside(i)) << s;
      if (is_int) continue;
      for (const char* frac : {".0", ".5", ".001", ".000"}) {
        const std::string f = (i == 0 ? std::string(frac[1] == '5' ? "-0" : "0") : s) + frac;
        ASSERT_EQ(test::full_match(g, f), inside(std::stod(f))) << f;
      }
    }
    EXPECT_FALSE(test::full_match(g, "01"));
    EXPECT_FALSE(test::full_match(g, "1e3"));
  }
}

TEST(GrammarJsonSchema, UnsupportedKeywordsRefused) {
  std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"type":"object","patternProperties":{"^a":{}}})", "'patternProperties'"},
      {R"({"type":"number","multipleOf":3})", "'multipleOf'"},
      {R"({"not":{"type":"string"}})", "'not'"},
      {R"({"if":{"type":"string"},"then":{}})", "'if'"},
      {R"({"type":"array","uniqueItems":true})", "'uniqueItems'"},
      {R"({"type":"object","minProperties":1})", "'minProperties'"},
      {R"({"type":"array","contains":{"type":"integer"}})", "'contains'"},
      {R"({"type":"string","format":"hostname"})", "format 'hostname'"},
      {R"({"$ref":"http://example.com/s.json"})", "only local $refs"},
      {R"({"$ref":"#/$defs/missing"})", "does not resolve"},
      {R"({"allOf":[{"type":"string"},{"maxLength":3}]})", "allOf"},
      {R"({"type":"number","minimum":0.5})", "must be integers"},
      {R"({"type":"integer","minimum":5,"maximum":4})", "empty"},
      {R"({"type":"object","properties":{"a":{"type":"string","nonsense":1}}})", "#/properties/a"},
      {R"({"type":"string","pattern":"(a)\\1"})", "backreference"},
      {R"(false)", "allows no value"},
      {R"({"type":"strin"})", "unknown type"},
      {R"({"type":)", "not valid JSON"},
  };
  std::string deep = R"({"type":"string"})";
  for (int i = 0; i < 150; ++i) deep = R"({"type":"array","items":)" + deep + "}";
  cases.push_back({deep, "nested too deeply"});
  for (const auto& [schema, what] : cases) {
    try {
      json_schema_grammar(std::string_view(schema));
      ADD_FAILURE() << schema << " accepted";
    } catch (const GrammarError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << schema << ": " << e.what();
    }
  }
}

TEST(GrammarJsonSchema, MaskEqualsBruteForce) {
  const ojson schema = ojson::parse(R"({"type":"object","properties":{
      "id":{"type":"integer","minimum":0,"maximum":500},
      "tags":{"type":"array","items":{"type":"string"},"maxItems":3},
      "meta":{"type":"object","properties":{"ok":{"type":"boolean"},"note":{"type":["string","null"]}},"required":["ok"]}},
    "required":["id","meta"]})");
  auto g = compile(json_schema_grammar(schema));
  std::mt19937_64 rng(3);
  std::vector<uint32_t> mask(g->vocab().mask_words());
  const int32_t n = g->vocab().mask_size();
  for (int walk = 0; walk < 3; ++walk) {
    GrammarMatcher m(g);
    for (int step = 0; step < 25 && !m.is_terminated(); ++step) {
      m.fill_mask(mask);
      const auto ids = test::allowed_ids(mask, n);
      ASSERT_EQ(ids, test::allowed_ids(test::brute_force_mask(m), n)) << "walk " << walk << " step " << step;
      ASSERT_FALSE(ids.empty());
      ASSERT_TRUE(m.accept_token(ids[rng() % ids.size()]));
    }
  }
}

}  // namespace
}  // namespace di::grammar
