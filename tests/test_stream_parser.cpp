// Streaming output parser: every output gives the same events however it is split into chunks (every
// two-way split at each byte, one byte at a time, random many-way splits); stop strings, malformed
// markup and a fuzz run over arbitrary bytes.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "tokenizer/stream_parser.h"

using namespace di::stream;
using nlohmann::json;

namespace {

std::vector<StreamEvent> parse_chunks(const ParserOptions& opt, const std::vector<std::string>& chunks,
                                      StopCause cause = StopCause::EndOfText) {
  StreamParser parser(opt);
  std::vector<StreamEvent> all, step;
  for (const std::string& c : chunks) {
    step.clear();
    parser.feed(c, step);
    all.insert(all.end(), step.begin(), step.end());
  }
  step.clear();
  parser.finish(cause, step);
  all.insert(all.end(), step.begin(), step.end());
  // Chunking only changes where text events are cut: merge neighbours of one kind.
  std::vector<StreamEvent> merged;
  for (StreamEvent& e : all) {
    const bool textual = e.kind == EventKind::Reasoning || e.kind == EventKind::Content || e.kind == EventKind::Invalid ||
                         e.kind == EventKind::ToolCallArguments;
    if (textual && !merged.empty() && merged.back().kind == e.kind && merged.back().tool_index == e.tool_index) {
      merged.back().text += e.text;
    } else {
      merged.push_back(std::move(e));
    }
  }
  return merged;
}

std::vector<StreamEvent> parse(const ParserOptions& opt, const std::string& text, StopCause cause = StopCause::EndOfText) {
  return parse_chunks(opt, {text}, cause);
}

std::string describe(const std::vector<StreamEvent>& events) {
  static const char* names[] = {"reasoning", "content", "begin", "args", "end", "invalid", "finish"};
  json j = json::array();
  for (const auto& e : events) j.push_back({names[static_cast<int>(e.kind)], e.tool_index, e.text});
  return j.dump();
}

// The property the issue asks for: identical events for every way of splitting the output.
void expect_split_invariant(const ParserOptions& opt, const std::string& text, const std::vector<StreamEvent>& expected,
                            StopCause cause = StopCause::EndOfText) {
  ASSERT_EQ(describe(parse(opt, text, cause)), describe(expected)) << "whole text";
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    auto got = parse_chunks(opt, {text.substr(0, cut), text.substr(cut)}, cause);
    ASSERT_EQ(describe(got), describe(expected)) << "split at byte " << cut;
  }
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  ASSERT_EQ(describe(parse_chunks(opt, bytes, cause)), describe(expected)) << "byte by byte";
  std::mt19937 rng(1234);
  for (int round = 0; round < 60; ++round) {
    std::vector<std::string> chunks;
    size_t pos = 0;
    while (pos < text.size()) {
      size_t n = 1 + rng() % 9;
      chunks.push_back(text.substr(pos, n));
      pos += n;
    }
    ASSERT_EQ(describe(parse_chunks(opt, chunks, cause)), describe(expected)) << "random split round " << round;
  }
}

StreamEvent ev(EventKind k, std::string text = "", int idx = -1) { return StreamEvent{k, std::move(text), idx}; }
StreamEvent content(std::string t) { return ev(EventKind::Content, std::move(t)); }
StreamEvent reasoning(std::string t) { return ev(EventKind::Reasoning, std::move(t)); }
StreamEvent begin(int i, std::string name) { return ev(EventKind::ToolCallBegin, std::move(name), i); }
StreamEvent args(int i, std::string a) { return ev(EventKind::ToolCallArguments, std::move(a), i); }
StreamEvent end(int i) { return ev(EventKind::ToolCallEnd, "", i); }
StreamEvent invalid(std::string t) { return ev(EventKind::Invalid, std::move(t)); }
StreamEvent finish(std::string r) { return ev(EventKind::Finish, std::move(r)); }

ParserOptions thinking() {
  ParserOptions o;
  o.start_in_reasoning = true;
  return o;
}

TEST(StreamParser, ReasoningThenAnswer) {
  expect_split_invariant(thinking(), "\nLet me think: 日本語 🙂.\n\n</think>\n\nThe answer is 4.",
                         {reasoning("Let me think: 日本語 🙂."), content("The answer is 4."), finish("stop")});
}

TEST(StreamParser, PlainContentKeepsInnerNewlinesDropsLeadingOnes) {
  expect_split_invariant(ParserOptions{}, "\n\nline 1\n\nline 2\n", {content("line 1\n\nline 2\n"), finish("stop")});
}

const std::string kDsmlV41 =
    "I'll check.\n\n<｜DSML｜ calls>\n"
    "<｜DSML｜ invoke name=\"submit\">\n"
    "<｜DSML｜ parameter name=\"shipping address\" string=\"true\">Paris\n日本 \"q\" \\</｜DSML｜ parameter>\n"
    "<｜DSML｜ parameter name=\" string= mode \" string=\"false\">{\"enabled\":true}</｜DSML｜ parameter>\n"
    "<｜DSML｜ parameter name=\"count\" string=\"false\">2</｜DSML｜ parameter>\n"
    "<｜DSML｜ parameter name=\"\" string=\"true\">empty key</｜DSML｜ parameter>\n"
    "</｜DSML｜ invoke>\n"
    "<｜DSML｜ invoke name=\"done\">\n</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>";

TEST(StreamParser, DsmlV41ToolCalls) {
  ParserOptions o;
  const std::string expected_args =
      R"({"shipping address": "Paris\n日本 \"q\" \\", " string= mode ": {"enabled":true}, "count": 2, "": "empty key"})";
  expect_split_invariant(o, kDsmlV41,
                         {content("I'll check."), begin(0, "submit"), args(0, expected_args), end(0), begin(1, "done"),
                          args(1, "{}"), end(1), finish("tool_calls")});
  EXPECT_EQ(json::parse(expected_args),
            json::parse(R"({"shipping address": "Paris\n日本 \"q\" \\", " string= mode ": {"enabled": true}, "count": 2, "": "empty key"})"));
}

TEST(StreamParser, DsmlV4TagsAndTextAfterTheBlockIsInvalid) {
  std::string v4 = kDsmlV41;
  for (auto [from, to] : {std::pair<std::string, std::string>{"｜DSML｜ calls", "｜DSML｜tool_calls"},
                          {"｜DSML｜ invoke", "｜DSML｜invoke"},
                          {"｜DSML｜ parameter", "｜DSML｜parameter"}}) {
    for (size_t p = v4.find(from); p != std::string::npos; p = v4.find(from, p + to.size())) v4.replace(p, from.size(), to);
  }
  ParserOptions o;
  auto events = parse(o, v4 + "\ntrailing");
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events[1].text, "submit");
  EXPECT_EQ(events.back().text, "tool_calls");
  EXPECT_EQ(events[events.size() - 2].kind, EventKind::Invalid);
  EXPECT_EQ(events[events.size() - 2].text, "\ntrailing");
}

TEST(StreamParser, ThinkingToolCallAndRequiredPrefill) {
  expect_split_invariant(thinking(),
                         "plan</think><｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"x\" "
                         "string=\"false\">[1, 2]</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
                         {reasoning("plan"), begin(0, "f"), args(0, R"({"x": [1, 2]})"), end(0), finish("tool_calls")});
  ParserOptions req;
  req.start_in_tool_calls = true;
  expect_split_invariant(req,
                         "<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"s\" string=\"true\">v</｜DSML｜ parameter>\n"
                         "</｜DSML｜ invoke>\n</｜DSML｜ calls>",
                         {begin(0, "f"), args(0, R"({"s": "v"})"), end(0), finish("tool_calls")});
}

TEST(StreamParser, MalformedDsmlNeverLeaksMarkupIntoArguments) {
  ParserOptions o;
  // A value left open before the next parameter, a Python-style non-JSON value, a missing string
  // attribute, a missing invoke closer, then the output stops mid-value.
  const std::string text =
      "<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n"
      "<｜DSML｜ parameter name=\"a\" string=\"true\">x\n"
      "<｜DSML｜ parameter name=\"b\" string=\"false\">True</｜DSML｜ parameter>\n"
      "<｜DSML｜ parameter name=\"n\">5</｜DSML｜ parameter>\n"
      "<｜DSML｜ invoke name=\"g\">\n<｜DSML｜ parameter name=\"t\" string=\"true\">unfinish";
  auto events = parse(o, text);
  expect_split_invariant(o, text, events);
  std::vector<std::string> call_args(2);
  for (const auto& e : events) {
    if (e.kind == EventKind::ToolCallArguments) call_args.at(e.tool_index) += e.text;
    EXPECT_EQ(e.text.find("DSML"), std::string::npos) << describe(events);
  }
  EXPECT_EQ(json::parse(call_args[0]), json::parse(R"({"a": "x", "b": "True", "n": 5})"));
  EXPECT_EQ(json::parse(call_args[1]), json::parse(R"({"t": "unfinish"})"));
  EXPECT_EQ(events.back().text, "tool_calls");
}

TEST(StreamParser, EveryTruncationLeavesValidArguments) {
  ParserOptions o;
  for (size_t cut = 0; cut <= kDsmlV41.size(); ++cut) {
    auto events = parse(o, kDsmlV41.substr(0, cut), StopCause::Length);
    std::vector<std::string> call_args(3);
    for (const auto& e : events)
      if (e.kind == EventKind::ToolCallArguments) call_args.at(e.tool_index) += e.text;
    for (const auto& a : call_args)
      if (!a.empty()) EXPECT_TRUE(json::parse(a, nullptr, false).is_object()) << "cut " << cut << ": " << a;
  }
}

TEST(StreamParser, StopSequences) {
  ParserOptions o;
  o.stop_sequences = {"STOP", "", "</end>"};
  expect_split_invariant(o, "Hello STOP world", {content("Hello "), invalid(" world"), finish("stop")});
  expect_split_invariant(o, "a</en", {content("a</en"), finish("stop")});  // never completed: it is text
  // Nothing of a possible stop string is released before it is decided.
  StreamParser p(o);
  std::vector<StreamEvent> out;
  p.feed("Hello ST", out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].text, "Hello ");
  out.clear();
  p.feed("OP tail", out);
  EXPECT_TRUE(p.done());
  EXPECT_EQ(p.matched_stop(), "STOP");
  // Stop strings do not apply inside reasoning.
  ParserOptions t = thinking();
  t.stop_sequences = {"STOP"};
  expect_split_invariant(t, "STOP in thought</think>then STOP here",
                         {reasoning("STOP in thought"), content("then "), invalid(" here"), finish("stop")});
}

TEST(StreamParser, JsonModeStripsFences) {
  ParserOptions o;
  o.parse_json_output = true;
  expect_split_invariant(o, "```json\n{\"a\": [1, 2]}\n```\nThanks", {content("{\"a\": [1, 2]}"), finish("stop")});
  expect_split_invariant(o, "Sure: [1, 2]", {content("[1, 2]"), finish("stop")});
  expect_split_invariant(o, "```\n{}\n```", {content("{}"), finish("stop")});
}

TEST(StreamParser, V3ToolCalls) {
  ParserOptions o;
  o.syntax = ToolCallSyntax::V3;
  expect_split_invariant(
      o,
      "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
      "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\nnot json\n```<｜tool▁call▁end｜>"
      "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
      {content("Checking."), begin(0, "get_weather"), args(0, "{\"city\": \"Paris\"}"), end(0), begin(1, "f"),
       args(1, "{\"arguments\": \"not json\"}"), end(1), invalid("<｜end▁of▁sentence｜>"), finish("tool_calls")});
}

TEST(StreamParser, V31ToolCallsAndR1Reasoning) {
  ParserOptions o;
  o.syntax = ToolCallSyntax::V31;
  expect_split_invariant(o,
                         "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"q\": \"x\"}<｜tool▁call▁end｜>"
                         "<｜tool▁call▁begin｜>now<｜tool▁sep｜><｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                         {content("Sure."), begin(0, "search"), args(0, "{\"q\": \"x\"}"), end(0), begin(1, "now"),
                          args(1, "{}"), end(1), finish("tool_calls")});
  ParserOptions r1 = thinking();
  r1.syntax = ToolCallSyntax::V3;
  expect_split_invariant(r1, "Hmm.\n</think>\n\nAnswer</think>", {reasoning("Hmm."), content("Answer"), invalid("</think>"), finish("stop")});
}

TEST(StreamParser, UnclosedReasoningKeepsTheAnswer) {
  expect_split_invariant(thinking(), "just an answer", {reasoning("just an answer"), content("just an answer"), finish("stop")});
  // Cut off by max_tokens it is genuinely unfinished reasoning.
  expect_split_invariant(thinking(), "still thinking", {reasoning("still thinking"), finish("length")}, StopCause::Length);
  ParserOptions recipe_exact = thinking();
  recipe_exact.unclosed_reasoning_as_content = false;
  expect_split_invariant(recipe_exact, "just an answer", {reasoning("just an answer"), finish("stop")});
  // A partial "</thi" at the very end is flushed, not lost.
  expect_split_invariant(thinking(), "ab</thi", {reasoning("ab</thi"), content("ab</thi"), finish("stop")});
}

TEST(StreamParser, InvalidUtf8BecomesReplacementCharacter) {
  auto events = parse(ParserOptions{}, std::string("a\xff" "b\xe3\x81"));
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].text, "a\xEF\xBF\xBD" "b\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(StreamParser, FuzzArbitraryBytesNeverCrashOrBreakJson) {
  const std::vector<std::string> pieces = {
      "<｜DSML｜", "</｜DSML｜", " calls>", "tool_calls>", " invoke name=\"", " parameter name=\"", "\" string=\"", "true\">",
      "false\">", "\"", ">", "\n", "</think>", "```json\n", "\n```", "{", "[", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
      "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "STOP", "x", "日", "\\", "1"};
  std::mt19937 rng(99);
  const auto t0 = std::chrono::steady_clock::now();
  for (int iter = 0; iter < 20000; ++iter) {
    std::string text;
    const int n = rng() % 40;
    for (int i = 0; i < n; ++i) {
      if (rng() % 4 == 0) {
        text += static_cast<char>(rng() % 256);
      } else {
        text += pieces[rng() % pieces.size()];
      }
    }
    ParserOptions o;
    o.syntax = static_cast<ToolCallSyntax>(rng() % 3);
    o.start_in_reasoning = rng() % 2;
    o.start_in_tool_calls = rng() % 4 == 0;
    o.parse_json_output = rng() % 4 == 0;
    if (rng() % 2) o.stop_sequences = {"STOP"};
    std::vector<std::string> chunks;
    for (size_t pos = 0; pos < text.size();) {
      size_t len = 1 + rng() % 7;
      chunks.push_back(text.substr(pos, len));
      pos += len;
    }
    auto events = parse_chunks(o, chunks, rng() % 2 ? StopCause::Length : StopCause::EndOfText);
    ASSERT_FALSE(events.empty());
    ASSERT_EQ(events.back().kind, EventKind::Finish);
    std::map<int, std::string> call_args;
    for (const auto& e : events) {
      // Every text is valid UTF-8 (json::dump throws otherwise).
      ASSERT_NO_THROW((void)json(e.text).dump()) << describe(events);
      if (e.kind == EventKind::ToolCallArguments) call_args[e.tool_index] += e.text;
    }
    for (const auto& [idx, a] : call_args)
      ASSERT_TRUE(json::parse(a, nullptr, false).is_object()) << "call " << idx << " args " << a;
    // Same events whole and chunked.
    ASSERT_EQ(describe(parse(o, text, StopCause::EndOfText)), describe(parse_chunks(o, chunks, StopCause::EndOfText)));
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
}

}  // namespace

namespace {

// parallel_tool_calls: false -> the output ends with the first complete call; the rest is dropped.
TEST(StreamParser, MaxToolCallsEndsAfterTheFirstCall) {
  ParserOptions o;
  o.max_tool_calls = 1;
  const std::string first_args =
      R"({"shipping address": "Paris\n日本 \"q\" \\", " string= mode ": {"enabled":true}, "count": 2, "": "empty key"})";
  const std::string rest = kDsmlV41.substr(kDsmlV41.find("</｜DSML｜ invoke>") + std::string("</｜DSML｜").size());
  expect_split_invariant(o, kDsmlV41,
                         {content("I'll check."), begin(0, "submit"), args(0, first_args), end(0), invalid(rest),
                          finish("tool_calls")});
  // done() turns true as soon as the first call is complete, so generation stops there.
  StreamParser p(o);
  std::vector<StreamEvent> out;
  p.feed(kDsmlV41.substr(0, kDsmlV41.find("</｜DSML｜ invoke>")), out);
  EXPECT_FALSE(p.done());
  p.feed("</｜DSML｜ invoke>\n", out);
  EXPECT_TRUE(p.done());
  EXPECT_EQ(p.tool_call_count(), 1);

  ParserOptions v3;
  v3.syntax = ToolCallSyntax::V3;
  v3.max_tool_calls = 1;
  const std::string second = "\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  expect_split_invariant(v3,
                         "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
                         "<｜tool▁call▁end｜>" + second,
                         {begin(0, "get_weather"), args(0, "{\"city\": \"Paris\"}"), end(0), invalid(second), finish("tool_calls")});
  // A first invoke left unclosed still ends (with valid arguments) where the second one starts.
  const std::string unclosed =
      "<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"a\">\n<｜DSML｜ parameter name=\"x\" string=\"false\">1</｜DSML｜ parameter>\n"
      "<｜DSML｜ invoke name=\"b\">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>";
  const std::string tail = unclosed.substr(unclosed.find("<｜DSML｜ invoke name=\"b\"") + std::string("<｜DSML｜ invoke name=\"").size());
  expect_split_invariant(o, unclosed, {begin(0, "a"), args(0, "{\"x\": 1}"), end(0), invalid(tail), finish("tool_calls")});
  // Unlimited (the default) keeps both calls.
  ParserOptions all;
  EXPECT_EQ(parse(all, kDsmlV41).size(), 8u);
}

}  // namespace
