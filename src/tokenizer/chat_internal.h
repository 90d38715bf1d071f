// Shared between the chat renderers (not a public header).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/chat_template.h"

namespace di::chat {

struct SegmentList {
  std::vector<Segment> segments;
  void push(Segment::Kind kind, std::string_view text);  // drops empty text
  void special(std::string_view token) { push(Segment::Kind::Special, token); }
  void templ(std::string_view text) { push(Segment::Kind::Template, text); }
  void content(std::string_view text) { push(Segment::Kind::Content, text); }
};

void render_v4(bool v41, const ChatRequest& request, SegmentList& out);
void render_v3(const ChatRequest& request, SegmentList& out);
void render_v31(const ChatRequest& request, SegmentList& out);
void render_r1(const ChatRequest& request, SegmentList& out);

// `s` as a JSON string literal, serde_json escaping (quotes included).
std::string json_escape_string(const std::string& s);

// Control-token spellings shared by the DeepSeek formats.
inline constexpr std::string_view kBos = "<｜begin▁of▁sentence｜>";
inline constexpr std::string_view kEos = "<｜end▁of▁sentence｜>";
inline constexpr std::string_view kUser = "<｜User｜>";
inline constexpr std::string_view kAssistant = "<｜Assistant｜>";
inline constexpr std::string_view kSystem = "<｜System｜>";
inline constexpr std::string_view kLatestReminder = "<｜latest_reminder｜>";
inline constexpr std::string_view kThinkStart = "<think>";
inline constexpr std::string_view kThinkEnd = "</think>";
inline constexpr std::string_view kDsml = "｜DSML｜";

inline constexpr std::string_view kToolCallsBegin = "<｜tool▁calls▁begin｜>";
inline constexpr std::string_view kToolCallsEnd = "<｜tool▁calls▁end｜>";
inline constexpr std::string_view kToolCallBegin = "<｜tool▁call▁begin｜>";
inline constexpr std::string_view kToolCallEnd = "<｜tool▁call▁end｜>";
inline constexpr std::string_view kToolSep = "<｜tool▁sep｜>";
inline constexpr std::string_view kToolOutputsBegin = "<｜tool▁outputs▁begin｜>";
inline constexpr std::string_view kToolOutputsEnd = "<｜tool▁outputs▁end｜>";
inline constexpr std::string_view kToolOutputBegin = "<｜tool▁output▁begin｜>";
inline constexpr std::string_view kToolOutputEnd = "<｜tool▁output▁end｜>";

}  // namespace di::chat
