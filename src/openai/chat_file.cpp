#include "openai/chat_file.h"

#include <fstream>
#include <sstream>

#include "openai/protocol.h"
#include "tokenizer/tokenizer.h"

namespace di::openai {

nlohmann::ordered_json render_chat_request_file(const Tokenizer& tok, const std::string& path,
                                                chat::ChatFormat format) {
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
  ConversionOptions options;
  options.format = format;
  ConversionResult converted = convert_chat_request(body, options);
  if (!converted.ok()) throw std::runtime_error(path + ": " + converted.error->message);
  chat::EncodedPrompt enc = chat::encode_chat(tok, format, converted.request->chat);
  nlohmann::ordered_json out;
  out["format"] = std::string(chat::chat_format_name(format));
  out["prompt"] = enc.prompt.text;
  out["ids"] = enc.ids;
  out["num_tokens"] = enc.ids.size();
  out["thinking"] = converted.request->chat.thinking;
  out["stop"] = converted.request->parser.stop_sequences;
  return out;
}

}  // namespace di::openai
