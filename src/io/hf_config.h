// Generic reading of a Hugging Face config.json: the JSON itself, the architecture it names, and
// typed reads of its keys. Each architecture maps the keys onto its own config type
// (src/model/<arch>/config.cpp).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/file_util.h"  // json_type_name

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

// Typed access to one JSON object of a config, throwing LoadError "origin: prefix.key: problem"
// (prefix names the enclosing objects, e.g. "text_config.rope_scaling.").
class HfConfigSection {
 public:
  HfConfigSection(const nlohmann::json& j, std::string prefix, std::string origin);

  [[noreturn]] void fail(const std::string& key, const std::string& msg) const;
  [[noreturn]] void wrong(const std::string& key, const char* expected, const nlohmann::json& v) const;
  bool has(const std::string& key) const;        // present, null included
  bool has_value(const std::string& key) const;  // present and not null
  const nlohmann::json& at(const std::string& key) const;  // fails "missing key"
  HfConfigSection sub(const std::string& key) const;       // a member object

  int64_t i64(const std::string& key) const;
  // An integer in [min, INT_MAX].
  int i32(const std::string& key, int min = std::numeric_limits<int>::min()) const;
  double num(const std::string& key) const;
  bool boolean(const std::string& key) const;
  std::string str(const std::string& key) const;

  void get(const std::string& key, int64_t* out) const { *out = i64(key); }
  void get(const std::string& key, int* out) const { *out = i32(key); }
  void get(const std::string& key, double* out) const { *out = num(key); }
  void get(const std::string& key, float* out) const { *out = float(num(key)); }
  void get(const std::string& key, bool* out) const { *out = boolean(key); }
  void get(const std::string& key, std::string* out) const { *out = str(key); }
  void get_list(const std::string& key, std::vector<int>* out) const;
  void get_list(const std::string& key, std::vector<int64_t>* out) const;
  // Descriptive HF keys the engine does not use: optional, but when present must hold the value
  // the engine implements.
  template <class T>
  void expect_if_present(const std::string& key, const T& want) const {
    if (!has(key)) return;
    const nlohmann::json& v = at(key);
    const nlohmann::json w = want;
    if (v.type() != w.type() && !(v.is_number() && w.is_number())) wrong(key, json_type_name(w), v);
    if (v != w) fail(key, "is " + v.dump() + ", only " + w.dump() + " is supported");
  }

 private:
  int64_t i64_of(const std::string& key, const nlohmann::json& v) const;
  int int_of(const std::string& key, const nlohmann::json& v, int min) const;
  template <class T>
  void list(const std::string& key, std::vector<T>* out) const;

  const nlohmann::json& j_;
  std::string prefix_, origin_;
};

}  // namespace di
