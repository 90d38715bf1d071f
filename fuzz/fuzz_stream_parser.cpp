// The streaming output parser (src/tokenizer/stream_parser.*) and the OpenAI message/delta builders
// on top of it. Properties: the events do not depend on how the output is cut into chunks; Finish
// comes last, once; every text is valid UTF-8; each tool call's arguments form one JSON object; the
// streamed deltas and the non-streaming message carry the same content, reasoning and arguments.
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "openai/protocol.h"
#include "tokenizer/stream_parser.h"
#include "tokenizer/text_utf8.h"

using namespace di;
using stream::EventKind;
using stream::StreamEvent;

namespace {

std::vector<StreamEvent> run(const stream::ParserOptions& opt, const std::vector<std::string_view>& chunks, stream::StopCause cause,
                             std::vector<std::vector<StreamEvent>>* batches = nullptr) {
  stream::StreamParser parser(opt);
  std::vector<StreamEvent> all, step;
  for (auto c : chunks) {
    step.clear();
    parser.feed(c, step);
    if (batches) batches->push_back(step);
    all.insert(all.end(), step.begin(), step.end());
  }
  step.clear();
  parser.finish(cause, step);
  if (batches) batches->push_back(step);
  all.insert(all.end(), step.begin(), step.end());
  // Chunking only moves the cuts between text events: merge neighbours of one kind.
  std::vector<StreamEvent> merged;
  for (auto& e : all) {
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

std::string describe(const std::vector<StreamEvent>& events) {
  static const char* names[] = {"reasoning", "content", "begin", "args", "end", "invalid", "finish"};
  nlohmann::json j = nlohmann::json::array();
  for (const auto& e : events) j.push_back({names[int(e.kind)], e.tool_index, e.text});
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in(data, size);
  const uint8_t a = in.byte(), b = in.byte(), cut_seed = in.byte();
  stream::ParserOptions opt;
  opt.syntax = static_cast<stream::ToolCallSyntax>((a & 3) % 3);
  opt.parse_tool_calls = !(a & 4);
  opt.start_in_tool_calls = a & 8;
  opt.start_in_reasoning = a & 16;
  opt.parse_json_output = a & 32;
  opt.unclosed_reasoning_as_content = !(a & 64);
  const auto cause = (a & 128) ? stream::StopCause::Length : stream::StopCause::EndOfText;
  // Up to two stop sequences taken from the input: length byte, then the bytes.
  for (int i = 0; i < (b & 3) % 3; ++i) {
    const size_t n = 1 + in.byte() % 8;
    std::string stop;
    for (size_t k = 0; k < n && in.remaining(); ++k) stop += char(in.byte());
    // Stop strings come from JSON requests, so they are valid UTF-8 (the API checks the body); an
    // invalid one starting with a continuation byte could cut a character of valid output.
    if (!stop.empty()) opt.stop_sequences.push_back(utf8::decode_lossy(stop));
  }
  const std::string_view text = in.rest();

  const auto whole = run(opt, {text}, cause);
  std::vector<std::string_view> chunks;
  uint32_t state = cut_seed * 2654435761u + 7;
  for (size_t pos = 0; pos < text.size();) {
    state = state * 1103515245u + 12345u;
    const size_t len = (b & 4) ? 1 : 1 + (state >> 16) % 9;
    chunks.push_back(text.substr(pos, len));
    pos += len;
  }
  std::vector<std::vector<StreamEvent>> batches;
  const auto split = run(opt, chunks, cause, &batches);
  FUZZ_CHECK(describe(whole) == describe(split), "whole " + describe(whole) + "\n  split " + describe(split));

  FUZZ_CHECK(!whole.empty() && whole.back().kind == EventKind::Finish, describe(whole));
  std::map<int, std::string> args;
  std::string content, reasoning;
  for (size_t i = 0; i < whole.size(); ++i) {
    const auto& e = whole[i];
    FUZZ_CHECK(e.kind != EventKind::Finish || i + 1 == whole.size(), "Finish before the end: " + describe(whole));
    FUZZ_CHECK(utf8::first_invalid_byte(e.text) == utf8::kValid, "invalid UTF-8 in " + describe({e}));
    if (e.kind == EventKind::ToolCallArguments) args[e.tool_index] += e.text;
    if (e.kind == EventKind::Content) content += e.text;
    if (e.kind == EventKind::Reasoning) reasoning += e.text;
  }
  for (const auto& [idx, s] : args)
    FUZZ_CHECK(nlohmann::json::parse(s, nullptr, false).is_object(), "call " + std::to_string(idx) + " arguments " + fuzz::show(s));
  const std::string& reason = whole.back().text;
  FUZZ_CHECK(reason == "stop" || reason == "length" || reason == "tool_calls", reason);

  // The OpenAI views of the same stream: deltas (streaming) and the message (non-streaming).
  openai::ChatDeltaConverter conv{openai::ToolCallIdGenerator(1)};
  openai::ChatMessageBuilder builder{openai::ToolCallIdGenerator(1)};
  std::vector<nlohmann::ordered_json> deltas;
  for (const auto& batch : batches) {
    conv.convert(batch, deltas);
    builder.add(batch);
  }
  const auto msg = builder.message();
  (void)msg.dump();  // throws on invalid UTF-8
  FUZZ_CHECK(conv.finish_reason().has_value() && *conv.finish_reason() == builder.finish_reason(),
             "delta finish " + conv.finish_reason().value_or("none") + " vs message " + builder.finish_reason());
  std::string d_content, d_reasoning;
  std::map<int64_t, std::string> d_args;
  for (const auto& d : deltas) {
    (void)d.dump();
    if (d.contains("content") && d["content"].is_string()) d_content += d["content"].get<std::string>();
    if (d.contains("reasoning_content") && d["reasoning_content"].is_string()) d_reasoning += d["reasoning_content"].get<std::string>();
    if (d.contains("tool_calls"))
      for (const auto& tc : d["tool_calls"])
        if (tc.contains("function") && tc["function"].contains("arguments"))
          d_args[tc["index"].get<int64_t>()] += tc["function"]["arguments"].get<std::string>();
  }
  const std::string m_content = msg.contains("content") && msg["content"].is_string() ? msg["content"].get<std::string>() : "";
  FUZZ_CHECK(d_content == m_content, "delta content " + fuzz::show(d_content) + "\n  message " + fuzz::show(m_content));
  const std::string m_reasoning = msg.contains("reasoning_content") ? msg["reasoning_content"].get<std::string>() : "";
  FUZZ_CHECK(d_reasoning == m_reasoning, "delta reasoning " + fuzz::show(d_reasoning) + "\n  message " + fuzz::show(m_reasoning));
  if (msg.contains("tool_calls")) {
    const auto& calls = msg["tool_calls"];
    FUZZ_CHECK(calls.size() == d_args.size(), "tool call count");
    for (size_t i = 0; i < calls.size(); ++i)
      FUZZ_CHECK(calls[i]["function"]["arguments"].get<std::string>() == d_args[int64_t(i)], "arguments of call " + std::to_string(i));
  } else {
    FUZZ_CHECK(d_args.empty(), "deltas carry tool calls the message lacks");
  }
  return 0;
}
