// Request validation of the OpenAI API layer (no HTTP) and the completions stop-string matcher.
#include <gtest/gtest.h>

#include "grammar/compiled_grammar.h"
#include "grammar/grammar_compiler.h"
#include "grammar/matcher.h"
#include "openai/api.h"
#include "server/stop_matcher.h"
#include "openai/protocol.h"
#include "server_test_util.h"

namespace di::test {
namespace {

openai::ModelContext ctx() {
  openai::ModelContext c;
  c.tokenizer = v41_tokenizer();
  c.served_name = "m";
  c.vocab_size = c.tokenizer->vocab_size();
  c.bos_id = 0;
  c.eos_id = 1;
  c.max_context = 100;
  c.default_max_tokens = 1000;
  return c;
}

openai::GenerationSpec ok(const openai::ParseResult& r) {
  if (auto* e = std::get_if<openai::ApiError>(&r)) {
    ADD_FAILURE() << e->message;
    return {};
  }
  return std::get<openai::GenerationSpec>(r);
}

openai::ApiError err(const openai::ParseResult& r) {
  if (!std::holds_alternative<openai::ApiError>(r)) {
    ADD_FAILURE() << "expected an error";
    return {};
  }
  return std::get<openai::ApiError>(r);
}

TEST(ServerApi, ChatDefaultsClampToContext) {
  const auto c = ctx();
  auto r = openai::parse_chat_completion(R"({"messages":[{"role":"user","content":"Hi"}]})", c);
  const auto& s = ok(r);
  ASSERT_EQ(s.prompts.size(), 1u);
  const int P = int(s.prompts[0].size());
  EXPECT_EQ(s.max_tokens, 100 - P);  // default 1000 clamped to the context
  EXPECT_EQ(s.prompts[0][0], 0);     // BOS
  ASSERT_TRUE(s.parser.has_value());
  EXPECT_FALSE(s.parser->start_in_reasoning);
  EXPECT_FALSE(s.stream);
  EXPECT_EQ(s.n, 1);
}

TEST(ServerApi, ChatThinkingToolsJson) {
  auto c = ctx();
  c.max_context = 4096;  // the tools prompt is long
  auto think = openai::parse_chat_completion(R"({"messages":[{"role":"user","content":"Hi"}],"reasoning_effort":"high","max_tokens":5})", c);
  EXPECT_TRUE(ok(think).parser->start_in_reasoning);
  auto off = openai::parse_chat_completion(R"({"messages":[{"role":"user","content":"Hi"}],"thinking":{"type":"disabled"},"max_tokens":5})", c);
  EXPECT_FALSE(ok(off).parser->start_in_reasoning);
  auto js = openai::parse_chat_completion(
      R"({"messages":[{"role":"user","content":"Hi"}],"response_format":{"type":"json_object"},"max_tokens":5})", c);
  // JSON mode is a grammar (StructuredOutputCompilesGrammars), not a repair: without the grammar
  // compilers this context lacks, it is refused rather than ignored.
  EXPECT_EQ(err(js).param, "response_format");
  auto tools = openai::parse_chat_completion(
      R"({"messages":[{"role":"user","content":"Hi"}],"tools":[{"type":"function","function":{"name":"f"}}],"max_tokens":5})", c);
  EXPECT_TRUE(ok(tools).parser->parse_tool_calls);
  auto stop = openai::parse_chat_completion(R"({"messages":[{"role":"user","content":"Hi"}],"stop":"END","max_tokens":5})", c);
  EXPECT_EQ(ok(stop).parser->stop_sequences, std::vector<std::string>{"END"});
  auto mct = openai::parse_chat_completion(
      R"({"messages":[{"role":"user","content":"Hi"}],"max_tokens":5,"max_completion_tokens":7,"logprobs":true,"top_logprobs":4})", c);
  EXPECT_EQ(ok(mct).max_tokens, 7);
  EXPECT_EQ(ok(mct).sampling.top_logprobs, 4);
  EXPECT_EQ(ok(mct).sampling.logprobs, 1);
}

TEST(ServerApi, Errors) {
  const auto c = ctx();
  auto e = err(openai::parse_chat_completion(R"({"messages":[{"role":"user","content":"Hi"}],"model":"x"})", c));
  EXPECT_EQ(e.status, 404);
  EXPECT_EQ(e.param, "model");
  e = err(openai::parse_chat_completion(R"({"messages":[{"role":"user","content":"Hi"}],"top_k":-2})", c));
  EXPECT_EQ(e.param, "top_k");
  e = err(openai::parse_chat_completion(R"({"messages":[{"role":"user","content":"Hi"}],"min_p":2})", c));
  EXPECT_EQ(e.param, "min_p");
  e = err(openai::parse_chat_completion(R"({"messages":[{"role":"user","content":"Hi"}],"n":17})", c));
  EXPECT_EQ(e.param, "n");  // max_n
  e = err(openai::parse_chat_completion(R"({"messages":[{"role":"user","content":"Hi"}],"stop_token_ids":[1,-1]})", c));
  EXPECT_EQ(e.param, "stop_token_ids[1]");
  e = err(openai::parse_chat_completion(R"({"messages":[{"role":"user","content":"Hi"}],"max_tokens":99})", c));
  EXPECT_EQ(e.param, "max_tokens");
  EXPECT_EQ(e.code, "context_length_exceeded");
  e = err(openai::parse_completion("{\"prompt\":\"\xc3\x28\"}", c));
  EXPECT_EQ(e.code, "invalid_utf8");
  EXPECT_NE(e.message.find("byte offset 11"), std::string::npos) << e.message;
  e = err(openai::parse_completion(R"({"prompt":[1,2,200000]})", c));
  EXPECT_EQ(e.param, "prompt[2]");
  e = err(openai::parse_completion(R"({"prompt":"x","stream":false,"stream_options":{}})", c));
  EXPECT_EQ(e.param, "stream_options");
  const std::string body = openai::error_body(e);
  auto j = nlohmann::json::parse(body);
  EXPECT_EQ(j["error"]["param"], "stream_options");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
}

TEST(ServerApi, CompletionPrompts) {
  const auto c = ctx();
  const auto& s = ok(openai::parse_completion(R"({"prompt":"<｜begin▁of▁sentence｜>Hi","max_tokens":3})", c));
  ASSERT_EQ(s.prompts.size(), 1u);
  EXPECT_EQ(s.prompts[0][0], 0);
  EXPECT_NE(s.prompts[0][1], 0);  // BOS not doubled
  EXPECT_EQ(s.max_tokens, 3);
  const auto& d = ok(openai::parse_completion(R"({"prompt":[7,8]})", c));
  EXPECT_EQ(d.max_tokens, 16);  // OpenAI's completions default
  EXPECT_EQ(d.prompts[0], (std::vector<int32_t>{7, 8}));
  const auto& b = ok(openai::parse_completion(R"({"prompt":[[7],"x"],"n":2,"best_of":2})", c));
  EXPECT_EQ(b.prompts.size(), 2u);
  EXPECT_EQ(b.prompt_texts.size(), 2u);
  const auto& zero = ok(openai::parse_completion(R"({"prompt":"x","top_p":0,"temperature":1})", c));
  EXPECT_EQ(zero.sampling.temperature, 0.f);  // top_p 0 = greedy
  const auto& lp0 = ok(openai::parse_completion(R"({"prompt":"x","logprobs":0})", c));
  EXPECT_TRUE(lp0.logprobs);
  EXPECT_EQ(lp0.sampling.logprobs, 1);
  EXPECT_EQ(lp0.sampling.top_logprobs, 0);
}

std::string run_stop(std::vector<std::string> stops, const std::vector<std::string>& pieces, bool* matched = nullptr) {
  server::StopMatcher m(std::move(stops));
  std::string out;
  for (const auto& p : pieces) m.feed(p, out);
  m.finish(out);
  if (matched) *matched = m.matched();
  return out;
}

TEST(ServerApi, StopMatcherNeverLeaksAPartialStop) {
  bool matched = false;
  EXPECT_EQ(run_stop({"END"}, {"abc E", "N", "D tail"}, &matched), "abc ");
  EXPECT_TRUE(matched);
  EXPECT_EQ(run_stop({"END"}, {"abc EN", "X"}, &matched), "abc ENX");
  EXPECT_FALSE(matched);
  EXPECT_EQ(run_stop({"END"}, {"abc EN"}, &matched), "abc EN");  // flushed at the end
  EXPECT_EQ(run_stop({"xyz", "b"}, {"aaab"}, &matched), "aaa");   // earliest match wins
  EXPECT_EQ(run_stop({}, {"a", "b"}), "ab");
  // Streaming: nothing of the stop string is released before it is decided.
  server::StopMatcher m({"</s>"});
  std::string out;
  m.feed("hi <", out);
  EXPECT_EQ(out, "hi ");
  m.feed("/", out);
  EXPECT_EQ(out, "hi ");
  m.feed("s>bye", out);
  EXPECT_EQ(out, "hi ");
  EXPECT_TRUE(m.matched());
  // Every split of one text gives the same result.
  const std::string text = "one two STOP three";
  for (size_t i = 0; i <= text.size(); ++i)
    for (size_t j = i; j <= text.size(); ++j)
      EXPECT_EQ(run_stop({"STOP", "TWO"}, {text.substr(0, i), text.substr(i, j - i), text.substr(j)}), "one two ");
}

// A body nesting 21,700 levels (the crash report) is a 400 naming the field, decided while parsing.
TEST(ServerApi, DeepNestingIs400) {
  auto c = ctx();
  c.max_context = 4096;
  const std::string deep = std::string(21700, '[') + std::string(21700, ']');
  const std::string tools = R"({"messages":[{"role":"user","content":"Hi"}],"tools":[{"type":"function","function":{"name":"f","parameters":)" +
                            deep + "}}]}";
  auto e = err(openai::parse_chat_completion(tools, c));
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.code, "json_too_deep");
  EXPECT_EQ(e.param.rfind("tools[0].function.parameters", 0), 0u) << e.param;
  EXPECT_NE(e.message.find("128 levels"), std::string::npos) << e.message;
  EXPECT_NE(e.message.find("--max-json-depth"), std::string::npos) << e.message;
  const std::string args = R"({"messages":[{"role":"user","content":"Hi"},{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":)" +
                           deep + "}}]}]}";
  e = err(openai::parse_chat_completion(args, c));
  EXPECT_EQ(e.code, "json_too_deep");
  EXPECT_EQ(e.param.rfind("messages[1].tool_calls[0].function", 0), 0u) << e.param;
  e = err(openai::parse_completion(R"({"prompt":"x","extra":)" + deep + "}", c));
  EXPECT_EQ(e.code, "json_too_deep");
  // The limit is the server's to set.
  c.json_limits.max_depth = 3;
  EXPECT_EQ(err(openai::parse_completion(R"({"prompt":"x","a":[[[1]]]})", c)).param, "a[0][0]");
  ok(openai::parse_completion(R"({"prompt":"x","a":[[1]]})", c));
}

TEST(ServerApi, TooManyKeysIs400) {
  auto c = ctx();
  c.json_limits.max_keys = 100;
  std::string body = R"({"prompt":"x","ignored":{)";
  for (int i = 0; i < 101; ++i) body += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":0";
  body += "}}";
  auto e = err(openai::parse_completion(body, c));
  EXPECT_EQ(e.code, "json_too_many_keys");
  EXPECT_EQ(e.param, "ignored.k100");
  EXPECT_NE(e.message.find("--max-json-keys"), std::string::npos) << e.message;
  c.json_limits.max_keys = 101;
  ok(openai::parse_completion(body, c));
}

// The bounded parser must not change a prompt: tools are rendered in the client's key order.
TEST(ServerApi, PromptUnchangedByTheBoundedParser) {
  auto c = ctx();
  c.max_context = 8192;
  const std::string body =
      R"({"messages":[{"role":"system","content":"S"},{"role":"user","content":"Weather?"},)"
      R"({"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"get","arguments":"{\"z\":1,\"a\":[1.5e-7,{\"y\":null,\"b\":true}]}"}}]},)"
      R"({"role":"tool","tool_call_id":"c1","content":"sunny"}],)"
      R"("tools":[{"type":"function","function":{"name":"get","description":"d","parameters":{"type":"object","required":["z"],"properties":{"z":{"type":"integer"},"a":{"type":"array"}}}}}],)"
      R"("max_tokens":5})";
  const auto& s = ok(openai::parse_chat_completion(body, c));
  openai::ConversionOptions copt;
  copt.format = c.chat_format;
  auto conv = openai::convert_chat_request(nlohmann::ordered_json::parse(body), copt);
  ASSERT_TRUE(conv.ok());
  const auto expected = chat::encode_chat(*c.tokenizer, c.chat_format, conv.request->chat);
  EXPECT_EQ(s.prompts[0], expected.ids);
  EXPECT_NE(expected.prompt.text.find(R"({"type": "object", "required": ["z"], "properties": {"z": )"), std::string::npos)
      << expected.prompt.text;
}

// vLLM's answer: an empty stop string is a 400 on both endpoints.
TEST(ServerApi, EmptyStopIs400OnBothEndpoints) {
  const auto c = ctx();
  EXPECT_EQ(err(openai::parse_completion(R"({"prompt":"x","stop":""})", c)).param, "stop");
  EXPECT_EQ(err(openai::parse_completion(R"({"prompt":"x","stop":["a",""]})", c)).param, "stop[1]");
  EXPECT_EQ(err(openai::parse_chat_completion(R"({"messages":[{"role":"user","content":"Hi"}],"stop":""})", c)).param, "stop");
  EXPECT_EQ(err(openai::parse_chat_completion(R"({"messages":[{"role":"user","content":"Hi"}],"stop":["a",""]})", c)).param,
            "stop[1]");
}

TEST(ServerApi, TokenizeAndDetokenize) {
  auto c = ctx();
  c.max_context = 4096;
  auto r = openai::tokenize_request(R"({"model":"m","prompt":"Hello world"})", c);
  ASSERT_TRUE(std::holds_alternative<std::string>(r));
  auto j = nlohmann::json::parse(std::get<std::string>(r));
  std::vector<int32_t> ids = j["tokens"].get<std::vector<int32_t>>();
  EXPECT_EQ(ids.front(), 0);  // BOS, as /v1/completions encodes a prompt
  EXPECT_EQ(j["count"], ids.size());
  EXPECT_EQ(j["max_model_len"], 4096);
  EXPECT_EQ(ids, ok(openai::parse_completion(R"({"prompt":"Hello world"})", c)).prompts[0]);
  auto plain = nlohmann::json::parse(std::get<std::string>(openai::tokenize_request(
      R"({"prompt":"Hello world","add_special_tokens":false,"return_token_strs":true})", c)));
  EXPECT_EQ(plain["count"], ids.size() - 1);
  EXPECT_EQ(plain["token_strs"].size(), ids.size() - 1);
  EXPECT_EQ(plain["token_strs"][0], "Hello");

  // Messages render exactly as chat completions does.
  const std::string chat = R"({"messages":[{"role":"user","content":"Hi"}],"thinking":{"type":"enabled"}})";
  auto cj = nlohmann::json::parse(std::get<std::string>(openai::tokenize_request(chat, c)));
  EXPECT_EQ(cj["tokens"].get<std::vector<int32_t>>(), ok(openai::parse_chat_completion(chat, c)).prompts[0]);

  auto d = openai::detokenize_request(R"({"tokens":[)" + std::to_string(ids[1]) + "," + std::to_string(ids[2]) + "]}", c);
  ASSERT_TRUE(std::holds_alternative<std::string>(d));
  EXPECT_EQ(nlohmann::json::parse(std::get<std::string>(d))["prompt"], "Hello world");
  EXPECT_EQ(nlohmann::json::parse(std::get<std::string>(openai::detokenize_request(R"({"tokens":[]})", c)))["prompt"], "");

  auto bad = std::get<openai::ApiError>(openai::detokenize_request(R"({"tokens":[5,-1]})", c));
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(bad.param, "tokens[1]");
  bad = std::get<openai::ApiError>(openai::detokenize_request(R"({"tokens":[5,)" + std::to_string(c.vocab_size) + "]}", c));
  EXPECT_EQ(bad.param, "tokens[1]");
  EXPECT_EQ(std::get<openai::ApiError>(openai::detokenize_request(R"({"tokens":"5"})", c)).param, "tokens");
  EXPECT_EQ(std::get<openai::ApiError>(openai::tokenize_request(R"({"prompt":"x","model":"other"})", c)).status, 404);
  EXPECT_EQ(std::get<openai::ApiError>(openai::tokenize_request(R"({})", c)).param, "prompt");
  EXPECT_EQ(std::get<openai::ApiError>(openai::tokenize_request(R"({"prompt":"x","messages":[]})", c)).param, "prompt");
}

TEST(ServerApi, StructuredOutputCompilesGrammars) {
  auto c = ctx();
  c.max_context = 4096;
  // Without compilers the fields are refused by name, not ignored.
  const auto none = err(openai::parse_completion(R"({"prompt":"x","guided_regex":"a+"})", c));
  EXPECT_EQ(none.param, "guided_regex");
  openai::attach_grammar_compilers(c, c.vocab_size);
  ASSERT_TRUE(c.grammars && c.tool_grammars);
  EXPECT_EQ(c.grammars->vocab().mask_size(), c.vocab_size);

  auto accepts = [](const std::shared_ptr<const grammar::CompiledGrammar>& g, const std::string& text) {
    grammar::GrammarMatcher m(g);
    return m.accept_bytes(text) && m.can_end();
  };
  const auto js = ok(openai::parse_chat_completion(
      R"({"messages":[{"role":"user","content":"Hi"}],"response_format":{"type":"json_object"},"max_tokens":5})", c));
  ASSERT_TRUE(js.grammar);
  EXPECT_TRUE(accepts(js.grammar, R"({"a":[1,true]})"));
  EXPECT_FALSE(accepts(js.grammar, R"({"a":1} done)"));

  const auto sch = ok(openai::parse_chat_completion(
      R"({"messages":[{"role":"user","content":"Hi"}],"max_tokens":5,"response_format":{"type":"json_schema","json_schema":{"name":"x","strict":true,"schema":{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}}}})",
      c));
  ASSERT_TRUE(sch.grammar);
  EXPECT_TRUE(accepts(sch.grammar, R"({"n":12})"));
  EXPECT_FALSE(accepts(sch.grammar, R"({"n":"12"})"));
  EXPECT_FALSE(accepts(sch.grammar, R"({})"));

  const auto gj = ok(openai::parse_completion(R"({"prompt":"x","guided_json":"{\"type\":\"boolean\"}"})", c));
  ASSERT_TRUE(gj.grammar);
  EXPECT_TRUE(accepts(gj.grammar, "false"));
  const auto re = ok(openai::parse_completion(R"({"prompt":"x","guided_regex":"[0-9]{2}-[a-z]"})", c));
  ASSERT_TRUE(re.grammar);
  EXPECT_TRUE(accepts(re.grammar, "42-q"));
  EXPECT_FALSE(accepts(re.grammar, "4-q"));
  const auto eb = ok(openai::parse_completion(R"({"prompt":"x","guided_grammar":"root ::= \"a\" | \"bc\""})", c));
  ASSERT_TRUE(eb.grammar);
  EXPECT_TRUE(accepts(eb.grammar, "bc"));

  // The same schema twice: one compile, one shared grammar.
  const auto again = ok(openai::parse_completion(R"({"prompt":"x","guided_regex":"[0-9]{2}-[a-z]"})", c));
  EXPECT_EQ(again.grammar.get(), re.grammar.get());

  // Errors name the field.
  EXPECT_EQ(err(openai::parse_chat_completion(
                    R"({"messages":[{"role":"user","content":"Hi"}],"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"array","uniqueItems":true}}}})",
                    c))
                .param,
            "response_format.json_schema.schema");
  const auto bad_schema = err(openai::parse_completion(R"({"prompt":"x","guided_json":{"type":"object","patternProperties":{}}})", c));
  EXPECT_EQ(bad_schema.param, "guided_json");
  EXPECT_NE(bad_schema.message.find("patternProperties"), std::string::npos) << bad_schema.message;
  EXPECT_EQ(err(openai::parse_completion(R"({"prompt":"x","guided_regex":"(a"})", c)).param, "guided_regex");
  EXPECT_EQ(err(openai::parse_completion(R"({"prompt":"x","guided_grammar":"root ::= \"x\" root"})", c)).param, "guided_grammar");
  EXPECT_EQ(err(openai::parse_completion(R"({"prompt":"x","guided_regex":"a","guided_json":{}})", c)).param, "guided_regex");
  EXPECT_EQ(err(openai::parse_completion(R"({"prompt":"x","guided_regex":3})", c)).param, "guided_regex");

  // A forced call: DSML with the calls block opened by the prompt, the control token as text.
  const auto tc = ok(openai::parse_chat_completion(
      R"({"messages":[{"role":"user","content":"Hi"}],"max_tokens":50,"parallel_tool_calls":false,"tool_choice":"required",)"
      R"("tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}}}]})",
      c));
  ASSERT_TRUE(tc.grammar);
  EXPECT_EQ(&tc.grammar->vocab(), &c.tool_grammars->vocab());
  const std::string call = "<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"n\" string=\"false\">7</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>";
  EXPECT_TRUE(accepts(tc.grammar, call));
  EXPECT_FALSE(accepts(tc.grammar, "hello"));
  const int32_t dsml = *c.tokenizer->token_to_id("｜DSML｜");
  grammar::GrammarMatcher m(tc.grammar);
  ASSERT_TRUE(m.accept_bytes("<"));
  EXPECT_TRUE(m.accept_token(dsml)) << "the control token spells its text in a tool-call grammar";
  grammar::GrammarMatcher mj(js.grammar);
  ASSERT_TRUE(mj.accept_bytes("{\""));
  EXPECT_FALSE(mj.accept_token(dsml)) << "control tokens never appear under other grammars";
}

}  // namespace
}  // namespace di::test
