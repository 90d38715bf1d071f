#include "io/hf_config.h"

#include <fstream>
#include <sstream>

#include "io/file_util.h"
#include "io/safetensors.h"  // LoadError

namespace di {

nlohmann::json parse_json_object(const std::string& text, const std::string& origin) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw LoadError(origin + ": invalid JSON: " + e.what());
  }
  if (!j.is_object()) throw LoadError(origin + ": expected a JSON object at top level, got " + json_type_name(j));
  return j;
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw LoadError(path + ": cannot open config file");
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw LoadError(path + ": read error");
  return parse_json_object(ss.str(), path);
}

HfArchitecture hf_architecture(const nlohmann::json& config) {
  HfArchitecture a;
  if (auto it = config.find("model_type"); it != config.end() && it->is_string()) a.model_type = it->get<std::string>();
  if (auto it = config.find("architectures"); it != config.end() && it->is_array())
    for (const auto& v : *it)
      if (v.is_string()) a.architectures.push_back(v.get<std::string>());
  return a;
}

}  // namespace di
