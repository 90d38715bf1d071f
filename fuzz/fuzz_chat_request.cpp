// OpenAI request -> prompt ids: the body bytes go through the server's own request validation
// (src/openai/api.cpp: JSON, fields, chat conversion, rendering, tokenization with the real
// V4.1 tokenizer). Properties: client input never escapes as an exception (that is a 500), errors are
// 4xx with a JSON error body, accepted requests have in-range ids within the context, and the prompt
// ids decode to exactly the rendered chat text (completions: to the prompt text after BOS).
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "openai/api.h"
#include "openai/protocol.h"
#include "tokenizer/v41_vocab.h"

using namespace di;

namespace {

std::shared_ptr<const Tokenizer> load_tokenizer() {
  std::ifstream f(fuzz::v3_tokenizer_json());
  if (!f) {
    std::fprintf(stderr, "%s: missing (run scripts/setup)\n", fuzz::v3_tokenizer_json().c_str());
    std::abort();
  }
  const auto v3 = nlohmann::json::parse(f);
  return Tokenizer::from_json_text(derive_v41_tokenizer_json(v3).dump(), "derived v41");
}

const std::shared_ptr<const Tokenizer>& tokenizer() {
  static const auto tok = load_tokenizer();
  return tok;
}

const chat::ChatFormat kFormats[] = {chat::ChatFormat::DeepSeekV41, chat::ChatFormat::DeepSeekV4, chat::ChatFormat::DeepSeekV3,
                                     chat::ChatFormat::DeepSeekV31, chat::ChatFormat::DeepSeekR1};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in(data, size);
  const uint8_t mode = in.byte();
  openai::ModelContext ctx;
  ctx.tokenizer = tokenizer();
  ctx.served_name = "deepinfer-tiny";
  ctx.vocab_size = ctx.tokenizer->vocab_size();
  ctx.bos_id = 0;
  ctx.eos_id = 1;
  static const int64_t kContext[] = {4096, 64, 1 << 20, 200};
  ctx.max_context = kContext[(mode >> 1) & 3];
  ctx.chat_format = kFormats[((mode >> 3) & 7) % 5];
  ctx.default_thinking = mode & 0x40;
  ctx.test_hooks = mode & 0x80;
  const bool chat = !(mode & 1);
  const std::string_view body = in.rest();

  openai::ParseResult r;
  try {
    r = chat ? openai::parse_chat_completion(body, ctx) : openai::parse_completion(body, ctx);
  } catch (const std::exception& e) {
    FUZZ_CHECK(false, std::string("exception escaped request validation (an HTTP 500): ") + e.what() + "\n  body: " + fuzz::show(body));
  }

  if (const auto* err = std::get_if<openai::ApiError>(&r)) {
    FUZZ_CHECK(err->status == 400 || err->status == 404, std::to_string(err->status) + " " + err->message);
    FUZZ_CHECK(!err->message.empty(), "error without a message");
    const auto j = nlohmann::json::parse(openai::error_body(*err), nullptr, false);
    FUZZ_CHECK(j.is_object() && j["error"]["message"].is_string(), openai::error_body(*err));
    return 0;
  }
  const auto& s = std::get<openai::GenerationSpec>(r);
  FUZZ_CHECK(!s.prompts.empty(), "accepted without a prompt");
  FUZZ_CHECK(s.n >= 1 && s.n <= ctx.max_n, std::to_string(s.n));
  FUZZ_CHECK(s.max_tokens >= 1, std::to_string(s.max_tokens));
  for (const auto& p : s.prompts) {
    FUZZ_CHECK(!p.empty(), "empty prompt accepted");
    FUZZ_CHECK(int64_t(p.size()) + s.max_tokens <= ctx.max_context || !s.forced_output.empty(),
               std::to_string(p.size()) + " + " + std::to_string(s.max_tokens) + " > " + std::to_string(ctx.max_context));
    for (int32_t id : p) FUZZ_CHECK(id >= 0 && id < ctx.vocab_size, std::to_string(id));
  }
  for (int32_t id : s.stop_token_ids) FUZZ_CHECK(id >= 0 && id < ctx.vocab_size, std::to_string(id));
  for (const auto& [id, bias] : s.sampling.logit_bias) FUZZ_CHECK(id >= 0 && id < ctx.vocab_size, std::to_string(id));

  if (chat) {
    // Round trip: the ids are the tokenization of the rendered prompt text.
    FUZZ_CHECK(s.prompts.size() == 1 && s.parser.has_value(), "chat spec shape");
    const auto body_json = nlohmann::ordered_json::parse(body);
    openai::ConversionOptions copt;
    copt.format = ctx.chat_format;
    copt.default_thinking = ctx.default_thinking;
    const auto conv = openai::convert_chat_request(body_json, copt);
    FUZZ_CHECK(conv.ok(), "accepted request fails conversion on its own");
    const auto rendered = chat::render_chat(ctx.chat_format, conv.request->chat);
    const std::string decoded = ctx.tokenizer->decode(s.prompts[0]);
    FUZZ_CHECK(decoded == rendered.text, "decode(ids) = " + fuzz::show(decoded) + "\n  rendered = " + fuzz::show(rendered.text));
  } else {
    FUZZ_CHECK(s.prompts.size() == s.prompt_texts.size(), "prompt texts");
    const std::string bos = ctx.tokenizer->decode({ctx.bos_id});
    for (size_t i = 0; i < s.prompts.size(); ++i) {
      const std::string decoded = ctx.tokenizer->decode(s.prompts[i]);
      const std::string& text = s.prompt_texts[i];
      FUZZ_CHECK(decoded == text || decoded == bos + text, "decode(ids) = " + fuzz::show(decoded) + "\n  prompt = " + fuzz::show(text));
    }
    for (const auto& stop : s.stop) FUZZ_CHECK(!stop.empty(), "empty stop string accepted");
  }
  return 0;
}
