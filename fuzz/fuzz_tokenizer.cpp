// The byte-level BPE tokenizer with the real DeepSeek vocabulary (V4.1 control tokens added).
// Text mode: valid UTF-8 encodes (plain and with control-token recognition) to ids that decode back
// to the same bytes, with the incremental detokenizer agreeing; plain BPE never yields a control
// token; invalid UTF-8 is rejected with std::invalid_argument. Id mode: any id sequence decodes to
// valid UTF-8 and the incremental detokenizer's pieces concatenate to the one-shot decode.
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "tokenizer/text_utf8.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/v41_vocab.h"

using namespace di;

namespace {

const std::shared_ptr<const Tokenizer>& tokenizer() {
  static const std::shared_ptr<const Tokenizer> tok = [] {
    std::ifstream f(fuzz::v3_tokenizer_json());
    if (!f) {
      std::fprintf(stderr, "%s: missing (run scripts/setup)\n", fuzz::v3_tokenizer_json().c_str());
      std::abort();
    }
    return Tokenizer::from_json_text(derive_v41_tokenizer_json(nlohmann::json::parse(f)).dump(), "derived v41");
  }();
  return tok;
}

std::string incremental(const std::vector<int32_t>& ids, bool skip_special) {
  IncrementalDecoder dec(tokenizer(), skip_special);
  std::string out;
  for (int32_t id : ids) {
    const std::string piece = dec.push(id);
    FUZZ_CHECK(utf8::first_invalid_byte(piece) == utf8::kValid, "incremental piece is not valid UTF-8: " + fuzz::show(piece));
    out += piece;
  }
  return out + dec.flush();
}

void text_mode(std::string_view text) {
  const Tokenizer& tok = *tokenizer();
  if (utf8::first_invalid_byte(text) != utf8::kValid) {
    for (bool special : {false, true}) {
      bool threw = false;
      try {
        (void)tok.encode(text, special);
      } catch (const std::invalid_argument&) {
        threw = true;
      }
      FUZZ_CHECK(threw, "invalid UTF-8 was encoded: " + fuzz::show(text));
    }
    return;
  }
  for (bool special : {false, true}) {
    const auto ids = tok.encode(text, special);
    FUZZ_CHECK(text.empty() == ids.empty(), fuzz::show(text));
    for (int32_t id : ids) {
      FUZZ_CHECK(id >= 0 && id < tok.vocab_size(), std::to_string(id));
      if (!special) FUZZ_CHECK(!tok.is_added(id), "plain BPE produced control token " + std::to_string(id) + " for " + fuzz::show(text));
    }
    const std::string back = tok.decode(ids);
    FUZZ_CHECK(back == std::string(text), "decode(encode(x)) = " + fuzz::show(back) + "\n  x = " + fuzz::show(text));
    FUZZ_CHECK(incremental(ids, false) == back, "incremental decode differs for " + fuzz::show(text));
  }
}

void id_mode(std::string_view bytes) {
  const Tokenizer& tok = *tokenizer();
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 3 <= bytes.size(); i += 3) {
    const uint32_t v = uint8_t(bytes[i]) | uint32_t(uint8_t(bytes[i + 1])) << 8 | uint32_t(uint8_t(bytes[i + 2])) << 16;
    ids.push_back(int32_t(v % uint32_t(tok.vocab_size())));
  }
  for (bool skip : {false, true}) {
    const std::string text = tok.decode(ids, skip);
    FUZZ_CHECK(utf8::first_invalid_byte(text) == utf8::kValid, "decode gave invalid UTF-8: " + fuzz::show(text));
    const std::string inc = incremental(ids, skip);
    FUZZ_CHECK(inc == text, "incremental " + fuzz::show(inc) + "\n  one-shot " + fuzz::show(text));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in(data, size);
  if (in.byte() & 1) {
    id_mode(in.rest());
  } else {
    text_mode(in.rest());
  }
  return 0;
}
