// JSON Schema -> grammar, and the built-in "any JSON" grammars.
//
// The grammar generates a subset of the JSON texts that validate: properties in the schema's
// order, no duplicate keys, strings with only the escapes JSON requires plus \uXXXX for
// non-surrogates. Supported keywords are listed in docs/structured-output.md; any other keyword
// that constrains values is refused with a GrammarError naming it and where it is.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "grammar/grammar.h"

namespace di::grammar {

struct JsonSchemaOptions {
  // Whitespace between tokens: any run of space, tab, newline, carriage return; or none at all.
  bool any_whitespace = true;
  // What an object without "additionalProperties" allows: false follows OpenAI's strict mode
  // (only the listed properties); true follows the JSON Schema default.
  bool additional_properties_default = false;
  // Code points that strings may contain only as \uXXXX escapes. Tool-call grammars list U+FF5C
  // (the bar in every DeepSeek control token), so no control-token text can appear inside JSON.
  std::vector<uint32_t> escaped_code_points;
};

Grammar json_schema_grammar(const nlohmann::ordered_json& schema, const JsonSchemaOptions& opt = {});
// Parses the schema text first (keeping property order). Bad JSON is a GrammarError too.
Grammar json_schema_grammar(std::string_view schema_text, const JsonSchemaOptions& opt = {});

// Any JSON object (response_format json_object), or any JSON value.
Grammar json_object_grammar(const JsonSchemaOptions& opt = {});
Grammar json_value_grammar(const JsonSchemaOptions& opt = {});

// Adds the JSON value rules (json-value, json-object, json-array, json-string, json-number,
// json-integer) to g if absent: building blocks for grammars that embed JSON (tool calls).
void add_json_rules(Grammar& g, const JsonSchemaOptions& opt = {});
// The grammar for values of `schema` added to g under a fresh rule name (returned), for grammars
// that embed schema-checked JSON (tool-call arguments).
std::string add_json_schema_rule(Grammar& g, const nlohmann::ordered_json& schema, std::string_view name_base,
                                 const JsonSchemaOptions& opt = {});

}  // namespace di::grammar
