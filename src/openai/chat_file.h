// `deepinfer tokenize --chat FILE`: an OpenAI-style chat request JSON -> prompt ids and text.
// The server's conversion, so the CLI renders exactly what the API would.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "tokenizer/chat_template.h"

namespace di {
class Tokenizer;
}

namespace di::openai {

// Reads the request at `path`, converts it as the server would and renders it with `format`.
// Returns {"format", "prompt", "ids", "num_tokens", "thinking", "stop"}. Throws std::runtime_error
// naming the file and the offending field.
nlohmann::ordered_json render_chat_request_file(const Tokenizer& tok, const std::string& path,
                                                chat::ChatFormat format);

}  // namespace di::openai
