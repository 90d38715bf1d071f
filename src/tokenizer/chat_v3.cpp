// DeepSeek-V3, V3.1 and R1 prompt rendering: hand-written equivalents of the Jinja chat templates these
// models ship (frozen copies in tests/data/chat/templates/), including their quirks, so that the text is
// byte-identical. Where the Jinja template would fail (None + string), we throw ChatError instead.
#include "tokenizer/chat_internal.h"

namespace di::chat {
namespace {

std::string where(size_t i, const char* field) { return "messages[" + std::to_string(i) + "]." + field; }

const std::string& need_content(const Message& m, size_t i) {
  if (!m.content) throw ChatError(where(i, "content"), "must be a string for this chat format");
  return *m.content;
}

void reject_unsupported_roles(const ChatRequest& req) {
  for (size_t i = 0; i < req.messages.size(); ++i) {
    if (req.messages[i].role == Role::LatestReminder)
      throw ChatError(where(i, "role"), "'latest_reminder' exists only in DeepSeek-V4.x formats");
  }
}

// V3 and V3.1 join all system messages with "\n\n"; R1 keeps only the last one.
std::string system_prompt(const ChatRequest& req, bool last_only) {
  std::string sp;
  bool first = true;
  for (size_t i = 0; i < req.messages.size(); ++i) {
    const Message& m = req.messages[i];
    if (m.role != Role::System) continue;
    const std::string& c = need_content(m, i);
    if (last_only || first) {
      sp = c;
    } else {
      sp += "\n\n" + c;
    }
    first = false;
  }
  return sp;
}

void v3_family(const ChatRequest& req, bool r1, SegmentList& out) {
  reject_unsupported_roles(req);
  out.special(kBos);
  out.content(system_prompt(req, r1));
  bool is_first = false, is_tool = false, is_output_first = true;
  for (size_t i = 0; i < req.messages.size(); ++i) {
    const Message& m = req.messages[i];
    switch (m.role) {
      case Role::User:
        is_tool = false;
        out.special(kUser);
        out.content(need_content(m, i));
        break;
      case Role::Assistant:
        if (!m.content) {
          is_tool = false;
          if (!m.tool_calls)
            throw ChatError(where(i, "tool_calls"), "an assistant message with null content needs tool_calls");
          for (const ToolCall& call : *m.tool_calls) {
            const bool first_call = !is_first;
            if (first_call) {
              out.special(kAssistant);
              out.special(kToolCallsBegin);
            } else {
              out.templ("\n");
            }
            out.special(kToolCallBegin);
            out.content(call.type);
            out.special(kToolSep);
            out.content(call.name);
            out.templ("\n```json\n");
            out.content(call.arguments);
            out.templ("\n```");
            out.special(kToolCallEnd);
            if (first_call) {
              is_first = true;  // never reset: the template's own behaviour
            } else {
              out.special(kToolCallsEnd);
              out.special(kEos);
            }
          }
        } else if (is_tool) {
          out.special(kToolOutputsEnd);
          out.content(*m.content);
          out.special(kEos);
          is_tool = false;
        } else {
          std::string content = *m.content;
          if (r1) {
            size_t pos = content.rfind(kThinkEnd);
            if (pos != std::string::npos) content = content.substr(pos + kThinkEnd.size());
          }
          out.special(kAssistant);
          out.content(content);
          out.special(kEos);
        }
        break;
      case Role::Tool:
        is_tool = true;
        if (is_output_first) {
          out.special(kToolOutputsBegin);
          is_output_first = false;
        } else {
          out.templ("\n");
        }
        out.special(kToolOutputBegin);
        out.content(need_content(m, i));
        out.special(kToolOutputEnd);
        break;
      case Role::System:
      case Role::LatestReminder: break;
    }
  }
  if (is_tool) out.special(kToolOutputsEnd);
  if (req.add_generation_prompt && !is_tool) {
    out.special(kAssistant);
    if (r1) {
      out.special(kThinkStart);
      out.templ("\n");
    }
  }
}

}  // namespace

void render_v3(const ChatRequest& req, SegmentList& out) { v3_family(req, /*r1=*/false, out); }
void render_r1(const ChatRequest& req, SegmentList& out) { v3_family(req, /*r1=*/true, out); }

void render_v31(const ChatRequest& req, SegmentList& out) {
  reject_unsupported_roles(req);
  out.special(kBos);
  out.content(system_prompt(req, false));
  bool is_first = false, is_tool = false, is_last_user = false;
  for (size_t i = 0; i < req.messages.size(); ++i) {
    const Message& m = req.messages[i];
    switch (m.role) {
      case Role::User:
        is_tool = false;
        is_first = false;
        is_last_user = true;
        out.special(kUser);
        out.content(need_content(m, i));
        break;
      case Role::Assistant:
        if (m.tool_calls) {
          if (is_last_user) {
            out.special(kAssistant);
            out.special(kThinkEnd);
          }
          is_last_user = false;
          is_first = false;
          is_tool = false;
          for (const ToolCall& call : *m.tool_calls) {
            if (!is_first) {
              if (m.content) out.content(*m.content);
              out.special(kToolCallsBegin);
              is_first = true;
            }
            out.special(kToolCallBegin);
            out.content(call.name);
            out.special(kToolSep);
            out.content(call.arguments);
            out.special(kToolCallEnd);
          }
          out.special(kToolCallsEnd);
          out.special(kEos);
        } else {
          if (is_last_user) {
            out.special(kAssistant);
            out.special(m.prefix && req.thinking ? kThinkStart : kThinkEnd);
          }
          is_last_user = false;
          std::string content = need_content(m, i);
          if (is_tool) {
            is_tool = false;
          } else {
            size_t pos = content.find(kThinkEnd);
            if (pos != std::string::npos) content = content.substr(pos + kThinkEnd.size());
          }
          out.content(content);
          out.special(kEos);
        }
        break;
      case Role::Tool:
        is_last_user = false;
        is_tool = true;
        out.special(kToolOutputBegin);
        out.content(need_content(m, i));
        out.special(kToolOutputEnd);
        break;
      case Role::System:
      case Role::LatestReminder: break;
    }
  }
  if (req.add_generation_prompt && is_last_user && !is_tool) {
    out.special(kAssistant);
    out.special(req.thinking ? kThinkStart : kThinkEnd);
  }
}

}  // namespace di::chat
