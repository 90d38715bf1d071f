// Structured output end to end: a real `deepinfer serve` on the tiny generated model (random
// weights) at temperature 1 with several seeds. Every JSON output is validated by Ajv
// (tests/oracle/validate_json_schema.js, independent of deepinfer), every regex output by PCRE2,
// and a forced tool call must come back as one call whose arguments validate against the tool's
// parameters.
#include <gtest/gtest.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server_process.h"

namespace di::test {
namespace {

using ojson = nlohmann::ordered_json;

// Schemas whose documents are short under any model: strings, numbers and arrays are bounded, so
// random weights finish well within max_tokens.
const char* kSchemas[] = {
    R"({"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]})",
    R"({"type":"object","properties":{"n":{"type":"integer","minimum":-5,"maximum":300},"tag":{"enum":["red","green",null,3]}},"required":["n","tag"]})",
    R"({"type":"object","properties":{"name":{"type":"string","minLength":1,"maxLength":6},"xs":{"type":"array","items":{"type":"integer","minimum":0,"maximum":9},"minItems":1,"maxItems":4}},"required":["name","xs"]})",
    R"({"type":"object","$defs":{"pt":{"type":"object","properties":{"x":{"type":"integer","minimum":0,"maximum":99},"y":{"type":"integer","minimum":0,"maximum":99}},"required":["x","y"]}},"properties":{"a":{"$ref":"#/$defs/pt"},"b":{"anyOf":[{"$ref":"#/$defs/pt"},{"type":"null"}]}},"required":["a","b"]})",
    R"({"type":"array","items":{"type":"string","pattern":"^[a-f]{2}$"},"minItems":2,"maxItems":3})",
};

ojson post(uint16_t port, const std::string& path, const ojson& body, int expect_status = 200) {
  const auto r = fetch(port, "POST", path, body.dump());
  EXPECT_EQ(r.status, expect_status) << r.body;
  return ojson::parse(r.body);
}

// Ajv verdicts, one per (schema, text).
std::vector<nlohmann::json> ajv(const std::vector<std::pair<ojson, std::string>>& cases) {
  const std::string dir = ::testing::TempDir();
  const std::string in = dir + "/structured_in.jsonl", out = dir + "/structured_out.jsonl";
  {
    std::ofstream f(in);
    for (const auto& [schema, text] : cases) f << nlohmann::json{{"schema", schema}, {"text", text}}.dump() << "\n";
  }
  const std::string cmd = "node " + std::string(DI_SOURCE_DIR) + "/tests/oracle/validate_json_schema.js < " + in + " > " + out;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << "the Ajv oracle failed (node and npm ajv from scripts/setup are needed)";
  std::ifstream f(out);
  std::vector<nlohmann::json> v;
  for (std::string line; std::getline(f, line);)
    if (!line.empty()) v.push_back(nlohmann::json::parse(line));
  return v;
}

bool pcre2_full_match(const std::string& pattern, const std::string& text) {
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                 PCRE2_ANCHORED | PCRE2_ENDANCHORED | PCRE2_UTF, &err, &off, nullptr);
  EXPECT_NE(re, nullptr) << pattern;
  if (!re) return false;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(re, nullptr);
  const int rc = pcre2_match(re, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), 0, 0, md, nullptr);
  pcre2_match_data_free(md);
  pcre2_code_free(re);
  return rc >= 0;
}

class StructuredE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    srv_ = new ServerProcess({e2e_model_dir(), "--port", "0", "--served-model-name", "tiny"});
    ASSERT_TRUE(srv_->wait_healthy(120)) << srv_->log();
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(srv_->stop(), 0) << srv_->log();
    delete srv_;
    srv_ = nullptr;
  }
  static ServerProcess* srv_;
};
ServerProcess* StructuredE2E::srv_ = nullptr;

TEST_F(StructuredE2E, JsonSchemaOutputsValidateWithAjv) {
  const std::string problem = node_problem();
  ASSERT_TRUE(problem.empty()) << problem;
  std::vector<std::pair<ojson, std::string>> cases;
  int i = 0;
  for (const char* text : kSchemas) {
    const ojson schema = ojson::parse(text);
    for (int seed = 0; seed < 2; ++seed, ++i) {
      // Alternate the two ways to ask: OpenAI's response_format and vLLM's guided_json.
      ojson body = {{"messages", {{{"role", "user"}, {"content", "Give me JSON."}}}},
                    {"temperature", 1.0}, {"seed", 1000 + i}, {"n", 3}, {"max_tokens", 200}};
      if (i % 2 == 0)
        body["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"name", "s"}, {"schema", schema}, {"strict", true}}}};
      else
        body["guided_json"] = schema;
      const ojson r = post(srv_->port(), "/v1/chat/completions", body);
      ASSERT_EQ(r["choices"].size(), 3u) << r.dump();
      for (const auto& c : r["choices"]) {
        EXPECT_EQ(c["finish_reason"], "stop") << c.dump();
        cases.emplace_back(schema, c["message"]["content"].get<std::string>());
      }
    }
  }
  const auto verdicts = ajv(cases);
  ASSERT_EQ(verdicts.size(), cases.size());
  std::set<std::string> distinct;
  for (size_t k = 0; k < cases.size(); ++k) {
    EXPECT_TRUE(verdicts[k]["valid"].get<bool>()) << cases[k].first.dump() << "\n" << cases[k].second << "\n" << verdicts[k].dump();
    distinct.insert(cases[k].second);
  }
  EXPECT_GT(distinct.size(), cases.size() / 2) << "temperature 1 with different seeds should vary";
}

TEST_F(StructuredE2E, JsonObjectStreamedIsAnObject) {
  // Any JSON object, streamed: the concatenated deltas are the object (nothing repaired afterwards).
  const ojson body = {{"messages", {{{"role", "user"}, {"content", "JSON please"}}}},
                      {"response_format", {{"type", "json_object"}}}, {"temperature", 0.0}, {"max_tokens", 8}, {"stream", true}};
  const auto r = fetch(srv_->port(), "POST", "/v1/chat/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  std::string content, finish;
  for (const std::string& d : sse_data(r.body)) {
    if (d == "[DONE]") continue;
    const ojson j = ojson::parse(d);
    for (const auto& c : j["choices"]) {
      if (c["delta"].contains("content")) content += c["delta"]["content"].get<std::string>();
      if (c.contains("finish_reason") && c["finish_reason"].is_string()) finish = c["finish_reason"];
    }
  }
  ASSERT_FALSE(content.empty());
  EXPECT_EQ(content[0], '{') << content;
  // 8 tokens may end early ("{}") or cut the object: either way a prefix of an object, never text
  // before it.
  if (finish == "stop") EXPECT_TRUE(ojson::parse(content).is_object()) << content;
  else EXPECT_EQ(finish, "length");
}

TEST_F(StructuredE2E, GuidedRegexMatchesWithPcre2) {
  const std::string pattern = "[a-z]{3,10}@[a-z]{2,8}\\.(com|net)";
  for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
    for (int seed = 0; seed < 2; ++seed) {
      ojson body = {{"guided_regex", pattern}, {"temperature", 1.0}, {"seed", seed}, {"n", 4}, {"max_tokens", 60}};
      if (std::string(path) == "/v1/completions") body["prompt"] = "Email:";
      else body["messages"] = {{{"role", "user"}, {"content", "Your email?"}}};
      const ojson r = post(srv_->port(), path, body);
      ASSERT_EQ(r["choices"].size(), 4u) << r.dump();
      for (const auto& c : r["choices"]) {
        const std::string text = c.contains("text") ? c["text"].get<std::string>() : c["message"]["content"].get<std::string>();
        EXPECT_TRUE(pcre2_full_match(pattern, text)) << text;
        EXPECT_EQ(c["finish_reason"], "stop") << c.dump();
      }
    }
  }
}

TEST_F(StructuredE2E, GuidedGrammarAndErrors) {
  const ojson r = post(srv_->port(), "/v1/completions",
                       {{"prompt", "x"}, {"guided_grammar", "root ::= (\"yes\" | \"no\") \"!\""}, {"seed", 3}, {"n", 4}, {"max_tokens", 10}});
  for (const auto& c : r["choices"]) EXPECT_TRUE(c["text"] == "yes!" || c["text"] == "no!") << c.dump();

  const ojson bad = post(srv_->port(), "/v1/chat/completions",
                         {{"messages", {{{"role", "user"}, {"content", "x"}}}},
                          {"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "s"}, {"schema", {{"type", "array"}, {"uniqueItems", true}}}}}}}},
                         400);
  EXPECT_EQ(bad["error"]["param"], "response_format.json_schema.schema") << bad.dump();
  EXPECT_NE(bad["error"]["message"].get<std::string>().find("uniqueItems"), std::string::npos) << bad.dump();
  const ojson bad_re = post(srv_->port(), "/v1/completions", {{"prompt", "x"}, {"guided_regex", "(a"}}, 400);
  EXPECT_EQ(bad_re["error"]["param"], "guided_regex") << bad_re.dump();
}

TEST_F(StructuredE2E, ForcedToolCallHasValidArguments) {
  const std::string problem = node_problem();
  ASSERT_TRUE(problem.empty()) << problem;
  const ojson params = ojson::parse(
      R"({"type":"object","properties":{"days":{"type":"integer","minimum":1,"maximum":7},"metric":{"type":"boolean"}},"required":["days","metric"]})");
  const ojson tools = {{{"type", "function"}, {"function", {{"name", "get_weather"}, {"parameters", params}}}},
                       {{"type", "function"}, {"function", {{"name", "get_time"}, {"parameters", {{"type", "object"}, {"properties", ojson::object()}}}}}}};
  std::vector<std::pair<ojson, std::string>> cases;
  for (int seed = 0; seed < 3; ++seed) {
    for (bool named : {false, true}) {
      ojson body = {{"messages", {{{"role", "user"}, {"content", "Weather?"}}}},
                    {"tools", tools}, {"parallel_tool_calls", false}, {"temperature", 1.0}, {"seed", seed}, {"max_tokens", 200}};
      body["tool_choice"] = named ? ojson{{"type", "function"}, {"function", {{"name", "get_weather"}}}} : ojson("required");
      const ojson r = post(srv_->port(), "/v1/chat/completions", body);
      const ojson& c = r["choices"][0];
      EXPECT_EQ(c["finish_reason"], "tool_calls") << r.dump();
      ASSERT_TRUE(c["message"].contains("tool_calls")) << r.dump();
      ASSERT_EQ(c["message"]["tool_calls"].size(), 1u) << "parallel_tool_calls false: one call; " << r.dump();
      const ojson& fn = c["message"]["tool_calls"][0]["function"];
      const std::string name = fn["name"];
      if (named) EXPECT_EQ(name, "get_weather");
      ASSERT_TRUE(name == "get_weather" || name == "get_time") << name;
      cases.emplace_back(name == "get_weather" ? params : ojson{{"type", "object"}, {"additionalProperties", false}},
                         fn["arguments"].get<std::string>());
    }
  }
  const auto verdicts = ajv(cases);
  ASSERT_EQ(verdicts.size(), cases.size());
  for (size_t k = 0; k < cases.size(); ++k) EXPECT_TRUE(verdicts[k]["valid"].get<bool>()) << cases[k].second << "\n" << verdicts[k].dump();
}

}  // namespace
}  // namespace di::test
