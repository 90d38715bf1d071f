// Chat encoding: OpenAI-style messages + tools + options -> prompt segments -> token ids.
//
// Formats:
//  - DeepSeek-V4.1 and V4 follow deepseek-recipe (`deepseek-recipe-encoding/src/v4`): a prompt is a list
//    of segments, template segments tokenized with added-token recognition, content as plain BPE.
//  - DeepSeek-V3, V3.1 and R1 reproduce, byte for byte, the Jinja chat templates those models ship.
//    Their ids equal Hugging Face's tokenization of the rendered text except that message content is
//    plain BPE (a user typing "<｜User｜>" never gets the control token).
// See docs/chat.md.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/json_limits.h"

namespace di {
class Tokenizer;
}

namespace di::chat {

enum class ChatFormat { DeepSeekV41, DeepSeekV4, DeepSeekV3, DeepSeekV31, DeepSeekR1 };

// "deepseek-v4.1" (also "v4.1"), "deepseek-v4", "deepseek-v3", "deepseek-v3.1", "deepseek-r1".
// Throws std::invalid_argument listing the accepted names.
ChatFormat parse_chat_format(std::string_view name);
std::string_view chat_format_name(ChatFormat format);

// Bad input to the renderer (a message the format cannot express). `where` names the field,
// e.g. "messages[2].content".
class ChatError : public std::runtime_error {
 public:
  ChatError(std::string where, const std::string& message)
      : std::runtime_error(where + ": " + message), where_(std::move(where)) {}
  const std::string& where() const { return where_; }

 private:
  std::string where_;
};

enum class Role { System, User, Assistant, Tool, LatestReminder };

struct ToolCall {
  std::string id;
  std::string type = "function";
  std::string name;
  std::string arguments;  // JSON text as the client sent it
};

struct Message {
  Role role = Role::User;
  std::optional<std::string> content;            // nullopt = JSON null
  std::optional<std::string> reasoning_content;  // assistant history (V4.x thinking mode)
  std::optional<std::vector<ToolCall>> tool_calls;  // nullopt = absent/null (V3.1 tells [] apart)
  std::string tool_call_id;                      // role == Tool
  bool prefix = false;                           // V3.1 assistant prefix continuation
};

struct ToolDefinition {
  std::string name;
  std::optional<std::string> description;
  nlohmann::ordered_json parameters;  // null when the client gave none
};

enum class ToolChoice { None, Auto, Required };

// Reasoning effort as DeepSeek's API names it. V4.1 maps it to the numeric line
// "Reasoning Effort: N (...)": low/minimal 50, medium/high/xhigh/default 75, max 100, or an explicit
// integer 1..100. V4 only has a prompt for max.
struct ReasoningEffort {
  enum class Level { Default, Low, Medium, High, Max };
  Level level = Level::Default;
  std::optional<int> value;  // explicit 1..100 (V4.1 only)
};

struct ChatRequest {
  std::vector<Message> messages;
  std::vector<ToolDefinition> tools;
  ToolChoice tool_choice = ToolChoice::Auto;
  bool json_mode = false;  // response_format {"type": "json_object"}
  bool thinking = false;
  ReasoningEffort reasoning_effort;
  bool add_generation_prompt = true;  // V3 family templates only; V4.x always ends with the assistant header
  JsonLimits json_limits;  // V4.x parses tool-call arguments (JSON text) within these
};

struct Segment {
  enum class Kind {
    Special,   // exactly one control token (must exist in the tokenizer)
    Template,  // template text, tokenized with added-token recognition
    Content,   // user-controlled text, plain BPE
  };
  Kind kind;
  std::string text;
};

struct RenderedPrompt {
  std::vector<Segment> segments;
  std::string text;  // concatenation of the segments
};

// Text-level rendering (no tokenizer needed). Throws ChatError on input the format cannot express.
RenderedPrompt render_chat(ChatFormat format, const ChatRequest& request);

// Segments -> ids. V4.x: each segment on its own, as deepseek-recipe does. V3 family: control tokens
// become their ids and the text between them is one plain-BPE run, as HF tokenizes the rendered text.
// Throws std::runtime_error naming the first control token the tokenizer lacks.
std::vector<int32_t> tokenize_prompt(const Tokenizer& tok, ChatFormat format, const RenderedPrompt& prompt);

struct EncodedPrompt {
  std::vector<int32_t> ids;
  RenderedPrompt prompt;
};
EncodedPrompt encode_chat(const Tokenizer& tok, ChatFormat format, const ChatRequest& request);

// JSON serialized as deepseek-recipe's `stringify_python_style`: ", " and ": " separators, non-ASCII
// unescaped, serde_json number formatting with Python-style small negative exponents (1e-05).
std::string stringify_python_style(const nlohmann::ordered_json& value);

}  // namespace di::chat
