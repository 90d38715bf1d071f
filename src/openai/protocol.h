// OpenAI chat-completions protocol <-> chat encoder / stream parser, independent of HTTP.
//  - convert_chat_request: request JSON -> ChatRequest + ParserOptions, or a 400-style error naming the field.
//  - ChatDeltaConverter: parser events -> streaming `choices[].delta` objects.
//  - ChatMessageBuilder: parser events -> the non-streaming `choices[].message` object.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/chat_template.h"
#include "io/json_limits.h"
#include "tokenizer/stream_parser.h"

namespace di::openai {

struct RequestError {
  std::string field;    // e.g. "messages[1].tool_calls[0].function.name"
  std::string message;  // human-readable, starts with the field
};

struct ConversionOptions {
  chat::ChatFormat format = chat::ChatFormat::DeepSeekV41;
  bool default_thinking = false;  // when the request says nothing about thinking
  size_t max_stop_sequences = 16;
  JsonLimits json_limits;  // for tool-call arguments sent as JSON text
};

// What the output is constrained to (compiled into a grammar by the caller).
struct StructuredOutput {
  enum class Kind { None, JsonObject, JsonSchema, ToolCall } kind = Kind::None;
  nlohmann::ordered_json schema;  // JsonSchema
  bool strict = false;            // JsonSchema: response_format.json_schema.strict
  std::string field;              // the request field it came from, for errors
  bool parallel_tool_calls = true;
};

struct ConvertedRequest {
  chat::ChatRequest chat;
  stream::ParserOptions parser;
  StructuredOutput structured;
};

struct ConversionResult {
  std::optional<ConvertedRequest> request;
  std::optional<RequestError> error;
  bool ok() const { return request.has_value(); }
};

// Reads messages, tools, tool_choice, response_format, stop, and thinking from `thinking`
// ({"type": "enabled"|"disabled"}, DeepSeek's API), `chat_template_kwargs.thinking` /
// `.enable_thinking` / top-level `enable_thinking`, or `reasoning_effort` ("none" disables thinking;
// any other level enables it), and `parallel_tool_calls` (false: the parser ends the output after the
// first complete tool call). An empty stop string is a 400, as in vLLM. Sampling fields are left to
// the caller.
// The body should be parsed as ordered_json: tool schemas are rendered in the client's key order.
ConversionResult convert_chat_request(const nlohmann::ordered_json& body, const ConversionOptions& options);

// "call_" + 24 alphanumerics. Seeded for reproducible tests; random_device otherwise.
class ToolCallIdGenerator {
 public:
  ToolCallIdGenerator();
  explicit ToolCallIdGenerator(uint64_t seed);
  std::string next();

 private:
  std::mt19937_64 rng_;
};

class ChatDeltaConverter {
 public:
  explicit ChatDeltaConverter(ToolCallIdGenerator ids = ToolCallIdGenerator());
  // Appends one delta object per event that carries output; the first delta also has "role".
  void convert(const std::vector<stream::StreamEvent>& events, std::vector<nlohmann::ordered_json>& deltas);
  // Set once the Finish event has been seen: "stop", "length" or "tool_calls".
  const std::optional<std::string>& finish_reason() const { return finish_reason_; }

 private:
  ToolCallIdGenerator ids_;
  bool sent_role_ = false;
  std::optional<std::string> finish_reason_;
};

class ChatMessageBuilder {
 public:
  explicit ChatMessageBuilder(ToolCallIdGenerator ids = ToolCallIdGenerator());
  void add(const std::vector<stream::StreamEvent>& events);
  // {"role": "assistant", "content": ..., "reasoning_content"?: ..., "tool_calls"?: [...]}
  nlohmann::ordered_json message() const;
  std::string finish_reason() const { return finish_reason_.value_or("stop"); }

 private:
  ToolCallIdGenerator ids_;
  std::string content_, reasoning_;
  bool has_content_ = false;
  nlohmann::ordered_json tool_calls_ = nlohmann::ordered_json::array();
  std::optional<std::string> finish_reason_;
};

}  // namespace di::openai
