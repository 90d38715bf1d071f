// DeepSeek-V4.1 and V4 prompt rendering, following deepseek-recipe's `encoding/src/v4` rules
// (see docs/chat.md for the rules and where they come from).
#include <algorithm>

#include "tokenizer/chat_internal.h"
#include "io/json_limits.h"

namespace di::chat {
namespace {

struct V4Tags {
  bool v41;
  std::string_view calls_block;  // "<｜DSML｜{calls_block}>"
  std::string_view invoke;
  std::string_view parameter;
};

constexpr V4Tags kTagsV41{true, " calls", " invoke", " parameter"};
constexpr V4Tags kTagsV4{false, "tool_calls", "invoke", "parameter"};

// V4's original release has a prompt for "max" only (its other levels add nothing).
constexpr std::string_view kV4MaxEffortPrompt =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

std::string effort_prompt(const V4Tags& tags, size_t index, bool thinking, const ReasoningEffort& effort) {
  if (index != 0 || !thinking) return "";
  if (!tags.v41) return effort.level == ReasoningEffort::Level::Max ? std::string(kV4MaxEffortPrompt) : "";
  int n = 75;
  if (effort.value) {
    n = *effort.value;
  } else if (effort.level == ReasoningEffort::Level::Low) {
    n = 50;
  } else if (effort.level == ReasoningEffort::Level::Max) {
    n = 100;
  }
  return "Reasoning Effort: " + std::to_string(n) +
         " (range 1-100, the higher the value, the more thorough the reasoning)\n\n";
}

std::string tag(std::string_view name) { return "<" + std::string(kDsml) + std::string(name) + ">"; }
std::string end_tag(std::string_view name) { return "</" + std::string(kDsml) + std::string(name) + ">"; }

std::string render_arguments(const V4Tags& tags, const ToolCall& call, const JsonLimits& limits) {
  nlohmann::ordered_json args;
  if (auto err = parse_json_limited(call.arguments, limits, args); err && err->kind != JsonLimitError::Kind::Syntax) {
    throw ChatError("tool_calls.function.arguments" + (err->path.empty() ? "" : "." + err->path), err->message);
  }
  if (!args.is_object()) {
    // The recipe wraps arguments that are not a JSON object rather than failing the request.
    args = nlohmann::ordered_json::object();
    args["arguments"] = call.arguments;
  }
  std::string out;
  bool first = true;
  for (const auto& [key, value] : args.items()) {
    if (!first) out += "\n";
    first = false;
    const bool is_str = value.is_string();
    out += "<" + std::string(kDsml) + std::string(tags.parameter) + " name=\"" + key + "\" string=\"" +
           (is_str ? "true" : "false") + "\">";
    out += is_str ? value.get<std::string>() : stringify_python_style(value);
    out += end_tag(tags.parameter);
  }
  return out;
}

std::string render_tool_calls_block(const V4Tags& tags, const std::vector<ToolCall>& calls, const JsonLimits& limits) {
  std::string invokes;
  for (size_t i = 0; i < calls.size(); ++i) {
    if (i) invokes += "\n";
    invokes += "<" + std::string(kDsml) + std::string(tags.invoke) + " name=\"" + calls[i].name + "\">\n" +
               render_arguments(tags, calls[i], limits) + "\n" + end_tag(tags.invoke);
  }
  return tag(tags.calls_block) + "\n" + invokes + "\n" + end_tag(tags.calls_block);
}

std::string render_tool_prompt(const V4Tags& tags, const std::vector<ToolDefinition>& tools) {
  std::string schemas;
  for (size_t i = 0; i < tools.size(); ++i) {
    nlohmann::ordered_json schema = nlohmann::ordered_json::object();
    schema["name"] = tools[i].name;
    schema["description"] = tools[i].description.value_or("");
    schema["parameters"] = tools[i].parameters;
    if (i) schemas += "\n";
    schemas += stringify_python_style(schema);
  }
  const std::string d(kDsml), block(tags.calls_block), inv(tags.invoke), par(tags.parameter);
  std::string s;
  s += "## Tools\n\n";
  s += "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<" +
       d + block + ">\" block like the following:\n\n";
  s += "<" + d + block + ">\n";
  s += "<" + d + inv + " name=\"$TOOL_NAME\">\n";
  s += "<" + d + par + " name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</" + d + par + ">\n";
  s += "...\n";
  s += "</" + d + inv + ">\n";
  s += "<" + d + inv + " name=\"$TOOL_NAME2\">\n";
  s += "...\n";
  s += "</" + d + inv + ">\n";
  s += "</" + d + block + ">\n\n";
  s += "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
       "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n";
  s += "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
       "<think>...</think> BEFORE any tool calls or final response.\n\n";
  s += "Otherwise, output directly after </think> with tool calls or final response.\n\n";
  s += "### Available Tool Schemas\n\n";
  s += schemas;
  s += "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";
  return s;
}

bool is_user_like(const Message& m) { return m.role == Role::User || m.role == Role::Tool; }

std::vector<Message> normalize(const V4Tags& tags, const std::vector<Message>& messages) {
  std::vector<Message> out;
  bool has_non_system = false;
  for (const Message& m : messages) {
    Message msg = m;
    if (!msg.content) msg.content = std::string();
    if (msg.role == Role::System && !tags.v41) {
      // V4 has no mid-conversation system: leading ones merge, later ones become user turns.
      if (!has_non_system) {
        if (!out.empty() && out.back().role == Role::System) {
          std::string& head = *out.back().content;
          if (!head.empty() && !msg.content->empty()) head += "\n\n";
          head += *msg.content;
        } else {
          out.push_back(std::move(msg));
        }
      } else if (!msg.content->empty()) {
        msg.role = Role::User;
        out.push_back(std::move(msg));
      }
      continue;
    }
    if (msg.role == Role::User) {
      has_non_system = true;
      if (!out.empty() && out.back().role == Role::User) {
        *out.back().content += "\n\n" + *msg.content;
      } else {
        out.push_back(std::move(msg));
      }
      continue;
    }
    if (msg.role != Role::System) has_non_system = true;
    out.push_back(std::move(msg));
  }
  // Tool results after a tool-call turn go in the order of the calls (unknown ids sort first, stably).
  std::vector<std::string> order;
  size_t i = 0;
  while (i < out.size()) {
    if (out[i].role == Role::Assistant && out[i].tool_calls && !out[i].tool_calls->empty()) {
      order.clear();
      for (const ToolCall& c : *out[i].tool_calls) order.push_back(c.id);
      ++i;
    } else if (is_user_like(out[i])) {
      size_t start = i;
      while (i < out.size() && is_user_like(out[i])) ++i;
      std::vector<size_t> tool_idx;
      for (size_t j = start; j < i; ++j)
        if (out[j].role == Role::Tool) tool_idx.push_back(j);
      if (tool_idx.size() > 1 && !order.empty()) {
        std::vector<Message> tools;
        for (size_t j : tool_idx) tools.push_back(std::move(out[j]));
        auto rank = [&](const Message& m) {
          auto it = std::find(order.begin(), order.end(), m.tool_call_id);
          return it == order.end() ? size_t{0} : static_cast<size_t>(it - order.begin());
        };
        std::stable_sort(tools.begin(), tools.end(),
                         [&](const Message& a, const Message& b) { return rank(a) < rank(b); });
        for (size_t k = 0; k < tool_idx.size(); ++k) out[tool_idx[k]] = std::move(tools[k]);
      }
    } else {
      ++i;
    }
  }
  return out;
}

void render_message(const V4Tags& tags, const std::vector<Message>& messages, size_t index, const ChatRequest& req,
                    SegmentList& out) {
  const Message& msg = messages[index];
  const Message* prev = index > 0 ? &messages[index - 1] : nullptr;
  const std::string effort = effort_prompt(tags, index, req.thinking, req.reasoning_effort);
  const std::string& content = *msg.content;
  if (index == 0 && (!effort.empty() || msg.role == Role::System) && tags.v41) out.special(kSystem);
  out.content(effort);
  switch (msg.role) {
    case Role::System:
      if (index > 0 && tags.v41) out.special(kSystem);
      out.content(content);
      break;
    case Role::User:
    case Role::Tool:
      if (prev && is_user_like(*prev)) {
        out.templ("\n\n");
      } else {
        out.special(kUser);
      }
      out.content(msg.role == Role::Tool ? "<tool_result>" + content + "</tool_result>" : content);
      break;
    case Role::LatestReminder:
      out.special(kLatestReminder);
      out.content(content);
      break;
    case Role::Assistant: {
      out.special(kAssistant);
      if (req.thinking && index > 0) {
        out.special(kThinkStart);
        if (msg.reasoning_content) out.content(*msg.reasoning_content);
        out.special(kThinkEnd);
      } else {
        out.special(kThinkEnd);
      }
      out.content(content);
      if (msg.tool_calls && !msg.tool_calls->empty()) out.templ("\n\n" + render_tool_calls_block(tags, *msg.tool_calls, req.json_limits));
      out.special(kEos);
      break;
    }
  }
}

}  // namespace

void render_v4(bool v41, const ChatRequest& req, SegmentList& out) {
  const V4Tags& tags = v41 ? kTagsV41 : kTagsV4;
  if (req.reasoning_effort.value && (*req.reasoning_effort.value < 1 || *req.reasoning_effort.value > 100)) {
    throw ChatError("reasoning_effort", "must be an integer in 1..100, got " + std::to_string(*req.reasoning_effort.value));
  }
  if (req.reasoning_effort.value && !v41) {
    throw ChatError("reasoning_effort", "numeric reasoning effort needs DeepSeek-V4.1");
  }
  std::vector<Message> messages = normalize(tags, req.messages);
  const bool has_tools = req.tool_choice != ToolChoice::None && !req.tools.empty();
  if (has_tools || req.json_mode) {
    if (messages.empty() || messages.front().role != Role::System) {
      Message sys;
      sys.role = Role::System;
      sys.content = std::string();
      messages.insert(messages.begin(), std::move(sys));
    }
    std::string& sys = *messages.front().content;
    if (has_tools) sys += "\n\n" + render_tool_prompt(tags, req.tools);
    if (req.json_mode) {
      sys += "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";
      sys += stringify_python_style(nlohmann::ordered_json{{"type", "json_object"}});
    }
  }
  out.special(kBos);
  for (size_t i = 0; i < messages.size(); ++i) render_message(tags, messages, i, req, out);
  out.special(kAssistant);
  out.special(req.thinking ? kThinkStart : kThinkEnd);
  if (req.tool_choice == ToolChoice::Required && !req.tools.empty()) out.templ("\n\n" + tag(tags.calls_block) + "\n");
}

}  // namespace di::chat
