// OpenAI HTTP API request validation: JSON body -> what to submit to the engine, or an OpenAI error
// object with its HTTP status and the offending field. Independent of the transport.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "tokenizer/chat_template.h"
#include "io/json_limits.h"
#include "tokenizer/stream_parser.h"
#include "tokenizer/tokenizer.h"

namespace di::grammar {
class CompiledGrammar;
class GrammarCompiler;
}  // namespace di::grammar

namespace di::openai {

// {"error": {"message", "type", "param", "code"}} plus the HTTP status and extra headers.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // "" -> null
  std::string code;   // "" -> null
  std::vector<std::pair<std::string, std::string>> headers;
};

ApiError invalid_param(const std::string& param, const std::string& message, const std::string& code = "invalid_value");
std::string error_body(const ApiError& e);

enum class Endpoint { ChatCompletions, Completions };

// What the server knows about the loaded model.
struct ModelContext {
  std::shared_ptr<const Tokenizer> tokenizer;
  std::string served_name;
  int32_t vocab_size = 0;
  int32_t bos_id = 0, eos_id = 1;
  int64_t max_context = 0;  // prompt + completion
  chat::ChatFormat chat_format = chat::ChatFormat::DeepSeekV41;
  bool default_thinking = false;
  int default_max_tokens = 1024;  // chat, when the request gives none (clamped to the context)
  int max_n = 16;
  bool test_hooks = false;  // accept `test_forced_output`
  JsonLimits json_limits;   // nesting and keys per object in request bodies (400 beyond)
  // Structured output (null: the fields that need them are a 400). `grammars` for response_format
  // and the guided_* fields; `tool_grammars` counts the chat format's tool-call control tokens as
  // text, for forced tool calls only.
  std::shared_ptr<grammar::GrammarCompiler> grammars, tool_grammars;
};

struct GenerationSpec {
  Endpoint endpoint = Endpoint::ChatCompletions;
  std::vector<std::vector<int32_t>> prompts;  // one engine submission each (completions may batch prompts)
  std::vector<std::string> prompt_texts;      // completions, for echo
  engine::SamplingParams sampling;
  int max_tokens = 16;
  int n = 1;
  bool stream = false, include_usage = false;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  std::vector<std::string> stop;                // completions (chat: inside `parser`)
  std::optional<stream::ParserOptions> parser;  // chat
  bool echo = false;
  bool logprobs = false;
  int top_logprobs = 0;
  int priority = 0;
  std::vector<int32_t> forced_output;  // test hook: the tokens every choice emits
  std::shared_ptr<const grammar::CompiledGrammar> grammar;  // constrained decoding, when requested
};

using ParseResult = std::variant<GenerationSpec, ApiError>;

// Sets ctx.grammars and ctx.tool_grammars from ctx.tokenizer (stop token ctx.eos_id; mask_size: the
// model's logit count, which may exceed the tokenizer's ids): once per served model, so every
// request shares their caches of compiled grammars.
void attach_grammar_compilers(ModelContext& ctx, int32_t mask_size);

// Body bytes -> spec. Checks UTF-8, JSON syntax, every field's type and range, the model name (404)
// and the context length.
ParseResult parse_chat_completion(std::string_view body, const ModelContext& ctx);
ParseResult parse_completion(std::string_view body, const ModelContext& ctx);

// vLLM's /tokenize: {"model"?, "prompt", "add_special_tokens"?: true} or {"model"?, "messages", ...chat
// fields} -> {"count", "max_model_len", "tokens", "token_strs"?}. Messages are rendered exactly as
// /v1/chat/completions renders them.
std::variant<std::string, ApiError> tokenize_request(std::string_view body, const ModelContext& ctx);
// vLLM's /detokenize: {"model"?, "tokens": [ids]} -> {"prompt": text}. Ids outside the vocabulary are a 400.
std::variant<std::string, ApiError> detokenize_request(std::string_view body, const ModelContext& ctx);

// The token's text for logprobs (invalid UTF-8 bytes as U+FFFD) and its raw bytes.
std::string token_text(const Tokenizer& tok, int32_t id);

}  // namespace di::openai
