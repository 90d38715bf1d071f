// Generic reading of a Hugging Face config.json: the JSON itself and the architecture it names.
// Each architecture maps the rest onto its own config type (src/model/<arch>/).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace di {

// Parses the file; throws LoadError naming the path when it is missing, unreadable, not JSON or
// not an object.
nlohmann::json read_json_file(const std::string& path);
nlohmann::json parse_json_object(const std::string& text, const std::string& origin);

// `model_type` and `architectures` of a config.json (empty when absent or not strings).
struct HfArchitecture {
  std::string model_type;
  std::vector<std::string> architectures;
};
HfArchitecture hf_architecture(const nlohmann::json& config);

}  // namespace di
