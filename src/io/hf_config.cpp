#include "io/hf_config.h"

#include <fstream>
#include <limits>
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

HfConfigSection::HfConfigSection(const nlohmann::json& j, std::string prefix, std::string origin)
    : j_(j), prefix_(std::move(prefix)), origin_(std::move(origin)) {}

void HfConfigSection::fail(const std::string& key, const std::string& msg) const {
  throw LoadError(origin_ + ": " + prefix_ + key + ": " + msg);
}

void HfConfigSection::wrong(const std::string& key, const char* expected, const nlohmann::json& v) const {
  fail(key, std::string("expected ") + expected + ", got " + json_type_name(v));
}

bool HfConfigSection::has(const std::string& key) const { return j_.contains(key); }

bool HfConfigSection::has_value(const std::string& key) const {
  auto it = j_.find(key);
  return it != j_.end() && !it->is_null();
}

const nlohmann::json& HfConfigSection::at(const std::string& key) const {
  auto it = j_.find(key);
  if (it == j_.end()) fail(key, "missing key");
  return *it;
}

HfConfigSection HfConfigSection::sub(const std::string& key) const {
  const nlohmann::json& v = at(key);
  if (!v.is_object()) wrong(key, "object", v);
  return HfConfigSection(v, prefix_ + key + ".", origin_);
}

int64_t HfConfigSection::i64_of(const std::string& key, const nlohmann::json& v) const {
  if (!v.is_number_integer()) wrong(key, "integer", v);
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
    fail(key, "integer " + v.dump() + " out of range");
  return v.get<int64_t>();
}

int HfConfigSection::int_of(const std::string& key, const nlohmann::json& v, int min) const {
  const int64_t x = i64_of(key, v);
  if (x < min || x > std::numeric_limits<int>::max()) fail(key, "integer " + std::to_string(x) + " out of range");
  return int(x);
}

int64_t HfConfigSection::i64(const std::string& key) const { return i64_of(key, at(key)); }

int HfConfigSection::i32(const std::string& key, int min) const { return int_of(key, at(key), min); }

double HfConfigSection::num(const std::string& key) const {
  const nlohmann::json& v = at(key);
  if (!v.is_number()) wrong(key, "number", v);
  return v.get<double>();
}

bool HfConfigSection::boolean(const std::string& key) const {
  const nlohmann::json& v = at(key);
  if (!v.is_boolean()) wrong(key, "boolean", v);
  return v.get<bool>();
}

std::string HfConfigSection::str(const std::string& key) const {
  const nlohmann::json& v = at(key);
  if (!v.is_string()) wrong(key, "string", v);
  return v.get<std::string>();
}

template <class T>
void HfConfigSection::list(const std::string& key, std::vector<T>* out) const {
  const nlohmann::json& v = at(key);
  if (!v.is_array()) wrong(key, "array of integers", v);
  out->clear();
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string k = key + "[" + std::to_string(i) + "]";
    if constexpr (std::is_same_v<T, int>) out->push_back(int_of(k, v[i], std::numeric_limits<int>::min()));
    else out->push_back(i64_of(k, v[i]));
  }
}

void HfConfigSection::get_list(const std::string& key, std::vector<int>* out) const { list(key, out); }
void HfConfigSection::get_list(const std::string& key, std::vector<int64_t>* out) const { list(key, out); }

}  // namespace di
