#include "tokenizer/chat_cli.h"

#include <fstream>
#include <sstream>

#include "tokenizer/openai_protocol.h"
#include "tokenizer/tokenizer.h"

namespace di::chat {

nlohmann::ordered_json render_chat_request_file(const Tokenizer& tok, const std::string& path, ChatFormat format) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open chat request " + path);
  std::ostringstream text;
  text << in.rdbuf();
  nlohmann::ordered_json body;
  try {
    body = nlohmann::ordered_json::parse(text.str());
  } catch (const nlohmann::json::parse_error& e) {
    throw std::runtime_error(path + ": not valid JSON: " + e.what());
  }
  openai::ConversionOptions options;
  options.format = format;
  openai::ConversionResult converted = openai::convert_chat_request(body, options);
  if (!converted.ok()) throw std::runtime_error(path + ": " + converted.error->message);
  EncodedPrompt enc = encode_chat(tok, format, converted.request->chat);
  nlohmann::ordered_json out;
  out["format"] = std::string(chat_format_name(format));
  out["prompt"] = enc.prompt.text;
  out["ids"] = enc.ids;
  out["num_tokens"] = enc.ids.size();
  out["thinking"] = converted.request->chat.thinking;
  out["stop"] = converted.request->parser.stop_sequences;
  return out;
}

}  // namespace di::chat
