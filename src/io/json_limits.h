// JSON text from clients -> nlohmann::ordered_json with bounds, in time linear in the input.
//
// nlohmann's own ordered_json parser looks every key up linearly before inserting it (quadratic in
// the keys of one object), and values nested thousands deep overflow the stack later, in the
// recursive writers (dump(), copies, comparisons). This parser builds the same value (keys in the
// client's order; a repeated key keeps its first position and takes the last value, as
// ordered_json::parse does) but counts nesting and keys as it goes and stops at the first limit,
// before anything deep exists.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace di {

struct JsonLimits {
  size_t max_depth = 128;    // nested arrays/objects; the outermost container is level 1
  size_t max_keys = 10000;   // keys in one object
};

struct JsonLimitError {
  enum class Kind { Syntax, Depth, Keys };
  Kind kind = Kind::Syntax;
  std::string message;  // nlohmann's parse_error text, or which limit and where
  std::string path;     // where a limit was hit, e.g. "tools[0].function.parameters" (shortened); "" = the top
};

// Parses `text` into `out`. Returns the error instead of throwing.
std::optional<JsonLimitError> parse_json_limited(std::string_view text, const JsonLimits& limits, nlohmann::ordered_json& out);

}  // namespace di
