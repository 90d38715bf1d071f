// Grammars that force a tool call in the model's own format, with arguments valid against each
// tool's parameter schema (tool_choice "required" / a named function).
//
//   DSML (V4.1; V4 without the space in the tag names):
//     <｜DSML｜ calls>\n
//     <｜DSML｜ invoke name="NAME">\n
//     <｜DSML｜ parameter name="KEY" string="true">RAW TEXT</｜DSML｜ parameter>\n      (strings)
//     <｜DSML｜ parameter name="KEY" string="false">JSON</｜DSML｜ parameter>\n         (other values)
//     </｜DSML｜ invoke>\n ... </｜DSML｜ calls>
//   V3:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>
//         (calls separated by \n) <｜tool▁calls▁end｜>
//   V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
// The control tokens these spell (｜DSML｜, <｜tool▁sep｜>, ...) must be counted as text in the
// matcher's Vocabulary (VocabularyOptions::text_added_ids); control_tokens lists them. JSON
// strings in arguments write U+FF5C (the bar of every control token) as \uff5c, and raw DSML text
// never contains "</｜DSML｜", so no value can end a call early.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "grammar/grammar.h"
#include "grammar/json_schema.h"

namespace di::grammar {

enum class ToolCallFormat { kDsmlV41, kDsmlV4, kV3, kV31 };

struct ToolSpec {
  std::string name;
  nlohmann::ordered_json parameters;  // a JSON schema of an object; null: no parameters
};

struct ToolCallGrammarOptions {
  ToolCallFormat format = ToolCallFormat::kDsmlV41;
  bool parallel = true;  // several calls (parallel_tool_calls), else exactly one
  // DSML: the prompt already ends with the calls-block opener and its newline (tool_choice
  // "required" pre-fills it), so the grammar starts at the first invoke.
  bool opener_in_prompt = false;
  JsonSchemaOptions json;
};

struct ToolCallGrammar {
  Grammar grammar;
  std::vector<std::string> control_tokens;  // added-token texts the grammar spells
};

ToolCallGrammar tool_call_grammar(const std::vector<ToolSpec>& tools, const ToolCallGrammarOptions& opt = {});

}  // namespace di::grammar
