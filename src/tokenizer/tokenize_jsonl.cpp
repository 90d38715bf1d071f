#include "tokenizer/tokenize_jsonl.h"

#include <istream>
#include <nlohmann/json.hpp>
#include <ostream>
#include <stdexcept>

#include "tokenizer/tokenizer.h"

namespace di {

namespace {

nlohmann::json process_line(const Tokenizer& tok, const TokenizeJsonlOptions& options, const std::string& line) {
  nlohmann::json obj;
  try {
    obj = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::invalid_argument(std::string("not valid JSON: ") + e.what());
  }
  if (!obj.is_object()) throw std::invalid_argument("expected a JSON object");
  if (options.decode) {
    if (!obj.contains("ids") || !obj["ids"].is_array()) throw std::invalid_argument("missing array \"ids\"");
    std::vector<int32_t> ids;
    ids.reserve(obj["ids"].size());
    for (size_t i = 0; i < obj["ids"].size(); ++i) {
      const auto& v = obj["ids"][i];
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= tok.vocab_size()) {
        throw std::invalid_argument("ids[" + std::to_string(i) + "]: not a token id of this tokenizer (0.." +
                                    std::to_string(tok.vocab_size() - 1) + ")");
      }
      ids.push_back(v.get<int32_t>());
    }
    obj["text"] = tok.decode(ids, options.skip_special);
  } else {
    if (!obj.contains("text") || !obj["text"].is_string()) throw std::invalid_argument("missing string \"text\"");
    obj["ids"] = tok.encode(obj["text"].get_ref<const std::string&>(), options.allow_special);
  }
  return obj;
}

}  // namespace

TokenizeJsonlResult tokenize_jsonl(const Tokenizer& tok, const TokenizeJsonlOptions& options, std::istream& in,
                                   std::ostream& out) {
  TokenizeJsonlResult result;
  std::string line;
  size_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    ++result.lines;
    nlohmann::json answer;
    try {
      answer = process_line(tok, options, line);
    } catch (const std::exception& e) {
      ++result.errors;
      answer = {{"line", line_number}, {"error", "line " + std::to_string(line_number) + ": " + e.what()}};
    }
    out << answer.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
  }
  out.flush();
  return result;
}

}  // namespace di
