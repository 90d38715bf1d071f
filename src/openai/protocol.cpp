#include "openai/protocol.h"

#include <algorithm>

namespace di::openai {
namespace {

using json = nlohmann::ordered_json;
using chat::ChatFormat;

struct Bad {
  std::string field;
  std::string message;
};

[[noreturn]] void fail(const std::string& field, const std::string& what) { throw Bad{field, field + ": " + what}; }

std::string type_name(const json& v) { return v.type_name(); }

const json* member(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string need_string(const json& v, const std::string& field) {
  if (!v.is_string()) fail(field, "must be a string, got " + type_name(v));
  return v.get<std::string>();
}

// String content, or an array of {"type": "text", "text": ...} parts joined with "\n\n".
std::optional<std::string> read_content(const json& msg, const std::string& field, bool nullable) {
  const json* c = member(msg, "content");
  if (!c) {
    if (nullable) return std::nullopt;
    fail(field, "is required");
  }
  if (c->is_string()) return c->get<std::string>();
  if (!c->is_array()) fail(field, "must be a string or an array of content parts, got " + type_name(*c));
  std::string out;
  for (size_t i = 0; i < c->size(); ++i) {
    const json& part = (*c)[i];
    const std::string pf = field + "[" + std::to_string(i) + "]";
    if (!part.is_object()) fail(pf, "must be an object");
    const json* type = member(part, "type");
    if (!type || !type->is_string()) fail(pf + ".type", "is required");
    if (*type != "text") fail(pf + ".type", "'" + type->get<std::string>() + "' is not supported (text only)");
    const json* text = member(part, "text");
    if (!text) fail(pf + ".text", "is required");
    if (i) out += "\n\n";
    out += need_string(*text, pf + ".text");
  }
  return out;
}

chat::ToolCall read_tool_call(const json& tc, const std::string& field, const JsonLimits& limits) {
  if (!tc.is_object()) fail(field, "must be an object");
  chat::ToolCall call;
  if (const json* id = member(tc, "id")) call.id = need_string(*id, field + ".id");
  if (const json* type = member(tc, "type")) {
    call.type = need_string(*type, field + ".type");
    if (call.type != "function") fail(field + ".type", "must be \"function\"");
  }
  const json* fn = member(tc, "function");
  if (!fn || !fn->is_object()) fail(field + ".function", "is required and must be an object");
  const json* name = member(*fn, "name");
  if (!name) fail(field + ".function.name", "is required");
  call.name = need_string(*name, field + ".function.name");
  const json* args = member(*fn, "arguments");
  if (!args) {
    call.arguments = "{}";
  } else if (args->is_string()) {
    call.arguments = args->get<std::string>();
    // The V4 formats parse this text to render it: hold it to the same bounds as the body.
    json parsed;
    if (auto err = parse_json_limited(call.arguments, limits, parsed); err && err->kind != JsonLimitError::Kind::Syntax)
      fail(field + ".function.arguments", err->message + (err->path.empty() ? "" : " at " + err->path));
  } else if (args->is_object()) {
    call.arguments = args->dump();  // lenient: some clients send the object itself
  } else {
    fail(field + ".function.arguments", "must be a JSON string, got " + type_name(*args));
  }
  return call;
}

chat::Message read_message(const json& m, size_t index, const JsonLimits& limits) {
  const std::string f = "messages[" + std::to_string(index) + "]";
  if (!m.is_object()) fail(f, "must be an object");
  const json* role = member(m, "role");
  if (!role) fail(f + ".role", "is required");
  const std::string r = need_string(*role, f + ".role");
  chat::Message msg;
  if (r == "system" || r == "developer") {
    msg.role = chat::Role::System;
    msg.content = read_content(m, f + ".content", false);
  } else if (r == "user") {
    msg.role = chat::Role::User;
    msg.content = read_content(m, f + ".content", false);
  } else if (r == "latest_reminder") {
    msg.role = chat::Role::LatestReminder;
    msg.content = read_content(m, f + ".content", false);
  } else if (r == "tool") {
    msg.role = chat::Role::Tool;
    msg.content = read_content(m, f + ".content", false);
    const json* id = member(m, "tool_call_id");
    if (!id) fail(f + ".tool_call_id", "is required for role \"tool\"");
    msg.tool_call_id = need_string(*id, f + ".tool_call_id");
  } else if (r == "assistant") {
    msg.role = chat::Role::Assistant;
    msg.content = read_content(m, f + ".content", true);
    if (const json* rc = member(m, "reasoning_content")) msg.reasoning_content = need_string(*rc, f + ".reasoning_content");
    if (const json* tcs = member(m, "tool_calls")) {
      if (!tcs->is_array()) fail(f + ".tool_calls", "must be an array");
      msg.tool_calls.emplace();
      for (size_t i = 0; i < tcs->size(); ++i)
        msg.tool_calls->push_back(read_tool_call((*tcs)[i], f + ".tool_calls[" + std::to_string(i) + "]", limits));
    }
    if (const json* prefix = member(m, "prefix")) {
      if (!prefix->is_boolean()) fail(f + ".prefix", "must be a boolean");
      msg.prefix = prefix->get<bool>();
    }
    if (!msg.content && !msg.tool_calls) fail(f + ".content", "is required unless tool_calls is given");
  } else {
    fail(f + ".role", "unknown role \"" + r + "\" (expected system, developer, user, assistant or tool)");
  }
  return msg;
}

chat::ToolDefinition read_tool(const json& t, size_t index) {
  const std::string f = "tools[" + std::to_string(index) + "]";
  if (!t.is_object()) fail(f, "must be an object");
  if (const json* type = member(t, "type")) {
    if (!type->is_string() || *type != "function") fail(f + ".type", "must be \"function\"");
  }
  const json* fn = member(t, "function");
  if (!fn || !fn->is_object()) fail(f + ".function", "is required and must be an object");
  chat::ToolDefinition def;
  const json* name = member(*fn, "name");
  if (!name) fail(f + ".function.name", "is required");
  def.name = need_string(*name, f + ".function.name");
  if (def.name.empty()) fail(f + ".function.name", "must not be empty");
  if (const json* d = member(*fn, "description")) def.description = need_string(*d, f + ".function.description");
  if (const json* p = member(*fn, "parameters")) {
    if (!p->is_object()) fail(f + ".function.parameters", "must be a JSON Schema object");
    def.parameters = *p;
  }
  return def;
}

}  // namespace

ConversionResult convert_chat_request(const json& body, const ConversionOptions& options) {
  ConversionResult result;
  try {
    if (!body.is_object()) fail("body", "must be a JSON object");
    ConvertedRequest out;
    chat::ChatRequest& req = out.chat;

    const json* messages = member(body, "messages");
    if (!messages) fail("messages", "is required");
    if (!messages->is_array()) fail("messages", "must be an array");
    if (messages->empty()) fail("messages", "must not be empty");
    for (size_t i = 0; i < messages->size(); ++i) req.messages.push_back(read_message((*messages)[i], i, options.json_limits));
    req.json_limits = options.json_limits;

    if (const json* tools = member(body, "tools")) {
      if (!tools->is_array()) fail("tools", "must be an array");
      for (size_t i = 0; i < tools->size(); ++i) req.tools.push_back(read_tool((*tools)[i], i));
    }

    req.tool_choice = chat::ToolChoice::Auto;
    if (const json* tc = member(body, "tool_choice")) {
      if (tc->is_string()) {
        const std::string s = tc->get<std::string>();
        if (s == "none") {
          req.tool_choice = chat::ToolChoice::None;
        } else if (s == "auto") {
          req.tool_choice = chat::ToolChoice::Auto;
        } else if (s == "required") {
          req.tool_choice = chat::ToolChoice::Required;
        } else {
          fail("tool_choice", "must be \"none\", \"auto\", \"required\" or a function object");
        }
      } else if (tc->is_object()) {
        const json* fn = member(*tc, "function");
        const json* name = fn && fn->is_object() ? member(*fn, "name") : nullptr;
        if (!name) fail("tool_choice.function.name", "is required");
        const std::string wanted = need_string(*name, "tool_choice.function.name");
        auto it = std::find_if(req.tools.begin(), req.tools.end(),
                               [&](const chat::ToolDefinition& t) { return t.name == wanted; });
        if (it == req.tools.end()) fail("tool_choice.function.name", "no tool named \"" + wanted + "\" in tools");
        // A named choice is "required" with only that tool offered.
        chat::ToolDefinition only = *it;
        req.tools = {only};
        req.tool_choice = chat::ToolChoice::Required;
      } else {
        fail("tool_choice", "must be a string or an object");
      }
    }
    bool parallel_tool_calls = true;
    if (const json* ptc = member(body, "parallel_tool_calls")) {
      if (!ptc->is_boolean()) fail("parallel_tool_calls", "must be a boolean, got " + type_name(*ptc));
      parallel_tool_calls = ptc->get<bool>();
    }
    if (req.tool_choice == chat::ToolChoice::Required && req.tools.empty())
      fail("tool_choice", "\"required\" needs at least one tool in tools");

    if (const json* rf = member(body, "response_format")) {
      if (!rf->is_object()) fail("response_format", "must be an object");
      const json* type = member(*rf, "type");
      if (!type) fail("response_format.type", "is required");
      const std::string t = need_string(*type, "response_format.type");
      if (t == "json_object") {
        req.json_mode = true;
        out.structured.kind = StructuredOutput::Kind::JsonObject;
        out.structured.field = "response_format";
      } else if (t == "json_schema") {
        const json* js = member(*rf, "json_schema");
        if (!js || !js->is_object()) fail("response_format.json_schema", "is required and must be an object");
        if (const json* name = member(*js, "name")) need_string(*name, "response_format.json_schema.name");
        const json* schema = member(*js, "schema");
        if (!schema) fail("response_format.json_schema.schema", "is required");
        if (!schema->is_object() && !schema->is_boolean())
          fail("response_format.json_schema.schema", "must be a JSON Schema object, got " + type_name(*schema));
        if (const json* strict = member(*js, "strict")) {
          if (!strict->is_boolean() && !strict->is_null())
            fail("response_format.json_schema.strict", "must be a boolean, got " + type_name(*strict));
          out.structured.strict = strict->is_boolean() && strict->get<bool>();
        }
        out.structured.kind = StructuredOutput::Kind::JsonSchema;
        out.structured.schema = *schema;
        out.structured.field = "response_format.json_schema.schema";
      } else if (t != "text") {
        fail("response_format.type", "\"" + t + "\" is not supported (use \"text\", \"json_object\" or \"json_schema\")");
      }
    }
    if (req.tool_choice == chat::ToolChoice::Required) {
      // The forced call is the whole output: response_format has nothing left to constrain.
      out.structured = {};
      out.structured.kind = StructuredOutput::Kind::ToolCall;
      out.structured.field = "tool_choice";
      out.structured.parallel_tool_calls = parallel_tool_calls;
    }
    // A grammar constrains the whole output, so there is no room for reasoning before it.
    const bool constrained = out.structured.kind != StructuredOutput::Kind::None || member(body, "guided_json") ||
                             member(body, "guided_regex") || member(body, "guided_grammar");
    if (constrained && options.format == ChatFormat::DeepSeekR1)
      fail("response_format", "constrained output needs a chat format whose prompt does not force reasoning (not deepseek-r1)");

    // Thinking: explicit switches win over what reasoning_effort implies.
    std::optional<bool> thinking;
    if (const json* rex = member(body, "reasoning_effort")) {
      if (rex->is_string()) {
        const std::string e = rex->get<std::string>();
        using L = chat::ReasoningEffort::Level;
        if (e == "none") {
          thinking = false;
        } else if (e == "minimal" || e == "low") {
          req.reasoning_effort.level = L::Low;
        } else if (e == "medium") {
          req.reasoning_effort.level = L::Medium;
        } else if (e == "high" || e == "xhigh") {
          req.reasoning_effort.level = L::High;
        } else if (e == "max") {
          req.reasoning_effort.level = L::Max;
        } else {
          fail("reasoning_effort", "must be none, minimal, low, medium, high, xhigh, max or an integer 1..100");
        }
      } else if (rex->is_number_integer()) {
        int64_t v = rex->get<int64_t>();
        if (v < 1 || v > 100) fail("reasoning_effort", "integer must be in 1..100");
        if (options.format != ChatFormat::DeepSeekV41) fail("reasoning_effort", "an integer effort needs DeepSeek-V4.1");
        req.reasoning_effort.value = static_cast<int>(v);
      } else {
        fail("reasoning_effort", "must be a string or an integer");
      }
      if (!thinking) thinking = true;
    }
    auto read_bool = [](const json& parent, const char* key, const std::string& field) -> std::optional<bool> {
      const json* v = member(parent, key);
      if (!v) return std::nullopt;
      if (!v->is_boolean()) fail(field, "must be a boolean");
      return v->get<bool>();
    };
    if (auto v = read_bool(body, "enable_thinking", "enable_thinking")) thinking = v;
    if (const json* kw = member(body, "chat_template_kwargs")) {
      if (!kw->is_object()) fail("chat_template_kwargs", "must be an object");
      if (auto v = read_bool(*kw, "enable_thinking", "chat_template_kwargs.enable_thinking")) thinking = v;
      if (auto v = read_bool(*kw, "thinking", "chat_template_kwargs.thinking")) thinking = v;
    }
    if (const json* th = member(body, "thinking")) {
      if (!th->is_object()) fail("thinking", "must be an object like {\"type\": \"enabled\"}");
      const json* type = member(*th, "type");
      if (!type) fail("thinking.type", "is required");
      const std::string t = need_string(*type, "thinking.type");
      if (t == "enabled") {
        thinking = true;
      } else if (t == "disabled") {
        thinking = false;
      } else {
        fail("thinking.type", "must be \"enabled\" or \"disabled\"");
      }
    }
    req.thinking = thinking.value_or(options.default_thinking);
    if (constrained) req.thinking = false;

    std::vector<std::string> stop;
    if (const json* s = member(body, "stop")) {
      // An empty stop string would match before any output: a 400, as vLLM answers.
      if (s->is_string()) {
        stop.push_back(s->get<std::string>());
        if (stop.back().empty()) fail("stop", "must not be an empty string");
      } else if (s->is_array()) {
        if (s->size() > options.max_stop_sequences)
          fail("stop", "at most " + std::to_string(options.max_stop_sequences) + " stop sequences");
        for (size_t i = 0; i < s->size(); ++i) {
          const std::string f = "stop[" + std::to_string(i) + "]";
          stop.push_back(need_string((*s)[i], f));
          if (stop.back().empty()) fail(f, "must not be an empty string");
        }
      } else {
        fail("stop", "must be a string or an array of strings");
      }
    }

    // What the prompt leaves open decides where the parser starts.
    stream::ParserOptions& p = out.parser;
    const bool v4 = options.format == ChatFormat::DeepSeekV41 || options.format == ChatFormat::DeepSeekV4;
    p.syntax = v4 ? stream::ToolCallSyntax::Dsml
                  : options.format == ChatFormat::DeepSeekV31 ? stream::ToolCallSyntax::V31 : stream::ToolCallSyntax::V3;
    p.parse_tool_calls = !req.tools.empty() && req.tool_choice != chat::ToolChoice::None;
    p.start_in_tool_calls = v4 && req.tool_choice == chat::ToolChoice::Required;
    switch (options.format) {
      case ChatFormat::DeepSeekV41:
      case ChatFormat::DeepSeekV4:
      case ChatFormat::DeepSeekV31: p.start_in_reasoning = req.thinking; break;
      case ChatFormat::DeepSeekR1: p.start_in_reasoning = true; break;  // its prompt always ends with <think>
      case ChatFormat::DeepSeekV3: p.start_in_reasoning = false; break;
    }
    if (options.format == ChatFormat::DeepSeekR1) req.thinking = true;
    if (options.format == ChatFormat::DeepSeekV3) req.thinking = false;
    // JSON mode is enforced by the grammar, not repaired afterwards.
    p.parse_json_output = false;
    p.max_tool_calls = parallel_tool_calls ? 0 : 1;
    p.stop_sequences = std::move(stop);
    // Validate against the format now so the caller gets a 400, not a failure at encode time.
    try {
      (void)chat::render_chat(options.format, req);
    } catch (const chat::ChatError& e) {
      throw Bad{e.where(), e.what()};
    }
    result.request = std::move(out);
  } catch (const Bad& b) {
    result.error = RequestError{b.field, b.message};
  }
  return result;
}

// ---- ids ----------------------------------------------------------------------------------------

ToolCallIdGenerator::ToolCallIdGenerator() : rng_(std::random_device{}()) {}
ToolCallIdGenerator::ToolCallIdGenerator(uint64_t seed) : rng_(seed) {}

std::string ToolCallIdGenerator::next() {
  static constexpr char kAlnum[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kAlnum[rng_() % 62];
  return id;
}

// ---- events -> deltas / message --------------------------------------------------------------------

ChatDeltaConverter::ChatDeltaConverter(ToolCallIdGenerator ids) : ids_(std::move(ids)) {}

void ChatDeltaConverter::convert(const std::vector<stream::StreamEvent>& events, std::vector<json>& deltas) {
  using stream::EventKind;
  for (const stream::StreamEvent& e : events) {
    json delta;
    switch (e.kind) {
      case EventKind::Reasoning: delta["reasoning_content"] = e.text; break;
      case EventKind::Content: delta["content"] = e.text; break;
      case EventKind::ToolCallBegin:
        delta["tool_calls"] = json::array({json{{"index", e.tool_index},
                                                {"id", ids_.next()},
                                                {"type", "function"},
                                                {"function", {{"name", e.text}, {"arguments", ""}}}}});
        break;
      case EventKind::ToolCallArguments:
        delta["tool_calls"] = json::array({json{{"index", e.tool_index}, {"function", {{"arguments", e.text}}}}});
        break;
      case EventKind::Finish: finish_reason_ = e.text; continue;
      case EventKind::ToolCallEnd:
      case EventKind::Invalid: continue;
    }
    if (!sent_role_) {
      delta["role"] = "assistant";
      sent_role_ = true;
    }
    deltas.push_back(std::move(delta));
  }
}

ChatMessageBuilder::ChatMessageBuilder(ToolCallIdGenerator ids) : ids_(std::move(ids)) {}

void ChatMessageBuilder::add(const std::vector<stream::StreamEvent>& events) {
  using stream::EventKind;
  for (const stream::StreamEvent& e : events) {
    switch (e.kind) {
      case EventKind::Reasoning: reasoning_ += e.text; break;
      case EventKind::Content:
        content_ += e.text;
        has_content_ = true;
        break;
      case EventKind::ToolCallBegin:
        tool_calls_.push_back(json{{"id", ids_.next()}, {"type", "function"}, {"function", {{"name", e.text}, {"arguments", ""}}}});
        break;
      case EventKind::ToolCallArguments:
        if (e.tool_index >= 0 && static_cast<size_t>(e.tool_index) < tool_calls_.size())
          tool_calls_[e.tool_index]["function"]["arguments"].get_ref<std::string&>() += e.text;
        break;
      case EventKind::Finish: finish_reason_ = e.text; break;
      case EventKind::ToolCallEnd:
      case EventKind::Invalid: break;
    }
  }
}

json ChatMessageBuilder::message() const {
  json m = {{"role", "assistant"}};
  // OpenAI sends null content on a pure tool-call turn.
  m["content"] = (has_content_ || tool_calls_.empty()) ? json(content_) : json(nullptr);
  if (!reasoning_.empty()) m["reasoning_content"] = reasoning_;
  if (!tool_calls_.empty()) m["tool_calls"] = tool_calls_;
  return m;
}

}  // namespace di::openai
