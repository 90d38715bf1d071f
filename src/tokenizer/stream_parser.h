// Streaming output parser: model text, fed in chunks of any size and split, -> reasoning text, content
// text and tool calls (name, then arguments as incremental JSON). A label matcher holds back only the
// bytes that could still start a label (a tag, `</think>`, a stop string), so a tag split across chunks
// is recognised and no partial stop string leaks; the events do not depend on how the text was split.
// Semantics follow deepseek-recipe's `src/stream/state_machine.rs`; differences are listed in docs/chat.md.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace di::stream {

enum class ToolCallSyntax {
  Dsml,  // DeepSeek-V4.1 `<｜DSML｜ calls>` and V4 `<｜DSML｜tool_calls>` (both recognised)
  V3,    // DeepSeek-V3 / R1: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>`
  V31,   // DeepSeek-V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`
};

struct ParserOptions {
  ToolCallSyntax syntax = ToolCallSyntax::Dsml;
  bool parse_tool_calls = true;
  bool start_in_tool_calls = false;   // the prompt pre-filled the calls block (tool_choice required)
  bool start_in_reasoning = false;    // the prompt ended with `<think>`
  bool parse_json_output = false;     // JSON mode: keep the JSON value, drop fences and surrounding text
  std::vector<std::string> stop_sequences;  // matched in answer text and JSON output only
  // > 0: the output ends once this many tool calls are complete (parallel_tool_calls: false -> 1);
  // anything after is dropped and the finish reason is "tool_calls".
  int max_tool_calls = 0;
  // If the output ends (not by the length limit) while still in reasoning and no answer or tool call
  // came, re-emit the reasoning text as content so the answer is not lost (deepseek-recipe leaves it
  // in reasoning only; set false to match it exactly).
  bool unclosed_reasoning_as_content = true;
};

enum class EventKind {
  Reasoning,          // text
  Content,            // text
  ToolCallBegin,      // tool_index, text = function name
  ToolCallArguments,  // tool_index, text = next piece of the arguments JSON
  ToolCallEnd,        // tool_index
  Invalid,            // text skipped as invalid (stray `</think>`, text after the calls block); informational
  Finish,             // text = finish reason: "stop", "length" or "tool_calls"; last event
};

enum class StopCause { EndOfText, Length };

struct StreamEvent {
  EventKind kind;
  std::string text;
  int tool_index = -1;
  bool operator==(const StreamEvent&) const = default;
};

class StreamParser {
 public:
  explicit StreamParser(ParserOptions options);

  // Appends the events for `chunk` to `out` (merging adjacent text of one kind). Never throws on
  // any input; invalid UTF-8 comes out as U+FFFD.
  void feed(std::string_view chunk, std::vector<StreamEvent>& out);
  // Flushes held-back text, closes an unfinished tool call so its arguments stay valid JSON, and
  // appends a Finish event. `cause` = Length when generation hit max_tokens.
  void finish(StopCause cause, std::vector<StreamEvent>& out);

  // True once a stop sequence matched or the tool-calls block closed: generation can stop.
  bool done() const;
  // The stop sequence that matched, if any.
  const std::string& matched_stop() const { return matched_stop_; }
  int tool_call_count() const { return tool_count_; }

  enum class Stage {
    Common, Json, MatchedJson, Reasoning,
    DsmlCalls, DsmlAfterEnd, DsmlName, DsmlArgs, DsmlParamName, DsmlParamType, DsmlParamValue,
    V3Calls, V3CallHead, V3CallName, V3CallArgs,
    Finished,
  };

 private:
  void process(bool final_flush, std::vector<StreamEvent>& out);
  void enter(Stage stage);
  void emit_unmatched(std::string_view text, std::vector<StreamEvent>& out);
  void on_label(int label_id, std::vector<StreamEvent>& out);
  void on_label_inner(int label_id, std::vector<StreamEvent>& out);
  void emit(EventKind kind, std::string_view text, std::vector<StreamEvent>& out, int tool_index = -1);
  void begin_tool_call(std::vector<StreamEvent>& out);
  void end_tool_call(std::vector<StreamEvent>& out);
  void close_param_value(std::vector<StreamEvent>& out);
  void finish_v3_call(std::vector<StreamEvent>& out);
  void close_open_call(std::vector<StreamEvent>& out);

  ParserOptions opt_;
  Stage stage_;
  bool leading_ = false;           // drop '\n' at the start of this stage
  bool args_leading_ = true;       // no parameter emitted yet in this call
  bool value_is_string_ = false;   // current DSML parameter has string="true"
  bool in_call_ = false;           // between ToolCallBegin and ToolCallEnd
  bool finished_calls_ = false;    // the calls block closed
  bool stopped_ = false;           // a stop sequence matched
  bool any_answer_ = false;        // content or a tool call was emitted
  int tool_count_ = 0;
  std::string pending_;            // input not yet classified
  std::string name_buf_;           // tool name being read
  std::string value_buf_;          // non-string DSML value / V3 arguments being read
  std::string reasoning_text_;     // for unclosed_reasoning_as_content
  std::string matched_stop_;
  size_t merge_floor_ = 0;         // events before this index belong to an earlier call: never merged into
  std::vector<int> active_labels_;  // label ids for the current stage, in priority order
};

}  // namespace di::stream
