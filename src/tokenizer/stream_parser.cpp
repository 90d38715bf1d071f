#include "tokenizer/stream_parser.h"

#include "tokenizer/text_utf8.h"

#include <algorithm>
#include <cstdio>

#include <nlohmann/json.hpp>

namespace di::stream {
namespace {

// Fixed labels; stop sequences follow at kStopBase + i.
enum LabelId : int {
  kThinkEnd,
  kDsmlBegin,     // "<｜DSML｜" (preceding newlines are part of the match)
  kDsmlEnd,       // "</｜DSML｜"
  kInvoke,        // `invoke name="`
  kCallsEndV41,   // "</｜DSML｜ calls>"
  kCallsEndV4,    // "</｜DSML｜tool_calls>"
  kCallsTail,     // "calls>" after a bare "</｜DSML｜" closed the arguments (invoke closer missing)
  kInvokeTail,    // "invoke>" after "</｜DSML｜": the normal end of an invoke
  kQuote,         // `"`
  kParam,         // `parameter name="`
  kTrue,          // `true">`
  kFalse,         // `false">`
  kGt,            // `>`: a parameter without a string attribute
  kJsonFence,     // "```json\n"
  kJsonFencePlain,  // "```\n"
  kJsonObj,       // "{"
  kJsonArr,       // "["
  kJsonEnd,       // "\n```"
  kV3CallsBegin,  // "<｜tool▁calls▁begin｜>"
  kV3CallBegin,   // "<｜tool▁call▁begin｜>"
  kV3CallEnd,
  kV3CallsEnd,
  kV3Sep,
  kNewline,
  kThinkEndPlain,  // a stray "</think>" in answer text (its newlines stay content)
  kStopBase,
};

struct FixedLabel {
  const char* text;
  bool newlines_before;
};

constexpr FixedLabel kFixed[kStopBase] = {
    {"</think>", true},
    {"<｜DSML｜", true},
    {"</｜DSML｜", false},
    {"invoke name=\"", false},
    {"</｜DSML｜ calls>", false},
    {"</｜DSML｜tool_calls>", false},
    {"calls>", false},
    {"invoke>", false},
    {"\"", false},
    {"parameter name=\"", false},
    {"true\">", false},
    {"false\">", false},
    {">", false},
    {"```json\n", false},
    {"```\n", false},
    {"{", false},
    {"[", false},
    {"\n```", false},
    {"<｜tool▁calls▁begin｜>", true},
    {"<｜tool▁call▁begin｜>", true},
    {"<｜tool▁call▁end｜>", false},
    {"<｜tool▁calls▁end｜>", false},
    {"<｜tool▁sep｜>", false},
    {"\n", false},
    {"</think>", false},
};

size_t utf8_len(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return lead >= 0xC2 ? 2 : 0;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return lead <= 0xF4 ? 4 : 0;
  return 0;
}

// Length of a complete, valid UTF-8 character at s[i], or 0.
size_t valid_char_at(std::string_view s, size_t i) {
  const auto c0 = static_cast<unsigned char>(s[i]);
  size_t n = utf8_len(c0);
  if (n <= 1) return n;
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 0;
  const auto c1 = static_cast<unsigned char>(s[i + 1]);
  if (n == 3 && ((c0 == 0xE0 && c1 < 0xA0) || (c0 == 0xED && c1 >= 0xA0))) return 0;  // overlong / surrogate
  if (n == 4 && ((c0 == 0xF0 && c1 < 0x90) || (c0 == 0xF4 && c1 >= 0x90))) return 0;  // overlong / > U+10FFFF
  return n;
}

void append_sanitized(std::string& out, std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t n = valid_char_at(s, i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
}

void append_json_escaped(std::string& out, std::string_view s) {
  std::string clean;
  append_sanitized(clean, s);
  utf8::append_json_string_body(out, clean);
}

std::string json_string(std::string_view s) {
  std::string out = "\"";
  append_json_escaped(out, s);
  out += '"';
  return out;
}

std::string_view trim(std::string_view s) {
  const char* ws = " \t\r\n";
  size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  size_t e = s.find_last_not_of(ws);
  return s.substr(b, e - b + 1);
}

// Bytes at the end of `s` that form the start of an unfinished UTF-8 character.
size_t incomplete_utf8_tail(std::string_view s) {
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const auto c = static_cast<unsigned char>(s[s.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    size_t need = utf8_len(c);
    return need > back ? back : 0;
  }
  return 0;
}

}  // namespace

StreamParser::StreamParser(ParserOptions options) : opt_(std::move(options)) {
  opt_.stop_sequences.erase(
      std::remove_if(opt_.stop_sequences.begin(), opt_.stop_sequences.end(), [](const std::string& s) { return s.empty(); }),
      opt_.stop_sequences.end());
  if (opt_.start_in_tool_calls && opt_.parse_tool_calls) {
    enter(opt_.syntax == ToolCallSyntax::Dsml ? Stage::DsmlCalls : Stage::V3Calls);
  } else if (opt_.start_in_reasoning) {
    enter(Stage::Reasoning);
    leading_ = true;
  } else {
    enter(Stage::Common);
    leading_ = true;
  }
}

bool StreamParser::done() const { return stage_ == Stage::Finished; }

void StreamParser::enter(Stage stage) {
  stage_ = stage;
  leading_ = false;
  active_labels_.clear();
  auto stops = [&] {
    for (size_t i = 0; i < opt_.stop_sequences.size(); ++i) active_labels_.push_back(kStopBase + static_cast<int>(i));
  };
  auto tool_begin = [&] {
    if (!opt_.parse_tool_calls) return;
    if (opt_.syntax == ToolCallSyntax::Dsml) {
      active_labels_.push_back(kDsmlBegin);
    } else {
      active_labels_.push_back(kV3CallsBegin);
      active_labels_.push_back(kV3CallBegin);
    }
  };
  switch (stage) {
    case Stage::Common:
      if (opt_.parse_json_output) {
        for (int id : {kJsonFence, kJsonFencePlain, kJsonObj, kJsonArr}) active_labels_.push_back(id);
      } else {
        stops();
      }
      tool_begin();
      active_labels_.push_back(kThinkEndPlain);
      break;
    case Stage::Json:
      stops();
      active_labels_.push_back(kJsonEnd);
      break;
    case Stage::MatchedJson: tool_begin(); break;
    case Stage::Reasoning:
      tool_begin();
      active_labels_.push_back(kThinkEnd);
      break;
    case Stage::DsmlCalls:
      active_labels_.push_back(kInvoke);
      active_labels_.push_back(kCallsEndV41);
      active_labels_.push_back(kCallsEndV4);
      break;
    case Stage::DsmlAfterEnd:
      active_labels_.push_back(kInvokeTail);
      active_labels_.push_back(kCallsTail);
      active_labels_.push_back(kInvoke);
      break;
    case Stage::DsmlName: active_labels_.push_back(kQuote); break;
    case Stage::DsmlArgs:
      active_labels_.push_back(kParam);
      active_labels_.push_back(kDsmlEnd);
      active_labels_.push_back(kInvoke);
      break;
    case Stage::DsmlParamName: active_labels_.push_back(kQuote); break;
    case Stage::DsmlParamType:
      active_labels_.push_back(kTrue);
      active_labels_.push_back(kFalse);
      active_labels_.push_back(kGt);
      break;
    case Stage::DsmlParamValue:
      active_labels_.push_back(kDsmlEnd);
      active_labels_.push_back(kDsmlBegin);
      break;
    case Stage::V3Calls:
      active_labels_.push_back(kV3CallBegin);
      active_labels_.push_back(kV3CallsEnd);
      break;
    case Stage::V3CallHead:
      active_labels_.push_back(kV3Sep);
      active_labels_.push_back(kV3CallEnd);
      active_labels_.push_back(kV3CallsEnd);
      break;
    case Stage::V3CallName:
      active_labels_.push_back(kNewline);
      active_labels_.push_back(kV3CallEnd);
      active_labels_.push_back(kV3CallsEnd);
      break;
    case Stage::V3CallArgs:
      active_labels_.push_back(kV3CallEnd);
      active_labels_.push_back(kV3CallsEnd);
      break;
    case Stage::Finished: break;
  }
}

void StreamParser::emit(EventKind kind, std::string_view text, std::vector<StreamEvent>& out, int tool_index) {
  const bool textual = kind == EventKind::Reasoning || kind == EventKind::Content || kind == EventKind::Invalid ||
                       kind == EventKind::ToolCallArguments;
  if (textual && text.empty()) return;
  if (kind == EventKind::Content || kind == EventKind::ToolCallBegin) any_answer_ = true;
  if (textual && out.size() > merge_floor_ && out.back().kind == kind && out.back().tool_index == tool_index) {
    out.back().text.append(text);
    return;
  }
  out.push_back(StreamEvent{kind, std::string(text), tool_index});
}

void StreamParser::emit_unmatched(std::string_view text, std::vector<StreamEvent>& out) {
  if (text.empty()) return;
  std::string clean;
  switch (stage_) {
    case Stage::Common:
      if (opt_.parse_json_output) return;  // text around the JSON value is dropped
      append_sanitized(clean, text);
      emit(EventKind::Content, clean, out);
      return;
    case Stage::Json:
      append_sanitized(clean, text);
      emit(EventKind::Content, clean, out);
      return;
    case Stage::Reasoning:
      append_sanitized(clean, text);
      if (opt_.unclosed_reasoning_as_content && !any_answer_) reasoning_text_ += clean;
      emit(EventKind::Reasoning, clean, out);
      return;
    case Stage::DsmlName:
    case Stage::V3CallName: name_buf_.append(text); return;
    case Stage::V3CallHead:
      if (opt_.syntax == ToolCallSyntax::V31) name_buf_.append(text);  // V3 puts the type ("function") here
      return;
    case Stage::DsmlParamName:
      append_json_escaped(clean, text);
      emit(EventKind::ToolCallArguments, clean, out, tool_count_ - 1);
      return;
    case Stage::DsmlParamValue:
      if (value_is_string_) {
        append_json_escaped(clean, text);
        emit(EventKind::ToolCallArguments, clean, out, tool_count_ - 1);
      } else {
        value_buf_.append(text);
      }
      return;
    case Stage::V3CallArgs: value_buf_.append(text); return;
    case Stage::Finished:
      append_sanitized(clean, text);
      emit(EventKind::Invalid, clean, out);
      return;
    case Stage::MatchedJson:
    case Stage::DsmlCalls:
    case Stage::DsmlAfterEnd:
    case Stage::DsmlArgs:
    case Stage::DsmlParamType:
    case Stage::V3Calls: return;  // markup between tags is skipped
  }
}

void StreamParser::begin_tool_call(std::vector<StreamEvent>& out) {
  std::string name;
  append_sanitized(name, trim(name_buf_));
  name_buf_.clear();
  value_buf_.clear();
  ++tool_count_;
  in_call_ = true;
  args_leading_ = true;
  emit(EventKind::ToolCallBegin, name, out, tool_count_ - 1);
}

void StreamParser::end_tool_call(std::vector<StreamEvent>& out) {
  emit(EventKind::ToolCallArguments, args_leading_ ? "{}" : "}", out, tool_count_ - 1);
  emit(EventKind::ToolCallEnd, "", out, tool_count_ - 1);
  in_call_ = false;
}

void StreamParser::close_param_value(std::vector<StreamEvent>& out) {
  if (value_is_string_) {
    emit(EventKind::ToolCallArguments, "\"", out, tool_count_ - 1);
    return;
  }
  // Non-string values are buffered so a malformed one can be passed on as a string: the arguments
  // must stay valid JSON.
  std::string_view v = trim(value_buf_);
  if (!v.empty() && nlohmann::json::accept(v)) {
    emit(EventKind::ToolCallArguments, v, out, tool_count_ - 1);
  } else {
    emit(EventKind::ToolCallArguments, json_string(v), out, tool_count_ - 1);
  }
  value_buf_.clear();
}

void StreamParser::finish_v3_call(std::vector<StreamEvent>& out) {
  std::string_view raw = trim(value_buf_);
  if (opt_.syntax == ToolCallSyntax::V3) {
    if (raw.substr(0, 7) == "```json") {
      raw.remove_prefix(7);
    } else if (raw.substr(0, 3) == "```") {
      raw.remove_prefix(3);
    }
    if (raw.size() >= 3 && raw.substr(raw.size() - 3) == "```") raw.remove_suffix(3);
    raw = trim(raw);
  }
  auto parsed = nlohmann::json::parse(raw, nullptr, /*allow_exceptions=*/false);
  std::string args;
  if (parsed.is_object()) {
    args = std::string(raw);
  } else if (raw.empty()) {
    args = "{}";
  } else {
    args = "{\"arguments\": " + json_string(raw) + "}";  // the same wrapping the V4 encoder applies
  }
  emit(EventKind::ToolCallArguments, args, out, tool_count_ - 1);
  emit(EventKind::ToolCallEnd, "", out, tool_count_ - 1);
  value_buf_.clear();
  in_call_ = false;
}

void StreamParser::close_open_call(std::vector<StreamEvent>& out) {
  const int idx = tool_count_ - 1;
  switch (stage_) {
    case Stage::DsmlName:
      begin_tool_call(out);
      end_tool_call(out);
      break;
    case Stage::DsmlArgs: end_tool_call(out); break;
    case Stage::DsmlParamName:
      emit(EventKind::ToolCallArguments, "\": null", out, idx);
      end_tool_call(out);
      break;
    case Stage::DsmlParamType:
      emit(EventKind::ToolCallArguments, "null", out, idx);
      end_tool_call(out);
      break;
    case Stage::DsmlParamValue:
      close_param_value(out);
      end_tool_call(out);
      break;
    case Stage::V3CallName:
      if (!trim(name_buf_).empty()) {
        begin_tool_call(out);
        finish_v3_call(out);
      }
      break;
    case Stage::V3CallArgs: finish_v3_call(out); break;
    default: break;
  }
}

void StreamParser::on_label(int id, std::vector<StreamEvent>& out) {
  const bool at_limit = opt_.max_tool_calls > 0 && tool_count_ >= opt_.max_tool_calls;
  if (at_limit && (id == kInvoke || id == kV3CallBegin)) {
    // One more call would start: the last allowed one ends here, closed by its tag or not.
    if (in_call_) {
      if (opt_.syntax == ToolCallSyntax::Dsml) {
        end_tool_call(out);
      } else {
        close_open_call(out);
      }
    }
    finished_calls_ = true;
    enter(Stage::Finished);
    return;
  }
  on_label_inner(id, out);
  if (opt_.max_tool_calls > 0 && tool_count_ >= opt_.max_tool_calls && !in_call_ && stage_ != Stage::Finished) {
    finished_calls_ = true;
    enter(Stage::Finished);
  }
}

void StreamParser::on_label_inner(int id, std::vector<StreamEvent>& out) {
  if (id >= kStopBase) {
    stopped_ = true;
    matched_stop_ = opt_.stop_sequences[id - kStopBase];
    enter(Stage::Finished);
    return;
  }
  const int idx = tool_count_ - 1;
  switch (id) {
    case kThinkEnd:
    case kThinkEndPlain:
      if (stage_ == Stage::Reasoning) {
        enter(Stage::Common);
        leading_ = true;
      } else {
        emit(EventKind::Invalid, "</think>", out);  // a stray end of thinking outside reasoning
      }
      break;
    case kDsmlBegin:
      if (stage_ == Stage::DsmlParamValue) {  // a new tag while a value is open: the closer is missing
        close_param_value(out);
        enter(Stage::DsmlArgs);
      } else {
        enter(Stage::DsmlCalls);
      }
      break;
    case kDsmlEnd:
      if (stage_ == Stage::DsmlArgs) {
        end_tool_call(out);
        enter(Stage::DsmlAfterEnd);
      } else {  // DsmlParamValue
        close_param_value(out);
        enter(Stage::DsmlArgs);
      }
      break;
    case kInvoke:
      if (stage_ == Stage::DsmlArgs) end_tool_call(out);  // the previous invoke was never closed
      name_buf_.clear();
      enter(Stage::DsmlName);
      break;
    case kInvokeTail: enter(Stage::DsmlCalls); break;
    case kCallsEndV41:
    case kCallsEndV4:
    case kCallsTail:
      finished_calls_ = true;
      enter(Stage::Finished);
      break;
    case kQuote:
      if (stage_ == Stage::DsmlName) {
        begin_tool_call(out);
        enter(Stage::DsmlArgs);
      } else {  // DsmlParamName
        emit(EventKind::ToolCallArguments, "\": ", out, idx);
        enter(Stage::DsmlParamType);
      }
      break;
    case kParam:
      emit(EventKind::ToolCallArguments, args_leading_ ? "{\"" : ", \"", out, idx);
      args_leading_ = false;
      enter(Stage::DsmlParamName);
      break;
    case kTrue:
      value_is_string_ = true;
      emit(EventKind::ToolCallArguments, "\"", out, idx);
      enter(Stage::DsmlParamValue);
      break;
    case kFalse:
    case kGt:
      value_is_string_ = false;
      value_buf_.clear();
      enter(Stage::DsmlParamValue);
      break;
    case kJsonFence:
    case kJsonFencePlain: enter(Stage::Json); break;
    case kJsonObj:
      emit(EventKind::Content, "{", out);
      enter(Stage::Json);
      break;
    case kJsonArr:
      emit(EventKind::Content, "[", out);
      enter(Stage::Json);
      break;
    case kJsonEnd: enter(Stage::MatchedJson); break;
    case kV3CallsBegin: enter(Stage::V3Calls); break;
    case kV3CallBegin:
      name_buf_.clear();
      enter(Stage::V3CallHead);
      break;
    case kV3Sep:
      if (opt_.syntax == ToolCallSyntax::V31) {
        begin_tool_call(out);
        enter(Stage::V3CallArgs);
      } else {
        name_buf_.clear();
        enter(Stage::V3CallName);
      }
      break;
    case kNewline:
      begin_tool_call(out);
      enter(Stage::V3CallArgs);
      break;
    case kV3CallEnd:
    case kV3CallsEnd:
      if (stage_ == Stage::V3CallHead && opt_.syntax == ToolCallSyntax::V31 && !trim(name_buf_).empty()) {
        begin_tool_call(out);
        finish_v3_call(out);
      } else if (stage_ == Stage::V3CallName || stage_ == Stage::V3CallArgs) {
        close_open_call(out);
      }
      if (id == kV3CallsEnd) {
        finished_calls_ = true;
        enter(Stage::Finished);
      } else {
        enter(Stage::V3Calls);
      }
      break;
    default: break;
  }
}

void StreamParser::process(bool final_flush, std::vector<StreamEvent>& out) {
  size_t pos = 0;
  for (;;) {
    if (leading_) {
      while (pos < pending_.size() && pending_[pos] == '\n') ++pos;
      if (pos < pending_.size()) leading_ = false;
    }
    if (active_labels_.empty()) break;
    const std::string_view rest = std::string_view(pending_).substr(pos);
    // The label that completes first wins; ties go to the earlier label in the stage's list.
    size_t best_end = std::string_view::npos, best_start = 0;
    int best = -1;
    for (int id : active_labels_) {
      const std::string_view text = id >= kStopBase ? std::string_view(opt_.stop_sequences[id - kStopBase])
                                                    : std::string_view(kFixed[id].text);
      size_t p = rest.find(text);
      if (p == std::string_view::npos) continue;
      size_t end = p + text.size();
      if (end < best_end) {
        best_end = end;
        best = id;
        best_start = p;
        if (id < kStopBase && kFixed[id].newlines_before)
          while (best_start > 0 && rest[best_start - 1] == '\n') --best_start;
      }
    }
    if (best < 0) break;
    emit_unmatched(rest.substr(0, best_start), out);
    on_label(best, out);
    pos += best_end;
  }
  std::string_view rest = std::string_view(pending_).substr(pos);
  size_t hold = 0;
  if (!final_flush) {
    for (int id : active_labels_) {
      const std::string_view text = id >= kStopBase ? std::string_view(opt_.stop_sequences[id - kStopBase])
                                                    : std::string_view(kFixed[id].text);
      const bool nl = id < kStopBase && kFixed[id].newlines_before;
      size_t k = std::min(text.size() - 1, rest.size());
      for (; k > 0; --k)
        if (rest.substr(rest.size() - k) == text.substr(0, k)) break;
      if (nl)
        while (k < rest.size() && rest[rest.size() - k - 1] == '\n') ++k;
      hold = std::max(hold, k);
    }
    hold = std::max(hold, incomplete_utf8_tail(rest));
  }
  emit_unmatched(rest.substr(0, rest.size() - hold), out);
  pending_.erase(0, pending_.size() - hold);
}

void StreamParser::feed(std::string_view chunk, std::vector<StreamEvent>& out) {
  merge_floor_ = out.size();
  pending_.append(chunk);
  process(false, out);
}

void StreamParser::finish(StopCause cause, std::vector<StreamEvent>& out) {
  merge_floor_ = out.size();
  process(true, out);
  close_open_call(out);
  if (stage_ == Stage::Reasoning && cause != StopCause::Length && opt_.unclosed_reasoning_as_content && !any_answer_ &&
      !reasoning_text_.empty()) {
    emit(EventKind::Content, reasoning_text_, out);
  }
  std::string reason = "stop";
  if (stopped_) {
    reason = "stop";
  } else if (cause == StopCause::Length && !finished_calls_) {
    reason = "length";
  } else if (tool_count_ > 0) {
    reason = "tool_calls";
  }
  enter(Stage::Finished);
  out.push_back(StreamEvent{EventKind::Finish, reason, -1});
}

}  // namespace di::stream
