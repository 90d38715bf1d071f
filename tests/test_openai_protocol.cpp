// OpenAI protocol conversion: request -> encoder input + parser options (with field-named errors),
// parser events -> streaming deltas and the final message.
#include <gtest/gtest.h>

#include <chrono>

#include "io/json_limits.h"
#include "openai/protocol.h"

using namespace di;
using json = nlohmann::ordered_json;

namespace {

openai::ConversionResult convert(const json& body, chat::ChatFormat format = chat::ChatFormat::DeepSeekV41) {
  openai::ConversionOptions opt;
  opt.format = format;
  return openai::convert_chat_request(body, opt);
}

json user(const std::string& text) { return {{"role", "user"}, {"content", text}}; }

const json kTool = {{"type", "function"},
                    {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}, {"properties", json::object()}}}}}};

void expect_error(const json& body, const std::string& field, chat::ChatFormat format = chat::ChatFormat::DeepSeekV41) {
  auto r = convert(body, format);
  ASSERT_FALSE(r.ok()) << body.dump();
  EXPECT_EQ(r.error->field, field) << r.error->message;
  EXPECT_EQ(r.error->message.rfind(field, 0), 0u) << r.error->message;
}

TEST(OpenAIRequest, Errors400NameTheField) {
  expect_error(json::array(), "body");
  expect_error(json::object(), "messages");
  expect_error({{"messages", json::array()}}, "messages");
  expect_error({{"messages", {{{"content", "x"}}}}}, "messages[0].role");
  expect_error({{"messages", {{{"role", "wizard"}, {"content", "x"}}}}}, "messages[0].role");
  expect_error({{"messages", {{{"role", "user"}, {"content", 5}}}}}, "messages[0].content");
  expect_error({{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}}, "messages[0].content[0].type");
  expect_error({{"messages", {user("x"), {{"role", "tool"}, {"content", "r"}}}}}, "messages[1].tool_call_id");
  expect_error({{"messages", {user("x"), {{"role", "assistant"}, {"tool_calls", {{{"function", {{"arguments", "{}"}}}}}}}}}},
               "messages[1].tool_calls[0].function.name");
  expect_error({{"messages", {user("x")}}, {"tools", {{{"type", "function"}, {"function", {{"name", 3}}}}}}}, "tools[0].function.name");
  expect_error({{"messages", {user("x")}}, {"tool_choice", "sometimes"}}, "tool_choice");
  expect_error({{"messages", {user("x")}}, {"tool_choice", "required"}}, "tool_choice");
  expect_error({{"messages", {user("x")}}, {"tools", {kTool}}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}},
               "tool_choice.function.name");
  expect_error({{"messages", {user("x")}}, {"response_format", {{"type", "json_schema"}}}}, "response_format.json_schema");
  expect_error({{"messages", {user("x")}}, {"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "n"}}}}}},
               "response_format.json_schema.schema");
  expect_error({{"messages", {user("x")}}, {"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", 3}}}}}},
               "response_format.json_schema.schema");
  expect_error({{"messages", {user("x")}},
                {"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", json::object()}, {"strict", "yes"}}}}}},
               "response_format.json_schema.strict");
  expect_error({{"messages", {user("x")}}, {"response_format", {{"type", "grammar"}}}}, "response_format.type");
  expect_error({{"messages", {user("x")}}, {"response_format", {{"type", "json_object"}}}}, "response_format",
               chat::ChatFormat::DeepSeekR1);
  expect_error({{"messages", {user("x")}}, {"reasoning_effort", "extreme"}}, "reasoning_effort");
  expect_error({{"messages", {user("x")}}, {"reasoning_effort", 101}}, "reasoning_effort");
  expect_error({{"messages", {user("x")}}, {"reasoning_effort", 50}}, "reasoning_effort", chat::ChatFormat::DeepSeekV4);
  expect_error({{"messages", {user("x")}}, {"thinking", {{"type", "maybe"}}}}, "thinking.type");
  expect_error({{"messages", {user("x")}}, {"chat_template_kwargs", {{"thinking", "yes"}}}}, "chat_template_kwargs.thinking");
  expect_error({{"messages", {user("x")}}, {"stop", {1}}}, "stop[0]");
  expect_error({{"messages", {user("x")}}, {"stop", json(std::vector<std::string>(17, "s"))}}, "stop");
  // Format-specific: V3 has no latest_reminder role; V3 needs string user content.
  expect_error({{"messages", {{{"role", "latest_reminder"}, {"content", "x"}}}}}, "messages[0].role", chat::ChatFormat::DeepSeekV3);
}

TEST(OpenAIRequest, ThinkingSwitchesAndEffort) {
  struct Case {
    json extra;
    bool thinking;
  };
  const std::vector<Case> cases = {
      {json::object(), false},
      {{{"reasoning_effort", "high"}}, true},
      {{{"reasoning_effort", "none"}}, false},
      {{{"reasoning_effort", "none"}, {"thinking", {{"type", "enabled"}}}}, true},
      {{{"reasoning_effort", "max"}, {"thinking", {{"type", "disabled"}}}}, false},
      {{{"chat_template_kwargs", {{"thinking", true}}}}, true},
      {{{"chat_template_kwargs", {{"enable_thinking", true}}}, {"thinking", {{"type", "disabled"}}}}, false},
      {{{"enable_thinking", true}}, true},
  };
  for (const auto& c : cases) {
    json body = c.extra;
    body["messages"] = {user("q")};
    auto r = convert(body);
    ASSERT_TRUE(r.ok()) << r.error->message;
    EXPECT_EQ(r.request->chat.thinking, c.thinking) << body.dump();
    EXPECT_EQ(r.request->parser.start_in_reasoning, c.thinking) << body.dump();
  }
  auto r = convert({{"messages", {user("q")}}, {"reasoning_effort", 37}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.request->chat.reasoning_effort.value, 37);
}

TEST(OpenAIRequest, MessagesToolsAndParserOptions) {
  json body = {{"messages",
                {{{"role", "developer"}, {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}}}},
                 user("go"),
                 {{"role", "assistant"},
                  {"content", nullptr},
                  {"reasoning_content", "r"},
                  {"tool_calls", {{{"id", "c1"}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", {{"city", "P"}}}}}}}}},
                 {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "sunny"}}}},
               {"tools", {kTool}},
               {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}},
               {"response_format", {{"type", "json_object"}}},
               {"stop", "END"}};
  auto r = convert(body);
  ASSERT_TRUE(r.ok()) << r.error->message;
  const auto& c = r.request->chat;
  ASSERT_EQ(c.messages.size(), 4u);
  EXPECT_EQ(c.messages[0].role, chat::Role::System);
  EXPECT_EQ(*c.messages[0].content, "a\n\nb");
  EXPECT_FALSE(c.messages[2].content.has_value());
  EXPECT_EQ(c.messages[2].tool_calls->at(0).arguments, R"({"city":"P"})");
  EXPECT_EQ(c.messages[3].tool_call_id, "c1");
  EXPECT_EQ(c.tool_choice, chat::ToolChoice::Required);
  EXPECT_TRUE(c.json_mode);
  const auto& p = r.request->parser;
  EXPECT_EQ(p.syntax, stream::ToolCallSyntax::Dsml);
  EXPECT_TRUE(p.parse_tool_calls && p.start_in_tool_calls);
  EXPECT_FALSE(p.parse_json_output) << "JSON is enforced by the grammar, not repaired";
  // The forced call is the output: it, not response_format, is the constraint.
  EXPECT_EQ(r.request->structured.kind, openai::StructuredOutput::Kind::ToolCall);
  EXPECT_EQ(r.request->structured.field, "tool_choice");
  EXPECT_EQ(p.stop_sequences, std::vector<std::string>{"END"});

  auto v31 = convert({{"messages", {user("q")}}, {"tools", {kTool}}, {"tool_choice", "none"}}, chat::ChatFormat::DeepSeekV31);
  ASSERT_TRUE(v31.ok());
  EXPECT_EQ(v31.request->parser.syntax, stream::ToolCallSyntax::V31);
  EXPECT_FALSE(v31.request->parser.parse_tool_calls);
  auto r1 = convert({{"messages", {user("q")}}}, chat::ChatFormat::DeepSeekR1);
  ASSERT_TRUE(r1.ok());
  EXPECT_TRUE(r1.request->parser.start_in_reasoning);
  EXPECT_EQ(r1.request->parser.syntax, stream::ToolCallSyntax::V3);
}

std::vector<stream::StreamEvent> run_parser(const stream::ParserOptions& opt, const std::vector<std::string>& chunks,
                                            std::vector<std::vector<stream::StreamEvent>>* per_feed = nullptr) {
  stream::StreamParser parser(opt);
  std::vector<stream::StreamEvent> all, step;
  for (const auto& c : chunks) {
    step.clear();
    parser.feed(c, step);
    if (per_feed) per_feed->push_back(step);
    all.insert(all.end(), step.begin(), step.end());
  }
  step.clear();
  parser.finish(stream::StopCause::EndOfText, step);
  if (per_feed) per_feed->push_back(step);
  all.insert(all.end(), step.begin(), step.end());
  return all;
}

TEST(OpenAIResponse, DeltasAndMessageFromToolCallStream) {
  auto r = convert({{"messages", {user("q")}}, {"tools", {kTool}}, {"thinking", {{"type", "enabled"}}}});
  ASSERT_TRUE(r.ok());
  const std::vector<std::string> chunks = {"Need weather.</th", "ink>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_",
                                           "weather\">\n<｜DSML｜ parameter name=\"city\" string=\"true\">Pa", "ris</｜DSML｜ parameter>\n",
                                           "</｜DSML｜ invoke>\n</｜DSML｜ calls>"};
  std::vector<std::vector<stream::StreamEvent>> per_feed;
  auto events = run_parser(r.request->parser, chunks, &per_feed);

  openai::ChatDeltaConverter deltas(openai::ToolCallIdGenerator(42));
  std::vector<json> out;
  for (const auto& step : per_feed) deltas.convert(step, out);
  ASSERT_TRUE(deltas.finish_reason().has_value());
  EXPECT_EQ(*deltas.finish_reason(), "tool_calls");
  ASSERT_GE(out.size(), 3u);
  EXPECT_EQ(out[0]["role"], "assistant");
  EXPECT_EQ(out[0]["reasoning_content"], "Need weather.");
  // Accumulate the deltas as a client does.
  std::string reasoning, args, name, id;
  for (const auto& d : out) {
    if (d.contains("reasoning_content")) reasoning += d["reasoning_content"].get<std::string>();
    EXPECT_FALSE(d.contains("content")) << d.dump();
    if (d.contains("tool_calls")) {
      const auto& tc = d["tool_calls"][0];
      EXPECT_EQ(tc["index"], 0);
      if (tc.contains("id")) {
        id = tc["id"];
        name = tc["function"]["name"];
        EXPECT_EQ(tc["type"], "function");
      }
      args += tc["function"]["arguments"].get<std::string>();
    }
  }
  EXPECT_EQ(reasoning, "Need weather.");
  EXPECT_EQ(name, "get_weather");
  EXPECT_EQ(id.rfind("call_", 0), 0u);
  EXPECT_EQ(id.size(), 29u);
  EXPECT_EQ(json::parse(args), json::parse(R"({"city": "Paris"})"));

  openai::ChatMessageBuilder builder(openai::ToolCallIdGenerator(42));
  builder.add(events);
  json m = builder.message();
  EXPECT_EQ(builder.finish_reason(), "tool_calls");
  EXPECT_EQ(m["role"], "assistant");
  EXPECT_TRUE(m["content"].is_null());
  EXPECT_EQ(m["reasoning_content"], "Need weather.");
  ASSERT_EQ(m["tool_calls"].size(), 1u);
  EXPECT_EQ(m["tool_calls"][0]["id"], id);  // same seed, same ids
  EXPECT_EQ(m["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(m["tool_calls"][0]["function"]["arguments"].get<std::string>()), json::parse(R"({"city": "Paris"})"));
}

TEST(OpenAIResponse, PlainAnswerAndStop) {
  auto r = convert({{"messages", {user("q")}}, {"stop", {"\n\nUser:"}}});
  ASSERT_TRUE(r.ok());
  auto events = run_parser(r.request->parser, {"Hello", " there.\n\nUs", "er: more"});
  openai::ChatMessageBuilder builder;
  builder.add(events);
  json m = builder.message();
  EXPECT_EQ(m["content"], "Hello there.");
  EXPECT_FALSE(m.contains("reasoning_content"));
  EXPECT_FALSE(m.contains("tool_calls"));
  EXPECT_EQ(builder.finish_reason(), "stop");

  // An empty answer is "" rather than null.
  openai::ChatMessageBuilder empty;
  empty.add(run_parser(stream::ParserOptions{}, {}));
  EXPECT_EQ(empty.message()["content"], "");
}

}  // namespace

namespace {

// ---- bounded JSON parsing --------------------------------------------------------------------

json parse_limited(const std::string& text, JsonLimits limits = {}) {
  json out;
  auto err = parse_json_limited(text, limits, out);
  EXPECT_FALSE(err.has_value()) << err->message;
  return out;
}

TEST(JsonLimits, SameValueAsOrderedJsonParse) {
  for (const std::string text :
       {R"({"z":1,"a":[1,2.5,-3,1e-7,18446744073709551615,true,null,"x"],"m":{"b":{},"a":[]}})",
        R"({"k":1,"j":2,"k":3})",  // a repeated key keeps its first position, takes the last value
        R"([{"a":{"b":{"c":[[["deep"]]]}}}])", R"("just a string")", R"(42)",
        R"({"日本":"語","\u0000":"nul","e":"\ud83d\ude00"})"}) {
    const json expected = json::parse(text);
    EXPECT_EQ(parse_limited(text).dump(), expected.dump()) << text;
  }
  // A big object (past the hash-index threshold) with repeats in it.
  std::string big = "{";
  for (int i = 0; i < 100; ++i) big += "\"k" + std::to_string(i % 60) + "\":" + std::to_string(i) + ",";
  big += "\"end\":0}";
  EXPECT_EQ(parse_limited(big).dump(), json::parse(big).dump());
}

TEST(JsonLimits, DepthAndKeysStopParsingAndNameThePath) {
  JsonLimits lim;
  lim.max_depth = 4;
  json out;
  EXPECT_FALSE(parse_json_limited(R"({"a":[{"b":{}}]})", lim, out).has_value());
  auto err = parse_json_limited(R"({"a":[{"b":{"c":[]}}]})", lim, out);
  ASSERT_TRUE(err.has_value());
  EXPECT_EQ(err->kind, JsonLimitError::Kind::Depth);
  EXPECT_EQ(err->path, "a[0].b.c");
  EXPECT_NE(err->message.find("4 levels"), std::string::npos) << err->message;
  EXPECT_TRUE(out.is_null());  // nothing half-built is handed back

  // 21,700 levels (the crash report's body): refused at level 129 without recursion.
  const std::string deep = "{\"tools\":[{\"function\":{\"parameters\":" + std::string(21700, '[') + std::string(21700, ']') + "}}]}";
  err = parse_json_limited(deep, JsonLimits{}, out);
  ASSERT_TRUE(err.has_value());
  EXPECT_EQ(err->kind, JsonLimitError::Kind::Depth);
  EXPECT_EQ(err->path.rfind("tools[0].function.parameters[0][0]", 0), 0u) << err->path;
  EXPECT_NE(err->path.find("..."), std::string::npos) << err->path;

  lim = JsonLimits{};
  lim.max_keys = 3;
  EXPECT_FALSE(parse_json_limited(R"({"x":{"a":1,"b":2,"c":3,"a":4}})", lim, out).has_value());  // a repeat is no new key
  err = parse_json_limited(R"({"x":{"a":1,"b":2,"c":3,"d":4}})", lim, out);
  ASSERT_TRUE(err.has_value());
  EXPECT_EQ(err->kind, JsonLimitError::Kind::Keys);
  EXPECT_EQ(err->path, "x.d");

  err = parse_json_limited(R"({"a":)", JsonLimits{}, out);
  ASSERT_TRUE(err.has_value());
  EXPECT_EQ(err->kind, JsonLimitError::Kind::Syntax);
  EXPECT_NE(err->message.find("parse error"), std::string::npos) << err->message;
}

// ordered_json::parse looks each key up linearly (63 s for this body); the bounded parser is linear.
TEST(JsonLimits, ManyKeysParseInLinearTime) {
  std::string body = "{\"ignored\":{";
  for (int i = 0; i < 300000; ++i) body += (i ? ",\"" : "\"") + std::to_string(i) + "\":0";
  body += "}}";
  JsonLimits lim;
  lim.max_keys = 1000000;
  const auto t0 = std::chrono::steady_clock::now();
  json out = parse_limited(body, lim);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(out["ignored"].size(), 300000u);
  EXPECT_LT(s, 5.0);  // well under a second on one core; the bound is for sanitizer builds
  // The default limit refuses it at the 10,001st key.
  auto err = parse_json_limited(body, JsonLimits{}, out);
  ASSERT_TRUE(err.has_value());
  EXPECT_EQ(err->kind, JsonLimitError::Kind::Keys);
  EXPECT_EQ(err->path, "ignored.10000");
}

TEST(JsonLimits, StringifyIsNotRecursive) {
  json v = json::array();
  for (int i = 0; i < 200000; ++i) {
    json outer = json::array();
    outer.push_back(std::move(v));
    v = std::move(outer);
  }
  const std::string s = chat::stringify_python_style(v);
  EXPECT_EQ(s.size(), 400002u);
  EXPECT_EQ(s.substr(0, 3), "[[[");
  EXPECT_EQ(chat::stringify_python_style(json::parse(R"({"b":[1,{"c":null}],"a":"x","e":[]})")),
            R"({"b": [1, {"c": null}], "a": "x", "e": []})");
}

TEST(OpenAIRequest, DeepToolCallArgumentsTextIs400) {
  const std::string deep_args = std::string(200, '[') + std::string(200, ']');
  json body = {{"messages",
                {user("x"),
                 {{"role", "assistant"}, {"tool_calls", {{{"function", {{"name", "f"}, {"arguments", deep_args}}}}}}},
                 {{"role", "tool"}, {"tool_call_id", "1"}, {"content", "r"}}}}};
  for (auto format : {chat::ChatFormat::DeepSeekV41, chat::ChatFormat::DeepSeekV3}) {
    auto r = convert(body, format);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error->field, "messages[1].tool_calls[0].function.arguments");
    EXPECT_NE(r.error->message.find("128 levels"), std::string::npos) << r.error->message;
  }
  // Within the limit it renders as before.
  body["messages"][1]["tool_calls"][0]["function"]["arguments"] = R"({"a":[[1]]})";
  EXPECT_TRUE(convert(body).ok());
  // The renderer holds its own bound too (callers that skip the protocol layer).
  chat::ChatRequest req;
  chat::Message u;
  u.content = "x";
  req.messages.push_back(u);
  chat::Message a;
  a.role = chat::Role::Assistant;
  a.content = "";
  a.tool_calls = std::vector<chat::ToolCall>{{"id", "function", "f", deep_args}};
  req.messages.push_back(a);
  req.messages.push_back(u);
  EXPECT_THROW(chat::render_chat(chat::ChatFormat::DeepSeekV41, req), chat::ChatError);
}

TEST(OpenAIRequest, EmptyStopStringIs400) {
  expect_error({{"messages", {user("x")}}, {"stop", ""}}, "stop");
  expect_error({{"messages", {user("x")}}, {"stop", {"END", ""}}}, "stop[1]");
  auto r = convert({{"messages", {user("x")}}, {"stop", {"END"}}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.request->parser.stop_sequences, std::vector<std::string>{"END"});
}

TEST(OpenAIRequest, ParallelToolCallsFalseLimitsTheParser) {
  auto r = convert({{"messages", {user("x")}}, {"tools", {kTool}}, {"parallel_tool_calls", false}});
  ASSERT_TRUE(r.ok()) << r.error->message;
  EXPECT_EQ(r.request->parser.max_tool_calls, 1);
  r = convert({{"messages", {user("x")}}, {"tools", {kTool}}, {"parallel_tool_calls", true}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.request->parser.max_tool_calls, 0);
  r = convert({{"messages", {user("x")}}, {"tools", {kTool}}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.request->parser.max_tool_calls, 0);
  expect_error({{"messages", {user("x")}}, {"parallel_tool_calls", "no"}}, "parallel_tool_calls");
}

}  // namespace

TEST(OpenAIRequest, StructuredOutputFieldsAndThinkingOff) {
  const json schema = {{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}};
  auto r = convert({{"messages", {user("q")}},
                    {"reasoning_effort", "high"},
                    {"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "x"}, {"schema", schema}, {"strict", true}}}}}});
  ASSERT_TRUE(r.ok()) << r.error->message;
  const auto& so = r.request->structured;
  EXPECT_EQ(so.kind, openai::StructuredOutput::Kind::JsonSchema);
  EXPECT_EQ(so.schema.dump(), json(schema).dump());
  EXPECT_TRUE(so.strict);
  EXPECT_EQ(so.field, "response_format.json_schema.schema");
  // The grammar starts at the first output token: no reasoning before it.
  EXPECT_FALSE(r.request->chat.thinking);
  EXPECT_FALSE(r.request->parser.start_in_reasoning);

  auto obj = convert({{"messages", {user("q")}}, {"response_format", {{"type", "json_object"}}}});
  ASSERT_TRUE(obj.ok());
  EXPECT_EQ(obj.request->structured.kind, openai::StructuredOutput::Kind::JsonObject);
  EXPECT_TRUE(obj.request->chat.json_mode);

  auto guided = convert({{"messages", {user("q")}}, {"thinking", {{"type", "enabled"}}}, {"guided_regex", "a+"}});
  ASSERT_TRUE(guided.ok());
  EXPECT_EQ(guided.request->structured.kind, openai::StructuredOutput::Kind::None);  // read by the API layer
  EXPECT_FALSE(guided.request->chat.thinking);

  auto free = convert({{"messages", {user("q")}}, {"thinking", {{"type", "enabled"}}}});
  ASSERT_TRUE(free.ok());
  EXPECT_TRUE(free.request->chat.thinking);

  auto tools = convert({{"messages", {user("q")}}, {"tools", {kTool}}, {"tool_choice", "required"}, {"parallel_tool_calls", false}});
  ASSERT_TRUE(tools.ok());
  EXPECT_EQ(tools.request->structured.kind, openai::StructuredOutput::Kind::ToolCall);
  EXPECT_FALSE(tools.request->structured.parallel_tool_calls);
}
