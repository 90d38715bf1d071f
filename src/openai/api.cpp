#include "openai/api.h"

#include <cmath>
#include <limits>

#include "grammar/grammar_compiler.h"
#include "grammar/tool_calls.h"
#include "openai/protocol.h"
#include "tokenizer/text_utf8.h"

namespace di::openai {
namespace {

using ojson = nlohmann::ordered_json;

struct Reject {
  ApiError error;
};

[[noreturn]] void reject(const std::string& param, const std::string& what, const std::string& code = "invalid_value") {
  throw Reject{invalid_param(param, param + ": " + what, code)};
}

const ojson* member(const ojson& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> get_bool(const ojson& body, const char* key) {
  const ojson* v = member(body, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) reject(key, std::string("must be a boolean, got ") + v->type_name(), "invalid_type");
  return v->get<bool>();
}

std::optional<double> get_number(const ojson& body, const char* key, double lo, double hi) {
  const ojson* v = member(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) reject(key, std::string("must be a number, got ") + v->type_name(), "invalid_type");
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%g is out of range [%g, %g]", x, lo, hi);
    reject(key, buf);
  }
  return x;
}

std::optional<int64_t> get_int(const ojson& body, const char* key, int64_t lo, int64_t hi) {
  const ojson* v = member(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) reject(key, std::string("must be an integer, got ") + v->type_name(), "invalid_type");
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
    reject(key, "is out of range");
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi) reject(key, std::to_string(x) + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

ojson parse_body(std::string_view body, const JsonLimits& limits) {
  const size_t bad = utf8::first_invalid_byte(body);
  if (bad != utf8::kValid)
    throw Reject{invalid_param("", "request body is not valid UTF-8 (byte offset " + std::to_string(bad) + ")", "invalid_utf8")};
  ojson j;
  if (auto err = parse_json_limited(body, limits, j)) {
    switch (err->kind) {
      case JsonLimitError::Kind::Syntax:
        throw Reject{invalid_param("", "request body is not valid JSON: " + err->message, "invalid_json")};
      case JsonLimitError::Kind::Depth:
        throw Reject{invalid_param(err->path, "request body: " + err->message + (err->path.empty() ? "" : " at " + err->path) +
                                                  " (the server's limit, --max-json-depth)",
                                   "json_too_deep")};
      case JsonLimitError::Kind::Keys:
        throw Reject{invalid_param(err->path, "request body: " + err->message + (err->path.empty() ? "" : " at " + err->path) +
                                                  " (the server's limit, --max-json-keys)",
                                   "json_too_many_keys")};
    }
  }
  if (!j.is_object()) throw Reject{invalid_param("", std::string("request body must be a JSON object, got ") + j.type_name(), "invalid_json")};
  return j;
}

void check_model(const ojson& body, const ModelContext& ctx) {
  const ojson* m = member(body, "model");
  if (!m) return;  // lenient: the only model
  if (!m->is_string()) reject("model", std::string("must be a string, got ") + m->type_name(), "invalid_type");
  const std::string name = m->get<std::string>();
  if (name != ctx.served_name) {
    ApiError e;
    e.status = 404;
    e.param = "model";
    e.code = "model_not_found";
    e.message = "The model `" + name + "` does not exist (this server serves `" + ctx.served_name + "`).";
    throw Reject{e};
  }
}

// Fields shared by both endpoints.
void read_common(const ojson& body, const ModelContext& ctx, GenerationSpec& s) {
  check_model(body, ctx);
  s.stream = get_bool(body, "stream").value_or(false);
  if (const ojson* so = member(body, "stream_options")) {
    if (!so->is_object()) reject("stream_options", "must be an object", "invalid_type");
    if (!s.stream) reject("stream_options", "is only allowed when stream is true");
    if (const ojson* iu = member(*so, "include_usage")) {
      if (!iu->is_boolean()) reject("stream_options.include_usage", "must be a boolean", "invalid_type");
      s.include_usage = iu->get<bool>();
    }
  }
  s.n = int(get_int(body, "n", 1, ctx.max_n).value_or(1));
  auto& p = s.sampling;
  p.temperature = float(get_number(body, "temperature", 0, 2).value_or(1.0));
  if (auto top_p = get_number(body, "top_p", 0, 1)) {
    // top_p 0 keeps only the most likely token.
    if (*top_p == 0) p.temperature = 0;
    else p.top_p = float(*top_p);
  }
  if (auto k = get_int(body, "top_k", -1, std::numeric_limits<int32_t>::max())) p.top_k = *k < 0 ? 0 : int(*k);
  if (auto v = get_number(body, "min_p", 0, 1)) p.min_p = float(*v);
  if (auto v = get_number(body, "presence_penalty", -2, 2)) p.presence_penalty = float(*v);
  if (auto v = get_number(body, "frequency_penalty", -2, 2)) p.frequency_penalty = float(*v);
  if (auto v = get_number(body, "repetition_penalty", 1e-6, 100)) p.repetition_penalty = float(*v);
  if (const ojson* seed = member(body, "seed")) {
    if (!seed->is_number_integer()) reject("seed", std::string("must be an integer, got ") + seed->type_name(), "invalid_type");
    p.seed = seed->is_number_unsigned() ? seed->get<uint64_t>() : uint64_t(seed->get<int64_t>());
  }
  if (const ojson* lb = member(body, "logit_bias")) {
    if (!lb->is_object()) reject("logit_bias", "must be an object mapping token ids to biases", "invalid_type");
    for (auto it = lb->begin(); it != lb->end(); ++it) {
      const std::string& key = it.key();
      const std::string f = "logit_bias." + key;
      size_t used = 0;
      long long id = -1;
      try {
        id = std::stoll(key, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (key.empty() || used != key.size()) reject(f, "key must be a token id");
      if (id < 0 || id >= ctx.vocab_size) reject(f, "token id out of range [0, " + std::to_string(ctx.vocab_size) + ")");
      if (!it->is_number()) reject(f, "bias must be a number", "invalid_type");
      const double b = it->get<double>();
      if (!(b >= -100 && b <= 100)) reject(f, "bias must be in [-100, 100]");
      p.logit_bias.emplace_back(int32_t(id), float(b));
    }
  }
  s.ignore_eos = get_bool(body, "ignore_eos").value_or(false);
  if (const ojson* ids = member(body, "stop_token_ids")) {
    if (!ids->is_array()) reject("stop_token_ids", "must be an array of token ids", "invalid_type");
    for (size_t i = 0; i < ids->size(); ++i) {
      const ojson& v = (*ids)[i];
      const std::string f = "stop_token_ids[" + std::to_string(i) + "]";
      if (!v.is_number_integer()) reject(f, "must be an integer", "invalid_type");
      const int64_t id = v.get<int64_t>();
      if (id < 0 || id >= ctx.vocab_size) reject(f, "token id out of range");
      s.stop_token_ids.push_back(int32_t(id));
    }
  }
  s.priority = int(get_int(body, "priority", -1000000, 1000000).value_or(0));
  if (const ojson* u = member(body, "user"))
    if (!u->is_string()) reject("user", "must be a string", "invalid_type");
  if (const ojson* forced = member(body, "test_forced_output")) {
    if (!ctx.test_hooks) reject("test_forced_output", "is a test hook; start the server with --enable-test-hooks");
    if (!forced->is_string()) reject("test_forced_output", "must be a string", "invalid_type");
    s.forced_output = ctx.tokenizer->encode(forced->get<std::string>(), true);
    if (s.forced_output.empty()) reject("test_forced_output", "must not be empty");
  }
}

grammar::JsonSchemaOptions server_json_options() {
  grammar::JsonSchemaOptions o;
  // Compact JSON: a grammar that allows any whitespace run lets a model pad forever.
  o.any_whitespace = false;
  return o;
}

grammar::ToolCallFormat tool_call_format(chat::ChatFormat f) {
  switch (f) {
    case chat::ChatFormat::DeepSeekV41: return grammar::ToolCallFormat::kDsmlV41;
    case chat::ChatFormat::DeepSeekV4: return grammar::ToolCallFormat::kDsmlV4;
    case chat::ChatFormat::DeepSeekV31: return grammar::ToolCallFormat::kV31;
    case chat::ChatFormat::DeepSeekV3:
    case chat::ChatFormat::DeepSeekR1: return grammar::ToolCallFormat::kV3;
  }
  return grammar::ToolCallFormat::kV3;
}

// The request's grammar from response_format / a forced tool call (chat, already read into
// `chat_so`) or vLLM's guided_json / guided_regex / guided_grammar; at most one of them.
void read_structured(const ojson& body, const ModelContext& ctx, GenerationSpec& s, const StructuredOutput* chat_so,
                     const std::vector<chat::ToolDefinition>* tools, chat::ChatFormat format) {
  std::vector<std::string> given;
  if (chat_so && chat_so->kind != StructuredOutput::Kind::None) given.push_back(chat_so->field);
  for (const char* f : {"guided_json", "guided_regex", "guided_grammar"})
    if (member(body, f)) given.emplace_back(f);
  if (given.empty()) return;
  if (given.size() > 1) reject(given[1], "cannot be combined with " + given[0] + " (one output constraint per request)");
  const std::string& field = given[0];
  if (!ctx.grammars) reject(field, "structured output is not available on this server");
  const grammar::JsonSchemaOptions jo = server_json_options();
  try {
    if (chat_so && chat_so->kind == StructuredOutput::Kind::JsonObject) {
      s.grammar = ctx.grammars->json_object(jo);
    } else if (chat_so && chat_so->kind == StructuredOutput::Kind::JsonSchema) {
      s.grammar = ctx.grammars->json_schema(chat_so->schema.dump(), jo);
    } else if (chat_so && chat_so->kind == StructuredOutput::Kind::ToolCall) {
      if (!ctx.tool_grammars) reject(field, "forced tool calls are not available on this server");
      grammar::ToolCallGrammarOptions to;
      to.format = tool_call_format(format);
      to.parallel = chat_so->parallel_tool_calls;
      // V4.x prompts of tool_choice "required" end with the calls-block opener.
      to.opener_in_prompt = to.format == grammar::ToolCallFormat::kDsmlV41 || to.format == grammar::ToolCallFormat::kDsmlV4;
      to.json = jo;
      std::vector<grammar::ToolSpec> specs;
      ojson key_tools = ojson::array();
      for (const auto& t : *tools) {
        specs.push_back({t.name, t.parameters});
        key_tools.push_back(ojson{{"name", t.name}, {"parameters", t.parameters}});
      }
      const std::string key = "tools:" + std::to_string(int(to.format)) + (to.parallel ? ":n:" : ":1:") + key_tools.dump();
      s.grammar = ctx.tool_grammars->get(key, [&] { return grammar::tool_call_grammar(specs, to).grammar; });
    } else if (const ojson* gj = member(body, "guided_json")) {
      if (gj->is_string()) s.grammar = ctx.grammars->json_schema(gj->get<std::string>(), jo);
      else if (gj->is_object()) s.grammar = ctx.grammars->json_schema(gj->dump(), jo);
      else reject("guided_json", "must be a JSON Schema (object or string)", "invalid_type");
    } else if (const ojson* gr = member(body, "guided_regex")) {
      if (!gr->is_string()) reject("guided_regex", "must be a string", "invalid_type");
      s.grammar = ctx.grammars->regex(gr->get<std::string>());
    } else if (const ojson* gg = member(body, "guided_grammar")) {
      if (!gg->is_string()) reject("guided_grammar", "must be a string", "invalid_type");
      s.grammar = ctx.grammars->ebnf(gg->get<std::string>());
    }
  } catch (const grammar::GrammarError& e) {
    reject(field, e.what());
  }
}

// max_tokens against the context: an explicit value that does not fit is an error, a default is clamped.
void fit_context(GenerationSpec& s, const ModelContext& ctx, std::optional<int64_t> requested, const char* max_field,
                 const char* prompt_field) {
  size_t longest = 0;
  for (const auto& p : s.prompts) longest = std::max(longest, p.size());
  const int64_t P = int64_t(longest);
  if (P >= ctx.max_context) {
    throw Reject{invalid_param(prompt_field,
                               std::string(prompt_field) + ": the prompt has " + std::to_string(P) +
                                   " tokens; this model's maximum context length is " + std::to_string(ctx.max_context) +
                                   " tokens (prompt + completion)",
                               "context_length_exceeded")};
  }
  if (requested) {
    if (P + *requested > ctx.max_context)
      throw Reject{invalid_param(max_field,
                                 std::string(max_field) + ": this model's maximum context length is " +
                                     std::to_string(ctx.max_context) + " tokens; you requested " +
                                     std::to_string(P + *requested) + " tokens (" + std::to_string(P) + " in the prompt, " +
                                     std::to_string(*requested) + " for the completion)",
                                 "context_length_exceeded")};
    s.max_tokens = int(*requested);
  } else {
    s.max_tokens = int(std::min<int64_t>(s.max_tokens, ctx.max_context - P));
  }
  if (!s.forced_output.empty()) s.max_tokens = int(s.forced_output.size());
}

std::vector<int32_t> token_array(const ojson& arr, const std::string& field, const ModelContext& ctx) {
  std::vector<int32_t> ids;
  ids.reserve(arr.size());
  for (size_t i = 0; i < arr.size(); ++i) {
    const ojson& v = arr[i];
    const std::string f = field + "[" + std::to_string(i) + "]";
    if (!v.is_number_integer()) reject(f, "token ids must be integers", "invalid_type");
    const int64_t id = v.get<int64_t>();
    if (id < 0 || id >= ctx.vocab_size) reject(f, "token id " + std::to_string(id) + " out of range [0, " + std::to_string(ctx.vocab_size) + ")");
    ids.push_back(int32_t(id));
  }
  if (ids.empty()) reject(field, "must not be empty");
  return ids;
}

std::vector<int32_t> encode_text_prompt(const std::string& text, const std::string& field, const ModelContext& ctx) {
  std::vector<int32_t> ids = ctx.tokenizer->encode(text, true);
  // Like Hugging Face's add_special_tokens: BOS first, unless the text already starts with it.
  if (ids.empty() || ids.front() != ctx.bos_id) ids.insert(ids.begin(), ctx.bos_id);
  return ids;
}

template <class Fn>
ParseResult guarded(Fn&& fn) {
  try {
    return fn();
  } catch (const Reject& r) {
    return r.error;
  }
}

}  // namespace

ApiError invalid_param(const std::string& param, const std::string& message, const std::string& code) {
  ApiError e;
  e.status = 400;
  e.param = param;
  e.message = message;
  e.code = code;
  return e;
}

std::string error_body(const ApiError& e) {
  ojson j;
  j["error"]["message"] = e.message;
  j["error"]["type"] = e.type;
  j["error"]["param"] = e.param.empty() ? ojson(nullptr) : ojson(e.param);
  j["error"]["code"] = e.code.empty() ? ojson(nullptr) : ojson(e.code);
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string token_text(const Tokenizer& tok, int32_t id) { return utf8::decode_lossy(tok.token_bytes_view(id)); }

// The chat fields of `body` in the served model's chat format (a 400 naming the field otherwise).
static openai::ConvertedRequest convert_chat(const ojson& body, const ModelContext& ctx) {
  openai::ConversionOptions copt;
  copt.format = ctx.chat_format;
  copt.default_thinking = ctx.default_thinking;
  copt.json_limits = ctx.json_limits;
  auto conv = openai::convert_chat_request(body, copt);
  if (!conv.ok()) throw Reject{invalid_param(conv.error->field, conv.error->message)};
  return std::move(*conv.request);
}

void attach_grammar_compilers(ModelContext& ctx, int32_t mask_size) {
  if (!ctx.tokenizer) return;
  grammar::VocabularyOptions vo;
  vo.mask_size = mask_size;
  vo.stop_ids = {ctx.eos_id};
  ctx.grammars = std::make_shared<grammar::GrammarCompiler>(grammar::Vocabulary::from_tokenizer(*ctx.tokenizer, vo));
  // The control tokens the chat format's tool calls spell count as text in a vocabulary of their
  // own: in the other one they must never appear (e.g. inside a JSON string).
  grammar::ToolCallGrammarOptions to;
  to.format = tool_call_format(ctx.chat_format);
  for (const std::string& text : grammar::tool_call_grammar({grammar::ToolSpec{"f", nullptr}}, to).control_tokens)
    if (auto id = ctx.tokenizer->token_to_id(text)) vo.text_added_ids.push_back(*id);
  ctx.tool_grammars = std::make_shared<grammar::GrammarCompiler>(grammar::Vocabulary::from_tokenizer(*ctx.tokenizer, vo));
}

ParseResult parse_chat_completion(std::string_view raw, const ModelContext& ctx) {
  return guarded([&]() -> ParseResult {
    const ojson body = parse_body(raw, ctx.json_limits);
    GenerationSpec s;
    s.endpoint = Endpoint::ChatCompletions;
    for (const char* unsupported : {"functions", "function_call", "audio", "prediction"})
      if (member(body, unsupported)) reject(unsupported, "is not supported by this server");
    if (const ojson* mod = member(body, "modalities")) {
      if (!mod->is_array()) reject("modalities", "must be an array", "invalid_type");
      for (const auto& m : *mod)
        if (m != "text") reject("modalities", "only \"text\" is supported");
    }
    read_common(body, ctx, s);
    s.max_tokens = ctx.default_max_tokens;
    std::optional<int64_t> max_tokens = get_int(body, "max_tokens", 1, std::numeric_limits<int32_t>::max());
    const char* max_field = "max_tokens";
    if (auto mct = get_int(body, "max_completion_tokens", 1, std::numeric_limits<int32_t>::max())) {
      max_tokens = mct;
      max_field = "max_completion_tokens";
    }
    s.logprobs = get_bool(body, "logprobs").value_or(false);
    if (auto k = get_int(body, "top_logprobs", 0, 20)) {
      if (!s.logprobs) reject("top_logprobs", "requires logprobs to be true");
      s.top_logprobs = int(*k);
    }
    if (s.logprobs) {
      s.sampling.logprobs = 1;
      s.sampling.top_logprobs = s.top_logprobs;
    }

    auto conv = convert_chat(body, ctx);
    read_structured(body, ctx, s, &conv.structured, &conv.chat.tools, ctx.chat_format);
    s.prompts.push_back(chat::encode_chat(*ctx.tokenizer, ctx.chat_format, conv.chat).ids);
    s.parser = std::move(conv.parser);
    fit_context(s, ctx, max_tokens, max_field, "messages");
    return s;
  });
}

ParseResult parse_completion(std::string_view raw, const ModelContext& ctx) {
  return guarded([&]() -> ParseResult {
    const ojson body = parse_body(raw, ctx.json_limits);
    GenerationSpec s;
    s.endpoint = Endpoint::Completions;
    if (const ojson* suffix = member(body, "suffix")) {
      if (!suffix->is_string() || !suffix->get<std::string>().empty()) reject("suffix", "is not supported by this server");
    }
    read_common(body, ctx, s);
    if (auto best_of = get_int(body, "best_of", 1, ctx.max_n); best_of && *best_of != s.n)
      reject("best_of", "only best_of = n is supported");
    s.max_tokens = 16;  // OpenAI's default for completions
    std::optional<int64_t> max_tokens = get_int(body, "max_tokens", 1, std::numeric_limits<int32_t>::max());
    s.echo = get_bool(body, "echo").value_or(false);
    if (auto lp = get_int(body, "logprobs", 0, 20)) {
      s.logprobs = true;
      s.top_logprobs = int(*lp);
      s.sampling.logprobs = 1;
      s.sampling.top_logprobs = s.top_logprobs;
    }
    if (s.echo && s.logprobs) reject("echo", "echo with logprobs needs prompt logprobs, which this server does not compute");
    read_structured(body, ctx, s, nullptr, nullptr, ctx.chat_format);

    const ojson* prompt = member(body, "prompt");
    if (!prompt) reject("prompt", "is required");
    if (prompt->is_string()) {
      s.prompt_texts.push_back(prompt->get<std::string>());
      s.prompts.push_back(encode_text_prompt(s.prompt_texts.back(), "prompt", ctx));
    } else if (prompt->is_array()) {
      if (prompt->empty()) reject("prompt", "must not be empty");
      const ojson& first = (*prompt)[0];
      if (first.is_number_integer()) {
        s.prompts.push_back(token_array(*prompt, "prompt", ctx));
        s.prompt_texts.push_back(ctx.tokenizer->decode(s.prompts.back()));
      } else {
        for (size_t i = 0; i < prompt->size(); ++i) {
          const ojson& p = (*prompt)[i];
          const std::string f = "prompt[" + std::to_string(i) + "]";
          if (p.is_string()) {
            s.prompt_texts.push_back(p.get<std::string>());
            s.prompts.push_back(encode_text_prompt(s.prompt_texts.back(), f, ctx));
          } else if (p.is_array()) {
            s.prompts.push_back(token_array(p, f, ctx));
            s.prompt_texts.push_back(ctx.tokenizer->decode(s.prompts.back()));
          } else {
            reject(f, "must be a string or an array of token ids", "invalid_type");
          }
        }
      }
      if (s.prompts.size() * size_t(s.n) > size_t(ctx.max_n) * 8)
        reject("prompt", "too many prompts x n (at most " + std::to_string(ctx.max_n * 8) + " choices)");
    } else {
      reject("prompt", std::string("must be a string, an array of strings or token ids, got ") + prompt->type_name(), "invalid_type");
    }
    for (const auto& text : s.prompt_texts)
      if (text.empty()) reject("prompt", "must not be empty");

    if (const ojson* st = member(body, "stop")) {
      if (st->is_string()) {
        s.stop.push_back(st->get<std::string>());
      } else if (st->is_array()) {
        if (st->size() > 16) reject("stop", "at most 16 stop sequences");
        for (size_t i = 0; i < st->size(); ++i) {
          if (!(*st)[i].is_string()) reject("stop[" + std::to_string(i) + "]", "must be a string", "invalid_type");
          s.stop.push_back((*st)[i].get<std::string>());
        }
      } else {
        reject("stop", "must be a string or an array of strings", "invalid_type");
      }
      // An empty stop string would match before any output: a 400, as vLLM answers (chat agrees).
      for (size_t i = 0; i < s.stop.size(); ++i)
        if (s.stop[i].empty()) reject(st->is_string() ? std::string("stop") : "stop[" + std::to_string(i) + "]", "must not be an empty string");
    }
    fit_context(s, ctx, max_tokens, "max_tokens", "prompt");
    return s;
  });
}

std::variant<std::string, ApiError> tokenize_request(std::string_view raw, const ModelContext& ctx) {
  try {
    const ojson body = parse_body(raw, ctx.json_limits);
    check_model(body, ctx);
    const bool token_strs = get_bool(body, "return_token_strs").value_or(false);
    std::vector<int32_t> ids;
    const ojson* prompt = member(body, "prompt");
    const ojson* messages = member(body, "messages");
    if (prompt && messages) reject("prompt", "give either prompt or messages, not both");
    if (prompt) {
      if (!prompt->is_string()) reject("prompt", std::string("must be a string, got ") + prompt->type_name(), "invalid_type");
      const std::string text = prompt->get<std::string>();
      // vLLM's default: add_special_tokens true (BOS first, as /v1/completions encodes a prompt).
      if (get_bool(body, "add_special_tokens").value_or(true)) {
        ids = encode_text_prompt(text, "prompt", ctx);
      } else {
        ids = ctx.tokenizer->encode(text, true);
      }
    } else if (messages) {
      ids = chat::encode_chat(*ctx.tokenizer, ctx.chat_format, convert_chat(body, ctx).chat).ids;
    } else {
      reject("prompt", "is required (or messages)");
    }
    std::string out = R"({"count":)" + std::to_string(ids.size()) + R"(,"max_model_len":)" + std::to_string(ctx.max_context) +
                      R"(,"tokens":[)";
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) out += ',';
      out += std::to_string(ids[i]);
    }
    out += ']';
    if (token_strs) {
      ojson strs = ojson::array();
      for (int32_t id : ids) strs.push_back(token_text(*ctx.tokenizer, id));
      out += R"(,"token_strs":)" + strs.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
    out += '}';
    return out;
  } catch (const Reject& r) {
    return r.error;
  }
}

std::variant<std::string, ApiError> detokenize_request(std::string_view raw, const ModelContext& ctx) {
  try {
    const ojson body = parse_body(raw, ctx.json_limits);
    check_model(body, ctx);
    const ojson* tokens = member(body, "tokens");
    if (!tokens) reject("tokens", "is required");
    if (!tokens->is_array()) reject("tokens", std::string("must be an array of token ids, got ") + tokens->type_name(), "invalid_type");
    std::vector<int32_t> ids;
    if (!tokens->empty()) ids = token_array(*tokens, "tokens", ctx);
    ojson out = {{"prompt", ctx.tokenizer->decode(ids)}};
    return out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } catch (const Reject& r) {
    return r.error;
  }
}

}  // namespace di::openai
