// Tool-call grammars: what the chat renderer writes for tool calls is accepted; random outputs
// under the mask parse with the streaming output parser into calls of known tools whose
// arguments validate (Ajv) against the tool's parameter schema.
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <sstream>

#include "grammar/compiled_grammar.h"
#include "grammar/tool_calls.h"
#include "test_grammar_util.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/stream_parser.h"
#include "tokenizer/v41_vocab.h"

namespace di::grammar {
namespace {

using ojson = nlohmann::ordered_json;

std::vector<ToolSpec> tools() {
  return {
      {"get_weather", ojson::parse(R"({"type":"object","properties":{
          "city":{"type":"string","description":"City name"},
          "days":{"type":"integer","minimum":1,"maximum":14},
          "unit":{"enum":["celsius","fahrenheit"]}},"required":["city","days"]})")},
      {"search", ojson::parse(R"({"type":"object","properties":{
          "query":{"type":"string"},
          "filters":{"type":"object","properties":{"site":{"type":"string"},"recent":{"type":"boolean"}},
                     "required":["recent"]},
          "limit":{"type":["integer","null"]}},"required":["query"]})")},
      {"ping", nullptr},
  };
}

struct FormatCase {
  ToolCallFormat format;
  chat::ChatFormat chat;
  stream::ToolCallSyntax syntax;
  std::string open, close;
};

const std::vector<FormatCase>& formats() {
  static const std::vector<FormatCase> f = {
      {ToolCallFormat::kDsmlV41, chat::ChatFormat::DeepSeekV41, stream::ToolCallSyntax::Dsml, "<｜DSML｜ calls>", "</｜DSML｜ calls>"},
      {ToolCallFormat::kDsmlV4, chat::ChatFormat::DeepSeekV4, stream::ToolCallSyntax::Dsml, "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"},
      {ToolCallFormat::kV3, chat::ChatFormat::DeepSeekV3, stream::ToolCallSyntax::V3, "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"},
      {ToolCallFormat::kV31, chat::ChatFormat::DeepSeekV31, stream::ToolCallSyntax::V31, "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"},
  };
  return f;
}

// The calls block the chat renderer writes for an assistant message with these calls.
std::string rendered_block(const FormatCase& f, const std::vector<chat::ToolCall>& calls) {
  chat::ChatRequest req;
  for (const ToolSpec& t : tools()) req.tools.push_back({t.name, std::nullopt, t.parameters});
  chat::Message user;
  user.content = "weather?";
  chat::Message assistant;
  assistant.role = chat::Role::Assistant;
  if (f.format == ToolCallFormat::kDsmlV41 || f.format == ToolCallFormat::kDsmlV4) assistant.content = "";
  assistant.tool_calls = calls;
  req.messages = {user, assistant};
  const std::string text = chat::render_chat(f.chat, req).text;
  // The last opener: the V4.x tool prompt shows an example block.
  const size_t b = text.rfind(f.open);
  EXPECT_NE(b, std::string::npos) << text;
  const size_t e = text.find(f.close, b);
  if (e == std::string::npos && f.format == ToolCallFormat::kV3) {
    // V3's template leaves a single call's block unclosed; the model closes it.
    const std::string call_end = "<｜tool▁call▁end｜>";
    const size_t last = text.rfind(call_end);
    return text.substr(b, last + call_end.size() - b) + f.close;
  }
  EXPECT_NE(e, std::string::npos) << text;
  return text.substr(b, e + f.close.size() - b);
}

TEST(GrammarToolCalls, AcceptsWhatTheRendererWrites) {
  const std::vector<chat::ToolCall> two = {
      {"c1", "function", "get_weather", R"({"city":"Paris <b>\"x\"</b> </DSML","days":3,"unit":"celsius"})"},
      {"c2", "function", "search", R"({"query":"a<b","filters":{"site":"x.org","recent":true},"limit":null})"},
  };
  const std::vector<chat::ToolCall> one = {{"c3", "function", "ping", "{}"}};
  const std::vector<chat::ToolCall> bad_enum = {{"c4", "function", "get_weather", R"({"city":"x","days":3,"unit":"kelvin"})"}};
  const std::vector<chat::ToolCall> missing = {{"c5", "function", "get_weather", R"({"city":"x"})"}};
  const std::vector<chat::ToolCall> unknown = {{"c6", "function", "launch", R"({})"}};
  for (const FormatCase& f : formats()) {
    SCOPED_TRACE(std::string(chat::chat_format_name(f.chat)));
    ToolCallGrammarOptions o;
    o.format = f.format;
    auto g = CompiledGrammar::compile(tool_call_grammar(tools(), o).grammar, test::byte_vocab());
    o.parallel = false;
    auto single = CompiledGrammar::compile(tool_call_grammar(tools(), o).grammar, test::byte_vocab());
    const std::string two_text = rendered_block(f, two), one_text = rendered_block(f, one);
    EXPECT_TRUE(test::full_match(g, two_text)) << two_text;
    EXPECT_TRUE(test::full_match(g, one_text)) << one_text;
    EXPECT_FALSE(test::full_match(single, two_text));
    EXPECT_TRUE(test::full_match(single, one_text));
    EXPECT_FALSE(test::full_match(g, rendered_block(f, bad_enum)));
    EXPECT_FALSE(test::full_match(g, rendered_block(f, missing)));
    EXPECT_FALSE(test::full_match(g, rendered_block(f, unknown)));
  }
}

TEST(GrammarToolCalls, DsmlStringValuesCannotCloseTheTag) {
  ToolCallGrammarOptions o;
  o.opener_in_prompt = true;
  auto g = CompiledGrammar::compile(tool_call_grammar({tools()[0]}, o).grammar, test::byte_vocab());
  const std::string head = "<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter name=\"city\" string=\"true\">";
  const std::string tail = "</｜DSML｜ parameter>\n<｜DSML｜ parameter name=\"days\" string=\"false\">2</｜DSML｜ parameter>\n"
                           "</｜DSML｜ invoke>\n</｜DSML｜ calls>";
  for (const char* v : {"", "<", "<<", "</", "</｜DSML", "a</｜DSM<x", "</｜DSMLx｜", "<</｜DS"}) {
    EXPECT_TRUE(test::full_match(g, head + v + tail)) << v;
  }
  for (const char* v : {"</｜DSML｜", "a</｜DSML｜ x", "<</｜DSML｜"}) EXPECT_FALSE(test::full_match(g, head + v + tail)) << v;
  // Random strings over the tag's characters: accepted exactly when the tag's start is absent.
  const std::vector<std::string> alphabet = {"<", "/", "｜", "D", "S", "M", "L", "x", " "};
  std::mt19937_64 rng(4);
  int absent = 0;
  for (int i = 0; i < 3000; ++i) {
    std::vector<std::string> pieces;
    for (size_t n = rng() % 14; n > 0; --n) pieces.push_back(alphabet[rng() % alphabet.size()]);
    if (i % 3 != 2) {
      pieces.insert(pieces.begin() + static_cast<std::ptrdiff_t>(rng() % (pieces.size() + 1)),
                    i % 3 == 0 ? "</｜DSM" : "</｜DSML｜");
    }
    std::string v;
    for (const std::string& p : pieces) v += p;
    const bool ok = v.find("</｜DSML｜") == std::string::npos;
    absent += ok;
    ASSERT_EQ(test::full_match(g, head + v + tail), ok) << v;
  }
  EXPECT_GT(absent, 100);
  EXPECT_LT(absent, 2950);
}

// Control-token text inside JSON arguments would end the call early for the output parser: JSON
// strings write U+FF5C only as an escape, so no token containing it fits inside one.
TEST(GrammarToolCalls, JsonArgumentsNeverContainControlText) {
  for (const FormatCase& f : formats()) {
    SCOPED_TRACE(std::string(chat::chat_format_name(f.chat)));
    ToolCallGrammarOptions o;
    o.format = f.format;
    auto g = CompiledGrammar::compile(tool_call_grammar(tools(), o).grammar, test::byte_vocab());
    const std::string raw_bar = rendered_block(f, {{"c", "function", "search", R"({"query":"a｜b"})"}});
    const std::string escaped_bar = rendered_block(f, {{"c", "function", "search", R"({"query":"a\uff5cb"})"}});
    const bool dsml = f.format == ToolCallFormat::kDsmlV41 || f.format == ToolCallFormat::kDsmlV4;
    EXPECT_EQ(test::full_match(g, raw_bar), dsml) << raw_bar;  // DSML strings are raw text
    if (!dsml) {
      EXPECT_TRUE(test::full_match(g, escaped_bar)) << escaped_bar;
    }
    const std::string filters = rendered_block(f, {{"c", "function", "search", R"({"query":"q","filters":{"site":"x｜y","recent":true}})"}});
    EXPECT_FALSE(test::full_match(g, filters)) << filters;
  }
  // On the real vocabulary: inside a V3 argument string, no allowed token contains U+FF5C.
  auto tok = test::v3_tokenizer();
  ToolCallGrammarOptions o;
  o.format = ToolCallFormat::kV3;
  const ToolCallGrammar tg = tool_call_grammar(tools(), o);
  VocabularyOptions vo;
  vo.mask_size = 129280;
  for (const std::string& t : tg.control_tokens) vo.text_added_ids.push_back(*tok->token_to_id(t));
  auto g = CompiledGrammar::compile(tg.grammar, Vocabulary::from_tokenizer(*tok, vo));
  GrammarMatcher m(g);
  ASSERT_TRUE(m.accept_bytes("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{\"query\": \"ab"));
  std::vector<uint32_t> mask(g->vocab().mask_words());
  m.fill_mask(mask);
  const auto ids = test::allowed_ids(mask, g->vocab().mask_size());
  EXPECT_GT(ids.size(), 100000u);
  for (int32_t id : ids) ASSERT_EQ(g->vocab().token_bytes(id).find("｜"), std::string_view::npos) << id;
}

std::shared_ptr<const Tokenizer> v41_tokenizer() {
  static auto tok = [] {
    std::ifstream f(di::test::v3_tokenizer_json());
    const nlohmann::json v3 = nlohmann::json::parse(f);
    return Tokenizer::from_json_text(derive_v41_tokenizer_json(v3).dump(), "derived v4.1");
  }();
  return tok;
}

std::string run_ajv(const std::string& jsonl) {
  const std::string dir = ::testing::TempDir();
  const std::string in = dir + "/tool_oracle_in.jsonl", out = dir + "/tool_oracle_out.jsonl";
  std::ofstream(in) << jsonl;
  const std::string cmd = "node " + std::string(DI_SOURCE_DIR) + "/tests/oracle/validate_json_schema.js < " + in + " > " + out;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << "the Ajv oracle failed to run (node and npm ajv from scripts/setup are needed)";
  std::stringstream ss;
  ss << std::ifstream(out).rdbuf();
  return ss.str();
}

TEST(GrammarToolCalls, SampledCallsParseAndValidate) {
  std::string oracle_input;
  int n_calls = 0;
  for (const FormatCase& f : formats()) {
    SCOPED_TRACE(std::string(chat::chat_format_name(f.chat)));
    const bool dsml = f.format == ToolCallFormat::kDsmlV41 || f.format == ToolCallFormat::kDsmlV4;
    auto tok = dsml ? v41_tokenizer() : test::v3_tokenizer();
    ToolCallGrammarOptions o;
    o.format = f.format;
    // Random tokens almost never close raw DSML text (that needs "</｜DSML｜" by chance), so strings
    // are bounded here; raw text is covered by the tests above.
    std::vector<ToolSpec> specs = tools();
    specs[0].parameters["properties"]["city"]["maxLength"] = 6;
    specs[1].parameters["properties"]["query"]["maxLength"] = 6;
    const ToolCallGrammar tg = tool_call_grammar(specs, o);
    VocabularyOptions vo;
    vo.mask_size = 129280;
    for (const std::string& t : tg.control_tokens) vo.text_added_ids.push_back(*tok->token_to_id(t));
    CompileOptions co;
    co.threads = 2;
    auto g = CompiledGrammar::compile(tg.grammar, Vocabulary::from_tokenizer(*tok, vo), co);
    for (int seed = 0; seed < 5; ++seed) {
      std::mt19937_64 rng(seed + 100);
      GrammarMatcher m(g);
      bool completed = false;
      const std::string text = test::sample_until_end(m, rng, 4000, completed);
      ASSERT_TRUE(completed) << text.substr(0, 300);
      stream::ParserOptions po;
      po.syntax = f.syntax;
      stream::StreamParser parser(po);
      std::vector<stream::StreamEvent> events;
      parser.feed(text, events);
      parser.finish(stream::StopCause::EndOfText, events);
      std::map<int, std::string> names, args;
      for (const auto& e : events) {
        if (e.kind == stream::EventKind::ToolCallBegin) names[e.tool_index] = e.text;
        if (e.kind == stream::EventKind::ToolCallArguments) args[e.tool_index] += e.text;
        EXPECT_NE(e.kind, stream::EventKind::Content) << text;
        EXPECT_NE(e.kind, stream::EventKind::Invalid) << text;
      }
      ASSERT_FALSE(names.empty()) << text;
      for (const auto& [i, name] : names) {
        const ToolSpec* spec = nullptr;
        for (const ToolSpec& t : specs) {
          if (t.name == name) spec = &t;
        }
        ASSERT_NE(spec, nullptr) << name;
        const ojson schema = spec->parameters.is_null() ? ojson{{"type", "object"}, {"additionalProperties", false}} : spec->parameters;
        oracle_input += nlohmann::json{{"schema", schema}, {"text", args[i]}}.dump() + "\n";
        ++n_calls;
      }
    }
  }
  std::stringstream verdicts(run_ajv(oracle_input));
  int checked = 0;
  for (std::string line; std::getline(verdicts, line);) {
    if (line.empty()) continue;
    EXPECT_TRUE(nlohmann::json::parse(line)["valid"].get<bool>()) << line;
    ++checked;
  }
  EXPECT_EQ(checked, n_calls);
}

}  // namespace
}  // namespace di::grammar
